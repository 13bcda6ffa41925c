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
           "--rl-steps", "2", "--profile", "--out", str(tmp_path)]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_scale.json").read_text(encoding="utf-8"))
    assert (tmp_path / "gpu_scale.png").stat().st_size > 0
    paths = {r["path"] for r in result["sampling"]["rows"]}
    assert {"generate, unmerged (before)", "generate, merged", "compact, merged"} <= paths
    # each path timed twice at each size, at its fastest run (a first run pays for allocation)
    rows = result["sampling"]["rows"]
    assert all(len(r["seconds_runs"]) == 2 and r["seconds"] == min(r["seconds_runs"]) for r in rows)
    # each PPO rollout against plain generate on the same merged weights at the rollout's batch
    ratios = {r["sampler"]: r["slower_by"] for r in result["rollout_against_generate"]}
    assert set(ratios) == {"compact", "transformers"} and all(v > 0 for v in ratios.values())
    # the projection samples as paper.yaml does (sampler: transformers, LoRA merged)
    assert result["projection"]["evaluation_path_now"] == "generate, merged"
    assert all("error" not in r for r in result["rl_steps"]), result["rl_steps"]
    hours = result["projection"]["hours"]
    assert set(hours["rl_per_algorithm"]) == set(result["projection"]["rl_algorithms"])
    assert all(v > 0 for v in (hours["rl"], hours["evaluation_sampling_now"], hours["total_now"]))
    assert result["projection"]["assumptions"]
    profile = json.loads((tmp_path / "gpu_profile.json").read_text(encoding="utf-8"))
    assert set(profile["paths"]) == {"generate, merged", "compact, merged"}
    assert all(p["top_self_cpu"] and p["syncs_per_step"] for p in profile["paths"].values())


def test_the_bench_policy_generates_as_the_studys_loaded_policy_does():
    """bench/gpu_scale.py's random Llama gets `load_policy`'s `generate` (a LoRA merged while
    sampling): its PPO and GRPO rollouts time the study's path, not an unmerged LoRA."""
    import torch

    sys.path.insert(0, str(PROJECT_ROOT / "bench"))
    try:
        import gpu_scale
    finally:
        sys.path.remove(str(PROJECT_ROOT / "bench"))
    for merge in (True, False):
        model = gpu_scale.build_policy(gpu_scale.TINY_LLAMA, "cpu", torch.float32, 0.1, merge)
        assert model.rlxf_merge_lora is merge
        assert model.generate.__func__.__name__ == "_generate_with_autocast_cache"
