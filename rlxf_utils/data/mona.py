"""Loading MONA: a file in one of the known vintages becomes one clean table of labelled
conditions (`load_mona`), and whole arrangements can be subsampled."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pandas as pd

from rlxf_utils.data.labels import (
    derive_test_year,
    label_statuses,
    normalise_status,
    parse_date,
    unrecognised_statuses,
)
from rlxf_utils.data.read import LoadReport, MonaTable, read_records
from rlxf_utils.data.schema import (
    CONDITION_TYPE_FALLBACKS,
    CONDITION_TYPES,
    KNOWN_STATUSES,
    SCHEMAS,
    UNRECOGNISED_POLICIES,
    DataError,
    detect_schema,
)
from rlxf_utils.prompts import econ_area

log = logging.getLogger(__name__)


def load_mona(
    path: str | Path,
    met: Iterable[str] = ("M", "PM"),
    not_assessed: Iterable[str] = ("SB", "PC", "PA", ""),
    expected_sha256: str | None = None,
    unrecognised: str = "non_met",
) -> MonaTable:
    """Read a MONA file (CSV or .xlsx) of either schema into the normalised, labelled table.

    `unrecognised` (`data.labels.unrecognised`) decides what a status that is neither a MONA code,
    its spelled-out form, nor in `met`/`not_assessed` becomes: 'non_met' (the paper's grouping of
    "others" under Non-MET), 'exclude', or 'error' (a DataError naming the values); the first two
    warn with counts. Columns: row_id, country, arrangement_id, arrangement_type, approval_date,
    econ_code, econ_descriptor, econ_area, condition_type, description, test_date, test_year,
    test_year_source, review_type, status_raw, status, label, y. No outcome commentary.
    """
    if unrecognised not in UNRECOGNISED_POLICIES:
        raise DataError(
            f"data.labels.unrecognised is {unrecognised!r}; expected one of "
            f"{list(UNRECOGNISED_POLICIES)}"
        )
    met, not_assessed = list(met), list(not_assessed)
    path = Path(path)
    expected = "a MONA file (CSV or .xlsx)"
    if not path.exists():
        raise DataError(f"{path}: file not found; expected {expected}")
    if not path.is_file():
        raise DataError(f"{path}: not a file; expected {expected}")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise DataError(
            f"{path}: cannot be read ({exc.strerror or exc}); expected {expected}"
        ) from None
    digest = hashlib.sha256(raw).hexdigest()
    if expected_sha256 and digest != expected_sha256:
        raise DataError(
            f"{path}: sha256 is {digest}, expected {expected_sha256} (key 'data.sha256'); "
            "the file differs from the vintage the parameters name"
        )
    if not raw.strip():
        raise DataError(f"{path}: the file is empty; expected a header row and MONA records")
    repairs: list[str] = []
    header, body, encoding, source_format = read_records(raw, path, repairs)
    schema = detect_schema(header, path)
    src = pd.DataFrame(body, columns=header, dtype="str")
    policy = "non_met" if unrecognised == "error" else unrecognised
    out = normalise_rows(src, schema, met, not_assessed, policy)
    unknown_mask = unrecognised_statuses(out["status"], met, not_assessed)
    unknown = out.loc[unknown_mask, "status"].value_counts()
    unknown_d = {str(k): int(v) for k, v in unknown.items()}
    if unknown_d and unrecognised == "error":
        col = SCHEMAS[schema]["status"]
        first = int(np.flatnonzero(unknown_mask.to_numpy())[0])
        raise DataError(
            f"{path}: column {col!r} has {int(unknown.sum())} unrecognised status value(s) "
            f"{unknown_d} (first in record {first + 1}: {out['status_raw'].iloc[first]!r}); "
            f"expected a MONA code {[c for c in KNOWN_STATUSES if c]}, a spelled-out status "
            "('Met', 'Not met', 'Partially met', 'Waived', ...) or one listed in data.labels.met / "
            "data.labels.not_assessed. data.labels.unrecognised is 'error'; 'non_met' groups them "
            "under Non-MET as the paper does, 'exclude' drops them"
        )
    status_table = (
        out.groupby(["status_raw", "status", "label"], dropna=False)
        .size()
        .rename("count")
        .reset_index()
        .sort_values("count", ascending=False, kind="stable")
        .reset_index(drop=True)
    )
    status_table["meaning"] = status_table["status"].map(KNOWN_STATUSES).fillna("UNKNOWN CODE")
    if unknown_d:
        log.warning(
            "%s: unrecognised status codes %s (data.labels.unrecognised: %s): %s",
            path,
            UNRECOGNISED_POLICIES[unrecognised],
            unrecognised,
            unknown_d,
        )
    report = LoadReport(
        path=str(path),
        sha256=digest,
        schema=schema,
        encoding=encoding,
        rows_read=len(out),
        repairs=repairs,
        status_table=status_table,
        label_counts={k: int(v) for k, v in out["label"].value_counts().items()},
        unknown_statuses=unknown_d,
        test_year_sources={k: int(v) for k, v in out["test_year_source"].value_counts().items()},
        source_format=source_format,
        unrecognised_policy=unrecognised,
    )
    for r in repairs:
        log.warning("%s: repaired: %s", path, r)
    return MonaTable(out, report)


def _col(src: pd.DataFrame, name: str | None, default: str = "") -> pd.Series:
    if name is None or name not in src.columns:
        return pd.Series([default] * len(src), index=src.index, dtype="str")
    return src[name].fillna(default).astype("str").str.strip()


def normalise_rows(
    src: pd.DataFrame,
    schema: str,
    met: Iterable[str],
    not_assessed: Iterable[str],
    unrecognised: str = "non_met",
) -> pd.DataFrame:
    m = SCHEMAS[schema]
    out = pd.DataFrame(index=src.index)
    out["row_id"] = np.arange(len(src), dtype=np.int64)
    out["country"] = _col(src, m["country"]).str.upper().str.replace(r"\s+", " ", regex=True)
    out["arrangement_type"] = _col(src, m["arrangement_type"]).replace("", "unknown")
    arr_id = _col(src, m["arrangement_id"])
    approval = _col(src, m["approval_date"])
    # Without an arrangement id, country + type + approval date identify a programme.
    fallback_id = out["country"] + "|" + out["arrangement_type"] + "|" + approval
    out["arrangement_id"] = arr_id.where(arr_id != "", fallback_id)
    descriptor = _col(src, m["econ_descriptor"]).str.replace(r"\s+", " ", regex=True)
    out["econ_descriptor"] = descriptor.replace("", "unknown")
    code = _col(src, m["econ_code"])
    from_descriptor = descriptor.str.extract(r"^(\d+(?:\.\d+)*)\.?\s")[0].fillna("")
    out["econ_code"] = code.where(code != "", from_descriptor).replace("", "unknown")
    out["econ_area"] = out["econ_descriptor"].map(econ_area)
    ctype = _col(src, m["condition_type"])
    if (ctype == "").all():
        for alt in CONDITION_TYPE_FALLBACKS:
            if alt in src.columns:
                ctype = _col(src, alt)
                break
    ctype = ctype.str.upper()
    out["condition_type"] = ctype.where(ctype.isin(CONDITION_TYPES), "unknown")
    out["description"] = _col(src, m["description"]).str.replace(r"\s+", " ", regex=True)
    test_raw = _col(src, m["test_date"])
    approval_ts = approval.map(parse_date)
    board_ts = _col(src, m["board_date"]).map(parse_date)
    review = _col(src, m["review_type"])
    derived = [
        derive_test_year(t, a, b, r)
        for t, a, b, r in zip(test_raw, approval_ts, board_ts, review, strict=True)
    ]
    out["approval_date"] = pd.to_datetime(pd.Series([a for a in approval_ts], index=src.index))
    out["test_date_raw"] = test_raw
    out["test_date"] = pd.to_datetime(pd.Series([d[0] for d in derived], index=src.index))
    out["test_year"] = pd.array([d[1] for d in derived], dtype="Int64")
    out["test_year_source"] = [d[2] for d in derived]
    out["review_type"] = review
    out["status_raw"] = src[m["status"]].fillna("").astype("str")
    out["status"] = out["status_raw"].map(normalise_status)
    out["label"] = label_statuses(out["status"], met, not_assessed, unrecognised)
    out["y"] = pd.array(
        [1 if lab == "MET" else 0 if lab == "Non-MET" else pd.NA for lab in out["label"]],
        dtype="Int8",
    )
    empty_desc = (out["description"] == "") & (out["label"] != "excluded")
    if empty_desc.any():
        log.warning("%d labelled rows have an empty description", int(empty_desc.sum()))
    return out.reset_index(drop=True)


def subsample_arrangements(df: pd.DataFrame, max_rows: int, seed: int) -> pd.DataFrame:
    """Whole arrangements in seeded random order until `max_rows` (keeps programmes intact)."""
    if len(df) <= max_rows:
        return df
    rng = np.random.default_rng(seed)
    ids = np.array(sorted(df["arrangement_id"].astype(str).unique()), dtype=object)
    rng.shuffle(ids)
    sizes = df.groupby("arrangement_id").size()
    keep, total = [], 0
    for a in ids:
        if total + sizes[a] > max_rows and keep:
            continue
        keep.append(a)
        total += sizes[a]
    return df[df["arrangement_id"].isin(keep)].reset_index(drop=True)
