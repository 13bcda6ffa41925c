"""Notebook 03's tables and figures: the algorithms' settings side by side, the training curves,
the training summary, RLGF's guidance and ILHF's training."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from rlxf_utils.algorithms import ILHF_ALGORITHMS, RLGF_ALGORITHMS, algorithm_label
from rlxf_utils.artifacts import RunDir


def settings_table(run_dir: str | Path, algos: Sequence[str]) -> pd.DataFrame:
    """Each algorithm's `settings.json` side by side (rows: settings; columns: algorithms)."""
    rd = RunDir(run_dir)
    cols = {a: rd.read_json(f"policy/{a}/settings.json", stage="notebook 03") for a in algos}
    keys = list(dict.fromkeys(k for c in cols.values() for k in c if k != "algo"))
    return pd.DataFrame(
        [
            {"setting": k, **{algorithm_label(a): _cell(c.get(k)) for a, c in cols.items()}}
            for k in keys
        ]
    )


def _cell(v: Any) -> str:
    """A setting as a reader reads it: '·' for none, floats in %g, a group of settings (the
    optimiser's) as 'name value' pairs ('eps 1e-05, weight decay 0, ...'), not a Python dict."""
    if v is None:
        return "·"
    if isinstance(v, dict):
        return ", ".join(f"{str(k).replace('_', ' ')} {_cell(x)}" for k, x in v.items())
    return f"{v:g}" if isinstance(v, float) else str(v)


def training_curves_figure(logs: pd.DataFrame) -> Any:
    """Per step and algorithm: reward, KL to the start policy, PPO's critic (explained variance;
    dashed, in the same colour: the reward-model prior's alone, what the learned head adds is the
    gap) and the KL coefficient beta."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(15, 3.6))
    logs = logs.assign(reward_own=own_reward(logs))
    panels = (
        ("reward_own", "mean reward  P(MET)", "Reward (the learner's own responses)"),
        ("kl", "nats / response", "KL to the start policy"),
        ("explained_variance", "1 - Var(R - V) / Var(R)", "Critic: explained variance"),
        ("kl_coef", "beta", "KL coefficient"),
    )
    for ax, (col, ylabel, title) in zip(axes, panels, strict=True):
        for algo, g in logs.groupby("algo", sort=False):
            if g[col].notna().any():
                (line,) = ax.plot(g["step"], g[col], marker=".", label=algorithm_label(algo))
                prior = g.get(f"{col}_prior")
                if prior is not None and prior.notna().any():
                    ax.plot(g["step"], prior, ls="--", color=line.get_color(), lw=1,
                            label=f"{algorithm_label(algo)}: prior alone")  # fmt: skip
        ax.set(xlabel="step", ylabel=ylabel, title=title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[2].axhline(0, color="black", lw=0.8)
    fig.tight_layout()
    return fig


def own_reward(g: pd.DataFrame) -> pd.Series:
    """One algorithm's training reward per step on the responses the learner wrote every token
    of (`reward_learner`: RLGF's guide-written and guide-finished responses left out; NaN at a
    step with none, e.g. every AggreVaTeD step); logs from before the column: `reward_mean`."""
    return g["reward_learner"] if "reward_learner" in g else g["reward_mean"]


def summary_table(
    logs: pd.DataFrame,
    window: int = 3,
    alpha: float = 0.05,
    beta_range: tuple[float, float] | None = None,
) -> pd.DataFrame:
    """Per algorithm: the learner's own reward (`own_reward`) at the start and end (mean of the
    first and last `window` steps that have one; `reward_first_step`: the first), final KL, step time,
    the critic's explained variance over the last third of the steps with a t interval at
    1 - alpha over those steps (so "positive" is read from the interval, not the mean), and β's
    trace: first, last, smallest, largest and, with the adaptive controller's `beta_range`, the
    steps at which β sat at its floor and at its ceiling (NaN without a β or a range)."""
    from scipy import stats

    rows = []
    for algo, g in logs.groupby("algo", sort=False):
        own = own_reward(g).dropna()
        tail = g.tail(max(1, len(g) // 3))
        ev_tail = tail["explained_variance"].dropna().to_numpy(float)
        prior_tail = tail.get("explained_variance_prior", pd.Series(dtype=float)).dropna()
        if ev_tail.size > 1 and ev_tail.std(ddof=1) > 0:
            half = stats.t.ppf(1 - alpha / 2, ev_tail.size - 1) * stats.sem(ev_tail)
            ev_low, ev_high = ev_tail.mean() - half, ev_tail.mean() + half
        else:
            ev_low = ev_high = float(ev_tail.mean()) if ev_tail.size else float("nan")
        rows.append(
            {
                "algorithm": algorithm_label(algo),
                "steps": int(g["step"].max()),
                "reward_first": own.head(window).mean(),
                "reward_last": own.tail(window).mean(),
                "reward_first_step": int(g.loc[own.index[0], "step"]) if len(own) else np.nan,
                "kl_last": g["kl"].tail(window).mean(),
                "kl_estimator": g["kl_estimator"].dropna().iloc[-1]
                if "kl_estimator" in g and g["kl_estimator"].notna().any()
                else None,
                "entropy_last": g["entropy"].tail(window).mean(),
                "explained_variance_last_third": float(ev_tail.mean()) if ev_tail.size else np.nan,
                "explained_variance_low": ev_low,
                "explained_variance_high": ev_high,
                # the critic's prior alone (the reward model's prefix scores); NaN without one
                "explained_variance_prior_last_third": float(prior_tail.mean())
                if len(prior_tail)
                else np.nan,
                "beta_first": g["kl_coef"].iloc[0],
                "beta_last": g["kl_coef"].iloc[-1],
                "beta_min": g["kl_coef"].min(),
                "beta_max": g["kl_coef"].max(),
                **_steps_at_bounds(g["kl_coef"], beta_range),
                "step_time_s": g["step_time_s"].median(),
                "tokens_per_s": g["tokens_per_s"].median(),
            }
        )
    return pd.DataFrame(rows)


def _steps_at_bounds(beta: pd.Series, beta_range: tuple[float, float] | None) -> dict[str, float]:
    """The steps a β trace sat at the floor and at the ceiling of the controller's range."""
    b = beta.dropna().to_numpy(float)
    if beta_range is None or not b.size:
        return {"beta_steps_at_floor": np.nan, "beta_steps_at_ceiling": np.nan}
    low, high = beta_range
    return {"beta_steps_at_floor": int(np.isclose(b, low, rtol=1e-6).sum()),
            "beta_steps_at_ceiling": int(np.isclose(b, high, rtol=1e-6).sum())}  # fmt: skip


