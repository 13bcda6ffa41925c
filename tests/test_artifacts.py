from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from rlxf_utils.artifacts import ArtifactMissing, RunDir, atomic_path, to_jsonable
from rlxf_utils.markdown import markdown_table
from rlxf_utils.report.wording import coef, typeset_apostrophes, typeset_minus


def test_atomic_write_keeps_old_file_when_writer_fails(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    run.write_json("a/b.json", {"x": 1})
    with pytest.raises(RuntimeError), atomic_path(run.path("a/b.json")) as tmp:
        tmp.write_text("half")
        raise RuntimeError("crash mid-write")
    assert run.read_json("a/b.json") == {"x": 1}
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["b.json"]  # no temp file left


def test_round_trips(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    df = pd.DataFrame({"a": [1, 2], "b": ["x", "y|z"], "c": [0.12345, np.nan]})
    run.write_parquet("d/t.parquet", df)
    pd.testing.assert_frame_equal(run.read_parquet("d/t.parquet"), df)
    run.write_table("t", df)
    assert run.read_table("t")["a"].tolist() == [1, 2]
    md = (tmp_path / "tables/t.md").read_text()
    assert (
        md.splitlines()[1] == "|-------:|:--------|---------:|"
    )  # longest cell + 4 (pandoc widths)
    assert "y\\|z" in md and "0.123" in md
    run.write_jsonl("s.jsonl", [{"a": np.int64(1)}, {"a": np.float32(0.5)}])
    assert run.read_jsonl("s.jsonl") == [{"a": 1}, {"a": 0.5}]


def test_missing_artifact_names_it_and_its_stage(tmp_path: Path) -> None:
    with pytest.raises(ArtifactMissing, match=r"data/splits\.json \(written by notebook 01"):
        RunDir(tmp_path).read_json("data/splits.json", stage="notebook 01")


def test_to_jsonable() -> None:
    out = to_jsonable(
        {"n": np.int32(3), "f": np.nan, "arr": np.arange(2), "p": Path("/x"), 1: True}
    )
    assert json.loads(json.dumps(out)) == {"n": 3, "f": None, "arr": [0, 1], "p": "/x", "1": True}


def test_markdown_table_index() -> None:
    md = markdown_table(pd.DataFrame({"v": [1.0]}, index=pd.Index(["r"], name="k")), index=True)
    assert md.splitlines()[0] == "| k | v |" and md.splitlines()[2] == "| r | 1.000 |"


def test_figure_written(tmp_path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([0, 1])
    p = RunDir(tmp_path).write_figure("f", fig)
    assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_markdown_dashes_give_wordy_columns_room() -> None:
    md = markdown_table(pd.DataFrame({"k": ["a", "b"], "long": ["x" * 120, "y" * 100]}))
    assert md.splitlines()[1] == "|:-------|:" + "-" * 44 + "|"


def test_a_coefficient_shows_its_standard_errors_two_significant_digits() -> None:
    assert coef(0.0190, 0.0012) == "+0.0190 ± 0.0012"
    assert coef(-0.00012, 0.00081) == "-0.00012 ± 0.00081"  # was '-0.000 ± 0.001'
    assert coef(-0.025, 0.076) == "-0.025 ± 0.076"  # three decimals already show two digits
    assert coef(0.31, 0.2) == "+0.310 ± 0.200"
    assert coef(0.00004, 0.0) == "+0.00004 ± 0.00000"  # a zero SE: the value's first digit
    assert coef(None, 0.1) == coef(float("nan"), 0.1) == "·"
    assert coef(0.5, None) == "+0.500"


def test_negative_numbers_get_a_minus_sign_and_nothing_else_changes() -> None:
    text = (
        "gain (-0.001 [-0.085, +0.083]), β -.5; offset -2.00\n"
        "| PPO | -0.004 [-0.008, +0.001] |\n"
        "steps 2-3, 2024-05-14, Platt-scaled, MiniLM-L6-v2, e-5, x=-1, `kl_coef: -0.1`, $e^{-1}$\n"
        "```yaml\nkl_coef: -0.1\n```\n"
        "|---:|:---|"
    )
    out = typeset_minus(text)
    m = "\u2212"
    assert out.split("\n")[:2] == [
        f"gain ({m}0.001 [{m}0.085, +0.083]), β {m}.5; offset {m}2.00",
        f"| PPO | {m}0.004 [{m}0.008, +0.001] |",
    ]
    assert out.split("\n", 2)[2] == text.split("\n", 2)[2].replace("x=-1", f"x={m}1")
    assert typeset_minus(out) == out  # idempotent


def test_a_possessive_after_a_bracket_or_full_stop_gets_the_typographic_apostrophe() -> None:
    # pandoc's smart quotes read "(history)'s" as an opening quote: the PDF showed "(history)‘s"
    text = "ILHF (history)'s gain, et al.'s form, [x]'s; GRPO's, 'quoted', `a)'s`, $b)'s$\n```\nc)'s\n```"
    out = typeset_apostrophes(text)
    r = "’"
    assert out.split("\n")[0] == (
        f"ILHF (history){r}s gain, et al.{r}s form, [x]{r}s; GRPO's, 'quoted', `a)'s`, $b)'s$"
    )
    assert out.split("\n", 1)[1] == text.split("\n", 1)[1]  # fenced code as written
    assert typeset_apostrophes(out) == out


def test_the_typst_source_writes_possessives_as_apostrophes() -> None:
    # pandoc's reader takes "(history)'s" for an opening quote when a single quote follows in the
    # paragraph (HTML and PDF), and Typst's smart quotes did so always (PDF): both are settled
    import pypandoc

    from rlxf_utils.report.render import READER, TYPST_WRITER, for_reader

    text = "ILHF (history)'s gain, et al.'s form; GRPO's, 'quoted'"
    for to in (TYPST_WRITER, "html"):
        out = pypandoc.convert_text(for_reader(text), to, format=READER)
        assert "(history)\u2019s gain, et al.\u2019s form; GRPO\u2019s" in out, (to, out)
        assert "\u2018s" not in out


def test_table_csvs_quote_what_a_spreadsheet_would_run_and_read_back_as_written(
    tmp_path: Path,
) -> None:
    """A text cell starting = + - @ (a formula when the CSV is opened in a spreadsheet) is written
    with a leading quote; numbers and text that is just a number are not; reading the table back
    gives the cells as they were."""
    text = ['=HYPERLINK("http://x","y")', "+cmd", "-2+3", "@SUM(A1)", "\tx", "-0.5", "ok", "'=q"]
    df = pd.DataFrame({"t": text, "x": [-0.01, 1.5, -2.0, 0.0, 1.0, 2.0, 3.0, 4.0]})
    run = RunDir(tmp_path)
    run.write_table("t", df)
    rows = (tmp_path / "tables/t.csv").read_text().splitlines()
    assert rows[1] == '"\'=HYPERLINK(""http://x"",""y"")",-0.01'
    assert rows[2:5] == ["'+cmd,1.5", "'-2+3,-2.0", "'@SUM(A1),0.0"]
    assert rows[6:9] == ["-0.5,2.0", "ok,3.0", "''=q,4.0"]
    back = run.read_table("t")
    assert back["t"].tolist() == text and back["x"].tolist() == df["x"].tolist()
