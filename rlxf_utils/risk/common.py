"""What every risk family shares: the error type, notes for missing inputs, column checks, the
binary metrics of a P(MET) column (from `reward`, the one place they are defined), correlations,
which notebook-04 policies are generated or tuned, and interval helpers for verdicts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

import numpy as np
import pandas as pd
from scipy import stats

from ..evaluation import bootstrap_ci, ci_sign, cluster_bootstrap
from ..reward import classification_metrics

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


def missing_note(artifact: str, notebook: str = "notebook 04") -> str:
    """The visible note shown (and stored) when an earlier notebook's artifact is absent."""
    return f"{notebook} did not run: {artifact} missing"


def note_table(note: str) -> pd.DataFrame:
    """A one-row table that says why a measurement is absent (written instead of a hole)."""
    return pd.DataFrame({"note": [note]})


def require_columns(df: pd.DataFrame, columns: Iterable[str], where: str) -> None:
    """RiskError naming `where`, the missing columns and those found, when any is absent."""
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise RiskError(f"{where}: missing column(s) {missing}; found {list(df.columns)}")


def binary_metrics(y: Sequence[int], p: Sequence[float], n_bins: int = 10) -> dict[str, float]:
    """n, observed MET rate, mean P(MET), calibration gap (mean p - rate), accuracy, AUC, Brier, ECE.

    Accuracy, AUC (NaN with one class), Brier and ECE are `reward.classification_metrics`'.
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


def corr(x: Any, y: Any) -> tuple[float, float, float, float]:
    """Spearman rho, its p, Pearson r, its p; NaN when fewer than 3 points or a constant side.

    The p-values treat the points as independent: quote them only where they are (e.g. one
    point per country), never over several responses to one prompt.
    """
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    ok = ~(np.isnan(x) | np.isnan(y))
    x, y = x[ok], y[ok]
    if x.size < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return (math.nan, math.nan, math.nan, math.nan)
    s = stats.spearmanr(x, y)
    r = stats.pearsonr(x, y)
    return (float(s.statistic), float(s.pvalue), float(r.statistic), float(r.pvalue))


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman rho of two aligned arrays (NaN as in `corr`): Pearson's r of average ranks.

    The same number as `scipy.stats.spearmanr`, without its overhead (bootstraps call it often).
    """
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    ok = ~(np.isnan(x) | np.isnan(y))
    x, y = x[ok], y[ok]
    if x.size < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return math.nan
    return float(np.corrcoef(stats.rankdata(x), stats.rankdata(y))[0, 1])


def spearman_ci(
    x: Any, y: Any, clusters: Any, alpha: float = 0.05, n_boot: int = 2000, seed: int = 0
) -> tuple[float, float, float]:
    """(Spearman rho, low, high): the interval resamples whole clusters (e.g. prompts)."""
    xa, ya = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    return stat_ci(lambda i: spearman(xa[i], ya[i]), clusters, alpha, n_boot, seed)


def mean_ci(
    values: Any, clusters: Any = None, alpha: float = 0.05, n_boot: int = 2000, seed: int = 0
) -> tuple[float, float, float]:
    """(mean, low, high): percentile bootstrap at level 1 - alpha, whole clusters resampled.

    Fewer than two clusters (or values) carry no information on the spread: the interval is NaN.
    """
    x = np.asarray(values, dtype=float)
    g = np.arange(x.size) if clusters is None else np.asarray(clusters)
    est = bootstrap_ci(
        x, n_boot=n_boot, alpha=alpha, seed=seed, clusters=None if clusters is None else g
    )
    return est if _n_clusters(g[~np.isnan(x)]) >= 2 else (est[0], math.nan, math.nan)


def _n_clusters(clusters: np.ndarray) -> int:
    return int(np.unique(clusters).size) if clusters.size else 0


def stat_ci(
    stat: Callable[[np.ndarray], float],
    clusters: Sequence[Hashable] | np.ndarray,
    alpha: float = 0.05,
    n_boot: int = 2000,
    seed: int = 0,
) -> tuple[float, float, float]:
    """(statistic, low, high) of `stat(row indices)`, resampling whole clusters (`evaluation`).

    Fewer than two clusters give a NaN interval (no information on the spread).
    """
    g = np.asarray(clusters)
    est = cluster_bootstrap(stat, g, n_boot=n_boot, alpha=alpha, seed=seed)
    return est if _n_clusters(g) >= 2 else (est[0], math.nan, math.nan)


sign_of = ci_sign  # +1 / -1 / 0 from an interval: one rule for the whole study (evaluation)


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
