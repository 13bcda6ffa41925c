"""Benchmark the cost of an RLGF step (PPO++, AggreVaTeD, LOLS, D²LOLS) relative to a PPO step.

Policy: the embedded SmolLM2-135M-Instruct with the profile's LoRA and rl settings (`--params`,
default params/default.yaml), from the base weights; guide: a second copy of the base model
(the guide's weights do not change the cost; in the study it is `sft_met`, merged). Reward: the
stand-in of bench/rl.py (share of distinct words), so the reward model's cost is NOT counted.
Every response is exactly `--tokens` long (`min_new_tokens` = `max_new_tokens`), PPO's approx-KL
early stop is off, and the MLE term (rlgf.mle_coef) trains on real historical MET descriptions
of the MONA file. Each algorithm runs `--warmup` untimed steps, then `--steps` timed ones; the
median step time is reported with its ratio to PPO's, and the generation share.

The expected cost: PPO++ and AggreVaTeD generate a roll-in for the beta share of the samples
(one more generate call), and AggreVaTeD's roll-out is sampled by the guide; the update is PPO's
plus the MLE term's forward and backward on one reference per context in each minibatch.

    .venv/bin/python bench/rlgf.py [--params params/default.yaml] [--tokens 32] [--steps 3]
        [--warmup 1] [--threads N] [--quick] [--out bench/results/rlgf.json]

Writes `--out` (JSON: machine, setup, results) and a bar chart next to it (.png). The load
average at start is recorded ("cores_shared" when above 0.5).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MPLBACKEND", "Agg")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from rl import CONTEXTS, machine_info, rl_settings, set_threads, stand_in_reward  # noqa: E402

from rlxf_utils.algorithms import RLGF_ALGORITHMS, algorithm_label  # noqa: E402
from rlxf_utils.artifacts import atomic_path, to_jsonable  # noqa: E402
from rlxf_utils.config import load_config  # noqa: E402
from rlxf_utils.models.generation import build_prompts  # noqa: E402
from rlxf_utils.models.loading import apply_lora, load_policy  # noqa: E402
from rlxf_utils.rl.ppo import PPOTrainer  # noqa: E402
from rlxf_utils.rl.rlgf import GuidedPPOTrainer  # noqa: E402
from rlxf_utils.rl.sft import target_ids  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def met_descriptions(cfg, n: int = 64) -> list[str]:
    """Real MET descriptions from the study's MONA file (the MLE term's references)."""
    from rlxf_utils.data.mona import load_mona

    table = load_mona(cfg.data.path, cfg.data.labels.met, cfg.data.labels.not_assessed)
    df = table.labelled
    met = df.loc[df["y"] == 1, "description"].dropna()
    return met.sample(n=min(n, len(met)), random_state=0).astype(str).tolist()


def bench(
    algo: str, cfg, rl, threads: int, steps: int, warmup: int, gen_kw: dict, texts: list[str]
) -> dict:
    set_threads(threads)
    torch.manual_seed(0)
    base, tok = load_policy(cfg.policy)
    contexts = [CONTEXTS[i % len(CONTEXTS)] for i in range(max(len(CONTEXTS), rl.prompts_per_step))]
    prompts = build_prompts(contexts, tok, rl.prompt_template, cfg.policy)
    model = apply_lora(base, cfg.policy.lora)
    with tempfile.TemporaryDirectory() as d:
        if algo == "ppo":
            tr = PPOTrainer(
                model, tok, prompts, contexts, stand_in_reward, rl, d, seed=0,
                generation_kwargs=gen_kw, autocast_dtype=cfg.policy.autocast,
            )  # fmt: skip
        else:
            guide, _ = load_policy(cfg.policy)
            refs = [[t] for t in target_ids(texts[: len(contexts)], tok, guide)]  # as SFT's targets
            tr = GuidedPPOTrainer(
                algo, model, guide, tok, prompts, contexts, stand_in_reward, rl, cfg.rlgf, d,
                references=refs, seed=0, generation_kwargs=gen_kw,
                autocast_dtype=cfg.policy.autocast,
            )  # fmt: skip
        tr.total_steps = warmup + steps
        rows = [tr.train_step() for _ in range(warmup + steps)][warmup:]
    return {
        "algo": algo,
        "step_time_s": float(np.median([r["step_time_s"] for r in rows])),
        "step_times_s": [r["step_time_s"] for r in rows],
        "gen_time_s": float(np.median([r["gen_time_s"] for r in rows])),
        "schemes": [r["scheme"] for r in rows],
        "learner_share": float(np.mean([r["learner_share"] for r in rows])),
    }


def figure(results: list[dict], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    names = [algorithm_label(r["algo"]) for r in results]
    gen = [r["gen_time_s"] for r in results]
    rest = [r["step_time_s"] - r["gen_time_s"] for r in results]
    ax.bar(names, gen, label="generation (roll-in + roll-out)")
    ax.bar(names, rest, bottom=gen, label="scoring + update")
    for i, r in enumerate(results):
        ax.text(i, r["step_time_s"], f"{r['cost_vs_ppo']:.2f}x", ha="center", va="bottom")
    ax.set(ylabel="median step time (s)", title="RLGF step cost relative to PPO")
    ax.set_ylim(0, 1.2 * max(r["step_time_s"] for r in results))
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default=str(ROOT / "params" / "default.yaml"))
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--algos", default="ppo," + ",".join(RLGF_ALGORITHMS))
    ap.add_argument("--quick", action="store_true", help="plumbing check: 8 tokens, 1 step")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "rlgf.json"))
    args = ap.parse_args()
    if args.quick:
        args.tokens, args.steps, args.warmup = 8, 1, 0
    load0 = os.getloadavg()[0]
    cfg = load_config(args.params)
    batch = 4 if args.quick else None
    rl = rl_settings(cfg.rl, args.tokens, batch)
    gen_kw = {"min_new_tokens": args.tokens}
    references = met_descriptions(cfg)  # read once: the MLE term's texts for every algorithm
    t0 = time.perf_counter()
    results = []
    for algo in args.algos.split(","):
        results.append(
            bench(algo, cfg, rl, args.threads, args.steps, args.warmup, gen_kw, references)
        )
        print(f"{algo}: {results[-1]['step_time_s']:.2f} s/step", flush=True)
    ppo = next((r["step_time_s"] for r in results if r["algo"] == "ppo"), float("nan"))
    for r in results:
        r["cost_vs_ppo"] = r["step_time_s"] / ppo
    out = {
        "machine": {**machine_info(load0), "load_average_1min_at_end": os.getloadavg()[0]},
        "setup": {
            "params": args.params,
            "tokens": args.tokens,
            "steps": args.steps,
            "warmup": args.warmup,
            "threads": args.threads,
            "responses_per_step": rl.batch_size,
            "rlgf": cfg.rlgf.model_dump(),
            "wall_s": time.perf_counter() - t0,
            "quick": args.quick,
        },  # fmt: skip
        "results": results,
    }
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(to_jsonable(out), indent=2) + "\n", encoding="utf-8")
    figure(results, path.with_suffix(".png"))
    print(json.dumps([{k: r[k] for k in ("algo", "step_time_s", "cost_vs_ppo")} for r in results]))


if __name__ == "__main__":
    main()
