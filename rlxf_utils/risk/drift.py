"""Backward-looking bias: the temporal protocol's reward model scored on each later year, next
to the MET base rate of every year (label shift), with the intervals its verdicts are read from.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd
from scipy import stats

from rlxf_utils.plots import PALETTE, WIDTH, setup_style
from rlxf_utils.risk.common import binary_metrics, clusters_of, require_columns
from rlxf_utils.stats import level, mean_ci, rate_by, stat_ci


def drift_by_year(
    pred: pd.DataFrame, p_col: str, year_col: str = "test_year", n_bins: int = 10
) -> pd.DataFrame:
    """Quality of one model's P(MET) per test year: n, MET rate, mean P(MET), accuracy, AUC, Brier.

    AUC is NaN in a year with one class. `majority_accuracy` is the accuracy of always predicting
    the training majority class (from `p_majority` when the table has it), the bar any year's
    accuracy should clear. Rows without a year are dropped.
    """
    require_columns(pred, [year_col, "y", p_col], "predictions table")
    d = pred[pred[year_col].notna()]
    rows = []
    for year, g in d.groupby(year_col, sort=True):
        m = binary_metrics(g["y"].astype(int), g[p_col].astype(float), n_bins)
        row: dict[str, Any] = {"test_year": int(year), **m}
        if "p_majority" in g:
            maj = (g["p_majority"].astype(float) >= 0.5).astype(int)
            row["majority_accuracy"] = float((maj == g["y"].astype(int)).mean())
        rows.append(row)
    cols = ["test_year", "n", "met_rate", "mean_p", "calibration_gap", "accuracy", "auc", "brier"]
    out = pd.DataFrame(rows)
    if out.empty:
        return pd.DataFrame(columns=cols)
    return out[[*cols, *(["majority_accuracy"] if "majority_accuracy" in out else [])]]


def base_rate_by_year(
    labelled: pd.DataFrame,
    cutoff: int | None = None,
    year_col: str = "test_year",
    alpha: float = 0.05,
) -> pd.DataFrame:
    """MET base rate (with its Wilson interval at level 1 - alpha) per test year.

    With `cutoff`, a `side` column says whether the year is on the training side (<= cutoff) or
    the test side of the temporal protocol.
    """

    require_columns(labelled, [year_col, "y"], "labelled conditions")
    d = labelled[labelled[year_col].notna()].copy()
    d[year_col] = d[year_col].astype(int)
    d["y"] = d["y"].astype(int)
    z = float(stats.norm.ppf(1 - alpha / 2))
    out = rate_by(d, year_col, z=z).rename(columns={year_col: "test_year"})
    if cutoff is not None:
        out["side"] = np.where(out["test_year"] <= cutoff, "train (<= cut-off)", "test")
    return out


def drift_summary(drift: pd.DataFrame, base: pd.DataFrame, cutoff: int) -> dict[str, Any]:
    """Headline numbers of the drift measure (for the notebook's prose and the report)."""
    past = base[base["test_year"] <= cutoff]
    future = base[base["test_year"] > cutoff]

    def pooled(b: pd.DataFrame) -> float:
        return float(b["n_met"].sum() / b["n"].sum()) if b["n"].sum() else math.nan

    out: dict[str, Any] = {
        "cutoff": cutoff,
        "met_rate_train_years": pooled(past),
        "met_rate_test_years": pooled(future),
        "test_years": [int(y) for y in drift["test_year"]],
    }
    if len(drift):
        n = drift["n"].to_numpy(dtype=float)
        out.update(
            {
                "n_test": int(n.sum()),
                "mean_p_test": float(np.average(drift["mean_p"], weights=n)),
                "observed_met_test": float(np.average(drift["met_rate"], weights=n)),
                "accuracy_first_year": float(drift["accuracy"].iloc[0]),
                "accuracy_last_year": float(drift["accuracy"].iloc[-1]),
                "first_year": int(drift["test_year"].iloc[0]),
                "last_year": int(drift["test_year"].iloc[-1]),
                "accuracy_slope_per_year": float(
                    np.polyfit(drift["test_year"], drift["accuracy"], 1)[0]
                )
                if len(drift) >= 2
                else math.nan,
            }
        )
        if "majority_accuracy" in drift:
            diff = drift["accuracy"] - drift["majority_accuracy"]
            out["years_beating_majority"] = int((diff > 1e-9).sum())
            out["years_tying_majority"] = int((diff.abs() <= 1e-9).sum())
    return out


def _ci(est: tuple[float, float, float]) -> dict[str, float]:
    return {"estimate": est[0], "low": est[1], "high": est[2]}


def drift_tests(
    labelled: pd.DataFrame,
    pred: pd.DataFrame,
    p_col: str,
    cutoff: int,
    alpha: float = 0.05,
    n_boot: int = 2000,
    seed: int = 0,
    year_col: str = "test_year",
) -> dict[str, Any]:
    """The intervals the drift verdicts are read from, at level 1 - alpha.

    Conditions of one arrangement are correlated, so every interval resamples whole
    arrangements (`arrangement_id`; rows when a table lacks it):
    - `base_rate_shift`: MET rate after the cut-off minus before, over all labelled conditions;
    - `calibration_in_the_large`: mean of P(MET) - y over the later conditions (> 0: the model
      promises more MET than happened);
    - `accuracy_trend`: slope per year of a least-squares line through each later condition's
      correctness (0/1) against its test year;
    - `vs_majority`: per test year, the model's accuracy minus the always-the-training-majority
      rule's (when the predictions carry `p_majority`).
    """
    require_columns(labelled, [year_col, "y"], "labelled conditions")
    require_columns(pred, [year_col, "y", p_col], "temporal predictions")
    lab = labelled[labelled[year_col].notna()]
    y_all = lab["y"].astype(float).to_numpy()
    after = (lab[year_col].astype(int) > cutoff).to_numpy()

    def shift(idx: np.ndarray) -> float:
        a, y = after[idx], y_all[idx]
        return float(y[a].mean() - y[~a].mean()) if a.any() and (~a).any() else math.nan

    out: dict[str, Any] = {
        "alpha": alpha,
        "base_rate_shift": _ci(stat_ci(shift, clusters_of(lab), alpha, n_boot, seed)),
    }
    d = pred[pred[year_col].notna()]
    if d.empty:
        return out
    y = d["y"].astype(int).to_numpy()
    p = d[p_col].astype(float).to_numpy()
    g = clusters_of(d)
    out["calibration_in_the_large"] = _ci(mean_ci(p - y, g, alpha, n_boot, seed + 1))
    correct = ((p >= 0.5).astype(int) == y).astype(float)
    year = d[year_col].astype(float).to_numpy()

    def slope(idx: np.ndarray) -> float:
        x = year[idx]
        if np.ptp(x) == 0:
            return math.nan
        return float(np.polyfit(x, correct[idx], 1)[0])

    if np.ptp(year) > 0:
        out["accuracy_trend"] = _ci(stat_ci(slope, g, alpha, n_boot, seed + 2))
    if "p_majority" in d:
        maj_ok = ((d["p_majority"].astype(float).to_numpy() >= 0.5).astype(int) == y).astype(float)
        rows = []
        for k, yr in enumerate(sorted(set(year.astype(int)))):
            m = year == yr
            est, lo, hi = mean_ci(correct[m] - maj_ok[m], g[m], alpha, n_boot, seed + 3 + k)
            rows.append({"test_year": yr, "difference": est, "low": lo, "high": hi})
        out["vs_majority"] = rows
    return out


def plot_drift(
    drift: pd.DataFrame, base: pd.DataFrame, cutoff: int, model: str, alpha: float = 0.05
) -> Any:
    """Left: MET base rate per year (all data) with the test years' mean P(MET); right: quality per test year."""
    import matplotlib.pyplot as plt

    setup_style()
    fig, axes = plt.subplots(1, 2, figsize=(WIDTH, 2.9), gridspec_kw={"width_ratios": [1.6, 1]})
    ax = axes[0]
    x = base["test_year"].astype(int)
    ax.fill_between(
        x,
        base["ci_low"],
        base["ci_high"],
        color=PALETTE["MET"],
        alpha=0.18,
        label=f"{level(alpha)} Wilson interval",
    )
    ax.plot(x, base["met_rate"], marker="o", ms=3, color=PALETTE["MET"], label="MET base rate")
    if len(drift):
        ax.plot(
            drift["test_year"],
            drift["mean_p"],
            marker="s",
            ms=4,
            color=PALETTE["Non-MET"],
            label=f"mean predicted P(MET) ({model})",
        )
    ax.axvline(cutoff + 0.5, color="black", ls=":", lw=1, label=f"cut-off ({cutoff})")
    ax.set(ylim=(0, 1), xlabel="test year", ylabel="share / probability")
    ax.set_title("Label shift: MET rate by year")
    ax.legend(fontsize=7, loc="lower left")
    ax = axes[1]
    if len(drift):
        ax.plot(drift["test_year"], drift["accuracy"], marker="o", label="accuracy")
        ax.plot(drift["test_year"], drift["auc"], marker="^", label="AUC")
        ax.plot(drift["test_year"], drift["brier"], marker="v", label="Brier")
        if "majority_accuracy" in drift:
            ax.plot(
                drift["test_year"],
                drift["majority_accuracy"],
                ls="--",
                color="grey",
                label="majority-class accuracy",
            )
        ax.set_xticks(drift["test_year"])
    ax.set(ylim=(0, 1), xlabel="test year")
    ax.set_title("Reward model after the cut-off")
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    return fig
