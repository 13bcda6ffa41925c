"""The over-optimisation curve in words (notebook 04's `eval_overoptimisation` and its fits):
where the proxy and the gold reward part ways, every verdict read from an interval."""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from rlxf_utils.artifacts import RunDir
from rlxf_utils.report.evaluation import null_clause, table_note
from rlxf_utils.report.gold import ceiling_sentence, gold_auc, gold_auc_words, gold_cannot_judge
from rlxf_utils.report.wording import ci, is_present, listing, markdown_table, say
from rlxf_utils.stats import level


def _pair(r: pd.Series, margin: float | None = None, gold: dict[str, Any] | None = None) -> str:
    """'<verb> the proxy (x [a, b]) and <verb> the gold (y [c, d])', each verb from its interval;
    a null says how large a gain it leaves open (`null_clause`: 'a gain of at most +0.004',
    equivalence within the margin). A null under a gold whose own AUC on held-out rows does not
    lie above chance (`gold`: `report.gold.gold_auc`) is no 'did not move': the gold can neither
    confirm nor refute a gain."""
    parts, join = [], " and "
    for key, who in (("proxy", "the proxy"), ("gold", "the gold")):
        low, high = r[f"{key}_low"], r[f"{key}_high"]
        verb = say("move", low, high)
        bound = null_clause(low, high, margin)
        shown = f"{ci(r[key], low, high, signed=True)}{'; ' + bound if bound else ''}"
        if key == "gold" and gold_cannot_judge(gold, low, high):
            parts.append(f"the gold can neither confirm nor refute a gain ({shown})")
            join = ", while "
        else:
            parts.append(f"{verb} {who} ({shown})")
    return join.join(parts)


def _coef(value: float, se: float) -> str:
    return "·" if not is_present(value) or not math.isfinite(value) else f"{value:+.3f} ± {se:.3f}"


def overopt_section(run: RunDir) -> tuple[dict[str, Any], dict[str, str]]:
    """Variables (`sentence`, `fit_sentence`, `distinct_sentence`, `level`) and the fit table."""
    stage = "notebook 04_evaluation"
    meta = run.read_json("eval/summary.json", stage=stage)
    lvl = level(meta.get("alpha", 0.05))
    margin = meta.get("equivalence_margin")
    start = meta.get("start_policy", "sft")
    if not run.exists("tables/eval_overoptimisation.csv"):
        note = f"This run directory predates the over-optimisation curve; rerun {stage}"
        return (
            {"sentence": note, "fit_sentence": note, "distinct_sentence": note, "level": lvl},
            {"eval_overoptimisation_fit.md": table_note(note)},
        )
    pts = run.read_table("eval_overoptimisation", stage)
    fits = run.read_table("eval_overoptimisation_fit", stage)
    if "ci_level" in pts and pts["ci_level"].notna().any():  # the vs-start family's level
        lvl = level(1 - float(pts["ci_level"].dropna().iloc[0]))
    info = meta.get("overoptimisation", {})
    bon = pts[pts["method"] == "best_of_n"].sort_values("point")
    gold = gold_auc(run)
    clauses = []
    if len(bon) > 1:
        top = bon.iloc[-1]
        clauses.append(
            f"best-of-{int(top['point'])} from `{start}` (√KL ≤ {top['sqrt_kl']:.2f}) {_pair(top, margin, gold)}"
        )
    for _, g in pts[pts["method"] != "best_of_n"].groupby("method", sort=False):
        far = g.loc[g["sqrt_kl"].idxmax()]
        where = ("its final policy" if far.get("source") == "final"
                 else f"its step-{int(far['point'])} snapshot")  # fmt: skip
        clauses.append(
            f"{far['label']} at its farthest point ({where}, √KL {far['sqrt_kl']:.2f}) {_pair(far, margin, gold)}"
        )
    sentence = (
        f"Gains over `{start}` on the held-out prompts, {lvl} cluster t intervals over countries "
        f"(the level of the family of each method against `{start}`, so a final policy's verdict "
        "here is the one of @tbl-eval): " + "; ".join(clauses)
        if clauses
        else "No point beyond the start policy was measured"
    )
    if gold is not None:  # what the gold's verdicts rest on: its own discrimination
        sentence += (
            f". The gold judges only as well as it tells MET from Non-MET: {gold_auc_words(gold)}"
            + ("" if gold["can_judge"] else ", so a null under it is no evidence of no gain")
        )
    ceiling = ceiling_sentence(run)
    if ceiling:
        sentence += f". {ceiling}"
    fitted = fits[fits["alpha"].map(lambda v: is_present(v) and math.isfinite(v))]
    if fitted.empty:
        fit_sentence = "Too few points (three with KL > 0 per family) to fit Gao et al.'s forms"
    else:
        fit_sentence = "Fitted by least squares (@tbl-overopt-fit): " + listing(
            [
                f"{'best-of-n' if f['family'] == 'best_of_n' else 'the RL algorithms (their points pooled)'}, "
                f"{f['reward']}: α {_coef(f['alpha'], f['alpha_se'])}, β {_coef(f['beta'], f['beta_se'])} "
                f"(R² {f['r2']:.2f}, {int(f['points'])} points)"
                for _, f in fitted.iterrows()
            ]
        )
    distinct = info.get("prompts_all_distinct")
    distinct_sentence = (
        f"The bound is tight when a prompt's candidates are distinct texts; in the pool of "
        f"{info.get('candidates_per_prompt', 0):.0f} candidates per prompt they all were for "
        f"{distinct:.0%} of the prompts ({info.get('distinct_fraction', math.nan):.0%} of the "
        "candidates distinct on average), so best-of-n's KL is at most slightly overstated there, "
        "which places its curve too far right and favours the RL policies in every equal-KL "
        "comparison"
        if is_present(distinct)
        else "The pool's distinct share was not recorded"
    )
    table = fits.assign(
        family=fits["family"].map({"best_of_n": "best-of-n", "rl": "RL algorithms (pooled)"}),
        alpha=[_coef(a, s) for a, s in zip(fits["alpha"], fits["alpha_se"], strict=True)],
        beta=[_coef(b, s) for b, s in zip(fits["beta"], fits["beta_se"], strict=True)],
        r2=fits["r2"].map(lambda v: f"{v:.2f}" if is_present(v) and math.isfinite(v) else "·"),
    )[["family", "reward", "form", "points", "alpha", "beta", "r2"]].rename(
        columns={"alpha": "α ± SE", "beta": "β ± SE", "r2": "R²"}
    )
    return (
        {"sentence": sentence, "fit_sentence": fit_sentence,
         "distinct_sentence": distinct_sentence, "level": lvl},
        {"eval_overoptimisation_fit.md": markdown_table(table)},
    )  # fmt: skip
