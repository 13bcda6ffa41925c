"""From raw MONA statuses and dates to labels: status normalisation, the MET / Non-MET mapping,
dates and the test year of a review."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from typing import Any

import numpy as np
import pandas as pd

from rlxf_utils.data.schema import (
    KNOWN_STATUSES,
    ORDINALS,
    STATUS_ALIASES,
    UNRECOGNISED_POLICIES,
    DataError,
    status_key,
)


def normalise_status(value: Any) -> str:
    """A status as its MONA code: 'Mod' -> 'MOD', ' M ' -> 'M', 'Not met' -> 'NM', NaN -> ''.

    Upper-cased with whitespace removed; a value that is no code then is looked up with its
    punctuation removed ('N.M.' -> 'NM') and among the spelled-out forms (`STATUS_WORDS`). What
    matches nothing is returned upper-cased, whitespace removed (and reported as unrecognised).
    """
    if value is None or (isinstance(value, float) and np.isnan(value)):
        return ""
    code = re.sub(r"\s+", "", str(value)).upper()
    if code in KNOWN_STATUSES:
        return code
    key = status_key(code)
    if key and key in KNOWN_STATUSES:
        return key
    return STATUS_ALIASES.get(key, code)


def unrecognised_statuses(
    statuses: pd.Series, met: Iterable[str], not_assessed: Iterable[str]
) -> pd.Series:
    """Boolean mask: normalised statuses that are no MONA code and not in `met`/`not_assessed`."""
    known = set(KNOWN_STATUSES)
    known |= {normalise_status(s) for s in met} | {normalise_status(s) for s in not_assessed}
    return ~statuses.isin(known)


def label_statuses(
    statuses: pd.Series,
    met: Iterable[str],
    not_assessed: Iterable[str],
    unrecognised: str = "non_met",
) -> pd.Series:
    """Map normalised statuses to 'MET', 'excluded' (not assessed yet) or 'Non-MET' (all else).

    An unrecognised status (`unrecognised_statuses`) is 'Non-MET' under `unrecognised='non_met'`
    (the paper groups "others" under Non-MET), 'excluded' under 'exclude'; under 'error' any is
    a DataError.
    """
    if unrecognised not in UNRECOGNISED_POLICIES:
        raise ValueError(
            f"unrecognised={unrecognised!r}; expected one of {list(UNRECOGNISED_POLICIES)}"
        )
    met_set = {normalise_status(s) for s in met}
    na_set = {normalise_status(s) for s in not_assessed}
    labels = statuses.map(
        lambda s: "MET" if s in met_set else "excluded" if s in na_set else "Non-MET"
    )
    if unrecognised != "non_met":
        unknown = unrecognised_statuses(statuses, met_set, na_set)
        if unrecognised == "error" and unknown.any():
            raise DataError(
                f"unrecognised status(es) {sorted(set(statuses[unknown]))}; expected a MONA code "
                f"({[c for c in KNOWN_STATUSES if c]}) (key 'data.labels.unrecognised' is 'error')"
            )
        labels = labels.mask(unknown, "excluded")
    return labels


_DATE_FORMATS = ("%m/%d/%Y", "%d %b %Y", "%Y-%m-%d", "%d/%m/%Y", "%Y-%m-%dT%H:%M:%S")


@functools.lru_cache(maxsize=8192)
def parse_date(s: str) -> pd.Timestamp | None:
    s = s.strip()
    if not s:
        return None
    for fmt in _DATE_FORMATS:
        try:
            return pd.Timestamp(pd.to_datetime(s, format=fmt))
        except (ValueError, TypeError):
            continue
    return None


def _review_number(text: str) -> int | None:
    """The (largest) review number named in e.g. 'Combined Third and Fourth Reviews Prior Action'."""
    nums = [ORDINALS[w] for w in re.findall(r"[a-z]+", text.lower()) if w in ORDINALS]
    nums += [int(n) for n in re.findall(r"\b(\d{1,2})(?:st|nd|rd|th)?\s+review", text.lower())]
    return max(nums) if nums else None


def _last_review_number(review_type: str) -> int | None:
    nums = [int(n) for n in re.findall(r"\d+", review_type or "")]
    return max(nums) if nums else None


def derive_test_year(
    test_date: str, approval: pd.Timestamp | None, board: pd.Timestamp | None, review_type: str
) -> tuple[pd.Timestamp | None, int | None, str]:
    """Test date and year of one condition, and how the year was found.

    A calendar date is used as is. A review's prior action has no date: its review's board date
    is interpolated between approval (review 0) and the last review's board date, which this
    vintage records once per arrangement. A programme prior action takes the approval year; a
    continuous condition the last review's board year.
    """
    parsed = parse_date(test_date)
    if parsed is not None:
        return parsed, parsed.year, "test_date"
    t = test_date.lower()
    if ("program prior action" in t or "programme prior action" in t) and approval is not None:
        return None, approval.year, "approval_date"
    n = _review_number(t) if "review" in t else None
    last = _last_review_number(review_type)
    if n is not None and approval is not None and board is not None and last and n <= last:
        est = approval + (board - approval) * (n / last)
        return None, est.year, "interpolated_review_date"
    if board is not None:
        return None, board.year, "board_date"
    if approval is not None:
        return None, approval.year, "approval_date"
    return None, None, "unknown"
