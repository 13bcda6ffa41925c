"""Comparing two run dirs: bytes first, tables and JSON without timings, volatile paths skipped."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from rlxf_utils.artifacts import RunDir
from rlxf_utils.compare import compare_runs


def _run(root: Path, reward: float, step_time: float, note: str = "x") -> Path:
    run = RunDir(root)
    run.write_table("rl_summary", pd.DataFrame({"algo": ["ppo"], "reward": [reward],
                                                "step_time_s": [step_time]}))  # fmt: skip
    run.write_json("eval/summary.json", {"gain": reward, "seconds": {"sampling": step_time}})
    run.write_text("figures/a.png", note)
    run.write_json("manifest.json", {"git": {"commit": str(step_time)}})
    run.write_text("policy/ppo/launch.log", str(step_time))
    return root


def test_timings_and_volatile_paths_aside_the_runs_are_equal(tmp_path: Path) -> None:
    a, b = _run(tmp_path / "a", 0.5, 1.0), _run(tmp_path / "b", 0.5, 2.0)
    result = compare_runs(a, b)
    assert result.same
    assert result.paths("identical") == ["figures/a.png"]
    assert result.paths("timings") == ["eval/summary.json", "tables/rl_summary.csv",
                                       "tables/rl_summary.md"]  # fmt: skip
    assert result.volatile == ["manifest.json", "policy/ppo/launch.log"]


def test_a_changed_result_a_changed_figure_and_a_missing_file_are_reported(tmp_path: Path) -> None:
    a = _run(tmp_path / "a", 0.5, 1.0)
    b = _run(tmp_path / "b", 0.6, 1.0, note="y")
    (a / "tables/extra.csv").write_text("x\n1\n")
    (b / "eval/new.json").write_text(json.dumps({"k": 1}))
    result = compare_runs(a, b)
    assert not result.same
    assert result.paths("differs") == ["eval/summary.json", "figures/a.png",
                                       "tables/rl_summary.csv", "tables/rl_summary.md"]  # fmt: skip
    assert result.paths("missing") == ["tables/extra.csv"]
    assert result.paths("extra") == ["eval/new.json"]
    assert result.counts()["volatile"] == 2


def test_the_largest_change_and_the_changed_words_are_named(tmp_path: Path) -> None:
    """`content_differences`: the largest change of a number present in both versions (not the
    first, not a timing), the count of numbers changed, words and missing numbers apart."""
    from rlxf_utils.compare import content_differences

    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    pd.DataFrame({"algo": ["ppo", "grpo", "kto"], "gain": [0.10, 0.20, float("nan")],
                  "kl": [1.0, 2.0, 3.0], "verdict": ["gain", "none", "none"],
                  "step_time_s": [1.0, 1.0, 1.0]}).to_csv(a, index=False)  # fmt: skip
    pd.DataFrame({"algo": ["ppo", "grpo", "kto"], "gain": [0.11, 0.20, float("nan")],
                  "kl": [1.0, 2.5, float("nan")], "verdict": ["gain", "gain", "none"],
                  "step_time_s": [9.0, 9.0, 9.0]}).to_csv(b, index=False)  # fmt: skip
    d = content_differences(a, b)
    assert d["largest"]["where"] == "row 1, kl" and d["largest"]["change"] == 0.5
    assert d["largest"]["relative"] == 0.2 and d["numbers_changed"] == 2
    assert d["other_values_changed"] == 2 and d["only_in_one"] == 0
    assert [k for k, _, _ in d["first_other_changes"]] == ["row 2, kl", "row 1, verdict"]
    ja, jb = tmp_path / "a.json", tmp_path / "b.json"
    ja.write_text(json.dumps({"gain": {"ppo": 0.5, "seconds": 1}, "ci": [0.1, 0.2], "n": 4}))
    jb.write_text(json.dumps({"gain": {"ppo": 0.5, "seconds": 7}, "ci": [0.1, 0.25], "m": 4}))
    d = content_differences(ja, jb)
    assert d["largest"]["where"] == "ci[1]" and d["numbers_changed"] == 1
    assert d["only_in_one"] == 2 and d["other_values_changed"] == 0
    assert content_differences(tmp_path / "a.png", tmp_path / "b.png") is None


def test_rlxf_compare_prints_each_changed_tables_largest_change(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from rlxf_utils.cli import main

    a = _run(tmp_path / "a", 0.5, 1.0)
    b = _run(tmp_path / "b", 0.625, 1.0)
    assert main(["compare", str(a), str(b), "--out", str(tmp_path / "c.json")]) == 1
    out = capsys.readouterr().out
    assert "differs: eval/summary.json (1 numbers, the largest gain: 0.5 -> 0.625)" in out
    saved = json.loads((tmp_path / "c.json").read_text())
    assert saved["changes"]["tables/rl_summary.csv"]["largest"]["change"] == 0.125


def test_json_lines_holding_a_unicode_line_separator_are_read_whole(tmp_path: Path) -> None:
    """A sampled text with U+2028 (JSON writes it unescaped with ensure_ascii=False): read back
    by `RunDir.read_jsonl` and compared by `content_differences` as one record, not two halves."""
    from rlxf_utils.compare import content_differences

    run = RunDir(tmp_path / "run")
    rows = [{"raw": "one\u2028two", "reward": 0.5}, {"raw": "three", "reward": 0.25}]
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    run.write_text("eval/samples.jsonl", text)
    assert run.read_jsonl("eval/samples.jsonl") == rows
    (tmp_path / "b.jsonl").write_text(text.replace("0.25", "0.5"), encoding="utf-8")
    d = content_differences(run.root / "eval/samples.jsonl", tmp_path / "b.jsonl")
    assert d["largest"]["where"] == "[1].reward" and d["numbers_changed"] == 1
