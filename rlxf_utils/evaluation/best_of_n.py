"""Best-of-N from the start policy: the selection, its KL bound, the expected maximum, the curve
over N and each policy against best-of-N at equal KL."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
import pandas as pd

from rlxf_utils.markdown import is_present
from rlxf_utils.stats import (
    bootstrap_ci,
    bound_verdict,
    cluster_t,
    family_alpha,
    mde,
    null_bound,
)

T = TypeVar("T")


def best_of_n(
    groups_of_samples: Sequence[Sequence[T]],
    rewards: Sequence[Sequence[float]],
) -> tuple[list[T], list[int]]:
    """Per prompt, the sample with the highest reward (first on ties; NaN never wins).

    Note that its reward under the *selecting* model is optimistically biased (a max over N);
    report best-of-N under an audit reward model as well.
    """
    if len(groups_of_samples) != len(rewards):
        raise ValueError(f"{len(groups_of_samples)} groups but {len(rewards)} reward groups")
    chosen: list[T] = []
    picks: list[int] = []
    for g, (samples, r) in enumerate(zip(groups_of_samples, rewards, strict=True)):
        r_arr = np.asarray(r, dtype=float)
        if len(samples) != r_arr.size or r_arr.size == 0:
            raise ValueError(f"group {g}: {len(samples)} samples, {r_arr.size} rewards")
        j = int(np.argmax(np.where(np.isnan(r_arr), -np.inf, r_arr)))
        picks.append(j)
        chosen.append(samples[j])
    return chosen, picks


def best_of_n_frame(
    df: pd.DataFrame,
    reward_col: str = "reward",
    group_cols: Sequence[str] = ("policy", "prompt_id"),
) -> pd.DataFrame:
    """Rows of a long table with the highest `reward_col` within each group (first on ties)."""
    r = df[reward_col].astype(float).fillna(-np.inf)
    idx = r.groupby([df[c] for c in group_cols], sort=False, observed=True).idxmax()
    return df.loc[idx.to_numpy()].reset_index(drop=True)


def expected_max_of_n(values: Sequence[float] | np.ndarray, n: int) -> float:
    """E[max of n draws without replacement] from `values` (a pool of m >= n candidates).

    The unbiased order-statistics estimator: with the pool sorted ascending, the i-th smallest
    (1-based) is the maximum of a random n-subset with probability C(i-1, n-1) / C(m, n). It uses
    every candidate instead of one arbitrary subset, so the best-of-N curve is far less noisy.
    """
    x = np.sort(np.asarray(values, dtype=float))
    return float((order_weights(len(x), n) * x).sum())


def order_weights(m: int, n: int) -> np.ndarray:
    """P(the i-th smallest of m candidates is the maximum of a random n-subset), i = 1..m:
    C(i - 1, n - 1) / C(m, n). Weights any value carried by the candidates sorted by the
    selecting score (the expected audit reward of the reward model's best of n, for one)."""
    if not 1 <= n <= m:
        raise ValueError(f"best-of-{n} needs a pool of at least {n} candidates, got {m}")
    i = np.arange(1, m + 1)
    return np.array([math.comb(int(k) - 1, n - 1) for k in i], dtype=float) / math.comb(m, n)


def best_of_n_kl_bound(n: int) -> float:
    """log N - (N - 1) / N: an upper bound on KL(best-of-N || base) (Beirami et al. 2024)."""
    return math.log(n) - (n - 1) / n


def pool_sampling(gen_kw: Mapping[str, Any]) -> dict[str, Any]:
    """The sampling settings of best-of-N's pool of start-policy candidates: the start policy's,
    with another seed than the policies' own samples (`gen_kw['seed'] + 1`), so best-of-N is never
    the maximum of the very samples it is compared with."""
    return {**gen_kw, "seed": int(gen_kw["seed"]) + 1}


def best_of_n_curve(pool: pd.DataFrame, ns: Sequence[int], n_boot: int, alpha: float,
                    seed: int, clusters: pd.Series | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:  # fmt: skip
    """Expected best-of-N reward per prompt for each N (order statistics over the pool), and the
    curve: Ave(R) with a bootstrap CI over prompts (or over `clusters`, a label per prompt_id)
    and KL at its upper bound log N - (N - 1) / N, per N."""
    per_prompt = pd.DataFrame(
        {n: pool.groupby("prompt_id")["reward"].apply(lambda v, n=n: expected_max_of_n(v, n)) for n in ns}
    )  # fmt: skip
    rows = []
    for n in ns:
        ave, lo, hi = bootstrap_ci(per_prompt[n], n_boot, alpha, seed,
                                      clusters=_clusters_of(per_prompt.index, clusters))  # fmt: skip
        rows.append({"algo": "best_of_n", "step": n, "reward": ave, "reward_low": lo, "reward_high": hi,
                     "audit_reward": np.nan, "kl": best_of_n_kl_bound(n), "kl_se": 0.0,
                     "source": "best_of_n"})  # fmt: skip
    return per_prompt, pd.DataFrame(rows)


def _clusters_of(prompt_ids: pd.Index, clusters: pd.Series | None) -> np.ndarray | None:
    return None if clusters is None else clusters.loc[prompt_ids].to_numpy()


def _curve_rows(bon: np.ndarray, kls: np.ndarray, kl: float) -> np.ndarray:
    """`_curve_at` on an array (prompts x N, columns in the order of `kls`): the per-prompt
    best-of-N reward at `kl`, linear in KL between the two nearest N, the largest N beyond."""
    j = int(np.searchsorted(kls, kl))
    if j == 0:
        return bon[:, 0]
    if j >= kls.size:
        return bon[:, -1]
    w = (kl - kls[j - 1]) / (kls[j] - kls[j - 1])
    return (1 - w) * bon[:, j - 1] + w * bon[:, j]


def _curve_at(
    per_prompt_bon: pd.DataFrame, kls: np.ndarray, ns: list[int], kl: float
) -> tuple[pd.Series, bool]:
    """Per-prompt best-of-N reward at `kl`, linear in KL between the two nearest N; beyond the
    largest N the largest N (flagged True)."""
    j = int(np.searchsorted(kls, kl))
    if j == 0:
        return per_prompt_bon[ns[0]], False
    if j >= len(ns):
        return per_prompt_bon[ns[-1]], True
    w = (kl - kls[j - 1]) / (kls[j] - kls[j - 1])
    return (1 - w) * per_prompt_bon[ns[j - 1]] + w * per_prompt_bon[ns[j]], False


def _curve_slope(bon: np.ndarray, kls: np.ndarray, kl: float) -> float:
    """The slope in KL of the mean best-of-N curve (`_curve_rows`' prompts averaged) at `kl`: the
    segment's between the two nearest N, 0 at the start and beyond the largest N (flat there)."""
    j = int(np.searchsorted(kls, kl))
    if j == 0 or j >= kls.size:
        return 0.0
    return float((bon[:, j].mean() - bon[:, j - 1].mean()) / (kls[j] - kls[j - 1]))


def versus_best_of_n(samples: pd.DataFrame, per_prompt_bon: pd.DataFrame, summary: pd.DataFrame,
                     algos: Sequence[str], n_boot: int, alpha: float, seed: int,
                     clusters: pd.Series | None = None) -> pd.DataFrame:  # fmt: skip
    """Each RL policy against the best-of-N curve at its own KL (the RLGF paper's Figure 2 test).

    The curve's reward at the policy's KL is interpolated linearly in KL between the two nearest
    N (per prompt); beyond the largest N the largest N is used and `beyond_curve` says so. Best-of-
    N's KL is its upper bound log N - (N - 1) / N: its true KL is at most that, so its curve is
    drawn too far right and the comparison favours the RL policy (`bound_favours`).

    The interval is the study's one for a few-cluster comparison: the cluster t interval over
    `clusters` (countries; CR2 variance, Bell-McCaffrey df: `stats.cluster_t`) at the family's
    level. The policies are one family (`stats.family_alpha`): every interval at 1 - alpha / m,
    `ci_level`, the difference's and the KL's alike. The policy's KL is itself an estimate: with
    the samples' log-probabilities (`logp_policy`, `logp_ref`) the difference's interval carries
    its error by the delta method, the per-prompt difference minus the curve's slope at the
    policy's KL times the prompt's deviation from the mean KL (`kl_resampled`; the mean of the
    added term is zero, so the estimate is the plain mean difference), and `kl_low`, `kl_high`
    are the cluster t interval of the per-prompt KL at the same level; without them the KL is
    taken as known (its interval the point). `p_family` is m times the interval's p-value,
    `bound` the largest advantage of the policy the interval allows and `mde` the family's
    minimum detectable difference at 80% power. (`n_boot` and `seed` are kept for callers: a
    percentile cluster bootstrap, used here before, covered a family's 95% only 88% of the time
    at 17 countries, `stats.cluster_t`'s notes.)
    """
    ns = sorted(per_prompt_bon.columns)
    kls = np.array([best_of_n_kl_bound(n) for n in ns])
    a_family = family_alpha(alpha, len(algos))  # one family: every policy against the curve
    rows = []
    for algo in algos:
        r = summary.set_index("policy").loc[algo]
        kl = float(max(r["kl"], 0.0))
        curve, beyond = _curve_at(per_prompt_bon, kls, ns, kl)
        mine = samples[samples["policy"] == algo]
        own = mine.groupby("prompt_id")["reward"].mean()
        diff = (own - curve).dropna()
        has_lp = {"logp_policy", "logp_ref"} <= set(mine.columns) and mine[
            "logp_policy"
        ].notna().all()
        kl_pp = (
            (mine["logp_policy"] - mine["logp_ref"]).groupby(mine["prompt_id"]).mean()
            if has_lp
            else None
        )
        ids = diff.index.to_numpy()
        labels = np.asarray(ids if clusters is None else clusters.loc[ids].to_numpy())
        values = diff.to_numpy(float)
        k_lo = k_hi = kl
        if kl_pp is not None:
            kl_v = kl_pp.loc[ids].to_numpy(float)
            slope = _curve_slope(per_prompt_bon.loc[ids, ns].to_numpy(float), kls, kl)
            values = values - slope * (kl_v - kl_v.mean())  # the KL's error, linearised
            kl_ci = cluster_t(kl_v, labels, a_family)
            k_lo, k_hi = kl_ci["low"], kl_ci["high"]
        res = cluster_t(values, labels, a_family)
        lo, hi = res["low"], res["high"]
        d = float(diff.mean())
        rows.append({"policy": algo, "kl": kl, "kl_low": float(k_lo), "kl_high": float(k_hi),
                     "kl_resampled": kl_pp is not None, "ave_r": float(own.mean()),
                     "best_of_n_at_kl": float(curve.loc[diff.index].mean()),
                     "best_of_n_kl": float(min(kl, kls[-1])), "diff": d,
                     "diff_low": float(lo), "diff_high": float(hi), "beyond_curve": bool(beyond),
                     "bound_favours": "RL policy", "ci_level": 1 - a_family,
                     "method": "cluster t over countries",
                     "p_family": min(1.0, len(algos) * res["p"]) if is_present(res["p"]) else math.nan,
                     "bound": null_bound(float(lo), float(hi)),
                     "mde": mde(res["se"], len(algos), alpha, 0.8, res["df"])
                     if is_present(res["se"]) else math.nan,
                     "verdict": bound_verdict(float(lo), float(hi))})  # fmt: skip
    return pd.DataFrame(rows)
