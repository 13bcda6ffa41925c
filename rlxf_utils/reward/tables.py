"""Notebook 02's tables: accuracy against the paper, confusion, confident errors, per-area
accuracy, the encoders compared, within-context ranking and the reference check."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
from sklearn import metrics as skm

from rlxf_utils.prompts import (
    CONTEXT_FIELDS,
    serialize_frame,
)
from rlxf_utils.reward.statistics import protocol_differences

if TYPE_CHECKING:  # heavy imports stay lazy so that `import rlxf_utils.reward` is cheap
    pass
from rlxf_utils.reward.encoders import encoder_label
from rlxf_utils.reward.model import PAPER_ACCURACY, RewardModel
from rlxf_utils.reward.protocol import ProtocolResult, take_rows
from rlxf_utils.reward.tfidf import TfidfAuditModel
from rlxf_utils.stats import cluster_bootstrap


def accuracy_table(results: Sequence[ProtocolResult]) -> pd.DataFrame:
    """Paper's claim | majority | TF-IDF LR | encoder | compared encoders: test accuracy per protocol.

    One row per protocol; a compared encoder not trained on a protocol is NaN there.
    """
    compared = list(dict.fromkeys(n for r in results for n in r.compared))
    rows = []
    for r in results:
        acc = r.metrics.set_index("model")["accuracy"]
        rows.append(
            {
                "protocol": r.protocol,
                "paper_claim": PAPER_ACCURACY,
                "majority": acc.get("majority", float("nan")),
                "tfidf_lr": acc.get("tfidf", float("nan")),
                "encoder": acc.get("encoder", float("nan")),
                **{n: acc.get(n, float("nan")) for n in compared},
            }
        )
    return pd.DataFrame(rows)


def confusion_frame(y: np.ndarray, p: np.ndarray, threshold: float = 0.5) -> pd.DataFrame:
    """2x2 confusion matrix (rows: true Non-MET/MET, columns: predicted) as a labelled table."""
    cm = skm.confusion_matrix(
        np.asarray(y, dtype=int), (np.asarray(p) >= threshold).astype(int), labels=[0, 1]
    )
    return pd.DataFrame(
        cm, index=["true Non-MET", "true MET"], columns=["pred Non-MET", "pred MET"]
    )


def most_confident_errors(pred: pd.DataFrame, model: str = "encoder", k: int = 10) -> pd.DataFrame:
    """The k test conditions the model got wrong with the most confidence (|P(MET) - 0.5| largest)."""
    p = pred[f"p_{model}"]
    wrong = pred[(p >= 0.5).astype(int) != pred["y"]].copy()
    wrong["confidence"] = (wrong[f"p_{model}"] - 0.5).abs() + 0.5
    cols = ["row_id", *CONTEXT_FIELDS, "description", "y", f"p_{model}", "confidence"]
    return wrong.sort_values("confidence", ascending=False)[cols].head(k).reset_index(drop=True)


def per_area_accuracy(
    pred: pd.DataFrame, models: Sequence[str] = ("encoder", "tfidf"), min_n: int = 10
) -> pd.DataFrame:
    """Test accuracy by economic area (areas with at least `min_n` test conditions) next to the MET share."""
    rows = []
    for area, g in pred.groupby("econ_descriptor", sort=True):
        if len(g) < min_n:
            continue
        row: dict[str, Any] = {"econ_descriptor": area, "n": len(g), "met_share": g["y"].mean()}
        for m in models:
            if f"p_{m}" in g:
                row[f"acc_{m}"] = ((g[f"p_{m}"] >= 0.5).astype(int) == g["y"]).mean()
        rows.append(row)
    return (
        pd.DataFrame(rows).sort_values("n", ascending=False).reset_index(drop=True)
        if rows
        else pd.DataFrame()
    )


def encoder_table(results: Sequence[ProtocolResult], encoders: Mapping[str, str]) -> pd.DataFrame:
    """TF-IDF and every encoder side by side, per protocol: size, time, accuracy and AUC with CIs.

    `encoders` maps model names ('encoder' and the compared ones) to their settings.
    Columns: protocol, model, label, parameters (millions; NaN for TF-IDF), train_s, epochs_run,
    score_texts_per_s, accuracy/roc_auc/auc_within_context with `_low`/`_high`, ece.
    """
    rows = []
    for r in results:
        m = r.metrics.set_index("model")
        models = {"tfidf": r.audit, "encoder": r.encoder, **r.compared}
        for name, model in models.items():
            if model is None or name not in m.index:
                continue
            rec: dict[str, Any] = {
                "protocol": r.protocol,
                "model": name,
                "label": "TF-IDF + LR"
                if name == "tfidf"
                else encoder_label(encoders.get(name, name)),
                "parameters_m": (
                    sum(p.numel() for p in model.model.parameters()) / 1e6
                    if isinstance(model, RewardModel)
                    else float("nan")
                ),
                "train_s": r.timing.get(f"{name}_train_s", float("nan")),
                "epochs_run": r.timing.get(f"{name}_epochs_run", float("nan")),
                "score_texts_per_s": r.timing.get(f"{name}_score_texts_per_s", float("nan")),
            }
            for k in ("accuracy", "roc_auc", "auc_within_context"):
                rec.update({k: m.loc[name, k], f"{k}_low": m.loc[name, f"{k}_low"],
                            f"{k}_high": m.loc[name, f"{k}_high"]})  # fmt: skip
            rec["ece"] = m.loc[name, "ece"]
            rows.append(rec)
    return pd.DataFrame(rows)


def reference_check_table(
    labelled: pd.DataFrame,
    holdout: Mapping[str, Any],
    chosen: ProtocolResult,
    audit: TfidfAuditModel,
    n_boot: int,
    alpha: float,
    seed: int,
) -> pd.DataFrame:
    """AUC of the reward model, the protocol's TF-IDF and the disjoint audit on the reference rows.

    The reference rows (evaluation countries) are in the reward protocol's test split and outside
    the audit's rows, so this is every scorer on data none of them trained on; the CI resamples
    arrangements (a condition repeats across one arrangement's reviews).
    """
    from sklearn.metrics import roc_auc_score

    pred = chosen.predictions.set_index("row_id")
    ref = [i for i in holdout["reference"] if i in pred.index]
    if len(ref) != len(holdout["reference"]):
        raise ValueError(
            "data/holdout.json reference rows are not all in the reward protocol's test split; "
            "rerun notebook 01 so the splits are nested"
        )
    rows = take_rows(labelled, ref, "holdout.reference")
    y = rows["y"].astype(int).to_numpy()
    scores = {
        f"{m} (protocol train rows)": pred.loc[ref, f"p_{m}"].to_numpy()
        for m in ("encoder", *chosen.compared, "tfidf")
        if f"p_{m}" in pred.columns
    }
    scores["audit (disjoint rows)"] = audit.score_texts(serialize_frame(rows))
    arr = rows["arrangement_id"].astype(str).to_numpy()
    out = []
    for name, p in scores.items():

        def auc(idx: np.ndarray, p: np.ndarray = p) -> float:
            return float(roc_auc_score(y[idx], p[idx])) if len(np.unique(y[idx])) == 2 else math.nan

        a, lo, hi = cluster_bootstrap(auc, arr, n_boot, alpha, seed)
        out.append({"model": name, "rows": len(y), "met_share": float(y.mean()),
                    "mean_p": float(np.mean(p)), "auc": a, "auc_low": lo, "auc_high": hi})  # fmt: skip
    return pd.DataFrame(out)


def within_context_table(results: Sequence[ProtocolResult]) -> pd.DataFrame:
    """Overall AUC next to pair-weighted AUC within country / economic area / full context, with CIs."""
    cols = ["protocol", "model", "roc_auc", "roc_auc_low", "roc_auc_high"]
    for stem in ("country", "area", "context"):
        cols += [
            f"auc_within_{stem}",
            f"auc_within_{stem}_low",
            f"auc_within_{stem}_high",
            f"n_{stem}_groups",
            f"n_{stem}_pairs",
        ]
    return pd.concat([r.metrics[cols] for r in results], ignore_index=True)


def comparison_tables(
    results: Sequence[ProtocolResult], alpha: float
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(paired comparisons within each protocol, accuracy of each protocol against the first)."""
    within = pd.concat([r.comparisons for r in results], ignore_index=True)
    reps = {r.protocol: r.extra.get("accuracy_replicates", {}) for r in results}
    points = {r.protocol: r.metrics.set_index("model")["accuracy"].to_dict() for r in results}
    return within, protocol_differences(reps, points, alpha)
