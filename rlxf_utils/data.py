"""MONA data layer: read either MONA schema into one normalised table, label it, split it.

`load_mona` reads the 2002–2013 vintage (`CountryName, ArrType, EconDescrpt, Descpt, ...`) or
the current IMF export (`Country Name, Arrangement Type, Economic Descriptor, Description, ...`),
from a CSV (comma, semicolon or tab, detected) or an Excel `.xlsx` workbook (the first sheet with
the required columns). Header names are matched whatever their case and spacing; statuses spelled
out (`Met`, `Not met`, ...) become their MONA codes. It repairs what can be repaired out loud
(cp1252 bytes, a truncated last line) and refuses the rest with a message naming the file, the
field and what was expected. `Comments` is written after the outcome and states it, so it is
dropped at load: no normalised table carries it.
"""

from __future__ import annotations

import csv
import datetime
import functools
import hashlib
import io
import logging
import re
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from .prompts import econ_area

__all__ = [
    "DataError",
    "LoadReport",
    "MonaTable",
    "build_contexts",
    "label_statuses",
    "load_holdout",
    "load_mona",
    "make_splits",
    "near_duplicates_across",
    "nest_evaluation_holdout",
    "normalise_header",
    "normalise_status",
    "read_records",
    "subsample_arrangements",
    "unrecognised_statuses",
]

log = logging.getLogger(__name__)

#: Status codes MONA uses (after normalisation), with their meaning, for the status report.
KNOWN_STATUSES: dict[str, str] = {
    "M": "met",
    "PM": "partly met",
    "NM": "not met",
    "W": "waived",
    "DL": "delayed",
    "MD": "met with delay",
    "MOD": "modified",
    "CAN": "cancelled",
    "WM": "waived/modified",
    "MMOD": "met/modified",
    "SB": "specified for a later review (benchmark)",
    "PC": "specified for a later review (performance criterion)",
    "PA": "specified for a later review (prior action)",
    "": "empty",
}

#: Statuses spelled out (as the current export and hand-made spreadsheets write them) -> code.
#: Matched in upper case with everything but letters and digits removed: 'Not met', 'NOT-MET'
#: and 'not  met' are all 'NM'.
STATUS_WORDS: dict[str, tuple[str, ...]] = {
    "M": ("met", "fully met", "observed", "implemented"),
    "PM": (
        "partially met",
        "partly met",
        "partially observed",
        "partly observed",
        "partially implemented",
        "partly implemented",
    ),
    "NM": ("not met", "unmet", "not observed", "not implemented", "missed"),
    "W": ("waived", "waiver", "waiver granted"),
    "DL": ("delayed", "delay"),
    "MD": (
        "met with delay",
        "met with a delay",
        "met with delays",
        "met late",
        "implemented with delay",
        "implemented with a delay",
    ),
    "MOD": ("modified", "modification"),
    "CAN": ("cancelled", "canceled", "cancellation"),
    "WM": ("waived/modified", "waived and modified"),
    "MMOD": ("met/modified", "met and modified", "met as modified"),
    "SB": ("structural benchmark",),
    "PC": ("performance criterion", "structural performance criterion"),
    "PA": ("prior action",),
}


def _status_key(text: str) -> str:
    return re.sub(r"[^0-9A-Z]", "", text.upper())


STATUS_ALIASES: dict[str, str] = {
    _status_key(word): code for code, words in STATUS_WORDS.items() for word in words
}
#: What an unrecognised status becomes (`data.labels.unrecognised`); the paper's grouping first.
UNRECOGNISED_POLICIES: dict[str, str] = {
    "non_met": "counted as Non-MET",
    "exclude": "excluded",
    "error": "refused",
}

#: Normalised column -> source column, per schema. `None` means the schema lacks it.
SCHEMAS: dict[str, dict[str, str | None]] = {
    "mona_2002_vintage": {
        "country": "CountryName",
        "arrangement_id": "ArrID",
        "arrangement_type": "ArrType",
        "approval_date": "ApprovalDate",
        "board_date": "BoardActDate",
        "review_type": "ReviewType",
        "econ_code": None,
        "econ_descriptor": "EconDescrpt",
        "condition_type": "SPC_PA_SB",
        "description": "Descpt",
        "test_date": "TestDate",
        "status": "Status",
    },
    "imf_current_export": {
        "country": "Country Name",
        "arrangement_id": "Arrangement Number",
        "arrangement_type": "Arrangement Type",
        "approval_date": "Approval Date",
        "board_date": "Board Action Date",
        "review_type": "Review Type",
        "econ_code": "Economic Code",
        "econ_descriptor": "Economic Descriptor",
        "condition_type": "Structural Conditionality Type",
        "description": "Description",
        "test_date": "Test Date",
        "status": "PC Status",
    },
}

