"""GRPO and RLOO through TRL, like for like with PPO: the same prompt schedule, reward, LoRA,
sampling, updates per batch, steps, optimiser and KL control (`beta_control`); TRL's checkpoints resume and the snapshots
feed the frontier."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from rlxf_utils.artifacts import atomic_dir, atomic_path, to_jsonable, write_jsonl
from rlxf_utils.models.generation import (
    autocast,
    encode_prompts,
    postprocess_response,
    sample_responses,
)
from rlxf_utils.models.loading import lora_config
from rlxf_utils.prompts import CONTEXT_FIELDS
from rlxf_utils.rl.core import (
    KL_ESTIMATORS,
    LOG_COLUMNS,
    AdaptiveKLController,
    FixedKLController,
    RewardFn,
    adapter_state,
    kl_controller,
    prompt_schedule,
)
from rlxf_utils.rl.optim import trainer_optimizer_arguments
from rlxf_utils.rl.trainer import TrainJob, write_settings
from rlxf_utils.runtime import seed_everything, world_size

log = logging.getLogger(__name__)


def trl_reward_function(reward_fn: RewardFn, postprocess: str) -> Callable[..., list[float]]:
    """Wrap `reward_fn` as a TRL reward function (context columns arrive as keyword lists)."""

    def reward_model(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        texts = [postprocess_response(t, postprocess) for t in texts]
        contexts = [
            {k: kwargs[k][i] for k in CONTEXT_FIELDS if k in kwargs} for i in range(len(texts))
        ]
        return [float(x) for x in reward_fn(contexts, texts)]

    return reward_model


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


def kl_per_response(logs: dict[str, Any]) -> float:
    """The step's mean KL to the reference per response, in nats, from TRL's logged per-token
    mean (`kl`) and mean response length: PPO's quantity (its controller's input and log's `kl`).
    RLOO's `kl` is k1 summed over the generation batch's tokens over their count, so this is
    exactly the batch's mean summed log-ratio; GRPO's is k3 over the step's first minibatch (the
    only one its log of the generation step holds), an unbiased estimate of the same KL."""
    kl_tok = logs.get("kl")
    length = logs.get("completions/mean_length")
    if kl_tok is None or length is None or not np.isfinite(kl_tok) or not np.isfinite(length):
        return float("nan")
    return float(kl_tok) * float(length)


def beta_control(
    ctl: AdaptiveKLController | FixedKLController, holder: TrainerHolder, per_batch: int
) -> Any:
    """A TrainerCallback that puts TRL's β (`trainer.beta`: GRPO's KL term in the loss, RLOO's
    KL penalty in the reward) under the controller PPO uses (`core.kl_controller`): after the
    step that generated a batch (its log holds `reward`), the controller is updated with that
    batch's KL per response (`kl_per_response`); at the end of the batch's optimiser steps the
    new β goes to the trainer, so each batch is trained with one β, as in PPO."""
    from transformers import TrainerCallback

    class _BetaControl(TrainerCallback):
        def on_log(
            self, args: Any, state: Any, control: Any, logs: dict | None = None, **kw: Any
        ) -> None:
            if not logs or "reward" not in logs:
                return
            kl = kl_per_response(logs)
            if np.isfinite(kl):
                ctl.update(kl)

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if int(state.global_step) % per_batch == 0 and holder.trainer is not None:
                holder.trainer.beta = ctl.value

    return _BetaControl()


def run_trl(job: TrainJob) -> pd.DataFrame:
    """GRPO or RLOO through TRL with the same prompts, reward, LoRA, sampling, updates, optimiser
    and KL control as PPO."""
    os.environ.setdefault("WANDB_DISABLED", "true")
    from datasets import Dataset
    from transformers import TrainerCallback

    algo = job.algo
    if algo == "grpo":
        from trl import GRPOConfig as Config
        from trl import GRPOTrainer as Trainer
    elif algo == "rloo":
        from trl import RLOOConfig as Config
        from trl import RLOOTrainer as Trainer
    else:
        raise ValueError(f"rl.algorithm entry {algo!r}: run_trl takes 'grpo' or 'rloo'")

    base_model, tokenizer = job.model, job.tokenizer
    prompts, contexts, reward_fn = job.prompts, job.contexts, job.reward_fn
    rl, policy, output_dir, seed = job.rl, job.policy, job.output_dir, job.seed
    steps, generation_kwargs = job.n_steps, job.generation_kwargs
    seed_everything(seed)
    score_labelled_positions_only()
    # The dataset is PPO's prompt schedule laid out step by step and read unshuffled: every
    # algorithm answers the same prompts at the same step.
    schedule = prompt_schedule(len(prompts), steps, rl.prompts_per_step, seed)
    rows = [
        {"prompt": prompts[i], **{k: str(contexts[i][k]) for k in CONTEXT_FIELDS}}
        for idx in schedule
        for i in idx
    ]
    dataset = Dataset.from_list(rows)
    per_batch = rl.optimizer_steps_per_batch
    args = Config(
        # completions per optimiser step, over all processes (as PPO's minibatch)
        per_device_train_batch_size=rl.minibatch_size // world_size(),
        steps_per_generation=rl.batch_size // rl.minibatch_size,  # generation batch = rl.batch_size
        shuffle_dataset=False,
        num_generations=rl.num_generations,
        max_completion_length=rl.max_new_tokens,
        temperature=rl.temperature,
        top_p=rl.top_p,
        top_k=0,
        generation_kwargs=dict(generation_kwargs) if generation_kwargs else None,
        beta=rl.kl_coef,  # KL to the adapter-disabled reference, as in PPO; then `beta_control`
        epsilon=rl.clip_range,
        num_iterations=rl.update_epochs,  # passes over each generation batch, as PPO's epochs
        remove_unused_columns=False,  # the context columns reach the reward function
        **({"loss_type": rl.grpo_loss_type} if algo == "grpo" else {}),  # named, not TRL's default
        **trainer_arguments(job, max_steps=steps * per_batch, save_steps=rl.checkpoint_every * per_batch),
    )  # fmt: skip
    history: list[dict[str, Any]] = []
    kl_ctl = kl_controller(rl)

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
            kl = kl_per_response(logs)
            gen_t, gen_n = self.timer.take() if self.timer else (np.nan, 0)
            history.append(  # noqa: B023 (the callback lives only inside this call)
                {
                    "algo": algo,
                    "step": -(-int(state.global_step) // per_batch),  # generation batches
                    "reward_mean": logs.get("reward", np.nan),
                    "reward_std": logs.get("reward_std", np.nan),
                    "reward_learner": logs.get("reward", np.nan),  # every token is its own
                    "kl": kl,
                    "kl_k3": kl,
                    "kl_all_tokens": kl,
                    "kl_estimator": KL_ESTIMATORS[algo],
                    "kl_per_token": kl_tok,
                    "kl_coef": kl_ctl.value,  # after this step's update, as PPO logs it
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

    resume = resume_history(output_dir, history, algo)
    if history:  # a resumed run's β: the controller's value after its last logged step
        kl_ctl.value = float(history[-1]["kl_coef"])
    cb = _LogCallback()
    holder = TrainerHolder()
    trainer = Trainer(
        model=base_model,
        reward_funcs=trl_reward_function(reward_fn, rl.response_postprocess),
        args=args,
        train_dataset=dataset,
        processing_class=trl_tokenizer(tokenizer, prompts),
        peft_config=lora_config(policy.lora),
        callbacks=[beta_control(kl_ctl, holder, per_batch), cb, *bookkeeping_callbacks(holder, history, per_batch, steps, rl.checkpoint_every, output_dir)],
    )  # fmt: skip
    holder.trainer = trainer
    trainer.beta = kl_ctl.value
    beta = "beta adaptive" if rl.adaptive_kl else "fixed beta"
    write_settings(output_dir, algo, rl, {
        "kl_penalty": f"k3 estimator in the loss ({beta})" if algo == "grpo"
        else f"sequence log-ratio to the reference subtracted from the reward ({beta})",
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
    finish_trl_run(trainer, job, frame)
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
    atomic_dir(
        output_dir / "snapshots" / f"step_{step:06d}",
        lambda d: save_file(state, str(d / "adapter_model.safetensors")),
    )


# -- what every run in TRL's Trainer shares (GRPO, RLOO and the offline methods, `rl.offline`) ----
def score_labelled_positions_only() -> bool:
    """Make TRL's fused LM head score only the labelled positions on the CPU too; returns whether
    it could (idempotent).

    Every TRL trainer of the study (GRPO, RLOO, KTO, DPO, SFT for RFT) computes per-token
    log-probabilities with TRL's fused, chunked LM head (`trl.trainer.utils.add_fused_lm_head`).
    On Triton devices it scores only the positions with a label; elsewhere it scores every
    position, prompt and padding included, so that a compiled backend (TRL names Neuron) keeps
    its tile shapes. Eager CPU execution compiles nothing, and on the CPU the head runs its
    gradient GEMMs in float32 over all 49k vocabulary rows: scoring the ~70% of positions that
    are prompt or padding, only to mask them out, was half of a TRL training step. The labelled
    positions' log-probabilities are the same numbers up to float32 summation order
    (tests/test_rl.py; on the real policy at most 1.9e-6 nats per token apart), and a study step
    of 4 optimiser steps ran x1.57 (KTO), x1.61 (DPO) and x1.55 (RFT) faster
    (bench/trl_steps.py, 2026-11-26). GRPO and RLOO use the same head.

    This rebinds `_use_triton` in `trl.trainer.utils` only, where it chooses the compact layout;
    the kernels keep their own (torch ops on the CPU). With a TRL whose module lacks it, nothing
    changes (a warning says so)."""
    import trl.trainer.utils as trl_utils

    current = getattr(trl_utils, "_use_triton", None)
    if current is None:
        log.warning("trl.trainer.utils has no _use_triton: TRL scores every position on the CPU")
        return False
    if getattr(current, "_rlxf_compact_on_cpu", False):
        return True

    def use_compact_layout(device: torch.device) -> bool:
        return device.type == "cpu" or current(device)

    use_compact_layout._rlxf_compact_on_cpu = True  # type: ignore[attr-defined]
    use_compact_layout.__wrapped__ = current  # type: ignore[attr-defined]
    trl_utils._use_triton = use_compact_layout
    return True


def trainer_arguments(job: TrainJob, max_steps: int, save_steps: int) -> dict[str, Any]:
    """The TrainingArguments every TRL run of the study shares: LoRA's learning rate, the study's
    optimiser (`rl.optimizer`: AdamW's settings, schedule, clipping), `max_steps` optimiser steps, checkpoints every `save_steps` (the last
    kept; an interrupted run resumes there), the run's seed, CPU or CUDA, and the autocast and
    gradient checkpointing of PPO."""
    rl, policy = job.rl, job.policy
    return dict(
        output_dir=str(job.output_dir / "trl"),
        gradient_accumulation_steps=1,
        learning_rate=rl.learning_rate,
        max_steps=max_steps,  # TRL counts optimiser steps
        logging_steps=1,
        # Trainer checkpoints (adapter, optimiser, RNG, data position) every `save_steps`, the
        # last one kept: an interrupted run resumes there (with its log rows, saved beside each
        # checkpoint by `HistoryCallback`)
        save_strategy="steps",
        save_steps=save_steps,
        save_total_limit=1,
        report_to="none",
        push_to_hub=False,
        seed=job.seed,
        data_seed=job.seed,
        disable_tqdm=not job.progress,
        dataloader_num_workers=0,
        use_cpu=not torch.cuda.is_available(),
        bf16=policy.dtype == "bfloat16" and torch.cuda.is_available(),  # autocast: see train()
        **trainer_optimizer_arguments(rl.optimizer),  # the study's one optimiser, ours too
        # TRL defaults to True; PPO matches (transformers 5's name: `gradient_checkpointing` warns)
        activation_checkpointing=rl.gradient_checkpointing,
    )


class TrainerHolder:
    """The Trainer, set once it exists (the callbacks are built before it)."""

    trainer: Any = None


def bookkeeping_callbacks(
    holder: TrainerHolder,
    history: list[dict[str, Any]],
    per_batch: int,
    steps: int,
    checkpoint_every: int,
    output_dir: Path,
) -> list[Any]:
    """A snapshot callback (at the end of each batch of `per_batch` optimiser steps: its wall
    time into the log row of that step; every `checkpoint_every` batches the adapter, for the
    reward-KL frontier) and a history callback (the log rows so far, written into each
    checkpoint Trainer saves)."""
    from transformers import TrainerCallback

    class _SnapshotCallback(TrainerCallback):
        last = time.perf_counter()

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.last = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            step, rest = divmod(int(state.global_step), per_batch)
            if rest:
                return
            now = time.perf_counter()
            if history and history[-1]["step"] == step:
                history[-1]["step_time_s"] = now - self.last
            self.last = now
            if step % checkpoint_every == 0 and step < steps:
                _save_snapshot(holder.trainer, output_dir, step)

    class _HistoryCallback(TrainerCallback):
        def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            ckpt = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            if ckpt.is_dir() and state.is_world_process_zero:
                with atomic_path(ckpt / HISTORY_FILE) as tmp:
                    tmp.write_text(json.dumps(to_jsonable(history)), encoding="utf-8")

    return [_SnapshotCallback(), _HistoryCallback()]


def resume_history(output_dir: Path, history: list[dict[str, Any]], algo: str) -> Path | None:
    """The newest complete Trainer checkpoint under `output_dir/trl` (None: train afresh), its
    log rows appended to `history`."""
    resume = _latest_trl_checkpoint(output_dir / "trl")
    if resume is not None:
        history.extend(json.loads((resume / HISTORY_FILE).read_text(encoding="utf-8")))
        log.info("%s: resuming from %s (%d rows logged)", algo, resume, len(history))
    return resume


def finish_trl_run(trainer: Any, job: TrainJob, frame: pd.DataFrame) -> None:
    """The final adapter, the log and a few scored samples of training prompts, each atomically
    (main process)."""
    if not trainer.accelerator.is_main_process:
        return
    peft_model = trainer.accelerator.unwrap_model(trainer.model)
    if "generate" in vars(peft_model):
        del peft_model.generate  # drop GRPO's timer before saving
    out, rl, prompts, contexts = job.output_dir, job.rl, job.prompts, job.contexts
    atomic_dir(out / "adapter", lambda d: peft_model.save_pretrained(d))
    with atomic_path(out / "train_log.parquet") as tmp:
        frame.to_parquet(tmp, index=False)
    n = min(4, len(prompts))
    with autocast(job.policy.autocast, trainer.accelerator.device):
        texts = sample_responses(peft_model, job.tokenizer, prompts[:n], rl, seed=job.seed)
    scores = (
        job.reward_fn([dict(c) for c in contexts[:n]], texts)
        if job.reward_fn is not None
        else [np.nan] * n
    )
    samples = [
        {"step": job.n_steps, **{k: contexts[i][k] for k in CONTEXT_FIELDS}, "response": texts[i], "reward": float(scores[i])}
        for i in range(n)
    ]  # fmt: skip
    write_jsonl(out / "samples.jsonl", samples, ensure_ascii=True)
