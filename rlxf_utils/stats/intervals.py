"""Confidence intervals and the rule that reads a verdict from one: percentile and basic
bootstrap, the cluster bootstrap (countries, arrangements), t intervals for means, and the sign an
interval supports. Every interval of the study is computed here."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

import numpy as np
from scipy import stats as sps

#: Resamples the percentile bootstrap needs beyond each bound of an interval (`tail_resamples`).
TAIL_RESAMPLES = 50


def bootstrap_ci(
    values: Iterable[float],
    n_boot: int = 2000,
    alpha: float = 0.05,
    seed: int = 0,
    chunk: int = 2_000_000,
    clusters: Sequence[Hashable] | np.ndarray | None = None,
) -> tuple[float, float, float]:
    """Percentile bootstrap of the mean: (mean, low, high) at level 1 - alpha; NaNs are dropped.
    (`bootstrap_reps` for the replicates themselves; see it for the cluster bootstrap.)"""
    check_alpha(alpha)
    mean, reps = bootstrap_reps(values, n_boot, seed, chunk, clusters)
    if reps.size == 0:
        return (mean, mean, mean)
    low, high = np.quantile(reps, [alpha / 2, 1 - alpha / 2])
    return (mean, float(low), float(high))


def bootstrap_reps(
    values: Iterable[float],
    n_boot: int = 2000,
    seed: int = 0,
    chunk: int = 2_000_000,
    clusters: Sequence[Hashable] | np.ndarray | None = None,
) -> tuple[float, np.ndarray]:
    """(mean, bootstrap replicates of the mean); NaNs are dropped. No replicates (an empty
    array) when fewer than two units are left: the mean alone (NaN when none).

    With `clusters` (one label per value, e.g. the prompt's country), whole clusters are
    resampled and each resample's statistic is the mean of the values it holds: values that
    share a cluster are correlated, and treating them as independent makes the interval too
    narrow. Resampling is vectorised in chunks of at most `chunk` drawn indices, so memory stays
    bounded; the result depends only on (values, clusters, n_boot, seed).
    """
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1; got {n_boot}")
    x = np.asarray(list(values) if not isinstance(values, np.ndarray) else values, dtype=float)
    if clusters is not None:
        g = np.asarray(list(clusters) if not isinstance(clusters, np.ndarray) else clusters)
        if g.shape != x.shape:
            raise ValueError(f"clusters need one label per value; got {g.shape} for {x.shape}")
        keep = ~np.isnan(x)
        x, g = x[keep], g[keep]
        if x.size == 0:
            return (math.nan, np.empty(0))
        _, inv = np.unique(g, return_inverse=True)
        return _resampled_means(x, np.bincount(inv, weights=x), np.bincount(inv).astype(float),
                                n_boot, seed, chunk)  # fmt: skip
    x = x[~np.isnan(x)]
    return _resampled_means(x, x, np.ones(x.size), n_boot, seed, chunk)


def _resampled_means(
    x: np.ndarray,
    sums: np.ndarray,
    counts: np.ndarray,
    n_boot: int,
    seed: int,
    chunk: int,
) -> tuple[float, np.ndarray]:
    """(mean of x, replicates) resampling units with replacement; each unit carries the sum and
    count of its values (one value per unit for the plain bootstrap, a cluster's otherwise)."""
    c = sums.size
    if c == 0:
        return (math.nan, np.empty(0))
    mean = float(x.mean())
    if c == 1:
        return (mean, np.empty(0))
    rng = np.random.default_rng(seed)
    rows = max(1, chunk // c)
    means = np.empty(n_boot)
    for start in range(0, n_boot, rows):
        stop = min(n_boot, start + rows)
        idx = rng.integers(0, c, size=(stop - start, c))
        means[start:stop] = sums[idx].sum(axis=1) / counts[idx].sum(axis=1)
    return (mean, means)


def interval_p(replicates: np.ndarray) -> float:
    """The p-value dual to the percentile interval of `replicates`: the smallest alpha at which
    the interval (`np.quantile`'s linear rule, level 1 - alpha) excludes 0, i.e. 2 x the smaller
    of the quantile levels at which the replicates' quantile function crosses 0. Exactly:
    `interval_p(r) < a` if and only if that interval at level 1 - a lies above or below 0, so a
    verdict read from the interval can never disagree with this test. NaN without replicates."""
    x = np.sort(np.asarray(replicates, dtype=float))
    x = x[~np.isnan(x)]
    n = x.size
    if n < 2:
        return math.nan
    # q_low: above it the quantile is > 0; q_high: below it the quantile is < 0
    j = int(np.searchsorted(x, 0.0, side="right")) - 1  # last index with x <= 0
    if j < 0:
        q_low = 0.0
    elif j >= n - 1:
        q_low = 1.0
    else:
        q_low = (j + (0.0 - x[j]) / (x[j + 1] - x[j])) / (n - 1)
    i = int(np.searchsorted(x, 0.0, side="left"))  # first index with x >= 0
    if i <= 0:
        q_high = 0.0
    elif i >= n:
        q_high = 1.0
    else:
        q_high = (i - 1 + (0.0 - x[i - 1]) / (x[i] - x[i - 1])) / (n - 1)
    return float(min(1.0, 2 * min(q_low, 1.0 - q_high)))


def family_alpha(alpha: float, m: int) -> float:
    """The one multiplicity rule of the study: a family of m comparisons (one question asked of
    several policies) is Bonferroni-adjusted, each interval at level 1 - alpha / m, so the
    family's intervals hold together with probability at least 1 - alpha, and a verdict word is
    given only where its interval excludes 0 (the family p-value, m x `interval_p`, < alpha)."""
    check_alpha(alpha)
    return alpha / max(int(m), 1)


def check_alpha(alpha: float) -> None:
    """A clear error for a significance level outside (0, 1)."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must lie in (0, 1); got {alpha}")


def cluster_bootstrap(
    stat: Callable[[np.ndarray], float],
    clusters: Sequence[Hashable] | np.ndarray,
    n_boot: int = 2000,
    alpha: float = 0.05,
    seed: int = 0,
) -> tuple[float, float, float]:
    """Percentile bootstrap of any statistic of rows, resampling whole clusters.

    `stat(idx)` computes the statistic on the rows `idx` (indices into the data, repeated when a
    cluster is drawn twice); it is called once on all rows for the point estimate. Resamples whose
    statistic is NaN (e.g. an AUC with one class) are dropped.
    """
    check_alpha(alpha)
    g = np.asarray(list(clusters) if not isinstance(clusters, np.ndarray) else clusters)
    if g.size == 0:
        return (math.nan, math.nan, math.nan)
    _, inv = np.unique(g, return_inverse=True)
    members = [np.flatnonzero(inv == j) for j in range(inv.max() + 1)]
    point = float(stat(np.arange(g.size)))
    rng = np.random.default_rng(seed)
    vals = []
    for _ in range(n_boot):
        pick = rng.integers(0, len(members), size=len(members))
        v = stat(np.concatenate([members[j] for j in pick]))
        if not math.isnan(v):
            vals.append(v)
    if not vals:
        return (point, math.nan, math.nan)
    low, high = np.quantile(vals, [alpha / 2, 1 - alpha / 2])
    return (point, float(low), float(high))


def contrast_bootstrap(
    values: Any, in_a: Any, clusters: Any, n_boot: int = 2000, alpha: float = 0.05, seed: int = 0
) -> tuple[float, float, float]:
    """(mean of the `in_a` values minus mean of the others, low, high): `cluster_bootstrap` of
    that contrast, vectorised (each cluster carries its sums and counts in both groups), so a
    family's tail count of resamples (`tail_resamples`) costs milliseconds. Resamples with an
    empty group are dropped, as `cluster_bootstrap` drops NaN statistics."""
    check_alpha(alpha)
    x = np.asarray(values, dtype=float)
    a = np.asarray(in_a, dtype=bool)
    g = np.asarray(clusters)
    if x.size == 0 or a.all() or not a.any():
        return (math.nan, math.nan, math.nan)
    point = float(x[a].mean() - x[~a].mean())
    _, inv = np.unique(g, return_inverse=True)
    parts = [
        np.bincount(inv, weights=w) for w in (x * a, a.astype(float), x * ~a, (~a).astype(float))
    ]
    rng = np.random.default_rng(seed)
    k = parts[0].size
    reps = np.empty(n_boot)
    rows = max(1, 2_000_000 // k)
    for start in range(0, n_boot, rows):
        stop = min(n_boot, start + rows)
        idx = rng.integers(0, k, size=(stop - start, k))
        sa, na, sb, nb = (p[idx].sum(axis=1) for p in parts)
        with np.errstate(invalid="ignore", divide="ignore"):
            reps[start:stop] = np.where((na > 0) & (nb > 0), sa / na - sb / nb, np.nan)
    reps = reps[~np.isnan(reps)]
    if reps.size == 0:
        return (point, math.nan, math.nan)
    low, high = np.quantile(reps, [alpha / 2, 1 - alpha / 2])
    return (point, float(low), float(high))


def level(alpha: float) -> str:
    """The confidence level as prose and captions write it: alpha 0.05 -> '95%', 0.025 -> '97.5%'."""
    check_alpha(alpha)
    return f"{1 - alpha:.0%}" if round(100 * (1 - alpha), 6).is_integer() else f"{1 - alpha:.1%}"


def level_span(ci_levels: Any, missing: str = "family-level") -> str:
    """The levels of several intervals as a caption states them: '99.2%' where they share one,
    '99.0% to 99.4%' where they differ (families of different sizes), `missing` where none is
    recorded (NaNs are ignored)."""
    v = np.asarray(list(ci_levels), dtype=float).ravel()
    v = v[~np.isnan(v)]
    if v.size == 0:
        return missing
    low, high = level(1 - float(v.min())), level(1 - float(v.max()))
    return low if low == high else f"{low} to {high}"


def ci_sign(low: Any, high: Any) -> int:
    """+1 when the interval lies above 0, -1 below, 0 when it holds 0 or a bound is missing."""
    if not all(isinstance(v, numbers.Real) and not math.isnan(v) for v in (low, high)):
        return 0
    return 1 if low > 0 else -1 if high < 0 else 0


def basic_ci(point: float, replicates: np.ndarray, alpha: float) -> tuple[float, float]:
    """Basic (reverse-percentile) interval 2 * point - quantiles: reflects a resampling bias back.

    Used for ECE: |sum of residuals| per bin grows with noise, so a resampled ECE sits above
    the estimate on average and a percentile interval of ECE (or of a difference of ECEs) is
    shifted by that bias; the basic interval is not.
    """
    low, high = percentile_ci(replicates, alpha)
    return 2 * point - high, 2 * point - low


def percentile_ci(replicates: np.ndarray, alpha: float) -> tuple[float, float]:
    """Percentile interval of bootstrap replicates (NaN replicates dropped; NaN when none left)."""
    check_alpha(alpha)
    r = np.asarray(replicates, dtype=float)
    r = r[~np.isnan(r)]
    if r.size < 2:
        return (math.nan, math.nan)
    low, high = np.quantile(r, [alpha / 2, 1 - alpha / 2])
    return float(low), float(high)


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


def tail_resamples(alpha: float, beyond: int = TAIL_RESAMPLES) -> int:
    """Bootstrap resamples for a percentile interval at level 1 - alpha to rest on at least
    `beyond` resamples past each bound: B >= beyond / (alpha / 2). A family's interval sits at
    alpha / m (`family_alpha`), so the count grows with the family: at alpha 0.05 and m = 10,
    20,000 where a fixed 2,000 leaves 5 resamples per tail."""
    check_alpha(alpha)
    return int(math.ceil(beyond / (alpha / 2) - 1e-9))


def cluster_t(values: Any, clusters: Any = None, alpha: float = 0.05) -> dict[str, float]:
    """The mean of `values` (each unit weighs the same) with a cluster-robust t interval:
    `mean`, `low`, `high`, `se`, `df`, `t`, `p` (two-sided, dual to the interval: `p < alpha`
    exactly when it excludes 0), `rho` and `n_clusters`. NaNs are dropped; without `clusters`
    every value is its own cluster (the interval is then the ordinary one-sample t interval).

    The variance is the CR2 sandwich of Bell and McCaffrey (2002) for a mean: with residuals
    e_i = x_i - mean, cluster sums S_g and sizes n_g of N values,

        Var = sum_g S_g^2 / (1 - n_g / N) / N^2

    (equal clusters: the CR1 variance G / (G - 1) x CR0), with t quantiles on Bell and
    McCaffrey's degrees of freedom as Imbens and Kolesár (2016) recommend (`bm_df`, with the
    within-cluster correlation `rho` estimated from the values): G - 1 when the clusters are
    equal, fewer when a few large clusters carry the estimate.

    Why this rather than a percentile cluster bootstrap for the study's paired gains: with 17
    countries, resampling whole countries under-covers (the bootstrap variance of a mean of G
    clusters is the plug-in one, (G - 1) / G of the unbiased, and its percentile quantiles are
    normal-like where a t applies: both narrow the interval, most in the far tails), and a
    Bonferroni family's intervals at 1 - alpha / m sit in tails (0.25% at m = 10) that 2,000
    resamples describe with 5 draws. Why not G - 1 degrees of freedom: the evaluation's
    countries hold 1 to 8 prompts, and with such unequal clusters the CR2 variance rests on the
    few large ones; in simulations of that design (48 prompts in 17 countries, a family of 10)
    t with G - 1 df held the family's 95% only 90-94% of the time, Bell and McCaffrey's df
    96-99%, and the percentile bootstrap with 2,000 resamples 88% (tests/test_power.py). The t
    interval costs one pass. Fewer than two clusters give a NaN interval (no information on the
    spread); a zero spread gives the point as its interval and p = 1 (mean 0) or 0.
    """
    check_alpha(alpha)
    x = np.asarray(values, dtype=float)
    g = np.arange(x.size) if clusters is None else np.asarray(clusters)
    if g.shape != x.shape:
        raise ValueError(f"clusters need one label per value; got {g.shape} for {x.shape}")
    keep = ~np.isnan(x)
    x, g = x[keep], g[keep]
    n = x.size
    out = {"mean": float(x.mean()) if n else math.nan, "low": math.nan, "high": math.nan,
           "se": math.nan, "df": math.nan, "t": math.nan, "p": math.nan, "rho": math.nan,
           "n_clusters": 0}  # fmt: skip
    if n == 0:
        return out
    _, inv = np.unique(g, return_inverse=True)
    sizes = np.bincount(inv).astype(float)
    out["n_clusters"] = int(sizes.size)
    if sizes.size < 2:
        return out
    mean = out["mean"]
    sums = np.bincount(inv, weights=x - mean)
    se = math.sqrt(max(float(np.sum(sums**2 / (1.0 - sizes / n))) / n**2, 0.0))
    rho = intraclass_correlation(x, inv)
    df = bm_df(sizes, rho)
    out.update(se=se, df=df, rho=rho)
    if se <= 1e-15 * max(1.0, abs(mean)):
        out.update(low=mean, high=mean, t=0.0 if mean == 0 else math.copysign(math.inf, mean),
                   p=1.0 if mean == 0 else 0.0)  # fmt: skip
        return out
    q = float(sps.t.ppf(1 - alpha / 2, df))
    t = mean / se
    out.update(low=mean - q * se, high=mean + q * se, t=t, p=float(2 * sps.t.sf(abs(t), df)))
    return out


def contrast_t(values: Any, in_a: Any, clusters: Any = None, alpha: float = 0.05) -> dict[str, float]:  # fmt: skip
    """The difference of two group means, the `in_a` values' mean minus the others' (each unit
    weighs the same within its group), with `cluster_t`'s interval applied to its linearisation:
    unit i carries d + N (a_i (x_i - m_a) / n_a - b_i (x_i - m_b) / n_b), whose mean is the
    difference d and whose cluster sums are the contrast's, so a cluster that holds units of
    both groups enters once, as in `contrast_bootstrap`. Keys as `cluster_t`'s (`mean` is the
    difference); NaN where a group is empty. For the few-cluster contrasts of the study (easy
    against hard prompts, 17 uneven countries) it holds its level where the percentile bootstrap
    falls short (tests/test_levels.py)."""
    x = np.asarray(values, dtype=float)
    a = np.asarray(in_a, dtype=bool)
    if a.shape != x.shape:
        raise ValueError(f"in_a needs one flag per value; got {a.shape} for {x.shape}")
    keep = ~np.isnan(x)
    x, a = x[keep], a[keep]
    g = None if clusters is None else np.asarray(clusters)[keep]
    if not a.any() or a.all():
        return cluster_t(np.array([]), None, alpha)
    m_a, m_b = x[a].mean(), x[~a].mean()
    lin = (m_a - m_b) + x.size * np.where(a, (x - m_a) / a.sum(), -(x - m_b) / (~a).sum())
    return cluster_t(lin, g, alpha)


def intraclass_correlation(values: np.ndarray, cluster_index: np.ndarray) -> float:
    """One-way ANOVA estimate of the share of the variance that lies between clusters
    (`cluster_index`: 0..G-1 per value), truncated to [0, 1]; 0 without the degrees of freedom
    to tell."""
    x = np.asarray(values, dtype=float)
    sizes = np.bincount(cluster_index).astype(float)
    n, k = x.size, int((sizes > 0).sum())
    if k < 2 or n <= k:
        return 0.0
    means = np.bincount(cluster_index, weights=x)[sizes > 0] / sizes[sizes > 0]
    ms_between = float((sizes[sizes > 0] * (means - x.mean()) ** 2).sum()) / (k - 1)
    ms_within = float(((x - (np.bincount(cluster_index, weights=x) / np.maximum(sizes, 1))[cluster_index]) ** 2).sum()) / (n - k)  # fmt: skip
    n0 = (n - float((sizes**2).sum()) / n) / (k - 1)
    between = max((ms_between - ms_within) / n0, 0.0)
    total = between + ms_within
    return float(min(between / total, 1.0)) if total > 0 else 0.0


def bm_df(cluster_sizes: Any, rho: float = 0.0) -> float:
    """Bell and McCaffrey's degrees of freedom of the CR2 t for a mean over units in clusters
    of `cluster_sizes`, under a working model of equicorrelation `rho` within a cluster
    (Imbens and Kolesár, 2016): (tr M)^2 / tr(M^2) with M = G' Omega G. For a mean, with
    n the sizes, N their sum and D = diag(1 / (N sqrt(1 - n_g / N))), K = diag(n) - n n' / N,

        M = D ((1 - rho) K + rho K^2) D.

    Equal clusters give G - 1 whatever rho; unequal ones fewer."""
    n = np.asarray(cluster_sizes, dtype=float)
    n = n[n > 0]
    if n.size < 2:
        return math.nan
    total = n.sum()
    d = 1.0 / (total * np.sqrt(1.0 - n / total))
    k = np.diag(n) - np.outer(n, n) / total
    m = d[:, None] * ((1.0 - rho) * k + rho * k @ k) * d[None, :]
    tr2 = float(np.trace(m @ m))
    return float(np.trace(m) ** 2 / tr2) if tr2 > 0 else float(n.size - 1)


def bm_df_moments(cluster_sizes: Any, rho: float = 0.0) -> float:
    """`bm_df` from sums over the clusters, in O(G) where the matrices cost O(G^3) (0.9 s at
    2,000 clusters, about 13 s at 5,000): for searches over designs with thousands of
    hypothetical countries (`evaluation.design.countries_needed`). It equals `bm_df` to
    rounding (1e-12 relative in tests/test_power.py); the study's intervals keep `bm_df`, whose
    numbers every earlier run printed.

    With w_g = d_g^2 and r = rho / N, the matrix A = (1 - rho) K + rho K^2 of `bm_df` is
    diag(a) + B with a_g = (1 - rho) n_g + rho n_g^2 and B_gh = n_g n_h (c - r (n_g + n_h)),
    c = -(1 - rho) / N + rho sum(n^2) / N^2. So tr M = sum_g w_g (a_g + B_gg) and
    tr M^2 = sum_g w_g^2 (a_g^2 + 2 a_g B_gg) + sum_gh w_g w_h B_gh^2, whose last sum is, with
    q_g = w_g n_g^2 and Q_j = sum_g q_g n_g^j,
    c^2 Q_0^2 - 4 c r Q_0 Q_1 + 2 r^2 (Q_0 Q_2 + Q_1^2)."""
    n = np.asarray(cluster_sizes, dtype=float)
    n = n[n > 0]
    if n.size < 2:
        return math.nan
    total = n.sum()
    w = 1.0 / (total * total * (1.0 - n / total))
    r = rho / total
    c = -(1.0 - rho) / total + rho * float((n * n).sum()) / total**2
    a = (1.0 - rho) * n + rho * n * n
    b = n * n * (c - 2.0 * r * n)
    q = w * n * n
    q0, q1, q2 = float(q.sum()), float((q * n).sum()), float((q * n * n).sum())
    off = c * c * q0 * q0 - 4.0 * c * r * q0 * q1 + 2.0 * r * r * (q0 * q2 + q1 * q1)
    tr = float((w * (a + b)).sum())
    tr2 = float((w * w * (a * a + 2.0 * a * b)).sum()) + off
    return tr * tr / tr2 if tr2 > 0 else float(n.size - 1)


def null_bound(low: float, high: float, direction: int = 1) -> float:
    """The largest effect in the direction of interest that an interval still allows: its upper
    end for a gain (`direction` +1), its lower end for a loss (-1). A verdict of 'not
    distinguishable' is stated with it: 'a gain of at most +0.004'."""
    return high if direction >= 0 else low


#: The verdict values of `bound_verdict`.
VERDICTS = ("above", "below", "equivalent", "not distinguishable")


def bound_verdict(low: Any, high: Any, margin: float | None = None) -> str:
    """What an interval of a difference says, one of `VERDICTS`: 'above' / 'below' when it
    excludes 0 (the study's one rule, `ci_sign`: the direction comes first, however small, and
    its bound says how small); otherwise 'equivalent' when it lies wholly within +/- `margin`
    (two one-sided tests at the interval's level: every effect the data allow is smaller than
    the smallest one a reader would care about), else 'not distinguishable' (too small to see
    at this sample size, not shown to be absent). A missing bound or margin: no equivalence."""
    sign = ci_sign(low, high)
    if sign:
        return VERDICTS[0] if sign > 0 else VERDICTS[1]
    if (
        margin is not None
        and all(isinstance(v, numbers.Real) and not math.isnan(v) for v in (low, high, margin))
        and -margin <= low
        and high <= margin
    ):
        return VERDICTS[2]
    return VERDICTS[3]


sign_of = ci_sign  # +1 / -1 / 0 from an interval: one rule for the whole study (evaluation)
