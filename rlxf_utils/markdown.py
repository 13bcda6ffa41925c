"""Text for artifacts and the report alike: markdown pipe tables whose cells are shown as written
(`markdown_table`, `literal`), whether a value can be quoted (`is_present`) and readable country
names (`display_country`). The stages write their `tables/*.md` with these, so they live below
the report: a change of the report's words (`report/`, `reports/templates/`) is in no
notebook's code fingerprint, while a change here, which changes what stages write, is."""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np
import pandas as pd


def is_present(x: Any) -> bool:
    """Not None and not a float NaN (a value a sentence can quote)."""
    return x is not None and not (isinstance(x, float) and math.isnan(x))


#: What markdown or HTML would read as markup (pandoc's markdown: emphasis, code, links and
#: images, raw HTML and entities, math, citations, spans, shortcodes, sub- and superscripts, table
#: cells); an underscore only where it could open or close emphasis (`sft_met` stays as it is).
_MARKUP = re.compile(r"[\\`*\[\]<>&$#@{}|~^]|(?<![^\W_])_|_(?![^\W_])")


def literal(text: Any) -> str:
    """Text from data or a model (a status, a description, a generated response) as markdown that
    shows it as written, in the HTML and the PDF alike: every character markdown or HTML would
    read as markup is backslash-escaped, line breaks become spaces. A `<script>`, an `<img src>`
    or a `[link](javascript:...)` is text, never an element, a fetch or an embedded file."""
    flat = " ".join(str(text).splitlines())
    return _MARKUP.sub(lambda m: "\\" + m.group(0), flat)


def _cell_text(v: Any, floatfmt: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)) or v is pd.NA:
        return ""
    if isinstance(v, float | np.floating):
        return format(float(v), floatfmt)
    return " ".join(str(v).splitlines())


def _fmt_cell(v: Any, floatfmt: str, markup: bool = False) -> str:
    text = _cell_text(v, floatfmt)
    return text.replace("|", "\\|") if markup else literal(text)


def markdown_table(
    df: pd.DataFrame, floatfmt: str = ".3f", index: bool = False, markup: bool = False
) -> str:
    """A pipe table (pandoc and Quarto read it) without the optional `tabulate` dependency.

    Every header and cell is text (`literal`), shown as written; `markup`: the cells are markdown
    the report wrote itself (cross-references, code spans), kept as such."""
    if index:
        df = df.reset_index()
    cols = [str(c) for c in df.columns]
    numeric = [pd.api.types.is_numeric_dtype(df[c]) for c in df.columns]
    header = "| " + " | ".join(literal(c) for c in cols) + " |"
    # Dash counts set pandoc's relative column widths when cells wrap: a short column gets its
    # longest cell plus a margin (so numbers and labels never break), a wordy one at most 44.
    longest = [
        max([len(_fmt_cell(v, floatfmt, markup)) for v in df[col].head(200)] or [0]) for col in df
    ]
    widths = [4 + max(3, len(c), min(40, n)) for c, n in zip(cols, longest, strict=True)]
    align = (
        "|"
        + "|".join(
            ("-" * w + ":") if n else (":" + "-" * w) for n, w in zip(numeric, widths, strict=True)
        )
        + "|"
    )
    rows = [
        "| " + " | ".join(_fmt_cell(v, floatfmt, markup) for v in rec) + " |"
        for rec in df.itertuples(index=False, name=None)
    ]
    return "\n".join([header, align, *rows]) + "\n"


def display_country(name: str) -> str:
    """'GAMBIA, THE' -> 'Gambia, The'-style readable names for completion prompts."""
    out = name.title()
    for a, b in ((" Of", " of"), (" And ", " and "), (" The", " the"), ("(Fyr)", "(FYR)")):
        out = out.replace(a, b)
    return out
