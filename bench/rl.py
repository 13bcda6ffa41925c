"""Benchmark RL and SFT throughput of the default policy: old vs new defaults, PPO vs GRPO vs RLOO.

Policy: the embedded SmolLM2-135M-Instruct with the LoRA of the profile (`--params`, default
params/default.yaml), started from the base weights (the start policy's weights do not change the
cost). Reward: a cheap stand-in (share of distinct words), so the reward model's cost is NOT
counted in any timing. Every response is exactly `--tokens` long (`min_new_tokens` =
`max_new_tokens`), PPO's approx-KL early stop is off (every step does all its optimiser steps),
and timed steps come after `--warmup` untimed steps; the median is reported.

  a. before/after: "before" = the old default RL configuration (fp32, 1 torch thread, 8 responses
     per step = 8 prompts x 1, update_epochs 2, minibatch 4, the chat template's default system
     turn); "after" = the profile's rl and policy settings (bf16 autocast, all cores, 16 responses
     = 4 prompts x 4, minibatch 8, update_epochs 2, its short system prompt). Throughput is
     responses per second of the whole PPO step (rollout + scoring + update); target after/before
     >= 2.5. Also the generation share of the step and tokens/s.
  b. equal work under "after": PPO (ours) vs GRPO and RLOO (TRL, rlxf_utils.rl.trl_runs.run_trl): same
     prompts, responses, tokens and optimiser steps per batch. TRL's step time is measured here
     from trainer callbacks, from the first optimiser step of a generation batch to the end of its
     last one (run_trl's own `step_time_s` covers only the optimiser step that generated).
     Target PPO/GRPO <= 1.0. PPO's "after" measurement of part a is reused.
  c. fp32 vs bf16 on one fixed batch of sampled responses: per-token and sequence log-prob
     differences, the PPO policy loss computed both ways, and forward+backward time of each.
  d. threads 1 vs 2 for one PPO step (bf16, "after"), and the prompt length in tokens with the
     template's default system turn vs the profile's short system prompt.
  e. SFT throughput: rlxf_utils.rl.sft.train_sft on ~64 real examples (built from `--run-dir`'s
     data when it has them, else synthetic), tokens/s (prompt + target tokens, as run_sft_stage)
     with bf16 autocast on all cores vs fp32 on 1 thread; target >= 566 / 1.5 tokens/s.

Writes `--out` (JSON: machine, setup, results, targets) and a figure next to it (`--fig`).
The machine may be shared: the load average at start and end is recorded with the numbers
("cores_shared" when the 1-minute load average at start is above 0.5). On busy cores, 2 torch
threads can be several times SLOWER than 1 (threads wait for each other); `--threads N` sets the
"after" settings' threads (default: all cores) to separate that from bf16 and batching.

    .venv/bin/python bench/rl.py [--params params/default.yaml] [--tokens 32] [--steps 2]
        [--warmup 1] [--threads N] [--run-dir runs/default] [--sft-examples 64] [--repeats 3]
        [--parts abcde] [--quick] [--out bench/results/rl.json] [--fig bench/results/rl.png]

`--quick` (a plumbing check, not a measurement): 1 timed step, no warm-up, 8 tokens, 4 responses
per step, 8 SFT examples, 1 repeat of the fp32/bf16 timing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MPLBACKEND", "Agg")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from rlxf_utils.artifacts import to_jsonable  # noqa: E402
from rlxf_utils.config import (  # noqa: E402
    PolicyConfig,
    RLConfig,
    SFTConfig,
    load_config,  # noqa: E402
)
from rlxf_utils.models.generation import autocast, build_prompts, encode_prompts, eos_ids  # noqa: E402
from rlxf_utils.models.loading import apply_lora, load_policy  # noqa: E402
from rlxf_utils.rl.core import PolicyWithValue, logprobs_from_logits, policy_loss  # noqa: E402
from rlxf_utils.rl.ppo import PPOTrainer  # noqa: E402
from rlxf_utils.rl.trainer import TrainJob  # noqa: E402
from rlxf_utils.rl.trl_runs import run_trl  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SFT_REFERENCE_TOKENS_PER_S = 566.0  # the reference SFT throughput the target is set against
SFT_TARGET_FACTOR = 1.5  # within 1.5x of the reference
RATIO_TARGET = 2.5  # after/before RL throughput
PPO_GRPO_TARGET = 1.0  # PPO step time / GRPO step time

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


# ---------------------------------------------------------------------------------------------
# Settings
# ---------------------------------------------------------------------------------------------
def rl_settings(base: RLConfig, tokens: int, batch: int | None, **extra: Any) -> RLConfig:
    """The profile's rl settings for timing: fixed response length, no early stop, no samples."""
    upd: dict[str, Any] = dict(
        max_new_tokens=tokens, approx_kl_stop=None, sample_every=10**6, checkpoint_every=10**6,
    )  # fmt: skip
    if batch is not None:  # --quick: fewer responses, same shape of the step
        upd.update(batch_size=batch, minibatch_size=min(base.minibatch_size, batch))
        upd["num_generations"] = min(base.num_generations, batch)
    upd.update(extra)
    return RLConfig.model_validate({**base.model_dump(), **upd})


