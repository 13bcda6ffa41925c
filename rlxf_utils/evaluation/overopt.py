"""The over-optimisation curve (Gao, Schulman and Hilton, 2022): as a policy moves away from the
start policy, does the reward it was optimised against (the proxy: the RL reward model) keep
rising while a judge it never saw (the gold: the disjoint-rows audit model) stalls or falls?

Every point is a gain over the start policy on the same held-out prompts, against d = sqrt(KL):

    best-of-n    n = 1, 2, 4, ... from one pool of start-policy candidates per prompt: the expected
                 proxy of the proxy-best of n (order statistics, `expected_max_of_n`) and the expected
                 gold of that same candidate; KL at its bound log n - (n - 1) / n
    RL           every snapshot and final policy of every algorithm: its per-prompt mean proxy and
                 gold minus the start policy's, KL its Monte-Carlo estimate

Intervals are cluster t intervals over countries of the per-prompt gains (`stats.cluster_t`, as
every paired gain of the study) at the level the stage passes: the vs-start family's simultaneous
level, so a final policy's point is the very number, interval and verdict of the tables, and the
snapshots and best-of-n points beside it are drawn at that level too. Gao et al.'s functional
forms are fitted by least squares where at least three points with d > 0 allow it:

    best-of-n    R(d) = d (alpha - beta d)
    RL           R(d) = d (alpha - beta log d)       (every trained method its own curve)

A positive `beta` is over-optimisation's signature (the gain turns down as d grows); the figure
shows whether the proxy and the gold part ways.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from rlxf_utils.algorithms import algorithm_label
from rlxf_utils.evaluation.best_of_n import best_of_n_kl_bound, order_weights
from rlxf_utils.models.logprobs import kl_estimate
from rlxf_utils.plots import ci_err
from rlxf_utils.stats import cluster_t, level

#: The two rewards of the curve: column in the samples -> what it is.
REWARDS = {
    "reward": "proxy (the RL reward model)",
    "audit_reward": "gold (the disjoint-rows audit)",
}

#: Gao et al.'s forms, as (name, feature builder): R(d) = alpha * f1(d) - beta * f2(d).
FORMS = {
    "best_of_n": ("d (alpha - beta d)", lambda d: (d, d * d)),
    "rl": ("d (alpha - beta log d)", lambda d: (d, d * np.log(d))),
}


def best_of_n_expectations(
    pool: pd.DataFrame, ns: Sequence[int], columns: Sequence[str] = tuple(REWARDS)
) -> dict[str, pd.DataFrame]:
    """Per prompt and n (columns): the expected proxy of the proxy-best of n candidates and the
    expected value of each of `columns` (the gold, the finished share) for that same candidate,
    from order statistics over the whole pool (sorted by proxy; ties keep the pool's order).
    Keys: `columns` ('reward', 'audit_reward' by default)."""
    out: dict[str, dict[int, pd.Series]] = {col: {} for col in columns}
    for pid, g in pool.groupby("prompt_id", sort=True):
        order = np.argsort(g["reward"].to_numpy(float), kind="stable")
        for n in ns:
            w = order_weights(len(order), n)
            for col in columns:
                out[col].setdefault(n, {})[pid] = float((w * g[col].to_numpy(float)[order]).sum())
    return {
        col: pd.DataFrame({n: pd.Series(v) for n, v in per.items()}) for col, per in out.items()
    }


def distinct_share(pool: pd.DataFrame) -> dict[str, float]:
    """How often the pool's candidates for a prompt are distinct texts: the KL bound
    log n - (n - 1) / n is tight only then (Beirami et al., 2024). `prompts_all_distinct`: share
    of prompts whose candidates are all distinct; `distinct_fraction`: mean share of distinct
    texts per prompt."""
    per = pool.groupby("prompt_id")["response"].agg(lambda s: s.nunique() / len(s))
    return {
        "prompts_all_distinct": float((per == 1.0).mean()) if len(per) else math.nan,
        "distinct_fraction": float(per.mean()) if len(per) else math.nan,
        "candidates_per_prompt": float(pool.groupby("prompt_id").size().mean()) if len(pool) else 0,
    }


def _gain_ci(
    gain: pd.Series, clusters: pd.Series, n_boot: int, alpha: float, seed: int
) -> tuple[float, float, float]:
    """(mean, low, high) of per-prompt gains: the cluster t over countries (`n_boot` and `seed`
    unused: kept so that the callers' signature stays)."""
    gain = gain.dropna()
    res = cluster_t(gain.to_numpy(float), clusters.loc[gain.index].to_numpy(), alpha)
    return res["mean"], res["low"], res["high"]


def overoptimisation_points(
    samples: pd.DataFrame,
    snapshots: pd.DataFrame,
    pool: pd.DataFrame,
    summary: pd.DataFrame,
    algos: Sequence[str],
    start: str,
    ns: Sequence[int],
    final_step: int | Mapping[str, int],
    clusters: pd.Series,
    n_boot: int,
    alpha: float,
    seed: int,
) -> pd.DataFrame:
    """One row per point of the curve: method ('best_of_n' or an algorithm), `point` (n or the
    training step), `kl` (and `kl_se`), `sqrt_kl`, and per reward (`proxy`, `gold`) the gain over
    `start` with its interval. `samples`: every policy's samples (`policy`, `prompt_id`,
    `reward`, `audit_reward`); `snapshots`: the frontier snapshots' samples (`algo`, `step`, ...,
    `logp_policy`, `logp_ref`); `summary`: evaluation's summary (final policies' `kl`, `kl_se`);
    `final_step`: the step of the final policies (`rl.steps`), or each algorithm's own (ILHF from
    history counts its steps in pairs, not in RL's batches); `clusters`: the country of each
    prompt_id. Best-of-n's gains are over the pool's own n = 1 (its start-policy level, same
    candidates), the policies' over `start`'s samples with the same sample ids (`base_for`)."""
    own = samples[samples["policy"] == start]

    def base_for(frame: pd.DataFrame) -> dict[str, pd.Series]:
        """The start policy's per-prompt mean over the sample ids `frame` holds: a snapshot drawn
        with fewer samples per prompt is compared with the start policy's same draws (the same
        sampling seeds), so a policy that has not moved gains exactly 0."""
        mine = own
        if "sample_id" in frame and "sample_id" in own:
            mine = own[own["sample_id"].isin(set(frame["sample_id"]))]
        return {col: mine.groupby("prompt_id")[col].mean() for col in REWARDS}

    rows = []
    ns = sorted({1, *ns})  # n = 1 is the pool's own start-policy level: every n's gain is paired
    exp = best_of_n_expectations(pool, ns)
    for n in ns:
        rec = {"method": "best_of_n", "point": int(n), "source": "best_of_n",
               "kl": best_of_n_kl_bound(n), "kl_se": 0.0}  # fmt: skip
        for col, key in zip(REWARDS, ("proxy", "gold"), strict=True):
            gain = exp[col][n] - exp[col][1]
            rec[key], rec[f"{key}_low"], rec[f"{key}_high"] = _gain_ci(
                gain, clusters, n_boot, alpha, seed
            )
        rows.append(rec)
    kl_of = summary.set_index("policy")
    for algo in algos:
        parts = []
        if len(snapshots):
            for step, g in snapshots[snapshots["algo"] == algo].groupby("step", sort=True):
                k = kl_estimate(g["logp_policy"], g["logp_ref"])
                parts.append((int(step), "snapshot", g, k["kl"], k["kl_se"]))
        fin = samples[samples["policy"] == algo]
        if len(fin) and algo in kl_of.index:
            kl, kl_se = float(kl_of.loc[algo, "kl"]), float(kl_of.loc[algo, "kl_se"])
            last = final_step[algo] if isinstance(final_step, Mapping) else final_step
            parts.append((int(last), "final", fin, kl, kl_se))
        for step, source, g, kl, kl_se in parts:
            rec = {"method": algo, "point": step, "source": source, "kl": kl, "kl_se": kl_se}
            base = base_for(g)
            for col, key in zip(REWARDS, ("proxy", "gold"), strict=True):
                gain = g.groupby("prompt_id")[col].mean() - base[col]
                rec[key], rec[f"{key}_low"], rec[f"{key}_high"] = _gain_ci(
                    gain, clusters, n_boot, alpha, seed
                )
            rows.append(rec)
    out = pd.DataFrame(rows)
    if len(out):
        out["ci_level"] = 1 - alpha  # the vs-start family's simultaneous level (the stage's)
        out["sqrt_kl"] = np.sqrt(out["kl"].clip(lower=0.0))
        out["label"] = [
            algorithm_label(m) if m != "best_of_n" else "best-of-n" for m in out["method"]
        ]
    return out


def fit_form(d: np.ndarray, r: np.ndarray, form: str) -> dict[str, float]:
    """Least squares of R(d) = alpha * f1(d) - beta * f2(d) (Gao et al.'s `form`) on points with
    d > 0; coefficients with their OLS standard errors and R² (NaN with fewer than 3 points)."""
    keep = (np.asarray(d) > 0) & np.isfinite(r)
    d, r = np.asarray(d, float)[keep], np.asarray(r, float)[keep]
    out = {"points": int(d.size), "alpha": math.nan, "alpha_se": math.nan, "beta": math.nan,
           "beta_se": math.nan, "r2": math.nan}  # fmt: skip
    if d.size < 3:
        return out
    f1, f2 = FORMS[form][1](d)
    X = np.column_stack([f1, -f2])
    coef, *_ = np.linalg.lstsq(X, r, rcond=None)
    resid = r - X @ coef
    dof = d.size - 2
    sigma2 = float(resid @ resid) / dof if dof > 0 else math.nan
    try:
        cov = sigma2 * np.linalg.inv(X.T @ X)
        se = np.sqrt(np.clip(np.diag(cov), 0, None))
    except np.linalg.LinAlgError:
        se = np.array([math.nan, math.nan])
    ss_tot = float(((r - r.mean()) ** 2).sum())
    out.update(alpha=float(coef[0]), alpha_se=float(se[0]), beta=float(coef[1]),
               beta_se=float(se[1]), r2=1 - float(resid @ resid) / ss_tot if ss_tot > 0 else math.nan)  # fmt: skip
    return out


def overoptimisation_fits(points: pd.DataFrame) -> pd.DataFrame:
    """Gao et al.'s forms fitted to each method's own points, for the proxy and the gold reward:
    best-of-n's form to best-of-n, the RL form to every trained method (the RL and guided
    algorithms, ILHF and the offline methods alike: each its own curve, none pooled); `method`,
    `family` (the form's: 'best_of_n' or 'rl'), reward, form, points, alpha, beta (with SEs), R²,
    and `beta_low`, `beta_high`: beta's 95% t interval on the fit's points - 2 degrees of
    freedom (NaN with fewer than four points: two coefficients leave it no spread to read)."""
    from scipy import stats as st

    rows = []
    if points.empty:
        return pd.DataFrame(rows)
    for method, g in points.groupby("method", sort=False):
        family = "best_of_n" if method == "best_of_n" else "rl"
        for key in ("proxy", "gold"):
            fit = fit_form(g["sqrt_kl"].to_numpy(float), g[key].to_numpy(float), family)
            dof = fit["points"] - 2
            half = (st.t.ppf(0.975, dof) * fit["beta_se"]) if dof > 1 else math.nan
            rows.append({"method": method, "family": family, "reward": key,
                         "form": FORMS[family][0], **fit, "beta_low": fit["beta"] - half,
                         "beta_high": fit["beta"] + half})  # fmt: skip
    return pd.DataFrame(rows)


def plot_overoptimisation(points: pd.DataFrame, fits: pd.DataFrame, start: str,
                          alpha: float = 0.05) -> Any:  # fmt: skip
    """Two panels, proxy and gold gain over `start` against sqrt(KL): best-of-n and every RL
    algorithm's snapshots (joined from the origin), bars their intervals, dashed Gao fits."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.6), sharey=True)
    methods = list(dict.fromkeys(points["method"])) if len(points) else []
    palette = plt.get_cmap("tab20")
    colour = {m: ("gray" if m == "best_of_n" else palette(i % 20)) for i, m in enumerate(methods)}
    for ax, key in zip(axes, ("proxy", "gold"), strict=True):
        ax.axhline(0, color="black", lw=0.8)
        for method, g in points.groupby("method", sort=False):
            g = g.sort_values("sqrt_kl")
            if method != "best_of_n":
                g = pd.concat([pd.DataFrame([{"sqrt_kl": 0.0, key: 0.0, f"{key}_low": 0.0,
                                              f"{key}_high": 0.0}]), g])  # fmt: skip
            style = (
                dict(fmt="*--", ms=5, lw=0.8)
                if method == "best_of_n"
                else dict(fmt="o:", ms=3, lw=0.8)
            )
            ax.errorbar(g["sqrt_kl"], g[key], yerr=ci_err(g, key, f"{key}_low", f"{key}_high"),
                        capsize=2, color=colour[method], elinewidth=0.6,
                        label="best-of-n" if method == "best_of_n" else algorithm_label(str(method)),
                        **style)  # fmt: skip
        for _, f in fits[fits["reward"] == key].iterrows() if len(fits) else []:
            if not math.isfinite(f["alpha"]) or f["method"] not in colour:
                continue
            top = points.loc[points["method"] == f["method"], "sqrt_kl"].max()
            d = np.linspace(1e-3, top, 100)
            f1, f2 = FORMS[f["family"]][1](d)
            ax.plot(d, f["alpha"] * f1 - f["beta"] * f2, lw=1.0, color=colour[f["method"]],
                    ls="--" if f["family"] == "best_of_n" else "-")  # fmt: skip
        ax.set(
            xlabel=f"√KL(policy ‖ {start}), √nats",
            title=REWARDS["reward" if key == "proxy" else "audit_reward"],
        )
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"gain over {start} (P(MET))")
    handles, names = axes[1].get_legend_handles_labels()
    if handles:
        fig.legend(handles, names, fontsize=7, loc="lower center", ncol=min(len(names), 8),
                   frameon=False)  # fmt: skip
    fig.suptitle(f"Over-optimisation: proxy and gold reward against √KL, each method's points and its own Gao et al. fit (bars: {level(alpha)} simultaneous cluster t CI over countries)",
                 fontsize=9)  # fmt: skip
    fig.tight_layout(rect=(0, 0.05 * (1 + len(methods) // 8), 1, 1))
    return fig


def overoptimisation_meta(points: pd.DataFrame, pool: pd.DataFrame) -> Mapping[str, Any]:
    """What the figure rests on: the pool's distinct share (the KL bound's tightness) and the
    largest sqrt(KL) of each family."""
    bon = points[points["method"] == "best_of_n"] if len(points) else points
    rl = points[points["method"] != "best_of_n"] if len(points) else points
    return {
        **distinct_share(pool),
        "max_sqrt_kl_best_of_n": float(bon["sqrt_kl"].max()) if len(bon) else math.nan,
        "max_sqrt_kl_rl": float(rl["sqrt_kl"].max()) if len(rl) else math.nan,
    }
