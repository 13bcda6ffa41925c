"""Benchmark `sequence_logprobs` with and without sharing a prompt's prefill among its k responses,
on evaluation's own pairs: the real default policy, `--prompts` held-out contexts x `--k` samples
drawn by `generate` (compact sampler, bf16 autocast, evaluation's token cap), scored at
`evaluation.logprob_batch_size` under bf16 autocast as notebook 04 scores them (`frame_logprobs`:
the drawn token ids, left padding for the one-pass path).

On a compute-bound CPU the cost is the tokens each forward pass runs: the one-pass path runs
prompt + response for every pair, the shared path each distinct prompt once per batch and each
response against its KV cache. The two variants run interleaved (A, B, A, B) so drifting cores
hit both alike; the JSON has each repetition's seconds, the medians, the tokens run (counted at
the input embedding), the speed-up and the largest |difference| of a pair's log-probability
(rounding only: bf16 GEMMs of other shapes), beside the one-pass path's own difference between
left and right padding as the yardstick of that rounding.

    .venv/bin/python bench/logprobs.py [--params params/default.yaml] [--prompts 48] [--k 4]
        [--max-new-tokens 128] [--batch 16] [--reps 2] [--threads 2]
        [--out bench/results/logprobs.json]
    .venv/bin/python bench/logprobs.py --quick --out /tmp/logprobs_quick.json   # 6 prompts, 32 tokens
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
from rlxf_utils.data.contexts import load_contexts  # noqa: E402
from rlxf_utils.data.stage import run_data_stage  # noqa: E402
from rlxf_utils.models.generation import (  # noqa: E402
    autocast,
    build_prompts,
    generate,
    sampling_kwargs,
)
from rlxf_utils.models.loading import load_policy  # noqa: E402
from rlxf_utils.models.logprobs import sequence_logprobs  # noqa: E402

VARIANTS = {"one pass (before)": False, "shared prefill": True}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="params/default.yaml")
    ap.add_argument(
        "--run-dir", default=None, help="a run dir with data/ (else built in a temp dir)"
    )
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--k", type=int, default=None, help="default: evaluation.samples_per_prompt")
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help="default: evaluation's cap (evaluation.max_new_tokens)")  # fmt: skip
    ap.add_argument("--batch", type=int, default=None,
                    help="default: evaluation.logprob_batch_size")  # fmt: skip
    ap.add_argument("--reps", type=int, default=2, help="timed repetitions of each variant")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--quick", action="store_true", help="6 prompts, 32 tokens, 1 repetition")
    ap.add_argument("--out", default="bench/results/logprobs.json")
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.max_new_tokens, args.reps = 6, 32, 1

    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    cfg = load_config(args.params)
    k = args.k or cfg.evaluation.samples_per_prompt
    batch = args.batch or cfg.evaluation.logprob_batch_size
    tmp = None
    if args.run_dir and (Path(args.run_dir) / "data").is_dir():
        run = RunDir(args.run_dir)
    else:
        tmp = tempfile.TemporaryDirectory()
        run = RunDir(tmp.name)
        run_data_stage(cfg, run)
    contexts = load_contexts(run.root, "eval", args.prompts, cfg.run.seed)
    model, tok = load_policy(cfg.policy)
    model.eval()
    prompts = build_prompts(contexts, tok, cfg.rl.prompt_template, cfg.policy)
    kw = {**sampling_kwargs(cfg, progress=False), "sampler": "compact"}
    if args.max_new_tokens:
        kw["max_new_tokens"] = args.max_new_tokens
    t0 = time.perf_counter()
    with torch.inference_mode(), autocast("bfloat16", model.device):
        df = generate(model, tok, prompts, k, **kw)
    sample_s = time.perf_counter() - t0
    print(f"sampled {len(df)} responses in {sample_s:.0f} s", flush=True)
    ps, rs = df["prompt_ids"].tolist(), df["response_ids"].tolist()

    counted: list[int] = []
    model.get_input_embeddings().register_forward_hook(
        lambda m, a, out: counted.append(a[0].numel())
    )
    seconds: dict[str, list[float]] = {n: [] for n in VARIANTS}
    tokens: dict[str, int] = {}
    logp: dict[str, np.ndarray] = {}
    with autocast("bfloat16", model.device):
        for share in VARIANTS.values():  # warm-up: the first call's allocations and kernels
            sequence_logprobs(model, tok, ps[: 2 * k], rs[: 2 * k], batch, padding_side="left",
                              share_prompts=share)  # fmt: skip
        for _ in range(args.reps):
            for name, share in VARIANTS.items():
                counted.clear()
                t = time.perf_counter()
                logp[name], _ = sequence_logprobs(model, tok, ps, rs, batch, padding_side="left",
                                                  share_prompts=share)  # fmt: skip
                seconds[name].append(time.perf_counter() - t)
                tokens[name] = sum(counted)
                print(f"{name}: {seconds[name][-1]:.1f} s, {tokens[name]} tokens", flush=True)
        # the yardstick of bf16 rounding: the one-pass path against itself, padded on the right
        right, _ = sequence_logprobs(model, tok, ps, rs, batch, padding_side="right",
                                     share_prompts=False)  # fmt: skip
    med = {n: float(np.median(s)) for n, s in seconds.items()}
    before, after = VARIANTS
    load_end = os.getloadavg()
    result = {
        "policy": cfg.policy.model, "params": args.params, "quick": args.quick,
        "n_prompts": len(prompts), "k": k, "n_pairs": len(df), "batch_size": batch,
        "max_new_tokens": kw["max_new_tokens"], "autocast": "bfloat16",
        "mean_prompt_tokens": float(np.mean([len(p) for p in ps])),
        "mean_response_tokens": float(df["n_tokens"].mean()),
        "max_response_tokens": int(df["n_tokens"].max()),
        "sampling_s": sample_s, "seconds": seconds, "median_s": med, "tokens_run": tokens,
        "tokens_per_s": {n: tokens[n] / med[n] for n in med},
        "speedup_median": med[before] / med[after],
        "token_ratio": tokens[before] / tokens[after],
        "max_abs_logp_difference": float(np.abs(logp[before] - logp[after]).max()),
        "mean_abs_logp_difference": float(np.abs(logp[before] - logp[after]).mean()),
        "max_abs_logp_difference_one_pass_left_vs_right": float(np.abs(logp[before] - right).max()),
        "torch_threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(), "load_averages": {"start": load_start, "end": load_end},
        "load_average_note": "1-, 5- and 15-min load averages before and after; above the core "
        "count other jobs shared the cores (both variants alike: they are interleaved)",
    }  # fmt: skip
    result = json.loads(json.dumps(to_jsonable(result)))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    brief = ("median_s", "tokens_run", "speedup_median", "token_ratio", "max_abs_logp_difference",
             "max_abs_logp_difference_one_pass_left_vs_right")  # fmt: skip
    print(json.dumps({key: result[key] for key in brief}, indent=2))
    print(f"wrote {out}")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
