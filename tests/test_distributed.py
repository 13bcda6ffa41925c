"""The distributed path on the CPU: PPO under `accelerate launch` with two processes (DDP over
gloo) against one process on the same global batch, and a launched stage's failure."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pandas as pd
import pytest

from rlxf_utils.config import load_config
from rlxf_utils.rl.launch import StageFailed, accelerate_args, launch_env, run_stage

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "ppo_ranks_worker.py"
#: two processes sum in another order than one: weights may differ by float32 rounding only
TOLERANCE = 1e-5


def _launch(n: int, out: Path, *args: str) -> pd.DataFrame:
    cmd = [*accelerate_args(None, n, "cpu" if n == 1 else "auto"), str(WORKER), str(out), *args]
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
def test_rlgf_on_two_processes_keeps_the_ranks_in_step(tmp_path: Path) -> None:
    """D²LOLS with the MLE term: its gradient (a forward outside DDP, accumulated under no_sync)
    and the guide's critic (idle in PPO++ steps) must still be averaged over the processes."""
    log = _launch(2, tmp_path / "d2lols", "d2lols")
    assert log["scheme"].tolist() == ["aggrevated"] * 2 + ["ppo_pp"] * 2
    assert (log["rank_weight_spread"] == 0).all(), log["rank_weight_spread"].tolist()


@pytest.mark.slow
def test_a_failed_stage_names_itself_and_shows_its_log(tmp_path: Path) -> None:
    cfg = load_config(ROOT / "params/smoke.yaml")
    with pytest.raises(StageFailed) as ei:  # no reward model in an empty run dir
        run_stage(cfg, ROOT / "params/smoke.yaml", tmp_path, "rl", "ppo", echo=None)
    msg = str(ei.value)
    assert "rl stage 'ppo' failed" in msg and "launch.log" in msg
    assert "ArtifactMissing: missing artifact" in msg  # the worker's own error, not the launcher's
    assert (tmp_path / "policy/ppo/launch.log").is_file()


# -- configuration: compute section, launch commands, hub, configs, memory table --------------
def _params(tmp_path: Path, **compute) -> Path:
    """The smoke profile with `compute`; on several processes without KTO and DPO, which need
    two sequences per process in each of the smoke's two-sequence minibatches."""
    import yaml

    # the smoke profile resolved: every key written out, paths absolute
    raw = load_config(ROOT / "params/smoke.yaml").resolved()
    if compute.get("num_processes", 1) > 1:
        raw["rl"]["algorithm"] = [a for a in raw["rl"]["algorithm"] if a not in ("kto", "dpo")]
    raw["compute"] = compute
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(raw))
    return tmp_path / "p.yaml"


def test_compute_settings_are_checked(tmp_path: Path) -> None:
    from rlxf_utils.config import ConfigError

    with pytest.raises(ConfigError, match="processes 'kernel'"):
        load_config(_params(tmp_path, processes="kernel", num_processes=2))
    with pytest.raises(ConfigError, match=r"divisible by compute.num_processes=3"):
        load_config(_params(tmp_path, num_processes=3))  # smoke: batch 4, minibatch 2
    with pytest.raises(ConfigError, match="compute.accelerate_config.*file not found"):
        load_config(_params(tmp_path, accelerate_config="accelerate/nope.yaml"))
    (tmp_path / "acc.yaml").write_text("distributed_type: 'NO'\n")
    cfg = load_config(_params(tmp_path, accelerate_config="acc.yaml"))
    assert cfg.compute.accelerate_config == tmp_path / "acc.yaml"  # next to the params file


def test_stage_commands_take_the_config_file_only_where_every_process_is_used(
    tmp_path: Path,
) -> None:
    (tmp_path / "acc.yaml").write_text("distributed_type: MULTI_GPU\n")
    cfg = load_config(_params(tmp_path, accelerate_config="acc.yaml", num_processes=2))
    from rlxf_utils.rl.launch import stage_command

    ppo = stage_command(cfg, tmp_path / "p.yaml", tmp_path, "rl", "ppo")
    assert ppo[ppo.index("--config_file") + 1] == str(tmp_path / "acc.yaml")
    assert ppo[ppo.index("--num_processes") + 1] == "2"
    assert ppo[-6:] == ["--params", str(tmp_path / "p.yaml"), "--run-dir", str(tmp_path),
                        "--algo", "ppo"]  # fmt: skip
    for stage, name in (("sft", None), ("rl", "ilhf_history")):  # one-process loops
        cmd = stage_command(cfg, tmp_path / "p.yaml", tmp_path, stage, name)
        assert "--config_file" not in cmd and cmd[cmd.index("--num_processes") + 1] == "1"


