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

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from rlxf_utils.stats import (
    basic_ci,
    bootstrap_weights,
    bound_verdict,
    check_alpha,
    percentile_ci,
    weighted_auc,
    weighted_ece,
    weighted_rates,
    within_group_auc,
)

#: Metrics of `reward.calibration.classification_metrics` that get a bootstrap interval.
CI_METRICS = ("accuracy", "precision", "recall", "f1", "roc_auc", "ece")


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
    `reward.protocol.run_protocol` writes them. Returns (per-model table: `<metric>_low/_high` for
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
                "verdict": bound_verdict(low, high),
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
                    "verdict": bound_verdict(low, high),
                }
            )
    return pd.DataFrame(rows)
