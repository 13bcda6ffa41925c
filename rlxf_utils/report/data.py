"""The data section's words: the MET-rate findings of notebook 01 (trend, shift, areas, arrangement
types; stored in `data/summary.json`) and the report's data variables."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from rlxf_utils.artifacts import ArtifactMissing, RunDir
from rlxf_utils.report.wording import interval, literal, num
from rlxf_utils.stats import level, rate_heterogeneity, rate_shift, rate_trend


def _p(p: float) -> str:
    return "n/a" if not np.isfinite(p) else ("< 0.001" if p < 0.001 else f"= {p:.3f}")


def data_findings(labelled: pd.DataFrame, cutoff: int, alpha: float, min_n: int) -> dict[str, Any]:
    """The data section's tested statements: trend over years, shift at the cut-off, differences
    across economic areas and arrangement types, as numbers and as sentences chosen at `alpha`."""
    lvl = level(alpha)
    dated = labelled.dropna(subset=["test_year"])
    y, cl = dated["y"].astype(float), dated["arrangement_id"].astype(str)
    trend = rate_trend(y, dated["test_year"].astype(float), cl, alpha)
    shift = rate_shift(y, dated["test_year"].astype(float) > cutoff, cl, alpha)
    areas = rate_heterogeneity(
        labelled["y"].astype(float),
        labelled["econ_descriptor"].astype(str),
        labelled["arrangement_id"].astype(str),
        min_n,
    )
    types = rate_heterogeneity(
        labelled["y"].astype(float),
        labelled["arrangement_type"].astype(str),
        labelled["arrangement_id"].astype(str),
        min_n,
    )
    if trend["p_value"] < alpha:
        word = "rises" if trend["or_low"] > 1 else "falls"
        trend_s = f"The MET rate {word} over the test years"
    else:
        trend_s = f"The MET rate has no linear trend over the test years significant at the {alpha:.0%} level"
    trend_s += (
        f" (odds ratio per year {trend['odds_ratio_per_year']:.3f}, {lvl} CI "
        f"{interval(trend['or_low'], trend['or_high'], signed=False)}, p {_p(trend['p_value'])})"
    )
    shift_word = (
        ("significantly higher" if shift["diff_low"] > 0 else "significantly lower")
        if shift["p_value"] < alpha
        else "not significantly different"
    )
    shift_s = (
        f"conditions due after {cutoff} are met {shift['rate_after']:.1%} of the time against "
        f"{shift['rate_before']:.1%} up to {cutoff}, {shift_word} "
        f"(difference {num(shift['diff'], 1, True, 100)} points, {lvl} CI "
        f"{interval(shift['diff_low'], shift['diff_high'], 1, scale=100)}, p {_p(shift['p_value'])})"
    )

    def het(r: dict[str, float], what: str) -> str:
        if r["groups"] < 2:
            return f"too few {what} hold {min_n} conditions to test whether MET rates differ across them"
        verdict = "differ" if r["p_value"] < alpha else "do not differ significantly"
        return (
            f"MET rates {verdict} across {what} ({r['groups']} with at least {min_n} conditions; "
            f"cluster-robust Wald χ²({r['df']}) = {r['wald']:.1f}, p {_p(r['p_value'])})"
        )

    return {
        "alpha": alpha,
        "level": lvl,
        "trend": trend,
        "shift": shift,
        "areas": areas,
        "arrangement_types": types,
        "trend_sentence": trend_s,
        "shift_sentence": shift_s,
        "area_sentence": het(areas, "economic areas"),
        "arrangement_type_sentence": het(types, "arrangement types"),
    }


def data_section(run: RunDir) -> dict[str, Any]:
    """The data section's tested sentences (notebook 01's `report.data.data_findings`) and its level."""
    s = run.read_json("data/summary.json", stage="notebook 01_data_exploration")
    f = s.get("findings")
    if not f:
        raise ArtifactMissing(
            f"{run.path('data/summary.json')}: field 'findings' missing; rerun notebook 01_data_exploration"
        )
    return {
        "level": f["level"],
        "trend_sentence": f["trend_sentence"],
        "shift_sentence": f["shift_sentence"],
        "area_sentence": f["area_sentence"],
        "arrangement_type_sentence": f["arrangement_type_sentence"],
    }


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
    return (
        f"{findings['trend_sentence']}; {findings['shift_sentence']}. {findings['area_sentence']}; "
        f"{findings['arrangement_type_sentence']}."
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
