"""Where each number comes from: every table and figure of the report, the run artifact it is
read from and the step of the study that wrote that artifact (the report's appendix table)."""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd

from rlxf_utils.artifacts import RunDir
from rlxf_utils.markdown import markdown_table

#: Which step writes an artifact, by the start of its name (first match wins): the stage
#: modules name their tables and figures this way (data/, reward/, rl/, evaluation/, risk/
#: stage.py and `rlxf seeds`).
WRITER_BY_PREFIX: tuple[tuple[str, str], ...] = (
    ("eval_seeds", "`rlxf seeds`"),
    ("eval_", "notebook 04"),
    ("rlgf_guidance", "notebook 03"),
    ("rlgf_", "notebook 04"),
    ("ilhf_training", "notebook 03"),
    ("ilhf_didactic", "notebook 03"),
    ("ilhf_", "notebook 04"),
    ("rl_", "notebook 03"),
    ("sft_", "notebook 03"),
    ("reward_", "notebook 02"),
    ("risk_", "notebook 05"),
    ("", "notebook 01"),
)

#: Report tables computed from a stage's summary file rather than one of its tables.
SUMMARY_OF_PREFIX: tuple[tuple[str, str], ...] = (
    ("eval_", "eval/summary.json"),
    ("rlgf_", "tables/eval_rlgf.csv"),
    ("ilhf_", "tables/eval_inclusive.csv"),
    ("rl_", "policy/train_logs.parquet"),
    ("reward_", "reward/metrics.json"),
    ("risk_", "risk/summary.json"),
    ("", "data/summary.json"),
)

#: Report tables read from the run's manifest (the reproducibility appendix).
MANIFEST_TABLES = ("timings", "versions", "params")

_TABLE = re.compile(
    r"\{\{< include _generated/([\w-]+)\.md >\}\}\s*\n\s*\n: [^\n]*\{#(tbl-[\w-]+)\}"
)
_FIGURE = re.compile(r"\]\(figures/([\w-]+)\.png\)\{#(fig-[\w-]+)")
#: A figure or table (with its caption) the report shows only when the run has it: written by a
#: section into `_generated/`, empty otherwise.
_FIGURE_INCLUDE = re.compile(r"\{\{< include _generated/([\w-]+_(?:figure|optional))\.md >\}\}")


def writer(stem: str) -> str:
    """The step that writes an artifact named `stem` (`WRITER_BY_PREFIX`)."""
    return next(w for p, w in WRITER_BY_PREFIX if stem.startswith(p))


def table_source(stem: str, run: RunDir, tables: dict[str, str]) -> tuple[str, str]:
    """(artifact, writer) of a report table included as `_generated/<stem>.md`; `tables` maps
    an include to the run table it copies (render's `TABLE_INCLUDES`)."""
    if stem in MANIFEST_TABLES:
        return "manifest.json", "`rlxf run`"
    name = tables.get(stem, stem)
    if run.exists(f"tables/{name}.csv"):
        return f"tables/{name}.csv", writer(name)
    return next(s for p, s in SUMMARY_OF_PREFIX if stem.startswith(p)), writer(stem)


def sources_table(
    qmd: str, run: RunDir, tables: dict[str, str], generated: Path | None = None
) -> str:
    """The markdown table of every table and figure that `qmd` shows (in its order): the item
    (a cross-reference), the artifact and the step that wrote it. A figure included from
    `generated` (`_generated/<name>_figure.md`, empty when the run lacks it) counts where its
    include stands."""
    if generated is not None:
        qmd = _FIGURE_INCLUDE.sub(
            lambda m: (
                (generated / f"{m.group(1)}.md").read_text(encoding="utf-8")
                if (generated / f"{m.group(1)}.md").is_file()
                else ""
            ),
            qmd,
        )
    items: list[tuple[int, str, str, str]] = []
    for m in _TABLE.finditer(qmd):
        if m.group(1) == "sources":  # this table itself
            continue
        path, by = table_source(m.group(1), run, tables)
        items.append((m.start(), f"@{m.group(2)}", f"`{path}`", by))
    for m in _FIGURE.finditer(qmd):
        items.append(
            (m.start(), f"@{m.group(2)}", f"`figures/{m.group(1)}.png`", writer(m.group(1)))
        )
    frame = pd.DataFrame(sorted(items), columns=["at", "item", "artifact", "written by"])
    return markdown_table(frame.drop(columns="at"), markup=True)  # its own cross-references