#: Columns without which a schema cannot be used (the rest are filled with `unknown`/NA).
REQUIRED: dict[str, tuple[str, ...]] = {
    "mona_2002_vintage": ("CountryName", "ArrType", "EconDescrpt", "Descpt", "TestDate", "Status"),
    "imf_current_export": (
        "Country Name",
        "Economic Descriptor",
        "Description",
        "Test Date",
        "PC Status",
    ),
}
CONDITION_TYPES = {"SPC", "PA", "SB", "SAC", "QPC", "IT"}
#: Alternative columns for the condition type in exports that name it differently.
CONDITION_TYPE_FALLBACKS = ("SPC_PA_SB", "Condition Type", "Description Code")
OUTCOME_COLUMNS = ("Comments", "comments")
#: The vintage's columns (data/raw/SOURCE.md) for their canonical spelling; its outcome column is
#: `OUTCOME_COLUMNS`, named there only.
VINTAGE_COLUMNS = (
    "CountryName",
    "ArrID",
    "ArrType",
    "ApprovalDate",
    "InitialEndDate",
    "RevisedEndDate",
    "IniPgmYr",
    "BoardActDate",
    "ReviewType",
    "ReviewSequence",
    "EconDescrpt",
    "Descpt",
    "CondtOriginTxt",
    "SPC_PA_SB",
    "CondtSource",
    "CondtSourceTxt",
    "LeadInst",
    "TestDate",
    "Status",
)
#: Separators a MONA CSV may use (European spreadsheet locales write ';'), with their names.
DELIMITERS: dict[str, str] = {",": "comma", ";": "semicolon", "\t": "tab"}
#: How many non-empty rows of a sheet are searched for the header (titles may sit above it).
HEADER_SCAN_ROWS = 20

ORDINALS = {
    w: i
    for i, w in enumerate(
        [
            "first",
            "second",
            "third",
            "fourth",
            "fifth",
            "sixth",
            "seventh",
            "eighth",
            "ninth",
            "tenth",
            "eleventh",
            "twelfth",
        ],
        start=1,
    )
}


class DataError(ValueError):
    """A MONA file that cannot be used; the message names the file, the field and what was expected."""


@dataclass
class LoadReport:
    """What the loader made of a file: schema, rows, repairs, statuses and their labels."""

    path: str
    sha256: str
    schema: str
    encoding: str
    rows_read: int
    repairs: list[str] = field(default_factory=list)
    status_table: pd.DataFrame | None = None
    label_counts: dict[str, int] = field(default_factory=dict)
    unknown_statuses: dict[str, int] = field(default_factory=dict)
    test_year_sources: dict[str, int] = field(default_factory=dict)
    source_format: str = "CSV, comma-separated"
    unrecognised_policy: str = "non_met"

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "status_table"}
        if self.status_table is not None:
            out["status_table"] = self.status_table.to_dict(orient="records")
        return out

    def render(self) -> str:
        """Human-readable summary (what `rlxf data summary` prints)."""
        n_lab = self.label_counts.get("MET", 0) + self.label_counts.get("Non-MET", 0)
        met_share = self.label_counts.get("MET", 0) / n_lab if n_lab else float("nan")
        n_excl = self.label_counts.get("excluded", 0)
        n_unknown = sum(self.unknown_statuses.values())
        if self.unrecognised_policy == "exclude" and n_unknown:
            why = f"not assessed yet {n_excl - n_unknown}; unrecognised status {n_unknown}"
        else:
            why = "not assessed yet"
        lines = [
            f"file:       {self.path}",
            f"format:     {self.source_format}",
            f"sha256:     {self.sha256}",
            f"schema:     {self.schema}",
            f"encoding:   {self.encoding}",
            f"rows read:  {self.rows_read}",
            f"labelled:   {n_lab} (MET {self.label_counts.get('MET', 0)}, "
            f"Non-MET {self.label_counts.get('Non-MET', 0)}, MET share {met_share:.3f})",
            f"excluded:   {n_excl} ({why})",
            "test year from: "
            + ", ".join(f"{k} {v}" for k, v in sorted(self.test_year_sources.items())),
            "repairs:    " + ("; ".join(self.repairs) if self.repairs else "none"),
        ]
        if self.unknown_statuses:
            policy = self.unrecognised_policy
            lines.append(
                f"WARNING unknown status codes ({UNRECOGNISED_POLICIES.get(policy, policy)}; "
                f"data.labels.unrecognised: {policy}): "
                + ", ".join(f"{k!r} x{v}" for k, v in self.unknown_statuses.items())
            )
        if self.status_table is not None:
            lines.append("statuses (raw -> normalised -> label):")
            for r in self.status_table.itertuples(index=False):
                lines.append(
                    f"  {r.status_raw!r:>8} -> {r.status!r:<7} {r.label:<9} {r.count:>6}  {r.meaning}"
                )
        return "\n".join(lines)


