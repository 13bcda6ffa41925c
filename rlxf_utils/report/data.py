"""The data section's words: the MET-rate findings of notebook 01 (trend, shift, areas, arrangement
types; stored as numbers and verdict codes in `data/summary.json`, `data.findings`) and the
report's data variables."""

from __future__ import annotations

from typing import Any

import pandas as pd

from rlxf_utils.artifacts import ArtifactMissing, RunDir
from rlxf_utils.markdown import is_present, literal
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
    n_met, n_non = int((lab["y"] == 1).sum()), int((lab["y"] == 0).sum())
    sub = (
        f" The profile caps the study at {max_rows} rows, so {len(stage.conditions):,} rows of whole "
        f"arrangements were drawn (seeded) from the {stage.subsampled_from:,} read."
        if stage.subsampled_from
        else ""
    )
    excluded = int((stage.conditions["label"] == "excluded").sum())
    return (
        f"The file ({rep.schema}, {rep.encoding}, sha256 `{rep.sha256[:12]}…`) holds **{rep.rows_read:,} "
        f"conditions**.{sub} Of the rows used, **{len(lab):,} are assessed** and labelled: "
        f"{n_met:,} MET and {n_non:,} Non-MET, a MET share of **{n_met / len(lab):.1%}**; "
        f"{excluded:,} were not assessed yet and are excluded. "
        f"Repairs: {literal('; '.join(rep.repairs)) if rep.repairs else 'none needed'}."
    )


def area_range_sentence(by_area: pd.DataFrame, min_n: int) -> str:
    """The lowest and highest MET rate among economic areas with at least `min_n` conditions."""
    hi, lo = (
        by_area.loc[by_area["n"] >= min_n].sort_values("met_rate").iloc[[-1, 0]].itertuples(index=False)
    )  # fmt: skip
    return (
        f"Among economic areas with at least {min_n} conditions, the MET rate ranges from "
        f"{lo.met_rate:.1%} (*{literal(lo.econ_descriptor)}*, n={lo.n}) to {hi.met_rate:.1%} "
        f"(*{literal(hi.econ_descriptor)}*, n={hi.n})."
    )


def findings_paragraph(findings: dict[str, Any]) -> str:
    """The tested findings (trend, shift, areas, arrangement types) as one paragraph."""
    w = findings_sentences(findings)
    return (
        f"{w['trend_sentence']}; {w['shift_sentence']}. {w['area_sentence']}; "
        f"{w['arrangement_type_sentence']}."
    )


def programmes_sentence(lab: pd.DataFrame, per_programme: pd.DataFrame) -> str:
    """Countries, programmes, conditions per programme and description length."""
    words = lab["description"].str.split().str.len()
    return (
        f"{lab['country'].nunique()} countries and {lab['arrangement_id'].nunique()} programmes; the "
        f"median programme has {per_programme['conditions'].median():.0f} assessed conditions (max "
        f"{per_programme['conditions'].max()}). Descriptions have a median of {words.median():.0f} words."
    )


def duplicates_sentence(dups: pd.DataFrame, threshold: float) -> str:
    """How much test text repeats training text under each protocol."""
    r = dups.set_index("protocol")
    return (
        f"Under the paper's random split, **{r.loc['random', 'exact_in_train']:,} of "
        f"{r.loc['random', 'test_rows']:,} test conditions ({r.loc['random', 'exact_share']:.1%})** "
        f"have an identical description on the training side, and {r.loc['random', 'near_share']:.1%} "
        f"a near-duplicate (cosine ≥ {threshold}). Holding out whole arrangements brings this to "
        f"{r.loc['grouped', 'near_share']:.1%}; the temporal split has "
        f"{r.loc['temporal', 'near_share']:.1%}. A classifier can score well on the random split by "
        "remembering repeated text."
    )
