"""The paper's risks, measured (notebook 05).

The paper (IMF WP/24/114) names the pitfalls of RLXF without measuring them: historical data may
carry biases and outdated assumptions, the model may overgeneralise, a backward-looking reward
may resist policy innovation, and RL may amplify all of it. Each risk becomes a number here:

1. **Backward-looking bias / drift** (`drift_by_year`, `base_rate_by_year`): the temporal
   protocol's reward model (trained up to the cut-off) scored on each later year, next to the MET
   base rate of every year (label shift).
2. **Group bias / overgeneralisation** (`group_metrics`, `group_bias_table`, `country_swap`):
   accuracy, AUC, calibration gap and ECE by region, arrangement type and economic area; and how
   much the reward of one condition text moves when only the country changes.
3. **Reward hacking** (`length_reward`, `checkpoint_gains`, `rising_ngrams`): reward against
   response length, training-reward gain against audit-reward gain over checkpoints, and the
   bigrams RL made more frequent.
4. **Diversity collapse** (`area_table`, `within_prompt_diversity`): the economic areas the
   responses fall into (entropy, KL to history, coverage) and the diversity among the samples of
   one prompt.
5. **Label-mapping sensitivity** (`relabel`, `label_sensitivity`): the TF-IDF reward retrained
   under other defensible MET mappings, and how much its ranking of texts changes.

Every measure is a pure function of tables; `run_risk_stage` reads the run dir, calls them and
writes tables `risk_*`, figures `risk_*` and `risk/summary.json`. Stages that depend on
notebook 04 (`eval/samples.parquet`, `eval/frontier.parquet`) are reported as missing, with a
flagged table, when that notebook has not run.
"""

from __future__ import annotations

import logging
import math
import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from scipy import stats

from .artifacts import fmt_num as _num
from .artifacts import fmt_pct as _pct
from .artifacts import is_present as _ok
from .evaluation import area_distribution, distinct_n, entropy, kl_divergence, tokenize
from .prompts import CONTEXT_FIELDS, econ_area

__all__ = [
    "HISTORY_PREFIX",
    "LABEL_VARIANTS",
    "NON_GENERATED",
    "RISK_FIGURES",
    "RiskError",
    "RiskStage",
    "area_table",
    "assign_regions",
    "base_rate_by_year",
    "checkpoint_gains",
    "choose_swap_countries",
    "country_swap",
    "Finding",
    "direction",
    "drift_by_year",
    "interpret",
    "report_content",
    "generated_policies",
    "group_bias_table",
    "group_metrics",
    "label_sensitivity",
    "length_reward",
    "load_regions",
    "missing_note",
    "policy_kind",
    "pool_small_groups",
    "prediction_column",
    "relabel",
    "rising_ngrams",
    "run_risk_stage",
    "swap_summary",
    "tuned_policies",
    "within_prompt_diversity",
    "word_tokens",
]

log = logging.getLogger(__name__)

#: Policies of notebook 04 whose names start with this are historical conditions, not generated.
HISTORY_PREFIX = "history"
#: Policies of notebook 04 that are neither generated nor historical (a reference).
NON_GENERATED = frozenset({"random_policy"})
#: Generated policies that are not tuned by RL (the start and the best-of-N selection of it).
UNTUNED = frozenset({"base", "sft", "sft_met", "best_of_n"})

#: Label mappings compared in the label-sensitivity check: MET statuses and statuses dropped.
LABEL_VARIANTS: dict[str, dict[str, tuple[str, ...]]] = {
    "paper": {"met": ("M", "PM"), "exclude": ()},
    "md_as_met": {"met": ("M", "PM", "MD"), "exclude": ()},
    "exclude_cancelled_modified": {"met": ("M", "PM"), "exclude": ("CAN", "MOD")},
}
#: Statuses that mark a condition as not assessed yet (excluded under every variant).
NOT_ASSESSED: tuple[str, ...] = ("SB", "PC", "PA", "")

#: Every figure the stage can write (those whose input is missing are removed, not left stale).
RISK_FIGURES = frozenset(
    {
        "risk_drift",
        "risk_group_bias",
        "risk_country_swap",
        "risk_length_reward",
        "risk_checkpoint_gains",
        "risk_area_shares",
        "risk_label_variants",
    }
)


class RiskError(ValueError):
    """An input the risk stage cannot use; the message names the file or field and what was expected."""


def missing_note(artifact: str, notebook: str = "notebook 04") -> str:
    """The visible note shown (and stored) when an earlier notebook's artifact is absent."""
    return f"{notebook} did not run: {artifact} missing"


def _note_table(note: str) -> pd.DataFrame:
    """A one-row table that says why a measurement is absent (written instead of a hole)."""
    return pd.DataFrame({"note": [note]})


def _require_columns(df: pd.DataFrame, columns: Iterable[str], where: str) -> None:
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise RiskError(f"{where}: missing column(s) {missing}; found {list(df.columns)}")


# ---------------------------------------------------------------------------------------------
# shared metrics
# ---------------------------------------------------------------------------------------------


def _auc(y: np.ndarray, p: np.ndarray) -> float:
    """ROC-AUC, NaN when only one class is present (AUC is undefined then)."""
    from sklearn.metrics import roc_auc_score

    return float(roc_auc_score(y, p)) if len(np.unique(y)) == 2 else math.nan


def _ece(y: np.ndarray, p: np.ndarray, n_bins: int) -> float:
    from .reward import expected_calibration_error

    return expected_calibration_error(y, p, n_bins)


def _binary_metrics(y: Sequence[int], p: Sequence[float], n_bins: int = 10) -> dict[str, float]:
    """n, observed MET rate, mean P(MET), calibration gap (mean p - rate), accuracy, AUC, Brier, ECE."""
    y_arr = np.asarray(y, dtype=float)
    p_arr = np.asarray(p, dtype=float)
    n = int(y_arr.size)
    if n == 0:
        return {
            k: math.nan
            for k in ("met_rate", "mean_p", "calibration_gap", "accuracy", "auc", "brier", "ece")
        } | {"n": 0}
    met_rate = float(y_arr.mean())
    mean_p = float(p_arr.mean())
    return {
        "n": n,
        "met_rate": met_rate,
        "mean_p": mean_p,
        "calibration_gap": mean_p - met_rate,
        "accuracy": float(((p_arr >= 0.5).astype(float) == y_arr).mean()),
        "auc": _auc(y_arr.astype(int), p_arr),
        "brier": float(np.mean((p_arr - y_arr) ** 2)),
        "ece": _ece(y_arr, p_arr, n_bins),
    }


def _corr(x: np.ndarray, y: np.ndarray) -> tuple[float, float, float, float]:
    """Spearman rho, its p, Pearson r, its p; NaN when fewer than 3 points or a constant side."""
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    ok = ~(np.isnan(x) | np.isnan(y))
    x, y = x[ok], y[ok]
    if x.size < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return (math.nan, math.nan, math.nan, math.nan)
    s = stats.spearmanr(x, y)
    r = stats.pearsonr(x, y)
    return (float(s.statistic), float(s.pvalue), float(r.statistic), float(r.pvalue))


def prediction_column(reward_source: str) -> str:
    """Column of `reward/predictions_<protocol>.parquet` holding the RL reward model's P(MET)."""
    cols = {"encoder": "p_encoder", "tfidf": "p_tfidf"}
    if reward_source not in cols:
        raise RiskError(f"reward_source {reward_source!r}; expected one of {sorted(cols)}")
    return cols[reward_source]


# ---------------------------------------------------------------------------------------------
# 1. backward-looking bias: drift by test year
# ---------------------------------------------------------------------------------------------


def drift_by_year(
    pred: pd.DataFrame, p_col: str, year_col: str = "test_year", n_bins: int = 10
) -> pd.DataFrame:
    """Quality of one model's P(MET) per test year: n, MET rate, mean P(MET), accuracy, AUC, Brier.

    AUC is NaN in a year with one class. `majority_accuracy` is the accuracy of always predicting
    the training majority class (from `p_majority` when the table has it), the bar any year's
    accuracy should clear. Rows without a year are dropped.
    """
    _require_columns(pred, [year_col, "y", p_col], "predictions table")
    d = pred[pred[year_col].notna()]
    rows = []
    for year, g in d.groupby(year_col, sort=True):
        m = _binary_metrics(g["y"].astype(int), g[p_col].astype(float), n_bins)
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
    labelled: pd.DataFrame, cutoff: int | None = None, year_col: str = "test_year"
) -> pd.DataFrame:
    """MET base rate (with its Wilson 95% interval) per test year over all labelled conditions.

    With `cutoff`, a `side` column says whether the year is on the training side (<= cutoff) or
    the test side of the temporal protocol.
    """
    from .data import rate_by

    _require_columns(labelled, [year_col, "y"], "labelled conditions")
    d = labelled[labelled[year_col].notna()].copy()
    d[year_col] = d[year_col].astype(int)
    d["y"] = d["y"].astype(int)
    out = rate_by(d, year_col).rename(columns={year_col: "test_year"})
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


def plot_drift(drift: pd.DataFrame, base: pd.DataFrame, cutoff: int, model: str) -> Any:
    """Left: MET base rate per year (all data) with the test years' mean P(MET); right: quality per test year."""
    import matplotlib.pyplot as plt

    from .plots import PALETTE, WIDTH, setup_style

    setup_style()
    fig, axes = plt.subplots(1, 2, figsize=(WIDTH, 2.9), gridspec_kw={"width_ratios": [1.6, 1]})
    ax = axes[0]
    x = base["test_year"].astype(int)
    ax.fill_between(x, base["ci_low"], base["ci_high"], color=PALETTE["MET"], alpha=0.18)
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


# ---------------------------------------------------------------------------------------------
# 2. group bias: regions, arrangement types, economic areas; country swap
# ---------------------------------------------------------------------------------------------


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
) -> pd.DataFrame:
    """Accuracy, AUC, mean P(MET) vs MET rate (calibration gap), ECE per group; small groups pooled.

    Groups with fewer than `min_group_size` rows are pooled into `other` (column `pooled` lists
    what went in). Rows are sorted by size, `other` last.
    """
    y_arr = np.asarray(y, dtype=int)
    p_arr = np.asarray(p, dtype=float)
    raw = pd.Series(list(groups), dtype=object).astype(str)
    if not (len(y_arr) == len(p_arr) == len(raw)):
        raise RiskError(
            f"lengths differ: {len(y_arr)} labels, {len(p_arr)} scores, {len(raw)} groups"
        )
    pooled = pool_small_groups(raw, min_group_size, other)
    rows = []
    for name in pd.unique(pooled):
        m = (pooled == name).to_numpy()
        members = sorted(set(raw[m])) if name == other else [name]
        rows.append(
            {
                "group": name,
                **_binary_metrics(y_arr[m], p_arr[m], n_bins),
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
) -> pd.DataFrame:
    """`group_metrics` by region, arrangement type and economic area, stacked (column `dimension`)."""
    _require_columns(
        pred, ["country", "arrangement_type", "econ_descriptor", "y", p_col], "predictions table"
    )
    dims = {
        "region": assign_regions(pred["country"], regions, regions_path).to_numpy(),
        "arrangement_type": pred["arrangement_type"].astype(str).to_numpy(),
        "econ_area": pred["econ_descriptor"].map(econ_area).to_numpy(),
    }
    parts = [
        group_metrics(pred["y"], pred[p_col], g, min_group_size, n_bins).assign(dimension=dim)
        for dim, g in dims.items()
    ]
    out = pd.concat(parts, ignore_index=True)
    return out[["dimension", *[c for c in out.columns if c != "dimension"]]]


def group_bias_summary(table: pd.DataFrame, overall: Mapping[str, float]) -> dict[str, Any]:
    """Per dimension: the groups with the lowest and highest accuracy and the largest |calibration gap|."""
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
    return out


def plot_group_bias(table: pd.DataFrame) -> Any:
    """Per dimension: observed MET rate and mean predicted P(MET) per group, accuracy marked."""
    import matplotlib.pyplot as plt

    from .plots import PALETTE, WIDTH, setup_style

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


def choose_swap_countries(countries: Iterable[str], k: int, seed: int) -> list[str]:
    """`k` distinct countries drawn (seeded) from the sorted unique `countries`, in sorted order."""
    pool = sorted({str(c) for c in countries})
    if len(pool) < 2:
        raise RiskError(f"the country-swap test needs at least 2 countries; got {pool}")
    k = min(k, len(pool))
    rng = np.random.default_rng(seed)
    return sorted(rng.choice(np.array(pool, dtype=object), size=k, replace=False).tolist())


ScoreFn = Callable[[list[dict[str, Any]], list[str]], np.ndarray]


def country_swap(
    score_fn: ScoreFn,
    contexts: pd.DataFrame,
    texts: Sequence[str],
    swap_countries: Sequence[str],
    source: str = "historical",
) -> pd.DataFrame:
    """Reward of each text under its own context and with only the country replaced.

    One row per (item, swapped-in country other than its own): `p_orig`, `p_swap` and
    `delta = p_swap - p_orig`. A reward that ignores the country gives delta 0 everywhere; one
    that reads only the country gives `score(country) - score(own country)`. All pairs are
    scored in one call of `score_fn(contexts, texts)`.
    """
    _require_columns(contexts, CONTEXT_FIELDS, "swap contexts")
    texts = [str(t) for t in texts]
    if len(contexts) != len(texts):
        raise RiskError(f"{len(contexts)} contexts but {len(texts)} texts in the country swap")
    base = contexts[list(CONTEXT_FIELDS)].astype(str).to_dict("records")
    pair_ctx: list[dict[str, Any]] = []
    pair_txt: list[str] = []
    meta: list[tuple[int, str]] = []
    for i, (ctx, t) in enumerate(zip(base, texts, strict=True)):
        pair_ctx.append(ctx)
        pair_txt.append(t)
        meta.append((i, ""))
        for c in swap_countries:
            if c == ctx["country"]:
                continue
            pair_ctx.append({**ctx, "country": c})
            pair_txt.append(t)
            meta.append((i, c))
    scores = np.asarray(score_fn(pair_ctx, pair_txt), dtype=float) if pair_ctx else np.array([])
    if scores.shape != (len(pair_ctx),):
        raise RiskError(f"score_fn returned shape {scores.shape}; expected ({len(pair_ctx)},)")
    orig = {i: s for (i, c), s in zip(meta, scores, strict=True) if c == ""}
    rows = [
        {
            "source": source,
            "item": i,
            "country": base[i]["country"],
            "arrangement_type": base[i]["arrangement_type"],
            "econ_descriptor": base[i]["econ_descriptor"],
            "swap_country": c,
            "p_orig": orig[i],
            "p_swap": float(s),
            "delta": float(s) - orig[i],
        }
        for (i, c), s in zip(meta, scores, strict=True)
        if c != ""
    ]
    cols = [
        "source",
        "item",
        "country",
        "arrangement_type",
        "econ_descriptor",
        "swap_country",
        "p_orig",
        "p_swap",
        "delta",
    ]
    return pd.DataFrame(rows, columns=cols)


def swap_summary(
    swaps: pd.DataFrame, country_met_rate: Mapping[str, float] | None = None
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(per source: mean |delta|, max |delta|, spread of the original rewards; per swapped-in country).

    Per country: mean deviation from the original reward when that country is swapped in (> 0:
    the reward favours it), mean |delta| and n; with `country_met_rate`, the country's historical
    MET rate beside it. Per source: `orig_sd` is the standard deviation of the original rewards
    across texts, the scale a country effect should be judged against.
    """
    rows = []
    for src, g in swaps.groupby("source", sort=False):
        orig = g.drop_duplicates("item")["p_orig"]
        rows.append(
            {
                "source": src,
                "n_texts": int(g["item"].nunique()),
                "n_pairs": len(g),
                "mean_abs_delta": float(g["delta"].abs().mean()),
                "max_abs_delta": float(g["delta"].abs().max()),
                "mean_delta": float(g["delta"].mean()),
                "orig_sd": float(orig.std(ddof=1)) if len(orig) > 1 else math.nan,
            }
        )
    overall = pd.DataFrame(rows)
    per = (
        swaps.groupby("swap_country", sort=True)["delta"]
        .agg(n="size", mean_delta="mean", mean_abs_delta=lambda d: d.abs().mean())
        .reset_index()
        .rename(columns={"swap_country": "country"})
    )
    if country_met_rate is not None:
        per["hist_met_rate"] = per["country"].map(dict(country_met_rate)).astype(float)
    return overall, per.sort_values("mean_delta", ascending=False).reset_index(drop=True)


def plot_swap(per_country: pd.DataFrame) -> Any:
    """Bar per swapped-in country: mean change of the reward when only the country is replaced."""
    import matplotlib.pyplot as plt

    from .plots import PALETTE, WIDTH, setup_style

    setup_style()
    g = per_country.sort_values("mean_delta")
    fig, ax = plt.subplots(figsize=(WIDTH, 0.28 * len(g) + 1.0))
    colors = [PALETTE["MET"] if v >= 0 else PALETTE["Non-MET"] for v in g["mean_delta"]]
    has_rate = "hist_met_rate" in g
    labels = [
        f"{r.country.title()} ({r.hist_met_rate:.2f})"
        if has_rate and not pd.isna(r.hist_met_rate)
        else r.country.title()
        for r in g.itertuples()
    ]
    ax.barh(np.arange(len(g)), g["mean_delta"], color=colors)
    ax.set_yticks(np.arange(len(g)), labels, fontsize=7.5)
    ax.axvline(0, color="black", lw=0.8)
    ax.set_xlabel("mean change of the reward, P(MET), when this country is swapped in")
    title = "Country swap: same condition text, only the country changed"
    if has_rate:
        title += "\n(in brackets: the country's MET rate in the reward's training data)"
    ax.set_title(title)
    ax.grid(axis="y", visible=False)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------------
# 3. reward hacking
# ---------------------------------------------------------------------------------------------


def generated_policies(policies: Iterable[str]) -> list[str]:
    """Policies that generated their responses: not `history*`, not `random_policy` (order kept)."""
    return [
        p
        for p in dict.fromkeys(str(x) for x in policies)
        if not p.startswith(HISTORY_PREFIX) and p not in NON_GENERATED
    ]


def policy_kind(policy: str, reference: str | None = None) -> str:
    """'reference', 'history', 'random' or 'generated': how a notebook-04 policy made its texts."""
    if policy == reference:
        return "reference"
    if policy.startswith(HISTORY_PREFIX):
        return "history"
    if policy in NON_GENERATED:
        return "random"
    return "generated"


def _start_policy(run: Any) -> str:
    """The policy RL started from, as notebook 04 recorded it (older runs: 'base')."""
    if run.exists("eval/summary.json"):
        return str(run.read_json("eval/summary.json").get("start_policy", "base"))
    return "base"


def tuned_policies(policies: Iterable[str]) -> list[str]:
    """Generated policies changed by RL (not `base`, not `best_of_n`)."""
    return [p for p in generated_policies(policies) if p not in UNTUNED]


def length_reward(
    samples: pd.DataFrame,
    length_col: str = "n_tokens",
    reward_col: str = "reward",
    bins: int = 5,
    policy_col: str = "policy",
    pooled_name: str = "all generated",
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(correlations, binned means) of reward against response length, per policy and pooled.

    Correlations: Spearman rho and Pearson r with p-values (NaN below 3 points or for a constant
    side). Bins: `bins` quantile bins of length within each group (fewer when lengths tie), with
    n, mean length, mean reward (and mean audit reward when the table has `audit_reward`).
    """
    _require_columns(samples, [policy_col, length_col, reward_col], "samples table")
    groups: list[tuple[str, pd.DataFrame]] = [
        (str(p), g) for p, g in samples.groupby(policy_col, sort=False)
    ]
    if samples[policy_col].nunique() > 1:
        groups.append((pooled_name, samples))
    crows, brows = [], []
    for name, g in groups:
        x = g[length_col].astype(float).to_numpy()
        r = g[reward_col].astype(float).to_numpy()
        rho, p_rho, pr, p_pr = _corr(x, r)
        crows.append(
            {
                "policy": name,
                "n": len(g),
                "mean_length": float(np.mean(x)) if len(x) else math.nan,
                "spearman": rho,
                "spearman_p": p_rho,
                "pearson": pr,
                "pearson_p": p_pr,
            }
        )
        if len(g) == 0:
            continue
        lengths = g[length_col].astype(float)
        if lengths.nunique() > 1:
            codes = pd.qcut(lengths, q=bins, duplicates="drop")
        else:  # one length only (e.g. every response hit max_new_tokens): a single bin
            codes = pd.Series(pd.Interval(lengths.iloc[0], lengths.iloc[0], "both"), index=g.index)
        agg: dict[str, Any] = {
            "n": (reward_col, "size"),
            "mean_length": (length_col, "mean"),
            "mean_reward": (reward_col, "mean"),
        }
        if "audit_reward" in g:
            agg["mean_audit_reward"] = ("audit_reward", "mean")
        b = g.assign(_bin=codes).groupby("_bin", observed=True, sort=True).agg(**agg).reset_index()
        b["bin"] = [f"{iv.left:.0f}-{iv.right:.0f}" for iv in b["_bin"]]
        b.insert(0, "policy", name)
        brows.append(b.drop(columns="_bin"))
    binned = pd.concat(brows, ignore_index=True) if brows else pd.DataFrame()
    if len(binned):
        binned = binned[
            ["policy", "bin", *[c for c in binned.columns if c not in ("policy", "bin")]]
        ]
    return pd.DataFrame(crows), binned


def plot_length_reward(
    samples: pd.DataFrame, binned: pd.DataFrame, length_col: str = "n_tokens"
) -> Any:
    """Reward against response length: one dot per response, binned means per policy as lines."""
    import matplotlib.pyplot as plt

    from .plots import WIDTH, setup_style

    setup_style()
    fig, ax = plt.subplots(figsize=(WIDTH, 3.0))
    for i, (pol, g) in enumerate(samples.groupby("policy", sort=False)):
        color = f"C{i}"
        ax.scatter(g[length_col], g["reward"], s=8, alpha=0.35, color=color)
        b = binned[binned["policy"] == pol]
        ax.plot(b["mean_length"], b["mean_reward"], marker="o", color=color, label=str(pol))
    ax.set(xlabel=f"response length ({length_col.replace('_', ' ')})", ylabel="reward, P(MET)")
    ax.set_title("Reward against response length (dots: responses; lines: quantile-bin means)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def checkpoint_gains(frontier: pd.DataFrame, base: str = "base") -> pd.DataFrame:
    """Training-reward and audit-reward gain over the start for every checkpoint of every algorithm.

    `gap = reward_gain - audit_gain`: a gap that widens with training means the policy learns
    what the training reward likes but an independent reward model does not (reward hacking).
    The start of an algorithm is its own step-0 row; else the shared start (the `base` row at
    step 0, as notebook 04 writes it); else its earliest checkpoint (`baseline` says which).
    Rows repeated for one (algo, step) are averaged. The `base` rows themselves are not listed.
    """
    _require_columns(frontier, ["algo", "step", "reward", "audit_reward"], "frontier table")
    cols = [c for c in ("reward", "audit_reward", "kl") if c in frontier.columns]
    f = frontier.assign(step=frontier["step"].astype(int))
    f = f.groupby(["algo", "step"], sort=False)[cols].mean().reset_index()
    shared = f[(f["algo"] == base) & (f["step"] == 0)]
    parts = []
    for algo, g in f.groupby("algo", sort=False):
        if algo == base:
            continue
        g = g.sort_values("step", kind="stable").reset_index(drop=True)
        if (g["step"] == 0).any():
            b, how = g[g["step"] == 0].iloc[0], f"{algo} step 0"
        elif len(shared):
            b, how = shared.iloc[0], f"{base} step 0"
            g = pd.concat([shared.assign(algo=algo), g], ignore_index=True)
        else:
            b, how = g.iloc[0], f"{algo} step {int(g['step'].iloc[0])}"
        out = pd.DataFrame(
            {
                "algo": algo,
                "step": g["step"].astype(int),
                "baseline": how,
                "reward": g["reward"].astype(float),
                "audit_reward": g["audit_reward"].astype(float),
                "reward_gain": g["reward"].astype(float) - float(b["reward"]),
                "audit_gain": g["audit_reward"].astype(float) - float(b["audit_reward"]),
            }
        )
        out["gap"] = out["reward_gain"] - out["audit_gain"]
        if "kl" in g:
            out["kl"] = g["kl"].astype(float).to_numpy()
        parts.append(out)
    cols_out = [
        "algo",
        "step",
        "baseline",
        "reward",
        "audit_reward",
        "reward_gain",
        "audit_gain",
        "gap",
    ]
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=cols_out)


def plot_gains(gains: pd.DataFrame) -> Any:
    """Training-reward gain and audit-reward gain against training step, one colour per algorithm."""
    import matplotlib.pyplot as plt

    from .plots import WIDTH, setup_style

    setup_style()
    fig, ax = plt.subplots(figsize=(WIDTH, 2.8))
    for i, (algo, g) in enumerate(gains.groupby("algo", sort=False)):
        ax.plot(
            g["step"], g["reward_gain"], marker="o", color=f"C{i}", label=f"{algo}: training reward"
        )
        ax.plot(
            g["step"],
            g["audit_gain"],
            marker="s",
            ls="--",
            color=f"C{i}",
            label=f"{algo}: audit reward",
        )
    ax.axhline(0, color="black", lw=0.8)
    ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
    ax.set(xlabel="training step", ylabel="gain over the start")
    ax.set_title("Does the audit reward follow the training reward?")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


_WORD = re.compile(r"[a-z0-9]+(?:['-][a-z0-9]+)*")


def word_tokens(text: str) -> list[str]:
    """Lower-case words without punctuation: 'Reform (tax)' -> ['reform', 'tax'] (n-gram reading aid)."""
    return _WORD.findall(str(text).lower())


def _ngram_presence(texts: Iterable[str], n: int) -> tuple[Counter[str], int]:
    """How many texts contain each n-gram (counted once per text), and the number of texts."""
    counts: Counter[str] = Counter()
    k = 0
    for t in texts:
        toks = word_tokens(t)
        counts.update({" ".join(toks[i : i + n]) for i in range(len(toks) - n + 1)})
        k += 1
    return counts, k


def rising_ngrams(
    samples: pd.DataFrame,
    base: str = "base",
    policies: Sequence[str] | None = None,
    n: int = 2,
    top: int = 15,
    text_col: str = "response",
) -> pd.DataFrame:
    """The `top` n-grams whose share of responses rose most from `base` to each policy.

    Share = fraction of a policy's responses containing the n-gram at least once; words are
    lower-case with punctuation dropped (`word_tokens`), so 'reform,' and 'reform' count as one.
    Only rises > 0 are listed; ties: more responses first, then alphabetical.
    """
    _require_columns(samples, ["policy", text_col], "samples table")
    if base not in set(samples["policy"]):
        raise RiskError(
            f"samples table has no '{base}' policy; found {sorted(set(samples['policy']))}"
        )
    policies = tuned_policies(samples["policy"]) if policies is None else list(policies)
    b_counts, b_n = _ngram_presence(samples.loc[samples["policy"] == base, text_col], n)
    rows = []
    for pol in policies:
        p_counts, p_n = _ngram_presence(samples.loc[samples["policy"] == pol, text_col], n)
        if p_n == 0:
            continue
        cand = []
        for g, c in p_counts.items():
            share_p = c / p_n
            share_b = b_counts.get(g, 0) / b_n if b_n else 0.0
            if share_p - share_b > 0:
                cand.append((-(share_p - share_b), -c, g, share_b, share_p, c))
        for neg, _, g, sb, sp, c in sorted(cand)[:top]:
            rows.append(
                {
                    "policy": pol,
                    "ngram": g,
                    "share_base": sb,
                    "share_policy": sp,
                    "rise": -neg,
                    "responses_with": c,
                }
            )
    cols = ["policy", "ngram", "share_base", "share_policy", "rise", "responses_with"]
    return pd.DataFrame(rows, columns=cols)


# ---------------------------------------------------------------------------------------------
# 4. diversity collapse
# ---------------------------------------------------------------------------------------------


def within_prompt_diversity(
    samples: pd.DataFrame, n: int = 2, text_col: str = "response"
) -> pd.DataFrame:
    """Per policy: mean over prompts of distinct-n among that prompt's samples (prompts with >= 2 samples).

    Distinct-2 of the pooled samples of one prompt is 1 when no bigram repeats across (or within)
    them and falls as the samples of a prompt converge on one answer; averaging over prompts keeps
    between-prompt variety (different contexts) out of it.
    """
    _require_columns(samples, ["policy", "prompt_id", text_col], "samples table")
    rows = []
    for pol, g in samples.groupby("policy", sort=False):
        vals = [
            distinct_n(gp[text_col].astype(str).tolist(), n)
            for _, gp in g.groupby("prompt_id", sort=True)
            if len(gp) >= 2
        ]
        vals = [v for v in vals if not math.isnan(v)]
        rows.append(
            {
                "policy": pol,
                "n_prompts_multi": len(vals),
                f"within_prompt_distinct_{n}": float(np.mean(vals)) if vals else math.nan,
            }
        )
    return pd.DataFrame(rows)


def area_table(
    samples: pd.DataFrame,
    reference: pd.Series | Sequence[str],
    reference_name: str = "history",
    area_col: str = "top_area",
    requested_col: str | None = "econ_area",
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(per-policy diversity of economic areas, area shares per policy) against a reference.

    Per policy: n, areas used, entropy of its area shares (nats), KL(policy || reference) in
    nats (`evaluation.kl_divergence` on add-half smoothed counts: half a response added to every
    area of both sides, so an area the reference never shows costs a finite amount that shrinks
    as the samples grow, instead of one set by an arbitrary epsilon), coverage (share of the
    reference's areas the policy produces at all) and, with `requested_col`, `on_topic` (share
    of responses whose assigned area is the one the prompt asked for). The reference itself is
    the first row. Entropy grows with the number of responses, so compare policies with equal n.
    """
    _require_columns(samples, ["policy", area_col], "samples table")
    ref = pd.Series(list(reference), dtype=object).astype(str)
    if ref.empty:
        raise RiskError(f"the {reference_name} reference has no areas")
    cats = sorted(set(ref) | set(samples[area_col].astype(str)))
    q = area_distribution(ref, cats)
    q_smooth = _add_half(ref, cats)
    ref_areas = set(ref)
    rows = [
        {
            "policy": reference_name,
            "n": len(ref),
            "n_areas": len(ref_areas),
            "entropy": entropy(q),
            "kl_to_reference": 0.0,
            "coverage": 1.0,
            "on_topic": math.nan,
        }
    ]
    shares = {reference_name: q}
    for pol, g in samples.groupby("policy", sort=False):
        a = g[area_col].astype(str)
        p = area_distribution(a, cats)
        shares[str(pol)] = p
        rows.append(
            {
                "policy": str(pol),
                "n": len(a),
                "n_areas": int(a.nunique()),
                "entropy": entropy(p),
                "kl_to_reference": kl_divergence(_add_half(a, cats), q_smooth, eps=0.0),
                "coverage": len(set(a) & ref_areas) / len(ref_areas),
                "on_topic": float((a == g[requested_col].astype(str)).mean())
                if requested_col and requested_col in g
                else math.nan,
            }
        )
    return pd.DataFrame(rows), pd.DataFrame(shares).rename_axis("area").reset_index()


def _add_half(labels: Iterable[str], categories: Sequence[str]) -> pd.Series:
    """Shares over `categories` after adding half a count to each (Jeffreys smoothing)."""
    counts = pd.Series(Counter(str(x) for x in labels), dtype=float).reindex(
        list(categories), fill_value=0.0
    )
    return (counts + 0.5) / (counts.sum() + 0.5 * len(categories))


def plot_areas(shares: pd.DataFrame, top: int = 8) -> Any:
    """Stacked bars: share of each economic area per policy (the `top` areas overall, rest 'other')."""
    import matplotlib.pyplot as plt

    from .plots import WIDTH, setup_style

    setup_style()
    s = shares.set_index("area")
    order = s.mean(axis=1).sort_values(ascending=False).index
    keep = list(order[:top])
    plot = s.loc[keep].copy()
    rest = s.drop(index=keep).sum(axis=0)
    if len(s) > top:
        plot.loc["other areas"] = rest
    fig, ax = plt.subplots(figsize=(WIDTH, 0.32 * s.shape[1] + 1.6))
    left = np.zeros(s.shape[1])
    cmap = plt.get_cmap("tab10")
    for i, (area, row) in enumerate(plot.iterrows()):
        label = area if len(area) <= 40 else area[:37] + "..."
        ax.barh(np.arange(s.shape[1]), row.to_numpy(), left=left, color=cmap(i % 10), label=label)
        left += row.to_numpy()
    ax.set_yticks(np.arange(s.shape[1]), list(s.columns))
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.set_xlabel("share of responses (area of the nearest historical conditions)")
    ax.set_title("Economic areas of the responses")
    ax.legend(fontsize=6.5, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncols=2)
    ax.grid(axis="y", visible=False)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------------
# 5. label-mapping sensitivity
# ---------------------------------------------------------------------------------------------


def relabel(
    conditions: pd.DataFrame, variant: str, not_assessed: Iterable[str] = NOT_ASSESSED
) -> pd.DataFrame:
    """Conditions labelled under one of `LABEL_VARIANTS`: `y` = 1 for its MET statuses, else 0.

    Rows whose status is not assessed yet are dropped under every variant, and the variant's
    `exclude` statuses too. Statuses are compared after `data.normalise_status`.
    """
    from .data import normalise_status

    if variant not in LABEL_VARIANTS:
        raise RiskError(
            f"unknown label variant {variant!r}; expected one of {list(LABEL_VARIANTS)}"
        )
    _require_columns(conditions, ["status"], "conditions table")
    spec = LABEL_VARIANTS[variant]
    status = conditions["status"].map(normalise_status)
    drop = {normalise_status(s) for s in (*not_assessed, *spec["exclude"])}
    keep = ~status.isin(drop)
    out = conditions.loc[keep].copy()
    out["y"] = status[keep].isin({normalise_status(s) for s in spec["met"]}).astype(int)
    out["label"] = np.where(out["y"] == 1, "MET", "Non-MET")
    return out.reset_index(drop=True)


def label_sensitivity(
    labelled: pd.DataFrame,
    split: Mapping[str, Sequence[int]],
    variants: Sequence[str],
    reward_cfg: Any,
    seed: int,
    reference: str = "paper",
    not_assessed: Iterable[str] = NOT_ASSESSED,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Retrain the TF-IDF + LR reward on one split under each label variant; compare.

    Returns (per-variant table, scores on the common test rows). Per variant: train/test rows,
    MET shares, train and test labels changed vs the reference variant, rows the variant drops
    (beyond the not-assessed ones), test accuracy, AUC, Brier and majority-class accuracy on its
    own test rows, and the Spearman correlation of its scores with the reference variant's on
    the test rows every variant keeps. Each model is `reward.train_tfidf` with the reward
    config, temperature-scaled on the split's validation rows under the same variant.
    """
    from .prompts import serialize_frame
    from .reward import train_tfidf

    if reference not in variants:
        reference = variants[0]
    by_id = labelled.set_index("row_id", drop=False)
    parts = {k: [i for i in split[k] if i in by_id.index] for k in ("train", "val", "test")}
    rows_used = by_id.loc[[i for k in ("train", "val", "test") for i in parts[k]]]
    # the rows every variant starts from (not-assessed ones out): the base for "rows dropped"
    assessed = set(relabel(rows_used, "paper", not_assessed)["row_id"])
    split_ids = {k: [i for i in parts[k] if i in assessed] for k in parts}
    relabelled = {v: relabel(rows_used, v, not_assessed) for v in variants}
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
        m = _binary_metrics(te["y"].to_numpy(), p_te, reward_cfg.ece_bins)
        maj = int(tr["y"].mean() >= 0.5)
        scores[v] = model.score_texts(x_common)
        rows.append(
            {
                "variant": v,
                "met_statuses": "+".join(LABEL_VARIANTS[v]["met"]),
                "excluded_statuses": "+".join(LABEL_VARIANTS[v]["exclude"]) or "-",
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
    table["spearman_vs_reference"] = [
        _corr(sc[reference].to_numpy(), sc[v].to_numpy())[0] if v != reference else 1.0
        for v in variants
    ]
    table["reference"] = reference
    return table, sc


def plot_label_variants(scores: pd.DataFrame, table: pd.DataFrame) -> Any:
    """Each variant's P(MET) against the reference variant's on the common test rows."""
    import matplotlib.pyplot as plt

    from .plots import WIDTH, setup_style

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


# ---------------------------------------------------------------------------------------------
# prose: sentences chosen from the results (shared by notebook 05 and the report)
# ---------------------------------------------------------------------------------------------


def direction(
    a: Any,
    b: Any,
    tol: float = 0.005,
    up: str = "rises",
    down: str = "falls",
    flat: str = "stays roughly flat",
) -> str:
    """The verb for a change from a to b: `up`, `down` or `flat` within `tol`."""
    if not (_ok(a) and _ok(b)):
        return "cannot be compared"
    return up if b > a + tol else down if b < a - tol else flat


@dataclass
class Finding:
    """One section's interpretation: a lead sentence and item sentences (or a note why absent)."""

    lead: str
    items: list[str] = field(default_factory=list)
    note: str | None = None

    def markdown(self) -> str:
        """For the notebook: the lead, then the items as a bullet list; a note as a warning."""
        if self.note:
            return f"> ⚠ {self.note}"
        return "\n\n".join(x for x in (self.lead, "\n".join(f"- {i}" for i in self.items)) if x)

    def paragraph(self) -> str:
        """For the report: one paragraph (lead and items as running sentences)."""
        if self.note:
            return f"Not measured in this run: {self.note}."
        return " ".join(x for x in (self.lead, *self.items) if x)


def drift_text(d: Mapping[str, Any] | None, note: str | None = None) -> Finding:
    """Label shift and the temporal model's accuracy path, in words chosen from the numbers."""
    if d is None or "n_test" not in d:
        return Finding("", note=note or "no temporal-protocol predictions to score by year")
    shift = d["met_rate_test_years"] - d["met_rate_train_years"]
    bias = d["mean_p_test"] - d["observed_met_test"]
    verb = "overstates" if bias > 0.005 else "understates" if bias < -0.005 else "matches"
    lead = (
        f"Conditions tested up to {d['cutoff']} were MET {_pct(d['met_rate_train_years'])} of the "
        f"time and those tested later {_pct(d['met_rate_test_years'])}: the base rate "
        f"{direction(d['met_rate_train_years'], d['met_rate_test_years'], up='rose', down='fell', flat='barely moved')}"
        f" by {abs(100 * shift):.1f} percentage points after the cut-off. Over the {d['n_test']} "
        f"later conditions the model trained up to {d['cutoff']} predicts P(MET) = "
        f"{_pct(d['mean_p_test'])} on average against an observed {_pct(d['observed_met_test'])}: it "
        f"{verb} the later MET rate"
        + (f" by {abs(100 * bias):.1f} points." if verb != "matches" else ".")
    )
    items = [
        f"Its accuracy {direction(d['accuracy_first_year'], d['accuracy_last_year'])} from "
        f"{_pct(d['accuracy_first_year'])} in {d['first_year']} to {_pct(d['accuracy_last_year'])} "
        f"in {d['last_year']} ({_num(100 * d['accuracy_slope_per_year'], 1)} points a year by a "
        "linear fit)."
    ]
    if "years_beating_majority" in d:
        tie = d.get("years_tying_majority", 0)
        items.append(
            f"It beats the always-the-training-majority rule in {d['years_beating_majority']} of "
            f"{len(d['test_years'])} test years" + (f" and ties it in {tie}." if tie else ".")
        )
    return Finding(lead, items)


_DIM_LABELS = {
    "region": "region",
    "arrangement_type": "arrangement type",
    "econ_area": "economic area",
}


def group_text(g: Mapping[str, Any], min_group_size: int | None = None) -> Finding:
    """Spread of accuracy and the worst calibration gap per grouping."""
    o = g["overall"]
    lead = (
        f"Overall, on {o['n']} test conditions, the reward model's accuracy is {_pct(o['accuracy'])}, "
        f"its AUC {_num(o['auc'])} and its mean P(MET) {_pct(o['mean_p'])} against an observed "
        f"{_pct(o['met_rate'])}."
    )
    items = []
    for dim, label in _DIM_LABELS.items():
        s = g.get(dim)
        if s is None:
            continue
        if s["n_groups"] < 2:
            size = f" of at least {min_group_size} conditions" if min_group_size else ""
            items.append(f"By {label}: one group only{size}, nothing to compare.")
            continue
        items.append(
            f"By {label} ({s['n_groups']} groups), accuracy ranges from {_pct(s['accuracy_min'])} "
            f"({s['accuracy_min_group']}, n = {s['accuracy_min_n']}) to {_pct(s['accuracy_max'])} "
            f"({s['accuracy_max_group']}, n = {s['accuracy_max_n']}); the largest calibration gap is "
            f"for {s['max_abs_gap_group']} (n = {s['max_abs_gap_n']}), where the model "
            f"{'over' if s['max_abs_gap_signed'] > 0 else 'under'}states the MET rate by "
            f"{100 * s['max_abs_gap']:.1f} points."
        )
    return Finding(lead, items)


def swap_text(cs: Mapping[str, Any]) -> Finding:
    """How far the reward moves when only the country changes, and whom it favours."""
    items = []
    for r in cs["by_source"]:
        sd = r.get("orig_sd")
        ratio = r["mean_abs_delta"] / sd if _ok(sd) and sd > 0 else None
        scale = ""
        if ratio is not None:
            how = "more than" if ratio > 1 else "about as much as" if ratio > 0.5 else "less than"
            scale = (
                f", {_num(ratio, 2)} times the standard deviation of these texts' own rewards "
                f"({_num(sd, 4)}): swapping the country moves the reward {how} the typical "
                "difference between two texts"
            )
        items.append(
            f"For {r['source']} texts ({r['n_texts']} texts, {r['n_pairs']} swaps) the reward "
            f"changes by {_num(r['mean_abs_delta'], 4)} on average (at most "
            f"{_num(r['max_abs_delta'], 4)}){scale}."
        )
    rho, k = cs.get("spearman_delta_vs_hist_met_rate"), len(cs["countries"])
    if not _ok(rho):
        fav = "Too few countries, or too little variation, to relate this to historical MET rates."
    elif rho == 0:
        fav = f"The favour is unrelated to the countries' historical MET rates (Spearman ρ = 0, {k} countries)."
    else:
        fav = (
            f"The reward favours countries with {'higher' if rho > 0 else 'lower'} historical MET "
            f"rates (Spearman ρ = {_num(rho, 2)} over {k} countries)."
        )
    items.append(
        f"Most favoured when swapped in: {cs['most_favoured'].title()} "
        f"({cs['most_favoured_delta']:+.4f}); least: {cs['least_favoured'].title()} "
        f"({cs['least_favoured_delta']:+.4f}). {fav}"
    )
    if not cs.get("generated_included"):
        items.append("Generated texts were not swapped (notebook 04's samples are missing).")
    return Finding("Changing only the country of a condition:", items)


def length_text(
    lr: Mapping[str, Any] | None, alpha: float = 0.05, note: str | None = None
) -> Finding:
    """Whether reward rises or falls with response length, per generated policy."""
    if lr is None:
        return Finding("", note=note or missing_note("eval/samples.parquet"))
    items = []
    for r in lr["by_policy"]:
        if not _ok(r["spearman"]):
            items.append(
                f"{r['policy']}: correlation undefined (constant length or reward, n = {r['n']})."
            )
            continue
        if r["spearman_p"] < alpha:
            verdict = f"reward {'rises' if r['spearman'] > 0 else 'falls'} with length"
        else:
            verdict = f"no association distinguishable from none at the {_pct(alpha, 0)} level"
        items.append(
            f"{r['policy']} (n = {r['n']}, mean {_num(r['mean_length'], 1)} words): {verdict} "
            f"(Spearman ρ = {_num(r['spearman'], 2)}, p = {_num(r['spearman_p'], 3)}; Pearson r = "
            f"{_num(r['pearson'], 2)})."
        )
    return Finding("Reward against response length, in words:", items)


def gains_text(cg: Sequence[Mapping[str, Any]] | None, note: str | None = None) -> Finding:
    """Whether the audit reward follows the training reward's gain at the last checkpoint."""
    if cg is None:
        return Finding("", note=note or missing_note("eval/frontier.parquet"))
    items = []
    for r in cg:
        if r["reward_gain"] <= 0:
            verdict = (
                "RL did not raise the training reward, so there is no gain for the audit to confirm"
            )
        elif r["audit_gain"] >= 0.5 * r["reward_gain"]:
            verdict = "the audit reward follows at least half of that gain"
        elif r["audit_gain"] > 0:
            verdict = (
                "the audit reward follows less than half of that gain: part of it is specific to "
                "the training reward"
            )
        else:
            verdict = (
                "the audit reward does not rise at all: the gain is specific to the training "
                "reward, a sign of reward hacking"
            )
        items.append(
            f"{r['algo']} at step {r['step']} (against {r['baseline']}): training reward "
            f"{r['reward_gain']:+.4f}, audit reward {r['audit_gain']:+.4f}; {verdict}."
        )
    return Finding("Gain over the start at the last checkpoint:", items)


def ngrams_text(ng: Mapping[str, Sequence[str]] | None, note: str | None = None) -> Finding:
    """The bigrams each tuned policy uses more than the base policy."""
    if ng is None:
        return Finding("", note=note or missing_note("eval/samples.parquet"))
    items = [
        f"{p}: " + (", ".join(f"“{b}”" for b in grams) if grams else "none rose") + "."
        for p, grams in ng.items()
    ]
    return Finding("Bigrams whose share of responses rose most from the base policy:", items)


def diversity_text(dv: Mapping[str, Any] | None, note: str | None = None) -> Finding:
    """Areas covered per generated policy against history, and how base -> tuned moved them."""
    if dv is None:
        return Finding("", note=note or missing_note("eval/samples.parquet"))
    rows = {r["policy"]: r for r in dv["by_policy"]}
    ref = rows[dv["reference"]]
    w = "within_prompt_distinct_2"
    lead = (
        f"The reference ({dv['reference']}, {ref['n']} conditions) spans {ref['n_areas']} areas "
        f"(entropy {_num(ref['entropy'], 2)} nats)."
    )
    items = [
        f"{p} ({r['n']} responses): {r['n_areas']} areas, entropy {_num(r['entropy'], 2)} nats, KL "
        f"to the reference {_num(r['kl_to_reference'], 2)} nats, {_pct(r['coverage'], 0)} of its "
        f"areas covered, {_pct(r['on_topic'], 0)} on the requested area; within-prompt distinct-2 "
        f"{_num(r.get(w), 3)}."
        for p, r in rows.items()
        if r.get("kind") == "generated"
    ]
    if "base" in rows:
        b = rows["base"]
        for p, r in rows.items():
            if r.get("kind") != "generated" or p in UNTUNED:
                continue
            items.append(
                f"From base to {p}, area entropy "
                f"{direction(b['entropy'], r['entropy'], 0.01)} ({_num(b['entropy'], 2)} → "
                f"{_num(r['entropy'], 2)} nats), KL to the reference "
                f"{direction(b['kl_to_reference'], r['kl_to_reference'], 0.01)} "
                f"({_num(b['kl_to_reference'], 2)} → {_num(r['kl_to_reference'], 2)}) and "
                f"within-prompt distinct-2 {direction(b.get(w), r.get(w))} ({_num(b.get(w), 3)} → "
                f"{_num(r.get(w), 3)})."
            )
    return Finding(lead, items)


def labels_text(records: Sequence[Mapping[str, Any]]) -> Finding:
    """How each label mapping changes labels, accuracy and the ranking of texts."""
    by = {r["variant"]: r for r in records}
    ref_name = records[0]["reference"]
    r0 = by[ref_name]
    items = []
    for r in records:
        if r["variant"] == ref_name:
            continue
        rho = r["spearman_vs_reference"]
        kept = (
            "n/a"
            if not _ok(rho)
            else "largely keeps the reference's ranking of texts"
            if rho >= 0.9
            else "changes the ranking of texts moderately"
            if rho >= 0.7
            else "ranks texts substantially differently"
        )
        items.append(
            f"{r['variant']} (MET = {r['met_statuses']}; dropped: {r['excluded_statuses']}): "
            f"{r['train_labels_changed']} training and {r['test_labels_changed']} test labels change "
            f"and {r['train_rows_dropped']} training and {r['test_rows_dropped']} test rows are "
            f"dropped; test MET share {_pct(r['met_share_test'])} ({ref_name}: "
            f"{_pct(r0['met_share_test'])}), accuracy {_pct(r['accuracy'])} ({ref_name}: "
            f"{_pct(r0['accuracy'])}; majority rule {_pct(r['majority_accuracy'])}), AUC "
            f"{_num(r['auc'])} ({ref_name}: {_num(r0['auc'])}); Spearman ρ with the {ref_name} "
            f"mapping's scores {_num(rho, 2)} on {r['n_common']} common test texts: it {kept}."
        )
    return Finding(
        f"The TF-IDF reward retrained under each mapping, against the {ref_name} mapping:", items
    )


def interpret(summary: Mapping[str, Any], alpha: float = 0.05) -> dict[str, Finding]:
    """Every section's `Finding` from `risk/summary.json` (or `RiskStage.summary`)."""
    notes = list(summary.get("notes", []))

    def note_for(artifact: str) -> str | None:
        return next((n for n in notes if artifact in n), None)

    return {
        "drift": drift_text(summary.get("drift"), note_for("predictions_temporal")),
        "group_bias": group_text(summary["group_bias"], summary.get("min_group_size")),
        "country_swap": swap_text(summary["country_swap"]),
        "length_reward": length_text(summary.get("length_reward"), alpha, note_for("samples")),
        "checkpoint_gains": gains_text(summary.get("checkpoint_gains"), note_for("frontier")),
        "rising_ngrams": ngrams_text(summary.get("rising_ngrams"), note_for("samples")),
        "diversity": diversity_text(summary.get("diversity"), note_for("samples")),
        "label_variants": labels_text(summary["label_variants"]),
    }


#: Tables the report includes (name in `_generated/` -> risk table and the columns kept).
REPORT_TABLES: dict[str, tuple[str, list[str] | None]] = {
    "risk_drift_by_year.md": ("risk_drift_by_year", None),
    "risk_group_bias.md": (
        "risk_group_bias",
        [
            "dimension",
            "group",
            "n",
            "met_rate",
            "mean_p",
            "calibration_gap",
            "accuracy",
            "auc",
            "ece",
        ],
    ),
    "risk_country_swap_by_country.md": ("risk_country_swap_by_country", None),
    "risk_length_reward.md": (
        "risk_length_reward",
        ["policy", "n", "mean_length", "spearman", "spearman_p", "pearson"],
    ),
    "risk_checkpoint_gains.md": ("risk_checkpoint_gains", None),
    "risk_area_diversity.md": ("risk_area_diversity", None),
    "risk_label_variants.md": (
        "risk_label_variants",
        [
            "variant",
            "met_statuses",
            "excluded_statuses",
            "n_train",
            "met_share_test",
            "accuracy",
            "auc",
            "spearman_vs_reference",
        ],
    ),
}


def report_content(run: Any, alpha: float = 0.05) -> tuple[dict[str, Any], dict[str, str]]:
    """(variables, includes) of the report's risk section, from notebook 05's artifacts.

    Variables: one paragraph per measure (`drift`, `group_bias`, `country_swap`,
    `length_reward`, `checkpoint_gains`, `rising_ngrams`, `diversity`, `label_variants`), each
    chosen from the numbers, plus a few headline numbers and `notes` (what was not measured).
    Includes: compact markdown tables `_generated/risk_*.md` (a table whose input was missing
    holds the note saying so).
    """
    from .artifacts import markdown_table

    stage = "notebook 05_risk_discussion"
    summary = run.read_json("risk/summary.json", stage)
    found = interpret(summary, alpha)
    variables: dict[str, Any] = {k: f.paragraph() for k, f in found.items()}
    notes = summary.get("notes", [])
    variables["notes"] = (
        "Every input was present." if not notes else "Not measured: " + "; ".join(notes) + "."
    )
    variables["reward_source"] = summary["reward_source"]
    variables["reward_protocol"] = summary["reward_protocol"]
    d = summary.get("drift") or {}
    variables["cutoff"] = str(d.get("cutoff", "n/a"))
    variables["met_rate_train_years"] = _pct(d.get("met_rate_train_years"))
    variables["met_rate_test_years"] = _pct(d.get("met_rate_test_years"))
    hist = next(
        (r for r in summary["country_swap"]["by_source"] if r["source"] == "historical"), {}
    )
    variables["swap_mean_abs_delta"] = _num(hist.get("mean_abs_delta"), 4)
    includes = {}
    for fname, (table, cols) in REPORT_TABLES.items():
        df = run.read_table(table, stage)
        if cols is not None and "note" not in df.columns:
            df = df[[c for c in cols if c in df.columns]]
        # identifiers read as words, and may wrap in a narrow PDF column ('arrangement type')
        text = [
            c for c in df.columns if df[c].dtype == object or pd.api.types.is_string_dtype(df[c])
        ]
        df = df.assign(**{c: df[c].astype(str).str.replace("_", " ") for c in text})
        df.columns = [str(c).replace("_", " ") for c in df.columns]
        includes[fname] = markdown_table(df)
    return variables, includes


# ---------------------------------------------------------------------------------------------
# the stage
# ---------------------------------------------------------------------------------------------


@dataclass
class RiskStage:
    """What notebook 05 computes: tables, headline numbers, notes on anything missing, figure paths."""

    tables: dict[str, pd.DataFrame]
    summary: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    figures: dict[str, Path] = field(default_factory=dict)


def _write_fig(run: Any, name: str, fig: Any, figures: dict[str, Path]) -> None:
    import matplotlib.pyplot as plt

    figures[name] = run.write_figure(name, fig)
    plt.close(fig)


def _json_records(df: pd.DataFrame) -> list[dict[str, Any]]:
    return df.to_dict("records")


def run_risk_stage(cfg: Any, run: Any, reward_model: Any | None = None) -> RiskStage:
    """Measure the five risks on a run dir and write `risk_*` tables, figures and `risk/summary.json`.

    `cfg` is a `StudyConfig`, `run` a `RunDir` holding notebooks 01-02's artifacts (04's are
    used when present). `reward_model` (anything with `score(contexts, texts, batch_size=)`)
    defaults to the one in `reward_model/`.
    """
    from .data import load_splits

    rc, rk = cfg.reward, cfg.risk
    seed = cfg.run.seed
    cutoff = cfg.data.splits.temporal_cutoff_year
    p_col = prediction_column(rc.reward_source)
    tables: dict[str, pd.DataFrame] = {}
    notes: list[str] = []
    figures: dict[str, Path] = {}
    summary: dict[str, Any] = {
        "reward_source": rc.reward_source,
        "reward_protocol": rc.reward_protocol,
        "prediction_column": p_col,
        "min_group_size": rk.min_group_size,
    }
    labelled, splits = load_splits(run)

    def read_pred(protocol: str) -> pd.DataFrame | None:
        rel = f"reward/predictions_{protocol}.parquet"
        if not run.exists(rel):
            return None
        pred = run.read_parquet(rel)
        if p_col not in pred.columns:
            raise RiskError(
                f"{run.path(rel)}: no column '{p_col}' (reward_source {rc.reward_source!r}); "
                f"found {list(pred.columns)}"
            )
        return pred

    # 1. drift ----------------------------------------------------------------------------
    base = base_rate_by_year(labelled, cutoff)
    tables["risk_met_rate_by_year"] = base
    temporal = read_pred("temporal")
    if temporal is None:
        note = (
            missing_note("reward/predictions_temporal.parquet", "notebook 02 (temporal protocol)")
            + f" (reward.protocols = {list(rc.protocols)})"
        )
        notes.append(note)
        tables["risk_drift_by_year"] = _note_table(note)
        summary["drift"] = None
    else:
        drift = drift_by_year(temporal, p_col, n_bins=rc.ece_bins)
        tables["risk_drift_by_year"] = drift
        summary["drift"] = drift_summary(drift, base, cutoff)
        _write_fig(run, "risk_drift", plot_drift(drift, base, cutoff, rc.reward_source), figures)

    # 2. group bias -----------------------------------------------------------------------
    pred = read_pred(rc.reward_protocol)
    if pred is None:
        raise RiskError(
            f"{run.path(f'reward/predictions_{rc.reward_protocol}.parquet')}: missing; notebook 02 "
            "writes the reward protocol's test predictions (run it first)"
        )
    regions = load_regions(rk.regions_path)
    assign_regions(labelled["country"], regions, rk.regions_path)  # every country, not just test
    groups = group_bias_table(pred, p_col, regions, rk.min_group_size, rc.ece_bins, rk.regions_path)
    tables["risk_group_bias"] = groups
    overall = _binary_metrics(pred["y"].astype(int), pred[p_col].astype(float), rc.ece_bins)
    summary["group_bias"] = group_bias_summary(groups, overall)
    _write_fig(run, "risk_group_bias", plot_group_bias(groups), figures)

    # 3/4 inputs from notebook 04 ---------------------------------------------------------
    samples = (
        run.read_parquet("eval/samples.parquet") if run.exists("eval/samples.parquet") else None
    )
    samples_note = missing_note("eval/samples.parquet")
    if samples is None:
        notes.append(samples_note)
    else:
        _require_columns(
            samples,
            ["policy", "prompt_id", *CONTEXT_FIELDS, "response", "reward", "top_area"],
            str(run.path("eval/samples.parquet")),
        )
    gen = generated_policies(samples["policy"]) if samples is not None else []

    # 2b. country swap --------------------------------------------------------------------
    if reward_model is None:
        from .reward import configure_threads, load_reward

        configure_threads(rc.num_threads)
        reward_model, _ = load_reward(run.require("reward_model", "notebook 02 (reward model)"))

    def score_fn(contexts: list[dict[str, Any]], texts: list[str]) -> np.ndarray:
        return np.asarray(reward_model.score(contexts, texts, batch_size=rc.score_batch_size))

    train_ids = set(splits[rc.reward_protocol]["train"])
    train_rows = labelled[labelled["row_id"].isin(train_ids)]
    panel = choose_swap_countries(train_rows["country"], rk.swap_countries, seed)
    rng = np.random.default_rng(seed + 5)
    hist = pred.iloc[
        np.sort(rng.choice(len(pred), size=min(rk.swap_texts, len(pred)), replace=False))
    ]
    swaps = [country_swap(score_fn, hist, hist["description"].tolist(), panel, "historical")]
    if samples is not None and rk.swap_generated > 0:
        g = samples[samples["policy"].isin(gen)]
        if len(g):
            g = g.iloc[
                np.sort(rng.choice(len(g), size=min(rk.swap_generated, len(g)), replace=False))
            ]
            swaps.append(country_swap(score_fn, g, g["response"].tolist(), panel, "generated"))
    swaps_df = pd.concat(swaps, ignore_index=True)
    met_rate = train_rows.groupby("country")["y"].mean().astype(float)
    swap_overall, swap_per_country = swap_summary(swaps_df, met_rate.to_dict())
    tables["risk_country_swap"] = swap_overall
    tables["risk_country_swap_by_country"] = swap_per_country
    rho_fav = _corr(swap_per_country["hist_met_rate"], swap_per_country["mean_delta"])[0]
    summary["country_swap"] = {
        "countries": panel,
        "by_source": _json_records(swap_overall),
        "most_favoured": str(swap_per_country["country"].iloc[0]),
        "most_favoured_delta": float(swap_per_country["mean_delta"].iloc[0]),
        "least_favoured": str(swap_per_country["country"].iloc[-1]),
        "least_favoured_delta": float(swap_per_country["mean_delta"].iloc[-1]),
        "spearman_delta_vs_hist_met_rate": rho_fav,
        "generated_included": bool((swaps_df["source"] == "generated").any()),
    }
    _write_fig(run, "risk_country_swap", plot_swap(swap_per_country), figures)

    # 3. reward hacking -------------------------------------------------------------------
    if samples is None:
        for name in ("risk_length_reward", "risk_length_reward_bins", "risk_rising_ngrams"):
            tables[name] = _note_table(samples_note)
        summary["length_reward"] = None
        summary["rising_ngrams"] = None
    else:
        gs = samples[samples["policy"].isin(gen)].copy()
        # length in words of the scored response (model-free, as evaluation's text measures);
        # n_tokens counts generated tokens, capped by max_new_tokens, so it often saturates
        length_col = "n_words"
        gs["n_words"] = gs["response"].map(lambda t: len(tokenize(t)))
        corr, binned = length_reward(gs, length_col, "reward", rk.length_bins)
        if "audit_reward" in gs:
            corr_a, _ = length_reward(gs, length_col, "audit_reward", rk.length_bins)
            corr["audit_spearman"] = corr_a["spearman"].to_numpy()
        if "n_tokens" in gs:
            corr_t, _ = length_reward(gs, "n_tokens", "reward", rk.length_bins)
            corr["tokens_spearman"] = corr_t["spearman"].to_numpy()
        tables["risk_length_reward"] = corr
        tables["risk_length_reward_bins"] = binned
        summary["length_reward"] = {"length_column": length_col, "by_policy": _json_records(corr)}
        _write_fig(run, "risk_length_reward", plot_length_reward(gs, binned, length_col), figures)
        tuned = tuned_policies(gen)
        start = _start_policy(run)
        if start in set(samples["policy"]) and tuned:
            ng = rising_ngrams(samples, start, tuned, 2, rk.top_ngrams)
            tables["risk_rising_ngrams"] = ng
            summary["rising_ngrams"] = {
                p: ng.loc[ng["policy"] == p, "ngram"].head(5).tolist() for p in tuned
            }
        else:
            note = f"no {start} and tuned policies in eval/samples.parquet (policies: {gen})"
            notes.append(note)
            tables["risk_rising_ngrams"] = _note_table(note)
            summary["rising_ngrams"] = None

    if run.exists("eval/frontier.parquet"):
        frontier = run.read_parquet("eval/frontier.parquet")
        if "source" in frontier:  # the RL start and checkpoints only (not best-of-N or references)
            frontier = frontier[frontier["source"].isin(["final", "snapshot"])]
        gains = checkpoint_gains(frontier, base=_start_policy(run))
        if gains.empty:
            note = "eval/frontier.parquet holds no tuned checkpoint (only the base policy)"
            notes.append(note)
            tables["risk_checkpoint_gains"] = _note_table(note)
            summary["checkpoint_gains"] = None
        else:
            tables["risk_checkpoint_gains"] = gains
            last = gains.groupby("algo", sort=False).tail(1)
            summary["checkpoint_gains"] = _json_records(
                last[["algo", "step", "baseline", "reward_gain", "audit_gain", "gap"]]
            )
            _write_fig(run, "risk_checkpoint_gains", plot_gains(gains), figures)
    else:
        note = missing_note("eval/frontier.parquet")
        notes.append(note)
        tables["risk_checkpoint_gains"] = _note_table(note)
        summary["checkpoint_gains"] = None

    # 4. diversity collapse ---------------------------------------------------------------
    if samples is None:
        tables["risk_area_diversity"] = _note_table(samples_note)
        tables["risk_area_shares"] = _note_table(samples_note)
        summary["diversity"] = None
    else:
        hist_rows = samples[samples["policy"].astype(str).str.startswith(HISTORY_PREFIX)]
        if len(hist_rows):
            ref, ref_name = hist_rows["top_area"], "history (pooled)"
        else:
            first = gen[0] if gen else samples["policy"].iloc[0]
            ref = samples.loc[samples["policy"] == first, "econ_area"].map(str)
            ref_name = "requested areas (prompts)"
            notes.append(
                "no history policies in eval/samples.parquet: areas compared with the prompts' areas"
            )
        div, shares = area_table(samples, ref, ref_name)
        wp = within_prompt_diversity(samples)
        if len(hist_rows):
            wp = pd.concat([wp, within_prompt_diversity(hist_rows.assign(policy=ref_name))])
        div = div.merge(wp, on="policy", how="left")
        div.insert(1, "kind", [policy_kind(p, ref_name) for p in div["policy"]])
        tables["risk_area_diversity"] = div
        tables["risk_area_shares"] = shares
        summary["diversity"] = {"reference": ref_name, "by_policy": _json_records(div)}
        _write_fig(run, "risk_area_shares", plot_areas(shares), figures)

    # 5. label mapping --------------------------------------------------------------------
    lab_table, lab_scores = label_sensitivity(
        labelled,
        splits[rc.reward_protocol],
        list(rk.label_variants),
        rc,
        seed,
        not_assessed=cfg.data.labels.not_assessed,
    )
    tables["risk_label_variants"] = lab_table
    summary["label_variants"] = _json_records(lab_table)
    _write_fig(run, "risk_label_variants", plot_label_variants(lab_scores, lab_table), figures)

    summary["notes"] = notes
    summary["inputs"] = {
        rel: run.exists(rel)
        for rel in (
            "reward/predictions_temporal.parquet",
            "eval/samples.parquet",
            "eval/frontier.parquet",
        )
    }
    # a figure from an earlier run must not outlive its input
    for name in sorted(RISK_FIGURES - set(figures)):
        stale = run.root / "figures" / f"{name}.png"
        if stale.exists():
            stale.unlink()
    for name, df in tables.items():
        run.write_table(name, df)
    run.write_json("risk/summary.json", summary)
    return RiskStage(tables, summary, notes, figures)