@dataclass
class MonaTable:
    """A normalised MONA table and the report of how it was read."""

    frame: pd.DataFrame
    report: LoadReport

    @property
    def labelled(self) -> pd.DataFrame:
        return self.frame[self.frame["label"] != "excluded"].reset_index(drop=True)


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------
def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _decode(raw: bytes, path: Path, repairs: list[str]) -> tuple[str, str]:
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    try:
        return raw.decode("utf-8"), "utf-8"
    except UnicodeDecodeError as exc:
        text = raw.decode("cp1252", errors="replace")
        repairs.append(
            f"bytes not valid UTF-8 (first at byte {exc.start}); decoded as cp1252 instead"
        )
        log.warning("%s: not valid UTF-8 at byte %d; decoded as cp1252", path, exc.start)
        return text, "cp1252"


def _header_key(name: Any) -> str:
    """A column name compared without case and with whitespace runs as one space."""
    return " ".join(str(name).split()).casefold()


def _known_columns() -> dict[str, str]:
    names = [c for m in SCHEMAS.values() for c in m.values() if c]
    names += [c for r in REQUIRED.values() for c in r]
    names += [*CONDITION_TYPE_FALLBACKS, *VINTAGE_COLUMNS, OUTCOME_COLUMNS[0]]
    out: dict[str, str] = {}
    for n in names:
        out.setdefault(_header_key(n), n)
    return out


#: Normalised name -> the spelling the schemas use, for every column the package knows.
CANONICAL_COLUMNS: dict[str, str] = _known_columns()


def _column_ref(i: int, letters: bool) -> str:
    if not letters:
        return f"column {i + 1}"
    s, n = "", i + 1
    while n:
        n, r = divmod(n - 1, 26)
        s = chr(65 + r) + s
    return f"column {s}"


def normalise_header(
    header: Iterable[Any], path: str | Path = "<data>", where: str = "", letters: bool = False
) -> list[str]:
    """Column names matched whatever their case and spacing: `' country  NAME'` -> `'Country Name'`.

    A column the package knows takes its schema spelling; any other is trimmed, its inner
    whitespace collapsed. Two columns that become the same name (`Description` and
    `Description `) are a DataError naming both: the loader cannot tell which one is meant.
    `where` (e.g. `, sheet 'Data'`) and `letters` (spreadsheet column letters) shape the message.
    """
    raw = ["" if h is None else str(h) for h in header]
    seen: dict[str, int] = {}
    out: list[str] = []
    for i, name in enumerate(raw):
        key = _header_key(name)
        if key and key in seen:
            j = seen[key]
            raise DataError(
                f"{path}{where}: {_column_ref(j, letters)} {raw[j]!r} and {_column_ref(i, letters)} "
                f"{name!r} are the same column once case and spaces are ignored ({key!r}); "
                "expected each column name once: delete or rename one of them"
            )
        seen[key] = i
        out.append(CANONICAL_COLUMNS.get(key, " ".join(name.split())))
    return out


def _matching_schema(columns: Iterable[str]) -> str | None:
    keys = {_header_key(c) for c in columns}
    for name, required in REQUIRED.items():
        if all(_header_key(c) in keys for c in required):
            return name
    return None