#: Which critic each RLGF scheme fits (on which tokens), for the guidance table and the report.
CRITIC_OF_SCHEME = {
    "ppo_pp": "V_θ (the policy's, on its tokens)",
    "aggrevated": "V_g (the guide's, on its tokens)",
}


#: `guidance_table`'s columns: a run without an RLGF algorithm writes the table with its header
#: alone (so a rerun without one leaves no earlier run's guidance behind).
GUIDANCE_COLUMNS = ("algorithm", "scheme", "steps", "learner_share", "reward_mean", "kl_last",
                    "critic", "explained_variance", "explained_variance_prior", "step_time_s",
                    "cost_vs_ppo")  # fmt: skip


def guidance_table(logs: Any) -> Any:
    """Per algorithm and scheme: steps, the learner's share of the response tokens, mean reward,
    KL and critic explained variance, and the median step time relative to PPO's (when PPO ran).

    `logs`: the stacked training logs (`rl.stage.read_logs`); PPO's rows give the cost baseline.
    Logs without an RLGF algorithm: the header alone (PPO's rows are only their baseline).
    """
    import pandas as pd

    if "scheme" not in logs or not logs["algo"].isin(RLGF_ALGORITHMS).any():
        return pd.DataFrame(columns=list(GUIDANCE_COLUMNS))
    ppo_time = logs.loc[logs["algo"] == "ppo", "step_time_s"].median()
    rows = []
    for (algo, scheme), g in logs.groupby(["algo", "scheme"], sort=False, dropna=True):
        rows.append(
            {
                "algorithm": algorithm_label(str(algo)),
                "scheme": algorithm_label(str(scheme)),
                "steps": len(g),
                "learner_share": g["learner_share"].mean(),
                "reward_mean": g["reward_mean"].mean(),
                "kl_last": g["kl"].iloc[-1],
                # the scheme's own critic on its own tokens: V_theta (the policy's) in PPO++,
                # V_g (the guide's) in AggreVaTeD; the prior alone shows what its head adds
                "critic": CRITIC_OF_SCHEME.get(str(scheme), "V (the policy's)"),
                "explained_variance": g["explained_variance"].mean(),
                "explained_variance_prior": g["explained_variance_prior"].mean()
                if "explained_variance_prior" in g
                else np.nan,
                "step_time_s": g["step_time_s"].median(),
                "cost_vs_ppo": g["step_time_s"].median() / ppo_time if ppo_time > 0 else np.nan,
            }
        )
    return pd.DataFrame(rows, columns=list(GUIDANCE_COLUMNS))


#: `training_table`'s columns: a run without ILHF writes the table with its header alone.
ILHF_TRAINING_COLUMNS = ("algorithm", "steps", "pairs_per_step", "mixed_outcome_share",
                         "loss_first", "loss_last", "pref_accuracy_last", "particle_spread_last",
                         "reward_last", "kl_last", "step_time_s")  # fmt: skip


def training_table(logs: pd.DataFrame) -> pd.DataFrame:
    """Per ILHF algorithm: steps, pairs per step (and the share with different outcomes), the ILHF
    loss at the start and end, the particles' preference accuracy on pairs with a winner, the
    spread of the particles' log-likelihood margins (their disagreement), and the step time."""

    rows = []
    for algo, g in logs[logs["algo"].isin(ILHF_ALGORITHMS)].groupby("algo", sort=False):
        third = max(1, len(g) // 3)
        rows.append({"algorithm": algorithm_label(str(algo)), "steps": len(g),
                     "pairs_per_step": g["pairs"].mean(),
                     "mixed_outcome_share": float(g["mixed_pairs"].sum() / max(g["pairs"].sum(), 1)),
                     "loss_first": g["ilhf_loss"].head(third).mean(),
                     "loss_last": g["ilhf_loss"].tail(third).mean(),
                     "pref_accuracy_last": g["pref_accuracy"].tail(third).mean(),
                     "particle_spread_last": g["particle_spread"].tail(third).mean(),
                     "reward_last": g["reward_mean"].tail(third).mean(),
                     "kl_last": g["kl"].tail(third).mean(),
                     "step_time_s": g["step_time_s"].median()})  # fmt: skip
    return pd.DataFrame(rows, columns=list(ILHF_TRAINING_COLUMNS))
