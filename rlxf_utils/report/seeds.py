"""The across-seed comparison in words (`rlxf seeds`' `tables/eval_seeds.csv`), when the run has
it: each algorithm's gain per seed and pooled over seeds with an interval that carries both the
seed-to-seed spread and the evaluation's error, and the seeds a target MDE needs. Claims about an
algorithm (rather than one trained policy) are made here only, where its seeds exist."""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from rlxf_utils.artifacts import RunDir
from rlxf_utils.report.evaluation import family_level, null_clause, table_note
from rlxf_utils.report.wording import (
    ABOVE,
    BELOW,
    UNCLEAR,
    ci,
    is_present,
    listing,
    markdown_table,
    num,
    phrase,
)
from rlxf_utils.stats import MAX_SEEDS, bound_verdict, ci_sign, level

#: How the pooled interval is built, in words (`stats.replicated_gain`).
POOLED_WORDS = (
    "intervals that carry both the seed-to-seed spread and the evaluation's own error (the "
    "variance of the seeds' estimates over the seeds plus the cluster-robust variance over "
    "countries of the seed-averaged gain, on Satterthwaite's degrees of freedom)"
)


def seeds_section(run: RunDir) -> tuple[dict[str, Any], dict[str, str]]:
    """Variables (`sentence`, `seeds`, `count_words`, `level`), the across-seed table and its figure (nothing
    for a run without further seeds, whose table says how to add them)."""
    meta = run.read_json("eval/summary.json", stage="notebook 04_evaluation")
    lvl = level(meta.get("alpha", 0.05))
    start = meta.get("start_policy", "sft")
    if not run.exists("tables/eval_seeds.csv"):
        note = ("This run trained each algorithm with one seed, so an algorithm's effect cannot be "
                "told from its seed's here and every gain reported is one trained policy's; "
                "`rlxf seeds --run-dir <run> --seeds 1 2` trains and evaluates more on the same "
                "reward model, SFT policies and prompts")  # fmt: skip
        return {"sentence": note, "seeds": "1", "count_words": "one training seed", "level": lvl}, {
            "eval_seeds.md": table_note(note),
            "eval_seeds_figure.md": "",
        }
    t = run.read_table("eval_seeds", "rlxf seeds")
    pooled = t[t["seed"] == "pooled"]
    n = int(pooled["seeds"].max())
    if "ci_level" in pooled:  # the family's level; tables from before the rule keep alpha's
        lvl = family_level(pooled)
    margin = meta.get("equivalence_margin")
    measures = (("gain", "under the reward model"), ("audit_gain", "under the audit model"))
    sentence = (
        f"Over {n} training seeds of {listing([str(x) for x in pooled['label']])}, each seed's "
        f"policies sampled with their own sampling seeds against the same `{start}` samples on "
        f"the same prompts, with {lvl} simultaneous {POOLED_WORDS} for the mean gain over "
        f"`{start}` (one family per measure, as every verdict of the study): "
        + "; ".join(f"{where}, {_by_verdict(pooled, col, margin)}" for col, where in measures)
    )
    needed = seeds_needed_sentence(pooled)
    if needed:
        sentence += f". {needed}"
    shown = []
    for _, r in t.iterrows():
        pooled_row = r["seed"] == "pooled"
        shown.append({
            "algorithm": r["label"], "seed": r["seed"],
            "gain": ci(r["gain"], r["gain_low"], r["gain_high"], signed=True),
            "audit gain": ci(r["audit_gain"], r["audit_gain_low"], r["audit_gain_high"], signed=True),
            "KL (nats)": f"{r['kl']:.2f}",
            "seed SD of gain": f"{r['gain_seed_sd']:.3f}" if pooled_row and is_present(r.get("gain_seed_sd")) else "·",
            "seeds for the target MDE": _needed_cell(r) if pooled_row else "·",
        })  # fmt: skip
    # the algorithms in the study's order; per algorithm its seeds in numeric order, then pooled
    algo_order = t["algorithm"].map({a: i for i, a in enumerate(pooled["algorithm"])})
    seed_order = pd.to_numeric(t["seed"], errors="coerce").fillna(float("inf"))
    table = (
        pd.DataFrame(shown)
        .assign(_algo=algo_order.to_numpy(), _seed=seed_order.to_numpy())
        .sort_values(["_algo", "_seed"], kind="stable")
        .drop(columns=["_algo", "_seed"])
    )
    figure = (
        "![Each algorithm's gain over the start policy under the reward model (left) and the audit "
        "(right) at each training seed, with that seed's own interval (dots), and the mean over "
        f"seeds with its {lvl} simultaneous interval over seeds and countries (squares; an "
        "interval running off the axis is cut there, its half-width written beside it)."
        "](figures/eval_seeds.png){#fig-seeds width=100%}"
    )
    return {
        "sentence": sentence,
        "seeds": str(n),
        "count_words": f"{n} training seeds",
        "level": lvl,
    }, {
        "eval_seeds.md": markdown_table(table),
        "eval_seeds_figure.md": figure,
    }