def before_settings(after: RLConfig, batch: int) -> RLConfig:
    """The old default: `batch` responses, one per prompt, update_epochs 2, minibatch 4."""
    return RLConfig.model_validate({
        **after.model_dump(), "algorithm": ["ppo"], "batch_size": batch, "num_generations": 1,
        "minibatch_size": min(4, batch), "update_epochs": 2,
    })  # fmt: skip


def set_threads(n: int) -> int:
    torch.set_num_threads(n)
    return torch.get_num_threads()


# ---------------------------------------------------------------------------------------------
# a, b, d: step times
# ---------------------------------------------------------------------------------------------
def bench_ppo(
    rl: RLConfig, policy: PolicyConfig, threads: int, steps: int, warmup: int, gen_kw: dict
) -> dict:
    """Median PPO step time and throughput (PPOTrainer.train_step on the stand-in reward)."""
    set_threads(threads)
    torch.manual_seed(0)
    base, tok = load_policy(policy)
    contexts = [CONTEXTS[i % len(CONTEXTS)] for i in range(max(len(CONTEXTS), rl.prompts_per_step))]
    prompts = build_prompts(contexts, tok, rl.prompt_template, policy)
    with tempfile.TemporaryDirectory() as d:
        tr = PPOTrainer(
            apply_lora(base, policy.lora), tok, prompts, contexts, stand_in_reward, rl, d,
            seed=0, generation_kwargs=gen_kw, autocast_dtype=policy.autocast,
        )  # fmt: skip
        rows = [tr.train_step() for _ in range(warmup + steps)][warmup:]
    step = float(np.median([r["step_time_s"] for r in rows]))
    gen = float(np.median([r["gen_time_s"] for r in rows]))
    length = float(np.mean([r["response_length"] for r in rows]))
    return {
        "torch_threads": threads,
        "autocast": policy.autocast,
        "responses_per_step": rl.batch_size,
        "prompts_per_step": rl.prompts_per_step,
        "responses_per_prompt": rl.num_generations,
        "update_epochs": rl.update_epochs,
        "minibatch_size": rl.minibatch_size,
        "optimizer_steps_per_batch": rl.optimizer_steps_per_batch,
        "step_time_s": step,
        "step_times_s": [r["step_time_s"] for r in rows],
        "gen_time_s": gen,
        "update_and_scoring_time_s": step - gen,
        "gen_share": gen / step,
        "responses_per_s": rl.batch_size / step,
        "gen_tokens_per_s": float(np.median([r["tokens_per_s"] for r in rows])),
        "step_tokens_per_s": rl.batch_size * length / step,
        "response_length": length,
    }


