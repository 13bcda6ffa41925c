"""Notebook 04's draws in side-by-side lanes (`evaluation.lanes`): when they run, how a task is
claimed once, and, on a copy of the smoke run, that drawing in lanes changes no number of the
stage against drawing in the kernel."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
from smoke import ROOT, copy_run

from rlxf_utils.artifacts import RunDir
from rlxf_utils.evaluation import lanes


def _cfg(**compute):
    base = dict(parallel_stages=2, processes="per_stage", lane_threads="all")
    return SimpleNamespace(compute=SimpleNamespace(**(base | compute)),
                           evaluation=SimpleNamespace(num_threads=None))  # fmt: skip


def test_lanes_run_only_where_their_draws_are_the_kernels():
    assert lanes.lanes_apply(_cfg()) is None
    assert "parallel_stages" in lanes.lanes_apply(_cfg(parallel_stages=1))
    assert "kernel" in lanes.lanes_apply(_cfg(processes="kernel"))
    assert "rounds bf16 differently" in lanes.lanes_apply(_cfg(lane_threads="share"))
    off = _cfg()
    off.evaluation.num_threads = 1
    assert "num_threads" in lanes.lanes_apply(off)


def test_a_task_is_claimed_by_one_lane_only(tmp_path: Path):
    run = RunDir(tmp_path)
    assert lanes.claim(run, 0) and not lanes.claim(run, 0)
    assert lanes.claim(run, 1)
    assert sorted(p.name for p in run.path(lanes.CLAIMS).iterdir()) == ["0000", "0001"]


#: A small evaluation on the smoke run's policies: every kind of draw, a few prompts.
SMALL = {
    "evaluation": {"max_prompts": 4, "samples_per_prompt": 2, "best_of_n": 2,
                   "best_of_n_curve": [1, 2], "heldout_rows": 6, "frontier_max_checkpoints": 1,
                   "table3_countries": 1, "n_boot": 200},
}  # fmt: skip
#: Summary entries that say how the draws were made, not what they are.
HOW = ("seconds", "lanes", "reused_draws")


@pytest.mark.slow
def test_drawing_in_lanes_changes_no_number(smoke_run: Path, tmp_path: Path) -> None:
    """The stage on a copy of the smoke run, its draws made by two lanes, then again in the
    kernel alone: every table, sample and summary entry equal; with lanes, every draw of the
    stage was read back (none drawn in the kernel) and each lane's tasks are recorded."""
    from rlxf_utils.config import load_config
    from rlxf_utils.evaluation.stage import run_evaluation_stage

    out = {}
    for label, compute in (("lanes", {"parallel_stages": 2, "lane_threads": "all"}),
                           ("kernel", {"parallel_stages": 1})):  # fmt: skip
        run_dir = copy_run(smoke_run, tmp_path / label)
        shutil.rmtree(run_dir / "eval/draws", ignore_errors=True)
        cfg = load_config(ROOT / "params/smoke.yaml", SMALL | {"compute": compute})
        run_evaluation_stage(cfg, RunDir(run_dir), progress=False)
        out[label] = run_dir
    a, b = (
        json.loads((d / "eval/summary.json").read_text()) for d in (out["lanes"], out["kernel"])
    )
    assert a["lanes"]["lanes"] == 2 and b["lanes"] == {
        "lanes": 0,
        "why_not": "compute.parallel_stages is 1",
    }
    drawn = [label for tasks in a["lanes"]["drawn"].values() for label in tasks]
    assert len(drawn) == len(set(drawn)) and all(
        a["lanes"]["drawn"].values()
    )  # each once, both lanes
    every = {
        "best-of-N pool",
        "samples base",
        "samples sft",
        *(f"samples {x}" for x in a["algorithms"]),
    }
    assert every <= set(drawn)
    assert set(a["reused_draws"]) == set(drawn) and b["reused_draws"] == []
    assert {k: v for k, v in a.items() if k not in HOW} == {
        k: v for k, v in b.items() if k not in HOW
    }
    for rel in ("eval/samples.parquet", "eval/frontier.parquet", "eval/heldout_nll_rows.parquet"):
        pd.testing.assert_frame_equal(
            pd.read_parquet(out["lanes"] / rel), pd.read_parquet(out["kernel"] / rel)
        )
    for table in ("eval_table3", "eval_paired", "eval_summary"):
        assert (out["lanes"] / f"tables/{table}.csv").read_bytes() == (
            out["kernel"] / f"tables/{table}.csv"
        ).read_bytes()
    assert not (out["lanes"] / lanes.CLAIMS).exists()  # the claims are cleared
