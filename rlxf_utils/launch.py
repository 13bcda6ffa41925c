"""Each training stage in its own process, started with `accelerate launch`.

`accelerate` keeps one state per process: the first `Accelerator` fixes mixed precision and the
distributed set-up, and a second one with other settings either raises ("AcceleratorState has
already been initialized") or silently inherits the first. So SFT and every RL algorithm run in
their own process (`compute.processes: per_stage`, the default):

    notebook 03 --> run_stage("rl", "ppo")  --> accelerate launch [--config_file F] [--num_processes N]
                                                   -m rlxf_utils.launch rl --params P --run-dir R --algo ppo
                <-- its log lines, streamed       (each rank: reward model, prompts, rl.run_algorithm)
                --> rl.run_algorithm(...)          reads what the process wrote (`complete.json`)

The worker is the same code the kernel would run (`rl.run_algorithm`, `sft.run_sft_stage`); the
notebook then calls that code itself, which finds the stage complete and only reads its outputs.
A failed process raises `StageFailed` naming the stage and showing the tail of its log
(`policy/<name>/launch.log`). PPO and the RLGF algorithms (ours) and GRPO/RLOO (TRL) use all
`compute.num_processes`; SFT and ILHF run one process (their loops are not data-parallel).

This module imports no torch at the top: notebooks call `hub_environment` before transformers
is imported (the hub's offline switch is read once, at import).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import socket
import subprocess
import sys
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: RL algorithms whose loop runs on one process whatever `compute.num_processes` says (SFT's
#: too: `processes_for`).
ONE_PROCESS = ("ilhf_history", "ilhf_online")
#: Lines of a failed stage's log shown in the error.
TAIL_LINES = 40
#: A Python exception line at the start of a log line ("pkg.mod.SomeError: message").
_ERROR_RE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Missing|Failed|Interrupt)\w*: ")
_HUB_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")


class StageFailed(RuntimeError):
    """A stage's process exited with an error; the message names it and shows its log's tail."""


def hub_environment(cfg: Any) -> dict[str, str]:
    """Set the Hugging Face offline switches from `compute.hf_offline` unless the environment
    already sets them (an explicit `HF_HUB_OFFLINE=0 make study` wins); returns them."""
    value = "1" if cfg.compute.hf_offline else "0"
    return {k: os.environ.setdefault(k, value) for k in _HUB_VARS}


def processes_for(cfg: Any, stage: str, name: str | None) -> int:
    """How many processes a stage gets: `compute.num_processes`, or 1 for SFT and ILHF."""
    return 1 if stage == "sft" or name in ONE_PROCESS else cfg.compute.num_processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def accelerate_args(config_file: str | Path | None, n: int, device: str = "auto") -> list[str]:
    """`accelerate launch ...` up to the program: a config file, or
    accelerate's defaults said out loud; `n` processes on a free local port; `--cpu` for one
    process without CUDA (or with `device` 'cpu'). Several processes without CUDA run DDP over
    gloo: accelerate's `--multi_gpu` launcher falls back to MULTI_CPU (its `--cpu` launcher
    would need MPI)."""
    import torch

    # accelerate's launcher, set to die with this process (rlxf_utils/_accelerate_launch.py)
    cmd = [sys.executable, "-m", "rlxf_utils._accelerate_launch"]
    if config_file is not None:
        cmd += ["--config_file", str(config_file)]
    else:  # no warning about values not passed
        cmd += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
        if n > 1:
            cmd += ["--multi_gpu"]
    cmd += ["--num_processes", str(n), "--main_process_port", str(_free_port())]
    cmd += ["--num_cpu_threads_per_process", str(max(1, (os.cpu_count() or 1) // n))]
    if n == 1 and (device == "cpu" or not torch.cuda.is_available()):
        cmd += ["--cpu"]
    return cmd


def launch_env(device: str = "auto") -> dict[str, str]:
    """The environment of a launched stage: this one, plus `ACCELERATE_USE_CPU=true` where
    there is no CUDA (or `device` is 'cpu'): accelerate's `--multi_gpu` launcher does not set
    it, and without it a process on a CPU machine never joins the others' process group."""
    import torch

    env = dict(os.environ)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("PYTHONHASHSEED", "0")  # set iteration order (peft's target_modules) fixed
    if device == "cpu" or not torch.cuda.is_available():
        env["ACCELERATE_USE_CPU"] = "true"
    return env


def process_state() -> Any:
    """accelerate's `PartialState` of this process (on the CPU where the launcher said so):
    the same one every later `Accelerator` in the process joins."""
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    return PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))


