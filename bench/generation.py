"""Benchmark sampling before and after issue 44 on the same machine, interleaved: evaluation's
sampling and an RL rollout, in useful tokens per second (tokens up to and including the end token).

Before: transformers' `generate` on the LoRA policy with its adapter unmerged (every row kept
until the batch's longest answer ends; what the study ran until issue 44, with the bf16 KV cache
and frozen weights cast once). After (`policy.sampler: compact`, `policy.merge_lora: true`):
`models.decode.sample_compact`, finished rows leave the batch, from the LoRA merged into a copy
of the weights. In between: compact with the adapter unmerged, so each change is seen alone.
`--compile` adds the compact loop with its forward through `torch.compile` (inductor).

Evaluation: notebook 04's call (`generate` with `sampling_kwargs`: `evaluation.batch_size`,
`rl.max_new_tokens`, temperature, top-p) on `--prompts` held-out contexts x `--k` samples.
RL rollout: `PPOTrainer.sample` on `rl.batch_size` responses per batch (`rl.num_generations`
per prompt), `--rollouts` batches, against plain generation on the same weights (the base model
without LoRA or trainer: transformers' `generate` and the compact loop).

Policy: the run's `sft` LoRA on the frozen base when `--run-dir` has one, else the base with a
fresh LoRA of `policy.lora` (B = 0: the base model's answers, the adapter's cost). Variants run
interleaved (A, B, C, A, B, C...) so drifting cores hit all alike; the load average before and
after is in the JSON (other engineers may share these cores).

    .venv/bin/python bench/generation.py [--params params/default.yaml] [--run-dir runs/default]
        [--prompts 64] [--k evaluation.samples_per_prompt] [--rollouts 4] [--reps 2] [--compile]
        [--out bench/results/generation.json]
    .venv/bin/python bench/generation.py --plot-only     # redraw generation.png from the JSON
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
    encode_prompts,
    generate,
    sampling_kwargs,
)
from rlxf_utils.models.loading import (  # noqa: E402
    apply_lora,
    load_policy,
    load_policy_with_adapter,
    load_start_policy,
)
from rlxf_utils.rl.ppo import PPOTrainer  # noqa: E402

EVAL_VARIANTS = {
    "before: generate, LoRA unmerged": {"sampler": "transformers", "merge": False},
    "compact, LoRA unmerged": {"sampler": "compact", "merge": False},
    "compact + merged LoRA (the study)": {"sampler": "compact", "merge": True},
}
COMPILED = {"compact + merged + torch.compile": {"sampler": "compact", "merge": True,
                                                 "compile_step": True}}  # fmt: skip
ROLLOUT_VARIANTS = ("rollout before (generate, unmerged)", "rollout now (compact, merged)",
                    "plain generate, same weights", "plain compact, same weights")  # fmt: skip


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = (("evaluation sampling", result["evaluation"]), ("RL rollout", result["rollout"]))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, (title, part) in zip(axes, parts, strict=True):
        names = list(part["useful_tokens_per_s"])
        for i, name in enumerate(names):
            rates = part["useful_tokens_per_s"][name]
            ax.scatter(np.full(len(rates), i), rates, color=f"C{i}", zorder=3)
            ax.hlines(np.median(rates), i - 0.25, i + 0.25, color=f"C{i}", lw=2)
        ax.set_xticks(range(len(names)), [n.replace(", ", ",\n").replace(" (", "\n(") for n in names],
                      fontsize=7)  # fmt: skip
        ax.set_ylim(bottom=0)
        ax.set_ylabel("useful tokens / s (up to the end token)")
        ax.set_title(f"{title}: x{part['speedup_median']:.2f} against before", fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(
        f"{result['policy']}, {result['autocast']} autocast, up to {result['max_new_tokens']} "
        f"tokens, {result['torch_threads']} threads, load average "
        f"{result['load_average_start']:.1f} -> {result['load_average_end']:.1f}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def summarise(seconds: dict, tokens: dict, lengths: dict) -> dict:
    """Useful tokens/s per variant and repetition, medians, and the speed-up against the first."""
    rates = {n: [t / s for t, s in zip(tokens[n], seconds[n], strict=True)] for n in seconds}
    med = {n: float(np.median(r)) for n, r in rates.items()}
    first, last = list(seconds)[0], list(seconds)[-1]
    return {
        "seconds": seconds, "useful_tokens": tokens, "useful_tokens_per_s": rates,
        "median_useful_tokens_per_s": med, "mean_response_tokens": lengths,
        "speedup_median": med[last] / med[first] if "plain" not in last else None,
    }  # fmt: skip


def bench_evaluation(model, tok, prompts, cfg, args, variants) -> dict:
    seconds = {n: [] for n in variants}
    tokens = {n: [] for n in variants}
    lengths: dict[str, float] = {}
    kw = sampling_kwargs(cfg, progress=False)
    with torch.inference_mode(), autocast(cfg.policy.autocast, model.device):
        for v in variants.values():  # warm-up (and the compiled step's compilation)
            generate(model, tok, prompts[:2], 1, **{**kw, **v})
        for _ in range(args.reps):
            for name, v in variants.items():
                t0 = time.perf_counter()
                df = generate(model, tok, prompts, args.k, **{**kw, **v})
                seconds[name].append(time.perf_counter() - t0)
                print(f"evaluation {name}: {seconds[name][-1]:.1f} s", flush=True)
                tokens[name].append(int(df["n_tokens"].sum()))
                lengths[name] = float(df["n_tokens"].mean())
    return summarise(seconds, tokens, lengths)


def bench_rollout(cfg, contexts, args, run: RunDir) -> dict:
    """PPO's rollout sampling (old and new path) against plain generation on the same weights:
    the start policy (`sft` merged into the base when the run has it, as RL holds it)."""
    rl = cfg.rl
    start = rl.start_policy if run.path(f"policy/{rl.start_policy}/adapter").is_dir() else "base"
    base, tok = load_start_policy(cfg.policy, start, run.root)
    plain, _ = load_start_policy(cfg.policy, start, run.root)
    plain.requires_grad_(False).eval()
    prompts = build_prompts(contexts, tok, rl.prompt_template, cfg.policy)
    idx = [i for i in range(len(prompts)) for _ in range(rl.num_generations)]
    batches = [idx[i : i + rl.batch_size] for i in range(0, len(idx), rl.batch_size)]
    batches = batches[: args.rollouts]
    zero = lambda c, t: np.zeros(len(t), dtype=np.float32)  # noqa: E731 (a stand-in reward)
    with tempfile.TemporaryDirectory() as out:
        tr = PPOTrainer(apply_lora(base, cfg.policy.lora), tok, prompts, contexts, zero, rl, out,
                        autocast_dtype=cfg.policy.autocast)  # fmt: skip
        policy = tr.unwrapped.policy.eval()
        stop = tr.stop_ids

        def rollout(sampler):
            def run(enc):
                tr.sampler = sampler  # before: generate with the LoRA unmerged, as until issue 44
                policy.get_base_model().rlxf_merge_lora = sampler == "compact"
                return tr.sample(policy, enc, rl.temperature, rl.top_p)[1]

            return run

        def plain_run(sampler):
            def run(enc):
                df_kw = dict(max_new_tokens=rl.max_new_tokens, temperature=rl.temperature,
                             top_p=rl.top_p, postprocess="none", seed=0, progress=False,
                             batch_size=len(enc["input_ids"]), sampler=sampler)  # fmt: skip
                texts = [prompts[i] for i in enc["idx"]]
                with autocast(cfg.policy.autocast, plain.device):
                    df = generate(plain, tok, texts, 1, **df_kw)
                return torch.tensor(df["n_tokens"].sum())

            return run

        runs = dict(zip(ROLLOUT_VARIANTS, (rollout("transformers"), rollout("compact"),
                                           plain_run("transformers"), plain_run("compact")), strict=True))  # fmt: skip
        encs = []
        for b in batches:
            enc = encode_prompts(tok, [prompts[i] for i in b], return_tensors="pt", padding=True)
            encs.append({**enc, "idx": b})
        seconds = {n: [] for n in runs}
        tokens = {n: [] for n in runs}
        with torch.inference_mode():
            for run in runs.values():
                run(encs[0])  # warm-up
            for rep in range(args.reps):
                for name, run in runs.items():
                    tr.step = rep  # another stream per repetition
                    t0, n = time.perf_counter(), 0
                    for enc in encs:
                        n += int(run(enc).sum())
                    seconds[name].append(time.perf_counter() - t0)
                    tokens[name].append(n)
                    print(f"rollout {name}: {seconds[name][-1]:.1f} s", flush=True)
    n_resp = sum(len(b) for b in batches)
    lengths = {n: float(np.mean(t)) / n_resp for n, t in tokens.items()}
    res = summarise(seconds, tokens, lengths)
    med = res["median_useful_tokens_per_s"]
    res["speedup_median"] = med[ROLLOUT_VARIANTS[1]] / med[ROLLOUT_VARIANTS[0]]
    res["rollout_vs_plain_generate"] = med[ROLLOUT_VARIANTS[2]] / med[ROLLOUT_VARIANTS[1]]
    res["rollout_vs_plain_generate_before"] = med[ROLLOUT_VARIANTS[2]] / med[ROLLOUT_VARIANTS[0]]
    res["responses_per_rollout"], res["rollouts"] = rl.batch_size, len(batches)
    res["start_policy"] = start
    res["stop_ids"] = stop
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="params/default.yaml")
    ap.add_argument("--run-dir", default=None, help="a run dir: its data/ and sft adapter")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--k", type=int, default=None,
                    help="samples per prompt (default: evaluation.samples_per_prompt)")  # fmt: skip
    ap.add_argument("--rollouts", type=int, default=4, help="RL rollout batches per repetition")
    ap.add_argument("--reps", type=int, default=2, help="timed repetitions of each variant")
    ap.add_argument("--compile", action="store_true", help="also the torch.compile'd step")
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default torch's; 1 when other jobs oversubscribe the cores)",
    )
    ap.add_argument("--out", default="bench/results/generation.json")
    ap.add_argument("--plot-only", action="store_true", help="redraw the figure from --out")
    args = ap.parse_args()
    out = Path(args.out)
    if args.plot_only:
        plot(json.loads(out.read_text(encoding="utf-8")), out.with_suffix(".png"))
        return

    if args.threads:
        torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    cfg = load_config(args.params)
    args.k = args.k or cfg.evaluation.samples_per_prompt
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
        model = apply_lora(model, cfg.policy.lora).requires_grad_(False)
        policy = "base + a fresh LoRA (B = 0)"
    model.eval()
    prompts = build_prompts(contexts, tok, cfg.rl.prompt_template, cfg.policy)
    variants = {**EVAL_VARIANTS, **(COMPILED if args.compile else {})}
    t0 = time.perf_counter()
    evaluation = bench_evaluation(model, tok, prompts, cfg, args, variants)
    rollout = bench_rollout(cfg, contexts, args, run)
    load_end = os.getloadavg()
    result = {
        "policy": policy, "params": args.params,
        "n_responses": len(prompts) * args.k, "max_new_tokens": cfg.rl.max_new_tokens,
        "batch_size": cfg.evaluation.batch_size, "temperature": cfg.rl.temperature,
        "top_p": cfg.rl.top_p, "autocast": cfg.policy.autocast,
        "torch_threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "load_average_start": load_start[0], "load_average_end": load_end[0],
        "load_average_note": "1-min load average before and after (5- and 15-min in "
        "load_averages); other engineers' jobs may share these cores: above the core count, "
        "every variant ran slower, alike (they are interleaved)",
        "load_averages": {"start": load_start, "end": load_end},
        "wall_s": time.perf_counter() - t0,
        "evaluation": evaluation, "rollout": rollout,
    }  # fmt: skip
    result = json.loads(json.dumps(to_jsonable(result)))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    plot(result, out.with_suffix(".png"))
    brief = {k: result[k]["median_useful_tokens_per_s"] for k in ("evaluation", "rollout")}
    print(json.dumps({**brief, "load": [load_start[0], load_end[0]]}, indent=2))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
