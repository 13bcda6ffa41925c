"""What every risk family shares: the error type, notes for missing inputs, column checks, the
binary metrics of a P(MET) column (from `reward`, the one place they are defined), correlations,
which notebook-04 policies are generated or tuned, and interval helpers for verdicts.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import pandas as pd

from rlxf_utils.reward.calibration import classification_metrics

#: Policies of notebook 04 whose names start with this are historical conditions, not generated.
HISTORY_PREFIX = "history"


#: Policies of notebook 04 that are neither generated nor historical (a reference).
NON_GENERATED = frozenset({"random_policy"})


#: Generated policies that are not tuned by RL (the start and the best-of-N selection of it).
UNTUNED = frozenset({"base", "sft", "sft_met", "best_of_n"})


#: Columns of `binary_metrics` besides `n`.
METRIC_KEYS = ("met_rate", "mean_p", "calibration_gap", "accuracy", "auc", "brier", "ece")


class RiskError(ValueError):
    """An input the risk stage cannot use; the message names the file or field and what was expected."""


def missing_note(artifact: str, notebook: str = "notebook 04", **detail: Any) -> dict[str, Any]:
    """The note stored when an earlier notebook's artifact is absent: its fields (`note`: the
    kind, 'missing'), which the report and notebook 05 put into words (`report.risk.note_text`,
    `reports/templates/risk.jinja`); no stage stores a sentence."""
    return {"note": "missing", "artifact": artifact, "notebook": notebook, **detail}


def note_table(note: dict[str, Any]) -> pd.DataFrame:
    """A one-row table that says why a measurement is absent (written instead of a hole): the
    note's fields, a list as its text."""
    return pd.DataFrame([{k: str(v) if isinstance(v, list) else v for k, v in note.items()}])


def require_columns(df: pd.DataFrame, columns: Iterable[str], where: str) -> None:
    """RiskError naming `where`, the missing columns and those found, when any is absent."""
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise RiskError(f"{where}: missing column(s) {missing}; found {list(df.columns)}")


def binary_metrics(y: Sequence[int], p: Sequence[float], n_bins: int = 10) -> dict[str, float]:
    """n, observed MET rate, mean P(MET), calibration gap (mean p - rate), accuracy, AUC, Brier, ECE.

    Accuracy, AUC (NaN with one class), Brier and ECE are `reward.calibration.classification_metrics`'.
    """
    y_arr = np.asarray(y, dtype=int)
    p_arr = np.asarray(p, dtype=float)
    if y_arr.size == 0:
        return {"n": 0} | dict.fromkeys(METRIC_KEYS, math.nan)
    m = classification_metrics(y_arr, p_arr, n_bins=n_bins)
    met_rate, mean_p = float(y_arr.mean()), float(p_arr.mean())
    return {
        "n": int(y_arr.size),
        "met_rate": met_rate,
        "mean_p": mean_p,
        "calibration_gap": mean_p - met_rate,
        "accuracy": m["accuracy"],
        "auc": m["roc_auc"],
        "brier": m["brier"],
        "ece": m["ece"],
    }


def clusters_of(df: pd.DataFrame, column: str = "arrangement_id") -> np.ndarray:
    """Cluster labels for a bootstrap: `column` when the table has it, else one per row."""
    if column in df.columns:
        return df[column].astype(str).to_numpy()
    return np.arange(len(df))


def prediction_column(reward_source: str) -> str:
    """Column of `reward/predictions_<protocol>.parquet` holding the RL reward model's P(MET)."""
    if not reward_source or not reward_source.replace("_", "").isalnum():
        raise RiskError(
            f"reward_source {reward_source!r}; expected 'encoder', 'tfidf' or a compared encoder's name"
        )
    return f"p_{reward_source}"


def generated_policies(policies: Iterable[str]) -> list[str]:
    """Policies that generated their responses: not `history*`, not `random_policy` (order kept)."""
    return [
        p
        for p in dict.fromkeys(str(x) for x in policies)
        if not p.startswith(HISTORY_PREFIX) and p not in NON_GENERATED
    ]


def policy_kind(policy: str, reference: str | None = None) -> str:
    """'reference', 'history', 'random' or 'generated': how a notebook-04 policy made its texts."""
    if policy == reference:
        return "reference"
    if policy.startswith(HISTORY_PREFIX):
        return "history"
    if policy in NON_GENERATED:
        return "random"
    return "generated"


def tuned_policies(policies: Iterable[str]) -> list[str]:
    """Generated policies changed by RL (not `base`, `sft`, `sft_met` or `best_of_n`)."""
    return [p for p in generated_policies(policies) if p not in UNTUNED]


def start_policy(run: Any) -> str:
    """The policy RL started from, as notebook 04 recorded it (older runs: 'base')."""
    if run.exists("eval/summary.json"):
        return str(run.read_json("eval/summary.json").get("start_policy", "base"))
    return "base"
