"""Label-mapping sensitivity: the TF-IDF reward retrained under each MET mapping of
`risk.label_mappings` (params), and how much its ranking of texts changes against the paper's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from rlxf_utils.data.labels import normalise_status
from rlxf_utils.plots import WIDTH, setup_style
from rlxf_utils.prompts import serialize_frame
from rlxf_utils.reward.tfidf import train_tfidf
from rlxf_utils.risk.common import RiskError, binary_metrics, clusters_of, require_columns
from rlxf_utils.stats import spearman_ci


def mapping_statuses(mapping: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(MET statuses, excluded statuses) of a mapping: a `config.LabelMapping` or a dict."""
    get = mapping.get if isinstance(mapping, Mapping) else lambda k, d=None: getattr(mapping, k, d)
    met, exclude = get("met"), get("exclude", ()) or ()
    if not met:
        raise RiskError(f"label mapping {mapping!r}: no 'met' statuses; expected a non-empty list")
    return tuple(str(s) for s in met), tuple(str(s) for s in exclude)


def relabel(conditions: pd.DataFrame, mapping: Any, not_assessed: Iterable[str]) -> pd.DataFrame:
    """Conditions labelled under one mapping: `y` = 1 for its MET statuses, else 0.

    Rows whose status is in `not_assessed` (`data.labels.not_assessed`) are dropped under every
    mapping, and the mapping's `exclude` statuses too. Statuses are compared after
    `data.labels.normalise_status`.
    """

    met, exclude = mapping_statuses(mapping)
    keep = _kept(conditions, (*not_assessed, *exclude))
    out = conditions.loc[keep].copy()
    out["y"] = out["status"].map(normalise_status).isin({normalise_status(s) for s in met})
    out["y"] = out["y"].astype(int)
    out["label"] = np.where(out["y"] == 1, "MET", "Non-MET")
    return out.reset_index(drop=True)


def _kept(conditions: pd.DataFrame, dropped: Iterable[str]) -> pd.Series:
    """Rows whose status (after `data.labels.normalise_status`) is none of the `dropped` statuses."""

    require_columns(conditions, ["status"], "conditions table")
    drop = {normalise_status(s) for s in dropped}
    return ~conditions["status"].map(normalise_status).isin(drop)