def test_one_process_algorithms_share_a_warm_process_and_the_rest_run_alone(
    tmp_path: Path,
) -> None:
    """`warm_groups`: consecutive one-process algorithms in one process (on one process every
    algorithm is one), an algorithm on several processes alone and never with others;
    `compute.warm_stages: false` gives each its own; the group's command names them all."""
    from rlxf_utils.rl.launch import stage_command, warm_groups

    order = ["ppo", "ilhf_history", "ilhf_online", "grpo", "kto", "rft"]
    one = load_config(_params(tmp_path, num_processes=1))
    assert warm_groups(one, order) == [order]
    cmd = stage_command(one, tmp_path / "p.yaml", tmp_path, "rl", order[:3])
    assert cmd[-2:] == ["--algo", "ppo,ilhf_history,ilhf_online"]
    two = load_config(_params(tmp_path, num_processes=2))
    assert warm_groups(two, order) == [["ppo"], ["ilhf_history", "ilhf_online"], ["grpo"], ["kto"], ["rft"]]  # fmt: skip
    with pytest.raises(ValueError, match="only one-process algorithms share a process"):
        stage_command(two, tmp_path / "p.yaml", tmp_path, "rl", ["ppo", "grpo"])
    apart = load_config(_params(tmp_path, num_processes=1, warm_stages=False))
    assert warm_groups(apart, order) == [[a] for a in order]


def test_side_by_side_lanes_deal_a_warm_group_and_share_the_cores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`compute.parallel_stages`: a warm group dealt to the lanes in turn, an algorithm on
    several processes alone; each lane's process gets its share of the cores whatever the
    number of algorithms pending (SFT, on its own, all of them); a lane needs warm processes."""
    import os

    from rlxf_utils.config import ConfigError
    from rlxf_utils.rl.launch import lanes, stage_command

    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    order = ["ppo", "ppo_mle", "d2lols", "grpo", "rloo"]
    two = load_config(_params(tmp_path, num_processes=1, parallel_stages=2))
    assert lanes(two, order) == [["ppo", "d2lols", "rloo"], ["ppo_mle", "grpo"]]
    assert lanes(two, ["kto"]) == [["kto"]]
    three = load_config(_params(tmp_path, num_processes=1, parallel_stages=3))
    assert lanes(three, order) == [["ppo", "grpo"], ["ppo_mle", "rloo"], ["d2lols"]]

    def threads(cfg, stage, name):
        cmd = stage_command(cfg, tmp_path / "p.yaml", tmp_path, stage, name)
        return int(cmd[cmd.index("--num_cpu_threads_per_process") + 1])

    assert threads(two, "rl", ["ppo", "d2lols"]) == threads(two, "rl", "kto") == 2
    assert threads(three, "rl", "kto") == 1 and threads(two, "sft", None) == 4
    one = load_config(_params(tmp_path, num_processes=1))
    assert lanes(one, order) == [order] and threads(one, "rl", "kto") == 4
    every = load_config(_params(tmp_path, num_processes=1, parallel_stages=2, lane_threads="all"))
    assert lanes(every, order) == lanes(two, order) and threads(every, "rl", ["ppo", "grpo"]) == 4
    several = load_config(_params(tmp_path, num_processes=2, parallel_stages=2))
    assert lanes(several, ["ppo"]) == [["ppo"]] and threads(several, "rl", "ppo") == 2
    assert lanes(several, ["ilhf_history", "ilhf_online"]) == [["ilhf_history"], ["ilhf_online"]]
    with pytest.raises(ConfigError, match="parallel_stages 2 .* warm_stages: true"):
        load_config(_params(tmp_path, num_processes=1, parallel_stages=2, warm_stages=False))
    with pytest.raises(ConfigError, match="lane_threads"):
        load_config(_params(tmp_path, num_processes=1, parallel_stages=2, lane_threads="half"))


@pytest.mark.parametrize(("lane_threads", "set_here", "seen"), [
    ("all", None, "PASSIVE"),  # the lanes' threads outnumber the cores: they wait passively
    ("all", "ACTIVE", "ACTIVE"),  # what the environment sets wins
    ("share", None, "unset"),  # a core each: libgomp's own default
])  # fmt: skip
def test_lanes_that_outnumber_the_cores_wait_passively(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lane_threads: str, set_here: str | None,
    seen: str,
) -> None:  # fmt: skip
    """`compute.lane_threads: all` on two lanes: each lane's process gets `OMP_WAIT_POLICY=PASSIVE`
    unless this environment sets it; with the cores shared among the lanes, nothing is set."""
    import os
    import sys

    from rlxf_utils.rl import launch

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    if set_here is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", set_here)

    def command(cfg, params_file, run_dir, stage, name):
        script = "import os; print('INFO wait', os.environ.get('OMP_WAIT_POLICY', 'unset'))"
        return [sys.executable, "-c", script]

    monkeypatch.setattr(launch, "stage_command", command)
    cfg = load_config(_params(tmp_path, num_processes=1, parallel_stages=2,
                              lane_threads=lane_threads))  # fmt: skip
    echoed: list[str] = []
    launch.run_lanes(cfg, tmp_path / "p.yaml", tmp_path, ["ppo", "grpo"], echoed.append)
    assert {f"[ppo] INFO wait {seen}", f"[grpo] INFO wait {seen}"} <= set(echoed)
    assert ("waiting passively" in echoed[0]) == (lane_threads == "all")


def test_lanes_run_side_by_side_and_a_failed_lane_lets_the_other_finish(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`run_lanes`: the lanes' processes run at the same time (each waits to see the other's
    file), a lane that fails does not stop the other, and its failure is raised after both."""
    import sys

    from rlxf_utils.rl import launch

    def command(cfg, params_file, run_dir, stage, name):
        first = name if isinstance(name, str) else name[0]
        other = {"ppo": "ppo_mle", "ppo_mle": "ppo"}[first]
        script = (
            "import pathlib, sys, time\n"
            f"here, there = pathlib.Path({str(tmp_path)!r}) / {first!r}, "
            f"pathlib.Path({str(tmp_path)!r}) / {other!r}\n"
            "here.write_text('up')\n"
            "end = time.monotonic() + 60\n"
            "while not there.exists() and time.monotonic() < end: time.sleep(0.05)\n"
            "print('INFO saw the other lane' if there.exists() else 'INFO alone', flush=True)\n"
            f"if {first!r} == 'ppo_mle': sys.exit('ValueError: ppo_mle broke')\n"
            "time.sleep(0.5); (here.parent / 'ppo.done').write_text('ok')\n"
        )
        return [sys.executable, "-c", script]

    monkeypatch.setattr(launch, "stage_command", command)
    cfg = load_config(_params(tmp_path, num_processes=1, parallel_stages=2))
    echoed: list[str] = []
    with pytest.raises(StageFailed, match="rl stage 'ppo_mle' failed.*ppo_mle broke"):
        launch.run_lanes(cfg, tmp_path / "p.yaml", tmp_path, ["ppo", "ppo_mle"], echoed.append)
    assert (tmp_path / "ppo.done").read_text() == "ok"  # the other lane ran to its end
    assert echoed[0].startswith("2 warm processes side by side") and "ppo | ppo_mle" in echoed[0]
    assert {"[ppo] INFO saw the other lane", "[ppo_mle] INFO saw the other lane"} <= set(echoed)