def sniff_delimiter(text: str) -> tuple[str, str]:
    """(delimiter, text): the separator of a CSV's header line and the text to parse.

    Comma, semicolon or tab, whichever occurs most often outside quotes in the header line
    (comma on a tie or when none occurs). A first line `sep=;` (a hint Excel writes and reads)
    names the delimiter and is removed from the text.
    """
    first = text.lstrip("\r\n").split("\n", 1)[0].strip()
    hint = re.fullmatch(r"(?i)sep=(.)", first)
    if hint and hint.group(1) in DELIMITERS:
        rest = text.lstrip("\r\n").split("\n", 1)
        return hint.group(1), rest[1] if len(rest) > 1 else ""
    counts = dict.fromkeys(DELIMITERS, 0)
    quoted = started = False
    for ch in text[: 1 << 16]:
        if ch in "\r\n" and not quoted:
            if started:
                break
            continue
        started = True
        if ch == '"':
            quoted = not quoted
        elif not quoted and ch in counts:
            counts[ch] += 1
    best = max(counts, key=lambda d: counts[d])
    return (best if counts[best] else ","), text


def _parse_records(
    text: str, path: Path, repairs: list[str], delimiter: str | None = None
) -> tuple[list[str], list[list[str]]]:
    """CSV records with a check that every row has the header's width; a cut last line is dropped.

    The delimiter is detected (`sniff_delimiter`) unless given; the header is normalised
    (`normalise_header`).
    """
    if delimiter is None:
        delimiter, text = sniff_delimiter(text)
    sep = f"{DELIMITERS.get(delimiter, repr(delimiter))}-separated"
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter, strict=True)
    records: list[list[str]] = []
    try:
        records.extend(reader)
    except csv.Error as exc:
        # An unterminated quote at the end of the file: the last record was cut mid-field.
        if "unexpected end of data" not in str(exc):
            raise DataError(
                f"{path}: CSV syntax error near line {reader.line_num}: {exc}; "
                f"expected {sep} values with double-quoted fields"
            ) from None
        repairs.append(
            f"truncated last record (from line {reader.line_num}, an unterminated quote) dropped; "
            "the file looks cut short"
        )
    records = [r for r in records if any(cell.strip() for cell in r)]
    if not records:
        raise DataError(f"{path}: the file is empty; expected a header row and MONA records")
    header = normalise_header(records[0], path)
    body = records[1:]
    if not body:
        raise DataError(f"{path}: only a header row, no records; expected MONA conditions")
    width = len(header)
    bad = [i for i, r in enumerate(body) if len(r) != width]
    if bad and bad[-1] == len(body) - 1 and len(body[-1]) < width:
        repairs.append(
            f"truncated last line dropped (it had {len(body[-1])} of {width} fields); "
            "the file looks cut short"
        )
        body = body[:-1]
        bad = bad[:-1]
    if bad:
        i = bad[0]
        raise DataError(
            f"{path}: record {i + 1} (after the header) has {len(body[i])} fields, expected "
            f"{width} as in the header ({sep}, detected from the header line); {len(bad)} "
            "record(s) have the wrong width"
        )
    return header, body


