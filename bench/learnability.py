"""Can PPO, GRPO and RLOO learn an easy toy reward with the default hyper-parameters?

A sanity check of the RL machinery, not of the study's reward model: the reward of a response is
the share of its words that belong to a fixed list of frequent MONA condition words
(`VOCAB`; words = lower-cased runs of letters, so punctuation is stripped; 0 for an empty
response). The base policy already uses some of them, so a working learner raises the share
within a few steps.

Setup: the profile's (`--params`, default params/default.yaml) policy, LoRA and rl settings as
they are (bf16 autocast, batch, update epochs, learning rate, KL, approx-KL stop, ...); only
`rl.steps` may be overridden (`--steps`). Each algorithm runs through the study's own entry
points (the registry's trainers, `rlxf_utils.algorithms`) into a temporary folder, from a freshly loaded start
policy: the run dir's `sft` policy when `<run-dir>/policy/sft/adapter` exists, else the base
model (recorded as `start_policy`). Prompts: `--contexts` training contexts of the run dir
(rl.load_contexts, seeded sample), or the 8 CONTEXTS of bench/rl.py when the run dir has no
data. Torch threads: rl.num_threads, or all cores when null (as the study); `--threads` overrides
(on cores busy with other jobs, `--threads 1`: 2 threads can be many times slower there).

Per algorithm: the reward per step (mean over the step's responses), the gain = mean of the last
W steps - mean of the first W (W = 3, fewer when steps < 6), and whether it rose by a clear
margin: gain > 0.05 (absolute share) AND gain > 2 standard errors of the difference of the two
W-step means, the step-to-step noise sigma being the standard deviation of the first W step
rewards (SE = sigma * sqrt(2 / W)). With W < 2 there is no noise estimate and nothing is
declared clear.

Writes `--out` (JSON) and a figure next to it (`--fig`): reward per step, one line per algorithm,
its first-W and last-W means marked.

    .venv/bin/python bench/learnability.py [--params params/default.yaml] [--run-dir runs/default]
        [--steps N] [--contexts 32] [--algos ppo,grpo,rloo] [--threads N] [--quick]
        [--out bench/results/learnability.json] [--fig bench/results/learnability.png]

`--quick` (a plumbing check, not a result): 1 step, 8 new tokens, 4 responses per step
(1 prompt x 4, minibatch 4), 4 contexts.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MPLBACKEND", "Agg")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from rlxf_utils.algorithms import algorithm  # noqa: E402
from rlxf_utils.artifacts import to_jsonable  # noqa: E402
from rlxf_utils.config import (
    RLConfig,  # noqa: E402
    load_config,  # noqa: E402
)
from rlxf_utils.data.contexts import load_contexts  # noqa: E402
from rlxf_utils.models.generation import build_prompts  # noqa: E402
from rlxf_utils.models.loading import load_start_policy  # noqa: E402
from rlxf_utils.rl.trainer import TrainJob  # noqa: E402
from rlxf_utils.runtime import seed_everything  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# fmt: off
VOCAB = frozenset([
    "adopt", "submit", "parliament", "law", "budget", "tax", "bank", "central", "public", "debt",
    "reform", "approve", "cabinet", "strategy", "plan", "financial", "revenue", "expenditure",
    "audit", "report",
])
# fmt: on
WINDOW = 3  # steps averaged at the start and at the end
MIN_GAIN = 0.05  # absolute share of vocabulary words
N_SE = 2.0  # the gain must exceed this many standard errors of the step-to-step noise
_WORD = re.compile(r"[a-z]+")


def vocab_share(text: str) -> float:
    """Share of the text's words (lower-cased letter runs) that are in VOCAB; 0 without words."""
    words = _WORD.findall(text.lower())
    return sum(w in VOCAB for w in words) / len(words) if words else 0.0


def toy_reward(contexts: list[dict], texts: list[str]) -> np.ndarray:
    """reward_fn(contexts, texts): the vocabulary share of each response (contexts unused)."""
    return np.array([vocab_share(t) for t in texts], dtype=np.float32)


