"""Paired comparisons of policies on the same prompts: per-prompt means, the paired test with
its interval and effect size (prompt- or cluster-level), Holm's adjustment, and per-policy
summaries with intervals."""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import numpy as np
import pandas as pd
from scipy import stats

from rlxf_utils.stats.intervals import (
    bootstrap_ci,
    bootstrap_reps,
    bound_verdict,
    cluster_t,
    family_alpha,
    interval_p,
    null_bound,
    tail_resamples,
)
from rlxf_utils.stats.power import mde


def _rank_biserial(diff: np.ndarray) -> float:
    """Matched-pairs rank-biserial correlation (W+ - W-) / (W+ + W-), zero differences dropped."""
    d = diff[diff != 0]
    if d.size == 0:
        return 0.0
    ranks = stats.rankdata(np.abs(d))
    w_plus = ranks[d > 0].sum()
    w_minus = ranks[d < 0].sum()
    return float((w_plus - w_minus) / (w_plus + w_minus))


def paired_comparison(
    per_prompt_a: Sequence[float] | np.ndarray,
    per_prompt_b: Sequence[float] | np.ndarray,
    n_boot: int = 2000,
    seed: int = 0,
    alpha: float = 0.05,
    clusters: Sequence[Hashable] | np.ndarray | None = None,
    family_size: int = 1,
    method: str = "t",
    power: float = 0.8,
) -> dict[str, float]:
    """Compare two policies on the same prompts (aligned per-prompt mean rewards), a minus b.

    The verdict's quantities share one unit, the prompt (each weighs the same): the mean
    difference and its interval at the family's level 1 - alpha / family_size
    (`stats.family_alpha`: the study's one multiplicity rule). `method` 't' (the default): the
    cluster-robust t interval (CR2 variance, Bell-McCaffrey degrees of freedom) over the
    `clusters` (one label per prompt such as its country; without them every prompt is its own
    cluster), see `intervals.cluster_t` for why; 'bootstrap': the percentile bootstrap resampling whole
    clusters, with at least `tail_resamples` resamples (50 beyond each bound of the family's
    interval) whatever `n_boot` says. `p_value` is dual to the interval (below alpha / m exactly
    when it excludes 0) and `p_family` = min(1, m x p_value), below alpha exactly when the
    verdict is given; `se` and `df` the standard error and degrees of freedom (t only), `mde`
    the minimum detectable effect at `power` for the family (`power.mde`), and `bound` the
    largest gain the interval allows (`null_bound`: its upper end). Cohen's d_z = mean
    difference / SD of the per-prompt differences, whose sign is the estimate's. Beside them, for
    reference: the paired t-test and Wilcoxon signed-rank p-values and the matched-pairs
    rank-biserial correlation, on per-cluster mean differences (`n_clusters` units) when
    clustered. Fewer than two clusters give no interval, p-value or MDE (NaN): a point is no
    interval, and a verdict must not rest on one. Pairs with a NaN on either side are dropped
    (`n_dropped`). Degenerate cases are answered, not raised: all differences zero gives p = 1
    and d_z = 0; a constant non-zero difference gives p = 0 and d_z = +/-inf.
    """
    if method not in ("t", "bootstrap"):
        raise ValueError(f"method must be 't' or 'bootstrap'; got {method!r}")
    a = np.asarray(per_prompt_a, dtype=float)
    b = np.asarray(per_prompt_b, dtype=float)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"per-prompt arrays must be 1-d and aligned; got {a.shape} vs {b.shape}")
    g = None if clusters is None else np.asarray(clusters)
    if g is not None and g.shape != a.shape:
        raise ValueError(f"clusters need one label per prompt; got {g.shape} for {a.shape}")
    keep = ~(np.isnan(a) | np.isnan(b))
    a, b = a[keep], b[keep]
    diff = a - b
    n = int(diff.size)
    out: dict[str, float] = {
        "n": n,
        "n_dropped": int((~keep).sum()),
        "mean_a": float(a.mean()) if n else math.nan,
        "mean_b": float(b.mean()) if n else math.nan,
    }
    if g is not None:
        g = g[keep]
    a_family = family_alpha(alpha, family_size)
    if method == "t":
        res = cluster_t(diff, g, a_family)
        mean_diff, low, high, p_value = res["mean"], res["low"], res["high"], res["p"]
        se, df = res["se"], res["df"]
    else:
        mean_diff, reps = bootstrap_reps(diff, n_boot=max(n_boot, tail_resamples(a_family)),
                                         seed=seed, clusters=g)  # fmt: skip
        low = high = se = df = math.nan  # one cluster: no replicates, so these stay NaN
        if reps.size > 1:
            low, high = (float(v) for v in np.quantile(reps, [a_family / 2, 1 - a_family / 2]))
            se = float(reps.std(ddof=1))
        p_value = interval_p(reps)
    prompt_sd = float(diff.std(ddof=1)) if n > 1 else math.nan
    out.update(mean_diff=mean_diff, ci_low=low, ci_high=high, family_size=int(family_size),
               ci_level=1 - a_family, method=method, se=se, df=df, p_value=p_value,
               p_family=min(1.0, family_size * p_value) if not math.isnan(p_value) else math.nan,
               mde=mde(se, family_size, alpha, power, df) if not math.isnan(se) else math.nan,
               bound=null_bound(low, high), cohens_dz=_dz(mean_diff, prompt_sd))  # fmt: skip
    if g is not None:
        # the tests' units are the clusters: mean difference per cluster
        frame = pd.DataFrame({"g": g, "a": a, "b": b}).groupby("g", sort=True).mean()
        a, b = frame["a"].to_numpy(), frame["b"].to_numpy()
        diff = a - b
        n = int(diff.size)
        out["n_clusters"] = n
    if n < 2:
        out.update(t_stat=math.nan, p_ttest=math.nan, p_wilcoxon=math.nan)
        out["rank_biserial"] = _rank_biserial(diff) if n else math.nan
        return out
    if np.ptp(diff) <= 1e-12 * max(1.0, float(np.abs(diff).max())):
        # constant differences (up to rounding): ttest_rel gives NaN or noise; the answer is known.
        zero = float(diff.mean()) == 0.0
        out["t_stat"] = 0.0 if zero else math.copysign(math.inf, float(diff.mean()))
        out["p_ttest"] = 1.0 if zero else 0.0
    else:
        res = stats.ttest_rel(a, b)
        out["t_stat"] = float(res.statistic)
        out["p_ttest"] = float(res.pvalue)
    if np.all(diff == 0):
        out["p_wilcoxon"] = 1.0  # no evidence of any shift; scipy would warn or raise
    else:
        out["p_wilcoxon"] = float(stats.wilcoxon(diff, zero_method="wilcox").pvalue)
    out["rank_biserial"] = _rank_biserial(diff)
    return out


