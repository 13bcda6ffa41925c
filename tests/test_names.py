"""Display names: one mapping from internal ids to what a reader sees (`rlxf_utils.names`)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from rlxf_utils.algorithms import ALGORITHMS  # noqa: E402
from rlxf_utils.artifacts import RunDir  # noqa: E402
from rlxf_utils.names import DISPLAY_NAMES, display_label, humanise, humanise_values  # noqa: E402


def test_every_policy_and_variant_has_a_name_a_reader_can_read() -> None:
    for a in ALGORITHMS:
        assert DISPLAY_NAMES[a] != a or a.isalpha(), a
    for name, shown in DISPLAY_NAMES.items():
        assert "_" not in shown, (name, shown)


def test_humanise_replaces_ids_in_prose_tables_and_ticks_but_not_paths_or_code() -> None:
    text = (
        "| policy | kl to reference | econ_descriptor |\n|:---|---:|:---|\n"
        "| sft_met | 0.1 | a |\n| sft | 2.0 | b |\n"
        "The `sft` policy and sft_met beat d2lols, unlike `ppo_mle`; see policy/sft_met/adapter.\n"
        "A base model and the sft step; ppo.py and @sec-rlgf.\n"
        "```yaml\n  md_as_met: {met: [M]}\n```\n"
    )
    out = humanise(text)
    assert out.splitlines()[0] == "| policy | KL to start policy | economic descriptor |"
    assert "| SFT on MET rows | 0.1 |" in out and "| SFT | 2.0 |" in out
    assert "The SFT policy and SFT on MET rows beat D²LOLS, unlike PPO + MLE" in out
    assert "policy/sft_met/adapter" in out  # a path stays a path
    assert "A base model and the SFT step; ppo.py and @sec-rlgf." in out  # 'base': English
    assert "  md_as_met: {met: [M]}" in out  # the parameters file is quoted as written
    assert humanise_values({"a": ["sft", "x sft_met"], "b": 1}) == {
        "a": ["SFT", "x SFT on MET rows"],
        "b": 1,
    }
    assert display_label("ppo step 8") == "PPO step 8"
    assert display_label("mean P(MET) minus sft") == "mean P(MET) minus SFT"
    assert display_label("base") == "zero-shot model"


def test_a_written_figure_shows_display_names(tmp_path: Path) -> None:
    fig, ax = plt.subplots()
    ax.bar(["base", "sft_met", "d2lols"], [1, 2, 3], label="best_of_n")
    ax.set_yticks([1, 2], ["history_met", "random_policy"])
    ax.set_title("gain over sft")
    ax.legend()
    RunDir(tmp_path).write_figure("f", fig)
    fig.canvas.draw()
    ticks = [t.get_text() for t in ax.get_xticklabels()]
    assert ticks == ["zero-shot model", "SFT on MET rows", "D²LOLS"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["history (MET)", "random policy"]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["best-of-N"]
    assert ax.get_title() == "gain over SFT"
    assert (tmp_path / "figures/f.png").stat().st_size > 0
    plt.close(fig)


def test_a_table_is_named_cell_by_cell_where_the_report_writes_it() -> None:
    import pandas as pd

    from rlxf_utils.report.wording import name_cells, name_table

    df = pd.DataFrame({"policy": ["ppo_mle", "sft step 0"], "kl_to_reference": [0.1, 0.2],
                       "note": ["base", "a text about sft_met"]})  # fmt: skip
    shown = name_cells(df)
    assert list(shown.columns) == ["policy", "KL to start policy", "note"]
    assert list(shown["policy"]) == ["PPO + MLE", "SFT step 0"]
    assert shown["note"].iloc[0] == "zero-shot model"  # an id as the whole cell
    md = "| policy | econ_descriptor |\n|:---|:---|\n| sft_met | the ppo_mle of sft |\n"
    # a table a stage wrote: whole-cell ids and headers only; data text stays as written
    assert name_table(md).splitlines()[0] == "| policy | economic descriptor |"
    assert name_table(md).splitlines()[2] == "| SFT on MET rows | the ppo_mle of sft |"
    # an escaped pipe is text inside a cell, not a border: its pieces are not cells
    escaped = "| sft | a \\| ppo |"
    assert name_table(escaped) == "| SFT | a \\| ppo |"


#: An id as the code writes it: lower case words joined by underscores ('ppo_mle', 'paper_input').
SNAKE_ID = r"(?<![\w/.`-])[a-z][a-z0-9]*(?:_[a-z0-9]+)+(?![\w/`-])"


def test_no_golden_report_text_shows_a_raw_id() -> None:
    """Every golden text of the report's sections (`tests/golden/report/*.md`, its case headings
    and the macro name that starts each line aside) names what it writes as a reader reads it: no
    id such as `guidance_vs_ppo` or `paper_input` reaches the prose (in backticks, a path or a
    parameter it may)."""
    import re

    leaks = []
    for golden in sorted((Path(__file__).parent / "golden" / "report").glob("*.md")):
        for n, line in enumerate(golden.read_text(encoding="utf-8").splitlines(), 1):
            if line.startswith("#"):
                continue
            prose = re.sub(r"^\w+: ", "", line)
            leaks += [f"{golden.name}:{n}: {m}" for m in re.findall(SNAKE_ID, prose)]
    assert leaks == []