def label_sensitivity(
    labelled: pd.DataFrame,
    split: Mapping[str, Sequence[int]],
    mappings: Mapping[str, Any],
    reward_cfg: Any,
    seed: int,
    not_assessed: Iterable[str],
    reference: str = "paper",
    alpha: float = 0.05,
    n_boot: int = 2000,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Retrain the TF-IDF + LR reward on one split under each label mapping; compare.

    `mappings` maps a variant name to its mapping (`met`, `exclude`), in the order to report.
    Returns (per-variant table, scores on the common test rows). Per variant: train/test rows,
    MET shares, train and test labels changed vs the reference variant, rows the variant drops
    (beyond the not-assessed ones), test accuracy, AUC, Brier and majority-class accuracy on its
    own test rows, and the Spearman correlation of its scores with the reference variant's on
    the test rows every variant keeps, with a percentile-bootstrap interval at level 1 - alpha
    that resamples arrangements. Each model is `reward.tfidf.train_tfidf` with the reward config,
    Platt-scaled on the split's validation rows under the same variant.
    """

    variants = list(mappings)
    if not variants:
        raise RiskError(
            "no label mappings to compare; expected at least one in risk.label_variants"
        )
    if reference not in variants:
        reference = variants[0]
    by_id = labelled.set_index("row_id", drop=False)
    parts = {k: [i for i in split[k] if i in by_id.index] for k in ("train", "val", "test")}
    rows_used = by_id.loc[[i for k in ("train", "val", "test") for i in parts[k]]]
    # the rows every variant starts from (not-assessed ones out): the base for "rows dropped"
    assessed = set(rows_used.loc[_kept(rows_used, not_assessed), "row_id"])
    split_ids = {k: [i for i in parts[k] if i in assessed] for k in parts}
    relabelled = {v: relabel(rows_used, mappings[v], not_assessed) for v in variants}
    common = sorted(
        set.intersection(*(set(relabelled[v]["row_id"]) & set(parts["test"]) for v in variants))
    )
    common_df = by_id.loc[common]
    x_common = serialize_frame(common_df)
    ref_y = relabelled[reference].set_index("row_id")["y"]

    def changed(frame: pd.DataFrame) -> int:
        """Labels of `frame` that differ from the reference variant's (on rows both keep)."""
        shared = frame.index.intersection(ref_y.index)
        return int((frame.loc[shared, "y"] != ref_y.loc[shared]).sum())

    rows, scores = [], {"row_id": common}
    for v in variants:
        d = relabelled[v].set_index("row_id", drop=False)
        tr, va, te = (
            d.loc[[i for i in parts[k] if i in d.index]] for k in ("train", "val", "test")
        )
        if tr["y"].nunique() < 2:
            raise RiskError(
                f"label variant {v!r}: the training rows hold one class only; cannot train a reward model"
            )
        model = train_tfidf(
            serialize_frame(tr),
            tr["y"].to_numpy(),
            serialize_frame(va),
            va["y"].to_numpy(),
            reward_cfg,
            seed,
        )
        p_te = model.score_texts(serialize_frame(te))
        m = binary_metrics(te["y"].to_numpy(), p_te, reward_cfg.ece_bins)
        maj = int(tr["y"].mean() >= 0.5)
        scores[v] = model.score_texts(x_common)
        rows.append(
            {
                "variant": v,
                "met_statuses": "+".join(mapping_statuses(mappings[v])[0]),
                "excluded_statuses": "+".join(mapping_statuses(mappings[v])[1]) or "-",
                "n_train": len(tr),
                "n_test": len(te),
                "met_share_train": float(tr["y"].mean()),
                "met_share_test": float(te["y"].mean()),
                "train_labels_changed": changed(tr),
                "test_labels_changed": changed(te),
                "train_rows_dropped": len(split_ids["train"]) - len(tr),
                "test_rows_dropped": len(split_ids["test"]) - len(te),
                "accuracy": m["accuracy"],
                "auc": m["auc"],
                "brier": m["brier"],
                "majority_accuracy": float((te["y"] == maj).mean()),
            }
        )
    sc = pd.DataFrame(scores)
    table = pd.DataFrame(rows)
    table["n_common"] = len(common)
    ref_scores = sc[reference].to_numpy()
    clusters = clusters_of(common_df)
    cis = [
        (1.0, 1.0, 1.0)
        if v == reference
        else spearman_ci(ref_scores, sc[v].to_numpy(), clusters, alpha, n_boot, seed)
        for v in variants
    ]
    table["spearman_vs_reference"] = [c[0] for c in cis]
    table["spearman_low"] = [c[1] for c in cis]
    table["spearman_high"] = [c[2] for c in cis]
    table["reference"] = reference
    return table, sc


def plot_label_variants(scores: pd.DataFrame, table: pd.DataFrame) -> Any:
    """Each variant's P(MET) against the reference variant's on the common test rows."""
    import matplotlib.pyplot as plt

    setup_style()
    ref = str(table["reference"].iloc[0])
    others = [v for v in table["variant"] if v != ref]
    fig, axes = plt.subplots(1, max(1, len(others)), figsize=(WIDTH, 2.9), squeeze=False)
    rho = table.set_index("variant")["spearman_vs_reference"]
    for ax, v in zip(axes[0], others, strict=False):
        ax.scatter(scores[ref], scores[v], s=8, alpha=0.5)
        ax.plot([0, 1], [0, 1], color="grey", lw=0.8, ls=":")
        ax.set(xlim=(0, 1), ylim=(0, 1), xlabel=f"P(MET), {ref}", ylabel=f"P(MET), {v}")
        ax.set_title(f"{v}: Spearman {rho[v]:.2f}", fontsize=9)
    fig.suptitle(
        f"TF-IDF reward retrained under other label mappings ({len(scores)} common test texts)"
    )
    fig.tight_layout()
    return fig
