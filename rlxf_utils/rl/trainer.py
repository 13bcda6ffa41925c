"""What every trainer of ours shares: the job it is given (`TrainJob`), the loop and its
bookkeeping (`Trainer`), and the settings file every algorithm writes (`write_settings`).

`Trainer` owns the step counter, the log rows and samples, checkpoints (every
`rl.checkpoint_every` steps and at the last; written atomically, the last two kept, the newest
resumed), the frontier snapshots of the adapter and the final outputs (`adapter/`,
`train_log.parquet`, `samples.jsonl`). A trainer subclasses it and writes what is new: one
`train_step`, what its checkpoint holds (`checkpoint_tensors`, `checkpoint_state`, `restore`),
and how its model is saved (`save_model`). PPO (`rl.ppo.PPOTrainer`), the RLGF trainers (its
subclass `rl.rlgf.GuidedPPOTrainer`) and ILHF (`rl.ilhf`) are such trainers; GRPO and RLOO run
in TRL's Trainer (`rl.trl_runs`), which has its own.

Layout of a trainer's `output_dir`: `adapter/`, `train_log.parquet`, `samples.jsonl`,
`checkpoints/step_XXXXXX/` (`state.pt` and the checkpoint's safetensors files) and, for trainers
with `snapshots`, `snapshots/step_XXXXXX/adapter_model.safetensors`.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from tqdm.auto import tqdm

from rlxf_utils.artifacts import atomic_dir, atomic_path, write_json, write_jsonl
from rlxf_utils.config import PolicyConfig, RLConfig, StudyConfig
from rlxf_utils.rl.core import LOG_COLUMNS, RewardFn
from rlxf_utils.runtime import rng_state, set_rng_state

log = logging.getLogger(__name__)

#: The checkpoints kept in `checkpoints/` (the newest resumes; the one before it is a fallback).
KEEP_CHECKPOINTS = 2


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed safely; the message names it and what to do."""


@dataclass
class TrainJob:
    """One algorithm's training run: what every trainer is given (`Algorithm.trainer(job)`).

    `model` is the start policy (a fresh copy; the trainer adds its LoRA), `prompts[i]` the
    formatted policy input for `contexts[i]`. `study` and `run_dir` are needed by the algorithms
    that read more of the run than the prompts (RLGF's guide and references, ILHF's pairs).
    """

    algo: str
    model: Any
    tokenizer: Any
    prompts: Sequence[str]
    contexts: Sequence[Mapping[str, Any]]
    reward_fn: RewardFn | None
    rl: RLConfig
    policy: PolicyConfig
    output_dir: Path
    seed: int = 0
    progress: bool = True
    steps: int | None = None
    #: extra `generate()` arguments (benchmarks)
    generation_kwargs: Mapping[str, Any] | None = None
    study: StudyConfig | None = None
    run_dir: Path | None = None

    def __post_init__(self) -> None:
        self.output_dir = Path(self.output_dir)

    @property
    def n_steps(self) -> int:
        """Steps to train: `steps` when given, else `rl.steps`."""
        return self.steps or self.rl.steps

    def require_study(self) -> tuple[StudyConfig, Path]:
        """The study's parameters and run dir, for algorithms that read more of the run."""
        if self.study is None or self.run_dir is None:
            raise ValueError(f"{self.algo} reads the run (guide, references or pairs): "
                             "TrainJob needs `study` and `run_dir`")  # fmt: skip
        return self.study, Path(self.run_dir)


def write_settings(
    output_dir: str | Path, algo: str, rl: RLConfig, extra: Mapping[str, Any]
) -> dict[str, Any]:
    """`settings.json`: what every algorithm shares (prompts, responses, updates) and its own loss."""
    out = {
        "algo": algo,
        "steps": rl.steps,
        "prompts_per_step": rl.prompts_per_step,
        "responses_per_prompt": rl.num_generations,
        "responses_per_step": rl.batch_size,
        "optimizer_steps_per_batch": rl.optimizer_steps_per_batch,
        "update_epochs": rl.update_epochs,
        "minibatch_size": rl.minibatch_size,
        "max_new_tokens": rl.max_new_tokens,
        "temperature": rl.temperature,
        "learning_rate": rl.learning_rate,
        "optimizer": rl.optimizer.model_dump(),
        "kl_coef_initial": rl.kl_coef,
        **dict(extra),
    }
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    write_json(Path(output_dir) / "settings.json", out)
    return out


class Trainer:
    """The training loop and its bookkeeping; subclasses implement the algorithm.

    To override: `train_step` (one step; returns its log row), `save_model` (the final model into
    a folder), `checkpoint_tensors` / `checkpoint_state` / `restore` (what a checkpoint holds
    besides the step, logs, samples and random state) and `describe` (the step's log line).
    """

    algo: str = ""
    #: columns of `train_log.parquet`
    log_columns: tuple[str, ...] = LOG_COLUMNS
    #: keep each checkpoint's adapter as `snapshots/step_XXXXXX/` (the reward-KL frontier)
    snapshots: bool = True

    def __init__(self, output_dir: str | Path, checkpoint_every: int, steps: int):
        self.output_dir = Path(output_dir)
        self.checkpoint_every = checkpoint_every
        self.step = 0
        self.total_steps = steps  # the run's length (`train` may set another)
        self.history: list[dict[str, Any]] = []
        self.samples: list[dict[str, Any]] = []

    # -- the algorithm (subclasses) -----------------------------------------------------------
    def train_step(self) -> dict[str, Any]:
        """One step of the algorithm: advances `self.step`, appends and returns its log row."""
        raise NotImplementedError

    def save_model(self, folder: Path) -> None:
        """Write the trained model (LoRA adapters) into `folder` (`output_dir/adapter`)."""
        raise NotImplementedError

    def checkpoint_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        """Tensors a checkpoint keeps as `<name>.safetensors` files (with `snapshots`, one named
        `adapter_model`: the policy's LoRA weights)."""
        return {}

    def checkpoint_state(self) -> dict[str, Any]:
        """Everything else a checkpoint keeps (optimisers, controllers), in `state.pt`."""
        return {}

    def restore(self, path: Path, state: Mapping[str, Any]) -> None:
        """Load what `checkpoint_tensors` (files under `path`) and `checkpoint_state` saved."""

    def describe(self, row: Mapping[str, Any]) -> tuple[str, dict[str, str]]:
        """The step's log line and progress-bar fields."""
        return f"{self.algo} step {self.step}", {}

    # -- processes (one by default; PPO's accelerator overrides) -------------------------------
    @property
    def is_main(self) -> bool:
        return True

    def wait(self) -> None:
        """Wait for every process (nothing on one)."""

    def rng_states(self) -> list[dict[str, Any]]:
        """Every process's random state, gathered to the main process."""
        return [rng_state()]

    def own_rng(self, states: Sequence[Mapping[str, Any]], path: Path) -> Mapping[str, Any]:
        """This process's random state among those a checkpoint saved."""
        if len(states) != 1:
            raise ValueError(f"{path}: saved by {len(states)} processes, resumed by 1")
        return states[0]

    # -- the loop ------------------------------------------------------------------------------
    def train(
        self,
        steps: int | None = None,
        resume: bool = True,
        progress: bool = True,
        callback: Callable[[int, dict[str, Any]], None] | None = None,
    ) -> pd.DataFrame:
        """Run until `steps` (default: the run's length), resuming from the newest checkpoint;
        write the outputs; return the log."""
        steps = steps or self.total_steps
        self.total_steps = steps  # schedules that depend on the run's length (RLGF's D²LOLS)
        if resume:
            self.load_checkpoint()
        bar = tqdm(total=steps, initial=self.step, desc=self.algo, disable=not progress)
        while self.step < steps:
            row = self.train_step()
            line, postfix = self.describe(row)
            bar.update(1)
            bar.set_postfix(postfix)
            log.info(line)
            if self.step % self.checkpoint_every == 0 or self.step == steps:
                self.save_checkpoint()
            if callback is not None:
                callback(self.step, row)
        bar.close()
        self.save_outputs()
        return self.log_frame()

    def log_frame(self) -> pd.DataFrame:
        """The training log as a table with `log_columns`."""
        return pd.DataFrame(self.history, columns=list(self.log_columns))

    def save_outputs(self) -> None:
        """The final model (`adapter/`), log and samples, each written atomically."""
        if not self.is_main:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        atomic_dir(self.output_dir / "adapter", self.save_model)
        self.save_extra_outputs()
        with atomic_path(self.output_dir / "train_log.parquet") as tmp:
            self.log_frame().to_parquet(tmp, index=False)
        write_jsonl(self.output_dir / "samples.jsonl", self.samples)

    def save_extra_outputs(self) -> None:
        """Outputs besides the adapter, log and samples (PPO: its value heads)."""

    # -- checkpoints ---------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        """Step, logs, samples, random states and the subclass's tensors and state, atomically; the
        adapter also as a frontier snapshot; the last `KEEP_CHECKPOINTS` kept."""
        from safetensors.torch import save_file

        root = self.output_dir / "checkpoints"
        target = root / f"step_{self.step:06d}"
        rngs = self.rng_states()  # every process's (each samples its own share)
        if not self.is_main:
            self.wait()  # until the main process has written it
            return target
        tensors = self.checkpoint_tensors()

        def write(d: Path) -> None:
            for name, state in tensors.items():
                save_file(state, str(d / f"{name}.safetensors"))
            # tensors and plain values only (the logs as JSON text): `load_checkpoint` reads it
            # with `weights_only=True`, so a state.pt from elsewhere cannot run code on resume
            torch.save({"step": self.step, "history": _json(self.history),
                        "samples": _json(self.samples), "rng_ranks": rngs,
                        **self.checkpoint_state()}, d / "state.pt")  # fmt: skip

        atomic_dir(target, write)
        if self.snapshots:
            self._snapshot(target)
        for old in sorted(root.glob("step_*"))[:-KEEP_CHECKPOINTS]:
            shutil.rmtree(old, ignore_errors=True)
        self.wait()
        return target

    def _snapshot(self, checkpoint: Path) -> None:
        """The checkpoint's adapter alone, kept under `snapshots/` (the reward-KL frontier)."""
        snap = self.output_dir / "snapshots" / checkpoint.name
        atomic_dir(snap, lambda d: shutil.copy2(checkpoint / "adapter_model.safetensors", d))

    def load_checkpoint(self, path: str | Path | None = None) -> bool:
        """Restore the newest checkpoint under `output_dir/checkpoints` (or `path`); False if none."""
        if path is None:
            found = sorted((self.output_dir / "checkpoints").glob("step_*"))
            if not found:
                return False
            path = found[-1]
        path = Path(path)
        # killed between the checkpoint and its frontier snapshot: write the snapshot now
        snap = self.output_dir / "snapshots" / path.name / "adapter_model.safetensors"
        if self.snapshots and self.is_main and not snap.is_file():
            self._snapshot(path)
        self.wait()
        state = read_state(path / "state.pt")
        self.restore(path, state)
        set_rng_state(self.own_rng(state["rng_ranks"], path))
        self.history, self.samples = json.loads(state["history"]), json.loads(state["samples"])
        self.step = state["step"]
        log.info("resumed %s from %s (step %d)", self.algo, path, self.step)
        return True


def _json(obj: Any) -> str:
    """Log rows and samples as JSON text (NaN kept; numpy scalars as plain numbers)."""
    return json.dumps(obj, default=lambda x: x.item() if hasattr(x, "item") else str(x))


def read_state(path: Path) -> dict[str, Any]:
    """A checkpoint's `state.pt`, loaded with `weights_only=True`: tensors and plain values only,
    never pickled objects (a run directory copied from elsewhere cannot run code on resume)."""
    try:
        state = torch.load(path, weights_only=True)
    except Exception as exc:  # torch raises UnpicklingError, RuntimeError or others by version
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"{path}: not a checkpoint this study can resume safely ({first}); expected tensors and "
            f"plain values only. Remove {path.parent} (or the run's checkpoints/) to train afresh"
        ) from None
    missing = [k for k in ("step", "history", "samples", "rng_ranks")
               if not isinstance(state, dict) or k not in state]  # fmt: skip
    if missing:
        raise CheckpointError(f"{path}: a checkpoint without {missing}; remove {path.parent} to "
                              "train afresh")  # fmt: skip
    return state