@contextlib.contextmanager
def batch_timer(trainer_cls: type, stamps: dict[str, list[float]]) -> Iterator[None]:
    """Add a callback to every `trainer_cls` built inside: wall time at each optimiser step's begin/end."""
    from transformers import TrainerCallback

    class _Stamp(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            stamps["begin"].append(time.perf_counter())

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            stamps["end"].append(time.perf_counter())

    orig = trainer_cls.__init__

    def init(self: Any, *a: Any, **kw: Any) -> None:
        orig(self, *a, **kw)
        self.add_callback(_Stamp())

    trainer_cls.__init__ = init
    try:
        yield
    finally:
        trainer_cls.__init__ = orig


def bench_trl(
    algo: str,
    rl: RLConfig,
    policy: PolicyConfig,
    threads: int,
    steps: int,
    warmup: int,
    gen_kw: dict,
) -> dict:
    """Median TRL step time per generation batch (all its optimiser steps), as PPO's step."""
    import trl

    set_threads(threads)
    torch.manual_seed(0)
    base, tok = load_policy(policy)
    contexts = [CONTEXTS[i % len(CONTEXTS)] for i in range(max(len(CONTEXTS), rl.prompts_per_step))]
    prompts = build_prompts(contexts, tok, rl.prompt_template, policy)
    stamps: dict[str, list[float]] = {"begin": [], "end": []}
    cls = trl.GRPOTrainer if algo == "grpo" else trl.RLOOTrainer
    with tempfile.TemporaryDirectory() as d, batch_timer(cls, stamps):
        log = run_trl(TrainJob(
            algo, base, tok, prompts, contexts, stand_in_reward, rl, policy, Path(d), seed=0,
            progress=False, steps=warmup + steps, generation_kwargs=gen_kw,
        ))  # fmt: skip
    per = rl.optimizer_steps_per_batch
    n_batches = len(stamps["end"]) // per
    batch_times = [
        stamps["end"][(k + 1) * per - 1] - stamps["begin"][k * per] for k in range(n_batches)
    ][warmup:]
    log = log.iloc[warmup:]
    step = float(np.median(batch_times))
    gen = float(log.gen_time_s.median())
    length = float(log.response_length.mean())
    return {
        "torch_threads": threads,
        "autocast": policy.autocast,
        "responses_per_step": rl.batch_size,
        "optimizer_steps_per_batch": per,
        "step_time_s": step,
        "step_times_s": batch_times,
        "trl_logged_step_time_s": float(log.step_time_s.median()),
        "gen_time_s": gen,
        "update_and_scoring_time_s": step - gen,
        "gen_share": gen / step,
        "responses_per_s": rl.batch_size / step,
        "gen_tokens_per_s": float(log.tokens_per_s.median()),
        "step_tokens_per_s": rl.batch_size * length / step,
        "response_length": length,
    }


def prompt_lengths(policy: PolicyConfig, template: str) -> dict:
    """Mean prompt length in tokens with the template's default system turn vs the short one."""
    _, tok = load_policy(policy.model_copy(update={"autocast": None}))
    out = {}
    for name, sp in (("default_system_turn", None), ("short_system_prompt", policy.system_prompt)):
        p = build_prompts(CONTEXTS, tok, template, policy.model_copy(update={"system_prompt": sp}))
        out[name] = float(np.mean([len(ids) for ids in encode_prompts(tok, p)["input_ids"]]))
    out["short_system_prompt_text"] = policy.system_prompt
    out["saved_tokens_per_prompt"] = out["default_system_turn"] - out["short_system_prompt"]
    return out


# ---------------------------------------------------------------------------------------------
# c: fp32 vs bf16 on one batch
# ---------------------------------------------------------------------------------------------
def _fwd_bwd(
    net: PolicyWithValue, batch: dict, dtype: str | None, old: torch.Tensor | None, clip: float
) -> tuple[torch.Tensor, torch.Tensor | None, float]:
    """Log-probs of the batch's responses under `dtype` (and the PPO loss's backward when `old`)."""
    t0 = time.perf_counter()
    with autocast(dtype):
        logits, _ = net(batch["ids"], batch["attn"], batch["R"], with_values=False)
    lp = logprobs_from_logits(logits / batch["temperature"], batch["resp"])
    loss = None
    if old is not None:
        loss, _, _ = policy_loss(lp, old, batch["adv"], batch["mask"], clip)
        net.zero_grad(set_to_none=True)
        loss.backward()
    return lp, loss, time.perf_counter() - t0


def bench_precision(
    rl: RLConfig, policy: PolicyConfig, threads: int, tokens: int, repeats: int
) -> dict:
    """Per-token log-prob, sequence log-prob and PPO-loss differences, fp32 vs bf16 autocast."""
    set_threads(threads)
    torch.manual_seed(0)
    base, tok = load_policy(policy.model_copy(update={"autocast": None}))
    net = PolicyWithValue(apply_lora(base, policy.lora))
    idx = [i for i in range(rl.prompts_per_step) for _ in range(rl.num_generations)]
    contexts = [CONTEXTS[i % len(CONTEXTS)] for i in idx]
    prompts = build_prompts(contexts, tok, rl.prompt_template, policy)
    enc = encode_prompts(tok, prompts, return_tensors="pt", padding=True)
    stop = sorted(eos_ids(net.policy, tok))
    net.eval()
    with torch.no_grad():  # sampled once, in fp32: the fixed batch both precisions score
        out = net.policy.generate(
            **enc, do_sample=True, temperature=rl.temperature, top_p=rl.top_p, top_k=0,
            max_new_tokens=tokens, min_new_tokens=tokens, pad_token_id=tok.pad_token_id,
            eos_token_id=stop,
        )  # fmt: skip
    resp = out[:, enc["input_ids"].shape[1] :]
    is_eos = torch.isin(resp, torch.tensor(stop))
    mask = ((is_eos.cumsum(-1) - is_eos.long()) == 0).long()
    # fixed per-sequence advantages (seeded, whitened): a non-zero loss and gradient to compare
    # (the stand-in reward is often equal across short responses, which would zero them)
    z = torch.randn(resp.shape[0], generator=torch.Generator().manual_seed(0))
    adv = ((z - z.mean()) / (z.std() + 1e-8))[:, None] * mask
    batch = {
        "ids": torch.cat([enc["input_ids"], resp], 1),
        "attn": torch.cat([enc["attention_mask"], mask], 1),
        "resp": resp, "mask": mask.float(), "adv": adv.float(), "R": resp.shape[1],
        "temperature": rl.temperature,
    }  # fmt: skip
    m = batch["mask"]
    res: dict[str, Any] = {"responses": int(resp.shape[0]), "response_tokens": int(m.sum())}
    net.train()
    lps, losses, grads, times = {}, {}, {}, {}
    for name, dtype in (("fp32", None), ("bf16", "bfloat16")):
        with torch.no_grad():
            old, _, _ = _fwd_bwd(net, batch, dtype, None, rl.clip_range)  # the rollout's log-probs
        t = []
        for _ in range(repeats):
            lp, loss, dt = _fwd_bwd(net, batch, dtype, old, rl.clip_range)
            t.append(dt)
        lps[name], losses[name], times[name] = lp.detach(), loss.item(), t
        grads[name] = torch.cat([p.grad.flatten() for p in net.parameters() if p.grad is not None])
    d = (lps["bf16"] - lps["fp32"]).abs() * m
    seq = ((lps["bf16"] - lps["fp32"]) * m).sum(1).abs()
    # the bf16 update's ratio against fp32 rollout log-probs: what precision alone moves
    cross, clip_frac, approx_kl = policy_loss(
        lps["bf16"], lps["fp32"], batch["adv"], m, rl.clip_range
    )
    g32, g16 = grads["fp32"], grads["bf16"]
    res.update({
        "token_logprob_abs_diff_mean": float(d.sum() / m.sum()),
        "token_logprob_abs_diff_max": float(d.max()),
        "seq_logprob_fp32_mean": float((lps["fp32"] * m).sum(1).mean()),
        "seq_logprob_abs_diff_mean": float(seq.mean()),
        "seq_logprob_abs_diff_max": float(seq.max()),
        "ppo_loss_fp32": losses["fp32"],
        "ppo_loss_bf16": losses["bf16"],
        "ppo_loss_abs_diff": abs(losses["bf16"] - losses["fp32"]),
        "ppo_loss_bf16_update_vs_fp32_rollout": float(cross),
        "bf16_vs_fp32_ratio_clip_frac": float(clip_frac),
        "bf16_vs_fp32_approx_kl": float(approx_kl),
        "lora_grad_cosine_fp32_bf16": float(torch.nn.functional.cosine_similarity(g32, g16, dim=0)),
        "lora_grad_norm_rel_diff": float((g16.norm() - g32.norm()).abs() / g32.norm().clamp(min=1e-12)),
        "fwd_bwd_time_fp32_s": statistics.median(times["fp32"]),
        "fwd_bwd_time_bf16_s": statistics.median(times["bf16"]),
        "fwd_bwd_times_s": times,
        "torch_threads": threads,
        "loss_definition": (
            "PPO clipped surrogate; advantages = a fixed, seeded, whitened value per sequence "
            "on every token; old log-probs from a no-grad pass in the same precision (each "
            "pipeline as training runs it); the batch was sampled once in fp32; "
            "ppo_loss_bf16_update_vs_fp32_rollout: bf16 new vs fp32 old log-probs. At ratio 1 "
            "the self-consistent losses equal -mean(A) in both precisions by construction; the "
            "gradient cosine compares the updates"
        ),
    })  # fmt: skip
    return res


# ---------------------------------------------------------------------------------------------
# e: SFT
# ---------------------------------------------------------------------------------------------
def sft_rows(run_dir: Path, cfg: Any, n: int) -> tuple[Any, str]:
    """`n` rows SFT may see (reward protocol's training split, RL countries), or synthetic ones."""
    import pandas as pd

    from rlxf_utils.artifacts import RunDir
    from rlxf_utils.data.contexts import eligible_rows
    from rlxf_utils.data.splits import load_splits

    if (run_dir / "data" / "conditions.parquet").is_file():
        rd = RunDir(run_dir)
        labelled, splits = load_splits(rd)
        contexts = rd.read_parquet("data/contexts.parquet")
        rows = eligible_rows(labelled, splits, contexts, cfg.reward.reward_protocol, "all")
        rows = rows.sample(n=min(2 * n, len(rows)), random_state=cfg.run.seed)  # some too long
        rows = rows.reset_index(drop=True)
        return rows, f"real: {run_dir / 'data'} ({cfg.reward.reward_protocol} training split)"
    texts = [
        "Submit to parliament a budget consistent with the programme's fiscal targets.",
        "Adopt a medium-term revenue strategy, including the removal of tax exemptions.",
        "Complete an independent audit of the central bank's financial statements.",
        "Approve by cabinet a public debt management strategy and publish the annual report.",
        "Clear domestic expenditure arrears and adopt a plan to prevent new arrears.",
        "Amend the banking law to strengthen supervision and bank resolution powers.",
    ]
    synth = [
        {**CONTEXTS[i % len(CONTEXTS)], "description": texts[i % len(texts)]} for i in range(n)
    ]
    return pd.DataFrame(synth), "synthetic prompt/description strings (no run data found)"


def bench_sft(cfg: Any, policy: PolicyConfig, threads: int, examples: list, warm: bool) -> dict:
    """train_sft tokens/s (prompt + target tokens per second of the optimiser steps)."""
    from rlxf_utils.rl.sft import train_sft

    set_threads(threads)
    model, tok = load_policy(policy)
    model = apply_lora(model, policy.lora)
    sc = SFTConfig.model_validate({**cfg.sft.model_dump(), "epochs": 1.0})
    frame = train_sft(
        model, tok, examples, sc, cfg.rl.optimizer, policy.autocast, cfg.run.seed, progress=False
    )
    timed = frame.iloc[1:] if warm and len(frame) > 1 else frame
    return {
        "torch_threads": threads,
        "autocast": policy.autocast,
        "examples": len(examples),
        "batch_size": sc.batch_size,
        "steps": len(frame),
        "tokens": int(frame["tokens"].sum()),
        "tokens_per_s_all_steps": float(frame["tokens"].sum() / frame["step_time_s"].sum()),
        "tokens_per_s": float(timed["tokens"].sum() / timed["step_time_s"].sum()),
        "tokens_per_s_definition": "after the first (warm-up) step"
        if timed is not frame
        else "all steps",
        "step_time_s": [float(x) for x in frame["step_time_s"]],
    }


# ---------------------------------------------------------------------------------------------
# Figure, machine
# ---------------------------------------------------------------------------------------------
def figure(out: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    r = out["results"]
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    ax = axes[0]
    if "before_after" in r:
        ba = r["before_after"]
        vals = [ba["before"]["responses_per_s"], ba["after"]["responses_per_s"]]
        labels = [
            f"{k}\n{'bf16' if x['autocast'] else 'fp32'}, {x['torch_threads']} thread(s),\n"
            f"{x['prompts_per_step']} prompts x {x['responses_per_prompt']}"
            for k, x in (("before", ba["before"]), ("after", ba["after"]))
        ]
        ax.bar(labels, vals, color=["#999999", "#1f77b4"])
        ax.axhline(
            vals[0] * RATIO_TARGET, color="k", ls="--", lw=1, label=f"target {RATIO_TARGET}x"
        )
        ax.set_title(f"PPO throughput: {vals[1] / vals[0]:.2f}x")
        ax.legend(fontsize=8)
    ax.set_ylabel("responses / s (whole PPO step)")
    ax = axes[1]
    if "equal_work" in r:
        algos = [a for a in ("ppo", "grpo", "rloo") if a in r["equal_work"]]
        ax.bar([a.upper() for a in algos], [r["equal_work"][a]["step_time_s"] for a in algos],
               color=["#1f77b4", "#ff7f0e", "#2ca02c"][: len(algos)])  # fmt: skip
        ax.set_title("Equal work, 'after' settings")
    ax.set_ylabel("median step time (s)")
    ax = axes[2]
    if "sft" in r:
        s = r["sft"]
        n = s["bf16_all"]["torch_threads"]
        ax.bar(["fp32\n1 thread", f"bf16\n{n} thread(s)", "reference"],
               [s["fp32_1thread"]["tokens_per_s"], s["bf16_all"]["tokens_per_s"],
                SFT_REFERENCE_TOKENS_PER_S],
               color=["#999999", "#1f77b4", "#dddddd"], hatch=["", "", "//"])  # fmt: skip
        ax.axhline(SFT_REFERENCE_TOKENS_PER_S / SFT_TARGET_FACTOR, color="k", ls="--", lw=1,
                   label=f"target {SFT_REFERENCE_TOKENS_PER_S / SFT_TARGET_FACTOR:.0f}")  # fmt: skip
        ax.legend(fontsize=8)
        ax.set_title("SFT throughput")
    ax.set_ylabel("tokens / s")
    for ax in axes:
        ax.grid(axis="y", alpha=0.3)
    note = "quick plumbing check, not a measurement" if out["setup"]["quick"] else ""
    fig.suptitle(f"RL/SFT benchmark ({out['machine']['cpu_count']} CPUs, "
                 f"cores shared: {out['machine']['cores_shared']}) {note}", fontsize=10)  # fmt: skip
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def machine_info(load0: float) -> dict:
    flags = ""
    with contextlib.suppress(OSError):
        flags = Path("/proc/cpuinfo").read_text()
    return {
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads_default": torch.get_num_threads(),
        "avx512_bf16": "avx512_bf16" in flags,
        "amx_bf16": "amx_bf16" in flags,
        "load_average_1min_at_start": load0,
        "cores_shared": load0 > 0.5,
    }


def target(value: float, op: str, bound: float) -> dict:
    met = value >= bound if op == ">=" else value <= bound
    return {"value": value, "target": f"{op} {bound:g}", "met": bool(met)}


# ---------------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default=str(ROOT / "params" / "default.yaml"))
    ap.add_argument("--tokens", type=int, default=32, help="response length (tokens), every run")
    ap.add_argument("--steps", type=int, default=2, help="timed RL steps per measurement")
    ap.add_argument("--warmup", type=int, default=1, help="untimed RL steps first")
    ap.add_argument("--run-dir", default=str(ROOT / "runs" / "default"), help="SFT examples' data")
    ap.add_argument("--sft-examples", type=int, default=64)
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads of the 'after' settings (default: all cores, as rl.num_threads null)",
    )
    ap.add_argument("--repeats", type=int, default=3, help="fp32/bf16 forward+backward repeats")
    ap.add_argument("--parts", default="abcde", help="which parts to run (subset of abcde)")
    ap.add_argument("--quick", action="store_true", help="plumbing check: tiny sizes, 1 step")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "rl.json"))
    ap.add_argument("--fig", default=None, help="figure path (default: --out with .png)")
    a = ap.parse_args()
    load0 = os.getloadavg()[0]
    machine = machine_info(load0)
    batch = None
    if a.quick:
        a.tokens, a.steps, a.warmup, a.sft_examples, a.repeats = 8, 1, 0, 8, 1
        batch = 4
    cfg = load_config(a.params)
    all_threads = a.threads or os.cpu_count() or 1  # the 'after' settings' threads
    gen_kw = {"min_new_tokens": a.tokens}  # every response exactly `tokens` long
    after_pol = cfg.policy
    before_pol = cfg.policy.model_copy(update={"autocast": None, "system_prompt": None})
    after = rl_settings(cfg.rl, a.tokens, batch)
    before = before_settings(after, batch or 8)
    res: dict[str, Any] = {}
    walls: dict[str, float] = {}
    t_all = time.time()

    if "a" in a.parts or "b" in a.parts or "d" in a.parts:
        t0 = time.time()
        after_run = bench_ppo(after, after_pol, all_threads, a.steps, a.warmup, gen_kw)
        walls["ppo_after"] = time.time() - t0
    if "a" in a.parts:
        t0 = time.time()
        before_run = bench_ppo(before, before_pol, 1, a.steps, a.warmup, gen_kw)
        res["before_after"] = {
            "before": before_run,
            "after": after_run,
            "throughput_ratio_after_over_before": after_run["responses_per_s"]
            / before_run["responses_per_s"],
        }
        walls["a"] = time.time() - t0 + walls["ppo_after"]
    if "b" in a.parts:
        t0 = time.time()
        eq = {"ppo": after_run}
        for algo in ("grpo", "rloo"):
            eq[algo] = bench_trl(algo, after, after_pol, all_threads, a.steps, a.warmup, gen_kw)
        eq["ppo_over_grpo_step_time"] = eq["ppo"]["step_time_s"] / eq["grpo"]["step_time_s"]
        eq["rloo_over_grpo_step_time"] = eq["rloo"]["step_time_s"] / eq["grpo"]["step_time_s"]
        res["equal_work"] = eq
        walls["b"] = time.time() - t0
    if "c" in a.parts:
        t0 = time.time()
        res["precision"] = bench_precision(after, after_pol, all_threads, a.tokens, a.repeats)
        walls["c"] = time.time() - t0
    if "d" in a.parts:
        t0 = time.time()
        thr = {}
        for n in (1, 2):
            thr[f"threads_{n}"] = (
                after_run
                if n == all_threads
                else bench_ppo(after, after_pol, n, a.steps, a.warmup, gen_kw)
            )
        thr["speedup_2_over_1"] = thr["threads_1"]["step_time_s"] / thr["threads_2"]["step_time_s"]
        res["threads"] = thr
        res["prompt_length_tokens"] = prompt_lengths(after_pol, after.prompt_template)
        walls["d"] = time.time() - t0
    if "e" in a.parts:
        from rlxf_utils.rl.sft import build_examples

        t0 = time.time()
        rows, source = sft_rows(Path(a.run_dir), cfg, a.sft_examples)
        model, tok = load_policy(after_pol)
        examples, dropped = build_examples(
            rows, tok, model, cfg.rl.prompt_template, after_pol, cfg.sft.max_response_tokens
        )
        del model
        examples = examples[: a.sft_examples]
        warm = not a.quick
        fp32_pol = after_pol.model_copy(update={"autocast": None})  # same examples, fp32
        res["sft"] = {
            "examples_source": source,
            "examples": len(examples),
            "left_out_too_long": f"{dropped} of {len(rows)} rows built",
            "fp32_1thread": bench_sft(cfg, fp32_pol, 1, examples, warm),
            "bf16_all": bench_sft(cfg, after_pol, all_threads, examples, warm),
        }
        res["sft"]["speedup"] = (
            res["sft"]["bf16_all"]["tokens_per_s"] / res["sft"]["fp32_1thread"]["tokens_per_s"]
        )
        walls["e"] = time.time() - t0

    targets = {}
    if "before_after" in res:
        targets["rl_throughput_after_over_before"] = target(
            res["before_after"]["throughput_ratio_after_over_before"], ">=", RATIO_TARGET
        )
    if "equal_work" in res:
        targets["ppo_over_grpo_step_time"] = target(
            res["equal_work"]["ppo_over_grpo_step_time"], "<=", PPO_GRPO_TARGET
        )
    if "sft" in res:
        targets["sft_tokens_per_s_bf16"] = target(
            res["sft"]["bf16_all"]["tokens_per_s"],
            ">=",
            round(SFT_REFERENCE_TOKENS_PER_S / SFT_TARGET_FACTOR, 1),
        )
        targets["sft_tokens_per_s_bf16"]["reference"] = SFT_REFERENCE_TOKENS_PER_S
    machine["load_average_1min_at_end"] = os.getloadavg()[0]
    out = {
        "machine": machine,
        "setup": {
            "params": os.path.relpath(Path(a.params).resolve(), ROOT),
            "quick": a.quick,
            "policy": f"{cfg.policy.model} SmolLM2-135M-Instruct ({cfg.policy.dtype} weights) "
            f"+ LoRA r={cfg.policy.lora.rank} on {','.join(cfg.policy.lora.target_modules)}, "
            "from the base weights",
            "response_tokens": a.tokens,
            "timed_steps": a.steps,
            "warmup_steps": a.warmup,
            "reward": "cheap stand-in (distinct-word share); reward-model cost excluded",
            "approx_kl_stop": "off in every timing (all optimiser steps run)",
            "definitions": {
                "responses_per_s": "responses per step / median step time (whole step)",
                "gen_tokens_per_s": "generated tokens / generation time (median over steps)",
                "step_tokens_per_s": "response tokens per step / median step time",
                "gen_share": "median generation time / median step time",
                "trl_step_time": "first optimiser step's begin to last optimiser step's end of "
                "one generation batch (trainer callbacks)",
            },
            "before": {
                "autocast": None,
                "torch_threads": 1,
                "system_prompt": None,
                **{
                    k: before.model_dump()[k]
                    for k in ("batch_size", "num_generations", "minibatch_size", "update_epochs")
                },
            },
            "after": {
                "autocast": after_pol.autocast,
                "torch_threads": all_threads,
                "system_prompt": after_pol.system_prompt,
                **{
                    k: after.model_dump()[k]
                    for k in ("batch_size", "num_generations", "minibatch_size", "update_epochs")
                },
            },
        },  # fmt: skip
        "results": res,
        "targets": targets,
        "wall_s": {**walls, "total": time.time() - t_all},
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(to_jsonable(out), indent=2) + "\n", encoding="utf-8")
    fig = Path(a.fig) if a.fig else Path(a.out).with_suffix(".png")
    figure(out, fig)
    print(json.dumps(to_jsonable({"targets": targets, "wall_s": out["wall_s"]}), indent=2))
    print(f"wrote {a.out} and {fig}")


if __name__ == "__main__":
    main()