def _needed_cell(r: pd.Series) -> str:
    """A pooled row's seeds for the target MDE under the reward model: the count, or 'none'
    with the floor no number of seeds passes."""
    if not is_present(r.get("target_mde")):
        return "·"
    if is_present(r.get("gain_seeds_needed")):
        return _count(r["gain_seeds_needed"])
    floor = r.get("gain_mde_floor")
    return f"none (floor {num(floor)})" if is_present(floor) else "·"


def _count(k: float) -> str:
    return str(int(k)) if math.isfinite(k) else f"more than {MAX_SEEDS}"


def seeds_needed_sentence(pooled: pd.DataFrame) -> str:
    """How many training seeds, evaluated as these were, an algorithm-level MDE of the run's
    target needs under each judge (`seeds.seed_table`'s `<m>_seeds_needed`), per algorithm, and
    where no number of seeds reaches it (the evaluation's shared error alone leaves a larger MDE:
    a larger evaluation is needed); '' without a target."""
    if "target_mde" not in pooled or not pooled["target_mde"].map(is_present).any():
        return ""
    target = float(pooled["target_mde"].dropna().iloc[0])
    parts = []
    for col, judge in (("gain", "the reward model"), ("audit_gain", "the audit model")):
        if f"{col}_seeds_needed" not in pooled:
            continue
        counts, floors = [], []
        for _, r in pooled.iterrows():
            k = r[f"{col}_seeds_needed"]
            if is_present(k):
                counts.append(f"{_count(k)} for {r['label']}")
            elif is_present(r[f"{col}_mde_floor"]):
                floors.append(f"{r['label']} (at most {num(r[f'{col}_mde_floor'])})")
        said = []
        if counts:
            said.append(listing(counts))
        if floors:
            said.append(
                f"none suffices for {listing(floors)}, where the evaluation's error that every seed "
                "shares leaves a larger MDE however many seeds are trained"
            )
        if said:
            parts.append(f"under {judge}, {'; '.join(said)}")
    if not parts:
        return ""
    return (
        f"To detect an algorithm-level gain of {num(target)} with 80% power at this family's "
        "level, from the seed-to-seed spread measured here, the seeds needed are: "
        + "; ".join(parts)
    )


def _by_verdict(pooled: pd.DataFrame, col: str, margin: float | None = None) -> str:
    """The algorithms grouped by what their pooled interval over seeds supports: those that moved
    the measure with their mean and interval, the rest named together with the largest gain each
    leaves open (`null_clause`)."""
    moved: dict[str, list[str]] = {ABOVE: [], BELOW: []}
    still = []
    for _, r in pooled.iterrows():
        low, high = r[f"{col}_low"], r[f"{col}_high"]
        code = bound_verdict(low, high)
        if code in moved:
            est = ci(r[col], low, high, signed=True)
            moved[code].append(f"{r['label']} (mean gain {est})")
        else:
            bound = null_clause(low, high, margin)
            still.append(f"{r['label']}{f' ({bound})' if bound else ''}")
    parts = [
        f"{listing(names)} {phrase('move', code)} it" for code, names in moved.items() if names
    ]
    if still:
        parts.append(
            f"{listing(still)} {phrase('move', UNCLEAR)} it"
            if parts or len(still) == 1
            else f"none of the {len(still)} algorithms distinguishably moved it ({listing(still)})"
        )
    return ", while ".join(parts)


def seed_finding(run: RunDir) -> str | None:
    """The across-seed finding for the key findings (None without further seeds): which
    algorithms' mean gain over seeds the pooled intervals (seeds and the evaluation's error
    together) place above or below zero, under the reward model and the audit."""
    if not run.exists("tables/eval_seeds.csv"):
        return None
    t = run.read_table("eval_seeds", "rlxf seeds")
    pooled = t[t["seed"] == "pooled"]
    if pooled.empty:
        return None
    n = int(pooled["seeds"].max())

    def pooled_moved(col: str) -> list[str]:
        return [str(r["label"]) for _, r in pooled.iterrows()
                if ci_sign(r[f"{col}_low"], r[f"{col}_high"]) != 0]  # fmt: skip

    reward, audit = pooled_moved("gain"), pooled_moved("audit_gain")
    lvl = family_level(pooled)
    if reward or audit:
        over = (
            f"the mean gain over seeds was distinguishable from zero under the reward model for "
            f"{listing(reward) if reward else 'no algorithm'} and under the audit model for "
            f"{listing(audit) if audit else 'no algorithm'}"
        )
    else:
        top = max((float(h) for h in pooled["gain_high"] if is_present(h)), default=math.nan)
        over = "no mean gain over seeds was distinguishable from zero" + (
            f" (under the reward model, gains of at most {num(top, signed=True)})"
            if math.isfinite(top)
            else ""
        )
    return (
        f"Over {n} training seeds of {listing([str(x) for x in pooled['label']])}, with {lvl} "
        f"simultaneous intervals that carry the seed-to-seed spread and the evaluation's error, "
        f"{over}"
    )
