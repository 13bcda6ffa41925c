"""The over-optimisation curve in words (notebook 04's `eval_overoptimisation` and its fits):
where the proxy and the gold reward part ways, every verdict read from an interval. The words are
the author's, in `reports/templates/overopt.jinja`; here, the numbers and verdicts they need."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from rlxf_utils.artifacts import RunDir
from rlxf_utils.evaluation.curves import FINISHED
from rlxf_utils.markdown import is_present
from rlxf_utils.report.evaluation import table_note
from rlxf_utils.report.gold import ceiling, gold_auc, gold_cannot_judge
from rlxf_utils.report.wording import EQUIVALENT, sentence, table
from rlxf_utils.stats import bound_verdict, level

#: The section's sentences (the report's variables), each a macro of the template.
SENTENCES = ("sentence", "fit_sentence", "distinct_sentence", "budget_sentence")


def point(r: pd.Series, margin: float | None = None, gold: dict[str, Any] | None = None) -> dict:
    """One point's gains under the proxy and the gold with their intervals, whether each lies
    within ±`margin` (`equivalent`) and whether the gold, at chance on held-out rows (`gold`:
    `report.gold.gold_auc`), can neither confirm nor refute a gain there (`cannot_judge`)."""
    out: dict[str, Any] = {}
    for key in ("proxy", "gold"):
        low, high = r[f"{key}_low"], r[f"{key}_high"]
        out[key] = {"est": r[key], "low": low, "high": high,
                    "equivalent": bound_verdict(low, high, margin) == EQUIVALENT}  # fmt: skip
    out["gold"]["cannot_judge"] = gold_cannot_judge(gold, out["gold"]["low"], out["gold"]["high"])
    return out


def _finite(v: Any) -> float | None:
    return float(v) if is_present(v) and math.isfinite(v) else None


def curve(pts: pd.DataFrame, margin: float | None, gold: dict[str, Any] | None) -> list[dict]:
    """The points the sentence reads: best-of-n's farthest, then each method's farthest point
    (its final policy, or the snapshot of step `point`)."""
    bon = pts[pts["method"] == "best_of_n"].sort_values("point")
    rows = [(True, bon.iloc[-1])] if len(bon) > 1 else []
    rows += [(False, g.loc[g["sqrt_kl"].idxmax()])
             for _, g in pts[pts["method"] != "best_of_n"].groupby("method", sort=False)]  # fmt: skip
    return [{"best_of_n": b, "label": r.get("label"), "point": int(r["point"]),
             "final": r.get("source") == "final", "sqrt_kl": r["sqrt_kl"],
             **point(r, margin, gold)} for b, r in rows]  # fmt: skip


def budget_context(run: RunDir, stage: str, span: float | None = None) -> dict[str, Any] | None:
    """What the KL-budget sentence reads (`evaluation.curves`): per budget, the methods read there
    (`reaching`), those whose curves do not reach it (`missing`) and those that pass it with no
    point near it (`far`), and per judge the pairs compared, their family's level and the pairs an interval distinguishes
    (`policy`, `versus`, `est`, `low`, `high`) or, where none is, the largest difference any
    interval allows (`widest`); `finished`, where the run read the finished share beside the
    gains (None before it did), the methods whose finished share there an interval puts below
    the start policy's (`method`, `est`, `low`, `high`); `span`, the run's
    `evaluation.kl_budget_span`, as the sentence names it. None for a run from before the
    budgets."""
    if not run.exists("tables/eval_kl_budget_gains.csv"):
        return None
    gains = run.read_table("eval_kl_budget_gains", stage)
    pairs = run.read_table("eval_kl_budget_pairs", stage)
    out = []
    for b, g in gains.groupby("budget", sort=True):
        first = g[g["measure"] == g["measure"].iloc[0]]
        reach = first["reaches"].astype(str).str.lower().eq("true")
        read = first["near"].astype(str).str.lower().eq("true") if "near" in first else reach
        rec = {"budget": float(b), "reaching": first.loc[read, "method"].tolist(),
               "missing": first.loc[~reach, "method"].tolist(),
               "far": first.loc[reach & ~read, "method"].tolist(), "judges": []}  # fmt: skip
        fin = g[g["measure"] == FINISHED]
        rec["finished"] = (
            [{"method": r.method, "est": r.gain, "low": r.low, "high": r.high}
             for r in fin[fin["high"] < 0].itertuples()] if len(fin) else None
        )  # fmt: skip
        for measure in [m for m in dict.fromkeys(g["measure"]) if m != FINISHED]:
            p = pairs[(pairs["budget"] == b) & (pairs["measure"] == measure)]
            apart = p[(p["low"] > 0) | (p["high"] < 0)]
            widest = float(np.nanmax(np.abs(p[["low", "high"]].to_numpy()))) if len(p) else None
            rec["judges"].append({
                "measure": measure, "pairs": len(p),
                "level": float(p["ci_level"].iloc[0]) if len(p) else None,
                "apart": [{"policy": r.policy, "versus": r.versus, "est": r.diff, "low": r.low,
                           "high": r.high} for r in apart.itertuples()],
                "widest": widest})  # fmt: skip
        out.append(rec)
    return {"budgets": out, "span": span}


def overopt_section(run: RunDir) -> tuple[dict[str, Any], dict[str, str]]:
    """Variables (`sentence`, `fit_sentence`, `distinct_sentence`, `level`) and the fit table."""
    stage = "notebook 04_evaluation"
    meta = run.read_json("eval/summary.json", stage=stage)
    alpha = meta.get("alpha", 0.05)
    if not run.exists("tables/eval_overoptimisation.csv"):
        note = sentence("overopt", "predates", stage)
        return (
            {**dict.fromkeys(SENTENCES, note), "level": level(alpha)},
            {"eval_overoptimisation_fit.md": table_note(note),
             "eval_kl_budget_reach.md": table_note(note)},
        )  # fmt: skip
    pts = run.read_table("eval_overoptimisation", stage)
    fits = run.read_table("eval_overoptimisation_fit", stage)
    if "ci_level" in pts and pts["ci_level"].notna().any():  # the vs-start family's level
        alpha = 1 - float(pts["ci_level"].dropna().iloc[0])
    margin = meta.get("equivalence_margin")
    gold = gold_auc(run)
    info = meta.get("overoptimisation", {})
    fitted = [{**f, "alpha": _finite(f["alpha"]), "beta": _finite(f["beta"]),
               "beta_low": _finite(f.get("beta_low")), "points": int(f["points"]),
               "method": f.get("method", f["family"])}
              for f in fits.to_dict("records") if _finite(f["alpha"]) is not None]  # fmt: skip
    context = {
        "sentence": {"start": meta.get("start_policy", "sft"), "alpha": alpha, "margin": margin,
                     "points": curve(pts, margin, gold), "gold": gold, "ceiling": ceiling(run)},
        "fit_sentence": fitted,
        "budget_sentence": budget_context(run, stage, meta.get("kl_budget_span")),
        "distinct_sentence": {"candidates": info.get("candidates_per_prompt", 0),
                              "distinct": info.get("prompts_all_distinct"),
                              "fraction": info.get("distinct_fraction")},
    }  # fmt: skip
    if not is_present(context["distinct_sentence"]["distinct"]):
        context["distinct_sentence"]["distinct"] = None
    macros = {"sentence": "curve_sentence"}
    variables = {k: sentence("overopt", macros.get(k, k), v) for k, v in context.items()}
    return (
        {**variables, "level": level(alpha)},
        {
            "eval_overoptimisation_fit.md": table(
                "eval_overoptimisation_fit", fits, finite=_finite
            ),
            "eval_kl_budget_reach.md": budget_table(run, stage),
        },  # fmt: skip
    )


def budget_table(run: RunDir, stage: str) -> str:
    """The KL budgets' reach: per budget, the methods reaching it, those not, and per judge the
    pairs compared and distinguished (a note for a run from before the budgets)."""
    if not run.exists("tables/eval_kl_budget_reach.csv"):
        return table_note(sentence("overopt", "predates", stage))
    return table("eval_kl_budget_reach", run.read_table("eval_kl_budget_reach", stage))
