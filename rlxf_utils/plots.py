"""Figures shared by the notebooks and the report: one style, sized for a working-paper page."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # headless: notebooks under papermill and CI have no display

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from rlxf_utils.stats import level  # noqa: E402

__all__ = ["bar_counts", "hist_by", "rate_bars", "rate_by_year", "setup_style", "split_balance"]

PALETTE = {"MET": "#1b6ca8", "Non-MET": "#d1495b", "excluded": "#9e9e9e"}
WIDTH = 6.5  # inches: the text width of the report's page


def setup_style() -> None:
    """A quiet, print-friendly style used by every figure of the study."""
    plt.rcParams.update(
        {
            "figure.dpi": 110,
            "savefig.dpi": 150,
            "font.size": 9,
            "axes.titlesize": 10,
            "axes.labelsize": 9,
            "axes.spines.top": False,
            "axes.spines.right": False,
            "axes.grid": True,
            "grid.alpha": 0.3,
            "legend.frameon": False,
        }
    )


def bar_counts(table: pd.DataFrame, label_col: str, count_col: str, hue_col: str, title: str):
    """Horizontal bars of counts, coloured by `hue_col` (e.g. raw statuses by their label)."""
    setup_style()
    t = table.sort_values(count_col)
    fig, ax = plt.subplots(figsize=(WIDTH, 0.25 * len(t) + 1.0))
    colors = [PALETTE.get(h, "#555555") for h in t[hue_col]]
    ax.barh(t[label_col].astype(str), t[count_col], color=colors)
    for y, v in enumerate(t[count_col]):
        ax.text(v, y, f" {v:,}", va="center", fontsize=8)
    handles = [
        plt.Rectangle((0, 0), 1, 1, color=c) for h, c in PALETTE.items() if h in set(t[hue_col])
    ]
    ax.legend(handles, [h for h in PALETTE if h in set(t[hue_col])], loc="lower right")
    ax.set_xlabel("conditions")
    ax.set_title(title)
    ax.grid(axis="y", visible=False)
    return fig


def rate_bars(
    rates: pd.DataFrame,
    column: str,
    title: str,
    overall: float | None = None,
    min_n: int = 1,
    alpha: float = 0.05,
):
    """MET rate with Wilson intervals per category (from `stats.rates.rate_by` at the same `alpha`)."""
    setup_style()
    r = rates[rates["n"] >= min_n].sort_values("met_rate")
    fig, ax = plt.subplots(figsize=(WIDTH, 0.24 * len(r) + 1.1))
    y = np.arange(len(r))
    err = np.vstack([r["met_rate"] - r["ci_low"], r["ci_high"] - r["met_rate"]])
    ax.barh(y, r["met_rate"], xerr=err, color=PALETTE["MET"], alpha=0.85, error_kw={"lw": 0.8})
    labels = [s if len(s) <= 55 else s[:52] + "..." for s in r[column].astype(str)]
    ax.set_yticks(y, labels, fontsize=7.5)
    for yi, n in enumerate(r["n"]):
        ax.text(0.01, yi, f"n={n}", va="center", fontsize=6.5, color="white")
    if overall is not None:
        ax.axvline(overall, color="black", lw=0.8, ls="--", label=f"all conditions {overall:.2f}")
        ax.legend(loc="lower right")
    ax.set_xlim(0, 1)
    ax.set_xlabel(f"MET rate ({level(alpha)} Wilson interval)")
    ax.set_title(title)
    ax.grid(axis="y", visible=False)
    return fig


def rate_by_year(rates: pd.DataFrame, title: str, cutoff: int | None = None, alpha: float = 0.05):
    """MET rate by test year with its interval (line) over the number of conditions (bars)."""
    setup_style()
    fig, ax = plt.subplots(figsize=(WIDTH, 3.0))
    x = rates["test_year"].astype(int)
    ax2 = ax.twinx()
    ax2.bar(x, rates["n"], color="#cccccc", alpha=0.6, width=0.7)
    ax2.set_ylabel("conditions (bars)")
    ax2.grid(False)
    ax.set_zorder(ax2.get_zorder() + 1)
    ax.patch.set_visible(False)
    ax.fill_between(x, rates["ci_low"], rates["ci_high"], color=PALETTE["MET"], alpha=0.2)
    ax.plot(x, rates["met_rate"], marker="o", color=PALETTE["MET"], label="MET rate")
    if cutoff is not None:
        ax.axvline(cutoff + 0.5, color="black", ls=":", lw=1, label=f"temporal cut-off ({cutoff})")
    ax.set_ylim(0, 1)
    ax.set_xlabel("test year")
    ax.set_ylabel(f"MET rate ({level(alpha)} Wilson interval)")
    ax.set_xticks(x)
    ax.tick_params(axis="x", labelrotation=45)
    ax.legend(loc="lower left")
    ax.set_title(title)
    return fig


def hist_by(
    values: pd.Series, groups: pd.Series, title: str, xlabel: str, bins: int = 40, log: bool = False
):
    """Overlaid histograms of `values` per group (e.g. description length by label)."""
    setup_style()
    fig, ax = plt.subplots(figsize=(WIDTH, 2.8))
    edges = np.histogram_bin_edges(values.astype(float), bins=bins)
    for g in sorted(groups.unique()):
        ax.hist(values[groups == g], bins=edges, alpha=0.55, label=str(g), color=PALETTE.get(g))
    if log:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("count")
    ax.legend()
    ax.set_title(title)
    return fig


def split_balance(summary: pd.DataFrame, title: str):
    """Rows and MET share per protocol and part (train / val / test)."""
    setup_style()
    fig, axes = plt.subplots(1, 2, figsize=(WIDTH, 2.6))
    protocols = list(dict.fromkeys(summary["protocol"]))
    parts = list(dict.fromkeys(summary["part"]))
    w = 0.8 / len(parts)
    for j, part in enumerate(parts):
        sub = summary[summary["part"] == part].set_index("protocol").loc[protocols]
        x = np.arange(len(protocols)) + j * w
        axes[0].bar(x, sub["rows"], width=w, label=part)
        axes[1].bar(x, sub["met_share"], width=w, label=part)
    for ax in axes:
        ax.set_xticks(np.arange(len(protocols)) + w * (len(parts) - 1) / 2, protocols)
    axes[0].set_ylabel("rows")
    axes[1].set_ylabel("MET share")
    axes[1].set_ylim(0, 1)
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def ci_err(
    df: pd.DataFrame, mid: str, low: str, high: str, fill_missing: bool = False
) -> np.ndarray:
    """Error-bar lengths (2, n) of intervals `low`..`high` around `mid` for matplotlib's
    `yerr`/`xerr`; `fill_missing`: a missing end draws no bar instead of NaN."""
    if fill_missing:
        df = df.fillna({low: df[mid], high: df[mid]})
    return np.vstack([df[mid] - df[low], df[high] - df[mid]]).astype(float).clip(min=0)
