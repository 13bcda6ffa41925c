"""Training seeds as replications: an algorithm's gain over the start policy averaged over its
training seeds, with an interval that carries both the seed-to-seed spread and the evaluation's
own sampling error, and the number of seeds a minimum detectable effect (MDE) needs.

The design (what `rlxf seeds` runs): S training seeds of one algorithm, each evaluated on the
same held-out prompts (P prompts in G countries) against the same start-policy samples, each
seed's policy sampled with its own sampling seed. Seed s's paired difference on prompt p is

    d_sp = theta + u_s + c_p + e_sp,

u_s the seed's own deviation (Var tau2: what a new training seed changes), c_p what every seed
shares (the prompt's and its country's effect on the gain, and the start policy's samples:
drawn once), e_sp what only seed s draws (its policy's samples; Var sigma2_e). The estimate
theta_hat = mean_s mean_p d_sp has

    Var theta_hat = tau2 / S + Var(mean_p c_p) + sigma2_e / (S P).

Two observable pieces bound it from above without knowing tau2 and sigma2_e apart:

* B, the variance over seeds of the seeds' estimates theta_hat_s (the shared c cancels in it):
  E B = tau2 + sigma2_e / P;
* V, the squared cluster-robust standard error over countries (`intervals.cluster_t`) of the
  seed-averaged per-prompt differences D_p = mean_s d_sp: E V = Var(mean_p c_p) +
  sigma2_e / (S P) (the seeds' common shifts u_s do not vary over prompts and leave V).

    Var_hat = B / S + V

counts sigma2_e / (S P) twice (conservative by that much, small when the evaluation's own error
is mostly shared) and misses nothing. Its degrees of freedom are the smaller of its two parts'
(`pooled_df`: S - 1 for B, the cluster t's for V), not Satterthwaite's: with S = 3 seeds, B's
two degrees of freedom make Satterthwaite's df rise exactly when the seeds happen to agree, and
the t quantile collapses with it (simulated, 17 uneven countries, a seed-to-seed spread beside
the evaluation's own error: 93.9% coverage at 95%, 98.8% at 99.58%; the smaller df: 95.4% and
99.9%; tests/test_replications.py). The price is width: with three seeds the interval is a t on
two degrees of freedom. The textbook alternative for independent replications, B / S plus the
mean of the seeds' own squared standard errors over S, divides the shared error by S: with
shared prompts and start samples it is too narrow (the simulation in tests/test_replications.py
shows both).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd
from scipy import stats as sps

from rlxf_utils.stats.intervals import check_alpha, cluster_t
from rlxf_utils.stats.power import mde

#: The most seeds `seeds_for_mde` counts to (beyond: inf).
MAX_SEEDS = 1000


def satterthwaite_df(parts: Any, dfs: Any) -> float:
    """Welch-Satterthwaite degrees of freedom of a sum of independent variance estimates `parts`
    with `dfs` degrees of freedom each (a part with NaN or infinite df counts as known)."""
    v = np.asarray(parts, float)
    d = np.asarray(dfs, float)
    total = float(v.sum())
    finite = np.isfinite(d) & (d > 0)
    denom = float((v[finite] ** 2 / d[finite]).sum())
    return total**2 / denom if denom > 0 else math.inf


def pooled_df(seeds: float, shared_df: float) -> float:
    """Degrees of freedom of the pooled variance B / S + V: the smaller of its parts' (S - 1 for
    B, `shared_df` for V; with infinitely many seeds, V's alone). Conservative: the interval's
    coverage is at least its level whatever the parts' sizes (module docstring)."""
    if not seeds > 1:
        raise ValueError(f"pooled_df needs at least 2 seeds; got {seeds}")
    return float(min(seeds - 1, shared_df)) if math.isfinite(shared_df) else float(seeds - 1)


