"""Project the paper profile's wall time on a GPU from a paper-shaped policy with random weights.

Builds Llama-2-7B's architecture from transformers' `LlamaConfig` (random weights, bf16 on the
GPU, nothing downloaded) with the paper's LoRA (`params/paper.yaml`: r 16 on q, k, v, o) and a
BERT-base-shaped reward encoder (`BertConfig`, random) as the stand-in reward, then measures:

  (a) evaluation sampling, useful tokens/s at several batch sizes (the largest sized from free
      GPU memory): before (transformers' `generate`, LoRA unmerged) and now
      (`models.decode.sample_compact`, LoRA merged), and each change alone at the smallest size;
      and the teacher-forced scoring evaluation runs on every sample (tokens/s);
  (b) a PPO step with the project's own trainer (`rl.ppo.run_ppo`, the paper's `rl` settings
      read from the yaml: batch, responses per prompt, minibatch, epochs, max new tokens,
      gradient checkpointing, the critic's reward prior) with the sampler before and now, and a
      GRPO step with the project's TRL run (`rl.trl_runs.run_trl`);
  (c) peak GPU memory of each stage;

and writes `gpu_scale.json` (every number, the projection, its assumptions) and `gpu_scale.png`.
Random weights almost never emit the end token, so an end-token hazard is imposed on the
logits (a forward hook on the LM head: P(end) = `--eos-hazard` at every token, answers of
geometric length, mean about 0.45 x the cap, as the default study's SmolLM2 answers are at 48
tokens): the compact loop's gain depends on answer lengths, which this sets.

    python bench/gpu_scale.py [--params params/paper.yaml] [--out bench/results]   # on a GPU
    python bench/gpu_scale.py --tiny --out /tmp/x     # the same code on the CPU, seconds

The projection: RL = steps x (PPO's step for the PPO family, RLGF, ILHF and the offline methods;
GRPO's step for GRPO and RLOO); evaluation = every held-out prompt x (samples per prompt x each
policy + best-of-N's pool + frontier samples x each RL snapshot) responses sampled at the best
batch, plus three teacher-forced scorings of each (policy, reference, base). SFT, the reward
model and the risk notebook are not projected.
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
os.environ.setdefault("WANDB_DISABLED", "true")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from rlxf_utils.algorithms import RL_ALGORITHMS  # noqa: E402
from rlxf_utils.config import load_config  # noqa: E402
from rlxf_utils.models.decode import auto_batch_size, merged_lora, sample_compact  # noqa: E402
from rlxf_utils.models.generation import cache_in_autocast_dtype  # noqa: E402
from rlxf_utils.models.loading import apply_lora  # noqa: E402
from rlxf_utils.rl.ppo import run_ppo  # noqa: E402
from rlxf_utils.rl.trainer import TrainJob  # noqa: E402
from rlxf_utils.rl.trl_runs import run_trl  # noqa: E402

LLAMA_2_7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                  max_position_embeddings=4096, rms_norm_eps=1e-5)  # fmt: skip
TINY_LLAMA = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512)  # fmt: skip
BERT_BASE = dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                 intermediate_size=3072)  # fmt: skip
TINY_BERT = dict(vocab_size=512, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                 intermediate_size=64)  # fmt: skip


def word_tokenizer(vocab: int):
    """A word-level tokenizer over `vocab` ids (`<eos>` 0 doubling as pad, `<unk>` 1, t2...)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<eos>": 0, "<unk>": 1, **{f"t{i}": i for i in range(2, vocab)}}
    tk = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", pad_token="<eos>",
                                  unk_token="<unk>")  # fmt: skip
    tok.padding_side = "left"
    return tok