def _dz(mean_diff: float, sd: float) -> float:
    """Cohen's d_z on the prompt unit: 0 when nothing differs, +/-inf for a constant non-zero
    difference, NaN without a spread to measure."""
    if math.isnan(mean_diff) or math.isnan(sd):
        return math.nan
    if sd <= 1e-12 * max(1.0, abs(mean_diff)):
        return 0.0 if mean_diff == 0.0 else math.copysign(math.inf, mean_diff)
    return mean_diff / sd


#: How prose names the interval of every paired difference the study reads a verdict from
#: (`paired_comparison`'s default, `intervals.cluster_t`).
PAIRED_INTERVAL = "cluster-robust t"
#: Methods computed beside the verdicts for reference only (`paired_table`'s `p_ttest_holm`,
#: `p_wilcoxon_holm`): prose that names one says it is for reference (tests/test_docs.py).
REFERENCE_ONLY = ("Holm", "Wilcoxon")


def holm(pvalues: Sequence[float] | np.ndarray) -> np.ndarray:
    """Holm-Bonferroni step-down adjusted p-values (monotone, capped at 1); NaNs stay NaN.

    Controls the family-wise error rate across the policies compared with the base, without
    Bonferroni's loss of power. NaN entries are excluded from the family size m.
    """
    p = np.asarray(pvalues, dtype=float)
    out = np.full(p.shape, np.nan)
    ok = np.flatnonzero(~np.isnan(p))
    m = ok.size
    if m == 0:
        return out
    order = ok[np.argsort(p[ok], kind="stable")]
    scaled = p[order] * (m - np.arange(m))
    out[order] = np.minimum(1.0, np.maximum.accumulate(scaled))
    return out


def per_prompt_means(
    df: pd.DataFrame,
    reward_col: str = "reward",
    policy_col: str = "policy",
    prompt_col: str = "prompt_id",
) -> pd.DataFrame:
    """Wide table prompt x policy of mean reward over the samples of each prompt."""
    missing = [c for c in (reward_col, policy_col, prompt_col) if c not in df.columns]
    if missing:
        raise KeyError(f"reward table lacks columns {missing}; found {list(df.columns)}")
    g = df.groupby([prompt_col, policy_col], sort=True, observed=True)[reward_col].mean()
    wide = g.unstack(policy_col)
    order = list(dict.fromkeys(df[policy_col]))
    return wide[order]


def prompt_clusters(
    df: pd.DataFrame, prompt_col: str = "prompt_id", cluster_col: str | None = None
) -> pd.Series | None:
    """The cluster label of each prompt (index: prompt), or None without `cluster_col`.

    Raises when a prompt carries two labels: a cluster must contain whole prompts.
    """
    if cluster_col is None:
        return None
    if cluster_col not in df.columns:
        raise KeyError(f"cluster column {cluster_col!r} not in {list(df.columns)}")
    per = df.groupby(prompt_col, sort=True, observed=True)[cluster_col]
    if (per.nunique(dropna=False) > 1).any():
        raise ValueError(
            f"{cluster_col!r} varies within a prompt; clusters must hold whole prompts"
        )
    return per.first()