def bench_contexts() -> list[dict[str, Any]]:
    """The 8 contexts of bench/rl.py (used when the run dir has no data)."""
    spec = importlib.util.spec_from_file_location("bench_rl", Path(__file__).parent / "rl.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return [dict(c, split="train") for c in mod.CONTEXTS]


def verdict(rewards: list[float]) -> dict[str, Any]:
    """Gain (last W - first W step means) and whether it is clear of the step-to-step noise."""
    r = np.asarray(rewards, dtype=float)
    w = max(1, min(WINDOW, len(r) // 2))
    first, last = float(r[:w].mean()), float(r[-w:].mean())
    gain = last - first
    sigma = float(r[:w].std(ddof=1)) if w >= 2 else math.nan
    se = sigma * math.sqrt(2.0 / w) if w >= 2 else math.nan
    clear = bool(w >= 2 and gain > MIN_GAIN and gain > N_SE * se)
    return {
        "window": w,
        "first_mean": first,
        "last_mean": last,
        "gain": gain,
        "noise_sd_first_steps": sigma,
        "se_of_gain": se,
        "clear_gain": clear,
    }


def figure(out: dict, path: Path) -> None:
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7.5, 4))
    w = WINDOW
    for i, (algo, res) in enumerate(out["results"].items()):
        color = f"C{i}"
        steps = np.arange(1, len(res["reward_per_step"]) + 1)
        v = res["verdict"]
        ax.plot(steps, res["reward_per_step"], marker=".", color=color,
                label=f"{algo.upper()}: gain {v['gain']:+.3f}{' (clear)' if v['clear_gain'] else ''}")  # fmt: skip
        w = v["window"]
        ax.hlines(v["first_mean"], steps[0], steps[w - 1], color=color, lw=3, alpha=0.5)
        ax.hlines(v["last_mean"], steps[-w], steps[-1], color=color, lw=3, alpha=0.5)
    ax.set(
        xlabel="step",
        ylabel="share of vocabulary words",
        title=f"Toy reward, default hyper-parameters (start: {out['setup']['start_policy']}; "
        f"bars: first/last {w}-step means)",
    )
    ax.title.set_fontsize(9)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default=str(ROOT / "params" / "default.yaml"))
    ap.add_argument("--run-dir", default=str(ROOT / "runs" / "default"))
    ap.add_argument("--steps", type=int, default=None, help="override rl.steps (quick checks)")
    ap.add_argument("--contexts", type=int, default=32, help="training contexts used as prompts")
    ap.add_argument("--algos", default="ppo,grpo,rloo")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: profile)")
    ap.add_argument("--quick", action="store_true", help="plumbing check: 1 tiny step")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "learnability.json"))
    ap.add_argument("--fig", default=None, help="figure path (default: --out with .png)")
    a = ap.parse_args()
    load0 = os.getloadavg()[0]
    cfg = load_config(a.params)
    upd: dict[str, Any] = {}
    if a.quick:
        upd = {"max_new_tokens": 8, "batch_size": 4, "minibatch_size": 4, "num_generations": 4}
        a.steps, a.contexts = a.steps or 1, 4
    if a.steps is not None:
        upd["steps"] = a.steps
    run_dir = Path(a.run_dir)
    start = "sft" if (run_dir / "policy" / "sft" / "adapter").is_dir() else "base"
    if start != cfg.rl.start_policy:
        upd["start_policy"] = start
    rl = RLConfig.model_validate({**cfg.rl.model_dump(), **upd})
    threads = a.threads or rl.num_threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    if (run_dir / "data" / "contexts.parquet").is_file():
        contexts = load_contexts(run_dir, "train", a.contexts, cfg.run.seed)
        source = f"{len(contexts)} training contexts of {run_dir} (seeded sample)"
    else:
        contexts = bench_contexts()
        source = "the 8 CONTEXTS of bench/rl.py (no run data)"
    results: dict[str, Any] = {}
    t_all = time.time()
    for algo in [x.strip() for x in a.algos.split(",") if x.strip()]:
        seed_everything(cfg.run.seed)
        model, tok = load_start_policy(cfg.policy, start, run_dir)
        prompts = build_prompts(contexts, tok, rl.prompt_template, cfg.policy)
        t0 = time.time()
        with tempfile.TemporaryDirectory(prefix=f"learn_{algo}_") as d:
            job = TrainJob(algo, model, tok, prompts, contexts, toy_reward, rl, cfg.policy, Path(d),
                           seed=cfg.run.seed, progress=False, steps=rl.steps)  # fmt: skip
            log = algorithm(algo).train(job)
        rewards = [float(x) for x in log["reward_mean"]]
        results[algo] = {
            "reward_per_step": rewards,
            "reward_std_per_step": [float(x) for x in log["reward_std"]],
            "kl_per_step": [float(x) for x in log["kl"]],
            "response_length_per_step": [float(x) for x in log["response_length"]],
            "verdict": verdict(rewards),
            "median_step_time_s": float(log["step_time_s"].median()),
            "wall_s": time.time() - t0,
        }
        del model
        print(f"{algo}: reward {rewards[0]:.3f} -> {rewards[-1]:.3f}, "
              f"gain {results[algo]['verdict']['gain']:+.3f}, "
              f"clear {results[algo]['verdict']['clear_gain']}, {time.time() - t0:.0f} s", flush=True)  # fmt: skip
    out = {
        "machine": {
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "torch_threads": threads,
            "torch": torch.__version__,
            "load_average_1min_at_start": load0,
            "cores_shared": load0 > 0.5,
            "load_average_1min_at_end": os.getloadavg()[0],
        },
        "setup": {
            "params": os.path.relpath(Path(a.params).resolve(), ROOT),
            "quick": a.quick,
            "start_policy": start,
            "start_policy_note": "the run dir's sft adapter merged into the base"
            if start == "sft"
            else f"base model ({run_dir / 'policy/sft/adapter'} not found)",
            "prompts": source,
            "steps": rl.steps,
            "overrides_of_profile": upd,
            "rl": {k: v for k, v in rl.model_dump().items() if k != "prompt_template"},
            "policy_autocast": cfg.policy.autocast,
            "system_prompt": cfg.policy.system_prompt,
            "reward": "share of response words (lower-cased letter runs, punctuation stripped) "
            "in VOCAB, after rl.response_postprocess; 0 for an empty response",
            "vocab": sorted(VOCAB),
            "criterion": f"clear gain: gain = mean(last {WINDOW} steps) - mean(first {WINDOW}) "
            f"> {MIN_GAIN} AND > {N_SE:g} x SE, SE = sd(first {WINDOW} step rewards) x "
            f"sqrt(2/{WINDOW}); fewer steps: W = steps // 2, no verdict when W < 2",
        },
        "results": results,
        "all_clear": bool(results) and all(r["verdict"]["clear_gain"] for r in results.values()),
        "wall_s": time.time() - t_all,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(to_jsonable(out), indent=2) + "\n", encoding="utf-8")
    fig = Path(a.fig) if a.fig else Path(a.out).with_suffix(".png")
    figure(out, fig)
    print(f"wrote {a.out} and {fig}")


if __name__ == "__main__":
    main()
