"""The process a stage runs in: seeds and random-number states, the processes of a job and the
main one among them, the hub environment, and threads."""

from __future__ import annotations

import os
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlxf_utils.config import PROJECT_ROOT


def seed_everything(seed: int) -> None:
    """Seed Python's, numpy's and torch's global generators."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


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
