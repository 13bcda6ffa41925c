"""Where each number comes from (`rlxf_utils.report.sources`): every table and figure of the
report, the artifact it reads and the step that wrote it."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from rlxf_utils.artifacts import RunDir
from rlxf_utils.report.sources import sources_table, writer

QMD = """Text.

{{< include _generated/eval_methods.md >}}

: Every method. {#tbl-methods}

![Gains.](figures/eval_gains.png){#fig-gains width=90%}

{{< include _generated/status_mapping.md >}}

: Statuses. {#tbl-status}

{{< include _generated/reward_metrics.md >}}

: Metrics. {#tbl-reward}

{{< include _generated/timings.md >}}

: Timings. {#tbl-timings}

{{< include _generated/sources.md >}}

: This table. {#tbl-sources}
"""


def test_each_item_names_its_artifact_and_writer_in_the_reports_order(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    for name in ("eval_methods", "status_mapping"):
        run.write_table(name, pd.DataFrame({"a": [1]}))
    md = sources_table(QMD, run, {"status_mapping": "status_mapping"})
    rows = [[c.strip() for c in r.strip("|").split("|")] for r in md.splitlines()[2:]]
    assert rows == [
        ["@tbl-methods", "`tables/eval_methods.csv`", "notebook 04"],
        ["@fig-gains", "`figures/eval_gains.png`", "notebook 04"],
        ["@tbl-status", "`tables/status_mapping.csv`", "notebook 01"],
        ["@tbl-reward", "`reward/metrics.json`", "notebook 02"],  # computed from the summary
        ["@tbl-timings", "`manifest.json`", "`rlxf run`"],
    ]


def test_writers_follow_the_stage_modules_names() -> None:
    assert writer("eval_seeds") == "`rlxf seeds`"
    assert writer("rlgf_guidance") == writer("sft_loss") == writer("ilhf_training") == "notebook 03"
    assert writer("rlgf_table") == writer("ilhf_tests") == "notebook 04"
    assert writer("risk_drift") == "notebook 05" and writer("split_sizes") == "notebook 01"


def test_a_figure_shown_only_when_the_run_has_it_is_listed_where_its_include_stands(
    tmp_path: Path,
) -> None:
    run = RunDir(tmp_path / "run")
    gen = tmp_path / "_generated"
    gen.mkdir()
    qmd = (
        "{{< include _generated/eval_seeds_figure.md >}}\n\n"
        "![Gains.](figures/eval_gains.png){#fig-gains width=90%}\n"
    )
    (gen / "eval_seeds_figure.md").write_text(
        "![Seeds.](figures/eval_seeds.png){#fig-seeds width=100%}", encoding="utf-8"
    )
    rows = sources_table(qmd, run, {}, gen).splitlines()[2:]
    assert [r.split("|")[1].strip() for r in rows] == ["@fig-seeds", "@fig-gains"]
    assert "`rlxf seeds`" in rows[0]
    (gen / "eval_seeds_figure.md").write_text("", encoding="utf-8")  # a run without seeds
    rows = sources_table(qmd, run, {}, gen).splitlines()[2:]
    assert [r.split("|")[1].strip() for r in rows] == ["@fig-gains"]


def test_a_table_shown_only_when_the_run_has_it_is_listed_only_then(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    gen = tmp_path / "_generated"
    gen.mkdir()
    qmd = "{{< include _generated/eval_seeds_optional.md >}}\n\n"
    (gen / "eval_seeds_optional.md").write_text(
        "{{< include _generated/eval_seeds.md >}}\n\n: Seeds. {#tbl-seeds}\n", encoding="utf-8"
    )
    rows = sources_table(qmd, run, {}, gen).splitlines()[2:]
    assert [r.split("|")[1].strip() for r in rows] == ["@tbl-seeds"]
    assert "`rlxf seeds`" in rows[0]
    (gen / "eval_seeds_optional.md").write_text("", encoding="utf-8")  # a run without seeds
    assert sources_table(qmd, run, {}, gen).splitlines()[2:] == []
    # a table whose include merely ends in "_table" is an ordinary table: listed as such
    (gen / "rlgf_table.md").write_text("| a |\n|---|\n| 1 |\n", encoding="utf-8")
    qmd = "{{< include _generated/rlgf_table.md >}}\n\n: RLGF. {#tbl-rlgf}\n"
    assert [r.split("|")[1].strip() for r in sources_table(qmd, run, {}, gen).splitlines()[2:]] == [
        "@tbl-rlgf"
    ]
