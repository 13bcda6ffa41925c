"""The RLGF paper's evaluation on our held-out prompts (notebook 04 and the report).

Chang et al. (2023), "Learning to Generate Better Than Your LLM", compare PPO with guided RL
(PPO++, AggreVaTeD, LOLS, D²LOLS) in three ways that carry over to MONA:

* their IMDB table: one row per policy (zero-shot, SFT, SFT + each RL algorithm; we add the
  MET-only SFT and best-of-N) with the reward, the perplexity of reference texts under the policy
  and the perplexity of the policy's own outputs under a fixed model (`rlgf_table`);
* their Figure 2: reward against perplexity (`plot_reward_perplexity`, beside the reward-KL
  frontier of `evaluation.figures.plot_frontier`);
* their Figure 3: easy against hard prompts (`prompt_difficulty`, `easy_hard_table`).

Two questions are then answered from paired cluster t intervals (`guidance_table`): does
guidance beat PPO, and does RL beat supervised learning on what was met (`sft_met`)? Everything
here assembles what the evaluation stage already measured (`evaluation.tables.summary_table`,
`evaluation.tables.heldout_perplexity`, the per-response samples): nothing is generated or scored again.
Every verdict (a code of `stats.bound_verdict`) is read from an interval, never from the sign of a
point estimate; every interval resamples countries, the unit prompts of one country share.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from rlxf_utils.algorithms import RLGF_ALGORITHMS, algorithm_label
from rlxf_utils.evaluation.questions import policy_kls, question_comparisons
from rlxf_utils.plots import ci_err
from rlxf_utils.prompts import CONTEXT_FIELDS
from rlxf_utils.stats import (
    bootstrap_ci,
    bound_verdict,
    family_alpha,
    level,
    paired_comparison,
    per_prompt_means,
)
from rlxf_utils.stats.intervals import contrast_t

SUPERVISED = ("sft", "sft_met")


MEASURES = {"reward": "reward model", "audit_reward": "audit model"}


HALVES = ("easy", "hard")


EASY_HARD_COLUMNS = ["policy", "label", "half", "n_prompts", "n_countries", "ave_r", "ave_r_low",
                     "ave_r_high", "gain", "gain_low", "gain_high", "gain_verdict",
                     "gain_ci_level", "median_met_rate"]  # fmt: skip


def policy_label(name: str) -> str:
    """How a policy is named in the RLGF table and its figures ('ppo_pp' -> 'PPO++')."""
    return {"base": "zero-shot (base)", "best_of_n": "best-of-N"}.get(name, algorithm_label(name))


def _kind(name: str, algos: Sequence[str]) -> str:
    if name == "base":
        return "zero-shot"
    if name in SUPERVISED:
        return "supervised"
    if name == "best_of_n":
        return "best-of-N"
    if name in RLGF_ALGORITHMS:
        return "RL, guided"
    return "RL" if name in algos else "other"


def rlgf_policies(present: Sequence[str], algos: Sequence[str]) -> list[str]:
    """The table's rows in the paper's order: zero-shot, the supervised policies, every RL
    algorithm in the order the run lists them (`algorithms.algorithm`), best-of-N; absent ones left out."""
    have = set(present)
    return [p for p in ("base", *SUPERVISED, *algos, "best_of_n") if p in have]


def rlgf_table(
    summary: pd.DataFrame, heldout_ppl: pd.DataFrame | None, algos: Sequence[str]
) -> pd.DataFrame:
    """The RLGF paper's IMDB-style table, assembled from the evaluation summary.

    One row per policy (`rlgf_policies` order). Columns: Ave(R) with its cluster-bootstrap CI
    (`ave_r`, `ave_r_low`, `ave_r_high`), the audit reward with its CI, KL to the start policy
    (`kl_kind` says 'upper bound' for best-of-N), `output_ppl` (perplexity of the policy's own
    responses under the zero-shot model: the paper's output-perplexity), `met_ppl` (perplexity of
    held-out historical MET descriptions under the policy: the paper's perplexity of references;
    NaN for best-of-N, which has no density), `distinct_2` and `finished` (share of responses
    that end before the token cap).
    """
    s = summary.set_index("policy")
    order = rlgf_policies(list(s.index), algos)
    ppl = (
        heldout_ppl.set_index("policy")["ppl_met"]
        if heldout_ppl is not None and not heldout_ppl.empty and "ppl_met" in heldout_ppl
        else pd.Series(dtype=float)
    )
    rows = []
    for p in order:
        r = s.loc[p]
        rows.append(
            {
                "policy": p,
                "label": policy_label(p),
                "kind": _kind(p, algos),
                **{c: r.get(c, math.nan) for c in ("ave_r", "ave_r_low", "ave_r_high", "audit",
                                                   "audit_low", "audit_high", "kl")},
                "kl_kind": r.get("kl_kind", "sampled"),
                "output_ppl": r.get("perplexity", math.nan),
                "met_ppl": float(ppl.get(p, math.nan)),
                "distinct_2": r.get("distinct_2", math.nan),
                "finished": r.get("finished", math.nan),
            }
        )  # fmt: skip
    return pd.DataFrame(rows)


def median_split(rates: Sequence[float] | np.ndarray) -> tuple[float, np.ndarray]:
    """(median, half): 'easy' above the median, 'hard' below it; rates equal to the median all go
    to the one side that leaves the two halves closest in size (the hard side when both are as
    close), so equal contexts are never split apart. NaN rates get None, and so does every rate
    when one half would be empty (all rates equal): then there is no split to make."""
    x = np.asarray(rates, dtype=float)
    ok = ~np.isnan(x)
    none = np.full(x.shape, None, dtype=object)
    if not ok.any():
        return math.nan, none
    med = float(np.median(x[ok]))
    above, at = int((x[ok] > med).sum()), int((x[ok] == med).sum())
    below = int(ok.sum()) - above - at
    ties_easy = abs((above + at) - below) < abs(above - (below + at))
    easy = ok & ((x > med) | ((x == med) & ties_easy))
    hard = ok & ~easy
    if not easy.any() or not hard.any():
        return med, none
    return med, np.where(easy, "easy", np.where(hard, "hard", None)).astype(object)


def prompt_difficulty(
    samples: pd.DataFrame, labelled: pd.DataFrame, keys: Sequence[str] = CONTEXT_FIELDS
) -> pd.DataFrame:
    """Each held-out prompt's historical MET rate and whether it is easy or hard.

    The rate is that of the labelled MONA conditions sharing the prompt's context (`keys`; by
    default the prompt's own context: country, arrangement type and descriptor, the fields of
    its prompt and of the reward model's input). A context holds few conditions (often one), so
    its raw rate is mostly 0 or 1; the split uses the rule-of-succession estimate
    `met_rate_smoothed` = (MET + 1) / (conditions + 2), the posterior mean under a uniform prior,
    which ranks four met conditions out of four above one out of one. Prompts are split at its
    median over prompts (`median_split`): contexts whose conditions were mostly met are easy,
    contexts whose conditions mostly failed are hard. `met_rate` and `n_history` keep the raw
    numbers.

    Using these labels is legitimate: held-out prompts come from the evaluation countries, and
    every row of those countries sits in the reward protocol's test split
    (`data.splits.nest_evaluation_holdout`), so neither the reward model, nor the audit model, nor SFT
    or RL ever trained on a row whose outcome sets the split; the split only stratifies the
    evaluation, it never feeds a policy or a reward.
    """
    keys = list(keys)
    per = samples.groupby("prompt_id", sort=True)[keys].first()
    hist = labelled.groupby(keys, sort=False)["y"].agg(n_history="size", n_met="sum")
    out = per.join(hist, on=keys)
    out["n_history"] = out["n_history"].fillna(0).astype(int)
    out["n_met"] = out["n_met"].fillna(0).astype(int)
    with np.errstate(invalid="ignore", divide="ignore"):
        out["met_rate"] = np.where(out["n_history"] > 0, out["n_met"] / out["n_history"], np.nan)
    out["met_rate_smoothed"] = (out["n_met"] + 1) / (out["n_history"] + 2)
    med, half = median_split(out["met_rate_smoothed"].to_numpy())
    out["half"] = half
    out["median_met_rate"] = med
    out["context_key"] = " × ".join(keys)
    return out.reset_index()


def _per_prompt(
    samples: pd.DataFrame, policies: Sequence[str], col: str = "reward"
) -> pd.DataFrame:
    """Prompt x policy mean of `col` for `policies` (`stats.paired.per_prompt_means`)."""
    return per_prompt_means(samples[samples["policy"].isin(policies)], col)


def easy_hard_table(
    samples: pd.DataFrame,
    difficulty: pd.DataFrame,
    policies: Sequence[str],
    start: str,
    n_boot: int,
    alpha: float,
    seed: int,
) -> pd.DataFrame:
    """Per policy and half (easy, hard): Ave(R) with a cluster-bootstrap CI over countries and
    the gain over the start policy with a cluster t CI over countries (`stats.paired_comparison`);
    and a `hard_minus_easy` row per policy, the difference of the two halves' Ave(R) and of their
    gains, each with the cluster t of the contrast (`stats.intervals.contrast_t`: a country may
    hold prompts of both halves). The gains are one family
    (`stats.family_alpha`: every policy's easy, hard and hard - easy gain, each interval at level
    1 - alpha / m, `gain_ci_level`); `gain_verdict` reads the gain's interval. Ave(R) intervals
    are at 1 - alpha."""
    d = difficulty.set_index("prompt_id")
    d = d[d["half"].isin(HALVES)]
    if d.empty:  # no split: every context has the same rate, or none has history
        return pd.DataFrame(columns=EASY_HARD_COLUMNS)
    wide = _per_prompt(samples, [*policies, start])
    wide = wide.loc[wide.index.intersection(d.index)]
    half = d.loc[wide.index, "half"]
    country = d.loc[wide.index, "country"].astype(str)
    m = 3 * sum(1 for pol in policies if pol in wide and pol != start)
    a_gain = family_alpha(alpha, m)
    rows = []
    for pol in policies:
        if pol not in wide:
            continue
        for h in HALVES:
            sel = (half == h).to_numpy() & wide[pol].notna().to_numpy()
            if not sel.any():
                continue
            v = wide.loc[sel, pol]
            ave, lo, hi = bootstrap_ci(
                v.to_numpy(), n_boot, alpha, seed, clusters=country[sel].to_numpy()
            )
            rec = {"policy": pol, "label": policy_label(pol), "half": h, "n_prompts": int(sel.sum()),
                   "n_countries": int(country[sel].nunique()), "ave_r": ave, "ave_r_low": lo,
                   "ave_r_high": hi}  # fmt: skip
            if pol != start:
                res = paired_comparison(v.to_numpy(), wide.loc[sel, start].to_numpy(), n_boot, seed,
                                        alpha, clusters=country[sel].to_numpy(), family_size=m)  # fmt: skip
                rec.update(gain=res["mean_diff"], gain_low=res["ci_low"], gain_high=res["ci_high"],
                           gain_ci_level=1 - a_gain)  # fmt: skip
            rows.append(rec)
        rows.append(_hard_minus_easy(wide, pol, start, half, country, n_boot, alpha, seed, a_gain))
    out = pd.DataFrame(rows).reindex(columns=EASY_HARD_COLUMNS)
    out["gain_verdict"] = [
        bound_verdict(lo, hi) if pd.notna(g) else ""
        for g, lo, hi in zip(out["gain"], out["gain_low"], out["gain_high"], strict=True)
    ]
    out["median_met_rate"] = float(d["median_met_rate"].iloc[0])
    return out


def _hard_minus_easy(wide: pd.DataFrame, pol: str, start: str, half: pd.Series, country: pd.Series,
                     n_boot: int, alpha: float, seed: int, a_gain: float) -> dict[str, Any]:  # fmt: skip
    ok = (wide[pol].notna() & wide[start].notna()).to_numpy()
    hard = (half == "hard").to_numpy()[ok]
    g = country.to_numpy()[ok]
    own = wide[pol].to_numpy()[ok]
    gain = own - wide[start].to_numpy()[ok]

    ave_t = contrast_t(own, hard, g, alpha)  # hard minus easy: the contrast's cluster t
    ave, lo, hi = ave_t["mean"], ave_t["low"], ave_t["high"]
    rec = {"policy": pol, "label": policy_label(pol), "half": "hard_minus_easy",
           "n_prompts": int(ok.sum()), "n_countries": int(pd.Series(g).nunique()), "ave_r": ave,
           "ave_r_low": lo, "ave_r_high": hi}  # fmt: skip
    if pol != start:
        # the family's cluster t, as the halves' gains beside it (`stats.intervals.contrast_t`)
        res = contrast_t(gain, hard, g, a_gain)
        rec.update(gain=res["mean"], gain_low=res["low"], gain_high=res["high"],
                   gain_ci_level=1 - a_gain)  # fmt: skip
    return rec


def guidance_comparator(algos: Sequence[str], present: Iterable[str] | None = None) -> str | None:
    """The PPO arm guidance is compared with: `ppo_mle` (PPO with the RLGF algorithms' MLE term,
    so that the comparison isolates guidance) when it ran, else plain `ppo`, else None.
    `present`: the policies evaluated (default: every one of `algos`)."""
    seen = set(algos if present is None else present)
    for name in ("ppo_mle", "ppo"):
        if name in algos and name in seen:
            return name
    return None


def guidance_pairs(samples: pd.DataFrame, algos: Sequence[str]) -> list[tuple[str, str, str]]:
    """The (question, policy, versus) pairs of the two RLGF questions (`guidance_table`)."""
    present = set(samples["policy"])
    pairs: list[tuple[str, str, str]] = []
    ppo = guidance_comparator(algos, present)
    if ppo is not None:
        pairs += [
            ("guidance_vs_ppo", a, ppo) for a in algos if a in RLGF_ALGORITHMS and a in present
        ]
    if "sft_met" in present:
        pairs += [("rl_vs_sft_met", a, "sft_met") for a in algos if a in present]
    return pairs


def guidance_table(
    samples: pd.DataFrame,
    algos: Sequence[str],
    n_boot: int,
    alpha: float,
    seed: int,
    measures: Sequence[str] = ("reward", "audit_reward"),
    kl: Mapping[str, float] | None = None,
    kl_ratio: float | None = None,
) -> pd.DataFrame:
    """Paired comparisons behind the two RLGF questions, under the reward and the audit model.

    `guidance_vs_ppo`: each guided algorithm that ran (`config.RLGF_ALGORITHMS`) against PPO
    (`guidance_comparator`: PPO with the same MLE term when it ran), only when PPO ran.
    `rl_vs_sft_met`: each RL algorithm against `sft_met`, when it was
    evaluated; only pairs at comparable KL (`questions.kl_matched`: `kl`, `kl_ratio`). Per-prompt
    mean rewards on the prompts both answered, difference with a cluster t interval over
    countries (`stats.paired.paired_comparison`), `verdict` read from that
    interval. Each question is a family under each measure (`stats.family_alpha`): its m intervals
    at level 1 - alpha / m (`ci_level`), `p_family` below alpha exactly when the verdict is given.
    Columns: question, measure, policy, versus, n, n_clusters, diff, low, high, verdict,
    p_family, ci_level.
    """
    pairs = guidance_pairs(samples, algos)
    return question_comparisons(samples, pairs, n_boot, alpha, seed, measures, kl, kl_ratio)


_MARKERS = {"zero-shot": "s", "supervised": "D", "RL": "o", "RL, guided": "^", "best-of-N": "*"}


def plot_reward_perplexity(table: pd.DataFrame, alpha: float = 0.05) -> Any:
    """Ave(R) against the perplexity of each policy's own responses under the zero-shot model
    (left) and against the perplexity of held-out historical MET descriptions under the policy
    (right): the RLGF paper's Figure 2 trade-off, one point per policy, bars its CI."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.0), sharey=True)
    panels = (("output_ppl", "output perplexity\n(its responses under the zero-shot model)"),
              ("met_ppl", "perplexity of held-out MET descriptions\n(under the policy)"))  # fmt: skip
    for ax, (col, xlabel) in zip(axes, panels, strict=True):
        t = table.dropna(subset=[col, "ave_r"])
        t = t[t[col] > 0]
        for j, r in enumerate(t.itertuples()):
            ax.errorbar([getattr(r, col)], [r.ave_r], yerr=ci_err(t.iloc[[j]], "ave_r", "ave_r_low", "ave_r_high"),
                        fmt=_MARKERS.get(r.kind, "o"), color=f"C{table.index.get_loc(r.Index) % 10}",
                        capsize=3, ms=7, label=r.label)  # fmt: skip
        if len(t) and t[col].max() / t[col].min() > 5:
            ax.set_xscale("log")
        ax.set(xlabel=xlabel)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("Ave(R) on held-out prompts")
    if table.dropna(subset=["met_ppl"]).empty:
        axes[1].text(0.5, 0.5, "no held-out perplexity measured", ha="center",
                     transform=axes[1].transAxes)  # fmt: skip
    fig.suptitle(f"Reward against perplexity, every policy (lower perplexity: more fluent; "
                 f"bars: {level(alpha)} CI, countries resampled)",
                 fontsize=10)  # fmt: skip
    handles, labels = axes[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 5), fontsize=8,
                   bbox_to_anchor=(0.5, -0.08))  # fmt: skip
    fig.tight_layout()
    return fig


def easy_hard_gain_level(easy_hard: pd.DataFrame, alpha: float = 0.05) -> str:
    """The level of the easy/hard gains' intervals ('99.2%'): their family's, `gain_ci_level` of
    `easy_hard_table` (1 - `alpha` for a table without it)."""
    levels = easy_hard.get("gain_ci_level", pd.Series(dtype=float)).dropna()
    return level(1 - float(levels.iloc[0])) if len(levels) else level(alpha)


def plot_easy_hard(easy_hard: pd.DataFrame, start: str, alpha: float = 0.05) -> Any:
    """The RLGF paper's Figure 3 on our prompts: Ave(R) (left) and the gain over the start policy
    (right) per policy on easy and hard prompts. The title states each panel's level and method
    as `easy_hard_table` computed them: Ave(R)'s cluster-bootstrap CIs at 1 - `alpha`, the gains'
    simultaneous cluster t CIs over countries at their family's level (`gain_ci_level`)."""
    import matplotlib.pyplot as plt

    t = easy_hard[easy_hard["half"].isin(HALVES)]
    pols = list(dict.fromkeys(t["policy"]))
    x = np.arange(len(pols))
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, (mid, lo, hi), title in (
        (axes[0], ("ave_r", "ave_r_low", "ave_r_high"), "Ave(R)"),
        (axes[1], ("gain", "gain_low", "gain_high"), f"gain over {policy_label(start)}"),
    ):
        for k, (half, color) in enumerate(zip(HALVES, ("tab:green", "tab:red"), strict=True)):
            h = t[t["half"] == half].set_index("policy").reindex(pols)
            ax.bar(x + (k - 0.5) * 0.4, h[mid], 0.4, yerr=ci_err(h.fillna({lo: h[mid], hi: h[mid]}), mid, lo, hi),
                   capsize=3, color=color, alpha=0.8, label=f"{half} prompts")  # fmt: skip
        ax.set_xticks(x, [policy_label(p) for p in pols], rotation=25, ha="right")
        ax.set(title=title)
        ax.axhline(0, color="black", lw=0.8)
        ax.grid(axis="y", alpha=0.3)
    med = easy_hard["median_met_rate"].iloc[0] if len(easy_hard) else math.nan
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Easy vs hard prompts: split at the median historical MET rate of the context,\n"
                 f"(MET + 1) / (conditions + 2) = {med:.2f}; bars: Ave(R) {level(alpha)} CI, "
                 f"countries resampled; gain {easy_hard_gain_level(easy_hard, alpha)} "
                 "simultaneous cluster t CI over countries", fontsize=10)  # fmt: skip
    fig.tight_layout()
    return fig


