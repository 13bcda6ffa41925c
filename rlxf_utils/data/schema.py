"""What a MONA file looks like: the known vintages' columns, status codes and their words,
condition types, and how a header is matched to a schema."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

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


def status_key(text: str) -> str:
    return re.sub(r"[^0-9A-Z]", "", text.upper())


STATUS_ALIASES: dict[str, str] = {
    status_key(word): code for code, words in STATUS_WORDS.items() for word in words
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


def matching_schema(columns: Iterable[str]) -> str | None:
    keys = {_header_key(c) for c in columns}
    for name, required in REQUIRED.items():
        if all(_header_key(c) in keys for c in required):
            return name
    return None


def _found_columns(cols: list[str]) -> str:
    """The header found, for an error: its names when some are MONA's (a misspelt column shows),
    else only how many (the first line of a file that is no export at all is not echoed)."""
    known = [c for c in cols if _header_key(c) in CANONICAL_COLUMNS]
    if not known:
        return f"found no MONA column ({len([c for c in cols if c])} column(s), not shown)"
    return f"found columns {sorted(c if len(c) <= 40 else c[:37] + '...' for c in cols if c)}"


def detect_schema(columns: Iterable[str], path: str | Path = "<data>") -> str:
    """Name of the schema whose required columns are all present, or a DataError listing both.

    Names are compared without case and with whitespace runs as one space.
    """
    cols = [str(c) for c in columns]
    found = matching_schema(cols)
    if found is not None:
        return found
    keys = {_header_key(c) for c in cols}
    missing_of = {n: [c for c in r if _header_key(c) not in keys] for n, r in REQUIRED.items()}
    closest = min(REQUIRED, key=lambda n: len(missing_of[n]))
    raise DataError(
        f"{path}: missing required column(s) {missing_of[closest]} for the {closest} schema; "
        f"{_found_columns(cols)}. Expected either "
        + " or ".join(f"{n}: {list(r)}" for n, r in REQUIRED.items())
        + " (case and spacing of the names do not matter)"
    )
