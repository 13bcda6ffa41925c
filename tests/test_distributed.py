"""The distributed path on the CPU: PPO under `accelerate launch` with two processes (DDP over
gloo) against one process on the same global batch, and a launched stage's failure."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pandas as pd
import pytest

from rlxf_utils.config import load_config
from rlxf_utils.launch import StageFailed, accelerate_args, launch_env, run_stage

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "ppo_ranks_worker.py"
#: two processes sum in another order than one: weights may differ by float32 rounding only
TOLERANCE = 1e-5


def _launch(n: int, out: Path) -> pd.DataFrame:
    cmd = [*accelerate_args(None, n, "cpu" if n == 1 else "auto"), str(WORKER), str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=launch_env("cpu"))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return pd.read_parquet(out / "train_log.parquet")


@pytest.mark.slow
def test_ppo_on_two_processes_matches_one(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    one, two = _launch(1, tmp_path / "one"), _launch(2, tmp_path / "two")
    assert one["processes"].tolist() == [1, 1, 1] and two["processes"].tolist() == [2, 2, 2]
    # DDP kept the ranks' weights identical after every step
    assert (two["rank_weight_spread"] == 0).all(), two["rank_weight_spread"].tolist()
    # the statistics the ranks reduce (reward, KL driving beta, critic) equal one process's
    for col in ("reward_mean", "kl", "kl_coef", "entropy", "value_mean", "explained_variance"):
        assert two[col].tolist() == pytest.approx(one[col].tolist(), abs=1e-5), col
    # the approximate-KL early stop fired, on every rank at the same minibatch (or DDP hangs)
    assert (one["approx_kl"] > 0.005).any()
    for name in ("adapter/adapter_model.safetensors", "value_head.safetensors"):
        a, b = load_file(str(tmp_path / "one" / name)), load_file(str(tmp_path / "two" / name))
        assert a.keys() == b.keys()
        diff = max(float((a[k] - b[k]).abs().max()) for k in a)
        assert diff < TOLERANCE, (name, diff)


@pytest.mark.slow
def test_a_failed_stage_names_itself_and_shows_its_log(tmp_path: Path) -> None:
    cfg = load_config(ROOT / "params/smoke.yaml")
    with pytest.raises(StageFailed) as ei:  # no reward model in an empty run dir
        run_stage(cfg, ROOT / "params/smoke.yaml", tmp_path, "rl", "ppo", echo=None)
    msg = str(ei.value)
    assert "rl stage 'ppo' failed" in msg and "launch.log" in msg
    assert "ArtifactMissing: missing artifact" in msg  # the worker's own error, not the launcher's
    assert (tmp_path / "policy/ppo/launch.log").is_file()
