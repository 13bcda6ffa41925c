"""Benchmark the TRL trainers' steps (KTO, DPO, RFT's SFT) with TRL's fused LM head scoring every
position, as TRL does on the CPU, against scoring only the labelled ones
(`rl.trl_runs.score_labelled_positions_only`, what the study runs).

TRL computes per-token log-probabilities with a fused, chunked LM head. On the CPU it scores
every position (prompt and padding included) and runs the head's gradient GEMMs in float32 over
the whole vocabulary; the labelled positions are the response tokens, about a third of each
sequence here. This script runs one study step (`rl.optimizer_steps_per_batch` optimiser steps
of `rl.minibatch_size` sequences) of each method from the run's `sft` policy on the run's own
training data (KTO's outcomes, DPO's pairs, RFT's kept candidates from `policy/rft/pool.parquet`),
both ways, interleaved (A, B, A, B...) so drifting cores hit both alike, with the same seed, and
records the time of the step and its losses: the same numbers up to float32 summation order.

    .venv/bin/python bench/trl_steps.py --run-dir runs/default [--methods kto dpo rft] [--reps 2]
        [--out bench/results/trl_steps.json]
    .venv/bin/python bench/trl_steps.py --plot-only

Writes the JSON (seconds per repetition, method and layout; median speed-ups; the logged
losses) and `trl_steps.png` beside it. The run must have finished notebook 03's `rft` (its pool).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from rl import machine_info  # noqa: E402

from rlxf_utils.artifacts import RunDir, to_jsonable  # noqa: E402
from rlxf_utils.config import load_config  # noqa: E402
from rlxf_utils.data.contexts import load_contexts  # noqa: E402
from rlxf_utils.models.generation import build_prompts  # noqa: E402
from rlxf_utils.models.loading import load_start_policy  # noqa: E402
from rlxf_utils.rl import offline  # noqa: E402
from rlxf_utils.rl.trainer import TrainJob  # noqa: E402

LAYOUTS = ("every position (TRL on the CPU)", "labelled positions only (the study)")


@contextlib.contextmanager
def layout(name: str):
    """TRL's own CPU layout, or the study's: `train_offline` applies the study's patch itself, so
    the first layout replaces that call with a no-op and restores TRL's switch."""
    import trl.trainer.utils as trl_utils

    saved = trl_utils._use_triton
    original = getattr(saved, "__wrapped__", saved)
    patch = offline.score_labelled_positions_only
    try:
        if name == LAYOUTS[0]:
            trl_utils._use_triton = original
            offline.score_labelled_positions_only = lambda: False
        yield
    finally:
        trl_utils._use_triton = saved
        offline.score_labelled_positions_only = patch


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(result["seconds"])
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    width = 0.38
    for j, name in enumerate(LAYOUTS):
        for i, m in enumerate(methods):
            s = result["seconds"][m][name]
            x = i + (j - 0.5) * width
            ax.bar(x, np.median(s), width, color=f"C{j}", label=name if i == 0 else None)
            ax.scatter(np.full(len(s), x), s, color="k", s=10, zorder=3)
    ax.set_xticks(range(len(methods)),
                  [f"{m.upper()}\nx{result['speedup_median'][m]:.2f}" for m in methods])  # fmt: skip
    ax.set_ylabel(f"seconds per study step ({result['optimizer_steps']} optimiser steps)")
    ax.set_title("TRL's fused LM head on 2 CPU cores, bf16 autocast, real policy", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default=None, help="default: the run's params.yaml")
    ap.add_argument("--run-dir", required=True, help="a run that finished notebook 03")
    ap.add_argument("--methods", nargs="+", default=["kto", "dpo", "rft"])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", default="bench/results/trl_steps.json")
    ap.add_argument("--plot-only", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    if args.plot_only:
        plot(json.loads(out.read_text(encoding="utf-8")), out.with_suffix(".png"))
        return
    load0 = os.getloadavg()[0]
    run = RunDir(args.run_dir)
    cfg = load_config(args.params or run.path("params.yaml"))
    pool = run.path("policy/rft/pool.parquet")
    if "rft" in args.methods and not pool.is_file():
        raise SystemExit(f"{pool}: missing; run notebook 03's rft first (its candidates)")
    contexts = load_contexts(run.root, "train", cfg.rl.max_prompts, cfg.run.seed)
    seconds = {m: {name: [] for name in LAYOUTS} for m in args.methods}
    losses = {m: {name: [] for name in LAYOUTS} for m in args.methods}
    calls = {m: {name: [] for name in LAYOUTS} for m in args.methods}
    offline.finish_trl_run = lambda *a, **k: None  # its samples need the reward model: not timed
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for method in args.methods:
                for name in LAYOUTS:
                    folder = Path(tmp) / f"{method}_{rep}_{LAYOUTS.index(name)}"
                    if method == "rft":
                        folder.mkdir(parents=True)
                        shutil.copy(pool, folder / "pool.parquet")  # no sampling: the run's pool
                    model, tok = load_start_policy(cfg.policy, cfg.rl.start_policy, run.root)
                    prompts = build_prompts(contexts, tok, cfg.rl.prompt_template, cfg.policy)
                    job = TrainJob(method, model, tok, prompts, contexts, None, cfg.rl, cfg.policy,
                                   folder, seed=cfg.training_seed, progress=False, steps=1,
                                   study=cfg, run_dir=run.root)  # fmt: skip
                    frame, rows, ids, extra = offline.offline_dataset(job)
                    with layout(name):
                        t0 = time.perf_counter()
                        log = offline.train_offline(job, cfg.offline, rows, ids, extra)
                        calls[method][name].append(time.perf_counter() - t0)
                    seconds[method][name].append(float(log["step_time_s"].sum()))
                    losses[method][name].append(log["policy_loss"].tolist())
                    print(f"{method} {name}: step {seconds[method][name][-1]:.1f} s, "
                          f"call {calls[method][name][-1]:.1f} s", flush=True)  # fmt: skip
    med = {m: {n: float(np.median(s)) for n, s in v.items()} for m, v in seconds.items()}
    result = {
        "run_dir": str(run.root),
        "machine": machine_info(load0),
        "torch_threads": torch.get_num_threads(),
        "optimizer_steps": cfg.rl.optimizer_steps_per_batch,
        "sequences_per_optimizer_step": cfg.rl.minibatch_size,
        "seconds": seconds,
        "call_seconds": calls,
        "median_seconds": med,
        "speedup_median": {m: v[LAYOUTS[0]] / v[LAYOUTS[1]] for m, v in med.items()},
        "policy_loss": losses,
        "note": "seconds: the study step's optimiser steps as the training log times them "
        "(step_time_s); call_seconds: the whole train_offline call (set-up, steps, adapter and "
        "log writing), without finish_trl_run's samples (they need the reward model)",
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(to_jsonable(result), indent=2) + "\n", encoding="utf-8")
    plot(result, out.with_suffix(".png"))
    print(
        json.dumps(
            to_jsonable({k: result[k] for k in ("median_seconds", "speedup_median")}), indent=2
        )
    )
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
