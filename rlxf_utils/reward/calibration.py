"""Calibration of a classifier's probabilities: classification metrics, expected calibration
error, reliability curves, and the Platt temperature/offset fitted on a calibration half."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import numpy as np
import pandas as pd
from sklearn import metrics as skm

from rlxf_utils.config import RewardConfig

log = logging.getLogger(__name__)


#: Share of the validation slice held out of checkpoint selection to fit the calibration.
CALIBRATION_SHARE = 0.5


#: Calibration measures reported before and after Platt scaling.
CAL_KEYS = ("ece_before", "ece_after", "brier_before", "brier_after", "nll_before", "nll_after")


def sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.clip(z, -50, 50)))


def expected_calibration_error(y: np.ndarray, p: np.ndarray, n_bins: int = 10) -> float:
    """ECE with equal-width bins on P(MET): sum over bins of |mean p - share MET| weighted by count."""
    y = np.asarray(y, dtype=float)
    p = np.asarray(p, dtype=float)
    if len(y) == 0:
        return float("nan")
    bins = np.minimum((p * n_bins).astype(int), n_bins - 1)
    ece = 0.0
    for b in range(n_bins):
        m = bins == b
        if m.any():
            ece += m.mean() * abs(p[m].mean() - y[m].mean())
    return float(ece)


def reliability_curve(y: np.ndarray, p: np.ndarray, n_bins: int = 10) -> pd.DataFrame:
    """Per-bin mean predicted P(MET), observed MET share and count (for reliability diagrams)."""
    y = np.asarray(y, dtype=float)
    p = np.asarray(p, dtype=float)
    bins = np.minimum((p * n_bins).astype(int), n_bins - 1)
    rows = [
        {
            "bin": b,
            "mean_p": p[bins == b].mean(),
            "share_met": y[bins == b].mean(),
            "n": int((bins == b).sum()),
        }
        for b in range(n_bins)
        if (bins == b).any()
    ]
    return pd.DataFrame(rows, columns=["bin", "mean_p", "share_met", "n"])


def classification_metrics(
    y: np.ndarray, p: np.ndarray, threshold: float = 0.5, n_bins: int = 10
) -> dict[str, float]:
    """Accuracy, precision/recall/F1 (MET class), macro-F1, ROC-AUC, Brier, ECE and NLL of P(MET)."""
    y = np.asarray(y, dtype=int)
    p = np.clip(np.asarray(p, dtype=float), 1e-7, 1 - 1e-7)
    pred = (p >= threshold).astype(int)
    both = len(np.unique(y)) == 2
    return {
        "n": int(len(y)),
        "met_share": float(y.mean()) if len(y) else float("nan"),
        "accuracy": float(skm.accuracy_score(y, pred)),
        "precision": float(skm.precision_score(y, pred, zero_division=0)),
        "recall": float(skm.recall_score(y, pred, zero_division=0)),
        "f1": float(skm.f1_score(y, pred, zero_division=0)),
        "macro_f1": float(skm.f1_score(y, pred, average="macro", zero_division=0)),
        "roc_auc": float(skm.roc_auc_score(y, p)) if both else float("nan"),
        "brier": float(skm.brier_score_loss(y, p)),
        "ece": expected_calibration_error(y, p, n_bins),
        "nll": float(skm.log_loss(y, p, labels=[0, 1])),
    }


def prior_bias(y: Sequence[int], cfg: RewardConfig) -> float:
    """Logit shift log(pi / (1 - pi)) that undoes balanced class weighting (which trains at prior 0.5).

    Without it a class-weighted model's P(MET) is centred on 0.5 instead of the MET share, and
    temperature scaling (which only rescales) cannot repair that.
    """
    if cfg.class_weighting != "balanced":
        return 0.0
    pi = float(np.clip(np.mean(np.asarray(y, dtype=float)), 1e-3, 1 - 1e-3))
    return math.log(pi / (1 - pi))


def fit_platt(margin: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Platt scaling P(MET) = sigmoid(margin / T + offset) fitted by NLL on held-out labels.

    Returns (T, offset). Platt (Platt 1999) rather than temperature scaling alone (Guo et al.
    2017): the offset also repairs a prior that the class-weighting correction (`prior_bias`) and
    early stopping leave off, which a temperature, rescaling around zero, cannot. With the
    calibration half's hundreds of rows two parameters are well determined. T is kept in
    [0.05, 20] and the offset in [-10, 10]; L-BFGS-B from (T=1, offset=0) is deterministic.
    """
    from scipy.optimize import minimize

    margin = np.asarray(margin, dtype=float)
    y = np.asarray(y, dtype=float)
    if len(y) == 0 or len(np.unique(y)) < 2:
        log.warning("Platt scaling skipped: the calibration rows (%d) hold one class", len(y))
        return 1.0, 0.0
    sign = 2.0 * y - 1.0

    def nll(theta: np.ndarray) -> tuple[float, np.ndarray]:
        a, b = math.exp(theta[0]), theta[1]
        z = a * margin + b
        loss = float(np.mean(np.logaddexp(0.0, -sign * z)))
        g = -sign * sigmoid(-sign * z)  # d loss / d z per row
        return loss, np.array([a * float(np.mean(g * margin)), float(np.mean(g))])

    res = minimize(
        nll,
        np.zeros(2),
        jac=True,
        method="L-BFGS-B",
        bounds=[(math.log(1 / 20.0), math.log(1 / 0.05)), (-10.0, 10.0)],
    )
    return float(math.exp(-res.x[0])), float(res.x[1])


def calibration_report(
    margin: np.ndarray,
    y: np.ndarray,
    temperature: float,
    offset: float = 0.0,
    n_bins: int = 10,
) -> dict[str, float]:
    """ECE, Brier and NLL of P(MET) before (sigmoid(margin)) and after Platt scaling."""
    before = classification_metrics(y, sigmoid(margin), n_bins=n_bins)
    after = classification_metrics(y, sigmoid(margin / temperature + offset), n_bins=n_bins)
    return {
        "temperature": temperature,
        "offset": offset,
        "n": before["n"],
        **{f"{k}_before": before[k] for k in ("ece", "brier", "nll")},
        **{f"{k}_after": after[k] for k in ("ece", "brier", "nll")},
    }
