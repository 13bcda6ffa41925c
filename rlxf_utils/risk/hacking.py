"""Reward hacking: reward against response length (Spearman with prompt-clustered intervals),
training-reward against audit-reward gain over checkpoints (intervals over prompts at the last
one), and the bigrams RL made more frequent (descriptive).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import pandas as pd

from rlxf_utils.plots import WIDTH, setup_style
from rlxf_utils.risk.common import RiskError, require_columns, tuned_policies
from rlxf_utils.stats import corr, mean_ci, per_prompt_means, spearman_ci


def length_reward(
    samples: pd.DataFrame,
    length_col: str = "n_tokens",
    reward_col: str = "reward",
    bins: int = 5,
    policy_col: str = "policy",
    pooled_name: str = "all generated",
    alpha: float = 0.05,
    n_boot: int = 2000,
    seed: int = 0,
    cluster_col: str = "prompt_id",
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(correlations, binned means) of reward against response length, per policy and pooled.

    Correlations: Spearman rho and Pearson r (NaN below 3 points or for a constant side; no
    p-values, which would treat the responses to one prompt as independent), and
    `spearman_low`, `spearman_high`: a percentile-bootstrap interval at level 1 - alpha that
    resamples whole prompts (`cluster_col`; rows when absent), since the samples of one prompt
    are not independent.
    `n_boot` 0 skips the intervals (NaN). Bins: `bins` quantile bins of length within each group
    (fewer when lengths tie), with n, mean length, mean reward (and mean audit reward when the
    table has `audit_reward`).
    """
    require_columns(samples, [policy_col, length_col, reward_col], "samples table")
    groups: list[tuple[str, pd.DataFrame]] = [
        (str(p), g) for p, g in samples.groupby(policy_col, sort=False)
    ]
    if samples[policy_col].nunique() > 1:
        groups.append((pooled_name, samples))
    crows, brows = [], []
    for name, g in groups:
        x = g[length_col].astype(float).to_numpy()
        r = g[reward_col].astype(float).to_numpy()
        rho, _, pr, _ = corr(x, r)  # their p-values assume independent responses: not kept
        low = high = math.nan
        if n_boot > 0 and not math.isnan(rho):
            cl = g[cluster_col].to_numpy() if cluster_col in g else np.arange(len(g))
            _, low, high = spearman_ci(x, r, cl, alpha, n_boot, seed)
        crows.append(
            {
                "policy": name,
                "n": len(g),
                "mean_length": float(np.mean(x)) if len(x) else math.nan,
                "spearman": rho,
                "spearman_low": low,
                "spearman_high": high,
                "pearson": pr,
            }
        )
        if len(g) == 0:
            continue
        lengths = g[length_col].astype(float)
        if lengths.nunique() > 1:
            codes = pd.qcut(lengths, q=bins, duplicates="drop")
        else:  # one length only (e.g. every response hit max_new_tokens): a single bin
            codes = pd.Series(pd.Interval(lengths.iloc[0], lengths.iloc[0], "both"), index=g.index)
        agg: dict[str, Any] = {
            "n": (reward_col, "size"),
            "mean_length": (length_col, "mean"),
            "mean_reward": (reward_col, "mean"),
        }
        if "audit_reward" in g:
            agg["mean_audit_reward"] = ("audit_reward", "mean")
        b = g.assign(_bin=codes).groupby("_bin", observed=True, sort=True).agg(**agg).reset_index()
        b["bin"] = [f"{iv.left:.0f}-{iv.right:.0f}" for iv in b["_bin"]]
        b.insert(0, "policy", name)
        brows.append(b.drop(columns="_bin"))
    binned = pd.concat(brows, ignore_index=True) if brows else pd.DataFrame()
    if len(binned):
        binned = binned[
            ["policy", "bin", *[c for c in binned.columns if c not in ("policy", "bin")]]
        ]
    return pd.DataFrame(crows), binned