def build_policy(fields: dict, device: str, dtype: torch.dtype, hazard: float, merge_lora: bool):
    """A random Llama from `fields` on `device` in `dtype`, its end token (0) forced to
    probability `hazard` at every position by a hook on the LM head, its `generate` made the
    study's (`models.generation.cache_in_autocast_dtype`, as `load_policy` does: a LoRA added
    later samples from merged weights when `merge_lora`, `policy.merge_lora`). Without this the
    bench's PPO and GRPO rollouts sampled an unmerged LoRA, which the study does not."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**fields, pad_token_id=0, eos_token_id=0, bos_token_id=1)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=dtype)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = 0
    shift = float(np.log(hazard / (1 - hazard)))

    def end_hazard(module, args, logits):
        others = torch.logsumexp(logits[..., 1:].float(), -1)
        return torch.cat([(others + shift).to(logits.dtype)[..., None], logits[..., 1:]], -1)

    model.lm_head.register_forward_hook(end_hazard)
    return cache_in_autocast_dtype(model, merge_lora=merge_lora)


def stand_in_reward(fields: dict, device: str, dtype: torch.dtype, tok, batch: int):
    """A BERT-base-shaped encoder with random weights scoring (context, text): the reward model's
    cost. Texts are tokenised by the policy's tokenizer (ids folded into BERT's vocabulary)."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(1)
    with torch.device(device):
        bert = BertModel._from_config(BertConfig(**fields), dtype=dtype).eval()

    @torch.no_grad()
    def reward_fn(contexts, texts):
        out = []
        for i in range(0, len(texts), batch):
            enc = tok(list(texts[i : i + batch]), return_tensors="pt", padding=True,
                      truncation=True, max_length=256)  # fmt: skip
            ids = (enc["input_ids"] % fields["vocab_size"]).to(device)
            h = bert(input_ids=ids, attention_mask=enc["attention_mask"].to(device)).pooler_output
            out.append(torch.sigmoid(h[:, 0].float()).cpu().numpy())
        return np.concatenate(out) if out else np.zeros(0, dtype=np.float32)

    return reward_fn


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def peak_gib(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None


def reset_peak(device: str) -> None:
    import gc

    gc.collect()  # a finished trainer's optimiser and activations
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def sample_once(model, enc, path: str, cap: int, seed: int) -> int:
    """Useful tokens (up to the end token) of one batch sampled the `path` way."""
    if path.startswith("generate"):
        torch.manual_seed(seed)
        out = model.generate(**enc, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                             max_new_tokens=cap, pad_token_id=0, eos_token_id=[0])  # fmt: skip
        resp = out[:, enc["input_ids"].shape[1] :]
    else:
        resp = sample_compact(model, enc["input_ids"], enc["attention_mask"], max_new_tokens=cap,
                              temperature=1.0, top_p=1.0, stop_ids=[0], pad_id=0,
                              seed=seed).ids  # fmt: skip
    ended = (resp == 0).long()
    after = (ended.cumsum(-1) - ended) > 0
    return int((~after).sum())


#: evaluation sampling paths: (how, LoRA merged); the first is the path before issue 44
PATHS = {
    "generate, unmerged (before)": ("generate", False),
    "generate, merged": ("generate", True),
    "compact, merged": ("compact", True),
}
#: `policy.sampler` -> the path the study samples with (merge_lora: true)
SAMPLER_PATH = {"transformers": "generate, merged", "compact": "compact, merged"}


def bench_sampling(model, tok, prompts, sizes, cap, device, reps: int = 2) -> dict:
    """Useful tokens/s per batch size and path (`PATHS`); the compact loop unmerged at the
    smallest size too (what merging alone buys it). Each is run `reps` times and timed at its
    fastest (`seconds`; every run in `seconds_runs`): a path's first full-size run pays for
    memory the allocator has not yet cached and shapes not yet run (on the H100 and the H200 the
    compact loop's first run at each size, with the LoRA merged, took longer than the unmerged
    run after it), which is not the path's pace."""
    alone = {"compact, unmerged": ("compact", False)}
    inner = model.get_base_model()  # whose `generate` merges the LoRA unless told not to
    study_merges = inner.rlxf_merge_lora
    rows = []
    for i, size in enumerate(sizes):
        enc = tok([prompts[j % len(prompts)] for j in range(size)], return_tensors="pt",
                  padding=True).to(device)  # fmt: skip
        for name, (path, merge) in {**PATHS, **(alone if i == 0 else {})}.items():
            reset_peak(device)
            inner.rlxf_merge_lora = merge
            runs = []
            with torch.no_grad(), merged_lora(model) if merge else _null():
                if i == 0:
                    sample_once(model, {k: v[:2] for k, v in enc.items()}, path, 4, 0)  # warm-up
                for _ in range(max(1, reps)):  # the same seed: the same tokens each time
                    sync(device)
                    t0 = time.perf_counter()
                    n = sample_once(model, enc, path, cap, seed=size)
                    sync(device)
                    runs.append(time.perf_counter() - t0)
            s = min(runs)
            rows.append({"batch": size, "path": name, "seconds": s, "seconds_runs": runs,
                         "useful_tokens": n, "useful_tokens_per_s": n / s, "mean_length": n / size,
                         "peak_gib": peak_gib(device)})  # fmt: skip
            print(f"  sampling batch {size:4d} {name:28s} {n / s:9.1f} useful tokens/s "
                  f"(runs {', '.join(f'{r:.2f}' for r in runs)} s)", flush=True)  # fmt: skip
    inner.rlxf_merge_lora = study_merges
    return {"rows": rows}


def profile_paths(model, tok, prompts, batch, cap, device) -> dict:
    """Where a decoding step's time goes on each path (`PATHS` merged, at `batch` rows, `cap`
    new tokens, after a warm-up): torch.profiler's busiest operators by self CPU time and by self
    device time, and how many host syncs each path made (`aten::_local_scalar_dense`: a tensor
    read into Python; `cudaStreamSynchronize` / `cudaDeviceSynchronize`) per sampled step. What
    a GPU session needs to see why one loop is slower than another at a small batch."""
    from torch.profiler import ProfilerActivity, profile

    inner = model.get_base_model()
    study_merges = inner.rlxf_merge_lora
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    enc = tok([prompts[j % len(prompts)] for j in range(batch)], return_tensors="pt",
              padding=True).to(device)  # fmt: skip
    out = {"batch": batch, "max_new_tokens": cap, "paths": {}}
    for name in ("generate, merged", "compact, merged"):
        path, merge = PATHS[name]
        inner.rlxf_merge_lora = merge
        with torch.no_grad(), merged_lora(model):
            sample_once(model, enc, path, cap, seed=1)  # warm-up at this batch
            sync(device)
            with profile(activities=activities) as prof:
                sample_once(model, enc, path, cap, seed=1)
                sync(device)
        events = prof.key_averages()
        dev = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"

        def top(key, events=events, n=15):
            rows = sorted(events, key=lambda e: getattr(e, key, 0), reverse=True)[:n]
            return [{"op": e.key, "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3,
                     "self_device_ms": getattr(e, "self_device_time_total", 0) / 1e3}
                    for e in rows]  # fmt: skip

        syncs = {e.key: e.count for e in events if e.key in (
            "aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaDeviceSynchronize",
            "aten::nonzero", "aten::item")}  # fmt: skip
        out["paths"][name] = {
            "wall_cpu_ms": sum(e.self_cpu_time_total for e in events) / 1e3,
            "syncs_per_step": {k: v / cap for k, v in syncs.items()},
            "kernel_launches_per_step": sum(
                e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel")
            ) / cap,
            "top_self_cpu": top("self_cpu_time_total"),
            "top_self_device": top(dev),
        }  # fmt: skip
        print(f"  profiled {name}: syncs per step {out['paths'][name]['syncs_per_step']}",
              flush=True)  # fmt: skip
    inner.rlxf_merge_lora = study_merges
    return out


def rollout_against_generate(sampling: dict, rl_rows: list[dict], batch: int) -> list[dict]:
    """Each PPO rollout's generation against plain `generate` on the same (merged) weights at
    the rollout's batch: the ratio of useful tokens/s (issue 44 asks for at most 1.3). None
    where sampling did not measure that batch."""
    plain = {r["batch"]: r["useful_tokens_per_s"] for r in sampling["rows"]
             if r["path"] == "generate, merged"}  # fmt: skip
    out = []
    for r in rl_rows:
        if r["algo"] != "ppo" or "error" in r:
            continue
        ref = plain.get(batch)
        out.append({"sampler": r["sampler"], "batch": batch, "plain_tokens_per_s": ref,
                    "rollout_tokens_per_s": r["tokens_per_s"],
                    "slower_by": ref / r["tokens_per_s"] if ref else None})  # fmt: skip
    return out


def _null():
    import contextlib

    return contextlib.nullcontext()


def bench_scoring(model, tok, prompts, cap, batch, device) -> float:
    """Teacher-forced scoring tokens/s (prompt + `cap` response tokens, `batch` sequences)."""
    text = [f"{prompts[j % len(prompts)]} " + " ".join(["t7"] * cap) for j in range(batch)]
    enc = tok(text, return_tensors="pt", padding=True).to(device)
    with torch.no_grad():
        model(**enc, logits_to_keep=cap + 1)
        sync(device)
        t0 = time.perf_counter()
        model(**enc, logits_to_keep=cap + 1)
        sync(device)
    return batch * cap / (time.perf_counter() - t0)


def bench_rl(algo: str, model, tok, prompts, contexts, reward_fn, rl, policy, steps, device,
             sampler: str = "compact") -> dict:  # fmt: skip
    """`steps` steps of the project's own `algo` run (the first a warm-up): step and generation
    seconds from its log rows, peak memory. The LoRA is removed again afterwards."""
    with tempfile.TemporaryDirectory(prefix=f"gpu_scale_{algo}_") as out:  # checkpoints, logs
        job = TrainJob(algo=algo, model=model, tokenizer=tok, prompts=prompts, contexts=contexts,
                       reward_fn=reward_fn, rl=rl.model_copy(update={"steps": steps}),
                       policy=policy.model_copy(update={"sampler": sampler}),
                       output_dir=Path(out), seed=0, progress=False, steps=steps)  # fmt: skip
        reset_peak(device)
        t0 = time.perf_counter()
        log = (run_ppo if algo == "ppo" else run_trl)(job)
        wall = time.perf_counter() - t0
    timed = log.iloc[1:] if len(log) > 1 else log
    return {
        "algo": algo, "sampler": sampler if algo == "ppo" else "TRL's generate",
        "steps": len(log), "wall_s": wall,
        "step_s": float(timed["step_time_s"].median()),
        "generation_s": float(timed["gen_time_s"].median()),
        "tokens_per_s": float(timed["tokens_per_s"].median()),
        "response_length": float(timed["response_length"].median()),
        "peak_gib": peak_gib(device),
    }  # fmt: skip


def strip_lora(model):
    """The base model again after a trainer wrapped it with peft (LoRA layers removed)."""
    from peft.tuners.lora import LoraLayer

    if hasattr(model, "peft_config") or any(isinstance(m, LoraLayer) for m in model.modules()):
        from peft import PeftModel

        if isinstance(model, PeftModel):
            return model.unload()
        for name, module in list(model.named_modules()):
            if isinstance(module, LoraLayer):
                parent = model.get_submodule(name.rsplit(".", 1)[0])
                setattr(parent, name.rsplit(".", 1)[1], module.get_base_layer())
    return model


def project(cfg, sampling: dict, scoring_tps: float, rl_rows: list[dict], eval_prompts: int,
            mean_length: float) -> dict:  # fmt: skip
    """Hours per stage of the profile from the measured rates (assumptions in `assumptions`)."""
    rl, ev = cfg.rl, cfg.evaluation
    algos = list(rl.algorithm)
    sampler = cfg.policy.sampler  # the profile's: RL rollouts and evaluation sample this way
    step = {r["algo"]: r["step_s"] for r in rl_rows
            if "error" not in r and r["sampler"] in (sampler, "TRL's generate")}  # fmt: skip
    ppo_s, grpo_s = step.get("ppo", np.nan), step.get("grpo", step.get("ppo", np.nan))
    per_algo = {a: rl.steps * (grpo_s if a in ("grpo", "rloo") else ppo_s) for a in algos}
    rows = sampling["rows"]
    now = [r for r in rows if r["path"] == SAMPLER_PATH[sampler]]
    before = [r for r in rows if r["path"] == "generate, unmerged (before)"]
    if ev.batch_size == "auto" and sampling.get("auto_batch"):
        at_batch = sampling["auto_batch"]
    else:
        at_batch = ev.batch_size if isinstance(ev.batch_size, int) else before[-1]["batch"]
    at_now = [r for r in now if r["batch"] == at_batch] or now[-1:]
    at_before = before[:1]  # the smallest batch: paper.yaml's 32 before `auto`
    best = max((r for r in rows if r["path"] in PATHS), key=lambda r: r["useful_tokens_per_s"])
    rl_algos = [a for a in algos if a in RL_ALGORITHMS]  # the ones with frontier snapshots
    snapshots = rl.steps // rl.checkpoint_every
    if ev.frontier_max_checkpoints is not None:
        snapshots = min(snapshots, ev.frontier_max_checkpoints)
    policies = 3 + len(algos)  # base, sft, sft_met and every algorithm
    responses = eval_prompts * (ev.samples_per_prompt * policies + ev.best_of_n
                                + ev.frontier_samples_per_prompt * snapshots * len(rl_algos))  # fmt: skip
    tokens = responses * mean_length
    sample_now = tokens / at_now[0]["useful_tokens_per_s"]
    sample_before = tokens / at_before[0]["useful_tokens_per_s"]
    sample_best = tokens / best["useful_tokens_per_s"]
    scoring = 3 * tokens / scoring_tps
    hours = {
        "rl_per_algorithm": {a: s / 3600 for a, s in per_algo.items()},
        "rl": sum(per_algo.values()) / 3600,
        "evaluation_sampling_now": sample_now / 3600,
        "evaluation_sampling_before": sample_before / 3600,
        "evaluation_sampling_best_path": sample_best / 3600,
        "evaluation_scoring": scoring / 3600,
    }
    hours["total_now"] = hours["rl"] + hours["evaluation_sampling_now"] + scoring / 3600
    return {
        "hours": hours,
        "rl_algorithms": algos,
        "evaluation_responses": responses,
        "evaluation_batch_now": at_now[0]["batch"],
        "evaluation_path_now": at_now[0]["path"],
        "evaluation_best_path": {k: best[k] for k in ("path", "batch", "useful_tokens_per_s")},
        "assumptions": [
            f"RL: rl.steps ({rl.steps}) x the measured step for each of the {len(algos)} "
            f"algorithms: GRPO's step for grpo and rloo, PPO's (policy.sampler: {sampler}) for "
            "every other one "
            "(the PPO family and RLGF add a roll-in or a guide, ILHF and the offline methods "
            "sample less: a stand-in, not a measurement)",
            f"evaluation: {eval_prompts} held-out prompts x ({ev.samples_per_prompt} samples x "
            f"{policies} policies + best-of-N's {ev.best_of_n} + {ev.frontier_samples_per_prompt}"
            f" x {snapshots} snapshots x {len(rl_algos)} RL algorithms) = {responses} responses "
            f"of {mean_length:.1f} tokens on average (the imposed end-token hazard)",
            f"evaluation sampling now the profile's way (policy.sampler: {sampler}, "
            f"{at_now[0]['path']}) at evaluation.batch_size ({ev.batch_size}: "
            f"{at_now[0]['batch']} rows), before with generate and the LoRA unmerged at "
            f"{at_before[0]['batch']} rows (the paper profile's batch before `auto`); the fastest "
            f"measured path and batch ({best['path']}, {best['batch']}) in "
            "evaluation_sampling_best_path",
            "scoring: three teacher-forced passes per response (policy, reference, base) at the "
            "measured scoring rate",
            "random weights with an imposed end-token hazard; the stand-in reward is a random "
            "BERT-base-shaped encoder; SFT, the reward model, rewards of evaluation samples and "
            "notebook 05 are not projected; one GPU, no overlap between stages",
        ],
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, name in enumerate(PATHS):
        rows = [r for r in result["sampling"]["rows"] if r["path"] == name]
        ax.plot([r["batch"] for r in rows], [r["useful_tokens_per_s"] for r in rows], "o-",
                color=f"C{i}", label=name)  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xlabel("responses per batch")
    ax.set_ylabel("useful tokens / s")
    ax.set_title(f"evaluation sampling, {result['policy_shape']}", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    h = result["projection"]["hours"]
    names = ["RL", "eval sampling\nbefore", "eval sampling\nnow", "eval scoring"]
    values = [h["rl"], h["evaluation_sampling_before"], h["evaluation_sampling_now"],
              h["evaluation_scoring"]]  # fmt: skip
    bx.bar(names, values, color=["C2", "C0", "C1", "C3"])
    bx.set_ylabel("projected hours")
    bx.set_title(f"{result['params']}: projected {h['total_now']:.1f} h (now)", fontsize=9)
    bx.grid(alpha=0.3, axis="y")
    fig.suptitle(f"{result['device']}; random weights, end-token hazard "
                 f"{result['eos_hazard']:.4f}", fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="params/paper.yaml")
    ap.add_argument("--out", default="bench/results", help="folder for gpu_scale.json / .png")
    ap.add_argument("--tiny", action="store_true", help="a small config on the CPU, seconds")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 64, 128, 256])
    ap.add_argument("--eos-hazard", type=float, default=None,
                    help="P(end token) at every step (default: mean answer 0.45 x the cap)")  # fmt: skip
    ap.add_argument("--eval-prompts", type=int, default=None,
                    help="held-out prompts the evaluation samples (default: the profile's "
                    "evaluation.max_prompts, else 600: all held-out contexts, an assumption)")  # fmt: skip
    ap.add_argument("--rl-steps", type=int, default=3, help="RL steps per run (first: warm-up)")
    ap.add_argument("--reps", type=int, default=2,
                    help="runs of each sampling path and size, timed at the fastest")  # fmt: skip
    ap.add_argument("--no-grpo", action="store_true", help="skip TRL's GRPO step")
    ap.add_argument("--profile", action="store_true",
                    help="also profile generate and the compact loop (merged) at the smallest "
                    "batch into gpu_profile.json")  # fmt: skip
    ap.add_argument("--sampling-only", action="store_true",
                    help="only (a), at the batch sizes and `auto`'s, into gpu_auto_batch.json")  # fmt: skip
    args = ap.parse_args()
    t_start = time.perf_counter()
    cfg = load_config(args.params)
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    rl, policy = cfg.rl, cfg.policy
    if args.tiny:  # the same code, seconds on a CPU
        rl = rl.model_copy(update=dict(batch_size=8, minibatch_size=4, num_generations=4,
                                       max_new_tokens=8, update_epochs=1,
                                       gradient_checkpointing=False))  # fmt: skip
        sizes, dtype, llama, bert = [4, 8], torch.float32, TINY_LLAMA, TINY_BERT
        policy = policy.model_copy(update={"dtype": "float32"})
        prompt_len = 12
    else:
        sizes, dtype, llama, bert = args.batch_sizes, torch.bfloat16, LLAMA_2_7B, BERT_BASE
        prompt_len = 80  # about the paper prompt in LLaMA-2's chat template
    cap = rl.max_new_tokens
    hazard = args.eos_hazard or 1.0 / (0.45 * cap)
    tok = word_tokenizer(llama["vocab_size"])
    rng = np.random.default_rng(0)
    prompts = [" ".join(f"t{w}" for w in rng.integers(2, llama["vocab_size"], size=prompt_len))
               for _ in range(64)]  # fmt: skip
    contexts = [{"country": f"C{i}", "arrangement_type": "SBA", "econ_area": "fiscal",
                 "econ_descriptor": "1.1"} for i in range(len(prompts))]  # fmt: skip
    print(f"device {device}; building the policy ({'tiny' if args.tiny else 'Llama-2-7B shape'})",
          flush=True)  # fmt: skip
    base = build_policy(llama, device, dtype, hazard, policy.merge_lora)
    reward_fn = stand_in_reward(bert, device, dtype, tok, cfg.rl.reward_batch_size)
    model = apply_lora(base, policy.lora).eval()
    with torch.no_grad():  # a LoRA that changes the output: merged and unmerged differ
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.01)
    auto = None
    if device == "cuda":  # `evaluation.batch_size: auto`, sized with the merged copy in place
        with torch.no_grad(), merged_lora(model):
            auto = auto_batch_size(model, prompt_len, cap)
            free, total = torch.cuda.mem_get_info()
        print(f"auto batch {auto} ({free / 2**30:.1f} of {total / 2**30:.1f} GiB free)", flush=True)
        if auto not in sizes:
            sizes = sorted({*sizes, auto})
    print("(a) evaluation sampling", flush=True)
    sampling = bench_sampling(model, tok, prompts, sizes, cap, device, args.reps)
    sampling["auto_batch"] = auto
    if args.profile:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        prof = profile_paths(model, tok, prompts, sizes[0], min(cap, 32), device)
        (out / "gpu_profile.json").write_text(json.dumps(prof, indent=2) + "\n", encoding="utf-8")
    if device == "cuda":
        sampling["gpu_total_gib"] = torch.cuda.mem_get_info()[1] / 2**30
    if args.sampling_only:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_auto_batch.json").write_text(json.dumps(
            {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
             "prompt_tokens": prompt_len, "max_new_tokens": cap, "sampling": sampling,
             "wall_s": time.perf_counter() - t_start}, indent=2))  # fmt: skip
        return
    score_tps = bench_scoring(model, tok, prompts, cap, cfg.evaluation.logprob_batch_size, device)
    base = strip_lora(model)
    print("(b) RL steps", flush=True)
    rl_rows = []
    for algo, sampler in (("ppo", "compact"), ("ppo", "transformers"), ("grpo", "compact")):
        if algo == "grpo" and args.no_grpo:
            continue
        steps = args.rl_steps if sampler == "compact" else 2
        try:
            row = bench_rl(algo, base, tok, prompts, contexts, reward_fn, rl, policy, steps,
                           device, sampler)  # fmt: skip
        except Exception as exc:  # noqa: BLE001 (reported in the JSON; the rest still runs)
            row = {"algo": algo, "sampler": sampler, "error": f"{type(exc).__name__}: {exc}"}
        rl_rows.append(row)
        base = strip_lora(base)
        print(f"  {row}", flush=True)
    mean_length = float(np.mean([r["mean_length"] for r in sampling["rows"]]))
    eval_prompts = args.eval_prompts or cfg.evaluation.max_prompts or 600
    result = {
        "params": args.params, "tiny": args.tiny, "device": torch.cuda.get_device_name()
        if device == "cuda" else "cpu", "policy_shape": "tiny Llama" if args.tiny
        else "Llama-2-7B (random weights, bf16) + LoRA r16 q,k,v,o",
        "reward_shape": "tiny BERT" if args.tiny else "BERT-base (random weights, bf16)",
        "rl_settings": {k: getattr(rl, k) for k in ("batch_size", "num_generations",
                        "minibatch_size", "update_epochs", "max_new_tokens", "critic_init",
                        "gradient_checkpointing", "steps")},
        "eos_hazard": hazard, "prompt_tokens": prompt_len, "sampling": sampling,
        "scoring_tokens_per_s": score_tps, "rl_steps": rl_rows,
        "rollout_against_generate": rollout_against_generate(sampling, rl_rows, rl.batch_size),
        "projection": project(cfg, sampling, score_tps, rl_rows, eval_prompts, mean_length),
        "versions": {"torch": torch.__version__},
    }  # fmt: skip
    result["wall_s"] = time.perf_counter() - t_start
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_scale.json").write_text(json.dumps(result, indent=2, default=str) + "\n",
                                        encoding="utf-8")  # fmt: skip
    plot(result, out / "gpu_scale.png")
    print(json.dumps(result["projection"]["hours"], indent=2))
    for r in result["rollout_against_generate"]:
        print(f"PPO rollout ({r['sampler']}): x{r['slower_by'] or float('nan'):.2f} the time "
              f"of plain generate on the same merged weights at batch {r['batch']}")  # fmt: skip
    print(f"wrote {out / 'gpu_scale.json'} and {out / 'gpu_scale.png'} in {result['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
