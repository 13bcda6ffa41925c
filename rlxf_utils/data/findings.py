"""The data section's tested findings as numbers and verdict codes: the MET rate's trend over the
test years, its shift at the temporal cut-off, and its spread across economic areas and
arrangement types, each with arrangement-clustered variances (`stats.rates`). The report phrases
them (`report.data.findings_sentences`); nothing here writes a sentence."""

from __future__ import annotations

from typing import Any

import pandas as pd

from rlxf_utils.stats import level, p_verdict, rate_heterogeneity, rate_shift, rate_trend


def data_findings(labelled: pd.DataFrame, cutoff: int, alpha: float, min_n: int) -> dict[str, Any]:
    """Trend over years, shift after `cutoff`, differences across economic areas and arrangement
    types (groups of at least `min_n` conditions), each test's numbers with its `verdict` at
    `alpha` (`stats.p_verdict`: the trend's and the shift's direction, the groups' spread)."""
    dated = labelled.dropna(subset=["test_year"])
    y, cl = dated["y"].astype(float), dated["arrangement_id"].astype(str)
    trend = rate_trend(y, dated["test_year"].astype(float), cl, alpha)
    trend["verdict"] = p_verdict(trend["p_value"], alpha, up=trend["or_low"] > 1)
    shift = rate_shift(y, dated["test_year"].astype(float) > cutoff, cl, alpha)
    shift["verdict"] = p_verdict(shift["p_value"], alpha, up=shift["diff_low"] > 0)
    groups = {}
    for key, column in (("areas", "econ_descriptor"), ("arrangement_types", "arrangement_type")):
        g = rate_heterogeneity(
            labelled["y"].astype(float),
            labelled[column].astype(str),
            labelled["arrangement_id"].astype(str),
            min_n,
        )
        groups[key] = {**g, "verdict": p_verdict(g["p_value"], alpha)}
    return {
        "alpha": alpha,
        "level": level(alpha),
        "cutoff": cutoff,
        "min_group_size": min_n,
        "trend": trend,
        "shift": shift,
        **groups,
    }
