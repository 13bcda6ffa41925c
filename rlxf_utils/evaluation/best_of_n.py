"""Best-of-N from the start policy: the selection, its KL bound, the expected maximum, the curve
over N and each policy against best-of-N at equal KL."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
import pandas as pd

from rlxf_utils.stats import (
    bootstrap_ci,
    bound_verdict,
    family_alpha,
    interval_p,
    mde,
    null_bound,
    tail_resamples,
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


def versus_best_of_n(samples: pd.DataFrame, per_prompt_bon: pd.DataFrame, summary: pd.DataFrame,
                     algos: Sequence[str], n_boot: int, alpha: float, seed: int,
                     clusters: pd.Series | None = None) -> pd.DataFrame:  # fmt: skip
    """Each RL policy against the best-of-N curve at its own KL (the RLGF paper's Figure 2 test).

    The curve's reward at the policy's KL is interpolated linearly in KL between the two nearest
    N (per prompt); beyond the largest N the largest N is used and `beyond_curve` says so. The
    policy's KL is itself an estimate: with the samples' log-probabilities (`logp_policy`,
    `logp_ref`) each bootstrap resample of prompts (or of `clusters` of them) recomputes the
    policy's KL from the resampled prompts and reads the curve there, so the interval of the
    difference carries the KL's sampling error as well as the rewards'. Best-of-N's KL is its
    upper bound log N - (N - 1) / N: its true KL is at most that, so its curve is drawn too far
    right and the comparison favours the RL policy (`bound_favours`). The policies are one
    family (`stats.family_alpha`): each interval at level 1 - alpha / m, `ci_level`, from at
    least `stats.tail_resamples` resamples (50 beyond each bound of the family's interval)
    whatever `n_boot` says; `bound` is the largest advantage of the policy the interval allows
    and `mde` the family's minimum detectable difference at 80% power from the resamples' SD.
    """
    ns = sorted(per_prompt_bon.columns)
    kls = np.array([best_of_n_kl_bound(n) for n in ns])
    rng_seed = np.random.SeedSequence(seed)
    a_family = family_alpha(alpha, len(algos))  # one family: every policy against the curve
    n_boot = max(n_boot, tail_resamples(a_family))
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
        units, inv = np.unique(labels, return_inverse=True)
        members = [np.flatnonzero(inv == u) for u in range(len(units))]
        rng = np.random.default_rng(rng_seed)
        own_v = own.loc[ids].to_numpy(float)
        kl_v = kl_pp.loc[ids].to_numpy(float) if kl_pp is not None else None
        bon_v = per_prompt_bon.loc[ids, ns].to_numpy(float)  # prompts x N
        reps, kl_reps = np.empty(n_boot), np.empty(n_boot)
        for b in range(n_boot):
            pick = np.concatenate([members[u] for u in rng.integers(0, len(units), len(units))])
            k_b = max(float(kl_v[pick].mean()), 0.0) if kl_v is not None else kl
            c_b = _curve_rows(bon_v[pick], kls, k_b)
            reps[b] = float((own_v[pick] - c_b).mean())
            kl_reps[b] = k_b
        lo, hi = np.quantile(reps, [a_family / 2, 1 - a_family / 2])
        k_lo, k_hi = np.quantile(kl_reps, [alpha / 2, 1 - alpha / 2])
        d = float(diff.mean())
        rows.append({"policy": algo, "kl": kl, "kl_low": float(k_lo), "kl_high": float(k_hi),
                     "kl_resampled": kl_v is not None, "ave_r": float(own.mean()),
                     "best_of_n_at_kl": float(curve.loc[diff.index].mean()),
                     "best_of_n_kl": float(min(kl, kls[-1])), "diff": d,
                     "diff_low": float(lo), "diff_high": float(hi), "beyond_curve": bool(beyond),
                     "bound_favours": "RL policy", "ci_level": 1 - a_family,
                     "p_family": min(1.0, len(algos) * interval_p(reps)),
                     "bound": null_bound(float(lo), float(hi)),
                     "mde": mde(float(reps.std(ddof=1)), len(algos), alpha),
                     "verdict": bound_verdict(float(lo), float(hi))})  # fmt: skip
    return pd.DataFrame(rows)
