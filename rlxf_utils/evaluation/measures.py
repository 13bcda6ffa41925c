"""What a set of responses is like, without a model: length, distinct n-grams, repetition, and the
distribution of economic areas (entropy, KL between distributions)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Iterable, Mapping, Sequence

import numpy as np
import pandas as pd


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
