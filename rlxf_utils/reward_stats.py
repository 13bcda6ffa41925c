"""Uncertainty for the reward model's test metrics: bootstrap CIs, paired differences, verdicts.

Every verdict the notebooks and the report write about the reward model ("more accurate than",
"lowered the ECE", "falls under the grouped protocol") is read from a percentile-bootstrap
interval at level 1 - alpha: a difference is called only when its interval excludes zero.

- Test rows are resampled by *arrangement* (cluster bootstrap) when the predictions carry
  `arrangement_id`: conditions of one programme are repeated and correlated, so resampling rows
  would understate the uncertainty. One set of draws is shared by every model of a protocol, so
  model-vs-model differences are paired.
- ECE intervals are *basic* bootstrap intervals (`basic_ci`): a resampled ECE is biased upward,
  which the percentile interval would carry into the verdict.
- Within-context AUC is pair-weighted: sum over contexts of concordant (MET, Non-MET) pairs over
  the sum of pairs, i.e. each context's AUC weighted by its number of pairs; its CI resamples
  contexts.

All statistics are computed on bootstrap *weight matrices* (n_boot x n_rows counts), so one
replicate costs a matrix product, not a Python loop.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
from scipy import sparse, stats

from .evaluation import check_alpha, ci_verdict, level

__all__ = [
    "CI_METRICS",
    "bootstrap_weights",
    "ci_verdict",
    "level",
    "basic_ci",
    "percentile_ci",
    "protocol_differences",
    "protocol_statistics",
    "weighted_auc",
    "weighted_ece",
    "weighted_rates",
    "within_group_auc",
]

#: Metrics of `reward.classification_metrics` that get a bootstrap interval.
CI_METRICS = ("accuracy", "precision", "recall", "f1", "roc_auc", "ece")


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


def basic_ci(point: float, replicates: np.ndarray, alpha: float) -> tuple[float, float]:
    """Basic (reverse-percentile) interval 2 * point - quantiles: reflects a resampling bias back.

    Used for ECE: |sum of residuals| per bin grows with noise, so a resampled ECE sits above
    the estimate on average and a percentile interval of ECE (or of a difference of ECEs) is
    shifted by that bias; the basic interval is not.
    """
    low, high = percentile_ci(replicates, alpha)
    return 2 * point - high, 2 * point - low


def percentile_ci(replicates: np.ndarray, alpha: float) -> tuple[float, float]:
    """Percentile interval of bootstrap replicates (NaN replicates dropped; NaN when none left)."""
    check_alpha(alpha)
    r = np.asarray(replicates, dtype=float)
    r = r[~np.isnan(r)]
    if r.size < 2:
        return (math.nan, math.nan)
    low, high = np.quantile(r, [alpha / 2, 1 - alpha / 2])
    return float(low), float(high)


# ---------------------------------------------------------------------------------------------
# weighted statistics: one value per row of a weight matrix
# ---------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------
# within-context AUC
# ---------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------
# one protocol's predictions -> metrics with CIs and paired comparisons
# ---------------------------------------------------------------------------------------------
#: Paired comparisons on one protocol's test rows: (name, model a, model b, measure).
COMPARISONS = (
    ("encoder vs TF-IDF", "encoder", "tfidf", "accuracy"),
    ("encoder vs TF-IDF", "encoder", "tfidf", "roc_auc"),
    ("text only vs context only", "text_only", "context_only", "roc_auc"),
    ("encoder calibrated vs raw", "encoder", "encoder_raw", "ece"),
    ("TF-IDF calibrated vs raw", "tfidf", "tfidf_raw", "ece"),
)

#: Groupings of within-context AUC: metrics column stem -> the columns that define a group.
WITHIN = {
    "country": ("country",),
    "area": ("econ_descriptor",),
    "context": ("country", "arrangement_type", "econ_descriptor"),
}


def _replicates(
    w: np.ndarray, y: np.ndarray, p: np.ndarray, measure: str, n_bins: int
) -> np.ndarray:
    if measure == "ece":
        return weighted_ece(w, y, p, n_bins)
    if measure == "roc_auc":
        return weighted_auc(w, y, p)
    return weighted_rates(w, y, p)[measure]


def protocol_statistics(
    pred: pd.DataFrame,
    models: Sequence[str],
    n_boot: int = 2000,
    alpha: float = 0.05,
    seed: int = 0,
    n_bins: int = 10,
    extra_comparisons: Sequence[tuple[str, str, str, str]] = (),
) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, np.ndarray]]:
    """CIs of each model's test metrics, within-context AUCs and paired comparisons on `pred`.

    `pred` holds `y` and `p_<model>` columns (and `p_<model>_raw` for calibrated models), as
    `reward.run_protocol` writes them. Returns (per-model table: `<metric>_low/_high` for
    `CI_METRICS` and `auc_within_<grouping>` with its interval and group count; comparisons
    table; the accuracy replicates per model, for comparisons across protocols).
    `extra_comparisons` are made after `COMPARISONS`, in the same (name, a, b, measure) form.
    """
    check_alpha(alpha)
    y = pred["y"].astype(int).to_numpy()
    clusters = pred["arrangement_id"].astype(str).tolist() if "arrangement_id" in pred else None
    w = bootstrap_weights(len(pred), n_boot, seed, clusters)
    boot: dict[str, dict[str, np.ndarray]] = {}

    def reps(model: str, measure: str) -> np.ndarray:
        key = boot.setdefault(model, {})
        if measure not in key:
            key[measure] = _replicates(w, y, pred[f"p_{model}"].to_numpy(), measure, n_bins)
        return key[measure]

    def point(model: str, measure: str) -> float:
        one = np.ones((1, len(y)))
        return float(_replicates(one, y, pred[f"p_{model}"].to_numpy(), measure, n_bins)[0])

    rows = []
    for model in models:
        p = pred[f"p_{model}"].to_numpy(dtype=float)
        row: dict[str, Any] = {"model": model}
        for measure in CI_METRICS:
            if measure == "ece":  # never below zero, bias reflected back (see basic_ci)
                low, high = basic_ci(point(model, measure), reps(model, measure), alpha)
                row["ece_low"], row["ece_high"] = max(low, 0.0), high
            else:
                row[f"{measure}_low"], row[f"{measure}_high"] = percentile_ci(
                    reps(model, measure), alpha
                )
        for stem, cols in WITHIN.items():
            missing = [c for c in cols if c not in pred]
            if missing:
                raise KeyError(f"predictions lack {missing} for within-{stem} AUC")
            keys = pred[list(cols)].astype(str).agg(" | ".join, axis=1)
            r = within_group_auc(y, p, keys.tolist(), n_boot, alpha, seed)
            row[f"auc_within_{stem}"] = r["auc"]
            row[f"auc_within_{stem}_low"] = r["low"]
            row[f"auc_within_{stem}_high"] = r["high"]
            row[f"n_{stem}_groups"] = r["n_groups"]
            row[f"n_{stem}_pairs"] = r["n_pairs"]
        rows.append(row)
    table = pd.DataFrame(rows)

    comp = []
    for name, a, b, measure in (*COMPARISONS, *extra_comparisons):
        if f"p_{a}" not in pred or f"p_{b}" not in pred:
            continue
        va, vb = point(a, measure), point(b, measure)
        diff_reps = reps(a, measure) - reps(b, measure)
        if measure == "ece":
            low, high = basic_ci(va - vb, diff_reps, alpha)
        else:
            low, high = percentile_ci(diff_reps, alpha)
        comp.append(
            {
                "comparison": name,
                "measure": measure,
                "a": a,
                "b": b,
                "value_a": va,
                "value_b": vb,
                "diff": va - vb,
                "diff_low": low,
                "diff_high": high,
                "verdict": ci_verdict(low, high),
            }
        )
    accuracy = {m: reps(m, "accuracy") for m in models}
    return table, pd.DataFrame(comp), accuracy


def protocol_differences(
    accuracy: Mapping[str, Mapping[str, np.ndarray]],
    points: Mapping[str, Mapping[str, float]],
    alpha: float = 0.05,
    models: Sequence[str] = ("encoder", "tfidf"),
) -> pd.DataFrame:
    """Accuracy of each model under every protocol against the first (the paper's random split).

    Protocols have different test sets, drawn independently, so the difference's replicates are
    differences of independent replicates (test sets that share rows make this conservative).
    `accuracy[protocol][model]` are replicates, `points[protocol][model]` the test accuracies.
    """
    protocols = list(accuracy)
    rows = []
    if not protocols:
        return pd.DataFrame()
    ref = protocols[0]
    for other in protocols[1:]:
        for m in models:
            if m not in accuracy[ref] or m not in accuracy[other]:
                continue
            low, high = percentile_ci(accuracy[other][m] - accuracy[ref][m], alpha)
            rows.append(
                {
                    "model": m,
                    "reference": ref,
                    "protocol": other,
                    "accuracy_reference": points[ref][m],
                    "accuracy": points[other][m],
                    "diff": points[other][m] - points[ref][m],
                    "diff_low": low,
                    "diff_high": high,
                    "verdict": ci_verdict(low, high),
                }
            )
    return pd.DataFrame(rows)
