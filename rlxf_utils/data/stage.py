"""Notebook 01's stage: load, label, subsample, split and build contexts, writing the run's
`data/` artifacts."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from rlxf_utils import plots
from rlxf_utils.config import portable_path
from rlxf_utils.data.checks import load_data
from rlxf_utils.data.contexts import build_contexts
from rlxf_utils.data.findings import data_findings
from rlxf_utils.data.mona import subsample_arrangements
from rlxf_utils.data.planted import plant, planted_summary
from rlxf_utils.data.read import MonaTable
from rlxf_utils.data.splits import (
    carve_policy_pool,
    make_splits,
    near_duplicates_across,
    nest_evaluation_holdout,
    pool_near_duplicates,
    pool_of_rows,
    pool_table,
    split_summary,
)
from rlxf_utils.stats import rate_by, wilson_z

log = logging.getLogger(__name__)


@dataclass
class DataStage:
    """Everything notebook 01 computes and later stages read back from the run dir."""

    table: MonaTable
    conditions: pd.DataFrame
    labelled: pd.DataFrame
    splits: dict[str, dict[str, list[int]]]
    contexts: pd.DataFrame
    duplicates: pd.DataFrame
    subsampled_from: int | None = None
    holdout: dict[str, Any] = field(default_factory=dict)
    #: exact and near copies across the reward model's, the audit's and the policies' pools
    pool_duplicates: pd.DataFrame = field(default_factory=pd.DataFrame)


def run_data_stage(cfg: Any, run: Any) -> DataStage:
    """Load, label, (sub)sample, split and build contexts; write them to the run dir.

    `cfg` is a `StudyConfig`, `run` a `RunDir`. Writes `data/conditions.parquet`,
    `data/splits.json`, `data/holdout.json` (nest_evaluation_holdout, carve_policy_pool),
    `data/pools.parquet` (each row's pool), `data/contexts.parquet`, `data/load_report.json`.
    """
    d = cfg.data
    table = load_data(cfg)
    conditions = table.frame
    subsampled_from = None
    if d.max_rows is not None and len(conditions) > d.max_rows:
        subsampled_from = len(conditions)
        conditions = subsample_arrangements(conditions, d.max_rows, cfg.run.seed)
        log.info("subsampled %d -> %d rows (whole arrangements)", subsampled_from, len(conditions))
    if d.planted is not None:  # the positive control: labels drawn from a known P*
        conditions = plant(conditions, d.planted)
    labelled = conditions[conditions["label"] != "excluded"].reset_index(drop=True)
    s = d.splits
    splits = make_splits(
        labelled, cfg.run.seed, s.test_fraction, s.validation_fraction, s.temporal_cutoff_year
    )
    contexts = build_contexts(labelled, cfg.run.seed, s.context_eval_fraction)
    splits, holdout = nest_evaluation_holdout(
        labelled,
        splits,
        cfg.reward.reward_protocol,
        contexts.loc[contexts["split"] == "eval", "country"].unique(),
        cfg.run.seed,
        s.validation_fraction,
    )
    splits, holdout = carve_policy_pool(labelled, splits, holdout, s.policy_fraction, cfg.run.seed)
    pools = pool_of_rows(labelled, splits, holdout)
    contexts = with_policy_rows(contexts, labelled, holdout["policy"])
    by_id = labelled.set_index("row_id")["description"]
    dup_rows = []
    for protocol, parts in splits.items():
        train_ids = parts["train"] + parts["val"]
        res = near_duplicates_across(
            by_id.loc[train_ids].tolist(),
            by_id.loc[parts["test"]].tolist(),
            s.near_duplicate_threshold,
        )
        dup_rows.append({"protocol": protocol, **res})
    duplicates = pd.DataFrame(dup_rows)
    across_pools = pool_near_duplicates(labelled, pools, s.near_duplicate_threshold)
    run.write_parquet("data/conditions.parquet", conditions)
    run.write_json("data/splits.json", splits)
    run.write_json("data/holdout.json", holdout)
    run.write_parquet("data/pools.parquet", pools)
    run.write_parquet("data/contexts.parquet", contexts)
    report = table.report.as_dict()
    report["path"] = portable_path(report["path"])  # the same in every checkout (issue 47)
    report["subsampled_from"] = subsampled_from
    report["rows_used"] = len(conditions)
    report["labelled_used"] = len(labelled)
    run.write_json("data/load_report.json", report)
    if d.planted is not None:
        held = splits[cfg.reward.reward_protocol]["test"]
        run.write_json("data/planted.json", planted_summary(labelled, held, d.planted))
    return DataStage(table, conditions, labelled, splits, contexts, duplicates, subsampled_from,
                     holdout, pool_duplicates=across_pools)  # fmt: skip


def with_policy_rows(
    contexts: pd.DataFrame, labelled: pd.DataFrame, policy: list[int]
) -> pd.DataFrame:
    """`contexts` with `policy_rows`: how many of the policy pool's rows each context holds. The
    training contexts with none are no method's prompt (`data.contexts.load_contexts`)."""
    keys = ["country", "arrangement_type", "econ_descriptor"]
    counts = labelled[labelled["row_id"].isin(set(policy))].groupby(keys).size()
    out = contexts.drop(columns="policy_rows", errors="ignore").merge(
        counts.rename("policy_rows").reset_index(), on=keys, how="left", validate="one_to_one"
    )
    out["policy_rows"] = out["policy_rows"].fillna(0).astype(int)
    return out


@dataclass
class DataDescription:
    """Notebook 01's descriptive tables (also written to `tables/`), the tested findings and the
    summary the report reads (`data/summary.json`)."""

    tables: dict[str, pd.DataFrame]
    findings: dict[str, Any]
    summary: dict[str, Any]


def _per_programme(lab: pd.DataFrame) -> pd.DataFrame:
    return (
        lab.groupby("arrangement_id")
        .agg(
            country=("country", "first"),
            type=("arrangement_type", "first"),
            conditions=("y", "size"),
            met_rate=("y", "mean"),
        )
        .sort_values("conditions", ascending=False)
        .reset_index()
    )


def describe_data(stage: DataStage, cfg: Any, run: Any) -> DataDescription:
    """Describe what the reward model learns from and write it: the status mapping, MET rates with
    Wilson intervals by year, area, arrangement and condition type, the tested findings, countries
    and programmes, description lengths, the paper's Table 2 sample, the splits and their near
    duplicates, the contexts; their figures; and `data/summary.json` for the report."""
    alpha = cfg.evaluation.alpha
    lab = stage.labelled
    t = rate_tables(stage, cfg, run)
    # groups too small to test: the one size the study uses for that (`risk.min_group_size`)
    findings = data_findings(
        lab, cfg.data.splits.temporal_cutoff_year, alpha, cfg.risk.min_group_size
    )
    t |= size_tables(lab, cfg, run)
    t |= split_tables(stage, run)
    for name, table in t.items():
        run.write_table(name, table)
    summary = data_summary(stage, cfg, t, findings)
    run.write_json("data/summary.json", summary)
    return DataDescription(t, findings, summary)


def rate_tables(stage: DataStage, cfg: Any, run: Any) -> dict[str, pd.DataFrame]:
    """The status mapping, where test years come from, and the MET rate (Wilson intervals) by
    year, economic area, arrangement type and condition type; with their figures."""
    alpha = cfg.evaluation.alpha
    z = wilson_z(alpha)
    lab = stage.labelled
    met_share = int((lab["y"] == 1).sum()) / len(lab)
    t: dict[str, pd.DataFrame] = {}
    status = stage.table.report.status_table[["status_raw", "status", "meaning", "label", "count"]]
    t["status_mapping"] = status
    fig = plots.bar_counts(status.assign(code=status["status_raw"].map(repr)), "code", "count",
                           "label", "Raw MONA status codes and their label")  # fmt: skip
    _figure(run, "status_counts", fig)
    t["test_year_sources"] = (
        stage.conditions["test_year_source"]
        .value_counts()
        .rename_axis("test_year_source")
        .reset_index(name="rows")
    )
    t["met_rate_by_year"] = rate_by(lab.dropna(subset=["test_year"]), "test_year", z=z)
    fig = plots.rate_by_year(t["met_rate_by_year"], "MET rate by test year",
                             cutoff=cfg.data.splits.temporal_cutoff_year, alpha=alpha)  # fmt: skip
    _figure(run, "met_rate_by_year", fig)
    for column, name, title in (
        ("econ_descriptor", "met_rate_by_area", "MET rate by economic area"),
        ("arrangement_type", "met_rate_by_arrangement_type", "MET rate by arrangement type"),
        ("condition_type", "met_rate_by_condition_type", "MET rate by condition type"),
    ):
        t[name] = rate_by(lab, column, z=z)
        _figure(run, name, plots.rate_bars(t[name], column, title, overall=met_share, alpha=alpha))
    return t


def size_tables(lab: pd.DataFrame, cfg: Any, run: Any) -> dict[str, pd.DataFrame]:
    """Conditions per country and per programme, description lengths (with their figure) and
    the paper's Table 2 sample."""
    t: dict[str, pd.DataFrame] = {}
    t["conditions_per_country"] = (
        lab.groupby("country")
        .agg(conditions=("y", "size"), met_rate=("y", "mean"), programmes=("arrangement_id", "nunique"))
        .sort_values("conditions", ascending=False)
        .reset_index()
    )  # fmt: skip
    t["conditions_per_programme"] = _per_programme(lab)
    words = lab["description"].str.split().str.len()
    t["description_length"] = (
        lab.assign(words=words)
        .groupby("label")["words"]
        .describe()[["count", "mean", "50%", "max"]]
        .rename(columns={"50%": "median"})
        .reset_index()
    )
    fig = plots.hist_by(words.clip(upper=120), lab["label"], "Condition description length",
                        "words (clipped at 120)")  # fmt: skip
    _figure(run, "description_length", fig)
    t["table2_sample"] = lab.sample(
        n=min(cfg.data.table2_sample_size, len(lab)), random_state=cfg.run.seed
    )[list(TABLE2_COLUMNS)].rename(columns=TABLE2_COLUMNS)
    return t


def split_tables(stage: DataStage, run: Any) -> dict[str, pd.DataFrame]:
    """The splits' sizes (with their figure), the pools of rows, the near duplicates across
    splits and across pools, and the contexts per split."""
    lab = stage.labelled
    t: dict[str, pd.DataFrame] = {"split_sizes": split_summary(lab, stage.splits)}
    _figure(
        run, "split_balance", plots.split_balance(t["split_sizes"], "Split sizes and MET share")
    )
    pools = pool_of_rows(lab, stage.splits, stage.holdout)
    t["data_pools"] = pool_table(lab, pools)
    t["split_duplicates"] = stage.duplicates
    t["pool_duplicates"] = stage.pool_duplicates
    t["context_split"] = (
        stage.contexts.groupby("split")
        .agg(
            contexts=("n", "size"),
            countries=("country", "nunique"),
            conditions=("n", "sum"),
            met_rate=("met_rate", "mean"),
        )
        .reset_index()
    )
    return t


def data_summary(
    stage: DataStage, cfg: Any, t: Mapping[str, pd.DataFrame], findings: Any
) -> dict[str, Any]:
    """`data/summary.json`: the counts and tables the report's data section reads (numbers only)."""
    lab = stage.labelled
    n_met, n_non = int((lab["y"] == 1).sum()), int((lab["y"] == 0).sum())
    years = pd.to_datetime(stage.conditions["approval_date"], errors="coerce").dt.year
    return {
        "rows_read": stage.table.report.rows_read,
        "rows_used": len(stage.conditions),
        "labelled": len(lab),
        "met": n_met,
        "non_met": n_non,
        "met_share": n_met / len(lab),
        "excluded": int((stage.conditions["label"] == "excluded").sum()),
        "countries": int(lab["country"].nunique()),
        "programmes": int(lab["arrangement_id"].nunique()),
        "approval_years": [int(y) for y in years.agg(["min", "max"])],
        "split_sizes": t["split_sizes"].to_dict(orient="records"),
        "duplicates": t["split_duplicates"].to_dict(orient="records"),
        "pool_duplicates": t["pool_duplicates"].to_dict(orient="records"),
        "contexts": t["context_split"].to_dict(orient="records"),
        "pools": t["data_pools"].to_dict(orient="records"),
        "policy_fraction": cfg.data.splits.policy_fraction,
        "policy_contexts": int((stage.contexts.get("policy_rows", pd.Series(dtype=int)) > 0).sum()),
        "findings": findings,
    }


#: The paper's Table 2: the columns it shows and their headers.
TABLE2_COLUMNS = {
    "country": "Country",
    "econ_code": "Economic code",
    "econ_descriptor": "Economic descriptor",
    "description": "Description",
    "condition_type": "Type",
    "test_date_raw": "Test date",
    "status": "Status",
}


def _figure(run: Any, name: str, fig: Any) -> None:
    """`figures/<name>.png`, then closed (the notebook shows the saved file)."""
    import matplotlib.pyplot as plt

    run.write_figure(name, fig)
    plt.close(fig)
