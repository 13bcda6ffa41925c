"""Benchmark one RL training step of PPO (ours), GRPO and RLOO (TRL) on the default policy.

Equal work: same policy (embedded SmolLM2-135M-Instruct + the same LoRA), same prompts, same
batch of completions per step, same response length (EOS suppressed until max_new_tokens via
`min_new_tokens`), same stand-in reward (a cheap function, so the reward model's cost is not
counted). Each algorithm runs `warmup + timed` steps; the timed steps' median is reported.
PPO is also timed with `ppo_epochs=1, minibatch=batch` (one gradient pass over the batch, the
same optimisation work as GRPO/RLOO with num_iterations=1) and a phase breakdown of its step.

    .venv/bin/python bench/rl.py [--batch 8] [--tokens 32] [--steps 3] [--out bench/results/rl.json]
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
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from rlxf_utils.config import PolicyConfig, RLConfig  # noqa: E402
from rlxf_utils.models import apply_lora, build_prompts, load_policy  # noqa: E402
from rlxf_utils.ppo import PPOTrainer  # noqa: E402
from rlxf_utils.rl import run_trl  # noqa: E402

CONTEXTS = [
    {"country": c, "arrangement_type": a, "econ_descriptor": d}
    for c, a, d in [
        ("KENYA", "ECF", "1.1. Revenue administration"),
        ("PAKISTAN", "EFF", "3.2. Central bank operations"),
        ("UKRAINE", "SBA", "2.1. Financial sector restructuring"),
        ("GHANA", "ECF", "1.3. Expenditure policy"),
        ("EGYPT", "EFF", "4.1. State-owned enterprises"),
        ("JAMAICA", "EFF", "1.2. Public debt management"),
        ("MOLDOVA", "ECF", "2.3. Banking supervision"),
        ("ARMENIA", "SBA", "5.1. Social safety nets"),
    ]
]


def stand_in_reward(contexts: list[dict], texts: list[str]) -> np.ndarray:
    """A cheap reward (share of distinct words) standing in for the reward model."""
    return np.array([len(set(t.split())) / max(len(t.split()), 1) for t in texts], dtype=np.float32)


def bench_ppo(rl: RLConfig, policy: PolicyConfig, steps: int, warmup: int, gen_kw: dict) -> dict:
    """Median PPO step time, generated tokens/s and a phase breakdown of the step."""
    base, tok = load_policy(policy)
    prompts = build_prompts(CONTEXTS, tok, rl.prompt_template, policy)
    with tempfile.TemporaryDirectory() as d:
        tr = PPOTrainer(
            apply_lora(base, policy.lora), tok, prompts, CONTEXTS, stand_in_reward, rl, d,
            seed=0, generation_kwargs=gen_kw,
        )  # fmt: skip
        rows = [tr.train_step() for _ in range(warmup + steps)][warmup:]
    step = float(np.median([r["step_time_s"] for r in rows]))
    gen = float(np.median([r["gen_time_s"] for r in rows]))
    return {
        "step_time_s": step,
        "gen_time_s": gen,
        "update_and_scoring_time_s": step - gen,
        "gen_share": gen / step,
        "tokens_per_s": float(np.median([r["tokens_per_s"] for r in rows])),
        "response_length": float(np.mean([r["response_length"] for r in rows])),
    }


def bench_trl(
    algo: str, rl: RLConfig, policy: PolicyConfig, steps: int, warmup: int, gen_kw: dict
) -> dict:
    """Median TRL step time and generated tokens/s."""
    base, tok = load_policy(policy)
    prompts = build_prompts(CONTEXTS, tok, rl.prompt_template, policy)
    with tempfile.TemporaryDirectory() as d:
        log = run_trl(
            algo, base, tok, prompts, CONTEXTS, stand_in_reward, rl, policy, d, seed=0,
            progress=False, steps=warmup + steps, generation_kwargs=gen_kw,
        )  # fmt: skip
    log = log.iloc[warmup:]
    step = float(log.step_time_s.median())
    gen = float(log.gen_time_s.median())
    return {
        "step_time_s": step,
        "gen_time_s": gen,
        "update_and_scoring_time_s": step - gen,
        "gen_share": gen / step,
        "tokens_per_s": float(log.tokens_per_s.median()),
        "response_length": float(log.response_length.mean()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8, help="completions per step")
    ap.add_argument("--tokens", type=int, default=32, help="response length (tokens)")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per algorithm")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--ppo-epochs", type=int, default=4)
    ap.add_argument("--minibatch", type=int, default=4)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (2 threads on shared cores: ~7x slower)",
    )
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "rl.json"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    policy = PolicyConfig()
    common = dict(
        batch_size=a.batch, max_new_tokens=a.tokens, num_generations=2, kl_coef=0.05,
        response_postprocess="none", sample_every=10**6, checkpoint_every=10**6,
    )  # fmt: skip
    gen_kw = {"min_new_tokens": a.tokens}  # every response exactly `tokens` long
    res: dict = {}
    t0 = time.time()
    res["ppo"] = bench_ppo(
        RLConfig(**common, ppo_epochs=a.ppo_epochs, minibatch_size=a.minibatch, approx_kl_stop=None),
        policy, a.steps, a.warmup, gen_kw,
    )  # fmt: skip
    res["ppo_1epoch"] = bench_ppo(
        RLConfig(**common, ppo_epochs=1, minibatch_size=a.batch, approx_kl_stop=None),
        policy, a.steps, a.warmup, gen_kw,
    )  # fmt: skip
    for algo in ("grpo", "rloo"):
        res[algo] = bench_trl(algo, RLConfig(**common), policy, a.steps, a.warmup, gen_kw)
    g = res["grpo"]["step_time_s"]
    out = {
        "machine": {
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "note": "2 shared CPU cores; another process may load them: timings are noisy",
        },
        "setup": {
            "policy": "embedded SmolLM2-135M-Instruct (float32) + LoRA r=16 on q,k,v,o",
            "batch_completions": a.batch,
            "response_tokens": a.tokens,
            "ppo_epochs": a.ppo_epochs,
            "ppo_minibatch": a.minibatch,
            "timed_steps": a.steps,
            "warmup_steps": a.warmup,
            "reward": "cheap stand-in (distinct-word share); reward-model cost excluded",
        },
        "results": res,
        "ratios": {
            "ppo_over_grpo_step_time": res["ppo"]["step_time_s"] / g,
            "ppo_1epoch_over_grpo_step_time": res["ppo_1epoch"]["step_time_s"] / g,
            "rloo_over_grpo_step_time": res["rloo"]["step_time_s"] / g,
            "ppo_over_grpo_tokens_per_s": res["ppo"]["tokens_per_s"] / res["grpo"]["tokens_per_s"],
            "rloo_over_grpo_tokens_per_s": res["rloo"]["tokens_per_s"]
            / res["grpo"]["tokens_per_s"],
        },
        "wall_s": time.time() - t0,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
