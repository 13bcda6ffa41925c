"""The across-seed comparison in words (`rlxf seeds`' `tables/eval_seeds.csv`), when the run has
it: each algorithm's gain per seed and pooled over seeds with an interval that carries both the
seed-to-seed spread and the evaluation's error, and the seeds a target MDE needs. Claims about an
algorithm (rather than one trained policy) are made here only, where its seeds exist. The words
are the author's, in `reports/templates/seeds.jinja`; here, the numbers and verdicts they need."""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from rlxf_utils.artifacts import FROZEN_PARAMS, RunDir
from rlxf_utils.config import load_config
from rlxf_utils.markdown import is_present
from rlxf_utils.report.evaluation import family_level
from rlxf_utils.report.gold import gold_auc
from rlxf_utils.report.wording import ABOVE, BELOW, EQUIVALENT, sentence, table
from rlxf_utils.stats import MAX_SEEDS, bound_verdict, ci_sign, level
from rlxf_utils.stats.intervals import level_span

#: The measures a pooled row gives: the gain under the reward model and under the audit.
MEASURES = ("gain", "audit_gain")


def seeds_section(run: RunDir) -> tuple[dict[str, Any], dict[str, str]]:
    """Variables (`sentence`, `seeds`, `count_words`, `level`), the across-seed table and its figure (nothing
    for a run without further seeds, whose table says how to add them)."""
    meta = run.read_json("eval/summary.json", stage="notebook 04_evaluation")
    lvl = level(meta.get("alpha", 0.05))
    if not run.exists("tables/eval_seeds.csv"):
        note = sentence("seeds", "one_seed")
        variables = {"sentence": note, "seeds": "1", "level": lvl,
                     "count_words": sentence("seeds", "count_words", 1)}  # fmt: skip
        # no table, no caption: the sentence says why (`eval_seeds_optional.md` holds both when shown)
        return variables, {
            "eval_seeds.md": "",
            "eval_seeds_optional.md": "",
            "eval_seeds_figure.md": "",
        }
    t = run.read_table("eval_seeds", "rlxf seeds")
    pooled = t[t["seed"] == "pooled"]
    n = int(pooled["seeds"].max())
    if "ci_level" in pooled:  # the family's level; tables from before the rule keep alpha's
        lvl = family_level(pooled)
    margin = meta.get("equivalence_margin")
    context = {"n": n, "labels": [str(x) for x in pooled["label"]], "level": lvl, "margin": margin,
               "start": meta.get("start_policy", "sft"), "needed": seeds_needed(pooled),
               "measures": [by_verdict(pooled, col, margin) for col in MEASURES],
               "gold": unjudged_gold(run)}  # fmt: skip
    # the algorithms in the study's order; per algorithm the run's own seed (marked `own`), the
    # further seeds in numeric order, then pooled
    seed = t["seed"].astype(str)
    own = seed == own_seed(run)
    algo_order = t["algorithm"].map({a: i for i, a in enumerate(pooled["algorithm"])})
    seed_order = pd.to_numeric(seed, errors="coerce").fillna(float("inf")).mask(own, -math.inf)
    shown = t.assign(
        _algo=algo_order.to_numpy(), _seed=seed_order.to_numpy(), seed=seed, own=own.to_numpy()
    ).sort_values(["_algo", "_seed"], kind="stable")
    variables = {"sentence": sentence("seeds", "seeds_sentence", context), "seeds": str(n),
                 "count_words": sentence("seeds", "count_words", n), "level": lvl}  # fmt: skip
    # the seeds' own intervals: each at its evaluation's vs-start family level (none: from before)
    per_seed = t.loc[t["seed"] != "pooled", "ci_level"] if "ci_level" in t else []
    own_lvl = level_span(per_seed, missing="") or None
    return variables, {
        "eval_seeds.md": table("eval_seeds", shown, most=MAX_SEEDS),
        "eval_seeds_optional.md": "{{< include _generated/eval_seeds.md >}}\n\n: "
        + sentence("seeds", "table_caption", lvl, own_lvl)
        + " {#tbl-seeds}\n",
        "eval_seeds_figure.md": sentence("seeds", "figure", lvl, own_lvl),
    }


def seeds_needed(pooled: pd.DataFrame) -> dict[str, Any] | None:
    """How many training seeds, evaluated as these were, an algorithm-level MDE of the run's
    target needs under each judge (`seeds.seed_table`'s `<m>_seeds_needed`), per algorithm
    (`seeds` None: more than `most`), and where no number of seeds reaches it (`floors`: the
    evaluation's shared error alone leaves a larger MDE); None without a target."""
    if "target_mde" not in pooled or not pooled["target_mde"].map(is_present).any():
        return None
    judges = []
    for col in MEASURES:
        if f"{col}_seeds_needed" not in pooled:
            continue
        counts, floors = [], []
        for _, r in pooled.iterrows():
            k, floor = r[f"{col}_seeds_needed"], r[f"{col}_mde_floor"]
            if is_present(k):
                counts.append({"label": r["label"], "seeds": int(k) if math.isfinite(k) else None})
            elif is_present(floor):
                floors.append({"label": r["label"], "floor": floor})
        if counts or floors:
            judges.append({"key": col, "counts": counts, "floors": floors})
    target = float(pooled["target_mde"].dropna().iloc[0])
    return {"target": target, "most": MAX_SEEDS, "judges": judges} if judges else None


def unjudged_gold(run: RunDir) -> dict[str, Any] | None:
    """The audit's own AUC on held-out rows when it cannot be shown to tell MET from Non-MET
    (`gold.gold_auc`'s interval does not lie above 0.5), else None: then no pooled move under the
    audit, up, down or none, is read as a gain, a loss or its absence (`gold.gold_cannot_judge`,
    the rule the methods state)."""
    gold = gold_auc(run)
    return gold if gold is not None and not gold["can_judge"] else None


