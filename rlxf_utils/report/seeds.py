"""The across-seed comparison in words (`rlxf seeds`' `tables/eval_seeds.csv`), when the run has
it: each algorithm's gain per seed and pooled, with the seed-to-seed spread."""

from __future__ import annotations

from typing import Any

import pandas as pd

from rlxf_utils.artifacts import RunDir
from rlxf_utils.report.evaluation import family_level, table_note
from rlxf_utils.report.wording import (
    ABOVE,
    BELOW,
    UNCLEAR,
    ci,
    is_present,
    listing,
    markdown_table,
    phrase,
)
from rlxf_utils.stats import bound_verdict, ci_sign, level


def seeds_section(run: RunDir) -> tuple[dict[str, Any], dict[str, str]]:
    """Variables (`sentence`, `seeds`, `count_words`, `level`), the across-seed table and its figure (nothing
    for a run without further seeds, whose table says how to add them)."""
    meta = run.read_json("eval/summary.json", stage="notebook 04_evaluation")
    lvl = level(meta.get("alpha", 0.05))
    start = meta.get("start_policy", "sft")
    if not run.exists("tables/eval_seeds.csv"):
        note = ("This run trained each algorithm with one seed, so an algorithm's effect cannot be "
                "told from its seed's here; `rlxf seeds --run-dir <run> --seeds 1 2` trains and "
                "evaluates more on the same reward model, SFT policies and prompts")  # fmt: skip
        return {"sentence": note, "seeds": "1", "count_words": "one training seed", "level": lvl}, {
            "eval_seeds.md": table_note(note),
            "eval_seeds_figure.md": "",
        }
    t = run.read_table("eval_seeds", "rlxf seeds")
    pooled = t[t["seed"] == "pooled"]
    n = int(pooled["seeds"].max())
    if "ci_level" in pooled:  # the family's level; tables from before the rule keep alpha's
        lvl = family_level(pooled)
    measures = (("gain", "under the reward model"), ("audit_gain", "under the audit model"))
    sentence = (
        f"Over {n} training seeds, each evaluated on the same prompts with the same sampling seeds, "
        f"with {lvl} simultaneous t intervals over seeds for the mean gain over `{start}` (one "
        "family per measure, as every verdict of the study): "
        + "; ".join(f"{where}, {_by_verdict(pooled, col)}" for col, where in measures)
    )
    per = t[t["seed"] != "pooled"]
    if run.exists("tables/eval_paired.csv"):  # the level of each seed's own gain intervals
        own = family_level(run.read_table("eval_paired", "notebook 04_evaluation"))
        sentence += (
            f". Seed by seed, each with its own evaluation's {own} simultaneous interval, the gain "
            f"under the reward model lay above zero {_seed_counts(per, pooled, 'gain', n)}. Under "
            f"the audit model it did {_seed_counts(per, pooled, 'audit_gain', n)}"
        )
    shown = []
    for _, r in t.iterrows():
        pooled_row = r["seed"] == "pooled"
        shown.append({
            "algorithm": r["label"], "seed": r["seed"],
            "gain": ci(r["gain"], r["gain_low"], r["gain_high"], signed=True),
            "audit gain": ci(r["audit_gain"], r["audit_gain_low"], r["audit_gain_high"], signed=True),
            "KL (nats)": f"{r['kl']:.2f}",
            "seed SD of gain": f"{r['gain_seed_sd']:.3f}" if pooled_row and is_present(r.get("gain_seed_sd")) else "·",
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
        f"seeds with its {lvl} simultaneous t interval (squares; an interval running off the axis "
        "is cut there, its half-width written beside it).](figures/eval_seeds.png){#fig-seeds "
        "width=100%}"
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


def _by_verdict(pooled: pd.DataFrame, col: str) -> str:
    """The algorithms grouped by what their pooled interval over seeds supports: those that moved
    the measure with their mean and interval, the rest named together."""
    moved: dict[str, list[str]] = {ABOVE: [], BELOW: []}
    still = []
    for _, r in pooled.iterrows():
        code = bound_verdict(r[f"{col}_low"], r[f"{col}_high"])
        if code in moved:
            est = ci(r[col], r[f"{col}_low"], r[f"{col}_high"], signed=True)
            moved[code].append(f"{r['label']} (mean gain {est})")
        else:
            still.append(str(r["label"]))
    parts = [
        f"{listing(names)} {phrase('move', code)} it" for code, names in moved.items() if names
    ]
    if still:
        parts.append(
            f"{listing(still)} {phrase('move', UNCLEAR)} it"
            if parts or len(still) == 1
            else f"none of the {len(still)} algorithms distinguishably moved it"
        )
    return ", while ".join(parts)


def _seed_signs(per: pd.DataFrame, pooled: pd.DataFrame, col: str) -> list[tuple[str, int, int]]:
    """Per algorithm (in the study's order): its label and how many seeds' own intervals lie
    above and below zero."""
    out = []
    for algo, label in zip(pooled["algorithm"], pooled["label"], strict=True):
        g = per[per["algorithm"] == algo]
        signs = [ci_sign(lo, hi) for lo, hi in zip(g[f"{col}_low"], g[f"{col}_high"], strict=True)]
        out.append((str(label), signs.count(1), signs.count(-1)))
    return out


def _seed_counts(per: pd.DataFrame, pooled: pd.DataFrame, col: str, n: int) -> str:
    """'at all 3 seeds for GRPO and KTO; at 2 seeds for DPO; at none for PPO': how many seeds'
    own intervals lie above zero, per algorithm (and below zero, where any does)."""
    groups: dict[tuple[int, int], list[str]] = {}
    for label, up, down in _seed_signs(per, pooled, col):
        groups.setdefault((up, down), []).append(label)
    parts = []
    for (up, down), labels in sorted(groups.items(), key=lambda kv: (-kv[0][0], kv[0][1])):
        where = (
            f"all {n} seeds" if up == n else ("none" if up == 0 else f"{up} seed{'s' * (up > 1)}")
        )
        below = f" (below zero at {down})" if down else ""
        parts.append(f"at {where} for {listing(labels)}{below}")
    return "; ".join(parts)


def seed_finding(run: RunDir) -> str | None:
    """The across-seed finding for the key findings (None without further seeds): which
    algorithms' gains lay above zero at every seed, under the reward model and the audit, and
    what the pooled intervals over seeds support."""
    if not (run.exists("tables/eval_seeds.csv") and run.exists("tables/eval_paired.csv")):
        return None
    t = run.read_table("eval_seeds", "rlxf seeds")
    pooled, per = t[t["seed"] == "pooled"], t[t["seed"] != "pooled"]
    n = int(pooled["seeds"].max())
    own = family_level(run.read_table("eval_paired", "notebook 04_evaluation"))

    def every(col: str) -> str:
        labels = [label for label, up, _ in _seed_signs(per, pooled, col) if up == n]
        return listing(labels) if labels else "no algorithm"

    def pooled_moved(col: str) -> list[str]:
        return [str(r["label"]) for _, r in pooled.iterrows()
                if ci_sign(r[f"{col}_low"], r[f"{col}_high"]) != 0]  # fmt: skip

    reward, audit = pooled_moved("gain"), pooled_moved("audit_gain")
    lvl = family_level(pooled)
    if reward or audit:
        over = (
            f"the mean gain over seeds ({lvl} simultaneous t intervals) was distinguishable from "
            f"zero under the reward model for {listing(reward) if reward else 'no algorithm'} and "
            f"under the audit model for {listing(audit) if audit else 'no algorithm'}"
        )
    else:
        over = f"no mean gain over seeds was distinguishable from zero ({lvl} simultaneous t intervals)"
    return (
        f"Over {n} training seeds, each evaluated with its own {own} simultaneous intervals, the "
        f"gain under the reward model lay above zero at every seed for {every('gain')}, and under "
        f"the audit model for {every('audit_gain')}; {over}"
    )