def test_an_interrupt_takes_every_lane_down(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, python_sigint: None
) -> None:
    """The kernel interrupted while two lanes train: `run_lanes` kills both processes and
    re-raises at once, instead of waiting for them to end."""
    import _thread
    import sys
    import threading
    import time

    import psutil

    from rlxf_utils.rl import launch

    def command(cfg, params_file, run_dir, stage, name):
        script = f"import os, pathlib, time; pathlib.Path({str(tmp_path)!r}, {name!r}).write_text(str(os.getpid())); time.sleep(120)"  # fmt: skip
        return [sys.executable, "-c", script]

    def interrupt_when_both_run() -> None:
        end = time.monotonic() + 30
        while time.monotonic() < end and not all((tmp_path / a).exists() for a in ("ppo", "grpo")):
            time.sleep(0.05)
        _thread.interrupt_main()

    monkeypatch.setattr(launch, "stage_command", command)
    cfg = load_config(_params(tmp_path, num_processes=1, parallel_stages=2))
    threading.Thread(target=interrupt_when_both_run, daemon=True).start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        launch.run_lanes(cfg, tmp_path / "p.yaml", tmp_path, ["ppo", "grpo"], echo=None)
    assert time.monotonic() - t0 < 60
    for a in ("ppo", "grpo"):
        pid = int((tmp_path / a).read_text())
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_warm_process_writes_each_algorithms_log_apart_and_names_the_one_that_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The launcher moves the log to each next algorithm's `launch.log` when the worker says so;
    a failure names the algorithm training when it came and shows that algorithm's lines."""
    import sys

    from rlxf_utils.rl import launch

    script = (
        "print('INFO ppo trains'); print('RuntimeError: not this one (a logged message)')\n"
        f"print({launch.NEXT_STAGE!r} + 'grpo', flush=True)\n"
        "import sys; print('INFO grpo trains'); sys.exit('ValueError: grpo broke')"
    )
    monkeypatch.setattr(launch, "stage_command", lambda *a, **k: [sys.executable, "-c", script])
    cfg = load_config(ROOT / "params/smoke.yaml")
    echoed: list[str] = []
    with pytest.raises(StageFailed) as ei:
        run_stage(cfg, ROOT / "params/smoke.yaml", tmp_path, "rl", ["ppo", "grpo"], echo=echoed.append)  # fmt: skip
    msg = str(ei.value)
    assert "rl stage 'grpo' failed" in msg and "ValueError: grpo broke" in msg
    assert "ppo trains" not in msg and "policy/grpo/launch.log" in msg
    ppo = (tmp_path / "policy/ppo/launch.log").read_text()
    grpo = (tmp_path / "policy/grpo/launch.log").read_text()
    assert "ppo trains" in ppo and "grpo" not in ppo
    assert "grpo trains" in grpo and "ppo" not in grpo and launch.NEXT_STAGE not in grpo
    assert "then grpo in the same process" in echoed[0]
    assert "[grpo] INFO grpo trains" in echoed


