"""History as policies: real MET and Non-MET descriptions of the held-out contexts and randomly
drawn ones, scored like every policy, and the contrast between what was met and what was not:
under each judge, the attainable ceiling against which every gain and bound is read; and the
attainable gain over the start policy (`attainable_gain`: history MET minus the start policy, on
the same prompts), beside which every headline gain is read as a share."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from rlxf_utils.evaluation.design import JUDGES
from rlxf_utils.prompts import CONTEXT_FIELDS
from rlxf_utils.stats import (
    paired_comparison,
    per_prompt_means,
    prompt_clusters,
)

HISTORY_POLICIES = ("history_met", "history_nonmet", "random_policy")


def history_references(
    labelled: pd.DataFrame,
    contexts: Sequence[Mapping[str, Any]],
    k: int,
    seed: int,
    reference_ids: Collection[int] | None = None,
) -> pd.DataFrame:
    """Real descriptions for each held-out context: MET, Non-MET (same context) and random.

    Up to k per prompt and kind, drawn without replacement (seeded); a context without MET (or
    Non-MET) history has no row of that kind, so paired tests use only prompts both sides have.
    Only rows whose `row_id` is in `reference_ids` (data/holdout.json's `reference`: rows no
    reward or audit model trained on) are drawn, the random policy's too. `hist_idx` is the
    row's position in `labelled` (the grounding index order).
    """
    rng = np.random.default_rng(seed)
    lab = labelled.reset_index(drop=True)
    allowed = (
        np.ones(len(lab), bool)
        if reference_ids is None
        else lab["row_id"].isin(set(reference_ids)).to_numpy()
    )
    if not allowed.any():
        raise ValueError("no labelled row is a reference row; check data/holdout.json")
    key = lab[list(CONTEXT_FIELDS)].astype(str).agg("\x1f".join, axis=1)
    groups = {
        k_: np.asarray(v)[allowed[np.asarray(v)]] for k_, v in lab.groupby(key).indices.items()
    }
    rows: list[dict[str, Any]] = []
    for pid, c in enumerate(contexts):
        idx = groups.get("\x1f".join(str(c[k_]) for k_ in CONTEXT_FIELDS), np.array([], dtype=int))
        for policy, want in (("history_met", 1), ("history_nonmet", 0)):
            pool = idx[lab.loc[idx, "y"].to_numpy() == want] if idx.size else idx
            pick = rng.choice(pool, size=min(k, pool.size), replace=False) if pool.size else []
            rows += [
                {"policy": policy, "prompt_id": pid, "sample_id": j, "hist_idx": int(h)}
                for j, h in enumerate(pick)
            ]
        rand = rng.choice(np.flatnonzero(allowed), size=k, replace=False)
        rows += [
            {"policy": "random_policy", "prompt_id": pid, "sample_id": j, "hist_idx": int(h)}
            for j, h in enumerate(rand)
        ]
    out = pd.DataFrame(rows)
    out["response"] = lab.loc[out["hist_idx"], "description"].astype(str).to_numpy()
    return out


def history_contrast(samples: pd.DataFrame, n_boot: int, alpha: float, seed: int) -> dict[str, Any]:
    """Real MET minus real Non-MET descriptions under the reward and the audit, per prompt, on the
    prompts that have both, with the cluster t interval over countries at 1 - `alpha`
    (`stats.paired_comparison`; `n_boot` and `seed` are unused by it) and tests over countries."""
    out: dict[str, Any] = {}
    h = samples[samples["policy"].isin(["history_met", "history_nonmet"])]
    if h.empty:
        return out
    for col in ("reward", "audit_reward"):
        wide = per_prompt_means(h, col).dropna()
        if wide.shape[1] < 2 or wide.empty:
            continue
        cl = prompt_clusters(h, cluster_col="country").loc[wide.index].to_numpy()
        res = paired_comparison(wide["history_met"].to_numpy(), wide["history_nonmet"].to_numpy(),
                                   n_boot=n_boot, seed=seed, alpha=alpha, clusters=cl)  # fmt: skip
        out[col] = {k: res[k] for k in ("n", "n_clusters", "mean_a", "mean_b", "mean_diff", "ci_low",
                                        "ci_high", "p_wilcoxon")}  # fmt: skip
    return out


def ceiling_table(contrast: Mapping[str, Any], alpha: float) -> pd.DataFrame:
    """The attainable ceiling under each judge (`history_contrast`'s numbers, one row per judge):
    how much higher the held-out contexts' own historical MET descriptions score than their
    Non-MET ones, the gain a perfect imitator of what worked would get over one of what did not
    (`met`, `nonmet`, `diff` with its cluster t interval over countries `ci_low`, `ci_high` at
    `ci_level`, on the `n` prompts in `n_clusters` countries that have both)."""
    rows = [
        {"judge": JUDGES[col], "measure": col, "n": int(h["n"]), "n_clusters": int(h["n_clusters"]),
         "met": h["mean_a"], "nonmet": h["mean_b"], "diff": h["mean_diff"], "ci_low": h["ci_low"],
         "ci_high": h["ci_high"], "ci_level": 1 - alpha, "method": "cluster t over countries"}
        for col, h in contrast.items()
        if col in JUDGES
    ]  # fmt: skip
    return pd.DataFrame(rows, columns=["judge", "measure", "n", "n_clusters", "met", "nonmet",
                                       "diff", "ci_low", "ci_high", "ci_level", "method"])  # fmt: skip


#: `attainable_gain`'s columns, in order.
ATTAINABLE_COLUMNS = ["judge", "measure", "vs", "n", "n_clusters", "met", "start", "diff",
                      "ci_low", "ci_high", "ci_level", "method"]  # fmt: skip


def attainable_gain(samples: pd.DataFrame, start: str, alpha: float, family_size: int = 1) -> pd.DataFrame:  # fmt: skip
    """The gain a policy tuned from `start` could reach, under each judge (one row per judge):
    the held-out contexts' own historical MET descriptions (`history_met`) minus `start`'s
    responses, per prompt (each side's mean over its samples), paired on the `n` prompts that
    have both (a context without MET history has no `history_met` row) in `n_clusters`
    countries, with the cluster t interval over countries that the gains over `start` get
    (`stats.paired_comparison`), at their family's level 1 - alpha / `family_size` (`ci_level`),
    so that it stands beside them at one level. Where neither side or no prompt has both: no
    row for that judge."""
    rows = []
    have = samples[samples["policy"].isin(["history_met", start])]
    if not {"history_met", start} <= set(have["policy"]):
        return pd.DataFrame(rows, columns=ATTAINABLE_COLUMNS)
    for col in JUDGES:
        if col not in have:
            continue
        wide = per_prompt_means(have, col)[["history_met", start]].dropna()
        if wide.empty:
            continue
        cl = prompt_clusters(have, cluster_col="country").loc[wide.index].to_numpy()
        res = paired_comparison(wide["history_met"].to_numpy(), wide[start].to_numpy(),
                                alpha=alpha, clusters=cl, family_size=family_size)  # fmt: skip
        rows.append({"judge": JUDGES[col], "measure": col, "vs": start, "n": int(res["n"]),
                     "n_clusters": int(res["n_clusters"]), "met": res["mean_a"],
                     "start": res["mean_b"], "diff": res["mean_diff"], "ci_low": res["ci_low"],
                     "ci_high": res["ci_high"], "ci_level": res["ci_level"],
                     "method": "cluster t over countries"})  # fmt: skip
    return pd.DataFrame(rows, columns=ATTAINABLE_COLUMNS)
