"""The process a stage runs in: seeds and random-number states, the processes of a job and the
main one among them, the hub environment, and threads."""

from __future__ import annotations

import os
import random
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlxf_utils.config import PROJECT_ROOT


def seed_everything(seed: int) -> None:
    """Seed Python's, numpy's and torch's global generators (and `warm_up_kernels`)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    warm_up_kernels()


#: The elementwise kernels a forward pass of the study's models runs (RoPE's cos/sin, softmax,
#: RMS/layer norm, SiLU/GELU, the losses), each run once per dtype by `warm_up_kernels`.
WARM_UP_OPS: tuple[str, ...] = ("cos", "sin", "exp", "log", "rsqrt", "sqrt", "tanh", "sigmoid",
                                "erf", "silu", "gelu", "softmax", "log_softmax", "pow")  # fmt: skip

_warmed: set[int] = set()


def warm_up_kernels() -> None:
    """Run torch's vectorised elementwise kernels (`WARM_UP_OPS`, in float32 and bfloat16) once on
    every intra-op thread of this process, before any number of the study is computed.

    Why: on this project's CPUs (2 threads, torch 2.13) the first call of such a kernel in a
    process sometimes computes the second thread's share differently: RoPE's cosines in the very
    first forward of a stage came out ~1.5e-4 off on half of the batch in 18 of 79 fresh
    processes, and every later call agreed. ILHF's first update starts from that forward, so a
    resumed study's ILHF differed from the uninterrupted one. After a warm-up no first forward
    differed (0 of 32). Consumes no random numbers (results are otherwise unchanged); runs again
    only when the thread count changes."""
    threads = torch.get_num_threads()
    if threads in _warmed:
        return
    from torch.nn import functional as F

    n = 32_768 * 2 * max(threads, 1)  # above torch's grain size per thread: every thread gets work
    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.linspace(0.5, 100.0, n, dtype=dtype).reshape(-1, 64)
            for name in WARM_UP_OPS:
                if name in ("softmax", "log_softmax"):
                    getattr(F, name)(x, dim=-1)
                elif name == "pow":
                    x.pow(2)
                elif name in ("silu", "gelu"):
                    getattr(F, name)(x)
                else:
                    getattr(torch, name)(x)
    _warmed.add(threads)


def rng_state() -> dict[str, Any]:
    """Every global generator's state as tensors and plain values, so that a checkpoint holding it
    loads with `torch.load(..., weights_only=True)` (no pickled objects)."""
    version, internal, gauss_next = random.getstate()
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss_next],
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        },  # fmt: skip
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what `rng_state` returned."""
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    n = state["numpy"]
    np.random.set_state(
        (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"])
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def world_size() -> int:
    """Processes of this job (`accelerate launch` / torchrun set WORLD_SIZE; 1 otherwise)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_main_process() -> bool:
    """True on the job's first process (and when there is one)."""
    return int(os.environ.get("RANK", "0")) == 0


def barrier() -> None:
    """Wait for every process of a multi-process job (nothing on one process)."""
    if world_size() > 1:
        process_state().wait_for_everyone()


_HUB_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")


def hub_environment(cfg: Any) -> dict[str, str]:
    """Set the Hugging Face offline switches from `compute.hf_offline` unless the environment
    already sets them (an explicit `HF_HUB_OFFLINE=0 make study` wins); returns them."""
    value = "1" if cfg.compute.hf_offline else "0"
    return {k: os.environ.setdefault(k, value) for k in _HUB_VARS}


#: How the FutureWarnings of the pinned libraries that say nothing about the run begin:
#: transformers 5 renamed `gradient_checkpointing*` to `activation_checkpointing*`, and TRL and
#: peft still call the old names (a warning on every call). The study uses the new names.
QUIET_FUTURE_WARNINGS = ("`gradient_checkpointing", "`is_gradient_checkpointing")


def quiet_library_warnings() -> str:
    """Hide `QUIET_FUTURE_WARNINGS` in this process and, through `PYTHONWARNINGS`, in every
    process it starts (the notebooks' kernels and the stages they launch); returns the latter."""
    entries = [f"ignore:{m}:FutureWarning" for m in QUIET_FUTURE_WARNINGS]
    for m in QUIET_FUTURE_WARNINGS:
        warnings.filterwarnings("ignore", re.escape(m), FutureWarning)
    current = [w for w in os.environ.get("PYTHONWARNINGS", "").split(",") if w]
    os.environ["PYTHONWARNINGS"] = ",".join([*current, *(e for e in entries if e not in current)])
    return os.environ["PYTHONWARNINGS"]


def process_state() -> Any:
    """accelerate's `PartialState` of this process (on the CPU where the launcher said so):
    the same one every later `Accelerator` in the process joins."""
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    return PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))


def resolve_device(setting: str | None = "auto") -> torch.device:
    """`compute.device` as a torch device: 'cpu'; 'cuda' (an error without CUDA); 'auto' (or
    None): this process's GPU (`LOCAL_RANK` under `accelerate launch`) when CUDA is available,
    else Apple's MPS when available, else the CPU. Other strings ('cuda:1') are taken as they are."""
    if setting == "cpu":
        return torch.device("cpu")
    if setting not in (None, "auto", "cuda"):
        return torch.device(setting)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if setting == "cuda":
        raise RuntimeError("compute.device is 'cuda' but torch sees no CUDA device")
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def cache_root() -> Path:
    """Folder for converted models: `$RLXF_CACHE` if set, else `<project root>/.cache/models`."""
    env = os.environ.get("RLXF_CACHE")
    return Path(env) if env else PROJECT_ROOT / ".cache" / "models"
