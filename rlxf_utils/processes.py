"""Child processes of the study (a stage's `accelerate launch`, an evaluation lane): the
environment they start with, and their death with the process that started them. Imports no
torch at the top: a launcher imports this before it starts anything heavy."""

from __future__ import annotations

import os
import sys


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
