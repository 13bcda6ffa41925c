"""One mapping from the study's internal ids to the names a reader sees.

Artifacts keep the ids (`sft_met`, `md_as_met`, `econ_descriptor`: stable keys that code and
users' scripts read); the report shows `DISPLAY_NAMES`. `humanise` applies the mapping to a
markdown text (the report's prose, variables and tables at render time), `relabel_figure` to
a figure's texts (when a stage writes it).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from rlxf_utils.algorithms import ALGORITHMS, POLICY_LABELS

#: The label mappings of the risk stage's sensitivity test (`risk.label_mappings`).
LABEL_VARIANT_NAMES: dict[str, str] = {
    "md_as_met": "met with delay as MET",
    "exclude_cancelled_modified": "cancelled and modified left out",
}

#: Columns and fields of the data and the tables.
FIELD_NAMES: dict[str, str] = {
    "econ_descriptor": "economic descriptor",
    "econ_area": "economic area",
    "arrangement_type": "arrangement type",
    "kl to reference": "KL to start policy",
    "kl_to_reference": "KL to start policy",
    "n_clusters": "countries",
    # the measures of the paired comparisons (`eval_paired`'s `measure`)
    "audit_reward": "audit reward",
    "reward_sd": "reward heads' SD",
    "reward_finished": "reward, finished responses",
    "audit_reward_finished": "audit reward, finished responses",
    "reward_as_written": "reward, cut responses as written",
    "audit_reward_as_written": "audit reward, cut responses as written",
    "finished_share": "share finished before the cap",
    # the data section's tables (notebook 01)
    "status_raw": "MONA code",
    "n_met": "MET",
    "met_rate": "MET rate",
    "ci_low": "CI low",
    "ci_high": "CI high",
    "test_rows": "test rows",
    "exact_in_train": "exact in training",
    "exact_share": "exact share",
    "near_in_train": "near in training",
    "near_share": "near share",
    # the forensic arm's input variants (`reward.forensic.VARIANTS`)
    "paper_input": "paper's four fields",
    "staff_comments": "staff comments",
    "arrangement_id": "arrangement id",
}

#: Every internal id the report may meet, with the name it shows instead.
DISPLAY_NAMES: dict[str, str] = {
    **{a.id: a.label for a in ALGORITHMS.values()},
    **POLICY_LABELS,
    **LABEL_VARIANT_NAMES,
    **FIELD_NAMES,
}


#: Ids that are also English words: replaced only in backticks, as a whole table cell or as a
#: whole figure text, never in running prose.
ENGLISH_WORDS: frozenset[str] = frozenset({"base"})


def _pattern(names: Mapping[str, str]) -> re.Pattern[str]:
    ids = sorted((n for n in names if n not in ENGLISH_WORDS), key=len, reverse=True)
    # not inside a path, a file name, a cross-reference label or an identifier:
    # `policy/sft_met/adapter`, `ppo.py`, `@sec-rlgf` stay as they are
    return re.compile(r"(?<![\w/.`@#-])(" + "|".join(map(re.escape, ids)) + r")(?![\w/`-]|\.\w)")


_SAFE = _pattern(DISPLAY_NAMES)
_TICKED = re.compile(r"`([^`\n]+)`")
#: A markdown table's cell separator: a pipe not escaped (`\|` is a pipe inside a cell's text).
CELL_SEPARATOR = re.compile(r"(?<!\\)\|")


def _cell(cell: str, names: Mapping[str, str]) -> str:
    stripped = cell.strip()
    if stripped in names:
        return cell.replace(stripped, names[stripped])
    return cell


def name_table_cells(line: str, names: Mapping[str, str] = DISPLAY_NAMES) -> str:
    """A markdown table line with each cell (headers included) that is exactly an id shown by its
    display name, any other text as written; a line that is not a table row as it is."""
    if not line.lstrip().startswith("|"):
        return line
    return "|".join(_cell(c, names) for c in CELL_SEPARATOR.split(line))


def humanise(text: str, names: Mapping[str, str] = DISPLAY_NAMES) -> str:
    """`text` (markdown) with internal ids shown by their display names: ids in backticks, whole
    table cells (headers included) and, but for `ENGLISH_WORDS`, anywhere else. Fenced code
    blocks (the parameters file) and paths are left as written."""
    pattern = _SAFE if names is DISPLAY_NAMES else _pattern(names)

    def line_names(line: str) -> str:
        line = _TICKED.sub(lambda m: names.get(m.group(1), m.group(0)), line)
        line = name_table_cells(line, names)
        return pattern.sub(lambda m: names[m.group(1)], line)

    return outside_fences(text, line_names)


def outside_fences(text: str, change: Callable[[str], str]) -> str:
    """`text` (markdown) with `change` applied to each line outside fenced code blocks, which
    stay as written."""
    out, fenced = [], False
    for line in text.split("\n"):
        fence = line.lstrip().startswith(("```", "~~~"))
        fenced ^= fence
        out.append(line if fenced or fence else change(line))
    return "\n".join(out)


def humanise_values(value: object, names: Mapping[str, str] = DISPLAY_NAMES) -> object:
    """`humanise` over every string of a nested structure (the report's variables); a string
    that is exactly an id becomes its display name."""
    return map_strings(value, lambda text: display_label(text, names))


def map_strings(value: object, change: Callable[[str], str]) -> object:
    """`value` (a string, or mappings and lists nesting them) with `change` applied to every
    string in it; anything else is returned as it is."""
    if isinstance(value, str):
        return change(value)
    if isinstance(value, Mapping):
        return {k: map_strings(v, change) for k, v in value.items()}
    if isinstance(value, list):
        return [map_strings(v, change) for v in value]
    return value


def display_label(text: str, names: Mapping[str, str] = DISPLAY_NAMES) -> str:
    """A figure's text (tick, legend entry, annotation, title) with display names: an id as
    the whole text, else `humanise` ('ppo step 8' -> 'PPO step 8')."""
    return names[text] if text in names else humanise(text, names)


def relabel_figure(fig: Any, names: Mapping[str, str] = DISPLAY_NAMES) -> Any:
    """`fig` with every text a reader sees shown by display names (`display_label`): titles,
    axis labels, legend entries, annotations and tick labels (categorical and fixed ticks keep
    their positions; only the words change). Returns `fig`, changed in place."""
    from matplotlib.category import StrCategoryFormatter
    from matplotlib.text import Text
    from matplotlib.ticker import FixedFormatter, FuncFormatter

    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            fmt = axis.get_major_formatter()
            # categorical axes, and ticks given labels (`set_ticks(..., labels)`: a FuncFormatter)
            if isinstance(fmt, (FixedFormatter, FuncFormatter, StrCategoryFormatter)):
                axis.set_major_formatter(
                    FuncFormatter(lambda x, pos, f=fmt: display_label(str(f(x, pos)), names))
                )
    for text in fig.findobj(Text):
        s = text.get_text()
        if s:
            new = display_label(s, names)
            if new != s:
                text.set_text(new)
    return fig