def replicated_gain(diffs: pd.DataFrame, alpha: float = 0.05) -> dict[str, Any]:
    """The gain averaged over training seeds with its interval, from one paired difference per
    (seed, prompt) (`diffs`: columns `seed`, `country`, `prompt`, `diff`; each seed's per-prompt
    mean difference from the start policy). Only prompts every seed has are used.

    Returns `mean`, `low`, `high` (t interval at 1 - alpha on `pooled_df`), `se`, `df`, `seeds`
    (S), `prompts`,
    `n_clusters`, `between_var` (B: the variance over seeds of the seeds' estimates),
    `shared_var` (V: the seed-averaged evaluation's variance over countries) with its cluster t
    df `shared_df`, and `seed_means`
    (each seed's estimate). With one seed B is unknown and the interval NaN."""
    check_alpha(alpha)
    need = {"seed", "country", "prompt", "diff"}
    if missing := need - set(diffs.columns):
        raise ValueError(f"replicated_gain needs columns {sorted(need)}; missing {sorted(missing)}")
    out: dict[str, Any] = {"mean": math.nan, "low": math.nan, "high": math.nan, "se": math.nan,
                           "df": math.nan, "seeds": int(diffs["seed"].nunique()), "prompts": 0,
                           "n_clusters": 0, "between_var": math.nan, "shared_var": math.nan,
                           "shared_df": math.nan, "seed_means": {}}  # fmt: skip
    if diffs.empty:
        return out
    wide = (
        diffs.assign(diff=diffs["diff"].astype(float))
        .pivot_table(index=["country", "prompt"], columns="seed", values="diff", aggfunc="mean")
        .dropna()
    )
    s = wide.shape[1]
    out["prompts"] = int(len(wide))
    if wide.empty:
        return out
    seed_means = wide.mean(axis=0)
    shared = cluster_t(wide.mean(axis=1).to_numpy(), wide.index.get_level_values("country"), alpha)
    out.update(mean=float(seed_means.mean()), n_clusters=int(shared["n_clusters"]),
               shared_var=float(shared["se"]) ** 2, shared_df=float(shared["df"]),
               seed_means=seed_means.to_dict())  # fmt: skip
    if s < 2 or not math.isfinite(out["shared_var"]):
        return out
    between = float(seed_means.var(ddof=1))
    var = between / s + out["shared_var"]
    df = pooled_df(s, float(shared["df"]))
    half = float(sps.t.ppf(1 - alpha / 2, df)) * math.sqrt(var)
    out.update(between_var=between, se=math.sqrt(var), df=df, low=out["mean"] - half,
               high=out["mean"] + half)  # fmt: skip
    return out


def seeds_for_mde(
    between_var: float,
    shared_var: float,
    shared_df: float,
    target: float,
    alpha: float = 0.05,
    power: float = 0.8,
    max_seeds: int = MAX_SEEDS,
) -> dict[str, float]:
    """How many training seeds an algorithm-level MDE of `target` needs, with every seed
    evaluated as the ones measured (the same prompts and start samples): the MDE with S seeds is
    `power.mde` of sqrt(B / S + V) on `pooled_df` (the noncentral t; `replicated_gain`'s
    B and V; `shared_df` the cluster t's df), which falls as S grows. Returns `seeds` (the
    smallest S >= 2 reaching it; inf when more than `max_seeds` would; NaN when none would) and
    `floor`, the MDE with infinitely many seeds (`shared_df`, sqrt(V)): a target at or below it needs a larger evaluation, not more seeds."""
    if not target > 0:
        raise ValueError(f"target MDE must be positive; got {target}")
    check_alpha(alpha)

    def at(s: float) -> float:
        var = between_var / s + shared_var
        df = pooled_df(s, shared_df) if math.isfinite(s) else shared_df
        return mde(math.sqrt(var), 1, alpha, power, df)

    floor = at(math.inf) if math.isfinite(shared_var) else math.nan
    out = {"seeds": math.nan, "floor": floor}
    if not (math.isfinite(between_var) and math.isfinite(floor)) or floor >= target:
        return out
    if at(max_seeds) > target:
        out["seeds"] = math.inf
        return out
    low, high = 1, max_seeds  # at(high) reaches the target; bisect for the first S that does
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if at(mid) <= target else (mid, high)
    out["seeds"] = float(high)
    return out
