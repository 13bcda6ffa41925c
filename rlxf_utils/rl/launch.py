"""Each training stage in its own process, started with `accelerate launch`.

`accelerate` keeps one state per process: the first `Accelerator` fixes mixed precision and the
distributed set-up, and a second one with other settings either raises ("AcceleratorState has
already been initialized") or silently inherits the first. So SFT and the RL algorithms run
outside the kernel (`compute.processes: per_stage`, the default), and where one process trains
several algorithms in turn (`warm_groups`: one-process algorithms, `compute.warm_stages`), the
worker clears accelerate's state between them:

    notebook 03 --> run_stage("rl", "ppo")  --> accelerate launch [--config_file F] [--num_processes N]
                                                   -m rlxf_utils.rl.worker rl --params P --run-dir R --algo ppo
                <-- its log lines, streamed       (each rank: reward model, prompts, run_algorithm)
                --> reads what the process wrote (`complete.json` with the marker the kernel
                    computed once, then `train_log.parquet`)

The worker is the same code the kernel would run (`run_algorithm`, `run_sft_stage`); for an RL
algorithm the notebook only reads what it wrote (`rl.stage.rl_step`), for SFT it calls
`run_sft_stage` itself, which finds both policies trained and reads their outputs.
A failed process raises `StageFailed` naming the stage and showing the tail of its log
(`policy/<name>/launch.log`). PPO and the RLGF algorithms (ours) and GRPO/RLOO (TRL) use all
`compute.num_processes`; SFT and ILHF run one process (their loops are not data-parallel).

This module imports no torch at the top: notebooks call `runtime.hub_environment` before transformers
is imported (the hub's offline switch is read once, at import).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from rlxf_utils.algorithms import algorithm
from rlxf_utils.processes import launch_env

#: Lines of a failed stage's log shown in the error.
TAIL_LINES = 40

#: The line a warm worker prints before its next algorithm (`rl.worker`): the launcher moves
#: the log to that algorithm's `launch.log`.
NEXT_STAGE = "RLXF next stage: "


#: A Python exception line at the start of a log line ("pkg.mod.SomeError: message").
_ERROR_RE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Missing|Failed|Interrupt)\w*: ")


class StageFailed(RuntimeError):
    """A stage's process exited with an error; the message names it and shows its log's tail."""


def processes_for(cfg: Any, stage: str, name: str | None) -> int:
    """How many processes a stage gets: `compute.num_processes`, or 1 for SFT and the algorithms the
    registry runs on one process (ILHF)."""
    one = stage == "sft" or (name is not None and algorithm(name).one_process)
    return 1 if one else cfg.compute.num_processes


def warm_groups(cfg: Any, names: Sequence[str]) -> list[list[str]]:
    """RL algorithms to train, grouped into processes: consecutive one-process algorithms share
    one warm process (`rl.worker` trains them in turn, paying the imports and the reward model's
    loading once, with accelerate's state cleared between them); an algorithm on several
    processes runs in its own. `compute.warm_stages: false`: every algorithm its own process."""
    groups: list[list[str]] = []
    for name in names:
        one = processes_for(cfg, "rl", name) == 1
        if (
            one
            and cfg.compute.warm_stages
            and groups
            and processes_for(cfg, "rl", groups[-1][0]) == 1
        ):
            groups[-1].append(name)
        else:
            groups.append([name])
    return groups


def lanes(cfg: Any, group: Sequence[str]) -> list[list[str]]:
    """A warm group's algorithms dealt to `compute.parallel_stages` side-by-side processes:
    lane i trains the group's algorithms i, i + n, i + 2n, ... in turn (fewer lanes when the
    group is shorter: a several-process algorithm, always a group of its own, is one lane)."""
    n = cfg.compute.parallel_stages
    return [list(group[i::n]) for i in range(min(n, len(group)))]


def stage_threads(cfg: Any, stage: str, n: int) -> int:
    """Torch threads of each process of a stage on `n` processes: the cores shared among them,
    and among `compute.parallel_stages` lanes for the one-process RL algorithms (whatever the
    number of lanes running: an algorithm's threads follow from the settings alone), unless
    `compute.lane_threads` is 'all'."""
    shared = stage == "rl" and n == 1 and cfg.compute.lane_threads == "share"
    side = cfg.compute.parallel_stages if shared else 1
    return max(1, (os.cpu_count() or 1) // (n * side))


def _stage_names(name: str | Sequence[str] | None) -> list[str]:
    """The algorithms a stage's `name` names: none (SFT), one, or a `warm_groups` group."""
    return [name] if isinstance(name, str) else list(name or [])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def accelerate_args(config_file: str | Path | None, n: int, device: str = "auto",
                    threads: int | None = None) -> list[str]:  # fmt: skip
    """`accelerate launch ...` up to the program: a config file, or
    accelerate's defaults said out loud; `n` processes on a free local port, each with
    `threads` torch threads (default: the cores shared among them); `--cpu` for one
    process without CUDA (or with `device` 'cpu'). Several processes without CUDA run DDP over
    gloo: accelerate's `--multi_gpu` launcher falls back to MULTI_CPU (its `--cpu` launcher
    would need MPI)."""
    import torch

    # accelerate's launcher, set to die with this process (rlxf_utils/rl/accelerate_launch.py)
    cmd = [sys.executable, "-m", "rlxf_utils.rl.accelerate_launch"]
    if config_file is not None:
        cmd += ["--config_file", str(config_file)]
    else:  # no warning about values not passed
        cmd += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
        if n > 1:
            cmd += ["--multi_gpu"]
    cmd += ["--num_processes", str(n), "--main_process_port", str(_free_port())]
    threads = threads or max(1, (os.cpu_count() or 1) // n)
    cmd += ["--num_cpu_threads_per_process", str(threads)]
    if n == 1 and (device == "cpu" or not torch.cuda.is_available()):
        cmd += ["--cpu"]
    return cmd


def stage_command(
    cfg: Any,
    params_file: str | Path,
    run_dir: str | Path,
    stage: str,
    name: str | Sequence[str] | None = None,
) -> list[str]:
    """The `accelerate launch` command line of one stage ('sft', or 'rl' with algorithm `name`,
    or several algorithms of one `warm_groups` group, trained in turn by one process)."""
    names = _stage_names(name)
    n = max([processes_for(cfg, stage, x) for x in names] or [processes_for(cfg, stage, None)])
    if len(names) > 1 and n > 1:
        raise ValueError(f"{names}: only one-process algorithms share a process")
    name = ",".join(names) or None
    # the config file describes the whole job; a one-process stage of a multi-process job
    # (SFT, ILHF) runs with accelerate's defaults instead
    whole = cfg.compute.accelerate_config is not None and n == cfg.compute.num_processes
    cmd = accelerate_args(cfg.compute.accelerate_config if whole else None, n, cfg.compute.device,
                          stage_threads(cfg, stage, n))  # fmt: skip
    cmd += ["-m", "rlxf_utils.rl.worker", stage, "--params", str(Path(params_file).resolve())]
    cmd += ["--run-dir", str(Path(run_dir).resolve())]
    return cmd + (["--algo", name] if name else [])


def run_stage(
    cfg: Any,
    params_file: str | Path,
    run_dir: str | Path,
    stage: str,
    name: str | Sequence[str] | None = None,
    echo: Callable[[str], Any] | None = print,
    started: Callable[[subprocess.Popen], Any] | None = None,
    env_defaults: Mapping[str, str] | None = None,
) -> Path | None:
    """Run a stage in its own process (or do nothing with `compute.processes: kernel`), streaming
    its output through `echo` into `policy/<name or sft>/launch.log`; returns the log's path.
    Several algorithms (`warm_groups`): one process trains them in turn, each algorithm's lines
    in its own `launch.log` (the worker announces each next one: `NEXT_STAGE`). `env_defaults`:
    variables the process gets where this environment does not set them.

    Raises `StageFailed` with the stage's name (the algorithm training when it failed), exit
    code and the last `TAIL_LINES` lines."""
    if cfg.compute.processes == "kernel":
        return None
    cmd = stage_command(cfg, params_file, run_dir, stage, name)
    names = _stage_names(name)
    label = names[0] if names else stage
    log_path = Path(run_dir) / "policy" / label / "launch.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = launch_env(cfg.compute.device)
    for key, value in (env_defaults or {}).items():
        env.setdefault(key, value)
    env["RLXF_PARENT_PID"] = str(os.getpid())  # the launcher dies with this process
    env["RLXF_LAUNCHED_AT"] = repr(time.time())  # its start-up, measured (`rl.timing`)
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    cause = None
    n = processes_for(cfg, stage, label if names else None)
    if echo:
        also = f", then {', '.join(names[1:])} in the same process" if len(names) > 1 else ""
        echo(f"{label}: {n} process{'es' if n > 1 else ''} (accelerate launch){also}, log {log_path}")  # fmt: skip
    fh = log_path.open("w", encoding="utf-8")
    try:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
            bufsize=1, errors="replace",
        )  # fmt: skip
        if started:
            started(proc)
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                nxt = line.startswith(NEXT_STAGE) and line[len(NEXT_STAGE) :].strip()
                if nxt in names:  # the warm worker's next algorithm: its own log from here
                    fh.close()
                    label, log_path = nxt, Path(run_dir) / "policy" / nxt / "launch.log"
                    log_path.parent.mkdir(parents=True, exist_ok=True)
                    fh = log_path.open("w", encoding="utf-8")
                    tail.clear()
                    cause = None
                    continue
                fh.write(line)
                fh.flush()
                tail.append(line.rstrip("\n"))
                if _ERROR_RE.match(line) and not line.startswith("subprocess.CalledProcessError"):
                    cause = line.strip()  # the worker's exception, not the launcher's
                if echo and _worth_echoing(line):
                    echo(f"[{label}] {line.rstrip()}")
            rc = proc.wait()
        except BaseException:  # the kernel interrupted: take the stage's processes down with it
            proc.kill()
            proc.wait()
            raise
    finally:
        fh.close()
    if rc != 0:
        shown = "\n".join(f"    {x}" for x in tail)
        raise StageFailed(
            f"{stage} stage '{label}' failed (exit code {rc})"
            + (f": {cause}" if cause else "")
            + f"\n  last lines of {log_path}:\n{shown}"
        )
    return log_path


def run_lanes(
    cfg: Any,
    params_file: str | Path,
    run_dir: str | Path,
    group: Sequence[str],
    echo: Callable[[str], Any] | None = print,
) -> None:
    """Train a `warm_groups` group: its `lanes`, each a warm process (`run_stage`), side by side.
    Every lane runs to its end even when another fails (what it trains is kept), then the first
    failure is raised; an interrupt takes every lane's process down. Lanes whose threads
    outnumber the cores (`compute.lane_threads: all`) wait passively: libgomp's default spin
    of idle threads, against another process's threads on the same cores, slows both many
    times over (`bench/omp_wait.py`)."""
    todo = lanes(cfg, group)
    if len(todo) == 1:
        run_stage(cfg, params_file, run_dir, "rl", _one(todo[0]), echo=echo)
        return
    threads = stage_threads(cfg, "rl", 1)
    crowded = len(todo) * threads > (os.cpu_count() or 1)
    env = {"OMP_WAIT_POLICY": "PASSIVE"} if crowded else None
    if echo:
        echo(f"{len(todo)} warm processes side by side (compute.parallel_stages), "
             f"{threads} thread(s) each{', waiting passively' if crowded else ''}: "
             + " | ".join(", ".join(lane) for lane in todo))  # fmt: skip
    procs: list[subprocess.Popen] = []
    cancelled = threading.Event()

    def started(proc: subprocess.Popen) -> None:
        procs.append(proc)
        if cancelled.is_set():  # a lane that started after the interrupt
            proc.kill()

    pool = ThreadPoolExecutor(len(todo), thread_name_prefix="rlxf-lane")
    futures = [pool.submit(run_stage, cfg, params_file, run_dir, "rl", _one(lane), echo=echo,
                           started=started, env_defaults=env) for lane in todo]  # fmt: skip
    try:
        while wait(futures, timeout=0.5).not_done:  # short waits: an interrupt is seen at once
            pass
    except BaseException:  # the kernel interrupted: no lane outlives it
        cancelled.set()
        for proc in list(procs):
            proc.kill()
        raise
    finally:
        pool.shutdown(wait=True)
    for future in futures:
        if future.exception() is not None:
            raise future.exception()


def _one(lane: list[str]) -> str | list[str]:
    """A lane as `run_stage` names it: one algorithm, or a warm process's several."""
    return lane if len(lane) > 1 else lane[0]


def _worth_echoing(line: str) -> bool:
    """The stage's log records (progress, warnings, errors), not progress bars or libraries'
    chatter: those stay in `launch.log`, and a failure shows its tail."""
    return line.startswith(("INFO ", "WARNING ", "ERROR ", "CRITICAL "))
