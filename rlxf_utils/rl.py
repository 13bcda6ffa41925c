"""RL fine-tuning runs: prompts from training contexts, the reward function, PPO (ours), GRPO/RLOO (TRL).

Like for like: all three start from the same policy (`rl.start_policy`, the SFT policy by
default, which is also their KL reference: a fresh LoRA on its merged weights, adapters off),
see the same prompts in the same order (`ppo.prompt_schedule`; TRL reads them unshuffled), answer
each `num_generations` times, take the same optimiser steps per batch (`update_epochs` passes in
minibatches of `minibatch_size`; TRL's `num_iterations` and `steps_per_generation`), and run the
same number of steps with the same reward function (calibrated P(MET) of the post-processed
response), LoRA settings, sampling settings and mixed precision. Each writes under
`<run_dir>/policy/<algo>/`: `adapter/` (LoRA, safetensors), `train_log.parquet` (columns
`ppo.LOG_COLUMNS`, NaN where an algorithm has no such quantity), `samples.jsonl`,
`settings.json` (its loss settings) and `snapshots/step_XXXXXX/` (the reward-KL frontier).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from rlxf_utils import stages
from rlxf_utils.artifacts import ArtifactMissing, RunDir, atomic_path, to_jsonable
from rlxf_utils.config import (
    CRITIC_INIT,
    ILHF_ALGORITHMS,
    RLGF_ALGORITHMS,
    PolicyConfig,
    RLConfig,
    StudyConfig,
    algorithm_label,
)
from rlxf_utils.ilhf import is_ensemble, load_particles
from rlxf_utils.launch import process_state, processes_for
from rlxf_utils.models import (
    apply_lora,
    autocast,
    build_prompts,
    encode_prompts,
    generate,
    load_start_policy,
    lora_config,
    postprocess_response,
    resolve_device,
)
from rlxf_utils.ppo import (
    LOG_COLUMNS,
    PPOTrainer,
    RewardFn,
    _atomic_dir,
    _seed_everything,
    adapter_state,
    prompt_schedule,
)

__all__ = [
    "CONTEXT_COLUMNS",
    "LOG_COLUMNS",
    "before_after_samples",
    "load_contexts",
    "make_reward_fn",
    "postprocess_response",
    "read_logs",
    "run_algorithm",
    "run_ppo",
    "run_trl",
    "sample_responses",
    "summary_table",
    "training_curves_figure",
    "trl_reward_function",
]

log = logging.getLogger(__name__)

CONTEXT_COLUMNS = ("country", "arrangement_type", "econ_descriptor", "econ_area", "split")
_CTX_KEYS = ("country", "arrangement_type", "econ_descriptor")


def load_contexts(
    run_dir: str | Path, split: str = "train", max_prompts: int | None = None, seed: int = 0
) -> list[dict[str, Any]]:
    """Prompt contexts of one split from `data/contexts.parquet` (RL uses only 'train')."""
    rd = RunDir(run_dir)
    df = rd.read_parquet("data/contexts.parquet", stage="notebook 01 (data exploration)")
    missing = [c for c in CONTEXT_COLUMNS if c not in df.columns]
    if missing:
        raise ArtifactMissing(
            f"{rd.root / 'data/contexts.parquet'} lacks columns {missing}; expected {list(CONTEXT_COLUMNS)}"
        )
    df = df[df["split"] == split].reset_index(drop=True)
    if df.empty:
        raise ValueError(
            f"{rd.root / 'data/contexts.parquet'} has no contexts with split=={split!r}"
        )
    if max_prompts is not None and len(df) > max_prompts:
        df = df.sample(n=max_prompts, random_state=seed).reset_index(drop=True)
    return df.to_dict("records")


def make_reward_fn(reward_model: Any, batch_size: int = 32) -> RewardFn:
    """reward_fn(contexts, texts) -> calibrated P(MET) from a `reward.RewardModel`."""

    def reward_fn(contexts: list[dict[str, Any]], texts: list[str]) -> np.ndarray:
        ctx = [{k: c[k] for k in _CTX_KEYS} for c in contexts]
        return np.asarray(
            reward_model.score(ctx, list(texts), batch_size=batch_size), dtype=np.float32
        )

    return reward_fn


def trl_reward_function(reward_fn: RewardFn, postprocess: str) -> Callable[..., list[float]]:
    """Wrap `reward_fn` as a TRL reward function (context columns arrive as keyword lists)."""

    def reward_model(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        texts = [postprocess_response(t, postprocess) for t in texts]
        contexts = [{k: kwargs[k][i] for k in _CTX_KEYS if k in kwargs} for i in range(len(texts))]
        return [float(x) for x in reward_fn(contexts, texts)]

    return reward_model


def sample_responses(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    rl: RLConfig,
    seed: int = 0,
    batch_size: int = 8,
    use_adapters: bool = True,
    adapter_names: Sequence[str] | None = None,
) -> list[str]:
    """Sample one post-processed response per prompt (adapters off = the starting policy;
    `adapter_names`: the adapter answering each prompt, e.g. an ILHF ensemble's particles)."""
    import contextlib

    ctx = (
        model.disable_adapter()
        if (not use_adapters and hasattr(model, "disable_adapter"))
        else contextlib.nullcontext()
    )
    with ctx:
        df = generate(
            model, tokenizer, prompts, 1, max_new_tokens=rl.max_new_tokens,
            temperature=rl.temperature, top_p=rl.top_p, postprocess=rl.response_postprocess,
            seed=seed, batch_size=batch_size, progress=False, adapter_names=adapter_names,
        )  # fmt: skip
    return df["response"].tolist()


def run_ppo(
    base_model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    contexts: Sequence[Mapping[str, Any]],
    reward_fn: RewardFn,
    rl: RLConfig,
    policy: PolicyConfig,
    output_dir: str | Path,
    seed: int = 0,
    progress: bool = True,
    steps: int | None = None,
    generation_kwargs: Mapping[str, Any] | None = None,
) -> pd.DataFrame:
    """PPO (rlxf_utils.ppo) with LoRA on `base_model`; resumes from `output_dir/checkpoints`."""
    model = apply_lora(base_model, policy.lora)
    trainer = PPOTrainer(
        model, tokenizer, prompts, contexts, reward_fn, rl, output_dir, seed=seed,
        generation_kwargs=generation_kwargs, autocast_dtype=policy.autocast,
    )  # fmt: skip
    write_settings(output_dir, "ppo", rl, ppo_loss_settings(
        rl, "GAE over tokens with a learned critic, whitened over the batch"
    ))  # fmt: skip
    return trainer.train(steps=steps, progress=progress)


def ppo_loss_settings(rl: RLConfig, advantage: str) -> dict[str, Any]:
    """The loss settings PPO and the RLGF algorithms built on it share, for `settings.json`."""
    return {
        "kl_penalty": "per-token log-ratio to the reference in the reward (beta adaptive)"
        if rl.adaptive_kl else "per-token log-ratio to the reference in the reward (fixed beta)",
        "advantage": advantage,
        "clip_range": rl.clip_range, "clip_range_value": rl.clip_range_value,
        "vf_coef": rl.vf_coef, "approx_kl_stop": rl.approx_kl_stop,
        "critic_init": CRITIC_INIT[rl.critic_init],
    }  # fmt: skip


def write_settings(
    output_dir: str | Path, algo: str, rl: RLConfig, extra: Mapping[str, Any]
) -> dict[str, Any]:
    """`settings.json`: what every algorithm shares (prompts, responses, updates) and its own loss."""
    out = {
        "algo": algo,
        "steps": rl.steps,
        "prompts_per_step": rl.prompts_per_step,
        "responses_per_prompt": rl.num_generations,
        "responses_per_step": rl.batch_size,
        "optimizer_steps_per_batch": rl.optimizer_steps_per_batch,
        "update_epochs": rl.update_epochs,
        "minibatch_size": rl.minibatch_size,
        "max_new_tokens": rl.max_new_tokens,
        "temperature": rl.temperature,
        "learning_rate": rl.learning_rate,
        "kl_coef_initial": rl.kl_coef,
        **dict(extra),
    }
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    with atomic_path(Path(output_dir) / "settings.json") as tmp:
        tmp.write_text(json.dumps(to_jsonable(out), indent=2) + "\n", encoding="utf-8")
    return out


def trl_tokenizer(tokenizer: Any, prompts: Sequence[str]) -> Any:
    """A tokenizer for TRL that turns our formatted prompts into exactly `encode_prompts`' ids.

    TRL tokenises string prompts with the tokenizer's default special tokens; for a template that
    already writes BOS (LLaMA-2) that would double it, so such a tokenizer gets `add_bos_token`
    switched off on a copy. Raises when the ids still differ.
    """
    import copy

    sample = list(prompts[:4])
    want = encode_prompts(tokenizer, sample)["input_ids"]
    if tokenizer(sample)["input_ids"] == want:
        return tokenizer
    tok = copy.deepcopy(tokenizer)
    if hasattr(tok, "add_bos_token"):
        tok.add_bos_token = False
    if tok(sample)["input_ids"] != want:
        raise ValueError(
            "TRL would tokenise the prompts differently from PPO and evaluation (special tokens); "
            "set policy.use_chat_template or use a tokenizer whose BOS can be switched off"
        )
    return tok


class _GenTimer:
    """Wraps a model's `generate` to add up generation time and generated tokens."""

    def __init__(self, model: Any, pad_id: int):
        self.model, self.pad_id, self.time, self.tokens = model, pad_id, 0.0, 0
        self._orig = model.generate
        model.generate = self  # instance attribute: TRL calls unwrapped_model.generate

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = self._orig(*args, **kwargs)
        self.time += time.perf_counter() - t0
        n_prompt = kwargs["input_ids"].shape[1] if "input_ids" in kwargs else args[0].shape[1]
        self.tokens += int((out[:, n_prompt:] != self.pad_id).sum())
        return out

    def take(self) -> tuple[float, int]:
        t, n = self.time, self.tokens
        self.time, self.tokens = 0.0, 0
        return t, n


def run_trl(
    algo: str,
    base_model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    contexts: Sequence[Mapping[str, Any]],
    reward_fn: RewardFn,
    rl: RLConfig,
    policy: PolicyConfig,
    output_dir: str | Path,
    seed: int = 0,
    progress: bool = True,
    steps: int | None = None,
    generation_kwargs: Mapping[str, Any] | None = None,
) -> pd.DataFrame:
    """GRPO or RLOO through TRL with the same prompts, reward, LoRA, sampling, updates and KL coefficient."""
    os.environ.setdefault("WANDB_DISABLED", "true")
    from datasets import Dataset
    from transformers import TrainerCallback

    if algo == "grpo":
        from trl import GRPOConfig as Config
        from trl import GRPOTrainer as Trainer
    elif algo == "rloo":
        from trl import RLOOConfig as Config
        from trl import RLOOTrainer as Trainer
    else:
        raise ValueError(f"rl.algorithm entry {algo!r}: run_trl takes 'grpo' or 'rloo'")

    output_dir = Path(output_dir)
    steps = steps or rl.steps
    _seed_everything(seed)
    # The dataset is PPO's prompt schedule laid out step by step and read unshuffled: every
    # algorithm answers the same prompts at the same step.
    schedule = prompt_schedule(len(prompts), steps, rl.prompts_per_step, seed)
    rows = [
        {"prompt": prompts[i], **{k: str(contexts[i][k]) for k in _CTX_KEYS}}
        for idx in schedule
        for i in idx
    ]
    dataset = Dataset.from_list(rows)
    per_batch = rl.optimizer_steps_per_batch
    args = Config(
        output_dir=str(output_dir / "trl"),
        # completions per optimiser step, over all processes (as PPO's minibatch)
        per_device_train_batch_size=rl.minibatch_size // world_size(),
        steps_per_generation=rl.batch_size // rl.minibatch_size,  # generation batch = rl.batch_size
        gradient_accumulation_steps=1,
        shuffle_dataset=False,
        num_generations=rl.num_generations,
        max_completion_length=rl.max_new_tokens,
        temperature=rl.temperature,
        top_p=rl.top_p,
        top_k=0,
        generation_kwargs=dict(generation_kwargs) if generation_kwargs else None,
        learning_rate=rl.learning_rate,
        beta=rl.kl_coef,  # KL to the adapter-disabled reference, as in PPO
        epsilon=rl.clip_range,
        max_grad_norm=rl.max_grad_norm,
        num_iterations=rl.update_epochs,  # passes over each generation batch, as PPO's epochs
        max_steps=steps * per_batch,  # TRL counts optimiser steps
        logging_steps=1,
        # Trainer checkpoints (adapter, optimiser, RNG, data position) at generation-batch
        # boundaries every `checkpoint_every` batches, the last one kept: an interrupted run
        # resumes there (with its log rows, saved beside each checkpoint by _HistoryCallback)
        save_strategy="steps",
        save_steps=rl.checkpoint_every * per_batch,
        save_total_limit=1,
        report_to="none",
        push_to_hub=False,
        seed=seed,
        data_seed=seed,
        disable_tqdm=not progress,
        dataloader_num_workers=0,
        remove_unused_columns=False,
        use_cpu=not torch.cuda.is_available(),
        bf16=policy.dtype == "bfloat16" and torch.cuda.is_available(),  # autocast: see train()
        lr_scheduler_type="constant",
        warmup_steps=0,
        gradient_checkpointing=rl.gradient_checkpointing,  # TRL defaults to True; PPO matches
    )
    history: list[dict[str, Any]] = []

    class _LogCallback(TrainerCallback):
        """Map TRL's logged metrics onto the PPO log schema."""

        timer: _GenTimer | None = None

        def on_log(
            self, args: Any, state: Any, control: Any, logs: dict | None = None, **kw: Any
        ) -> None:
            if not logs or "reward" not in logs:  # only the step that generated logs the reward
                return
            length = logs.get("completions/mean_length", np.nan)
            kl_tok = logs.get("kl", np.nan)
            gen_t, gen_n = self.timer.take() if self.timer else (np.nan, 0)
            history.append(  # noqa: B023 (the callback lives only inside this call)
                {
                    "algo": algo,
                    "step": -(-int(state.global_step) // per_batch),  # generation batches
                    "reward_mean": logs.get("reward", np.nan),
                    "reward_std": logs.get("reward_std", np.nan),
                    "kl": kl_tok * length if np.isfinite(kl_tok) else np.nan,
                    "kl_per_token": kl_tok,
                    "kl_coef": rl.kl_coef,
                    "entropy": logs.get("entropy", np.nan),
                    "value_mean": np.nan,
                    "clip_frac": logs.get("clip_ratio/region_mean", np.nan),
                    "approx_kl": np.nan,
                    "policy_loss": logs.get("loss", np.nan),
                    "value_loss": np.nan,
                    "explained_variance": np.nan,
                    "explained_variance_prior": np.nan,
                    "response_length": length,
                    "tokens_per_s": gen_n / gen_t if gen_t and gen_t > 0 else np.nan,
                    "gen_time_s": gen_t,
                    "step_time_s": logs.get("step_time", np.nan),
                }
            )
            row = history[-1]  # noqa: B023
            log.info(
                "%s step %d: reward %.4f kl %.3f", algo, row["step"], row["reward_mean"], row["kl"]
            )

    class _SnapshotCallback(TrainerCallback):
        """At the end of each generation batch: its wall time (generation and every optimiser
        step, as PPO's step time counts them) into the log row; every `checkpoint_every` batches
        the adapter, for the reward-KL frontier."""

        last = time.perf_counter()

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.last = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            step, rest = divmod(int(state.global_step), per_batch)
            if rest:
                return
            now = time.perf_counter()
            if history and history[-1]["step"] == step:  # noqa: B023
                history[-1]["step_time_s"] = now - self.last  # noqa: B023
            self.last = now
            if step % rl.checkpoint_every == 0 and step < steps:
                _save_snapshot(trainer, output_dir, step)

    class _HistoryCallback(TrainerCallback):
        """The log rows so far, written into each checkpoint Trainer saves."""

        def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            ckpt = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            if ckpt.is_dir() and state.is_world_process_zero:
                with atomic_path(ckpt / HISTORY_FILE) as tmp:
                    tmp.write_text(json.dumps(to_jsonable(history)), encoding="utf-8")  # noqa: B023

    resume = _latest_trl_checkpoint(output_dir / "trl")
    if resume is not None:
        history.extend(json.loads((resume / HISTORY_FILE).read_text(encoding="utf-8")))
        log.info("%s: resuming from %s (%d batches logged)", algo, resume, len(history))
    cb = _LogCallback()
    trainer = Trainer(
        model=base_model,
        reward_funcs=trl_reward_function(reward_fn, rl.response_postprocess),
        args=args,
        train_dataset=dataset,
        processing_class=trl_tokenizer(tokenizer, prompts),
        peft_config=lora_config(policy.lora),
        callbacks=[cb, _SnapshotCallback(), _HistoryCallback()],
    )
    write_settings(output_dir, algo, rl, {
        "kl_penalty": "k3 estimator in the loss, fixed beta" if algo == "grpo"
        else "sequence log-ratio to the reference subtracted from the reward, fixed beta",
        "advantage": "group-normalised reward" if algo == "grpo" else "leave-one-out baseline",
        **{k: getattr(args, k) for k in ("loss_type", "scale_rewards", "normalize_advantages",
                                         "epsilon", "beta", "num_iterations", "steps_per_generation",
                                         "per_device_train_batch_size", "mask_truncated_completions")
           if hasattr(args, k)},
    })  # fmt: skip
    cb.timer = _GenTimer(trainer.accelerator.unwrap_model(trainer.model), tokenizer.pad_token_id)
    with autocast(policy.autocast, trainer.accelerator.device):
        trainer.train(resume_from_checkpoint=str(resume) if resume is not None else None)
    frame = pd.DataFrame(history, columns=list(LOG_COLUMNS))
    if trainer.accelerator.is_main_process:
        peft_model = trainer.accelerator.unwrap_model(trainer.model)
        del peft_model.generate  # drop the timer before saving
        _atomic_dir(output_dir / "adapter", lambda d: peft_model.save_pretrained(d))
        with atomic_path(output_dir / "train_log.parquet") as tmp:
            frame.to_parquet(tmp, index=False)
        n = min(4, len(prompts))
        with autocast(policy.autocast, trainer.accelerator.device):
            texts = sample_responses(peft_model, tokenizer, prompts[:n], rl, seed=seed)
        scores = reward_fn([dict(c) for c in contexts[:n]], texts)
        samples = [
            {"step": steps, **{k: contexts[i][k] for k in _CTX_KEYS}, "response": texts[i], "reward": float(scores[i])}
            for i in range(n)
        ]  # fmt: skip
        with atomic_path(output_dir / "samples.jsonl") as tmp:
            tmp.write_text(
                "".join(json.dumps(to_jsonable(s)) + "\n" for s in samples), encoding="utf-8"
            )
    return frame


HISTORY_FILE = "rlxf_history.json"


def _latest_trl_checkpoint(folder: Path) -> Path | None:
    """The newest complete Trainer checkpoint (one with our log rows, written after Trainer's files)."""
    found = [
        (int(p.name.split("-")[1]), p)
        for p in folder.glob("checkpoint-*")
        if p.name.split("-")[1].isdigit() and (p / HISTORY_FILE).is_file()
    ]
    return max(found)[1] if found else None


def _save_snapshot(trainer: Any, output_dir: Path, step: int) -> None:
    """The LoRA weights at a generation batch, as `snapshots/step_XXXXXX/adapter_model.safetensors`."""
    from safetensors.torch import save_file

    if not trainer.accelerator.is_main_process:
        return
    state = adapter_state(trainer.accelerator.unwrap_model(trainer.model))
    _atomic_dir(
        output_dir / "snapshots" / f"step_{step:06d}",
        lambda d: save_file(state, str(d / "adapter_model.safetensors")),
    )


def algorithm_marker(
    algo: str, cfg: StudyConfig, run_dir: str | Path, n_prompts: int, steps: int | None = None
) -> dict[str, Any]:
    """What an RL run depends on: its settings, steps, seed, prompts, process count and the
    hashes of its inputs (`complete.json` when it finished, `started.json` while it trains)."""
    root = Path(run_dir)
    return {
        "rl": cfg.rl.model_dump(mode="json", exclude={"num_threads", "algorithm"}),
        "policy": cfg.policy.model_dump(mode="json"),
        **({"rlgf": cfg.rlgf.model_dump(mode="json")} if algo in RLGF_ALGORITHMS else {}),
        **({"ilhf": cfg.ilhf.model_dump(mode="json")} if algo in ILHF_ALGORITHMS else {}),
        "steps": steps or cfg.rl.steps,
        "seed": cfg.run.seed,
        "prompts": n_prompts,
        # each process samples its own share: another process count is another run
        "processes": processes_for(cfg, "rl", algo),
        # what it was trained from: the data, the reward, the start policy (and RLGF's guide)
        "inputs": stages.input_hashes(root, [
            "data", *stages.REWARD_PATHS, f"policy/{cfg.rl.start_policy}/adapter",
            *([f"policy/{cfg.rlgf.guide}/adapter"] if algo in RLGF_ALGORITHMS else []),
        ]),
    }  # fmt: skip


def is_trained(
    algo: str,
    cfg: StudyConfig,
    run_dir: str | Path,
    contexts: Sequence[Mapping[str, Any]],
    steps: int | None = None,
) -> bool:
    """True when `policy/<algo>/complete.json` matches what a run now would depend on."""
    done = Path(run_dir) / "policy" / algo / "complete.json"
    return done.is_file() and _matches(
        done, algorithm_marker(algo, cfg, run_dir, len(contexts), steps)
    )


def _matches(path: Path, marker: Mapping[str, Any]) -> bool:
    """True when the marker file `path` exists and records `marker`."""
    return path.is_file() and json.loads(path.read_text(encoding="utf-8")) == marker


def run_algorithm(
    algo: str,
    cfg: StudyConfig,
    run_dir: str | Path,
    reward_fn: RewardFn,
    contexts: Sequence[Mapping[str, Any]] | None = None,
    progress: bool = True,
    steps: int | None = None,
) -> pd.DataFrame:
    """Load the start policy afresh, build prompts from the training contexts and run one algorithm."""
    rd = RunDir(run_dir)
    if contexts is None:
        contexts = load_contexts(rd.root, "train", cfg.rl.max_prompts, cfg.run.seed)
    if any(c.get("split", "train") != "train" for c in contexts):
        raise ValueError("RL must only see split=='train' contexts; held-out contexts were passed")
    if cfg.rl.num_threads is not None:  # on shared cores, 1 thread avoids spin-wait slowdowns
        torch.set_num_threads(cfg.rl.num_threads)
    out = rd.root / "policy" / algo
    # A finished run with the same settings and prompts is reused (the marker is written last),
    # checked before the start policy is loaded and merged.
    marker = algorithm_marker(algo, cfg, rd.root, len(contexts), steps)
    done = out / "complete.json"
    if _matches(done, marker):
        log.info("%s: up to date (%s): reading its outputs", algo, done)
        return rd.read_parquet(f"policy/{algo}/train_log.parquet")
    # Checkpoints resume only the run they belong to: with other settings or inputs, the
    # checkpoints, TRL's checkpoints and the frontier snapshots of the old run are removed.
    started = out / "started.json"
    if is_main_process():  # the others wait until the folder is ready
        if out.exists() and not _matches(started, marker):
            stale = [out / d for d in ("checkpoints", "trl", "snapshots") if (out / d).exists()]
            if stale:
                log.info(
                    "%s: settings or inputs changed; removing %s", algo, [p.name for p in stale]
                )
            for d in stale:
                shutil.rmtree(d)
            done.unlink(missing_ok=True)
        out.mkdir(parents=True, exist_ok=True)
        # a process killed while writing leaves the temporary folders of `_atomic_dir` behind
        for folder in (out, out / "snapshots", out / "checkpoints"):
            for tmp_dir in folder.glob(".*") if folder.is_dir() else []:
                if tmp_dir.is_dir():
                    shutil.rmtree(tmp_dir, ignore_errors=True)
        with atomic_path(started) as tmp:
            tmp.write_text(json.dumps(marker, indent=2), encoding="utf-8")
    barrier()
    _seed_everything(cfg.run.seed)
    model, tok = load_start_policy(
        cfg.policy, cfg.rl.start_policy, rd.root, device=resolve_device(cfg.compute.device)
    )
    prompts = build_prompts(contexts, tok, cfg.rl.prompt_template, cfg.policy)
    log.info("%s: %d training prompts -> %s", algo, len(prompts), out)
    kw = dict(seed=cfg.run.seed, progress=progress, steps=steps)
    if algo == "ppo":
        frame = run_ppo(model, tok, prompts, contexts, reward_fn, cfg.rl, cfg.policy, out, **kw)
    elif algo in RLGF_ALGORITHMS:
        from rlxf_utils.rlgf import run_rlgf

        frame = run_rlgf(algo, cfg, rd.root, model, tok, prompts, contexts, reward_fn, out, **kw)
    elif algo in ILHF_ALGORITHMS:
        from rlxf_utils.ilhf import run_ilhf

        frame = run_ilhf(algo, cfg, rd.root, model, tok, prompts, contexts, reward_fn, out, **kw)
    else:
        frame = run_trl(
            algo, model, tok, prompts, contexts, reward_fn, cfg.rl, cfg.policy, out, **kw
        )
    if is_main_process():
        with atomic_path(done) as tmp:
            tmp.write_text(json.dumps(marker, indent=2), encoding="utf-8")
    return frame


def world_size() -> int:
    """Processes of this job (`accelerate launch` / torchrun set WORLD_SIZE; 1 otherwise)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def barrier() -> None:
    """Wait for every process of a multi-process job (nothing on one process)."""
    if world_size() > 1:
        process_state().wait_for_everyone()


def read_logs(run_dir: str | Path, algos: Sequence[str]) -> pd.DataFrame:
    """All algorithms' `policy/<algo>/train_log.parquet`, stacked."""
    rd = RunDir(run_dir)
    frames = [rd.read_parquet(f"policy/{a}/train_log.parquet", stage="notebook 03") for a in algos]
    return pd.concat(frames, ignore_index=True)


def load_named_policy(cfg: StudyConfig, run_dir: str | Path, name: str) -> tuple[Any, Any]:
    """A policy of this run by name: 'base' (zero-shot), 'sft' / 'sft_met' (LoRA on the base) or
    an RL algorithm (LoRA on the start policy; an ILHF ensemble with every particle loaded).
    Evaluation and the before/after samples use `alignment.PolicySet` instead (one load per set
    of weights, Thompson draws for ensembles)."""
    from rlxf_utils.models import load_policy, load_policy_with_adapter

    rd = RunDir(run_dir)
    if name == "base":
        return load_policy(cfg.policy)
    adapter = rd.require(f"policy/{name}/adapter", "notebook 03")
    if name in ("sft", "sft_met"):
        return load_policy_with_adapter(cfg.policy, adapter)
    from peft import PeftModel

    model, tok = load_start_policy(cfg.policy, cfg.rl.start_policy, rd.root)
    if is_ensemble(adapter):
        model, _ = load_particles(model, adapter, name)
    else:
        model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    return model, tok


def before_after_samples(
    cfg: StudyConfig,
    run_dir: str | Path,
    contexts: Sequence[Mapping[str, Any]],
    reward_fn: RewardFn,
    policies: Sequence[str],
    n: int = 4,
) -> pd.DataFrame:
    """Responses to the same `n` training prompts from each named policy, with their rewards.

    The policies come from evaluation's `alignment.PolicySet` on `compute.device`: the base
    weights (zero-shot and the supervised adapters) and the start policy's (the RL adapters)
    are each loaded once, and every policy samples with evaluation's settings and seed."""
    from rlxf_utils.alignment import PolicySet, sampling_kwargs
    from rlxf_utils.sft import SFT_POLICIES

    ctx = [dict(c) for c in contexts[:n]]
    algos = [p for p in policies if p != "base" and p not in SFT_POLICIES]
    pset = PolicySet(cfg, RunDir(run_dir), algos)
    prompts = build_prompts(ctx, pset.tok, cfg.rl.prompt_template, cfg.policy)
    gen_kw = sampling_kwargs(cfg, progress=False)
    rows: list[dict[str, Any]] = []
    for name in policies:
        texts = pset.generate(name, prompts, 1, name, gen_kw)["response"].tolist()
        scores = reward_fn(ctx, texts)
        for c, t, s in zip(ctx, texts, scores, strict=True):
            rows.append(
                {"policy": name, **{k: c[k] for k in _CTX_KEYS}, "response": t, "reward": float(s)}
            )
    return pd.DataFrame(rows)


def settings_table(run_dir: str | Path, algos: Sequence[str]) -> pd.DataFrame:
    """Each algorithm's `settings.json` side by side (rows: settings; columns: algorithms)."""
    rd = RunDir(run_dir)
    cols = {a: rd.read_json(f"policy/{a}/settings.json", stage="notebook 03") for a in algos}
    keys = list(dict.fromkeys(k for c in cols.values() for k in c if k != "algo"))
    return pd.DataFrame(
        [
            {"setting": k, **{algorithm_label(a): _cell(c.get(k)) for a, c in cols.items()}}
            for k in keys
        ]
    )


def _cell(v: Any) -> str:
    if v is None:
        return "·"
    return f"{v:g}" if isinstance(v, float) else str(v)


def training_curves_figure(logs: pd.DataFrame) -> Any:
    """Per step and algorithm: reward, KL to the start policy, PPO's critic (explained variance;
    dashed, in the same colour: the reward-model prior's alone, what the learned head adds is the
    gap) and the KL coefficient beta."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(15, 3.6))
    panels = (
        ("reward_mean", "mean reward  P(MET)", "Reward"),
        ("kl", "nats / response", "KL to the start policy"),
        ("explained_variance", "1 - Var(R - V) / Var(R)", "Critic: explained variance"),
        ("kl_coef", "beta", "KL coefficient"),
    )
    for ax, (col, ylabel, title) in zip(axes, panels, strict=True):
        for algo, g in logs.groupby("algo", sort=False):
            if g[col].notna().any():
                (line,) = ax.plot(g["step"], g[col], marker=".", label=algorithm_label(algo))
                prior = g.get(f"{col}_prior")
                if prior is not None and prior.notna().any():
                    ax.plot(g["step"], prior, ls="--", color=line.get_color(), lw=1,
                            label=f"{algorithm_label(algo)}: prior alone")  # fmt: skip
        ax.set(xlabel="step", ylabel=ylabel, title=title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[2].axhline(0, color="black", lw=0.8)
    fig.tight_layout()
    return fig


def summary_table(logs: pd.DataFrame, window: int = 3, alpha: float = 0.05) -> pd.DataFrame:
    """Per algorithm: reward at the start and end (mean of `window` steps), final KL, step time,
    and the critic's explained variance over the last third of the steps with a t interval at
    1 - alpha over those steps (so "positive" is read from the interval, not the mean)."""
    from scipy import stats

    rows = []
    for algo, g in logs.groupby("algo", sort=False):
        tail = g.tail(max(1, len(g) // 3))
        ev_tail = tail["explained_variance"].dropna().to_numpy(float)
        prior_tail = tail.get("explained_variance_prior", pd.Series(dtype=float)).dropna()
        if ev_tail.size > 1 and ev_tail.std(ddof=1) > 0:
            half = stats.t.ppf(1 - alpha / 2, ev_tail.size - 1) * stats.sem(ev_tail)
            ev_low, ev_high = ev_tail.mean() - half, ev_tail.mean() + half
        else:
            ev_low = ev_high = float(ev_tail.mean()) if ev_tail.size else float("nan")
        rows.append(
            {
                "algorithm": algorithm_label(algo),
                "steps": int(g["step"].max()),
                "reward_first": g["reward_mean"].head(window).mean(),
                "reward_last": g["reward_mean"].tail(window).mean(),
                "kl_last": g["kl"].tail(window).mean(),
                "entropy_last": g["entropy"].tail(window).mean(),
                "explained_variance_last_third": float(ev_tail.mean()) if ev_tail.size else np.nan,
                "explained_variance_low": ev_low,
                "explained_variance_high": ev_high,
                # the critic's prior alone (the reward model's prefix scores); NaN without one
                "explained_variance_prior_last_third": float(prior_tail.mean())
                if len(prior_tail)
                else np.nan,
                "beta_first": g["kl_coef"].iloc[0],
                "beta_last": g["kl_coef"].iloc[-1],
                "step_time_s": g["step_time_s"].median(),
                "tokens_per_s": g["tokens_per_s"].median(),
            }
        )
    return pd.DataFrame(rows)