def plot_length_reward(
    samples: pd.DataFrame, binned: pd.DataFrame, length_col: str = "n_tokens"
) -> Any:
    """Reward against response length: one dot per response, binned means per policy as lines."""
    import matplotlib.pyplot as plt

    setup_style()
    fig, ax = plt.subplots(figsize=(WIDTH, 3.0))
    for i, (pol, g) in enumerate(samples.groupby("policy", sort=False)):
        color = f"C{i}"
        ax.scatter(g[length_col], g["reward"], s=8, alpha=0.35, color=color)
        b = binned[binned["policy"] == pol]
        ax.plot(b["mean_length"], b["mean_reward"], marker="o", color=color, label=str(pol))
    ax.set(xlabel=f"response length ({length_col.replace('_', ' ')})", ylabel="reward, P(MET)")
    ax.set_title("Reward against response length (dots: responses; lines: quantile-bin means)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def checkpoint_gains(frontier: pd.DataFrame, base: str = "base") -> pd.DataFrame:
    """Training-reward and audit-reward gain over the start for every checkpoint of every algorithm.

    `gap = reward_gain - audit_gain`: a gap that widens with training means the policy learns
    what the training reward likes but an independent reward model does not (reward hacking).
    The start of an algorithm is its own step-0 row; else the shared start (the `base` row at
    step 0, as notebook 04 writes it); else its earliest checkpoint (`baseline` says which).
    Rows repeated for one (algo, step) are averaged. The `base` rows themselves are not listed.
    """
    require_columns(frontier, ["algo", "step", "reward", "audit_reward"], "frontier table")
    cols = [c for c in ("reward", "audit_reward", "kl") if c in frontier.columns]
    f = frontier.assign(step=frontier["step"].astype(int))
    f = f.groupby(["algo", "step"], sort=False)[cols].mean().reset_index()
    shared = f[(f["algo"] == base) & (f["step"] == 0)]
    parts = []
    for algo, g in f.groupby("algo", sort=False):
        if algo == base:
            continue
        g = g.sort_values("step", kind="stable").reset_index(drop=True)
        if (g["step"] == 0).any():
            b, how = g[g["step"] == 0].iloc[0], f"{algo} step 0"
        elif len(shared):
            b, how = shared.iloc[0], f"{base} step 0"
            g = pd.concat([shared.assign(algo=algo), g], ignore_index=True)
        else:
            b, how = g.iloc[0], f"{algo} step {int(g['step'].iloc[0])}"
        out = pd.DataFrame(
            {
                "algo": algo,
                "step": g["step"].astype(int),
                "baseline": how,
                "reward": g["reward"].astype(float),
                "audit_reward": g["audit_reward"].astype(float),
                "reward_gain": g["reward"].astype(float) - float(b["reward"]),
                "audit_gain": g["audit_reward"].astype(float) - float(b["audit_reward"]),
            }
        )
        out["gap"] = out["reward_gain"] - out["audit_gain"]
        if "kl" in g:
            out["kl"] = g["kl"].astype(float).to_numpy()
        parts.append(out)
    cols_out = [
        "algo",
        "step",
        "baseline",
        "reward",
        "audit_reward",
        "reward_gain",
        "audit_gain",
        "gap",
    ]
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=cols_out)


def final_gains(
    samples: pd.DataFrame,
    start: str,
    policies: Sequence[str],
    alpha: float = 0.05,
    n_boot: int = 2000,
    seed: int = 0,
) -> pd.DataFrame:
    """Gain of each final policy over `start` on the same prompts, with intervals over prompts.

    Per policy: per-prompt mean training reward and audit reward minus the start's on the prompts
    both answered; `reward_gain`, `audit_gain` and `gap` (their difference) with
    percentile-bootstrap intervals at level 1 - alpha over prompts (one shared set of draws, so
    the three are paired). These are the last checkpoints of `checkpoint_gains`, measured on
    notebook 04's samples instead of the frontier's means.
    """
    require_columns(samples, ["policy", "prompt_id", "reward", "audit_reward"], "samples table")
    present = set(samples["policy"])
    cols = ["algo", "n_prompts"] + [
        f"{m}{s}" for m in ("reward_gain", "audit_gain", "gap") for s in ("", "_low", "_high")
    ]
    if start not in present:
        return pd.DataFrame(columns=cols)
    wide = {c: per_prompt_means(samples, reward_col=c) for c in ("reward", "audit_reward")}
    rows = []
    for pol in policies:
        if pol not in present or pol == start:
            continue
        d_r = (wide["reward"][pol] - wide["reward"][start]).to_numpy(dtype=float)
        d_a = (wide["audit_reward"][pol] - wide["audit_reward"][start]).to_numpy(dtype=float)
        ok = ~(np.isnan(d_r) | np.isnan(d_a))
        row: dict[str, Any] = {"algo": pol, "n_prompts": int(ok.sum())}
        for name, v in (("reward_gain", d_r), ("audit_gain", d_a), ("gap", d_r - d_a)):
            est, low, high = mean_ci(v[ok], None, alpha, n_boot, seed)
            row |= {name: est, f"{name}_low": low, f"{name}_high": high}
        rows.append(row)
    return pd.DataFrame(rows, columns=cols)