def stage_command(
    cfg: Any, params_file: str | Path, run_dir: str | Path, stage: str, name: str | None = None
) -> list[str]:
    """The `accelerate launch` command line of one stage ('sft', or 'rl' with algorithm `name`)."""
    n = processes_for(cfg, stage, name)
    # the config file describes the whole job; a one-process stage of a multi-process job
    # (SFT, ILHF) runs with accelerate's defaults instead
    whole = cfg.compute.accelerate_config is not None and n == cfg.compute.num_processes
    cmd = accelerate_args(cfg.compute.accelerate_config if whole else None, n, cfg.compute.device)
    cmd += ["-m", "rlxf_utils.launch", stage, "--params", str(Path(params_file).resolve())]
    cmd += ["--run-dir", str(Path(run_dir).resolve())]
    return cmd + (["--algo", name] if name else [])


def run_stage(
    cfg: Any,
    params_file: str | Path,
    run_dir: str | Path,
    stage: str,
    name: str | None = None,
    echo: Callable[[str], Any] | None = print,
) -> Path | None:
    """Run a stage in its own process (or do nothing with `compute.processes: kernel`), streaming
    its output through `echo` into `policy/<name or sft>/launch.log`; returns the log's path.

    Raises `StageFailed` with the stage's name, exit code and the last `TAIL_LINES` lines."""
    if cfg.compute.processes == "kernel":
        return None
    cmd = stage_command(cfg, params_file, run_dir, stage, name)
    label = name or stage
    log_path = Path(run_dir) / "policy" / label / "launch.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = launch_env(cfg.compute.device)
    env["RLXF_PARENT_PID"] = str(os.getpid())  # the launcher dies with this process
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    cause = None
    n = processes_for(cfg, stage, name)
    if echo:
        echo(f"{label}: {n} process{'es' if n > 1 else ''} (accelerate launch), log {log_path}")
    with log_path.open("w", encoding="utf-8") as fh:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
            bufsize=1, errors="replace",
        )  # fmt: skip
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
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
    if rc != 0:
        shown = "\n".join(f"    {x}" for x in tail)
        raise StageFailed(
            f"{stage} stage '{label}' failed (exit code {rc})"
            + (f": {cause}" if cause else "")
            + f"\n  last lines of {log_path}:\n{shown}"
        )
    return log_path


def die_with_parent() -> None:
    """Linux: have this process killed when its parent dies (`prctl(PR_SET_PDEATHSIG)`), so a
    stage never outlives the notebook kernel that launched it (an interrupted `make study`
    leaves no training process behind). Elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    # the parent may have died before the line above: then no signal comes; the launcher
    # names the parent it expects in RLXF_PARENT_PID
    expected = os.environ.get("RLXF_PARENT_PID")
    if expected and int(expected) != os.getppid():
        os._exit(1)


def _worth_echoing(line: str) -> bool:
    """The stage's log records (progress, warnings, errors), not progress bars or libraries'
    chatter: those stay in `launch.log`, and a failure shows its tail."""
    return line.startswith(("INFO ", "WARNING ", "ERROR ", "CRITICAL "))


# ---------------------------------------------------------------------------------------------
# The worker: `python -m rlxf_utils.launch {sft,rl} --params P --run-dir R [--algo A]`
# ---------------------------------------------------------------------------------------------
def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rlxf_utils.launch", description=__doc__)
    p.add_argument("stage", choices=["sft", "rl"], nargs="?")
    p.add_argument("--params", type=Path)
    p.add_argument("--run-dir", type=Path)
    p.add_argument("--algo", default=None)
    p.add_argument("--memory", action="store_true", help="print the README's memory table")
    args = p.parse_args(argv)
    if not args.memory and not (args.stage and args.params and args.run_dir):
        p.error("a stage with --params and --run-dir, or --memory")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    if args.memory:
        print(memory_table(), end="")
        return 0
    from rlxf_utils.config import load_config

    die_with_parent()  # the launcher's worker: gone when the launcher is
    cfg = load_config(args.params)
    hub_environment(cfg)
    logging.basicConfig(
        level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stdout
    )
    from rlxf_utils.artifacts import RunDir

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        process_state()  # join the process group before anything else creates a state
    run = RunDir(args.run_dir)
    if args.stage == "sft":
        from rlxf_utils import sft

        sft.run_sft_stage(cfg, run, progress=False)
        return 0
    if not args.algo or args.algo not in cfg.rl.algorithm:
        raise SystemExit(f"--algo {args.algo!r}: expected one of rl.algorithm {cfg.rl.algorithm}")
    from rlxf_utils import rl
    from rlxf_utils.reward import load_reward

    contexts = rl.load_contexts(run.root, "train", cfg.rl.max_prompts, cfg.run.seed)
    reward_model, _ = load_reward(run.require("reward_model", stage="notebook 02 (reward model)"))
    reward_fn = rl.make_reward_fn(reward_model, cfg.rl.reward_batch_size)
    rl.run_algorithm(args.algo, cfg, run.root, reward_fn, contexts=contexts, progress=False)
    return 0


# ---------------------------------------------------------------------------------------------
# Memory per GPU, estimated from parameter counts (README: "Running on GPUs")
# ---------------------------------------------------------------------------------------------
#: LLaMA-2-7B's architecture (its published config.json), for counting parameters offline.
LLAMA2_7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32)  # fmt: skip
GIB = 2**30


def parameter_counts(
    model_config: Any, target_modules: Sequence[str], rank: int
) -> tuple[int, int]:
    """(all parameters, LoRA parameters) of a causal LM built from `model_config` on the meta
    device (nothing allocated): LoRA adds rank x (in + out) per targeted linear layer."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    total = sum(p.numel() for p in model.parameters())
    lora = sum(
        rank * (m.in_features + m.out_features)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in target_modules
    )
    return total, lora


