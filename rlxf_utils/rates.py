"""Tests on MET rates (notebook 01 and the report's data section): trend, shift, heterogeneity.

Conditions of one programme are reviewed together and repeat each other, so they are not
independent draws: every test here uses cluster-robust (sandwich) variances with the
arrangement as the cluster (small-sample factor G / (G - 1)). The sentences that describe a
result are chosen from these tests at `alpha`, never from the sign of a point estimate.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
import pandas as pd
from scipy import stats

from .evaluation import check_alpha, level

__all__ = ["data_findings", "rate_heterogeneity", "rate_shift", "rate_trend", "wilson_z"]


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
    min_n: int = 20,
) -> dict[str, float]:
    """Do MET rates differ across groups? Cluster-robust Wald test that all group rates are equal.

    Groups with fewer than `min_n` conditions are left out (their rates are too noisy to test).
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


def _p(p: float) -> str:
    return "n/a" if not np.isfinite(p) else ("< 0.001" if p < 0.001 else f"= {p:.3f}")


def data_findings(
    labelled: pd.DataFrame, cutoff: int, alpha: float = 0.05, min_n: int = 20
) -> dict[str, Any]:
    """The data section's tested statements: trend over years, shift at the cut-off, differences
    across economic areas and arrangement types, as numbers and as sentences chosen at `alpha`."""
    lvl = level(alpha)
    dated = labelled.dropna(subset=["test_year"])
    y, cl = dated["y"].astype(float), dated["arrangement_id"].astype(str)
    trend = rate_trend(y, dated["test_year"].astype(float), cl, alpha)
    shift = rate_shift(y, dated["test_year"].astype(float) > cutoff, cl, alpha)
    areas = rate_heterogeneity(
        labelled["y"].astype(float),
        labelled["econ_descriptor"].astype(str),
        labelled["arrangement_id"].astype(str),
        min_n,
    )
    types = rate_heterogeneity(
        labelled["y"].astype(float),
        labelled["arrangement_type"].astype(str),
        labelled["arrangement_id"].astype(str),
        min_n,
    )
    if trend["p_value"] < alpha:
        word = "rises" if trend["or_low"] > 1 else "falls"
        trend_s = f"The MET rate {word} over the test years"
    else:
        trend_s = f"The MET rate has no linear trend over the test years significant at the {alpha:.0%} level"
    trend_s += (
        f" (odds ratio per year {trend['odds_ratio_per_year']:.3f}, {lvl} CI "
        f"[{trend['or_low']:.3f}, {trend['or_high']:.3f}], p {_p(trend['p_value'])})"
    )
    shift_word = (
        ("significantly higher" if shift["diff_low"] > 0 else "significantly lower")
        if shift["p_value"] < alpha
        else "not significantly different"
    )
    shift_s = (
        f"conditions due after {cutoff} are met {shift['rate_after']:.1%} of the time against "
        f"{shift['rate_before']:.1%} up to {cutoff}, {shift_word} "
        f"(difference {100 * shift['diff']:+.1f} points, {lvl} CI [{100 * shift['diff_low']:+.1f}, "
        f"{100 * shift['diff_high']:+.1f}], p {_p(shift['p_value'])})"
    )

    def het(r: dict[str, float], what: str) -> str:
        if r["groups"] < 2:
            return f"too few {what} hold {min_n} conditions to test whether MET rates differ across them"
        verdict = "differ" if r["p_value"] < alpha else "do not differ significantly"
        return (
            f"MET rates {verdict} across {what} ({r['groups']} with at least {min_n} conditions; "
            f"cluster-robust Wald χ²({r['df']}) = {r['wald']:.1f}, p {_p(r['p_value'])})"
        )

    return {
        "alpha": alpha,
        "level": lvl,
        "trend": trend,
        "shift": shift,
        "areas": areas,
        "arrangement_types": types,
        "trend_sentence": trend_s,
        "shift_sentence": shift_s,
        "area_sentence": het(areas, "economic areas"),
        "arrangement_type_sentence": het(types, "arrangement types"),
    }
