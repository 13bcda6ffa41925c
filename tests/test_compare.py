"""Comparing two run dirs: bytes first, tables and JSON without timings, volatile paths skipped."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

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