def test_hub_access_follows_the_profile_unless_the_environment_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rlxf_utils.runtime import hub_environment

    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    online = load_config(_params(tmp_path, hf_offline=False))
    assert hub_environment(online)["HF_HUB_OFFLINE"] == "0"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # set by the user: wins over the profile
    assert hub_environment(online)["HF_HUB_OFFLINE"] == "1"
    assert load_config(ROOT / "params/smoke.yaml").compute.hf_offline  # the default: offline
    assert not load_config(ROOT / "params/paper.yaml").compute.hf_offline  # the hub model


def test_resolve_device() -> None:
    import torch

    from rlxf_utils.runtime import resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")
        with pytest.raises(RuntimeError, match="no CUDA"):
            resolve_device("cuda")


ACCELERATE_CONFIGS = sorted((ROOT / "params/accelerate").glob("*.yaml"))


@pytest.mark.parametrize("path", ACCELERATE_CONFIGS, ids=lambda p: p.stem)
def test_accelerate_configs_load_and_the_docs_show_how_to_use_them(path: Path) -> None:
    from accelerate.commands.config.config_args import load_config_from_file

    c = load_config_from_file(str(path))
    want = {"single_gpu_bf16": "NO", "multi_gpu_ddp": "MULTI_GPU", "cpu_ddp": "MULTI_GPU",
            "deepspeed_zero2": "DEEPSPEED", "deepspeed_zero3": "DEEPSPEED"}  # fmt: skip
    assert str(c.distributed_type).rsplit(".", 1)[-1] == want[path.stem]
    if c.distributed_type == "DEEPSPEED":
        assert c.deepspeed_config["zero_stage"] == int(path.stem[-1])
    assert f"accelerate/{path.name}" in (ROOT / "docs" / "profiles-and-gpus.md").read_text()


def test_docs_memory_table_is_the_computed_one() -> None:
    from rlxf_utils.rl.memory import memory_per_gpu, memory_table

    assert memory_table() in (ROOT / "docs" / "profiles-and-gpus.md").read_text()
    # 1B frozen bf16 parameters on one GPU: 2e9 bytes; ZeRO-3 on 4 GPUs shards them
    assert memory_per_gpu(10**9, 0, 0, "single", 1) == pytest.approx(2e9 / 2**30)
    assert memory_per_gpu(10**9, 0, 0, "zero3", 4) == pytest.approx(0.5e9 / 2**30)
    # LoRA: 16 bytes a parameter, of which ZeRO-2 shards 12
    assert memory_per_gpu(0, 10**6, 0, "zero2", 4) == pytest.approx(7e6 / 2**30)


def test_a_launched_process_dies_with_its_parent(tmp_path: Path) -> None:
    """A stage must not outlive the kernel that launched it: the child of a killed parent goes."""
    import os
    import signal
    import sys
    import time

    import psutil

    pid_file = tmp_path / "pid"
    grandchild = (
        "import os, time\n"
        "from rlxf_utils.processes import die_with_parent\n"
        "die_with_parent()\n"
        f"open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
        "time.sleep(60)\n"
    )
    code = (
        "import os, subprocess, sys, time\n"
        "env = dict(os.environ, RLXF_PARENT_PID=str(os.getpid()))\n"
        f"subprocess.Popen([sys.executable, '-c', {grandchild!r}], env=env)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], env=os.environ)
    for _ in range(400):
        if pid_file.exists() and pid_file.read_text():
            break
        time.sleep(0.05)
    child = int(pid_file.read_text())
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    for _ in range(100):  # the child is gone (killed; a zombie until init reaps it) in seconds
        try:
            if psutil.Process(child).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.05)
    pytest.fail(f"child {child} outlived its killed parent")
