"""Benchmark the policy's sampling under bf16 autocast: what `load_policy` installs against
transformers' defaults, at the batch sizes RL and evaluation use.

Under bf16 autocast transformers' defaults cost two avoidable casts at every decoding step:
  - Llama-style keys leave the rotary embedding in float32, so the dynamic KV cache grows in
    fp32 and attention casts the whole cache to bf16 again
    (`models.generation.autocast_kv_cache` stores it in bf16 as it enters);
  - autocast casts every frozen float32 weight again at every call (its cast cache holds only
    trainable weights), 135M weights per token for SmolLM2
    (`models.generation.frozen_weights_in_autocast_dtype` casts them once per `generate` call).
Both give the matmuls the very same bf16 operands. This script times the three variants
(defaults; bf16 cache; bf16 cache and weights cast once = what the study runs) on the real
policy, interleaved (A, B, C, A, B, C...) so drifting cores hit all alike, with the same seed,
and checks that every variant samples the very same tokens.

Policy: the embedded SmolLM2-135M with the run's `sft` LoRA adapter on the frozen base, as
evaluation and RL hold it, when `--run-dir` has one, else the base model. Prompts: the profile's
RL prompt on held-out contexts (`--prompts` of them, `--k` samples each), sampled as notebook 04
does (`rl.max_new_tokens`, temperature, top-p) at each of `--batch-sizes` (16: an RL rollout's
batch; 64: evaluation.batch_size).

    .venv/bin/python bench/generation.py [--params params/default.yaml] [--run-dir runs/default]
        [--prompts 16] [--k 4] [--reps 2] [--batch-sizes 16 64] [--out bench/results/generation.json]
    .venv/bin/python bench/generation.py --plot-only     # redraw generation.png from the JSON

Writes the JSON (seconds and responses/s per batch size, variant and repetition; the speed-ups
of the medians against the defaults; whether every repetition sampled identical tokens) and
`generation.png` beside it.
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
    autocast_kv_cache,
    build_prompts,
    generate,
    sampling_kwargs,
)
from rlxf_utils.models.loading import load_policy, load_policy_with_adapter  # noqa: E402

VARIANTS = (
    "transformers' defaults",
    "bf16 KV cache",
    "bf16 KV cache + frozen weights cast once (the study)",
)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(result["responses_per_s"])
    fig, axes = plt.subplots(1, len(sizes), figsize=(4.2 * len(sizes), 3.8), squeeze=False)
    for ax, size in zip(axes[0], sizes, strict=True):
        for i, name in enumerate(VARIANTS):
            rates = result["responses_per_s"][size][name]
            ax.scatter(np.full(len(rates), i), rates, color=f"C{i}", zorder=3)
            ax.hlines(np.median(rates), i - 0.25, i + 0.25, color=f"C{i}", lw=2)
        ax.set_xticks(range(len(VARIANTS)), ["defaults", "bf16 cache", "+ weights\ncast once"])
        ax.set_xlim(-0.6, len(VARIANTS) - 0.4)
        ax.set_ylim(bottom=0)
        ax.set_ylabel("responses / s (whole generate call)")
        ax.set_title(
            f"batch {size}: x{result['speedup_median'][size]:.2f} against the defaults", fontsize=9
        )
        ax.grid(alpha=0.3, axis="y")
    same = "identical tokens" if result["identical_tokens"] else "TOKENS DIFFER"
    fig.suptitle(
        f"{result['policy']}, bf16 autocast, {result['n_responses']} responses x up to "
        f"{result['max_new_tokens']} tokens, {result['torch_threads']} threads: {same}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="params/default.yaml")
    ap.add_argument("--run-dir", default=None, help="a run dir: its data/ and sft adapter")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--k", type=int, default=4, help="samples per prompt")
    ap.add_argument("--reps", type=int, default=2, help="timed repetitions of each variant")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 64])
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
            f"{args.params}: policy.autocast is null; this bench compares casts under autocast"
        )
    tmp = None
    if args.run_dir and (Path(args.run_dir) / "data").is_dir():
        run = RunDir(args.run_dir)
    else:
        tmp = tempfile.TemporaryDirectory()
        run = RunDir(tmp.name)
        run_data_stage(cfg, run)
    contexts = load_contexts(run.root, "eval", args.prompts, cfg.run.seed)
    adapter = run.path("policy/sft/adapter")
    if (adapter / "adapter_config.json").is_file():
        model, tok = load_policy_with_adapter(cfg.policy, adapter)  # frozen base + LoRA
        policy = "sft (LoRA on the frozen base)"
    else:
        model, tok = load_policy(cfg.policy)
        model.requires_grad_(False)  # frozen, as under LoRA
        policy = "base"
    model.eval()
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    prompts = build_prompts(contexts, tok, cfg.rl.prompt_template, cfg.policy)

    def defaults(*a, **k):  # transformers' own cache and autocast's per-call weight casts
        from transformers.cache_utils import DynamicCache

        return type(base).generate(base, *a, past_key_values=DynamicCache(config=base.config), **k)

    def cache_only(*a, **k):
        return type(base).generate(base, *a, past_key_values=autocast_kv_cache(base), **k)

    study = base.generate
    seconds = {b: {name: [] for name in VARIANTS} for b in args.batch_sizes}
    tokens: dict[int, list[list[tuple[int, ...]]]] = {b: [] for b in args.batch_sizes}
    with torch.inference_mode(), autocast(cfg.policy.autocast, base.device):
        generate(model, tok, prompts[:2], 1, **sampling_kwargs(cfg, progress=False))  # warm-up
        for _ in range(args.reps):
            for size in args.batch_sizes:
                kw = {**sampling_kwargs(cfg, progress=False), "batch_size": size}
                for name, gen in zip(VARIANTS, (defaults, cache_only, study), strict=True):
                    base.generate = gen
                    t0 = time.perf_counter()
                    df = generate(model, tok, prompts, args.k, **kw)
                    seconds[size][name].append(time.perf_counter() - t0)
                    tokens[size].append(df["response_ids"].map(tuple).tolist())
        base.generate = study
    n = len(prompts) * args.k
    # the same seed at the same batch size: the same draws (another batch size draws otherwise)
    identical = all(ids == runs[0] for runs in tokens.values() for ids in runs)
    med = {b: {name: float(np.median(s)) for name, s in v.items()} for b, v in seconds.items()}
    result = {
        "policy": policy,
        "params": args.params,
        "n_responses": n,
        "max_new_tokens": cfg.rl.max_new_tokens,
        "batch_sizes": args.batch_sizes,
        "autocast": cfg.policy.autocast,
        "torch_threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "load_average_at_start": load_at_start,
        "seconds": seconds,
        "responses_per_s": {
            b: {name: [n / s for s in v] for name, v in per.items()} for b, per in seconds.items()
        },
        "median_seconds": med,
        "speedup_median": {b: m[VARIANTS[0]] / m[VARIANTS[-1]] for b, m in med.items()},
        "speedup_weights_cast_once": {b: m[VARIANTS[1]] / m[VARIANTS[2]] for b, m in med.items()},
        "identical_tokens": identical,
        "mean_response_tokens": float(np.mean([len(r) for r in tokens[args.batch_sizes[0]][0]])),
    }
    result = json.loads(json.dumps(to_jsonable(result)))  # batch sizes as keys: strings
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    plot(result, out.with_suffix(".png"))
    keys = ("median_seconds", "speedup_median", "speedup_weights_cast_once", "identical_tokens")
    print(json.dumps({k: result[k] for k in keys}, indent=2))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