def paired_table(
    df: pd.DataFrame,
    base: str = "base",
    reward_col: str = "reward",
    policy_col: str = "policy",
    prompt_col: str = "prompt_id",
    n_boot: int = 2000,
    seed: int = 0,
    alpha: float = 0.05,
    cluster_col: str | None = None,
    policies: Sequence[str] | None = None,
    margin: float | None = None,
    power: float = 0.8,
) -> pd.DataFrame:
    """Every policy (or the named `policies`: the family's members) vs `base` on their shared
    prompts, one family at Bonferroni's level (Holm's adjustment of the reference p-values
    beside it).

    Rewards are averaged within each (policy, prompt) first; each comparison uses only the
    prompts both policies were scored on. The table is one family: each interval is at level
    1 - alpha / m for its m comparisons and `p_family` decides the verdict
    (`paired_comparison`); `verdict` is `bound_verdict` at the equivalence `margin` (None where
    there is no interval: fewer than two clusters) and `bound` the largest gain the interval
    allows. Holm is applied, for reference, to the t-test and the Wilcoxon p-values (columns
    `p_ttest_holm`, `p_wilcoxon_holm`). With `cluster_col` (a column constant within a prompt,
    e.g. country) the intervals are over that cluster.
    """
    wide = per_prompt_means(df, reward_col, policy_col, prompt_col)
    if base not in wide.columns:
        raise KeyError(f"base policy {base!r} not in {list(wide.columns)}")
    cl = prompt_clusters(df, prompt_col, cluster_col)
    members = [p for p in wide.columns if p != base and (policies is None or p in set(policies))]
    rows = []
    m = len(members)
    for pol in members:
        pair = wide[[pol, base]].dropna()
        res = paired_comparison(
            pair[pol].to_numpy(), pair[base].to_numpy(), n_boot=n_boot, seed=seed, alpha=alpha,
            clusters=None if cl is None else cl.loc[pair.index].to_numpy(), family_size=m,
            power=power,
        )  # fmt: skip
        rows.append({"policy": pol, "vs": base, **res,
                     "verdict": None if math.isnan(res["ci_low"])
                     else bound_verdict(res["ci_low"], res["ci_high"], margin)})  # fmt: skip
    table = pd.DataFrame(rows)
    if table.empty:
        return table
    table["margin"] = margin if margin is not None else math.nan
    table["p_ttest_holm"] = holm(table["p_ttest"].to_numpy())
    table["p_wilcoxon_holm"] = holm(table["p_wilcoxon"].to_numpy())
    return table


def summarise_policies(
    df: pd.DataFrame,
    reward_col: str = "reward",
    policy_col: str = "policy",
    prompt_col: str = "prompt_id",
    n_boot: int = 2000,
    alpha: float = 0.05,
    seed: int = 0,
    cluster_col: str | None = None,
) -> pd.DataFrame:
    """Per-policy Ave(R) with a percentile-bootstrap CI that resamples prompts, not samples.

    Samples drawn for one prompt share its context and are correlated, so resampling them as if
    independent would make the interval too narrow; the prompt is the unit, or with
    `cluster_col` (e.g. country, constant within a prompt) the cluster of prompts. Ave(R) is the
    mean over prompts of the per-prompt mean reward (each prompt weighs the same), which equals
    the plain sample mean when every prompt has the same number of samples.
    """
    wide = per_prompt_means(df, reward_col, policy_col, prompt_col)
    counts = df.groupby(policy_col, sort=False, observed=True)[reward_col].agg(["count", "std"])
    cl = prompt_clusters(df, prompt_col, cluster_col)
    rows = []
    for pol in wide.columns:
        col = wide[pol].dropna()
        vals = col.to_numpy()
        mean, low, high = bootstrap_ci(
            vals, n_boot=n_boot, alpha=alpha, seed=seed,
            clusters=None if cl is None else cl.loc[col.index].to_numpy(),
        )  # fmt: skip
        rows.append(
            {
                "policy": pol,
                "n_prompts": int(vals.size),
                "n_clusters": int(vals.size if cl is None else cl.loc[col.index].nunique()),
                "n_samples": int(counts.loc[pol, "count"]),
                "ave_r": mean,
                "ci_low": low,
                "ci_high": high,
                "sd_prompt_means": float(vals.std(ddof=1)) if vals.size > 1 else math.nan,
                "sd_samples": float(counts.loc[pol, "std"]),
            }
        )
    return pd.DataFrame(rows)
