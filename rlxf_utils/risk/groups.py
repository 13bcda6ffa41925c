"""Group bias and overgeneralisation: the reward model's accuracy, AUC, calibration gap (with
its interval) and ECE by region, arrangement type and economic area; small groups pooled.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from rlxf_utils.plots import PALETTE, WIDTH, setup_style
from rlxf_utils.risk.common import RiskError, binary_metrics, clusters_of, require_columns
from rlxf_utils.stats import mean_ci, sign_of

from ..prompts import econ_area


def _norm_country(s: pd.Series) -> pd.Series:
    """The data layer's country normalisation: upper case, inner whitespace collapsed."""
    return s.astype(str).str.strip().str.upper().str.replace(r"\s+", " ", regex=True)


def load_regions(path: str | Path) -> pd.DataFrame:
    """Read the country -> region CSV (columns country, region[, region_name]); names normalised."""
    path = Path(path)
    if not path.is_file():
        raise RiskError(
            f"{path}: regions file not found; expected a CSV with columns country,region"
        )
    df = pd.read_csv(path, dtype=str, keep_default_na=False)
    missing = [c for c in ("country", "region") if c not in df.columns]
    if missing:
        raise RiskError(
            f"{path}: missing column(s) {missing}; expected columns country,region,region_name "
            f"(found {list(df.columns)})"
        )
    df = df.copy()
    df["country"] = _norm_country(df["country"])
    df["region"] = df["region"].str.strip()
    if "region_name" not in df.columns:
        df["region_name"] = df["region"]
    empty = df.loc[df["region"] == "", "country"].tolist()
    if empty:
        raise RiskError(f"{path}: empty 'region' for {empty}; expected a region code")
    conflicts = df.groupby("country")["region"].nunique()
    conflicts = sorted(conflicts[conflicts > 1].index)
    if conflicts:
        raise RiskError(f"{path}: countries listed with more than one region: {conflicts}")
    return df.drop_duplicates("country")[["country", "region", "region_name"]].reset_index(
        drop=True
    )


def assign_regions(
    countries: Iterable[str], regions: pd.DataFrame, path: str | Path = "<regions>"
) -> pd.Series:
    """Region of each country; any country missing from the regions table is a RiskError naming them."""
    c = _norm_country(pd.Series(list(countries), dtype=str))
    mapping = dict(zip(regions["country"], regions["region"], strict=True))
    missing = sorted(set(c) - set(mapping))
    if missing:
        raise RiskError(
            f"{path}: {len(missing)} country(ies) in the data have no region: {missing}; "
            "add a row 'country,region,region_name' for each (names as in the MONA file)"
        )
    return c.map(mapping).rename("region")


def pool_small_groups(groups: Iterable[Any], min_size: int, other: str = "other") -> pd.Series:
    """Groups with fewer than `min_size` members relabelled `other` (their members pooled)."""
    g = pd.Series(list(groups), dtype=object).astype(str)
    counts = g.value_counts()
    small = set(counts[counts < min_size].index)
    return g.where(~g.isin(small), other)


def group_metrics(
    y: Sequence[int],
    p: Sequence[float],
    groups: Sequence[Any],
    min_group_size: int,
    n_bins: int = 10,
    other: str = "other",
    clusters: Sequence[Any] | None = None,
    alpha: float = 0.05,
    n_boot: int = 2000,
    seed: int = 0,
) -> pd.DataFrame:
    """Accuracy, AUC, mean P(MET) vs MET rate (calibration gap), ECE per group; small groups pooled.

    Groups with fewer than `min_group_size` rows are pooled into `other` (column `pooled` lists
    what went in). Rows are sorted by size, `other` last. `gap_low`, `gap_high`: the calibration
    gap's percentile-bootstrap interval at level 1 - alpha, resampling whole `clusters` (e.g.
    arrangements: their conditions are correlated) or rows when none are given.
    """
    y_arr = np.asarray(y, dtype=int)
    p_arr = np.asarray(p, dtype=float)
    raw = pd.Series(list(groups), dtype=object).astype(str)
    if not (len(y_arr) == len(p_arr) == len(raw)):
        raise RiskError(
            f"lengths differ: {len(y_arr)} labels, {len(p_arr)} scores, {len(raw)} groups"
        )
    g_arr = np.arange(len(y_arr)) if clusters is None else np.asarray(clusters)
    if len(g_arr) != len(y_arr):
        raise RiskError(f"lengths differ: {len(y_arr)} labels, {len(g_arr)} cluster labels")
    pooled = pool_small_groups(raw, min_group_size, other)
    rows = []
    for k, name in enumerate(pd.unique(pooled)):
        m = (pooled == name).to_numpy()
        members = sorted(set(raw[m])) if name == other else [name]
        _, low, high = mean_ci(p_arr[m] - y_arr[m], g_arr[m], alpha, n_boot, seed + k)
        rows.append(
            {
                "group": name,
                **binary_metrics(y_arr[m], p_arr[m], n_bins),
                "gap_low": low,
                "gap_high": high,
                "pooled": ", ".join(members) if name == other else "",
            }
        )
    out = pd.DataFrame(rows)
    out["_other"] = out["group"] == other
    out = out.sort_values(["_other", "n", "group"], ascending=[True, False, True], kind="stable")
    return out.drop(columns="_other").reset_index(drop=True)


def group_bias_table(
    pred: pd.DataFrame,
    p_col: str,
    regions: pd.DataFrame,
    min_group_size: int,
    n_bins: int = 10,
    regions_path: str | Path = "<regions>",
    alpha: float = 0.05,
    n_boot: int = 2000,
    seed: int = 0,
) -> pd.DataFrame:
    """`group_metrics` by region, arrangement type and economic area, stacked (column `dimension`).

    Gap intervals resample arrangements (`arrangement_id`) when the predictions carry it.
    """
    require_columns(
        pred, ["country", "arrangement_type", "econ_descriptor", "y", p_col], "predictions table"
    )
    dims = {
        "region": assign_regions(pred["country"], regions, regions_path).to_numpy(),
        "arrangement_type": pred["arrangement_type"].astype(str).to_numpy(),
        "econ_area": pred["econ_descriptor"].map(econ_area).to_numpy(),
    }
    parts = [
        group_metrics(
            pred["y"],
            pred[p_col],
            g,
            min_group_size,
            n_bins,
            "other",
            clusters_of(pred),
            alpha,
            n_boot,
            seed,
        ).assign(dimension=dim)
        for dim, g in dims.items()
    ]
    out = pd.concat(parts, ignore_index=True)
    return out[["dimension", *[c for c in out.columns if c != "dimension"]]]


def group_bias_summary(table: pd.DataFrame, overall: Mapping[str, float]) -> dict[str, Any]:
    """Per dimension: the groups with the lowest and highest accuracy and the largest |calibration gap|.

    With gap intervals in the table: that group's interval, and how many groups' intervals lie
    wholly above 0 (`n_groups_over`: the model promises more MET than happened) or below.
    """
    out: dict[str, Any] = {"overall": dict(overall)}
    for dim, g in table.groupby("dimension", sort=False):
        g = g[g["n"] > 0]
        worst = g.loc[g["calibration_gap"].abs().idxmax()]
        lo, hi = g.loc[g["accuracy"].idxmin()], g.loc[g["accuracy"].idxmax()]
        out[dim] = {
            "n_groups": int(len(g)),
            "accuracy_min": float(lo["accuracy"]),
            "accuracy_min_group": str(lo["group"]),
            "accuracy_min_n": int(lo["n"]),
            "accuracy_max": float(hi["accuracy"]),
            "accuracy_max_group": str(hi["group"]),
            "accuracy_max_n": int(hi["n"]),
            "accuracy_range": float(g["accuracy"].max() - g["accuracy"].min()),
            "max_abs_gap": float(abs(worst["calibration_gap"])),
            "max_abs_gap_signed": float(worst["calibration_gap"]),
            "max_abs_gap_group": str(worst["group"]),
            "max_abs_gap_n": int(worst["n"]),
            "max_ece": float(g["ece"].max()),
        }
        if "gap_low" in g:
            signs = [sign_of(lo, hi) for lo, hi in zip(g["gap_low"], g["gap_high"], strict=True)]
            out[dim].update(
                {
                    "max_abs_gap_low": float(worst["gap_low"]),
                    "max_abs_gap_high": float(worst["gap_high"]),
                    "n_groups_over": signs.count(1),
                    "n_groups_under": signs.count(-1),
                }
            )
    return out


def plot_group_bias(table: pd.DataFrame) -> Any:
    """Per dimension: observed MET rate and mean predicted P(MET) per group, accuracy marked."""
    import matplotlib.pyplot as plt

    setup_style()
    dims = list(dict.fromkeys(table["dimension"]))
    heights = [max(1.2, 0.22 * (table["dimension"] == d).sum() + 0.6) for d in dims]
    fig, axes = plt.subplots(
        len(dims), 1, figsize=(WIDTH, sum(heights) + 0.4), gridspec_kw={"height_ratios": heights}
    )
    axes = np.atleast_1d(axes)
    for ax, dim in zip(axes, dims, strict=True):
        g = table[table["dimension"] == dim].iloc[::-1]
        yy = np.arange(len(g))
        labels = [
            (s if len(s) <= 45 else s[:42] + "...") + f" (n={n})"
            for s, n in zip(g["group"], g["n"], strict=True)
        ]
        ax.barh(
            yy - 0.2, g["met_rate"], height=0.4, color=PALETTE["MET"], label="observed MET rate"
        )
        ax.barh(yy + 0.2, g["mean_p"], height=0.4, color="#f0a202", label="mean predicted P(MET)")
        ax.scatter(g["accuracy"], yy, marker="|", s=120, color="black", zorder=3, label="accuracy")
        ax.set_yticks(yy, labels, fontsize=7)
        ax.set_xlim(0, 1)
        ax.set_title(f"by {dim.replace('_', ' ')}")
        ax.grid(axis="y", visible=False)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="lower center", ncols=3, bbox_to_anchor=(0.5, 0))
    axes[-1].set_xlabel("share / probability")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    return fig
