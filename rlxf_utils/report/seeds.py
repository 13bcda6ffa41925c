"""The across-seed comparison in words (`rlxf seeds`' `tables/eval_seeds.csv`), when the run has
it: each algorithm's gain per seed and pooled, with the seed-to-seed spread."""

from __future__ import annotations

from typing import Any

import pandas as pd

from rlxf_utils.artifacts import RunDir
from rlxf_utils.report.evaluation import family_level, table_note
from rlxf_utils.report.wording import ci, ci_verdict, is_present, listing, markdown_table
from rlxf_utils.stats import level

_MOVE = ("raised", "lowered", "did not distinguishably move")


def seeds_section(run: RunDir) -> tuple[dict[str, Any], dict[str, str]]:
    """Variables (`sentence`, `seeds`, `level`), the across-seed table and its figure (nothing
    for a run without further seeds, whose table says how to add them)."""
    meta = run.read_json("eval/summary.json", stage="notebook 04_evaluation")
    lvl = level(meta.get("alpha", 0.05))
    start = meta.get("start_policy", "sft")
    if not run.exists("tables/eval_seeds.csv"):
        note = ("This run trained each algorithm with one seed, so an algorithm's effect cannot be "
                "told from its seed's here; `rlxf seeds --run-dir <run> --seeds 1 2` trains and "
                "evaluates more on the same reward model, SFT policies and prompts")  # fmt: skip
        return {"sentence": note, "seeds": "1", "level": lvl}, {
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
    return {"sentence": sentence, "seeds": str(n), "level": lvl}, {
        "eval_seeds.md": markdown_table(table),
        "eval_seeds_figure.md": figure,
    }


def _by_verdict(pooled: pd.DataFrame, col: str) -> str:
    """The algorithms grouped by what their pooled interval over seeds supports: those that moved
    the measure with their mean and interval, the rest named together."""
    moved: dict[str, list[str]] = {_MOVE[0]: [], _MOVE[1]: []}
    still = []
    for _, r in pooled.iterrows():
        verb = ci_verdict(r[f"{col}_low"], r[f"{col}_high"], *_MOVE)
        if verb in moved:
            est = ci(r[col], r[f"{col}_low"], r[f"{col}_high"], signed=True)
            moved[verb].append(f"{r['label']} (mean gain {est})")
        else:
            still.append(str(r["label"]))
    parts = [f"{listing(names)} {verb} it" for verb, names in moved.items() if names]
    if still:
        parts.append(
            f"{listing(still)} did not distinguishably move it"
            if parts or len(still) == 1
            else f"none of the {len(still)} algorithms distinguishably moved it"
        )
    return ", while ".join(parts)
