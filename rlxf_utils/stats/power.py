"""How large an evaluation must be: the variance components of a policy's paired difference from
the start policy, the minimum detectable effect (MDE) of a family of comparisons, and the design
(prompts, samples per prompt) that buys the smallest MDE for its sampling cost.

The evaluation is a nested design: G countries, P_g prompts (held-out contexts) in country g,
k samples per prompt. A policy's paired difference from the start policy for sample j of prompt
p of country g (the two drawn with the same sampling seed) is modelled as

    d_gpj = mu + a_g + b_gp + e_gpj,   Var a = s2_country, Var b = s2_prompt, Var e = s2_sample,

and the study's estimate, the mean over prompts of the per-prompt mean difference, has

    Var = s2_country * sum_g w_g^2 + s2_prompt / P + s2_sample * sum_p 1 / (k_p P^2),

w_g = P_g / P the share of prompts in country g (sum_g w_g^2 = 1 / G with equal shares).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
from scipy import stats as sps
from scipy.optimize import brentq

from rlxf_utils.stats.intervals import bm_df

#: The three variance components, in the order of the design's levels.
COMPONENTS = ("var_country", "var_prompt", "var_sample")


def variance_components(values: Any, countries: Any, prompts: Any) -> dict[str, float]:
    """Method-of-moments (ANOVA) estimates of the nested design's three variance components
    from one value per sample (`values`), its country and its prompt (prompts nested in
    countries; unequal numbers of prompts and samples allowed): `var_country`, `var_prompt`
    (between prompts within a country), `var_sample` (within a prompt), each truncated at 0, with
    the counts `n_countries`, `n_prompts`, `n_samples` and `mean`.

    The mean squares MS_a (countries), MS_b (prompts in countries) and MS_e (samples in prompts)
    are equated to their expectations for the unbalanced nested design (Searle, Casella and
    McCulloch, 1992, ch. 5):

        E MS_e = s2_e,  E MS_b = s2_e + c1 s2_b,  E MS_a = s2_e + c2 s2_b + c3 s2_a,
        c1 = (N - sum_gp k_gp^2 / n_g) / (P - G),
        c2 = (sum_gp k_gp^2 / n_g - sum_gp k_gp^2 / N) / (G - 1),
        c3 = (N - sum_g n_g^2 / N) / (G - 1),

    with n_g the samples of country g and N of all (balanced, P prompts of k samples in every
    country: c1 = c2 = k and c3 = P k, the textbook's). The untruncated estimates are solved in turn and each is then truncated
    at 0 (a negative one is sampling noise around a small component). A level without degrees of
    freedom (one sample per prompt, one prompt per country, one country) leaves its component NaN
    and its variation in the level above.
    """
    frame = pd.DataFrame(
        {"x": np.asarray(values, float), "g": np.asarray(countries), "p": np.asarray(prompts)}
    ).dropna(subset=["x"])
    if frame.groupby("p")["g"].nunique().gt(1).any():
        raise ValueError("a prompt lies in two countries: prompts must nest in countries")
    n = len(frame)
    out = {"n_countries": int(frame["g"].nunique()), "n_prompts": int(frame["p"].nunique()),
           "n_samples": n, "mean": float(frame["x"].mean()) if n else math.nan,
           **dict.fromkeys(COMPONENTS, math.nan)}  # fmt: skip
    if n == 0:
        return out
    cells = frame.groupby(["g", "p"], sort=True)["x"].agg(["mean", "count"]).reset_index()
    k_gp = cells["count"].to_numpy(float)
    n_g = cells.groupby("g")["count"].transform("sum").to_numpy(float)
    g_mean = frame.groupby("g")["x"].mean()
    grand = float(frame["x"].mean())
    big_g, big_p = out["n_countries"], out["n_prompts"]
    cell_mean = frame.groupby(["g", "p"])["x"].transform("mean")
    ss_e = float(((frame["x"] - cell_mean) ** 2).sum())
    ss_b = float((k_gp * (cells["mean"].to_numpy() - g_mean.loc[cells["g"]].to_numpy()) ** 2).sum())
    sizes_g = frame.groupby("g").size().to_numpy(float)
    ss_a = float((sizes_g * (g_mean.to_numpy() - grand) ** 2).sum())
    df_e, df_b, df_a = n - big_p, big_p - big_g, big_g - 1
    ms_e = ss_e / df_e if df_e > 0 else math.nan
    sum_k2_ng = float((k_gp**2 / n_g).sum())
    s2_e = ms_e
    s2_b = math.nan
    if df_b > 0:
        c1 = (n - sum_k2_ng) / df_b
        s2_b = (ss_b / df_b - (ms_e if df_e > 0 else 0.0)) / c1
    s2_a = math.nan
    if df_a > 0:
        c2 = (sum_k2_ng - float((k_gp**2).sum()) / n) / df_a
        c3 = (n - float((sizes_g**2).sum()) / n) / df_a
        s2_a = (ss_a / df_a - (ms_e if df_e > 0 else 0.0)
                - c2 * (s2_b if not math.isnan(s2_b) else 0.0)) / c3  # fmt: skip
    for key, v in zip(COMPONENTS, (s2_a, s2_b, s2_e), strict=True):
        out[key] = max(v, 0.0) if not math.isnan(v) else math.nan
    return out


def paired_differences(
    samples: pd.DataFrame,
    policy: str,
    base: str,
    measure: str,
    policy_col: str = "policy",
    prompt_col: str = "prompt_id",
    sample_col: str = "sample_id",
    cluster_col: str = "country",
) -> pd.DataFrame:
    """`policy` minus `base` under `measure`, one row per (prompt, sample index) both have, as
    the study pairs them (sample j of a prompt drawn with the same sampling seed for every
    policy): columns `country`, `prompt`, `sample`, `diff`."""
    cols = [prompt_col, sample_col, measure]
    a = samples.loc[samples[policy_col] == policy, [*cols, cluster_col]]
    b = samples.loc[samples[policy_col] == base, cols]
    both = a.merge(b, on=[prompt_col, sample_col], suffixes=("_a", "_b")).dropna(
        subset=[f"{measure}_a", f"{measure}_b"]
    )
    return pd.DataFrame({"country": both[cluster_col].to_numpy(),
                         "prompt": both[prompt_col].to_numpy(),
                         "sample": both[sample_col].to_numpy(),
                         "diff": (both[f"{measure}_a"] - both[f"{measure}_b"]).to_numpy(float)})  # fmt: skip


def component_table(
    samples: pd.DataFrame,
    policies: Sequence[str],
    base: str,
    measures: Mapping[str, str],
    cluster_col: str = "country",
) -> pd.DataFrame:
    """The variance components of each policy's paired difference from `base` under each judge
    (`measures`: column -> judge name): one row per (policy, judge) with `variance_components`'
    columns, the design it was estimated on (`samples_per_prompt`: the largest k) and `se`, the
    standard error `design_se` predicts for that design (the study's own mean over prompts)."""
    rows = []
    for measure, judge in measures.items():
        for pol in policies:
            d = paired_differences(samples, pol, base, measure, cluster_col=cluster_col)
            if d.empty:
                continue
            comp = variance_components(d["diff"], d["country"], d["prompt"])
            per_country = d.groupby("country")["prompt"].nunique().to_numpy()
            k = int(d.groupby("prompt").size().max())
            rows.append({"policy": pol, "judge": judge, "measure": measure, **comp,
                         "samples_per_prompt": k,
                         "se": design_se(comp, per_country, k)})  # fmt: skip
    return pd.DataFrame(rows)


def design_se(
    components: Mapping[str, float],
    prompts_per_country: Sequence[int] | np.ndarray,
    samples_per_prompt: int,
) -> float:
    """The standard error of the mean over prompts of the per-prompt mean difference, for a
    design with `prompts_per_country` (one count per country sampled) and k samples per prompt,
    from the variance components (a NaN component counts as 0: its variation is in the level
    above, where it was estimated)."""
    p_g = np.asarray(prompts_per_country, dtype=float)
    p_g = p_g[p_g > 0]
    if p_g.size == 0 or samples_per_prompt < 1:
        return math.nan
    total = p_g.sum()
    s2 = [0.0 if math.isnan(components.get(c, math.nan)) else components[c] for c in COMPONENTS]
    var = (s2[0] * float(((p_g / total) ** 2).sum()) + s2[1] / total
           + s2[2] / (samples_per_prompt * total))  # fmt: skip
    return math.sqrt(var)


def mde(
    se: float, family_size: int = 1, alpha: float = 0.05, power: float = 0.8,
    df: float | None = None,
) -> float:  # fmt: skip
    """The minimum detectable effect of a two-sided test in a Bonferroni family of m comparisons:
    the true effect that a family's interval excludes zero with probability `power`. Without
    `df`, MDE = (z_{1 - alpha / (2 m)} + z_{power}) x SE. With `df` (the interval's t degrees
    of freedom: those of the cluster t of `intervals.cluster_t`) it is solved exactly: the
    effect delta = lambda x SE at which the t statistic, noncentral t with `df` and
    noncentrality lambda, falls beyond +/- t_{1 - alpha / (2 m), df} with probability `power`
    (`t_test_power`). The central-t shortcut (t quantiles in place of z in the formula above)
    is low by 2% at df 3 for one comparison, and in a family of 14 by 11% at df 3, 5% at df 6
    and 1.4% at df 16."""
    if not 0 < alpha < 1 or not 0 < power < 1:
        raise ValueError(f"alpha and power must lie in (0, 1); got {alpha}, {power}")
    a = alpha / max(int(family_size), 1)
    if df is None or math.isnan(df) or math.isinf(df):
        return float((sps.norm.ppf(1 - a / 2) + sps.norm.ppf(power)) * se)
    if not df > 0:
        raise ValueError(f"the t degrees of freedom must be positive; got {df}")
    crit = float(sps.t.ppf(1 - a / 2, df))
    gap = lambda nc: t_test_power(nc, df, crit) - power  # noqa: E731  rises with nc
    high = crit + float(sps.norm.ppf(power))  # the central-t shortcut: below the root or near
    while gap(high) < 0:
        high *= 1.5
    return float(brentq(gap, 0.0, high, xtol=1e-12, rtol=1e-12)) * se


def t_test_power(noncentrality: float, df: float, crit: float) -> float:
    """P(|T| > crit) for T noncentral t with `df` and `noncentrality` (true effect / SE): the
    power of the two-sided t test whose critical value is `crit`. The far tail's term, where
    scipy's noncentral t returns NaN (at noncentralities where it is below 1e-15), counts 0."""
    near = float(sps.nct.sf(crit, df, noncentrality))
    far = float(sps.nct.cdf(-crit, df, noncentrality))
    return near + (far if math.isfinite(far) else 0.0)


def allocate(available: Mapping[Any, int] | Sequence[int], prompts: int) -> np.ndarray:
    """Prompts per country when `prompts` of the available held-out contexts are drawn in
    proportion to each country's count (largest remainders; never more than a country has)."""
    avail = np.asarray(list(available.values()) if isinstance(available, Mapping) else available, float)  # fmt: skip
    prompts = int(min(prompts, avail.sum()))
    share = avail / avail.sum() * prompts
    out = np.minimum(np.floor(share), avail)
    order = np.argsort(-(share - np.floor(share)), kind="stable")
    i = 0
    while out.sum() < prompts:
        j = order[i % order.size]
        if out[j] < avail[j]:
            out[j] += 1
        i += 1
    return out.astype(int)


def design_grid(
    components: Mapping[str, float],
    available: Mapping[Any, int] | Sequence[int],
    cost_per_sample: float,
    cost_per_prompt: float = 0.0,
    family_size: int = 1,
    alpha: float = 0.05,
    power: float = 0.8,
    max_samples: int = 16,
    prompt_steps: Sequence[int] | None = None,
) -> pd.DataFrame:
    """Every design (prompts P up to the available held-out contexts, k = 1..`max_samples`)
    with its countries, predicted SE and MDE (t on the degrees of freedom the study's cluster t
    would have, `bm_df` at the design's within-country correlation of prompt means), sampling
    cost P x (cost_per_prompt + k x cost_per_sample) (e.g. seconds of sampling: each prompt's
    fixed draws, best-of-N's pool and the snapshots', and k responses per compared policy) and
    `mde_x_cost` = MDE^2 x cost (the variance bought per unit of cost; lower is better)."""
    total = int(sum(available.values()) if isinstance(available, Mapping) else sum(available))
    steps = sorted({int(p) for p in (prompt_steps or range(1, total + 1)) if 1 <= p <= total})
    rows = []
    for p in steps:
        per = allocate(available, p)
        g = int((per > 0).sum())
        s2 = [0.0 if math.isnan(components.get(c, math.nan)) else components[c] for c in COMPONENTS]
        for k in range(1, max_samples + 1):
            se = design_se(components, per, k)
            between = s2[0] + s2[1] + s2[2] / k
            df = bm_df(per, s2[0] / between if between > 0 else 0.0) if g > 1 else math.nan
            m = mde(se, family_size, alpha, power, df=df)
            cost = p * (cost_per_prompt + k * cost_per_sample)
            rows.append({"prompts": p, "samples_per_prompt": k, "countries": g, "se": se, "df": df,
                         "mde": m, "cost": cost, "mde_x_cost": m * m * cost})  # fmt: skip
    return pd.DataFrame(rows)


def choose_design(
    grid: pd.DataFrame, budget: float | None = None, target_mde: float | None = None
) -> pd.Series:
    """The design to run from `design_grid`: with `target_mde`, the cheapest design that reaches
    it (else the one with the smallest MDE within `budget`, if any); with `budget` alone, the
    smallest MDE whose cost is within it; with neither, the smallest MDE x cost. Ties go to the
    cheaper design. The row carries `reason` ('target', 'budget' or 'efficiency')."""
    g = grid.dropna(subset=["mde"])
    if g.empty:
        raise ValueError("no design with a finite MDE (are the components estimated?)")
    if target_mde is not None:
        ok = g[g["mde"] <= target_mde]
        if budget is not None:
            ok = ok[ok["cost"] <= budget]
        if len(ok):
            r = ok.sort_values(["cost", "mde"]).iloc[0]
            return pd.concat([r, pd.Series({"reason": "target"})])
    if budget is not None:
        within = g[g["cost"] <= budget]
        if len(within):
            r = within.sort_values(["mde", "cost"]).iloc[0]
            return pd.concat([r, pd.Series({"reason": "budget"})])
    r = g.sort_values(["mde_x_cost", "cost"]).iloc[0]
    return pd.concat([r, pd.Series({"reason": "efficiency"})])
