"""The trainer base every trainer of ours shares: the loop, checkpoints (no pickled objects),
resume, snapshots and outputs, on a trainer whose step is a counter."""

from __future__ import annotations

import math
import pickle
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from rlxf_utils.rl.trainer import CheckpointError, Trainer, read_state
from rlxf_utils.runtime import rng_state, seed_everything, set_rng_state


class Counter(Trainer):
    """One 'parameter' that each step moves by a random draw of every global generator."""

    algo = "counter"
    snapshots = False
    log_columns = ("algo", "step", "value", "draw", "missing")

    def __init__(self, out: Path, every: int = 2, steps: int = 5):
        super().__init__(out, every, steps)
        self.value = torch.zeros(3)

    def train_step(self) -> dict[str, Any]:
        draw = random.random() + float(np.random.rand()) + float(torch.rand(()))
        self.value += draw
        self.step += 1
        row = {"algo": self.algo, "step": self.step, "value": float(self.value.sum()),
               "draw": draw, "missing": math.nan}  # fmt: skip
        self.history.append(row)
        self.samples.append({"step": self.step, "text": "é"})
        return row

    def checkpoint_state(self) -> dict[str, Any]:
        return {"value": self.value.clone()}

    def restore(self, path: Path, state: Any) -> None:
        self.value = state["value"].clone()

    def save_model(self, folder: Path) -> None:
        torch.save(self.value, folder / "value.pt")


def test_a_resumed_run_ends_where_an_uninterrupted_one_ends(tmp_path: Path) -> None:
    seed_everything(1)
    whole = Counter(tmp_path / "whole").train(progress=False)
    seed_everything(1)
    Counter(tmp_path / "cut").train(steps=3, progress=False)  # killed after step 3
    assert sorted(p.name for p in (tmp_path / "cut/checkpoints").iterdir()) == [
        "step_000002", "step_000003"]  # fmt: skip
    seed_everything(99)  # a fresh process: its own random state, restored from the checkpoint
    resumed = Counter(tmp_path / "cut")
    log = resumed.train(progress=False)
    assert log.drop(columns="missing").equals(whole.drop(columns="missing"))
    assert log["missing"].isna().all()  # NaN survives the checkpoint's JSON logs
    assert (tmp_path / "cut/samples.jsonl").read_text(encoding="utf-8").count("é") == 5
    assert (tmp_path / "cut/adapter/value.pt").is_file()
    # the last two checkpoints are kept, the last one at the final step
    assert sorted(p.name for p in (tmp_path / "cut/checkpoints").iterdir()) == [
        "step_000004", "step_000005"]  # fmt: skip


def test_random_state_round_trips_through_plain_values() -> None:
    seed_everything(3)
    saved = rng_state()
    want = (random.random(), float(np.random.rand()), float(torch.rand(())))
    seed_everything(4)
    set_rng_state(saved)
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == want


def test_kernel_warm_up_draws_no_random_numbers_and_runs_once_per_thread_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`warm_up_kernels` (run by `seed_everything`) leaves every generator where the seed put it,
    so a seeded stage draws the same numbers with it as without; it runs each listed kernel in
    both dtypes, once per thread count."""
    from torch.nn import functional as F

    from rlxf_utils import runtime

    seed_everything(5)
    want = (random.random(), float(np.random.rand()), float(torch.rand(())))
    monkeypatch.setattr(runtime, "_warmed", set())
    calls: list[tuple[str, torch.dtype]] = []
    for name in runtime.WARM_UP_OPS:
        mod = F if name in ("silu", "gelu", "softmax", "log_softmax") else torch
        if name == "pow":
            mod, name = torch.Tensor, "pow"
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda x, *a, _n=name, _f=real, **k: (
            calls.append((_n, x.dtype)), _f(x, *a, **k))[1])  # fmt: skip
    seed_everything(5)
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == want
    assert set(calls) == {
        (n, d) for n in runtime.WARM_UP_OPS for d in (torch.float32, torch.bfloat16)
    }
    assert runtime._warmed == {torch.get_num_threads()}
    seed_everything(5)  # the same thread count: nothing runs again
    assert len(calls) == 2 * len(runtime.WARM_UP_OPS)


class Payload:
    """Runs code when unpickled, as a crafted state.pt would."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_crafted_checkpoint_runs_nothing_on_resume(tmp_path: Path) -> None:
    trainer = Counter(tmp_path / "run")
    ckpt = tmp_path / "run/checkpoints/step_000002"
    ckpt.mkdir(parents=True)
    marker = tmp_path / "pwned"
    with (ckpt / "state.pt").open("wb") as f:
        pickle.dump({"step": 2, "history": "[]", "samples": "[]", "rng_ranks": [],
                     "evil": Payload(marker)}, f)  # fmt: skip
    assert not marker.exists()
    with pytest.raises(CheckpointError, match=r"state\.pt: not a checkpoint this study can resume"):
        trainer.load_checkpoint()
    assert not marker.exists()  # nothing ran
    with open(tmp_path / "proof.pt", "wb") as f:  # the same payload does run under plain pickle
        pickle.dump(Payload(marker), f)
    with open(tmp_path / "proof.pt", "rb") as f:
        pickle.load(f)  # noqa: S301 (the point of the test)
    assert marker.exists()


def test_a_checkpoint_missing_its_keys_is_named(tmp_path: Path) -> None:
    torch.save({"step": 1}, tmp_path / "state.pt")
    with pytest.raises(CheckpointError, match="without"):
        read_state(tmp_path / "state.pt")