def by_verdict(pooled: pd.DataFrame, col: str, margin: float | None = None) -> dict[str, Any]:
    """The algorithms grouped by what their pooled interval over seeds supports: those that moved
    the measure (`moved`: a verdict `code` and its `rows`, above then below), and the rest
    (`still`, each with whether its interval lies within ±`margin`)."""
    rows = [{"label": r["label"], "est": r[col], "low": r[f"{col}_low"], "high": r[f"{col}_high"],
             "code": bound_verdict(r[f"{col}_low"], r[f"{col}_high"], margin)}
            for _, r in pooled.iterrows()]  # fmt: skip
    for r in rows:
        r["equivalent"] = r["code"] == EQUIVALENT
    moved = [{"code": c, "rows": [r for r in rows if r["code"] == c]} for c in (ABOVE, BELOW)]
    return {"key": col, "moved": [g for g in moved if g["rows"]],
            "still": [r for r in rows if r["code"] not in (ABOVE, BELOW)]}  # fmt: skip


def own_seed(run: RunDir) -> str | None:
    """The run's own training seed as the across-seed table writes it (`StudyConfig.training_seed`
    of the run's frozen parameters); None where the run has no parameters file."""
    if not run.exists(FROZEN_PARAMS):
        return None
    return str(load_config(run.path(FROZEN_PARAMS)).training_seed)


def own_seed_checks(table: pd.DataFrame, own: str | None) -> list[dict[str, Any]]:
    """Each gain the run's own training seed found distinguishable from zero (one trained policy's
    verdict, the one the rest of the report gives) read against the algorithm's seeds: per judge
    (`key`) and pooled algorithm, the seed's row (`label`, `est`, `low`, `high`), the pooled row
    (`pooled`: `est`, `low`, `high`) and whether the pooled interval lies on the same side of zero
    (`held`)."""
    seed = table["seed"].astype(str)
    pooled = table[seed == "pooled"]
    own_rows = table[seed == own].drop_duplicates("algorithm").set_index("algorithm")
    checks = []
    for col in MEASURES:
        for _, p in pooled.iterrows():
            if p["algorithm"] not in own_rows.index:
                continue
            r = own_rows.loc[p["algorithm"]]
            sign = ci_sign(r[f"{col}_low"], r[f"{col}_high"])
            if sign == 0:
                continue
            checks.append({"key": col, "label": str(p["label"]), "est": float(r[col]),
                           "low": float(r[f"{col}_low"]), "high": float(r[f"{col}_high"]),
                           "pooled": {"est": float(p[col]), "low": float(p[f"{col}_low"]),
                                      "high": float(p[f"{col}_high"])},
                           "held": ci_sign(p[f"{col}_low"], p[f"{col}_high"]) == sign})  # fmt: skip
    return checks


def finished_checks(row: pd.Series, judges: list[str]) -> list[dict[str, Any]]:
    """A pooled row's gain among finished responses alone under each of `judges` ('gain',
    'audit_gain'; `seeds.seed_table`'s `<judge>_finished` columns, pooled over the prompts where
    every seed and the start policy finished a response): `key`, `est`, `low`, `high`, `prompts`
    and whether it lies on the side of zero the full gain does (`held`); a judge without an
    interval (tables from before; no such prompt) is left out."""
    out = []
    for key in judges:
        col = f"{key}_finished"
        low, high = row.get(f"{col}_low"), row.get(f"{col}_high")
        if not (is_present(low) and is_present(high)):
            continue
        prompts = row.get(f"{col}_prompts")
        out.append({"key": key, "est": float(row[col]), "low": float(low), "high": float(high),
                    "prompts": int(prompts) if is_present(prompts) else None,
                    "held": ci_sign(low, high) == ci_sign(row[f"{key}_low"], row[f"{key}_high"])})  # fmt: skip
    return out


def seed_finding(run: RunDir) -> dict[str, Any] | None:
    """The across-seed finding for the key findings (None without further seeds): which
    algorithms' mean gain over seeds the pooled intervals (seeds and the evaluation's error
    together) place above or below zero, under the reward model and the audit, and whether each
    gain the run's own seed found held over seeds (`checks`, `own_seed_checks`); the context of
    `seed_finding` in `reports/templates/seeds.jinja`."""
    if not run.exists("tables/eval_seeds.csv"):
        return None
    t = run.read_table("eval_seeds", "rlxf seeds")
    pooled = t[t["seed"] == "pooled"]
    if pooled.empty:
        return None
    moved = {col: [str(r["label"]) for _, r in pooled.iterrows()
                   if ci_sign(r[f"{col}_low"], r[f"{col}_high"]) != 0] for col in MEASURES}  # fmt: skip
    top = max((float(h) for h in pooled["gain_high"] if is_present(h)), default=math.nan)
    # each mover's finished share over seeds and, under each judge it moved, its pooled gain among
    # finished responses alone: a gain among responses cut at the token cap may be the cut's
    movers = {lab for labels in moved.values() for lab in labels}
    finished = [{"label": str(r["label"]), "finished": float(r["finished"]),
                 "checks": finished_checks(r, [c for c in MEASURES if r["label"] in moved[c]])}
                for _, r in pooled.iterrows()
                if r["label"] in movers and is_present(r.get("finished"))]  # fmt: skip
    return {"n": int(pooled["seeds"].max()), "labels": [str(x) for x in pooled["label"]],
            "level": family_level(pooled), "reward": moved["gain"], "audit": moved["audit_gain"],
            "gold": unjudged_gold(run),
            "finished": finished,
            "top": top if math.isfinite(top) else None,
            "checks": own_seed_checks(t, own_seed(run))}  # fmt: skip
