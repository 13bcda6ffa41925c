"""Every number, interval and verdict word a reader sees is formatted here, each by one function:
numbers (`num`), percentages (`pct`, `pct_ci`), p-values (`pval`), confidence intervals (`ci`,
`interval`, `level_ci`), lists, markdown tables, and the one vocabulary that turns a verdict code
into words (`vocabulary`, read from `reports/templates/vocabulary.yaml`; `phrase`, `say`), and
the report's tables (`table`, from `reports/templates/tables.yaml`)."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

import jinja2
import numpy as np
import pandas as pd
import yaml

from rlxf_utils.config import PROJECT_ROOT
from rlxf_utils.markdown import display_country, is_present, literal, markdown_table
from rlxf_utils.names import CELL_SEPARATOR, display_label, name_table_cells, outside_fences
from rlxf_utils.stats import VERDICTS, bound_verdict, ci_sign, level


def value(x: Any) -> Any:
    """A table's number for a template's context: a Python number, None where missing."""
    if isinstance(x, np.generic):
        x = x.item()
    return x if is_present(x) else None


def listing(items: Sequence[str]) -> str:
    """'a', 'a and b', 'a, b and c' for prose ('nothing' when empty)."""
    items = list(items)
    if not items:
        return "nothing"
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


#: The verdict codes a stage stores (`stats.bound_verdict`, decided from an interval, never
#: from the sign of a point estimate): the vocabulary below is keyed by them.
ABOVE, BELOW, EQUIVALENT, UNCLEAR = VERDICTS

#: Verdict values written by runs from before the codes ('higher' / 'lower'): read as codes.
_LEGACY_CODES = {"higher": ABOVE, "lower": BELOW}

#: The study's one verdict vocabulary (`reports/templates/vocabulary.yaml`, which an author edits):
#: for each kind of comparison, the phrase a sentence uses for each verdict code. Read once.
VOCABULARY_FILE = PROJECT_ROOT / "reports" / "templates" / "vocabulary.yaml"


@cache
def vocabulary(path: Path = VOCABULARY_FILE) -> dict[str, dict[str, str]]:
    """The phrases of `path` by key and verdict code, `{told_apart}` spelled out; a phrase set
    without the three codes, or a code that is not one, is a ValueError naming the file and key."""
    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    told = raw["told_apart"]
    out = {}
    for key, words in raw["phrases"].items():
        if not {ABOVE, BELOW, UNCLEAR} <= set(words) <= set(VERDICTS):
            raise ValueError(f"{path}: phrases.{key} needs {ABOVE!r}, {BELOW!r} and {UNCLEAR!r} "
                             f"(and may have {EQUIVALENT!r}); it has {sorted(words)}")  # fmt: skip
        out[key] = {c: str(t).replace("{told_apart}", told) for c, t in words.items()}
    return out


def verdict_code(value: Any) -> str:
    """A stored verdict as its code: one of `stats.VERDICTS`; 'higher' / 'lower' of older runs
    read as `ABOVE` / `BELOW`; anything else (missing, 'not tested') as `UNCLEAR`."""
    v = _LEGACY_CODES.get(value, value) if isinstance(value, str) else UNCLEAR
    return v if v in VERDICTS else UNCLEAR


def phrase(key: str, code: Any, **fields: Any) -> str:
    """The vocabulary's phrase of `key` for a verdict `code` (a stored verdict value,
    `verdict_code`), its `{fields}` filled; `EQUIVALENT` reads as `UNCLEAR` where `key` has no
    phrase for it. A key the vocabulary lacks: a KeyError naming the keys it has."""
    vocab = vocabulary()
    if key not in vocab:
        raise KeyError(f"{VOCABULARY_FILE.name} has no {key!r}; it has {sorted(vocab)}")
    words = vocab[key]
    c = verdict_code(code)
    return words.get(c, words[UNCLEAR]).format(**fields)


def say(key: str, low: Any, high: Any, margin: float | None = None, **fields: Any) -> str:
    """The phrase of `key` for the verdict an interval [low, high] of a difference earns
    (`stats.bound_verdict`, with equivalence within ±`margin` where given)."""
    return phrase(key, bound_verdict(low, high, margin), **fields)


def margin_verdict(low: float, high: float, margin: float | None, key: str = "position") -> str:
    """`say` with equivalence (`stats.bound_verdict`): the `EQUIVALENT` phrase followed by
    ' within ±margin' where the whole interval lies within ±`margin`."""
    v = bound_verdict(low, high, margin)
    if v == EQUIVALENT:
        return f"{phrase(key, v)} within ±{num(margin)}"
    return phrase(key, v)


def null_bound_clause(low: Any, high: Any, what: str = "gain", digits: int = 3) -> str:
    """How large an effect a null leaves open, for a sentence: 'a gain of at most +0.004' where
    the interval holds zero (its upper end, `stats.null_bound`, at the `digits` its interval is
    printed with), '' where it excludes zero."""
    if ci_sign(low, high) or not is_present(high):
        return ""
    return f"a {what} of at most {num(high, digits, signed=True)}"


def spaced(name: Any) -> str:
    """A name with spaces for underscores, so a long one wraps in a narrow PDF column."""
    return str(name).replace("_", " ")


#: The most decimals a signed number gets to show its sign (see `num`).
MAX_SIGN_DIGITS = 6


def sign_digits(x: float, digits: int) -> int:
    """The decimals a signed number needs: `digits`, or more (up to `MAX_SIGN_DIGITS`) when a
    nonzero value would round to zero, so that −0.00037 reads −0.0004, not '−0.000': an interval
    bound printed as zero cannot say on which side of zero it lies."""
    d = digits
    while x != 0 and round(abs(x), d) == 0 and d < MAX_SIGN_DIGITS:
        d += 1
    return d


def num(
    x: Any, digits: int = 3, signed: bool = False, scale: float = 1.0, significant: bool = False
) -> str:
    """A number for prose and tables: `digits` decimals, a sign when `signed`, times `scale`
    (100 for percentage points); 'n/a' when missing. A signed number (a difference, a gain, an
    interval's bound), or with `significant` any number (a minimum detectable effect), that is
    not zero but would round to zero gets the decimals that show its first significant digit
    (`sign_digits`)."""
    if not is_present(x):
        return "n/a"
    v = scale * x
    if signed:
        return f"{v:+.{sign_digits(v, digits)}f}"
    return f"{v:.{sign_digits(v, digits) if significant else digits}f}"


def coef(value: Any, se: Any, digits: int = 3) -> str:
    """A fitted coefficient with its standard error, '+0.019 ± 0.001', with the decimals that give
    the SE two significant digits when `digits` would not ('−0.0002 ± 0.0010', not
    '−0.000 ± 0.001'), at most `MAX_SIGN_DIGITS`; '·' when missing."""
    if not is_present(value):
        return "·"
    d = digits
    if is_present(se) and se > 0:
        d = max(d, min(MAX_SIGN_DIGITS, 1 - math.floor(math.log10(se))))
    d = max(d, sign_digits(value, d))
    return f"{value:+.{d}f} ± {se:.{d}f}" if is_present(se) else f"{value:+.{d}f}"


def pct(x: Any, digits: int = 1) -> str:
    """A share as a percentage for prose and tables ('12.3%'), or 'n/a' when missing."""
    return f"{100 * x:.{digits}f}%" if is_present(x) else "n/a"


def pct_ci(mid: Any, low: Any, high: Any, digits: int = 1) -> str:
    """A share with its interval as percentages: '82.0% [79.1%, 84.6%]'."""
    return f"{pct(mid, digits)} [{pct(low, digits)}, {pct(high, digits)}]"


def pval(p: Any, prose: bool = False) -> str:
    """A p-value: for a table cell '0.013', '<0.001' or 'n/a'; with `prose`, for a sentence,
    'p = 0.013', 'p < 0.001' or 'p n/a'."""
    if not is_present(p):
        return "p n/a" if prose else "n/a"
    if p < 0.001:
        return "p < 0.001" if prose else "<0.001"
    return f"p = {p:.3f}" if prose else f"{p:.3f}"


def interval(low: Any, high: Any, digits: int = 3, signed: bool = True, scale: float = 1.0) -> str:
    """A confidence interval as '[low, high]' (signed by default: intervals of differences)."""
    return f"[{num(low, digits, signed, scale)}, {num(high, digits, signed, scale)}]"


def ci(mid: Any, low: Any, high: Any, digits: int = 3, signed: bool = False,
       scale: float = 1.0) -> str:  # fmt: skip
    """An estimate with its interval, 'mid [low, high]': the one CI format of the study (signed
    for differences and gains)."""
    return f"{num(mid, digits, signed, scale)} {interval(low, high, digits, signed, scale)}"


def level_ci(low: Any, high: Any, alpha: float, digits: int = 3, scale: float = 1.0) -> str:
    """'95% CI [+low, +high]' (the level from `alpha`), or '95% CI n/a' without an interval."""
    if not (is_present(low) and is_present(high)):
        return f"{level(alpha)} CI n/a"
    return f"{level(alpha)} CI {interval(low, high, digits, True, scale)}"


_CODE_OR_MATH = re.compile(r"(`[^`\n]*`|\$[^$\n]*\$)")
_HYPHEN_MINUS = re.compile(r"(?<![\w.\-\u2212/])-(?=\.?\d)")


def in_prose(text: str, pattern: re.Pattern[str], repl: str) -> str:
    """`pattern.sub(repl, ...)` on the prose of markdown `text`: fenced code, inline code and math
    are left as written."""

    def line(part: str) -> str:
        parts = _CODE_OR_MATH.split(part)  # odd items: code spans and math, kept
        return "".join(p if i % 2 else pattern.sub(repl, p) for i, p in enumerate(parts))

    return outside_fences(text, line)


def typeset_minus(text: str) -> str:
    """Markdown with every negative number's hyphen-minus made a minus sign (U+2212), in prose and
    tables alike. Typst turns some such hyphens into minus signs and leaves others, so the PDF
    showed '(-0.001 [\u22120.085, +0.083])'. Ranges, dates and words ('2-3', '2024-05', 'Platt-
    scaled'), fenced code, inline code and math are left as written."""
    return in_prose(text, _HYPHEN_MINUS, "\u2212")


#: a possessive's apostrophe after a closing bracket or a full stop ("ILHF (history)'s", "et
#: al.'s"), which pandoc's smart quotes take for an opening quote (U+2018)
_POSSESSIVE = re.compile(r"(?<=[)\].])'(?=s\b)")


def typeset_apostrophes(text: str) -> str:
    """Markdown with each possessive apostrophe after ')', ']' or '.' made a right single quote
    (U+2019), the typographic apostrophe: pandoc's smart quotes turned "ILHF (history)'s" into
    "ILHF (history)\u2018s". Code, math and fenced blocks are left as written."""
    return in_prose(text, _POSSESSIVE, "\u2019")


def short_text(text: Any, n: int = 160) -> str:
    s = " ".join(str(text).split())
    return s if len(s) <= n else s[: n - 1].rstrip() + "…"


#: The report's prose that an author edits: one Jinja2 file per section, each sentence a macro.
TEMPLATES = PROJECT_ROOT / "reports" / "templates"


@cache
def templates(folder: Path = TEMPLATES) -> jinja2.Environment:
    """The section templates' environment: the filters that format numbers (`num`, `pct`,
    `pval`) and the functions that phrase verdicts and intervals (`phrase`, `say`, `interval`,
    `ci`, `listing`); a name a template uses that its context lacks is an error, not a blank."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(folder),
        undefined=jinja2.StrictUndefined,
        autoescape=False,  # markdown, not HTML
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(num=num, pct=pct, pval=pval, name=display_name, names=display_names,
                       literal=literal, level=level, fmt=_fmt, spaced=spaced,
                       country=display_country)  # fmt: skip
    env.tests["present"] = is_present
    env.globals.update(phrase=phrase, say=say, interval=interval, ci=ci, listing=listing,
                       pct_ci=pct_ci, level_ci=level_ci, bound=null_bound_clause, coef=coef,
                       margin_verdict=margin_verdict, short_text=short_text,
                       estimate=estimate)  # fmt: skip
    return env


def _fmt(x: Any, spec: str) -> str:
    """`format(x, spec)` for a present number ('+.2f', '.0%'), 'n/a' for a missing one: the
    templates' `fmt` filter, for the few cells the named formatters do not cover."""
    return format(x.item() if isinstance(x, np.generic) else x, spec) if is_present(x) else "n/a"


#: The report's tables that an author edits: per table, each column's header (a template, which
#: may quote the table's context: `{{ level }}`) and its cell (an expression over the row `r`); or,
#: for a table of named values, its two `columns` and its `rows` (label: expression).
TABLES_FILE = TEMPLATES / "tables.yaml"


@cache
def _table_spec(
    name: str, path: Path = TABLES_FILE
) -> tuple[list[str] | None, list[tuple[Any, Any]]]:
    specs = yaml.safe_load(path.read_text(encoding="utf-8"))
    if name not in specs:
        raise ValueError(f"{path}: no table {name!r}; it has {sorted(specs)}")
    env, spec = templates(path.parent), specs[name]
    named = isinstance(spec.get("rows"), dict)
    try:
        return (spec["columns"] if named else None), [
            (env.from_string(str(h)), env.compile_expression(str(e), undefined_to_none=False))
            for h, e in (spec["rows"] if named else spec).items()
        ]
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"{path}: table {name!r}: {e.message}") from e


def estimate(r: Any, col: str, signed: bool = False) -> str:
    """A table row's `col` with its interval (`col_low`, `col_high`) where the row has one, the
    number alone where it has none, '·' where the value is missing: the templates' `estimate`."""
    x, low, high = r.get(col), r.get(f"{col}_low"), r.get(f"{col}_high")
    if not is_present(x):
        return "·"
    return ci(x, low, high, signed=signed) if is_present(low) and is_present(high) else num(x, signed=signed)  # fmt: skip


def _defined(x: Any) -> Any:
    if isinstance(x, jinja2.Undefined):
        str(x)  # a StrictUndefined raises, naming what was missing
    return x


def table(name: str, rows: Any = (), floatfmt: str = ".3f", path: Path = TABLES_FILE, **context: Any) -> str:  # fmt: skip
    """The markdown table `name` of `reports/templates/tables.yaml` over `rows` (records, or a
    DataFrame's rows), each column's header rendered with `context` and its cell evaluated with
    the row as `r`; cells are shown as written (`markdown.markdown_table`). A column whose header
    renders empty is left out (a column only some runs have). A table of named values takes no
    rows: one row per label whose expression is not none. A field the spec names that the rows
    or context lack raises a ValueError naming the table."""
    records = rows.to_dict("records") if isinstance(rows, pd.DataFrame) else list(rows)
    named, spec = _table_spec(name, path)
    try:
        if named:
            pairs = [(h.render(**context), _defined(v(**context))) for h, v in spec]
            cols = dict(zip(named, zip(*[(h, v) for h, v in pairs if v is not None], strict=True), strict=True))  # fmt: skip
        else:
            heads = [(h.render(**context), cell) for h, cell in spec]
            cols = {h: [_defined(cell(r=r, **context)) for r in records] for h, cell in heads if h}
    except jinja2.UndefinedError as e:
        raise ValueError(f"{path}: table {name!r}: {e.message}") from e
    return fit_words(
        markdown_table(pd.DataFrame({h: list(v) for h, v in cols.items()}), floatfmt=floatfmt)
    )


#: About how many characters of a table's font fill the PDF's text width.
LINE_CHARS = 110


def fit_words(md: str) -> str:
    """A pipe table whose separator gives each column room for its longest word: at least 1.5
    times that word in dashes (plus a margin), and, since pandoc turns the dashes into relative
    widths, a share of all the dashes no smaller than the word's share of a line (`LINE_CHARS`,
    the word and two characters of padding). A PDF column narrower than a word it cannot break
    runs that word into the next column ('supervised+0.0003', 'staff_commentsTF-IDF')."""
    lines = md.split("\n")
    if len(lines) < 2 or not lines[1].startswith("|"):
        return md
    rows = [
        [c.strip() for c in CELL_SEPARATOR.split(ln.strip())[1:-1]]
        for ln in lines
        if ln.startswith("|")
    ]
    seps = rows.pop(1)
    longest = [
        max((len(w) for r in rows for w in r[i].split()), default=0) for i in range(len(seps))
    ]
    widths = [max(len(s.strip(":")), 3 * n // 2 + 4) for s, n in zip(seps, longest, strict=True)]
    if sum(n + 2 for n in longest) < LINE_CHARS:  # else no widths fit every word: leave them
        for _ in range(8):  # the shares grow the total: a few rounds reach the fixed point
            total = sum(widths)
            widths = [max(w, math.ceil((n + 2) * total / LINE_CHARS)) for w, n in zip(widths, longest, strict=True)]  # fmt: skip
    dashes = [(":" if s.startswith(":") else "") + "-" * w + (":" if s.endswith(":") else "")
              for s, w in zip(seps, widths, strict=True)]  # fmt: skip
    lines[1] = "|" + "|".join(dashes) + "|"
    return "\n".join(lines)


def display_name(name: Any) -> str:
    """A method, judge or protocol id as the reader sees it ('ppo_mle' -> 'PPO + MLE'): the
    templates' `name` filter, applied where the text is written."""
    return display_label(str(name))


def name_cells(df: pd.DataFrame) -> pd.DataFrame:
    """A DataFrame as the reader sees it, named where the report writes it: every header and every
    text cell by `display_name` ('ppo_mle' -> 'PPO + MLE', 'sft step 0' -> 'SFT step 0')."""
    shown = df.rename(columns=display_name)
    return shown.apply(lambda col: col.map(lambda v: display_name(v) if isinstance(v, str) else v))


def name_table(markdown: str) -> str:
    """A markdown table a stage wrote (`tables/*.md`) with each cell, headers included, that is
    exactly an id shown by its display name; any other text (data, descriptions) as written."""
    return "\n".join(name_table_cells(line) for line in markdown.split("\n"))


def display_names(names: Sequence[Any]) -> str:
    """Ids as one list of display names for prose ('PPO, GRPO and D²LOLS'): the `names` filter."""
    return listing([display_name(n) for n in names])


#: A paragraph break in a macro's output: a line holding only whitespace.
_BLANK = re.compile(r"\n[ \t]*\n\s*")
_PARAGRAPHS = "\n\n"


def sentence(section: str, name: str, *args: Any, folder: Path = TEMPLATES) -> str:
    """The sentence (or paragraphs) macro `name` of `reports/templates/<section>.jinja` called
    with `args`: within a paragraph, line breaks and indentation collapse to single spaces; an
    empty line in the macro's output separates paragraphs (kept as one blank line). A missing
    file or macro, or a field the arguments lack, raises a ValueError naming the template and
    what it wanted."""
    where = folder / f"{section}.jinja"
    try:
        macro = getattr(templates(folder).get_template(f"{section}.jinja").module, name, None)
        if macro is None:
            raise ValueError(f"{where}: no macro {name!r}")
        text = str(macro(*args))
        return _PARAGRAPHS.join(" ".join(p.split()) for p in _BLANK.split(text) if p.strip())
    except jinja2.TemplateNotFound as e:
        raise ValueError(f"{where}: no such template") from e
    except jinja2.UndefinedError as e:
        raise ValueError(f"{where}: macro {name!r}: {e.message}") from e
