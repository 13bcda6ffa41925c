"""Rates of a binary outcome: Wilson intervals by group, and the trend, shift and heterogeneity
tests of a rate with arrangement-clustered (sandwich) standard errors."""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
import pandas as pd
from scipy import stats

from rlxf_utils.stats.intervals import VERDICTS, check_alpha


def wilson_z(alpha: float) -> float:
    """The normal quantile of a two-sided interval at level 1 - alpha (1.96 for alpha 0.05)."""
    check_alpha(alpha)
    return float(stats.norm.ppf(1 - alpha / 2))


def _arrays(
    y: Sequence[float], clusters: Sequence[Hashable], *others: Sequence[Any]
) -> tuple[np.ndarray, np.ndarray, int]:
    y = np.asarray(y, dtype=float)
    if any(len(o) != len(y) for o in (clusters, *others)):
        raise ValueError("y, clusters and covariates must have the same length")
    if len(y) == 0:
        raise ValueError("no rows to test")
    codes, uniq = pd.factorize(pd.Series(list(clusters)))
    return y, codes, len(uniq)


def _sandwich(x: np.ndarray, resid: np.ndarray, bread: np.ndarray, codes: np.ndarray, g: int):
    """Cluster-robust covariance bread @ (sum_c s_c s_c') @ bread * G / (G - 1)."""
    scores = np.zeros((g, x.shape[1]))
    np.add.at(scores, codes, x * resid[:, None])
    meat = scores.T @ scores
    return bread @ meat @ bread * (g / (g - 1) if g > 1 else math.nan)


def rate_trend(
    y: Sequence[float], year: Sequence[float], clusters: Sequence[Hashable], alpha: float = 0.05
) -> dict[str, float]:
    """Logistic regression of MET on year: odds ratio per year with a cluster-robust CI and p."""
    y, codes, g = _arrays(y, clusters, year)
    t = np.asarray(year, dtype=float)
    x = np.column_stack([np.ones_like(t), t - t.mean()])
    beta = np.zeros(2)
    for _ in range(100):  # Newton / IRLS
        p = 1 / (1 + np.exp(-(x @ beta)))
        h = x.T @ (x * (p * (1 - p))[:, None])
        step = np.linalg.solve(h, x.T @ (y - p))
        beta += step
        if np.abs(step).max() < 1e-10:
            break
    p = 1 / (1 + np.exp(-(x @ beta)))
    bread = np.linalg.inv(x.T @ (x * (p * (1 - p))[:, None]))
    v = _sandwich(x, y - p, bread, codes, g)
    se = math.sqrt(v[1, 1])
    z = wilson_z(alpha)
    return {
        "log_odds_per_year": float(beta[1]),
        "odds_ratio_per_year": math.exp(beta[1]),
        "or_low": math.exp(beta[1] - z * se),
        "or_high": math.exp(beta[1] + z * se),
        "p_value": float(2 * stats.norm.sf(abs(beta[1]) / se)) if se > 0 else math.nan,
        "n": len(y),
        "clusters": g,
    }


def rate_shift(
    y: Sequence[float], after: Sequence[bool], clusters: Sequence[Hashable], alpha: float = 0.05
) -> dict[str, float]:
    """MET rate after minus before a cut-off, with a cluster-robust CI and p (linear probability)."""
    y, codes, g = _arrays(y, clusters, after)
    a = np.asarray(after, dtype=float)
    if a.min() == a.max():
        raise ValueError("rate_shift needs rows on both sides of the cut-off")
    x = np.column_stack([np.ones_like(a), a])
    bread = np.linalg.inv(x.T @ x)
    beta = bread @ x.T @ y
    v = _sandwich(x, y - x @ beta, bread, codes, g)
    se = math.sqrt(v[1, 1])
    z = wilson_z(alpha)
    return {
        "rate_before": float(y[a == 0].mean()),
        "rate_after": float(y[a == 1].mean()),
        "diff": float(beta[1]),
        "diff_low": float(beta[1] - z * se),
        "diff_high": float(beta[1] + z * se),
        "p_value": float(2 * stats.norm.sf(abs(beta[1]) / se)) if se > 0 else math.nan,
        "n_before": int((a == 0).sum()),
        "n_after": int((a == 1).sum()),
    }


