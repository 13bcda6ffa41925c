"""Sanity checks on a loaded MONA file: what a wrong column or a wrong export looks like (most
statuses no MONA code, most descriptions empty, too few rows or one outcome), stopped before any
work with what was found and the threshold to loosen (`data.checks`)."""

from __future__ import annotations

from typing import Any

from rlxf_utils.data.mona import load_mona
from rlxf_utils.data.read import MonaTable
from rlxf_utils.data.schema import KNOWN_STATUSES, DataError


def data_problems(table: MonaTable, checks: Any) -> list[str]:
    """Each check `table` fails, as a sentence naming what was found and the threshold."""
    frame, rep = table.frame, table.report
    n = max(len(frame), 1)
    out = []
    unknown = sum(rep.unknown_statuses.values())
    if unknown / n > checks.max_unrecognised_share:
        shown = ", ".join(f"{k!r} x{v}" for k, v in list(rep.unknown_statuses.items())[:5])
        out.append(
            f"{unknown} of {len(frame)} statuses ({unknown / n:.0%}) are no MONA code ({shown}); "
            f"expected codes such as {', '.join(c for c in KNOWN_STATUSES if c)} "
            f"(data.checks.max_unrecognised_share is {checks.max_unrecognised_share}): is the "
            "status column the right one?"
        )
    empty = int((frame["description"].fillna("").str.strip() == "").sum())
    if empty / n > checks.max_empty_description_share:
        out.append(
            f"{empty} of {len(frame)} condition descriptions ({empty / n:.0%}) are empty "
            f"(data.checks.max_empty_description_share is {checks.max_empty_description_share}): "
            "is the description column the right one?"
        )
    met, non = rep.label_counts.get("MET", 0), rep.label_counts.get("Non-MET", 0)
    if met + non < checks.min_labelled_rows:
        out.append(
            f"{met + non} assessed (MET or Non-MET) rows; the splits need at least "
            f"{checks.min_labelled_rows} (data.checks.min_labelled_rows)"
        )
    if min(met, non) < checks.min_rows_per_label:
        out.append(
            f"{met} MET and {non} Non-MET rows; each outcome needs at least "
            f"{checks.min_rows_per_label} (data.checks.min_rows_per_label): is the label mapping "
            "(data.labels) right for this file?"
        )
    return out


def check_data(table: MonaTable, checks: Any) -> MonaTable:
    """`table` when it passes every check, else a `DataError` naming the file and each failure."""
    problems = data_problems(table, checks)
    if problems:
        raise DataError(f"{table.report.path}: " + "; ".join(problems))
    return table


def load_data(cfg: Any) -> MonaTable:
    """The parameters' MONA file loaded, labelled, its sha256 and `data.checks` verified: what
    `rlxf run` does before any notebook starts, and notebook 01 first of all."""
    d = cfg.data
    table = load_mona(d.path, met=d.labels.met, not_assessed=d.labels.not_assessed,
                      expected_sha256=d.sha256, unrecognised=d.labels.unrecognised)  # fmt: skip
    return check_data(table, d.checks)
