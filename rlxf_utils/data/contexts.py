"""Prompt contexts: the (country, arrangement type, economic area) cells of MONA that RL and
evaluation prompt with, split into training and held-out contexts."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from rlxf_utils.artifacts import ArtifactMissing, RunDir
from rlxf_utils.data.schema import DataError
from rlxf_utils.prompts import econ_area


def build_contexts(labelled: pd.DataFrame, seed: int, eval_fraction: float = 0.2) -> pd.DataFrame:
    """Distinct (country, arrangement type, descriptor) with counts, MET rate and a by-country split."""
    keys = ["country", "arrangement_type", "econ_descriptor"]
    ctx = labelled.groupby(keys, sort=True).agg(n=("y", "size"), n_met=("y", "sum")).reset_index()
    ctx["n_met"] = ctx["n_met"].astype(int)
    ctx["met_rate"] = ctx["n_met"] / ctx["n"]
    ctx["econ_area"] = ctx["econ_descriptor"].map(econ_area)
    countries = np.array(sorted(ctx["country"].unique()))
    rng = np.random.default_rng(seed + 3)
    rng.shuffle(countries)
    k = max(1, round(len(countries) * eval_fraction))
    if k >= len(countries):
        raise DataError(
            f"only {len(countries)} countries: cannot hold out {eval_fraction:.0%} for evaluation "
            "(key 'data.splits.context_eval_fraction')"
        )
    held = set(countries[:k].tolist())
    ctx["split"] = np.where(ctx["country"].isin(held), "eval", "train")
    return ctx[[*keys, "econ_area", "n", "n_met", "met_rate", "split"]]


CONTEXT_COLUMNS = ("country", "arrangement_type", "econ_descriptor", "econ_area", "split")


def load_contexts(
    run_dir: str | Path, split: str = "train", max_prompts: int | None = None, seed: int = 0
) -> list[dict[str, Any]]:
    """Prompt contexts of one split from `data/contexts.parquet` (RL uses only 'train': the
    training contexts the policy pool has rows of, `policy_rows` > 0)."""
    rd = RunDir(run_dir)
    df = rd.read_parquet("data/contexts.parquet", stage="notebook 01 (data exploration)")
    missing = [c for c in CONTEXT_COLUMNS if c not in df.columns]
    if missing:
        raise ArtifactMissing(
            f"{rd.root / 'data/contexts.parquet'} lacks columns {missing}; expected {list(CONTEXT_COLUMNS)}"
        )
    df = df[df["split"] == split]
    if split == "train" and "policy_rows" in df.columns:
        # the training contexts every method shares: those the policy pool has rows of
        df = df[df["policy_rows"] > 0]
    df = df.reset_index(drop=True)
    if df.empty:
        raise ValueError(
            f"{rd.root / 'data/contexts.parquet'} has no contexts with split=={split!r}"
        )
    if max_prompts is not None and len(df) > max_prompts:
        df = df.sample(n=max_prompts, random_state=seed).reset_index(drop=True)
    return df.to_dict("records")


def eligible_rows(
    labelled: pd.DataFrame, holdout: Mapping[str, Any], outcomes: str = "all"
) -> pd.DataFrame:
    """The policy pool's rows (`data/holdout.json`'s `policy`, `data.splits.carve_policy_pool`):
    the only historical rows SFT, `sft_met`, the offline methods, ILHF's pairs and the MLE
    references learn from. No reward model, audit or reference row is among them.

    `outcomes='met'` keeps MET rows only.
    """
    if "policy" not in holdout:
        raise KeyError("data/holdout.json has no 'policy' pool; rerun notebook 01")
    rows = labelled[labelled["row_id"].isin(set(holdout["policy"]))]
    if outcomes == "met":
        rows = rows[rows["y"] == 1]
    elif outcomes != "all":
        raise ValueError(f"outcomes={outcomes!r}; expected 'all' or 'met'")
    return rows.reset_index(drop=True)


def heldout_rows(
    labelled: pd.DataFrame, contexts: pd.DataFrame, max_rows: int | None, seed: int
) -> pd.DataFrame:
    """Historical descriptions of held-out (eval) countries: never seen by SFT or RL."""
    eval_countries = set(contexts.loc[contexts["split"] == "eval", "country"])
    rows = labelled[labelled["country"].isin(eval_countries)]
    if max_rows is not None and len(rows) > max_rows:
        rows = rows.sample(n=max_rows, random_state=seed)
    return rows.reset_index(drop=True)