def _cell_text(value: Any) -> str:
    """A spreadsheet cell as the text a CSV export would hold (dates as ISO dates)."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "TRUE" if value else "FALSE"
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, datetime.datetime):
        if value.time() == datetime.time(0):
            return value.strftime("%Y-%m-%d")
        return value.strftime("%Y-%m-%dT%H:%M:%S")
    if isinstance(value, datetime.date):
        return value.isoformat()
    return str(value)


def _read_xlsx(
    raw: bytes, path: Path, repairs: list[str]
) -> tuple[list[str], list[list[str]], str]:
    """(header, records, where): the first sheet whose header row has a schema's required columns.

    The header is searched in each sheet's first `HEADER_SCAN_ROWS` non-empty rows (a title may
    sit above it); rows above it are skipped and reported in `where`.
    """
    try:
        from openpyxl import load_workbook
    except ImportError:
        raise DataError(
            f"{path}: reading an .xlsx workbook needs openpyxl (pinned in pyproject.toml); "
            "run `make install`, or save the sheet as CSV"
        ) from None
    try:
        with warnings.catch_warnings():  # styles and validations it cannot read: values are fine
            warnings.filterwarnings("ignore", category=UserWarning, module="openpyxl")
            wb = load_workbook(io.BytesIO(raw), read_only=True, data_only=True)
    except Exception as exc:  # a zip that is no workbook fails in many ways inside openpyxl
        raise DataError(
            f"{path}: not a readable .xlsx workbook ({type(exc).__name__}: {exc}); expected an "
            "Excel workbook (.xlsx) or a CSV file"
        ) from None
    try:
        found: list[str] = []
        for ws in wb.worksheets:
            rows = ws.iter_rows(values_only=True)
            header: list[str] | None = None
            first: list[str] | None = None
            header_row = scanned = 0
            for i, row in enumerate(rows, start=1):
                cells = [_cell_text(v) for v in row]
                if not any(c.strip() for c in cells):
                    continue
                scanned += 1
                if first is None:
                    first = [" ".join(c.split()) for c in cells if c.strip()]
                if _matching_schema(cells) is not None:
                    header, header_row = cells, i
                    break
                if scanned >= HEADER_SCAN_ROWS:
                    break
            if header is None:
                cols = "empty" if first is None else f"first row {first[:12]}"
                found.append(f"{ws.title!r} ({cols}{', ...' if first and len(first) > 12 else ''})")
                continue
            where = f", sheet {ws.title!r}"
            width = max(j for j, c in enumerate(header) if c.strip()) + 1
            names = normalise_header(header[:width], path, where, letters=True)
            body: list[list[str]] = []
            beyond = 0
            for row in rows:
                cells = [_cell_text(v) for v in row]
                if not any(c.strip() for c in cells):
                    continue
                if any(c.strip() for c in cells[width:]):
                    beyond += 1
                body.append((cells + [""] * width)[:width])
            if not body:
                raise DataError(
                    f"{path}{where}: only a header row, no records; expected MONA conditions"
                )
            if beyond:
                repairs.append(
                    f"sheet {ws.title!r}: {beyond} row(s) have values right of the last named "
                    "column; ignored"
                )
            skipped = scanned - 1
            desc = f"sheet {ws.title!r}, header on row {header_row}"
            if skipped:
                desc += f" ({skipped} non-empty row(s) above it skipped)"
            if found:
                desc += f"; sheets without the columns: {'; '.join(found)}"
            return names, body, desc
    finally:
        wb.close()
    raise DataError(
        f"{path}: no sheet has the columns of a MONA export; sheets found: {'; '.join(found)}. "
        "Expected a sheet whose header row (within its first "
        f"{HEADER_SCAN_ROWS} non-empty rows) has "
        + " or ".join(f"{n}: {list(r)}" for n, r in REQUIRED.items())
    )


_ZIP_MAGIC = b"PK\x03\x04"
_OLE_MAGIC = b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1"


def read_records(
    raw: bytes, path: Path, repairs: list[str]
) -> tuple[list[str], list[list[str]], str, str]:
    """(header, records, encoding, format) of a MONA file's bytes: an .xlsx workbook or a CSV.

    The reader behind `load_mona`: any other reader of the raw file should use it too, so that
    record numbers (`row_id`) agree. A workbook is recognised by its zip signature or its
    `.xlsx`/`.xlsm` name; an Excel 97-2003 `.xls` is refused with what to do; anything else is
    read as CSV (`_decode`, `sniff_delimiter`, `_parse_records`).
    """
    suffix = path.suffix.lower()
    if raw.startswith(_OLE_MAGIC) or suffix == ".xls":
        raise DataError(
            f"{path}: an Excel 97-2003 workbook (.xls), which is not read; expected an .xlsx "
            "workbook or a CSV file: open it in a spreadsheet and save it as .xlsx or CSV"
        )
    if raw.startswith(_ZIP_MAGIC) or suffix in (".xlsx", ".xlsm"):
        header, body, where = _read_xlsx(raw, path, repairs)
        return header, body, "xlsx", f"Excel workbook, {where}"
    text, encoding = _decode(raw, path, repairs)
    delimiter, text = sniff_delimiter(text)
    header, body = _parse_records(text, path, repairs, delimiter)
    return header, body, encoding, f"CSV, {DELIMITERS[delimiter]}-separated"


def detect_schema(columns: Iterable[str], path: str | Path = "<data>") -> str:
    """Name of the schema whose required columns are all present, or a DataError listing both.

    Names are compared without case and with whitespace runs as one space.
    """
    cols = [str(c) for c in columns]
    found = _matching_schema(cols)
    if found is not None:
        return found
    keys = {_header_key(c) for c in cols}
    missing_of = {n: [c for c in r if _header_key(c) not in keys] for n, r in REQUIRED.items()}
    closest = min(REQUIRED, key=lambda n: len(missing_of[n]))
    raise DataError(
        f"{path}: missing required column(s) {missing_of[closest]} for the {closest} schema; "
        f"found columns {sorted(c for c in cols if c)}. Expected either "
        + " or ".join(f"{n}: {list(r)}" for n, r in REQUIRED.items())
        + " (case and spacing of the names do not matter)"
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
    key = _status_key(code)
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
def _parse_date(s: str) -> pd.Timestamp | None:
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
    parsed = _parse_date(test_date)
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
    out = _normalise(src, schema, met, not_assessed, policy)
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


def _normalise(
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
    approval_ts = approval.map(_parse_date)
    board_ts = _col(src, m["board_date"]).map(_parse_date)
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


# --------------------------------------------------------------------------------------------
# Subsample, splits, near-duplicates, contexts
# --------------------------------------------------------------------------------------------
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


def _stratified_take(ids: np.ndarray, y: np.ndarray, frac: float, rng: np.random.Generator):
    """Split `ids` into (rest, taken) with `frac` of each label class taken."""
    taken = []
    for cls in np.unique(y):
        cls_ids = ids[y == cls].copy()
        rng.shuffle(cls_ids)
        k = round(len(cls_ids) * frac)
        taken.extend(cls_ids[:k].tolist())
    taken_set = set(taken)
    rest = [i for i in ids.tolist() if i not in taken_set]
    return sorted(rest), sorted(taken)


def _grouped_take(ids: np.ndarray, groups: np.ndarray, frac: float, rng: np.random.Generator):
    """Split `ids` into (rest, taken) by whole groups, taking groups until `frac` of rows."""
    uniq = pd.unique(groups)
    order = rng.permutation(len(uniq))
    target = frac * len(ids)
    counts = pd.Series(groups).value_counts()
    chosen, n = set(), 0
    for j in order:
        g = uniq[j]
        if n >= target:
            break
        chosen.add(g)
        n += counts[g]
    mask = np.array([g in chosen for g in groups])
    return sorted(ids[~mask].tolist()), sorted(ids[mask].tolist())


def make_splits(
    labelled: pd.DataFrame,
    seed: int,
    test_fraction: float = 0.2,
    validation_fraction: float = 0.1,
    temporal_cutoff_year: int = 2010,
) -> dict[str, dict[str, list[int]]]:
    """The three protocols as row_id lists: random (stratified), grouped (by arrangement), temporal.

    Each has train/val/test; val is carved from the training side the same way the protocol
    separates train from test (stratified, by arrangement, or stratified within the past).
    """
    ids = labelled["row_id"].to_numpy()
    y = labelled["y"].astype(int).to_numpy()
    groups = labelled["arrangement_id"].astype(str).to_numpy()
    by_id = labelled.set_index("row_id")
    out: dict[str, dict[str, list[int]]] = {}

    rng = np.random.default_rng(seed)
    train, test = _stratified_take(ids, y, test_fraction, rng)
    tr = np.array(train)
    train, val = _stratified_take(
        tr, by_id.loc[tr, "y"].astype(int).to_numpy(), validation_fraction, rng
    )
    out["random"] = {"train": train, "val": val, "test": test}

    rng = np.random.default_rng(seed + 1)
    train, test = _grouped_take(ids, groups, test_fraction, rng)
    tr = np.array(train)
    train, val = _grouped_take(
        tr, by_id.loc[tr, "arrangement_id"].astype(str).to_numpy(), validation_fraction, rng
    )
    out["grouped"] = {"train": train, "val": val, "test": test}

    rng = np.random.default_rng(seed + 2)
    year = labelled["test_year"]
    known = year.notna().to_numpy()
    past = known & (year.fillna(-1).to_numpy() <= temporal_cutoff_year)
    future = known & (year.fillna(-1).to_numpy() > temporal_cutoff_year)
    tr = ids[past]
    train, val = _stratified_take(tr, y[past], validation_fraction, rng)
    out["temporal"] = {"train": train, "val": val, "test": sorted(ids[future].tolist())}
    for name, parts in out.items():
        for part, rows in parts.items():
            if not rows:
                raise DataError(
                    f"split '{name}' has an empty '{part}' part ({len(labelled)} labelled rows); "
                    "check data.max_rows, data.splits.* fractions and temporal_cutoff_year"
                )
    return out


def nest_evaluation_holdout(
    labelled: pd.DataFrame,
    splits: dict[str, dict[str, list[int]]],
    protocol: str,
    eval_countries: Iterable[str],
    seed: int,
    validation_fraction: float = 0.1,
) -> tuple[dict[str, dict[str, list[int]]], dict[str, Any]]:
    """Nest the RL evaluation inside the reward protocol's test split; carve a disjoint audit slice.

    RL is evaluated on the contexts of held-out countries, and its history references (real MET
    and Non-MET descriptions) come from those countries. So that neither the reward model nor the
    audit model ever trained on a reference, every row of an evaluation country moves from the
    reward protocol's train/val into its test part (whole countries, hence whole arrangements: the
    grouped protocol stays grouped). The rest of that test part, the held-out rows of training
    countries, trains the audit model, split by arrangement into `audit_train` / `audit_val`; it
    shares no row with the reward model's training data. Returns (new splits, holdout), holdout
    holding row_id lists `reference`, `audit_train`, `audit_val` and the country list.
    """
    if protocol not in splits:
        raise DataError(
            f"reward.reward_protocol is {protocol!r} but the splits are {sorted(splits)}"
        )
    held = sorted({str(c) for c in eval_countries})
    country = labelled.set_index("row_id")["country"].astype(str)
    in_eval = set(country.index[country.isin(held)].tolist())
    sp = splits[protocol]
    nested = {
        "train": [i for i in sp["train"] if i not in in_eval],
        "val": [i for i in sp["val"] if i not in in_eval],
        "test": sorted(set(sp["test"]) | in_eval),
    }
    audit = np.array([i for i in nested["test"] if i not in in_eval], dtype=np.int64)
    arr = labelled.set_index("row_id").loc[audit, "arrangement_id"].astype(str).to_numpy()
    audit_train, audit_val = _grouped_take(
        audit, arr, validation_fraction, np.random.default_rng(seed + 4)
    )
    holdout = {
        "reward_protocol": protocol,
        "eval_countries": held,
        "reference": sorted(in_eval),
        "audit_train": audit_train,
        "audit_val": audit_val,
    }
    for name in ("train", "val"):
        if not nested[name]:
            raise DataError(
                f"reward protocol {protocol!r} has no {name} rows once the evaluation countries "
                "are held out; lower data.splits.context_eval_fraction"
            )
    for name in ("reference", "audit_train"):
        if not holdout[name]:
            raise DataError(
                f"the evaluation holdout has no {name!r} rows ({len(labelled)} labelled rows); "
                "check data.splits.test_fraction and context_eval_fraction"
            )
    out = dict(splits)
    out[protocol] = nested
    return out, holdout


def load_holdout(run: Any) -> dict[str, Any]:
    """`data/holdout.json` (see `nest_evaluation_holdout`), written by notebook 01."""
    h = run.read_json("data/holdout.json", "notebook 01_data_exploration")
    missing = [k for k in ("reference", "audit_train", "audit_val", "eval_countries") if k not in h]
    if missing:
        raise DataError(
            f"{run.path('data/holdout.json')}: fields {missing} missing; rerun notebook 01"
        )
    return h


def near_duplicates_across(
    train_texts: list[str], test_texts: list[str], threshold: float = 0.9
) -> dict[str, float]:
    """How many test descriptions have an exact or near duplicate (TF-IDF cosine ≥ threshold) in train."""
    from sklearn.feature_extraction.text import TfidfVectorizer

    norm = [" ".join(t.lower().split()) for t in train_texts]
    norm_test = [" ".join(t.lower().split()) for t in test_texts]
    train_set = set(norm)
    exact = sum(t in train_set for t in norm_test)
    vec = TfidfVectorizer(ngram_range=(1, 2), min_df=1, sublinear_tf=True).fit(norm + norm_test)
    a, b = vec.transform(norm_test), vec.transform(norm)
    best = np.zeros(len(norm_test))
    for start in range(0, len(norm_test), 512):
        sims = (a[start : start + 512] @ b.T).toarray()
        best[start : start + 512] = sims.max(axis=1) if sims.shape[1] else 0.0
    near = int((best >= threshold).sum())
    n = max(len(norm_test), 1)
    return {
        "test_rows": len(norm_test),
        "exact_in_train": int(exact),
        "exact_share": exact / n,
        "near_in_train": near,
        "near_share": near / n,
        "threshold": threshold,
    }


def build_contexts(labelled: pd.DataFrame, seed: int, eval_fraction: float = 0.2) -> pd.DataFrame:
    """Distinct (country, arrangement type, descriptor) with counts, MET rate and a by-country split."""
    keys = ["country", "arrangement_type", "econ_descriptor"]
    ctx = labelled.groupby(keys, sort=True).agg(n=("y", "size"), n_met=("y", "sum")).reset_index()
    ctx["n_met"] = ctx["n_met"].astype(int)
    ctx["met_rate"] = ctx["n_met"] / ctx["n"]
    ctx["econ_area"] = ctx["econ_descriptor"].map(econ_area)
    countries = np.array(sorted(ctx["country"].unique()))
    rng = np.random.default_rng(seed + 3)
    rng.shuffle(countries)
    k = max(1, round(len(countries) * eval_fraction))
    if k >= len(countries):
        raise DataError(
            f"only {len(countries)} countries: cannot hold out {eval_fraction:.0%} for evaluation "
            "(key 'data.splits.context_eval_fraction')"
        )
    held = set(countries[:k].tolist())
    ctx["split"] = np.where(ctx["country"].isin(held), "eval", "train")
    return ctx[[*keys, "econ_area", "n", "n_met", "met_rate", "split"]]


# --------------------------------------------------------------------------------------------
# The data stage and its descriptive tables
# --------------------------------------------------------------------------------------------
def rate_by(labelled: pd.DataFrame, column: str, *, z: float) -> pd.DataFrame:
    """Count, MET count, MET rate and its Wilson interval for each value of `column`, at the
    normal quantile `z` (`rates.wilson_z(evaluation.alpha)`)."""
    g = labelled.groupby(column, sort=True)["y"].agg(n="size", n_met="sum").reset_index()
    g["n_met"] = g["n_met"].astype(int)
    p = g["n_met"] / g["n"]
    denom = 1 + z**2 / g["n"]
    centre = (p + z**2 / (2 * g["n"])) / denom
    half = z * np.sqrt(p * (1 - p) / g["n"] + z**2 / (4 * g["n"] ** 2)) / denom
    g["met_rate"] = p
    g["ci_low"] = centre - half
    g["ci_high"] = centre + half
    return g


def split_summary(labelled: pd.DataFrame, splits: dict[str, dict[str, list[int]]]) -> pd.DataFrame:
    """Rows, MET share and arrangements per protocol and part (train/val/test)."""
    by_id = labelled.set_index("row_id")
    rows = []
    for protocol, parts in splits.items():
        for part, ids in parts.items():
            sub = by_id.loc[ids]
            rows.append(
                {
                    "protocol": protocol,
                    "part": part,
                    "rows": len(sub),
                    "met_share": float(sub["y"].astype(float).mean()),
                    "arrangements": int(sub["arrangement_id"].nunique()),
                    "years": f"{int(sub['test_year'].min())}–{int(sub['test_year'].max())}",
                }
            )
    return pd.DataFrame(rows)


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


def run_data_stage(cfg: Any, run: Any) -> DataStage:
    """Load, label, (sub)sample, split and build contexts; write them to the run dir.

    `cfg` is a `StudyConfig`, `run` a `RunDir`. Writes `data/conditions.parquet`,
    `data/splits.json`, `data/holdout.json` (nest_evaluation_holdout), `data/contexts.parquet`,
    `data/load_report.json`.
    """
    d = cfg.data
    table = load_mona(
        d.path,
        met=d.labels.met,
        not_assessed=d.labels.not_assessed,
        expected_sha256=d.sha256,
        unrecognised=d.labels.unrecognised,
    )
    conditions = table.frame
    subsampled_from = None
    if d.max_rows is not None and len(conditions) > d.max_rows:
        subsampled_from = len(conditions)
        conditions = subsample_arrangements(conditions, d.max_rows, cfg.run.seed)
        log.info("subsampled %d -> %d rows (whole arrangements)", subsampled_from, len(conditions))
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
    run.write_parquet("data/conditions.parquet", conditions)
    run.write_json("data/splits.json", splits)
    run.write_json("data/holdout.json", holdout)
    run.write_parquet("data/contexts.parquet", contexts)
    report = table.report.as_dict()
    report["subsampled_from"] = subsampled_from
    report["rows_used"] = len(conditions)
    report["labelled_used"] = len(labelled)
    run.write_json("data/load_report.json", report)
    return DataStage(
        table, conditions, labelled, splits, contexts, duplicates, subsampled_from, holdout
    )


def load_splits(run: Any) -> tuple[pd.DataFrame, dict[str, dict[str, list[int]]]]:
    """The labelled conditions and the splits written by notebook 01 (for later stages)."""
    stage = "notebook 01_data_exploration"
    cond = run.read_parquet("data/conditions.parquet", stage)
    labelled = cond[cond["label"] != "excluded"].reset_index(drop=True)
    return labelled, run.read_json("data/splits.json", stage)
