"""Benchmark the policy's sampling: transformers' KV cache against the cache kept in the autocast dtype.

Under bf16 autocast, Llama-style keys leave the rotary embedding in float32, so transformers'
dynamic cache grows in fp32 and attention casts the whole cache to bf16 at every decoding step.
`models.generation.cache_in_autocast_dtype` (installed by `load_policy`) keeps the cache in bf16
instead. This script times both on the real policy, interleaved (A, B, A, B, ...) so drifting
cores hit both alike, with the same seed, and checks that they sample the very same tokens.

Policy: the embedded SmolLM2-135M with the run's `sft` adapter when `--run-dir` has one (the
policy evaluation samples most), else the base model. Prompts: the profile's RL prompt on the
held-out contexts (`--prompts` of them, `--k` samples each), generated as notebook 04 does
(`evaluation.batch_size` per batch, `rl.max_new_tokens`, temperature, top-p).

    .venv/bin/python bench/generation.py [--params params/default.yaml] [--run-dir runs/default]
        [--prompts 32] [--k 4] [--reps 3] [--out bench/results/generation.json]
    .venv/bin/python bench/generation.py --plot-only     # redraw generation.png from the JSON

Writes the JSON (seconds and responses/s per repetition and cache, the speed-up of the medians,
whether every repetition sampled identical tokens) and `generation.png` beside it.
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
from rlxf_utils.models.generation import (
    autocast,
    build_prompts,
    generate,
    sampling_kwargs,  # noqa: E402
)
from rlxf_utils.models.loading import load_policy, merge_adapter

CACHES = ("transformers' fp32 cache", "cache in the autocast dtype")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for i, name in enumerate(CACHES):
        rates = result["responses_per_s"][name]
        ax.scatter(np.full(len(rates), i), rates, color=f"C{i}", zorder=3)
        ax.hlines(np.median(rates), i - 0.25, i + 0.25, color=f"C{i}", lw=2)
    ax.set_xticks(range(len(CACHES)), CACHES)
    ax.set_xlim(-0.6, len(CACHES) - 0.4)
    ax.set_ylabel("responses / s (whole generate call)")
    same = "identical tokens" if result["identical_tokens"] else "TOKENS DIFFER"
    ax.set_title(
        f"{result['policy']}, bf16 autocast, {result['n_responses']} responses x "
        f"up to {result['max_new_tokens']} tokens: x{result['speedup_median']:.2f}, {same}",
        fontsize=9,
    )
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="params/default.yaml")
    ap.add_argument("--run-dir", default=None, help="a run dir: its data/ and sft adapter")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--k", type=int, default=4, help="samples per prompt")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions of each cache")
    ap.add_argument("--out", default="bench/results/generation.json")
    ap.add_argument("--plot-only", action="store_true", help="redraw the figure from --out")
    args = ap.parse_args()
    out = Path(args.out)
    if args.plot_only:
        plot(json.loads(out.read_text(encoding="utf-8")), out.with_suffix(".png"))
        return

    load_at_start = os.getloadavg()[0]
    cfg = load_config(args.params)
    if cfg.policy.autocast is None:
        raise SystemExit(
            f"{args.params}: policy.autocast is null; this bench compares caches under autocast"
        )
    tmp = None
    if args.run_dir and (Path(args.run_dir) / "data").is_dir():
        run = RunDir(args.run_dir)
    else:
        tmp = tempfile.TemporaryDirectory()
        run = RunDir(tmp.name)
        run_data_stage(cfg, run)
    contexts = load_contexts(run.root, "eval", args.prompts, cfg.run.seed)
    model, tok = load_policy(cfg.policy)
    adapter = run.path("policy/sft/adapter")
    policy = "base"
    if (adapter / "adapter_config.json").is_file():
        model, policy = merge_adapter(model, adapter), "sft"
    model.eval()
    prompts = build_prompts(contexts, tok, cfg.rl.prompt_template, cfg.policy)
    kw = sampling_kwargs(cfg, progress=False)  # notebook 04's settings
    default_generate = model.generate

    def fp32_cache(*a, **k):  # what transformers builds when no cache is passed
        from transformers.cache_utils import DynamicCache

        return default_generate(*a, past_key_values=DynamicCache(config=model.config), **k)

    with torch.inference_mode(), autocast(cfg.policy.autocast, model.device):
        generate(model, tok, prompts[:2], 1, **kw)  # warm-up
        seconds = {name: [] for name in CACHES}
        tokens = {name: [] for name in CACHES}
        for _ in range(args.reps):
            for name, gen in zip(CACHES, (fp32_cache, default_generate), strict=True):
                model.generate = gen
                t0 = time.perf_counter()
                df = generate(model, tok, prompts, args.k, **kw)
                seconds[name].append(time.perf_counter() - t0)
                ids = df["response_ids"].map(tuple).tolist()
                tokens[name].append(ids)
        model.generate = default_generate
    n = len(prompts) * args.k
    first = tokens[CACHES[0]][0]
    identical = all(ids == first for name in CACHES for ids in tokens[name])
    med = {name: float(np.median(s)) for name, s in seconds.items()}
    result = {
        "policy": policy,
        "params": args.params,
        "n_responses": n,
        "max_new_tokens": cfg.rl.max_new_tokens,
        "batch_size": cfg.evaluation.batch_size,
        "autocast": cfg.policy.autocast,
        "torch_threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "load_average_at_start": load_at_start,
        "seconds": seconds,
        "responses_per_s": {name: [n / s for s in v] for name, v in seconds.items()},
        "median_seconds": med,
        "speedup_median": med[CACHES[0]] / med[CACHES[1]],
        "identical_tokens": identical,
        "mean_response_tokens": float(np.mean([len(r) for r in first])),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(to_jsonable(result), indent=2) + "\n", encoding="utf-8")
    plot(result, out.with_suffix(".png"))
    print(
        json.dumps(
            to_jsonable(
                {k: result[k] for k in ("median_seconds", "speedup_median", "identical_tokens")}
            ),
            indent=2,
        )
    )
    print(f"wrote {out} and {out.with_suffix('.png')}")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
