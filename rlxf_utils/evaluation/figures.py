"""Notebook 04's figures: reward distributions, gains, reward uncertainty, the frontier, held-out
perplexity and grounding."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from rlxf_utils.algorithms import algorithm_label
from rlxf_utils.plots import ci_err
from rlxf_utils.stats import level


def plot_distributions(samples: pd.DataFrame, order: Sequence[str]) -> Any:
    """Reward and audit reward per policy (box plots over responses)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for ax, col, title in (
        (axes[0], "reward", "Reward model"),
        (axes[1], "audit_reward", "Audit (TF-IDF LR, disjoint rows)"),
    ):
        data = [samples.loc[samples["policy"] == p, col].dropna().to_numpy() for p in order]
        ax.boxplot(data, showmeans=True)
        ax.set_xticks(range(1, len(order) + 1), order, rotation=30, ha="right")
        ax.set(title=title, ylabel="P(MET)" if col == "reward" else None)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def plot_gains(summary: pd.DataFrame, start: str = "base", alpha: float = 0.05) -> Any:
    """Gain over the start policy under the training reward and the audit reward, with CIs: the
    vs-start family's members (the policies with a gain), `alpha` the family's own (1 - alpha is
    its simultaneous level)."""
    import matplotlib.pyplot as plt

    s = summary[(summary["policy"] != start) & summary["gain"].notna()].reset_index(drop=True)
    x = np.arange(len(s))
    fig, ax = plt.subplots(figsize=(8, 3.6))
    ax.bar(
        x - 0.2,
        s["gain"],
        0.4,
        yerr=ci_err(s, "gain", "gain_low", "gain_high"),
        label="reward model",
        capsize=3,
    )
    ax.bar(x + 0.2, s["audit_gain"], 0.4, yerr=ci_err(s, "audit_gain", "audit_gain_low", "audit_gain_high"), label="audit model", capsize=3)  # fmt: skip
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xticks(x, s["policy"], rotation=20, ha="right")
    ax.set(
        ylabel=f"mean P(MET) minus {start}",
        title=f"Gain over the starting policy ({level(alpha)} simultaneous cluster t CI over "
        "countries)",
    )
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def plot_reward_uncertainty(summary: pd.DataFrame, start: str = "base", alpha: float = 0.05) -> Any:
    """Ave(R) against the mean SD of the reward heads' P(MET) per policy, with CI bars on both.

    A policy to the right of its start moved into text the reward model is less sure about, so
    its Ave(R) rests on extrapolation; without heads (TF-IDF reward, `reward_heads: 0`) the
    figure says so.
    """
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.4))
    s = (
        summary.dropna(subset=["reward_sd"]).reset_index(drop=True)
        if "reward_sd" in summary
        else summary.iloc[:0]
    )
    if s.empty:
        ax.axis("off")
        ax.text(0.5, 0.5, "No reward uncertainty in this run: the reward source has no encoder\n"
                "features or evaluation.reward_heads is 0.", ha="center", va="center")  # fmt: skip
        return fig
    for r in s.itertuples():
        one = s[s["policy"] == r.policy]
        ax.errorbar(one["reward_sd"], one["ave_r"],
                    xerr=ci_err(one, "reward_sd", "reward_sd_low", "reward_sd_high"),
                    yerr=ci_err(one, "ave_r", "ave_r_low", "ave_r_high"),
                    fmt="s" if r.policy == start else "o", color="black" if r.policy == start else None,
                    capsize=3, label=algorithm_label(r.policy))  # fmt: skip
        ax.annotate(algorithm_label(r.policy), (r.reward_sd, r.ave_r), fontsize=7, xytext=(4, 4),
                    textcoords="offset points")  # fmt: skip
    ax.set(xlabel="mean SD of P(MET) across the reward heads (epistemic)",
           ylabel="Ave(R) on held-out prompts",
           title=f"Reward and the reward model's uncertainty ({level(alpha)} CIs, countries resampled)")  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig


def plot_frontier(frontier: pd.DataFrame, start: str = "base", alpha: float = 0.05) -> Any:
    """Reward against KL to the start policy: each algorithm's snapshots and final policy, and the
    best-of-N curve from the start policy (RLGF paper, Figure 2).

    Each algorithm's line starts at the start policy (step 0); bars are CIs over countries, so a
    rise smaller than them is not evidence of alignment. Best-of-N sits at its KL upper bound.
    """
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.4))
    origin = frontier[(frontier["algo"] == start) & (frontier["step"] == 0)]
    ax.plot(origin["kl"], origin["reward"], "ks", label=f"start ({start})")
    bon = frontier[frontier["algo"] == "best_of_n"].sort_values("step")
    if not bon.empty:
        ax.errorbar(bon["kl"], bon["reward"], yerr=ci_err(bon, "reward", "reward_low", "reward_high"),
                    fmt="--", color="gray", capsize=2, label="best-of-N (KL upper bound)")  # fmt: skip
        for r in bon.itertuples():
            ax.annotate(f"N={r.step}", (r.kl, r.reward), fontsize=7, color="gray", xytext=(3, -10),
                        textcoords="offset points")  # fmt: skip
    others = frontier[
        ~frontier["algo"].isin([start, "best_of_n"]) & (frontier["source"] != "reference")
    ]
    for algo, g in others.groupby("algo", sort=False):
        g = pd.concat([origin, g]).sort_values("step")
        err = ci_err(
            g.fillna({"reward_low": g["reward"], "reward_high": g["reward"]}),
            "reward",
            "reward_low",
            "reward_high",
        )
        ax.errorbar(
            g["kl"], g["reward"], yerr=err, fmt="-o", capsize=3, label=algorithm_label(algo)
        )
        for r in g.itertuples():
            ax.annotate(
                str(r.step), (r.kl, r.reward), fontsize=7, xytext=(4, 4), textcoords="offset points"
            )
    xlabel = f"KL(policy || {start}), nats per response"
    kl = frontier["kl"].dropna()
    if len(kl) and kl.max() > 10 * max(bon["kl"].max() if not bon.empty else 1.0, 1.0):
        # policies that drifted far would squeeze best-of-N and the close ones into one corner
        ax.set_xscale("symlog", linthresh=1.0)
        xlabel += " (linear below 1, log above)"
    ax.set(xlabel=xlabel, ylabel="Ave(R) on held-out prompts")
    ax.set_title(f"Reward-KL frontier (labels: training step or N; bars: {level(alpha)} CI, "
                 "countries resampled)")  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_heldout_perplexity(ppl: pd.DataFrame) -> Any:
    """Perplexity of held-out historical MET and Non-MET descriptions under each policy (log scale)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.4))
    x = np.arange(len(ppl))
    ax.bar(x - 0.2, ppl["ppl_met"], 0.4, label="MET descriptions")
    ax.bar(x + 0.2, ppl["ppl_nonmet"], 0.4, label="Non-MET descriptions")
    ax.set_yscale("log")
    ax.set_xticks(x, ppl["policy"], rotation=20, ha="right")
    ax.set(ylabel="perplexity per token (log scale)",
           title="Held-out historical descriptions under each policy")  # fmt: skip
    ax.grid(axis="y", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def plot_grounding(summary: pd.DataFrame) -> Any:
    """Similarity-weighted MET rate of each policy's nearest historical conditions, and novelty."""
    import matplotlib.pyplot as plt

    s = summary.dropna(subset=["grounded_met"]).reset_index(drop=True)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    x = np.arange(len(s))
    axes[0].bar(
        x,
        s["grounded_met"],
        yerr=ci_err(s, "grounded_met", "grounded_low", "grounded_high"),
        capsize=3,
    )
    axes[0].set(title="MET rate of nearest historical conditions", ylabel="weighted MET rate")
    axes[1].bar(x, s["max_sim"], color="tab:gray")
    axes[1].set(title="Similarity to the closest historical condition", ylabel="cosine (MiniLM)")
    for ax in axes:
        ax.set_xticks(x, s["policy"], rotation=30, ha="right")
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig
