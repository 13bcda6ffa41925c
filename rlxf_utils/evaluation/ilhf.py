"""The ILHF paper's questions on our held-out prompts (notebook 04 and the report).

Xu, Dong, Arumugam and Van Roy (2023), "Shattering the Agent-Environment Interface for
Fine-Tuning Inclusive Language Models", train the language model as its own reward so that it
reproduces the population's preferences instead of collapsing onto the majority response, and
measure it by the KL from the population to the model. On MONA the population is the history of
the same contexts, and the questions become: does inclusive learning (`ilhf_history`, which needs
no reward model, and `ilhf_online`) keep the population's variety where PPO collapses, and at what
reward? Measured here, from what the evaluation stage already produced (nothing is generated or
scored again; only the responses are embedded):

* the paper's KL to the population, up to a constant: `xent_met`, the cross-entropy per token of
  held-out historical MET descriptions (countries no SFT or RL saw) under the policy, and its
  difference from the start policy (the population's own entropy cancels in the difference);
* diversity against the history of the same contexts: the entropy of the economic areas the
  responses fall into (`top_area`, the area of their nearest historical neighbours), the KL from
  the history's area distribution to the policy's, distinct-2, and `pairwise_sim`, the mean
  cosine similarity (MiniLM) between the samples of one prompt (1: every sample the same).

`inclusive_table` has one row per policy; `inclusive_tests` compares each ILHF algorithm with PPO,
`sft_met` and the start policy (paired by prompt or by held-out row). Every verdict (a code of
`stats.bound_verdict`) is read from an interval, never from the sign of a point estimate; every
interval resamples countries, the unit that prompts and held-out rows of one country share.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from rlxf_utils.algorithms import ILHF_ALGORITHMS, algorithm_label
from rlxf_utils.evaluation.measures import area_distribution, entropy, kl_divergence
from rlxf_utils.evaluation.questions import kl_matched, policy_kls
from rlxf_utils.markdown import is_present
from rlxf_utils.plots import ci_err
from rlxf_utils.stats import (
    bootstrap_ci,
    bound_verdict,
    cluster_t,
    family_alpha,
    level,
    paired_comparison,
    per_prompt_means,
    prompt_clusters,
)

#: The history references of the same contexts: real MET and Non-MET descriptions.
HISTORY = ("history_met", "history_nonmet")


#: What each ILHF algorithm is compared with, in this order (those the run evaluated).
COMPARATORS = ("ppo", "sft_met")


#: measure id -> how the tests table and the prose name it.
MEASURES = {
    "reward": "Ave(R)",
    "pairwise_sim": "pairwise similarity",
    "xent_met": "held-out MET cross-entropy (nats per token)",
}


TABLE_COLUMNS = [
    "policy", "label", "n_prompts", "ave_r", "ave_r_low", "ave_r_high", "reward_sd", "reward_sd_low",
    "reward_sd_high", "kl", "xent_met", "xent_met_vs_start", "xent_met_vs_start_low",
    "xent_met_vs_start_high", "n_met_rows", "area_entropy", "area_kl_to_history", "distinct_2",
    "pairwise_sim", "pairwise_sim_low", "pairwise_sim_high", "n_prompts_sim",
]  # fmt: skip


TEST_COLUMNS = ["measure", "policy", "versus", "n", "n_clusters", "diff", "low", "high", "verdict",
                "ci_level"]  # fmt: skip


Encoder = Callable[[Sequence[str]], np.ndarray]


def inclusive_policies(present: Sequence[str], algos: Sequence[str], start: str) -> list[str]:
    """The table's rows: the start policy, `sft_met`, every RL algorithm in the run's order, the
    two history references; absent ones left out."""
    have = set(present)
    return [p for p in dict.fromkeys((start, "sft_met", *algos, *HISTORY)) if p in have]


def xent_met(ppl_rows: pd.DataFrame) -> pd.Series:
    """Cross-entropy per token of held-out MET descriptions under each policy: the summed NLL
    over the MET rows (`y == 1`) divided by their summed tokens (`evaluation.tables.heldout_perplexity`'s
    per-row output). The paper's KL from the population to the model, up to the population's
    entropy, which is the same for every policy."""
    met = ppl_rows[ppl_rows["y"] == 1]
    g = met.groupby("policy", sort=False)[["nll", "n_tokens"]].sum()
    return (g["nll"] / g["n_tokens"]).astype(float)


def xent_difference(ppl_rows: pd.DataFrame, a: str, b: str, n_boot: int, alpha: float,
                    seed: int) -> dict[str, float]:  # fmt: skip
    """`xent_met` of policy a minus that of b on the held-out MET rows both scored, paired by row,
    with the study's cluster t interval over countries (`stats.cluster_t`) on the difference's
    delta-method linearisation: row i carries d + (nll_a - R_a tok_a) / mean tok_a - (nll_b -
    R_b tok_b) / mean tok_b (R: a policy's ratio of sums), whose mean is d. With 17 uneven
    countries it holds 95% (94.8%) and a family's 99.5% (99.3-99.8%) where the percentile cluster
    bootstrap of the ratio used before covered 89.7% and 97.0-97.7% (tests/test_levels.py).
    `n_boot` and `seed` are kept for callers. Keys: diff, low, high, n (rows), n_clusters."""
    met = ppl_rows[ppl_rows["y"] == 1]
    cols = ["row", "country", "nll", "n_tokens"]
    pair = met.loc[met["policy"] == a, cols].merge(
        met.loc[met["policy"] == b, ["row", "nll", "n_tokens"]], on="row", suffixes=("_a", "_b")
    )
    if pair.empty:
        return {"diff": math.nan, "low": math.nan, "high": math.nan, "n": 0, "n_clusters": 0}
    nll_a, tok_a = pair["nll_a"].to_numpy(float), pair["n_tokens_a"].to_numpy(float)
    nll_b, tok_b = pair["nll_b"].to_numpy(float), pair["n_tokens_b"].to_numpy(float)
    r_a, r_b = nll_a.sum() / tok_a.sum(), nll_b.sum() / tok_b.sum()
    lin = (r_a - r_b) + (nll_a - r_a * tok_a) / tok_a.mean() - (nll_b - r_b * tok_b) / tok_b.mean()
    country = pair["country"].astype(str).to_numpy()
    res = cluster_t(lin, country, alpha)
    return {"diff": float(r_a - r_b), "low": res["low"], "high": res["high"], "n": len(pair),
            "n_clusters": int(pd.Series(country).nunique())}  # fmt: skip


def pairwise_similarity(samples: pd.DataFrame, policies: Sequence[str], encoder: Encoder) -> pd.DataFrame:  # fmt: skip
    """Per policy and prompt: the mean cosine similarity over the pairs of that prompt's samples
    (prompts with at least two), from the sentence embeddings of `encoder` (texts -> one row per
    text; rows are L2-normalised here too). 1 when every sample of the prompt is the same text.
    Columns: policy, prompt_id, country, pairwise_sim, n_samples. Each distinct text is embedded
    once."""
    sel = samples[samples["policy"].isin(policies)]
    texts = sel["response"].astype(str)
    unique = list(dict.fromkeys(texts))
    cols = ["policy", "prompt_id", "country", "pairwise_sim", "n_samples"]
    if not unique:
        return pd.DataFrame(columns=cols)
    emb = np.asarray(encoder(unique), dtype=np.float64)
    if emb.ndim != 2 or emb.shape[0] != len(unique):
        raise ValueError(
            f"the encoder must return one embedding row per text; got shape {emb.shape} for "
            f"{len(unique)} texts"
        )
    norms = np.linalg.norm(emb, axis=1, keepdims=True)
    emb = emb / np.where(norms > 0, norms, 1.0)
    where = {t: i for i, t in enumerate(unique)}
    pos = texts.map(where).to_numpy()
    rows = []
    for (pol, pid), g in sel.assign(_pos=pos).groupby(["policy", "prompt_id"], sort=False):
        if len(g) < 2:
            continue
        e = emb[g["_pos"].to_numpy()]
        s = e @ e.T
        iu = np.triu_indices(len(g), k=1)
        rows.append({"policy": pol, "prompt_id": pid, "country": str(g["country"].iloc[0]),
                     "pairwise_sim": float(s[iu].mean()), "n_samples": len(g)})  # fmt: skip
    return pd.DataFrame(rows, columns=cols)


def _half_smoothed(labels: pd.Series, cats: Sequence[str]) -> np.ndarray:
    """Counts over `cats` plus half a count each (Jeffreys), as `risk.diversity` smooths areas."""
    c = Counter(labels.astype(str))
    return np.array([c.get(a, 0) for a in cats], dtype=float) + 0.5


def area_measures(samples: pd.DataFrame, policies: Sequence[str]) -> pd.DataFrame:
    """Per policy: `area_entropy`, the entropy (nats) of the economic areas its responses fall
    into (`top_area`), and `area_kl_to_history`, KL(history || policy) in nats, where history is
    the real MET and Non-MET descriptions of the same prompts pooled. KL runs from the history to
    the policy, as the paper's KL from the population to the model: an area the history holds and
    the policy never writes costs the most. Counts are smoothed by half a response per area
    (over every area any of `policies` or the history shows), so a missing area costs a finite
    amount. Entropy grows with the number of responses: history rows are fewer where a context
    has fewer than k real descriptions."""
    hist = samples[samples["policy"].isin(HISTORY)]
    sel = samples[samples["policy"].isin(policies)]
    cats = sorted(
        set(sel["top_area"].dropna().astype(str)) | set(hist["top_area"].dropna().astype(str))
    )
    rows = []
    for pol in policies:
        g = sel.loc[sel["policy"] == pol].dropna(subset=["top_area"])
        if g.empty:
            continue
        ref = hist.loc[hist["prompt_id"].isin(set(g["prompt_id"])), "top_area"].dropna()
        kl = (
            kl_divergence(_half_smoothed(ref, cats), _half_smoothed(g["top_area"], cats), eps=0.0)
            if len(ref)
            else math.nan
        )  # fmt: skip
        h = entropy(area_distribution(g["top_area"].astype(str))) + 0.0  # -0.0: one area
        rows.append({"policy": pol, "area_entropy": h, "area_kl_to_history": kl})
    return pd.DataFrame(rows, columns=["policy", "area_entropy", "area_kl_to_history"])


def inclusive_table(samples: pd.DataFrame, summary: pd.DataFrame, ppl_rows: pd.DataFrame | None,
                    sims: pd.DataFrame, algos: Sequence[str], start: str, n_boot: int, alpha: float,
                    seed: int) -> pd.DataFrame:  # fmt: skip
    """One row per policy (`inclusive_policies` order): Ave(R) with its CI, the reward heads' SD
    (NaN where the summary has none) and KL to the start policy, copied from the summary;
    `xent_met` and its paired difference from the start policy with a cluster t CI
    (`xent_difference`; NaN for the history references, which have no density); `area_entropy`,
    `area_kl_to_history` (`area_measures`), `distinct_2` (summary) and `pairwise_sim` with a
    cluster-bootstrap CI over countries of its per-prompt values (`sims`, from
    `pairwise_similarity`; `n_prompts_sim` prompts with two samples or more)."""
    s = summary.set_index("policy")
    order = inclusive_policies([p for p in s.index if p in set(samples["policy"])], algos, start)
    xe = xent_met(ppl_rows) if ppl_rows is not None and len(ppl_rows) else pd.Series(dtype=float)
    n_met = (
        ppl_rows[ppl_rows["y"] == 1].groupby("policy").size()
        if ppl_rows is not None and len(ppl_rows)
        else pd.Series(dtype=int)
    )
    areas = area_measures(samples, order).set_index("policy")
    rows = []
    for p in order:
        r = s.loc[p]
        rec: dict[str, Any] = {"policy": p, "label": algorithm_label(p)}
        for c in ("n_prompts", "ave_r", "ave_r_low", "ave_r_high", "reward_sd", "reward_sd_low",
                  "reward_sd_high", "kl", "distinct_2"):  # fmt: skip
            rec[c] = r.get(c, math.nan)
        rec["xent_met"] = float(xe.get(p, math.nan))
        rec["n_met_rows"] = int(n_met.get(p, 0))
        if p == start and is_present(rec["xent_met"]):
            rec.update(xent_met_vs_start=0.0)
        elif p in xe.index and start in xe.index:
            d = xent_difference(ppl_rows, p, start, n_boot, alpha, seed)
            rec.update(xent_met_vs_start=d["diff"], xent_met_vs_start_low=d["low"],
                       xent_met_vs_start_high=d["high"])  # fmt: skip
        v = sims[sims["policy"] == p]
        if len(v):
            mid, lo, hi = bootstrap_ci(v["pairwise_sim"].to_numpy(), n_boot, alpha, seed,
                                          clusters=v["country"].to_numpy())  # fmt: skip
            rec.update(pairwise_sim=mid, pairwise_sim_low=lo, pairwise_sim_high=hi)
        rec["n_prompts_sim"] = len(v)
        if p in areas.index:
            rec.update(areas.loc[p].to_dict())
        rows.append(rec)
    return pd.DataFrame(rows).reindex(columns=TABLE_COLUMNS)


def comparator_pairs(samples: pd.DataFrame, algos: Sequence[str]) -> list[tuple[str, str, str]]:
    """(question, policy, versus): each ILHF algorithm that ran against each of `COMPARATORS`
    evaluated, the method comparisons of `inclusive_tests` (against the start policy it is a
    gain, made whatever the KL)."""
    present = set(samples["policy"])
    return [("ilhf_vs_comparator", a, v) for a in algos if a in ILHF_ALGORITHMS and a in present
            for v in COMPARATORS if v in present and v != a]  # fmt: skip


def _pairs(present: set[str], algos: Sequence[str], start: str,
           kl: Mapping[str, float] | None = None,
           kl_ratio: float | None = None) -> list[tuple[str, str, str]]:  # fmt: skip
    """(measure, policy, versus) of `inclusive_tests`: against a comparator only at comparable
    KL (`questions.kl_matched`, when `kl` is given)."""
    ilhf = [a for a in algos if a in ILHF_ALGORITHMS and a in present]
    versus = [v for v in dict.fromkeys((*COMPARATORS, start)) if v in present]
    kl = dict(kl or {})

    def compared(a: str, v: str) -> bool:
        return (
            v == start or not kl or kl_matched(kl.get(a, math.nan), kl.get(v, math.nan), kl_ratio)
        )

    out = [(m, a, v) for a in ilhf for v in versus if v != a and compared(a, v) for m in MEASURES]
    if "ppo" in present and start in present and start != "ppo":
        out.append(("pairwise_sim", "ppo", start))  # does PPO collapse the variety?
    return out


def inclusive_tests(samples: pd.DataFrame, ppl_rows: pd.DataFrame | None, sims: pd.DataFrame,
                    algos: Sequence[str], start: str, n_boot: int, alpha: float,
                    seed: int, kl: Mapping[str, float] | None = None,
                    kl_ratio: float | None = None) -> pd.DataFrame:  # fmt: skip
    """Each ILHF algorithm that ran against each of `ppo`, `sft_met` and the start policy that
    the run evaluated, and PPO against the start policy on pairwise similarity: the mean
    difference (policy minus versus) with a paired cluster t CI over countries at the family's
    level (`ci_level`) and the `verdict` it supports. `reward`: per-prompt mean rewards;
    `pairwise_sim`: per-prompt similarities (`pairwise_similarity`); both on the prompts both
    policies answered (`stats.paired.paired_comparison`). `xent_met`: per held-out MET row, on
    the difference's delta-method linearisation (`xent_difference`). With `kl` (each policy's KL
    to the start policy) an ILHF algorithm meets a comparator only at comparable KL
    (`questions.kl_matched` at `kl_ratio`; the pairs left out: `comparator_pairs`)."""
    pairs = _pairs(set(samples["policy"]), algos, start, kl, kl_ratio)
    if not pairs:
        return pd.DataFrame(columns=TEST_COLUMNS)
    pols = sorted({p for _, a, b in pairs for p in (a, b)})
    m = len(pairs)  # one family (`stats.family_alpha`): each interval at level 1 - alpha / m
    a_family = family_alpha(alpha, m)
    reward = per_prompt_means(samples[samples["policy"].isin(pols)], "reward")
    sim = sims.pivot_table(index="prompt_id", columns="policy", values="pairwise_sim")
    country = prompt_clusters(samples, cluster_col="country").astype(str)
    rows = []
    for measure, a, b in pairs:
        if measure == "xent_met":
            if ppl_rows is None or not {a, b} <= set(ppl_rows["policy"]):
                continue
            d = xent_difference(ppl_rows, a, b, n_boot, a_family, seed)  # the family's cluster t
        else:
            wide = reward if measure == "reward" else sim
            if a not in wide or b not in wide:
                continue
            pair = wide[[a, b]].dropna()
            res = paired_comparison(pair[a].to_numpy(), pair[b].to_numpy(), n_boot, seed, alpha,
                                    clusters=country.loc[pair.index].to_numpy(), family_size=m)  # fmt: skip
            d = {"diff": res["mean_diff"], "low": res["ci_low"], "high": res["ci_high"],
                 "n": res["n"], "n_clusters": res.get("n_clusters", res["n"])}  # fmt: skip
        rows.append({"measure": measure, "policy": a, "versus": b, **d,
                     "verdict": bound_verdict(d["low"], d["high"]), "ci_level": 1 - a_family})  # fmt: skip
    return pd.DataFrame(rows, columns=TEST_COLUMNS)


def ilhf_tables(samples: pd.DataFrame, summary: pd.DataFrame, ppl_rows: pd.DataFrame | None,
                algos: Sequence[str], start: str, n_boot: int, alpha: float, seed: int,
                encoder: Encoder, kl_ratio: float | None = None) -> dict[str, pd.DataFrame]:  # fmt: skip
    """The evaluation stage's ILHF tables: `eval_inclusive` (`inclusive_table`) and
    `eval_inclusive_tests` (`inclusive_tests`). `encoder` embeds the responses for the pairwise
    similarity (`evaluation.grounding.minilm_encoder`, the one the grounding index uses)."""
    order = inclusive_policies(list(dict.fromkeys(samples["policy"])), algos, start)
    sims = pairwise_similarity(samples, order, encoder)
    return {
        "eval_inclusive": inclusive_table(samples, summary, ppl_rows, sims, algos, start, n_boot,
                                          alpha, seed),
        "eval_inclusive_tests": inclusive_tests(
            samples, ppl_rows, sims, algos, start, n_boot, alpha, seed,
            policy_kls(summary) if kl_ratio else None,
            kl_ratio,
        ),
    }  # fmt: skip


def plot_inclusive(table: pd.DataFrame, start: str, alpha: float = 0.05) -> Any:
    """Ave(R) against the mean pairwise similarity of one prompt's samples (left: lower is more
    varied) and against the held-out MET cross-entropy relative to the start policy (right: left
    of zero is closer to the population), one point per policy, bars its CIs; the history
    references are points on the left and dashed lines on the right (they have no density)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), sharey=True)
    t = table.reset_index(drop=True)
    panels = (("pairwise_sim", "mean pairwise similarity of one prompt's samples\n(MiniLM cosine; lower: more varied)"),
              ("xent_met_vs_start", f"held-out MET cross-entropy minus {start}'s\n(nats per token; lower: closer to the population)"))  # fmt: skip
    for ax, (col, xlabel) in zip(axes, panels, strict=True):
        for i, r in t.iterrows():
            one = t.iloc[[i]]
            hist = r["policy"] in HISTORY
            if is_present(r[col]) and is_present(r["ave_r"]):
                ax.errorbar(one[col], one["ave_r"], xerr=ci_err(one, col, f"{col}_low", f"{col}_high", fill_missing=True),
                            yerr=ci_err(one, "ave_r", "ave_r_low", "ave_r_high", fill_missing=True),
                            fmt="*" if hist else ("s" if r["policy"] == start else "o"),
                            color=f"C{i % 10}", capsize=3, ms=9 if hist else 7, label=r["label"])  # fmt: skip
            elif hist and is_present(r["ave_r"]) and col == "xent_met_vs_start":
                ax.axhline(r["ave_r"], ls="--", lw=1, color=f"C{i % 10}",
                           label=f"{r['label']} (no density)")  # fmt: skip
        ax.set(xlabel=xlabel)
        ax.grid(alpha=0.3)
    axes[1].axvline(0, color="black", lw=0.8)
    axes[0].set_ylabel("Ave(R) on held-out prompts")
    if t["xent_met_vs_start"].isna().all():
        axes[1].text(0.5, 0.5, "no held-out cross-entropy measured", ha="center",
                     transform=axes[1].transAxes)  # fmt: skip
    fig.suptitle(f"Variety and closeness to the population, at what reward (bars: {level(alpha)} "
                 "CIs over countries: cluster bootstrap; the cross-entropy difference: cluster t)",
                 fontsize=10)  # fmt: skip
    handles: dict[str, Any] = {}
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(lab, h)
    if handles:
        fig.legend(list(handles.values()), list(handles), loc="lower center",
                   ncol=min(len(handles), 4), fontsize=8, bbox_to_anchor=(0.5, -0.12))  # fmt: skip
    fig.tight_layout()
    return fig


def ilhf_figures(tables: Mapping[str, pd.DataFrame], start: str, alpha: float) -> dict[str, Any]:
    """Figure `eval_inclusive` from `ilhf_tables`' output."""
    return {"eval_inclusive": plot_inclusive(tables["eval_inclusive"], start, alpha)}
