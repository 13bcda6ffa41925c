"""bench/gpu_scale.py --tiny: the GPU projection's code runs end to end on the CPU in seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from rlxf_utils.config import PROJECT_ROOT


def test_gpu_scale_tiny_runs_and_projects_every_stage(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(PROJECT_ROOT / "bench" / "gpu_scale.py"), "--tiny", "--no-grpo",
           "--rl-steps", "2", "--out", str(tmp_path)]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_scale.json").read_text(encoding="utf-8"))
    assert (tmp_path / "gpu_scale.png").stat().st_size > 0
    paths = {r["path"] for r in result["sampling"]["rows"]}
    assert {"generate, unmerged (before)", "compact, merged (now)"} <= paths
    assert all("error" not in r for r in result["rl_steps"]), result["rl_steps"]
    hours = result["projection"]["hours"]
    assert set(hours["rl_per_algorithm"]) == set(result["projection"]["rl_algorithms"])
    assert all(v > 0 for v in (hours["rl"], hours["evaluation_sampling_now"], hours["total_now"]))
    assert result["projection"]["assumptions"]
