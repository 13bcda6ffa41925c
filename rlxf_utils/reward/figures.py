"""Notebook 02's figures: the encoders compared, reliability diagrams and confusion matrices."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from rlxf_utils.stats import level

if TYPE_CHECKING:  # heavy imports stay lazy so that `import rlxf_utils.reward` is cheap
    pass
from rlxf_utils.reward.calibration import reliability_curve
from rlxf_utils.reward.model import PAPER_ACCURACY
from rlxf_utils.reward.protocol import ProtocolResult
from rlxf_utils.reward.tables import confusion_frame


def plot_encoders(table: pd.DataFrame, alpha: float) -> Any:
    """Accuracy and AUC with their intervals for TF-IDF and each encoder, one row per protocol."""
    import matplotlib.pyplot as plt

    protocols = list(dict.fromkeys(table["protocol"]))
    labels = list(dict.fromkeys(table["label"]))
    fig, axes = plt.subplots(1, 2, figsize=(9.5, 0.9 + 0.55 * len(protocols) * len(labels)))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (measure, title) in zip(
        axes, (("accuracy", "test accuracy"), ("roc_auc", "test AUC")), strict=True
    ):
        ticks, names = [], []
        y = 0
        for proto in protocols:
            for j, lab in enumerate(labels):
                row = table[(table["protocol"] == proto) & (table["label"] == lab)]
                if not len(row):  # not trained on this protocol: no empty slot
                    continue
                if len(row):
                    r = row.iloc[0]
                    ax.errorbar(
                        r[measure], y,
                        xerr=[[r[measure] - r[f"{measure}_low"]], [r[f"{measure}_high"] - r[measure]]],
                        fmt="o", color=colours[j % len(colours)], capsize=3,
                    )  # fmt: skip
                    ticks.append(y)
                    names.append(f"{proto}: {lab}")
                    y += 1
            y += 0.6
        if measure == "roc_auc":
            ax.axvline(0.5, color="grey", ls=":", lw=1)
            ax.text(0.5, 0, " chance", fontsize=7, color="grey", rotation=90, va="top")
        if measure == "accuracy":
            ax.axvline(PAPER_ACCURACY, color="grey", ls=":", lw=1)
            ax.text(
                PAPER_ACCURACY, 0, " paper's 82%", fontsize=7, color="grey", rotation=90, va="top"
            )
        ax.set_yticks(ticks, names if ax is axes[0] else [""] * len(names), fontsize=8)
        ax.invert_yaxis()
        ax.set(xlabel=f"{title} [{level(alpha)} CI, arrangements resampled]")
    fig.tight_layout()
    return fig


def plot_reliability(
    results: Sequence[ProtocolResult],
    models: Sequence[str] = ("encoder", "tfidf"),
    n_bins: int = 10,
) -> Any:
    """Reliability diagrams (one panel per protocol): raw and calibrated P(MET) against MET share."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 4), squeeze=False)
    for ax, r in zip(axes[0], results, strict=True):
        ax.plot([0, 1], [0, 1], color="grey", lw=0.8, ls=":")
        for m in models:
            for suffix, ls in (("_raw", "--"), ("", "-")):
                col = f"p_{m}{suffix}"
                if col not in r.predictions:
                    continue
                c = reliability_curve(r.predictions["y"], r.predictions[col], n_bins)
                ax.plot(
                    c.mean_p,
                    c.share_met,
                    ls=ls,
                    marker="o",
                    ms=3,
                    label=f"{m}{' (raw)' if suffix else ' (calibrated)'}",
                )
        ax.set(
            title=r.protocol,
            xlabel="predicted P(MET)",
            ylabel="observed MET share",
            xlim=(0, 1),
            ylim=(0, 1),
        )
    axes[0][0].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return fig


def plot_confusion(results: Sequence[ProtocolResult], model: str = "encoder") -> Any:
    """Confusion matrices (counts) of one model, one panel per protocol."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(3.4 * len(results), 3.2), squeeze=False)
    for ax, r in zip(axes[0], results, strict=True):
        if f"p_{model}" not in r.predictions:
            ax.set_axis_off()
            continue
        cm = confusion_frame(r.predictions["y"], r.predictions[f"p_{model}"])
        ax.imshow(cm.to_numpy(), cmap="Blues")
        for (i, j), v in np.ndenumerate(cm.to_numpy()):
            ax.text(j, i, str(v), ha="center", va="center")
        ax.set_xticks([0, 1], ["Non-MET", "MET"])
        ax.set_yticks([0, 1], ["Non-MET", "MET"])
        ax.set(title=f"{r.protocol} ({model})", xlabel="predicted", ylabel="true")
    fig.tight_layout()
    return fig