def rlgf_tables(samples: pd.DataFrame, summary: pd.DataFrame, heldout_ppl: pd.DataFrame | None,
                labelled: pd.DataFrame, algos: Sequence[str], start: str, n_boot: int, alpha: float,
                seed: int, kl_ratio: float | None = None) -> dict[str, pd.DataFrame]:  # fmt: skip
    """The evaluation stage's RLGF tables: `eval_rlgf` (the paper's table), `eval_prompt_difficulty`
    (each prompt's context rate and half), `eval_easy_hard` and `eval_guidance` (pairs at
    comparable KL, `kl_ratio`: `questions.kl_matched` on the summary's KLs)."""
    table = rlgf_table(summary, heldout_ppl, algos)
    difficulty = prompt_difficulty(samples[samples["policy"] == start], labelled)
    easy_hard = easy_hard_table(
        samples, difficulty, list(table["policy"]), start, n_boot, alpha, seed
    )
    guidance = guidance_table(samples, algos, n_boot, alpha, seed, kl=policy_kls(summary),
                              kl_ratio=kl_ratio)  # fmt: skip
    return {"eval_rlgf": table, "eval_prompt_difficulty": difficulty,
            "eval_easy_hard": easy_hard, "eval_guidance": guidance}  # fmt: skip


def rlgf_figures(tables: Mapping[str, pd.DataFrame], start: str, alpha: float) -> dict[str, Any]:
    """Figures `eval_reward_perplexity` and `eval_easy_hard` from `rlgf_tables`' output."""
    return {
        "eval_reward_perplexity": plot_reward_perplexity(tables["eval_rlgf"], alpha),
        "eval_easy_hard": plot_easy_hard(tables["eval_easy_hard"], start, alpha),
    }