def memory_per_gpu(
    n_params: int, n_lora: int, n_reward: int, strategy: str, gpus: int, guide: bool = False
) -> float:
    """Estimated GiB per GPU for RL with a LoRA policy, before activations and the KV cache.

    The policy in bf16 (2 bytes a parameter; the reference is the same weights with adapters off,
    no copy); an RLGF guide is a second bf16 copy. LoRA weights in fp32 (peft upcasts adapters
    of a bf16 model) with their gradient and Adam's two moments: 16 bytes a LoRA parameter, of
    which ZeRO-2/3 shard the gradient and moments (12 bytes) over the GPUs and ZeRO-3 the
    frozen weights too. The reward model scores in fp32 (4 bytes) on every process."""
    if strategy not in ("single", "ddp", "zero2", "zero3"):
        raise ValueError(f"strategy {strategy!r}: expected single, ddp, zero2 or zero3")
    n = 1 if strategy == "single" else gpus
    frozen = 2 * n_params * (2 if guide else 1) / (n if strategy == "zero3" else 1)
    lora = n_lora * (4 + 12 / (n if strategy in ("zero2", "zero3") else 1))
    return (frozen + lora + 4 * n_reward) / GIB


def memory_table(gpus: int = 8) -> str:
    """The README's table: GiB per GPU for the paper profile's policy (LLaMA-2-7B shape, LoRA
    rank and targets from params/paper.yaml) and reward (BERT-base), per accelerate config."""
    from transformers import BertConfig, BertModel, LlamaConfig

    from rlxf_utils.config import PROJECT_ROOT, load_config

    cfg = load_config(PROJECT_ROOT / "params/paper.yaml")
    lora = cfg.policy.lora
    n, n_lora = parameter_counts(LlamaConfig(**LLAMA2_7B), lora.target_modules, lora.rank)
    import torch

    with torch.device("meta"):
        n_reward = sum(p.numel() for p in BertModel(BertConfig()).parameters())
    rows = [
        ("single_gpu_bf16.yaml", "single", 1),
        ("multi_gpu_ddp.yaml", "ddp", gpus),
        ("deepspeed_zero2.yaml", "zero2", gpus),
        ("deepspeed_zero3.yaml", "zero3", gpus),
    ]
    lines = [
        f"Policy {n / 1e9:.2f}B parameters (LLaMA-2-7B shape), LoRA rank {lora.rank} on "
        f"{', '.join(lora.target_modules)}: {n_lora / 1e6:.1f}M trainable; reward BERT-base "
        f"{n_reward / 1e6:.0f}M. GiB per GPU, estimated from these counts (`python -m "
        "rlxf_utils.launch --memory`), before activations and the KV cache:",
        "",
        "| accelerate config | GPUs | PPO, GRPO, RLOO | RLGF (+ the guide's copy) |",
        "| --- | --- | --- | --- |",
    ]
    for name, strategy, g in rows:
        a = memory_per_gpu(n, n_lora, n_reward, strategy, g)
        if strategy == "zero3":  # PPO and RLGF generate with full weights: they refuse ZeRO-3
            lines.append(f"| `{name}` | {g} | {a:.1f} (GRPO, RLOO only) | not supported |")
            continue
        b = memory_per_gpu(n, n_lora, n_reward, strategy, g, guide=True)
        lines.append(f"| `{name}` | {g} | {a:.1f} | {b:.1f} |")
    lines += ["", "SFT and ILHF train on one process: the first row's figure."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # pragma: no cover - exercised through run_stage in the tests
    raise SystemExit(main())
