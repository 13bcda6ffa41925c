"""Bootstrap by weights: Poisson/multinomial replicate weights over rows or clusters and the
weighted classification metrics (rates, AUC, ECE, within-group AUC) evaluated under them."""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import numpy as np
import pandas as pd
from scipy import sparse, stats

from rlxf_utils.stats.intervals import percentile_ci


def bootstrap_weights(
    n_rows: int, n_boot: int, seed: int, clusters: Sequence[Hashable] | None = None
) -> np.ndarray:
    """(n_boot, n_rows) resampling counts: rows drawn with replacement, or whole clusters."""
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1; got {n_boot}")
    rng = np.random.default_rng(seed)
    if clusters is None:
        codes, n_units = np.arange(n_rows), n_rows
    else:
        if len(clusters) != n_rows:
            raise ValueError(f"got {len(clusters)} cluster labels for {n_rows} rows")
        codes, uniques = pd.factorize(pd.Series(list(clusters)), sort=True)
        n_units = len(uniques)
    if n_rows == 0 or n_units == 0:
        return np.zeros((n_boot, n_rows))
    draws = rng.integers(0, n_units, size=(n_boot, n_units))
    offsets = (np.arange(n_boot) * n_units)[:, None]
    counts = np.bincount((draws + offsets).ravel(), minlength=n_boot * n_units)
    return counts.reshape(n_boot, n_units)[:, codes].astype(float)


def weighted_ece(w: np.ndarray, y: np.ndarray, p: np.ndarray, n_bins: int = 10) -> np.ndarray:
    """ECE (equal-width bins) under each row of weights: sum_b |sum_{i in b} w_i (p_i - y_i)| / sum w."""
    y = np.asarray(y, dtype=float)
    p = np.asarray(p, dtype=float)
    bins = np.minimum((p * n_bins).astype(int), n_bins - 1)
    onehot = sparse.csr_matrix(
        (p - y, (np.arange(len(p)), bins)), shape=(len(p), n_bins)
    )  # row i holds p_i - y_i in its bin's column
    gaps = np.asarray((onehot.T @ w.T).T)
    total = w.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.abs(gaps).sum(axis=1) / total


def weighted_rates(
    w: np.ndarray, y: np.ndarray, p: np.ndarray, threshold: float = 0.5
) -> dict[str, np.ndarray]:
    """Accuracy, precision, recall and F1 (MET class) under each row of weights."""
    y = np.asarray(y, dtype=int)
    pred = (np.asarray(p, dtype=float) >= threshold).astype(int)
    tp = w @ ((pred == 1) & (y == 1)).astype(float)
    fp = w @ ((pred == 1) & (y == 0)).astype(float)
    fn = w @ ((pred == 0) & (y == 1)).astype(float)
    correct = w @ (pred == y).astype(float)
    with np.errstate(invalid="ignore", divide="ignore"):
        precision = np.where(tp + fp > 0, tp / (tp + fp), 0.0)
        recall = np.where(tp + fn > 0, tp / (tp + fn), 0.0)
        f1 = np.where(precision + recall > 0, 2 * precision * recall / (precision + recall), 0.0)
        accuracy = correct / w.sum(axis=1)
    return {"accuracy": accuracy, "precision": precision, "recall": recall, "f1": f1}


def weighted_auc(w: np.ndarray, y: np.ndarray, p: np.ndarray) -> np.ndarray:
    """ROC-AUC under each row of weights (ties count one half), NaN where a class has no weight."""
    y = np.asarray(y, dtype=int)
    levels, rank = np.unique(np.asarray(p, dtype=float), return_inverse=True)
    onehot = sparse.csr_matrix(
        (np.ones(len(y)), (np.arange(len(y)), rank)), shape=(len(y), len(levels))
    )
    w_neg = w * (y == 0)
    w_pos = w * (y == 1)
    neg_at = np.asarray((onehot.T @ w_neg.T).T)  # (n_boot, levels): Non-MET weight per score
    below = np.cumsum(neg_at, axis=1) - neg_at  # negative weight strictly below each level
    credit = (below + 0.5 * neg_at)[:, rank]  # (n_boot, n_rows)
    concordant = (w_pos * credit).sum(axis=1)
    pairs = w_pos.sum(axis=1) * w_neg.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(pairs > 0, concordant / pairs, np.nan)


def within_group_auc(
    y: Sequence[int] | np.ndarray,
    p: Sequence[float] | np.ndarray,
    groups: Sequence[Hashable],
    n_boot: int = 2000,
    alpha: float = 0.05,
    seed: int = 0,
) -> dict[str, float]:
    """Pair-weighted AUC within groups, with a percentile CI that resamples groups.

    Only pairs of one MET and one Non-MET condition *in the same group* count, so a score that
    only knows each group's base rate gets 0.5. Returns auc, low, high, n_groups (groups holding
    both labels) and n_pairs.
    """
    frame = pd.DataFrame(
        {"y": np.asarray(y, dtype=int), "p": np.asarray(p, dtype=float), "g": list(groups)}
    )
    conc, pairs = [], []
    for _, g in frame.groupby("g", sort=True):
        n_pos = int(g["y"].sum())
        n_neg = len(g) - n_pos
        if n_pos == 0 or n_neg == 0:
            continue
        ranks = stats.rankdata(g["p"].to_numpy())  # average ranks: ties count one half
        conc.append(ranks[g["y"].to_numpy() == 1].sum() - n_pos * (n_pos + 1) / 2)
        pairs.append(n_pos * n_neg)
    out = {"auc": math.nan, "low": math.nan, "high": math.nan, "n_groups": len(conc), "n_pairs": 0}
    if not conc:
        return out
    u, n = np.asarray(conc, dtype=float), np.asarray(pairs, dtype=float)
    out["auc"] = float(u.sum() / n.sum())
    out["n_pairs"] = int(n.sum())
    if len(conc) >= 2:
        c = bootstrap_weights(len(conc), n_boot, seed)
        out["low"], out["high"] = percentile_ci((c @ u) / (c @ n), alpha)
    return out
