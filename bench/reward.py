"""Benchmark the reward encoders: training seconds per step and scoring throughput by precision.

Uses a profile's `reward` settings (default: params/default.yaml) on the project's own data stage
(rlxf_utils.data) and its `grouped` split. For each encoder (`--encoders`, default the embedded
MiniLM and mpnet):

- training: `--steps` optimiser steps in fp32 and under bf16 autocast (`reward.train_precision`),
  reported as s/step and per full epoch of the grouped training split;
- scoring: the grouped test set (serialised MONA conditions, the texts RL and evaluation score)
  in the three `reward.score_precision` settings (`RewardModel.with_precision`: fp32; bf16,
  autocast over the fp32 weights; int8, dynamic quantisation of the encoder) and, for comparison,
  with the weights cast to bf16 (`bf16_weights`), on 1 and 2 threads, as texts/s after a warm-up, with the largest and mean
  |P(MET) - fp32's P(MET)| on those rows and the share of MET/Non-MET decisions that change.
  The naive loop (pad to max_length, input order, batch 32) is timed once for reference.

The scorer is the run's trained reward model when `--run-dir` holds `reward_model/` with that
encoder, else the model just trained for `--steps` steps (differences of a barely trained head
are smaller than a converged one's: the JSON says which). `choice` is the fastest precision whose
largest difference stays within `--tolerance` (reward.score_tolerance), variants within 5% of the
fastest counting as tied and the closest to fp32 among them winning.

    .venv/bin/python bench/reward.py [--params params/default.yaml] [--run-dir runs/default]
        [--encoders embedded:minilm embedded:mpnet] [--steps 8] [--out bench/results/reward.json]
    .venv/bin/python bench/reward.py --plot-only     # redraw reward.png from the JSON

Writes the JSON and `reward.png` beside it (texts/s per precision and threads, per encoder, with
the 300 texts/s target; training s/step fp32 vs bf16).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from rlxf_utils.artifacts import RunDir, to_jsonable  # noqa: E402
from rlxf_utils.config import load_config  # noqa: E402
from rlxf_utils.data.splits import load_splits  # noqa: E402
from rlxf_utils.data.stage import run_data_stage  # noqa: E402
from rlxf_utils.prompts import serialize_frame  # noqa: E402
from rlxf_utils.reward.encoders import EMBEDDED_MINILM, EMBEDDED_MPNET
from rlxf_utils.reward.model import RewardModel
from rlxf_utils.reward.training import configure_threads, train_encoder


def _naive_texts_per_s(rm: RewardModel, texts: list[str], batch: int = 32) -> float:
    """Throughput of the naive loop: fixed padding to max_length, input order, batch 32."""
    t0 = time.perf_counter()
    with torch.inference_mode():
        for s in range(0, len(texts), batch):
            enc = rm.tokenizer(
                texts[s : s + batch],
                truncation=True,
                max_length=rm.max_length,
                padding="max_length",
                return_tensors="pt",
            )
            rm.model(**enc)
    return len(texts) / (time.perf_counter() - t0)


def _scorer(rm: RewardModel, variant: str) -> RewardModel:
    """The scorer for one variant: a `score_precision`, or `bf16_weights` (weights cast, no autocast)."""
    if variant != "bf16_weights":
        return rm.with_precision(variant)
    import copy

    return RewardModel(
        copy.deepcopy(rm.model).to(torch.bfloat16), rm.tokenizer, rm.max_length, rm.temperature,
        rm.meta, rm.bias, rm.offset,
    )  # fmt: skip


def _score(rm: RewardModel, texts: list[str], batch: int) -> tuple[np.ndarray, float]:
    """(calibrated P(MET), texts/s) after a warm-up batch."""
    rm.score_texts(texts[:batch], batch)
    t0 = time.perf_counter()
    p = rm.score_texts(texts, batch)
    return p, len(texts) / (time.perf_counter() - t0)


def choose(scoring: dict[str, dict[str, float]], threads: int, tolerance: float) -> str | None:
    """The fastest variant on `threads` within `tolerance` of fp32; variants within 5% of the
    fastest count as tied (timing noise) and the one closest to fp32 among them wins."""
    ok = {
        k: v
        for k, v in scoring.items()
        if v["threads"] == threads and v["max_abs_diff"] <= tolerance
    }
    if not ok:
        return None
    best = max(v["texts_per_s"] for v in ok.values())
    tied = {k: v for k, v in ok.items() if v["texts_per_s"] >= 0.95 * best}
    return min(tied, key=lambda k: tied[k]["max_abs_diff"])


def _train_timing(rc, tr, steps: int, seed: int) -> tuple[RewardModel, dict[str, float]]:
    """s/step of `steps` optimiser steps (one epoch of that many batches) for the settings `rc`."""
    n_rows = min(len(tr), steps * rc.batch_size)
    sub, val = tr.iloc[:n_rows], tr.iloc[n_rows : n_rows + 64]
    timed = rc.model_copy(update={"epochs": 1.0, "evals_per_epoch": 1})
    t0 = time.perf_counter()
    rm, log = train_encoder(
        serialize_frame(sub), sub["y"].astype(int).to_numpy(),
        serialize_frame(val), val["y"].astype(int).to_numpy(), timed, seed,
    )  # fmt: skip
    train_s = float(log["train_seconds"].sum())
    n_steps = int(np.ceil(n_rows / rc.batch_size))
    return rm, {
        "timed_steps": n_steps,
        "seconds_per_step": train_s / max(1, n_steps),
        "epoch_seconds_estimate": train_s / max(1, n_steps) * int(np.ceil(len(tr) / rc.batch_size)),
        "wall_seconds_incl_setup": time.perf_counter() - t0,
    }


TARGET_TEXTS_PER_S = 300  # issue 16: MiniLM on 2 idle cores
VARIANTS = ("fp32", "bf16", "bf16_weights", "int8")


def plot(result: dict, path: Path) -> None:
    """Scoring texts/s per variant and threads (one panel per encoder) and training s/step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    encs = result["encoders"]
    fig, axes = plt.subplots(1, len(encs) + 1, figsize=(4.6 * (len(encs) + 1), 3.8), squeeze=False)
    variants = list(VARIANTS)
    for ax, (name, r) in zip(axes[0], encs.items(), strict=False):
        threads = sorted({v["threads"] for v in r["scoring"].values()})
        w = 0.8 / len(threads)
        for j, t in enumerate(threads):
            vals = [r["scoring"].get(f"{v}_{t}t", {}).get("texts_per_s", 0.0) for v in variants]
            bars = ax.bar(
                np.arange(len(variants)) + j * w, vals, w, label=f"{t} thread{'s' * (t > 1)}"
            )
            for b, v in zip(bars, variants, strict=True):
                d = r["scoring"].get(f"{v}_{t}t", {}).get("max_abs_diff")
                if d is not None and t == max(threads):
                    ax.annotate(f"{d:.3f}", (b.get_x() + b.get_width() / 2, b.get_height()),
                                ha="center", va="bottom", fontsize=7)  # fmt: skip
        ax.axhline(TARGET_TEXTS_PER_S, color="grey", ls=":", lw=1)
        ax.set_xticks(np.arange(len(variants)) + w * (len(threads) - 1) / 2, variants, fontsize=8)
        ax.set(title=f"{name}: scoring ({r['test_rows']} test rows)", ylabel="texts/s")
        ax.legend(
            fontsize=7, title="labels: max |dP(MET)| vs fp32", title_fontsize=7, loc="upper left"
        )
    ax = axes[0][-1]
    names = list(encs)
    for j, prec in enumerate(("fp32", "bf16")):
        ax.bar(np.arange(len(names)) + j * 0.4, [encs[n]["training"][prec]["seconds_per_step"] for n in names],
               0.4, label=prec)  # fmt: skip
    ax.set_xticks(np.arange(len(names)) + 0.2, names, fontsize=8)
    ax.set(title="training: s per optimiser step", ylabel="s/step")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="params/default.yaml")
    ap.add_argument("--run-dir", default=None, help="reuse data/ (and reward_model/) of a run dir")
    ap.add_argument("--encoders", nargs="+", default=[EMBEDDED_MINILM, EMBEDDED_MPNET])
    ap.add_argument("--steps", type=int, default=8, help="optimiser steps to time per setting")
    ap.add_argument("--n-score", type=int, default=None, help="test rows to score (default all)")
    ap.add_argument("--tolerance", type=float, default=None, help="default reward.score_tolerance")
    ap.add_argument("--out", default="bench/results/reward.json")
    ap.add_argument("--plot-only", action="store_true", help="redraw the figure from --out")
    args = ap.parse_args()
    out = Path(args.out)
    if args.plot_only:
        plot(json.loads(out.read_text()), out.with_suffix(".png"))
        return

    cpus = len(os.sched_getaffinity(0))
    load_before = os.getloadavg()
    cfg = load_config(args.params)
    tolerance = args.tolerance or cfg.reward.score_tolerance
    with tempfile.TemporaryDirectory() as tmp:
        run = RunDir(args.run_dir or tmp)
        if not run.exists("data/splits.json"):
            run_data_stage(cfg, run)
        labelled, splits = load_splits(run)
    by_id = labelled.set_index("row_id", drop=False)
    tr = by_id.loc[splits["grouped"]["train"]].reset_index(drop=True)
    te = by_id.loc[splits["grouped"]["test"]].reset_index(drop=True)
    texts = serialize_frame(te)[: args.n_score]
    batch = cfg.reward.score_batch_size

    results = {}
    for name in args.encoders:
        print(f"== {name}", flush=True)
        configure_threads(cpus)
        rc = cfg.reward.model_copy(
            update={
                "encoder": name,
                "num_threads": cpus,
                "progress": False,
                "early_stopping_patience": None,
            }
        )
        training = {}
        rm = None
        for precision in ("fp32", "bf16"):
            rm_p, training[precision] = _train_timing(
                rc.model_copy(update={"train_precision": precision}), tr, args.steps, cfg.run.seed
            )
            rm = rm if rm is not None else rm_p
            print(
                f"  train {precision}: {training[precision]['seconds_per_step']:.2f} s/step",
                flush=True,
            )
        scorer_from = f"trained for {args.steps} steps here"
        saved = Path(args.run_dir or "") / "reward_model" / "encoder"
        if args.run_dir and (saved / "rlxf_reward.json").is_file():
            marker = json.loads((saved / "rlxf_reward.json").read_text())
            if marker.get("encoder") == name:
                rm, scorer_from = (
                    RewardModel.load(saved, "cpu"),
                    f"{saved} (the run's reward model)",
                )
        tok_len = float(np.mean([len(x) for x in rm.tokenizer(texts)["input_ids"]]))
        scoring: dict[str, dict[str, float]] = {}
        p32 = None
        for threads in sorted({1, cpus}):
            torch.set_num_threads(threads)
            for variant in VARIANTS:
                p, rate = _score(_scorer(rm, variant), texts, batch)
                if p32 is None:
                    p32 = p
                diff = np.abs(p - p32)
                scoring[f"{variant}_{threads}t"] = {
                    "precision": variant,
                    "threads": threads,
                    "texts_per_s": rate,
                    "max_abs_diff": float(diff.max()),
                    "mean_abs_diff": float(diff.mean()),
                    "decision_changes": float(np.mean((p >= 0.5) != (p32 >= 0.5))),
                }
                print(
                    f"  score {variant:14s} {threads}t: {rate:6.1f} texts/s, max |dP| {diff.max():.4f}",
                    flush=True,
                )
        torch.set_num_threads(cpus)
        naive = _naive_texts_per_s(rm, texts[:256])
        choice = choose(scoring, cpus, tolerance)
        results[name] = {
            "parameters_m": sum(p.numel() for p in rm.model.parameters()) / 1e6,
            "training": training,
            "scorer": scorer_from,
            "test_rows": len(texts),
            "mean_tokens": tok_len,
            "naive_texts_per_s": naive,
            "scoring": scoring,
            "choice": {
                "variant": choice,
                **(scoring[choice] if choice else {}),
                "tolerance": tolerance,
            },
        }
    result = {
        "profile": str(args.params),
        "settings": cfg.reward.model_dump(mode="json"),
        "train_rows_full_split": len(tr),
        "encoders": results,
        "cpus": cpus,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "note": "2-core machine: compare runs only at similar load averages (idle: below ~0.3)",
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(to_jsonable(result), indent=2) + "\n", encoding="utf-8")
    plot(to_jsonable(result), out.with_suffix(".png"))
    print(json.dumps(to_jsonable({k: v["choice"] for k, v in results.items()}), indent=2))


if __name__ == "__main__":
    main()
