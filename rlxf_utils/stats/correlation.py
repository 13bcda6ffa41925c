"""Correlation with intervals: Pearson with Fisher's interval, Spearman with a (cluster)
bootstrap interval."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from scipy import stats

from rlxf_utils.stats.intervals import stat_ci


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
    return float(np.corrcoef(average_ranks(x), average_ranks(y))[0, 1])


def average_ranks(x: np.ndarray) -> np.ndarray:
    """`scipy.stats.rankdata(x)` (ties share their average rank) of a 1-D array without NaNs,
    by scipy's own steps without its checks, which cost 10x the ranking at a bootstrap's sizes:
    the ranks are the same numbers (halves of integer sums, exact in floating point)."""
    order = np.argsort(x, kind="mergesort")
    xs = x[order]
    first = np.r_[True, xs[1:] != xs[:-1]]
    dense = np.empty(x.size, dtype=np.intp)
    dense[order] = np.cumsum(first)
    ends = np.r_[np.flatnonzero(first), x.size]
    return 0.5 * (ends[dense] + ends[dense - 1] + 1)


def spearman_ci(
    x: Any, y: Any, clusters: Any, alpha: float = 0.05, n_boot: int = 2000, seed: int = 0
) -> tuple[float, float, float]:
    """(Spearman rho, low, high): the interval resamples whole clusters (e.g. prompts)."""
    xa, ya = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    return stat_ci(lambda i: spearman(xa[i], ya[i]), clusters, alpha, n_boot, seed)
