"""Benchmark the reward encoder: training seconds per epoch and scoring throughput (texts/s).

Uses a profile's `reward` settings (default: params/default.yaml) on the project's own data
stage (rlxf_utils.data) and its `grouped` training split. Training is timed for `--steps`
optimiser steps and reported per full epoch (steps/epoch x median s/step), since an epoch of
the full split takes minutes. Scoring is timed on serialised MONA conditions and on short texts
(context + the first 12 words of a condition, the size of an RL completion), three ways: the
naive loop (pad everything to max_length, unsorted, batch 32), our `RewardModel.score_texts`
(length-sorted, dynamic padding, inference_mode), and the same on a dynamic-int8 copy.
The machine is shared, so the load average before and after is recorded with the numbers.

    .venv/bin/python bench/reward.py [--params params/default.yaml] [--steps 12] [--threads 2]
                                     [--n-score 512] [--out bench/results/reward.json]
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

from rlxf_utils import reward as R  # noqa: E402
from rlxf_utils.artifacts import RunDir, to_jsonable  # noqa: E402
from rlxf_utils.config import load_config  # noqa: E402
from rlxf_utils.data import load_splits, run_data_stage  # noqa: E402
from rlxf_utils.prompts import serialize_frame  # noqa: E402


def _naive_texts_per_s(rm: R.RewardModel, texts: list[str], batch: int = 32) -> float:
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


def _texts_per_s(rm: R.RewardModel, texts: list[str], batch: int) -> float:
    rm.score_texts(texts[:batch], batch)  # warm-up
    t0 = time.perf_counter()
    rm.score_texts(texts, batch)
    return len(texts) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="params/default.yaml")
    ap.add_argument("--run-dir", default=None, help="reuse data/ of an existing run dir")
    ap.add_argument("--steps", type=int, default=12, help="optimiser steps to time")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all CPUs)")
    ap.add_argument("--n-score", type=int, default=512)
    ap.add_argument("--out", default="bench/results/reward.json")
    args = ap.parse_args()

    threads = R.configure_threads(args.threads)
    load_before = os.getloadavg()
    cfg = load_config(args.params)
    rc = cfg.reward.model_copy(
        update={"num_threads": threads, "progress": False, "early_stopping_patience": None}
    )
    with tempfile.TemporaryDirectory() as tmp:
        run = RunDir(args.run_dir or tmp)
        if not run.exists("data/splits.json"):
            run_data_stage(cfg, run)
        labelled, splits = load_splits(run)
    by_id = labelled.set_index("row_id", drop=False)
    tr = by_id.loc[splits["grouped"]["train"]].reset_index(drop=True)
    te = by_id.loc[splits["grouped"]["test"]].reset_index(drop=True)
    steps_per_epoch = int(np.ceil(len(tr) / rc.batch_size))

    # -- training: `steps` optimiser steps on the first rows of the split, one epoch of them
    n_rows = min(len(tr), args.steps * rc.batch_size)
    sub = tr.iloc[:n_rows]
    val = tr.iloc[n_rows : n_rows + 64]
    timed = rc.model_copy(update={"epochs": 1.0, "evals_per_epoch": 1})
    t0 = time.perf_counter()
    rm, log = R.train_encoder(
        serialize_frame(sub),
        sub["y"].astype(int).to_numpy(),
        serialize_frame(val),
        val["y"].astype(int).to_numpy(),
        timed,
        cfg.run.seed,
    )
    total = time.perf_counter() - t0
    train_s = float(log["train_seconds"].sum())
    s_per_step = train_s / max(1, int(np.ceil(n_rows / rc.batch_size)))

    # -- scoring
    texts = serialize_frame(te)[: args.n_score]
    short = R.serialize_inputs(
        te.iloc[: args.n_score],
        [" ".join(d.split()[:12]) for d in te["description"][: args.n_score]],
    )
    tok_len = {
        name: float(np.mean([len(x) for x in rm.tokenizer(t)["input_ids"]]))
        for name, t in (("mona", texts), ("short", short))
    }
    scoring: dict[str, dict[str, float]] = {}
    quant = R.RewardModel(
        torch.ao.quantization.quantize_dynamic(rm.model, {torch.nn.Linear}, dtype=torch.qint8),
        rm.tokenizer,
        rm.max_length,
        rm.temperature,
        bias=rm.bias,
    )
    for name, t in (("mona", texts), ("short", short)):
        scoring[name] = {
            "mean_tokens": tok_len[name],
            "naive_texts_per_s": _naive_texts_per_s(rm, t),
            "ours_texts_per_s": _texts_per_s(rm, t, rc.score_batch_size),
            "ours_int8_texts_per_s": _texts_per_s(quant, t, rc.score_batch_size),
        }
    result = {
        "profile": str(args.params),
        "encoder": rc.encoder,
        "settings": rc.model_dump(mode="json"),
        "train_rows_full_split": len(tr),
        "steps_per_epoch": steps_per_epoch,
        "timed_steps": int(np.ceil(n_rows / rc.batch_size)),
        "seconds_per_step": s_per_step,
        "epoch_seconds_estimate": s_per_step * steps_per_epoch,
        "timed_wall_seconds_incl_setup": total,
        "scoring": scoring,
        "torch_threads": threads,
        "cpus": os.cpu_count(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "note": "shared 2-core machine: compare runs only at similar load averages",
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(to_jsonable(result), indent=2) + "\n", encoding="utf-8")
    print(
        json.dumps(
            to_jsonable({k: result[k] for k in ("epoch_seconds_estimate", "scoring")}), indent=2
        )
    )


if __name__ == "__main__":
    main()