def plot_gains(gains: pd.DataFrame) -> Any:
    """Training-reward gain and audit-reward gain against training step, one colour per algorithm."""
    import matplotlib.pyplot as plt

    setup_style()
    fig, ax = plt.subplots(figsize=(WIDTH, 2.8))
    for i, (algo, g) in enumerate(gains.groupby("algo", sort=False)):
        ax.plot(
            g["step"], g["reward_gain"], marker="o", color=f"C{i}", label=f"{algo}: training reward"
        )
        ax.plot(
            g["step"],
            g["audit_gain"],
            marker="s",
            ls="--",
            color=f"C{i}",
            label=f"{algo}: audit reward",
        )
    ax.axhline(0, color="black", lw=0.8)
    ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
    ax.set(xlabel="training step", ylabel="gain over the start")
    ax.set_title("Does the audit reward follow the training reward?")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


_WORD = re.compile(r"[a-z0-9]+(?:['-][a-z0-9]+)*")


def word_tokens(text: str) -> list[str]:
    """Lower-case words without punctuation: 'Reform (tax)' -> ['reform', 'tax'] (n-gram reading aid)."""
    return _WORD.findall(str(text).lower())


def _ngram_presence(texts: Iterable[str], n: int) -> tuple[Counter[str], int]:
    """How many texts contain each n-gram (counted once per text), and the number of texts."""
    counts: Counter[str] = Counter()
    k = 0
    for t in texts:
        toks = word_tokens(t)
        counts.update({" ".join(toks[i : i + n]) for i in range(len(toks) - n + 1)})
        k += 1
    return counts, k


def rising_ngrams(
    samples: pd.DataFrame,
    base: str = "base",
    policies: Sequence[str] | None = None,
    n: int = 2,
    top: int = 15,
    text_col: str = "response",
) -> pd.DataFrame:
    """The `top` n-grams whose share of responses rose most from `base` to each policy.

    Share = fraction of a policy's responses containing the n-gram at least once; words are
    lower-case with punctuation dropped (`word_tokens`), so 'reform,' and 'reform' count as one.
    Only rises > 0 are listed; ties: more responses first, then alphabetical.
    """
    require_columns(samples, ["policy", text_col], "samples table")
    if base not in set(samples["policy"]):
        raise RiskError(
            f"samples table has no '{base}' policy; found {sorted(set(samples['policy']))}"
        )
    policies = tuned_policies(samples["policy"]) if policies is None else list(policies)
    b_counts, b_n = _ngram_presence(samples.loc[samples["policy"] == base, text_col], n)
    rows = []
    for pol in policies:
        p_counts, p_n = _ngram_presence(samples.loc[samples["policy"] == pol, text_col], n)
        if p_n == 0:
            continue
        cand = []
        for g, c in p_counts.items():
            share_p = c / p_n
            share_b = b_counts.get(g, 0) / b_n if b_n else 0.0
            if share_p - share_b > 0:
                cand.append((-(share_p - share_b), -c, g, share_b, share_p, c))
        for neg, _, g, sb, sp, c in sorted(cand)[:top]:
            rows.append(
                {
                    "policy": pol,
                    "ngram": g,
                    "share_base": sb,
                    "share_policy": sp,
                    "rise": -neg,
                    "responses_with": c,
                }
            )
    cols = ["policy", "ngram", "share_base", "share_policy", "rise", "responses_with"]
    return pd.DataFrame(rows, columns=cols)
