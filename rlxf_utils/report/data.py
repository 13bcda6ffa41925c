"""The data section's words: the MET-rate findings of notebook 01 (trend, shift, areas, arrangement
types; stored as numbers and verdict codes in `data/summary.json`, `data.findings`) and the
report's data variables."""

from __future__ import annotations

from typing import Any

import pandas as pd

from rlxf_utils.artifacts import ArtifactMissing, RunDir
from rlxf_utils.markdown import is_present
from rlxf_utils.report.wording import pct, sentence, table

#: The data section's sentences, each a macro of `reports/templates/data.jinja`.
SENTENCES = ("trend_sentence", "shift_sentence", "area_sentence", "arrangement_type_sentence")


def findings_sentences(f: dict[str, Any]) -> dict[str, str]:
    """The data section's four tested findings (`data.findings.data_findings`, stored in
    `data/summary.json`) as sentences: `trend_sentence`, `shift_sentence`, `area_sentence` and
    `arrangement_type_sentence`, written by the author in `reports/templates/data.jinja`, each
    verb the vocabulary's phrase of its test's verdict code."""
    return {name: sentence("data", name, f) for name in SENTENCES}


#: The tests of `data.findings.data_findings`, and every field the sentences read.
_TESTS = ("trend", "shift", "areas", "arrangement_types")
_FINDINGS = ("alpha", "level", "cutoff", "min_group_size", *_TESTS)


def data_section(run: RunDir) -> dict[str, Any]:
    """The data section's tested sentences (`findings_sentences` of the numbers notebook 01 stored
    in `data/summary.json`) and its level."""
    s = run.read_json("data/summary.json", stage="notebook 01_data_exploration")
    f = s.get("findings") or {}
    missing = [k for k in _FINDINGS if k not in f] + [
        f"{k}.verdict" for k in _TESTS if k in f and "verdict" not in f[k]
    ]
    if missing:
        raise ArtifactMissing(
            f"{run.path('data/summary.json')}: findings fields {missing} missing (a run from "
            "before the findings were stored as numbers); rerun notebook 01_data_exploration"
        )
    return {"level": f["level"], **findings_sentences(f)}


#: The pools of `data.splits.carve_policy_pool` (tables/data_pools.csv) as the reader sees them:
#: who learns from each.
POOL_LABELS = {
    "reward_train": "reward model: training",
    "reward_val": "reward model: validation",
    "audit_train": "audit: training",
    "audit_val": "audit: calibration",
    "policy": "policies (SFT, offline methods, RL contexts, MLE references)",
    "reference": "evaluation references (held-out countries)",
    "unused": "unused",
}


def _share(x: Any) -> str:
    """A share as a percentage in a table cell; '·' where it does not apply."""
    return pct(x) if is_present(x) else "·"


def pools_table(run: RunDir) -> str:
    """Report Table 4: each pool of rows (who learns from it) with its rows, its shares as
    percentages, its countries, arrangements and contexts, and its MET share."""
    t = run.read_table("data_pools", "notebook 01_data_exploration")
    return table("data_pools", t, pools=POOL_LABELS)


def split_sizes_table(run: RunDir) -> str:
    """Each protocol's training, validation and test parts: rows, MET share as a percentage,
    arrangements and test years."""
    return table("split_sizes", run.read_table("split_sizes", "notebook 01_data_exploration"))


# -- notebook 01's narrative --------------------------------------------------------------------
def load_sentence(stage: Any, max_rows: int | None) -> str:
    """What the file held, what was used and labelled, and what the loader repaired."""
    rep, lab = stage.table.report, stage.labelled
    return sentence("data", "load_sentence", {
        "schema": rep.schema, "encoding": rep.encoding, "sha256": rep.sha256,
        "rows_read": rep.rows_read, "max_rows": max_rows, "rows_used": len(stage.conditions),
        "subsampled_from": stage.subsampled_from, "labelled": len(lab),
        "met": int((lab["y"] == 1).sum()), "nonmet": int((lab["y"] == 0).sum()),
        "excluded": int((stage.conditions["label"] == "excluded").sum()),
        "repairs": list(rep.repairs)})  # fmt: skip


def area_range_sentence(by_area: pd.DataFrame, min_n: int) -> str:
    """The lowest and highest MET rate among economic areas with at least `min_n` conditions."""
    ranked = by_area.loc[by_area["n"] >= min_n].sort_values("met_rate")
    hi, lo = (ranked.iloc[i].to_dict() for i in (-1, 0))
    return sentence("data", "area_range_sentence", min_n, lo, hi)


def findings_paragraph(findings: dict[str, Any]) -> str:
    """The tested findings (trend, shift, areas, arrangement types) as one paragraph."""
    return sentence("data", "findings_paragraph", findings_sentences(findings))


def programmes_sentence(lab: pd.DataFrame, per_programme: pd.DataFrame) -> str:
    """Countries, programmes, conditions per programme and description length."""
    return sentence("data", "programmes_sentence", {
        "countries": lab["country"].nunique(), "programmes": lab["arrangement_id"].nunique(),
        "median_conditions": per_programme["conditions"].median(),
        "max_conditions": per_programme["conditions"].max(),
        "median_words": lab["description"].str.split().str.len().median()})  # fmt: skip


def pool_duplicates_sentence(rows: list[dict[str, Any]]) -> str:
    """How much text of one pool repeats in another (`data.splits.pool_near_duplicates`, stored
    in `data/summary.json` as `pool_duplicates`): the report's data section sentence."""
    if not rows:
        raise ArtifactMissing("data/summary.json has no 'pool_duplicates'; rerun notebook 01")
    by: dict[str, dict[str, Any]] = {}
    for r in rows:
        by.setdefault(r["pool"], {})[r["other"]] = r
    return sentence("data", "pool_duplicates_sentence", by, rows[0]["threshold"])


def duplicates_sentence(dups: pd.DataFrame, threshold: float) -> str:
    """How much test text repeats training text under each protocol."""
    return sentence(
        "data", "duplicates_sentence", dups.set_index("protocol").to_dict("index"), threshold
    )