def rate_heterogeneity(
    y: Sequence[float],
    groups: Sequence[Hashable],
    clusters: Sequence[Hashable],
    min_n: int,
) -> dict[str, float]:
    """Do MET rates differ across groups? Cluster-robust Wald test that all group rates are equal.

    Groups with fewer than `min_n` conditions (the study passes `risk.min_group_size`) are left out (their rates are too noisy to test).
    Also returns Pearson's chi-square p, which assumes independent conditions, for reference.
    """
    y, _, _ = _arrays(y, clusters, groups)
    frame = pd.DataFrame({"y": y, "g": list(groups), "c": list(clusters)})
    sizes = frame["g"].value_counts()
    frame = frame[frame["g"].isin(sizes.index[sizes >= min_n])]
    k = frame["g"].nunique()
    out: dict[str, float] = {"groups": k, "n": len(frame), "min_n": min_n}
    if k < 2:
        return {**out, "wald": math.nan, "df": 0, "p_value": math.nan, "p_pearson": math.nan}
    gcodes, _ = pd.factorize(frame["g"], sort=True)
    ccodes, cl = pd.factorize(frame["c"])
    yy = frame["y"].to_numpy(dtype=float)
    x = np.eye(k)[gcodes]
    n_g = x.sum(axis=0)
    beta = (x.T @ yy) / n_g  # the group rates
    v = _sandwich(x, yy - x @ beta, np.diag(1 / n_g), ccodes, len(cl))
    r = np.hstack([-np.ones((k - 1, 1)), np.eye(k - 1)])  # rate_j - rate_0, j = 1..k-1
    rv = r @ v @ r.T
    diff = r @ beta
    df = int(np.linalg.matrix_rank(rv))
    wald = float(diff @ np.linalg.pinv(rv) @ diff)
    table = pd.crosstab(frame["g"], frame["y"])
    p_pearson = float(stats.chi2_contingency(table)[1]) if table.shape[1] == 2 else math.nan
    return {
        **out,
        "wald": wald,
        "df": df,
        "p_value": float(stats.chi2.sf(wald, df)) if df else math.nan,
        "p_pearson": p_pearson,
        "rate_min": float(beta.min()),
        "rate_max": float(beta.max()),
    }


def p_verdict(p_value: float, alpha: float, up: bool = True) -> str:
    """The verdict code (`intervals.VERDICTS`) a test earns at `alpha`: where p < alpha, 'above'
    when `up` (the effect's direction: a trend's odds ratio above 1, a shift's interval above 0, a
    spread across groups) else 'below'; otherwise, or with a missing p, 'not distinguishable'."""
    check_alpha(alpha)
    if p_value is None or not p_value < alpha:  # NaN compares False
        return VERDICTS[3]
    return VERDICTS[0] if up else VERDICTS[1]


def rate_by(labelled: pd.DataFrame, column: str, *, z: float) -> pd.DataFrame:
    """Count, MET count, MET rate and its Wilson interval for each value of `column`, at the
    normal quantile `z` (`wilson_z(evaluation.alpha)`)."""
    g = labelled.groupby(column, sort=True)["y"].agg(n="size", n_met="sum").reset_index()
    g["n_met"] = g["n_met"].astype(int)
    p = g["n_met"] / g["n"]
    denom = 1 + z**2 / g["n"]
    centre = (p + z**2 / (2 * g["n"])) / denom
    half = z * np.sqrt(p * (1 - p) / g["n"] + z**2 / (4 * g["n"] ** 2)) / denom
    g["met_rate"] = p
    g["ci_low"] = centre - half
    g["ci_high"] = centre + half
    return g
