"""Reading a MONA file as records: decoding, delimiter sniffing, CSV and .xlsx parsing, and the
load report that says what was read and repaired."""

from __future__ import annotations

import csv
import datetime
import io
import logging
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from rlxf_utils.data.schema import (
    DELIMITERS,
    HEADER_SCAN_ROWS,
    REQUIRED,
    UNRECOGNISED_POLICIES,
    DataError,
    matching_schema,
    normalise_header,
)

log = logging.getLogger(__name__)


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


#: Byte-order marks a spreadsheet program writes, longest first (UTF-32's starts like UTF-16's).
BOMS = (
    (b"\xff\xfe\x00\x00", "utf-32-le"),
    (b"\x00\x00\xfe\xff", "utf-32-be"),
    (b"\xef\xbb\xbf", "utf-8"),
    (b"\xff\xfe", "utf-16-le"),
    (b"\xfe\xff", "utf-16-be"),
)
#: Tried in order when there is no byte-order mark (strictly: nothing is replaced).
FALLBACKS = ("utf-8", "cp1252")


def detect_encoding(raw: bytes) -> tuple[str | None, int, str]:
    """(encoding, bytes to skip, how it was found) from a byte-order mark, or from the zero bytes
    that UTF-16 text without one has in every other position; (None, 0, '') when neither tells."""
    for bom, name in BOMS:
        if raw.startswith(bom):
            return name, len(bom), "byte-order mark"
    head = raw[:4096]
    if len(head) >= 4:
        even, odd = head[0::2].count(0), head[1::2].count(0)
        if odd > 0.4 * len(head[1::2]) and even < 0.05 * len(head[0::2]):
            return "utf-16-le", 0, "zero bytes in every other position"
        if even > 0.4 * len(head[0::2]) and odd < 0.05 * len(head[1::2]):
            return "utf-16-be", 0, "zero bytes in every other position"
    return None, 0, ""


def _decode(raw: bytes, path: Path, repairs: list[str]) -> tuple[str, str]:
    """The file's text and the encoding it was read with: the one a byte-order mark or UTF-16's
    zero bytes name, else UTF-8, else Windows-1252 (a repair, noted). Nothing is decoded with
    replacement characters: a file none of them reads is an error naming what was tried."""
    name, skip, how = detect_encoding(raw)
    if name is not None:
        try:
            text = raw[skip:].decode(name)
        except UnicodeDecodeError as exc:
            raise DataError(
                f"{path}: the {how} says {name}, but byte {exc.start + skip} is not valid {name}; "
                "expected a text file in one encoding: save it again as UTF-8 CSV"
            ) from None
        if name != "utf-8" or how != "byte-order mark":
            repairs.append(f"read as {name} ({how})")
        return text, name
    failures = []
    for enc in FALLBACKS:
        try:
            text = raw.decode(enc)
        except UnicodeDecodeError as exc:
            failures.append(f"{enc} (byte {exc.start})")
            continue
        if enc != "utf-8":
            repairs.append(f"bytes not valid UTF-8 ({failures[0]}); decoded as {enc} instead")
            log.warning("%s: not valid UTF-8; decoded as %s", path, enc)
        return text, enc
    raise DataError(
        f"{path}: not text in any encoding tried ({', '.join(failures)}, no byte-order mark); "
        "expected a CSV file (UTF-8, UTF-16 or Windows-1252) or an .xlsx workbook"
    )


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
    body = drop_repeats(records[0], records[1:], repairs)
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


def drop_repeats(header: list[str], body: list[list[str]], repairs: list[str]) -> list[list[str]]:
    """`body` without the rows that repeat the header (exports joined together: each brings its
    own header row), noted in `repairs`; rows that repeat an earlier row exactly are kept and
    noted too (the same export joined twice?)."""
    same = [" ".join(c.split()).casefold() for c in header]
    repeats = [i for i, r in enumerate(body) if [" ".join(c.split()).casefold() for c in r] == same]
    if repeats:
        dropped = set(repeats)
        body = [r for i, r in enumerate(body) if i not in dropped]
        repairs.append(
            f"{len(repeats)} repeated header row(s) dropped (first after record {repeats[0]}): "
            "the file looks like exports joined together"
        )
    first: dict[tuple[str, ...], int] = {}
    dups = [(i, first.setdefault(tuple(r), i)) for i, r in enumerate(body)]
    dups = [(i, j) for i, j in dups if i != j]
    if dups:
        i, j = dups[0]
        repairs.append(
            f"{len(dups)} record(s) repeat an earlier record exactly (first: record {i + 1}, as "
            f"record {j + 1}); kept: check the file is not the same export joined twice"
        )
    return body


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
                if matching_schema(cells) is not None:
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
            body = drop_repeats(header[:width], body, repairs)
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
    `.xlsx`/`.xlsm` name; an Excel 97-2003 workbook (its OLE signature, whatever its name) is
    refused with what to do; anything else is read as CSV (`_decode`, `sniff_delimiter`,
    `_parse_records`), a CSV named `.xls` too.
    """
    suffix = path.suffix.lower()
    if raw.startswith(_OLE_MAGIC):
        raise DataError(
            f"{path}: an Excel 97-2003 workbook (.xls), which is not read; expected an .xlsx "
            "workbook or a CSV file: open it in a spreadsheet and save it as .xlsx or CSV"
        )
    if raw.startswith(_ZIP_MAGIC) or suffix in (".xlsx", ".xlsm"):
        header, body, where = _read_xlsx(raw, path, repairs)
        return header, body, "xlsx", f"Excel workbook, {where}"
    if suffix == ".xls":  # what the bytes are decides, not the name
        repairs.append("named .xls but holds text, not an Excel workbook: read as CSV")
    text, encoding = _decode(raw, path, repairs)
    delimiter, text = sniff_delimiter(text)
    header, body = _parse_records(text, path, repairs, delimiter)
    return header, body, encoding, f"CSV, {DELIMITERS[delimiter]}-separated"
