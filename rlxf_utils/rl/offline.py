"""Learning from experience without RL: KTO, DPO and rejection-sampling fine-tuning (RFT).

RLXF's claim is that RL against a reward model learned from experience aligns the policy with
what worked. These three ask whether the experience needs RL at all:

- `kto` (Ethayarajh et al., 2024; TRL's KTOTrainer): unpaired binary feedback. Each historical
  condition, in its context, was MET (desirable) or Non-MET (undesirable): no reward model and no
  pairs. The undesirable weight balances the outcomes (`offline.kto_undesirable_weight`).
- `dpo` (Rafailov et al., 2023; TRL's DPOTrainer): pairs of a MET and a Non-MET description of
  one context (`rl.history_pairs.history_pairs` with `mixed_only`: the mixed pairs ILHF (history) builds).
- `rft` (RAFT / ReST / expert iteration, one round; TRL's SFTTrainer): the start policy answers
  `offline.rft_candidates` times per training context, the reward model keeps its best, and
  the policy is fine-tuned on those responses (their own tokens, as generated): best-of-N
  distilled into a policy.

Like for like with RL: the same start policy (their reference: LoRA disabled), LoRA, learning
rate and constant schedule; the policy pool's rows and contexts (no evaluation country, no row a
reward model or the audit learns from: `data.contexts.eligible_rows`); and the same optimiser steps
of the same size: `offline.examples` sequences (default rl.steps x rl.batch_size, the responses
an RL algorithm trains on; DPO: half as many pairs, two sequences each) in minibatches of
rl.minibatch_size sequences for rl.update_epochs passes, rl.steps x rl.optimizer_steps_per_batch
optimiser steps in all; and RL's contexts in RL's order (`rl.experience`): RFT asks RL's context
visits, KTO and DPO take per visit the sequences RL samples there, walking on past RL's visits
only where a context holds fewer historical rows. RFT draws rft_candidates x examples responses
to choose from (4x RL's samples at the defaults): its sampling budget is best-of-N's, not RL's,
and `settings.json` says so.

TRL tokenises KTO's and DPO's text; `check_token_ids` verifies that what it built equals the
study's own prompt and target ids (`encode_prompts`, `sft.target_ids`) and raises otherwise.
The training log keeps one row per step (rl.optimizer_steps_per_batch optimiser steps, as an
RL step) with TRL's loss and implicit-reward statistics; every `rl.checkpoint_every` steps the
adapter is kept as a frontier snapshot; TRL's checkpoints resume an interrupted run.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from rlxf_utils.artifacts import RunDir, atomic_path
from rlxf_utils.config import OfflineConfig
from rlxf_utils.data.contexts import eligible_rows
from rlxf_utils.data.splits import load_holdout, load_splits
from rlxf_utils.models.generation import autocast, encode_prompts, generate
from rlxf_utils.models.loading import lora_config
from rlxf_utils.prompts import CONTEXT_FIELDS
from rlxf_utils.rl.core import KL_ESTIMATORS, LOG_COLUMNS
from rlxf_utils.rl.experience import context_visits, take_in_context_order
from rlxf_utils.rl.history_pairs import context_areas, context_prompts, history_pairs, pair_targets
from rlxf_utils.rl.sft import target_ids
from rlxf_utils.rl.trainer import TrainJob, write_settings
from rlxf_utils.rl.trl_runs import (
    TrainerHolder,
    bookkeeping_callbacks,
    finish_trl_run,
    resume_history,
    score_labelled_positions_only,
    trainer_arguments,
    trl_tokenizer,
)
from rlxf_utils.runtime import barrier, is_main_process, seed_everything, world_size

log = logging.getLogger(__name__)

#: The offline methods' own columns in the training log, beside `rl.core.LOG_COLUMNS`
OFFLINE_COLUMNS = ("pref_accuracy", "reward_margin", "logp_chosen", "logp_rejected")

#: TRL's logged metrics -> the log's columns (the first name TRL logs wins)
_METRICS = {
    "policy_loss": ("loss",),
    "pref_accuracy": ("rewards/accuracies",),
    "reward_margin": ("rewards/margins",),
    "logp_chosen": ("logps/chosen",),
    "logp_rejected": ("logps/rejected",),
    "entropy": ("entropy",),
}


class OfflineDataError(ValueError):
    """The data cannot give an offline method what it needs; the message says what is short."""


def n_examples(job: TrainJob) -> int:
    """Training sequences per method: `offline.examples`, or rl.steps x rl.batch_size."""
    cfg, _ = job.require_study()
    return cfg.offline.examples or job.n_steps * job.rl.batch_size


def total_steps(job: TrainJob) -> int:
    """Optimiser steps: as every RL algorithm's (steps x optimizer_steps_per_batch)."""
    return job.n_steps * job.rl.optimizer_steps_per_batch


# -- the data of each method ---------------------------------------------------------------------
def training_rows(cfg: Any, run_dir: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The historical rows the RL stage may see (every outcome) and the contexts table."""
    rd = RunDir(run_dir)
    labelled, _ = load_splits(rd)
    ctx = rd.read_parquet("data/contexts.parquet", stage="notebook 01 (data exploration)")
    return eligible_rows(labelled, load_holdout(rd), "all"), ctx


def kto_examples(job: TrainJob) -> tuple[pd.DataFrame, list[str], list[tuple[list[int], list[int]]]]:  # fmt: skip
    """`n_examples` historical rows (distinct descriptions of a context whose target fits
    `offline.max_tokens`), taken in RL's context order, `rl.num_generations` a visit
    (`experience.take_in_context_order`), then shuffled (seeded), with `label` (MET:
    desirable); their formatted prompts; and their (prompt, target) ids."""
    cfg, run_dir = job.require_study()
    rows, ctx = training_rows(cfg, run_dir)
    text = rows["description"].astype(str).map(lambda t: " ".join(t.split()))
    rows = rows.assign(text=text).drop_duplicates([*CONTEXT_FIELDS, "text", "y"])
    rows = rows.reset_index(drop=True)
    targets = target_ids(rows["text"], job.tokenizer, job.model)
    fits = np.flatnonzero([len(t) <= cfg.offline.max_tokens for t in targets])
    n = n_examples(job)
    take = fits[take_in_context_order(rows.iloc[fits], job.contexts, job.seed, job.rl.num_generations, n)]  # fmt: skip
    take = take[np.random.default_rng(job.seed).permutation(len(take))]
    if len(take) < n:
        raise OfflineDataError(f"kto: {len(take)} historical rows of the training contexts fit "
                               f"offline.max_tokens={cfg.offline.max_tokens}, {n} wanted (offline.examples)")  # fmt: skip
    rows = rows.iloc[take].reset_index(drop=True)
    targets = [targets[i] for i in take]
    prompts = context_prompts(rows, context_areas(ctx), job.tokenizer, cfg)
    p_ids = encode_prompts(job.tokenizer, prompts)["input_ids"]
    frame = rows[[*CONTEXT_FIELDS, "row_id", "text", "y"]].assign(label=rows["y"].astype(bool))
    return frame, prompts, [(list(p), t) for p, t in zip(p_ids, targets, strict=True)]


def dpo_pairs(job: TrainJob) -> tuple[pd.DataFrame, list[str], list[tuple[list[int], list[int], list[int]]]]:  # fmt: skip
    """`n_examples / 2` pairs of a MET (chosen) and a Non-MET (rejected) description of one
    context; their formatted prompts; their (prompt, chosen, rejected) ids."""
    cfg, run_dir = job.require_study()
    oc = cfg.offline
    rows, ctx = training_rows(cfg, run_dir)
    n = n_examples(job) // 2
    # every context's pairs (at most pairs_per_context each) that fit, then n of those in RL's
    # context order, half of rl.num_generations a visit (two sequences each)
    pairs = history_pairs(rows, len(rows) ** 2, oc.pairs_per_context, job.seed, mixed_only=True)
    pairs, a_ids, b_ids = pair_targets(pairs, job.tokenizer, job.model, oc.max_tokens, len(pairs), job.seed)  # fmt: skip
    take = take_in_context_order(pairs, job.contexts, job.seed, max(1, job.rl.num_generations // 2), n)  # fmt: skip
    pairs = pairs.iloc[take].reset_index(drop=True)
    a_ids, b_ids = [a_ids[i] for i in take], [b_ids[i] for i in take]
    if len(pairs) < n:
        raise OfflineDataError(f"dpo: {len(pairs)} MET/Non-MET pairs of one context fit "
                               f"offline.max_tokens={oc.max_tokens}, {n} wanted (offline.examples "
                               "/ 2; raise offline.pairs_per_context)")  # fmt: skip
    prompts = context_prompts(pairs, context_areas(ctx), job.tokenizer, cfg)
    p_ids = encode_prompts(job.tokenizer, prompts)["input_ids"]
    a_met = (pairs["y_a"] > pairs["y_b"]).to_numpy()
    chosen = [a if m else b for a, b, m in zip(a_ids, b_ids, a_met, strict=True)]
    rejected = [b if m else a for a, b, m in zip(a_ids, b_ids, a_met, strict=True)]
    frame = pairs.assign(
        chosen=np.where(a_met, pairs["text_a"], pairs["text_b"]),
        rejected=np.where(a_met, pairs["text_b"], pairs["text_a"]),
    )[[*CONTEXT_FIELDS, "row_a", "row_b", "chosen", "rejected"]]
    ids = [(list(p), c, r) for p, c, r in zip(p_ids, chosen, rejected, strict=True)]
    return frame, prompts, ids


def rft_pool(job: TrainJob, batch_size: int | str = 64) -> pd.DataFrame:
    """`rft_candidates` responses of the start policy (adapters absent: the model as loaded) to
    each of `n_examples` training prompts (RL's context visits, `experience.context_visits`, each
    asked rl.num_generations times), scored by the reward model; `kept` marks each prompt's best
    (first on ties).

    Sampled once, by the main process, into `policy/rft/pool.parquet`; every process (and a
    resumed run) reads it back: it is what the run trains on."""
    path = job.output_dir / "pool.parquet"
    if not path.is_file() and is_main_process():
        pool = _sample_pool(job, batch_size)
        job.output_dir.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            pool.to_parquet(tmp, index=False)
    barrier()
    return pd.read_parquet(path)


def _sample_pool(job: TrainJob, batch_size: int | str) -> pd.DataFrame:
    cfg, _ = job.require_study()
    if job.reward_fn is None:
        raise ValueError("rft needs the reward model's reward_fn (it keeps the best response)")
    n, k, rl = n_examples(job), cfg.offline.rft_candidates, job.rl
    # RL's context visits, each asked rl.num_generations times: RL's contexts and sequences
    visits = list(itertools.islice(context_visits(len(job.prompts), job.seed), -(-n // rl.num_generations)))  # fmt: skip
    order = np.repeat(np.asarray(visits, dtype=np.int64), rl.num_generations)[:n]
    prompts = [job.prompts[i] for i in order]
    with autocast(job.policy.autocast, next(job.model.parameters()).device):
        pool = generate(job.model, job.tokenizer, prompts, k, max_new_tokens=rl.max_new_tokens,
                        temperature=rl.temperature, top_p=rl.top_p,
                        postprocess=rl.response_postprocess, seed=job.seed, batch_size=batch_size,
                        desc="rft candidates", progress=job.progress, sampler=job.policy.sampler,
                        merge=job.policy.merge_lora)  # fmt: skip
    pool["context_id"] = order[pool["prompt_id"].to_numpy()]
    contexts = [dict(job.contexts[i]) for i in pool["context_id"]]
    for key in CONTEXT_FIELDS:
        pool[key] = [str(c[key]) for c in contexts]
    pool["reward"] = np.asarray(job.reward_fn(contexts, pool["response"].tolist()), dtype=float)
    pool["kept"] = False
    pool.loc[pool.groupby("prompt_id")["reward"].idxmax().to_numpy(), "kept"] = True
    return pool


# -- TRL ---------------------------------------------------------------------------------------
def check_token_ids(built: Any, expected: Sequence[Sequence[Sequence[int]]], columns: Sequence[str], algo: str) -> None:  # fmt: skip
    """Raise when TRL's tokenised dataset `built` differs from the study's ids `expected` (one
    tuple of id lists per example, in `columns`' order)."""
    for i, want in enumerate(expected):
        got = [list(built[i][c]) for c in columns]
        if got != [list(w) for w in want]:
            bad = next(c for c, g, w in zip(columns, got, want, strict=True) if g != list(w))
            raise ValueError(
                f"{algo}: TRL tokenised example {i} differently from the study ({bad}: {got[columns.index(bad)][:12]}... "
                f"vs {list(want[columns.index(bad)])[:12]}...); the policy would train on other tokens than it is evaluated on"
            )  # fmt: skip


def _log_callback(algo: str, history: list[dict[str, Any]], per_batch: int) -> Any:
    """One log row per step (`per_batch` optimiser steps): the mean of TRL's logs over its steps."""
    from transformers import TrainerCallback

    class _LogCallback(TrainerCallback):
        def __init__(self) -> None:
            self.rows: list[dict[str, float]] = []
            self.last = time.perf_counter()

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.last = time.perf_counter()

        def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kw: Any) -> None:  # fmt: skip
            if not logs or "loss" not in logs:
                return
            self.rows.append({col: next((float(logs[n]) for n in names if n in logs), np.nan)
                              for col, names in _METRICS.items()})  # fmt: skip
            step, rest = divmod(int(state.global_step), per_batch)
            if rest:
                return
            mean = pd.DataFrame(self.rows).mean().to_dict()
            now = time.perf_counter()  # the step's optimiser steps (Trainer logs after each)
            self.rows, seconds, self.last = [], now - self.last, now
            history.append({"algo": algo, "step": step, "kl_estimator": KL_ESTIMATORS["offline"],
                            **{c: np.nan for c in LOG_COLUMNS if c not in ("algo", "step", "kl_estimator")},
                            **mean, "step_time_s": seconds, "processes": world_size()})  # fmt: skip
            log.info("%s step %d: loss %.4f (%.1f s)", algo, step, mean["policy_loss"], seconds)

    return _LogCallback()


def offline_dataset(job: TrainJob) -> tuple[pd.DataFrame, list[dict[str, Any]], list[Any], dict[str, Any]]:  # fmt: skip
    """What `job.algo` trains on, from the run: the examples as a table (`data.parquet`), TRL's
    dataset rows, the study's token ids TRL must reproduce (KTO, DPO) and the settings it adds."""
    cfg, _ = job.require_study()
    oc = cfg.offline
    if job.algo == "kto":
        frame, prompts, ids = kto_examples(job)
        rows = [{"prompt": p, "completion": t, "label": bool(y)}
                for p, t, y in zip(prompts, frame["text"], frame["label"], strict=True)]  # fmt: skip
        return frame, rows, ids, {}
    if job.algo == "dpo":
        frame, prompts, ids = dpo_pairs(job)
        rows = [{"prompt": p, "chosen": c, "rejected": r}
                for p, c, r in zip(prompts, frame["chosen"], frame["rejected"], strict=True)]  # fmt: skip
        ctx = int(frame[list(CONTEXT_FIELDS)].drop_duplicates().shape[0])
        return frame, rows, ids, {"pairs": len(frame), "contexts": ctx}
    if job.algo == "rft":
        pool = rft_pool(job, cfg.evaluation.batch_size)
        kept = pool[pool["kept"]].sort_values("prompt_id").reset_index(drop=True)
        rows = [{"input_ids": list(p) + list(r), "completion_mask": [0] * len(p) + [1] * len(r)}
                for p, r in zip(kept["prompt_ids"], kept["response_ids"], strict=True)]  # fmt: skip
        extra = {"responses_per_prompt": oc.rft_candidates, "prompts": len(kept),
                 "max_new_tokens": job.rl.max_new_tokens, "temperature": job.rl.temperature,
                 "responses_sampled": len(pool), "kept_reward_mean": float(kept["reward"].mean()),
                 "candidate_reward_mean": float(pool["reward"].mean()),
                 "kept_finished_share": float(kept["finished"].mean())}  # fmt: skip
        return kept.drop(columns=["prompt_ids", "response_ids"]), rows, [], extra
    raise ValueError(
        f"rl.algorithm entry {job.algo!r}: the offline methods are 'kto', 'dpo', 'rft'"
    )


def run_offline(job: TrainJob) -> pd.DataFrame:
    """KTO, DPO or RFT from the start policy on the run's data (`offline_dataset`); resumes;
    returns the log."""
    cfg, _ = job.require_study()
    frame, rows, ids, extra = offline_dataset(job)  # its draws are seeded by job.seed
    job.output_dir.mkdir(parents=True, exist_ok=True)
    with atomic_path(job.output_dir / "data.parquet") as tmp:
        frame.to_parquet(tmp, index=False)
    return train_offline(job, cfg.offline, rows, ids, extra)


def train_offline(
    job: TrainJob,
    oc: OfflineConfig,
    rows: Sequence[dict[str, Any]],
    expected_ids: Sequence[Any] = (),
    extra: dict[str, Any] | None = None,
) -> pd.DataFrame:
    """`job.algo` (kto, dpo or rft) in TRL's trainer on `rows` (TRL's dataset format: KTO
    prompt/completion/label, DPO prompt/chosen/rejected, RFT input_ids/completion_mask), LoRA on
    `job.model`, which is the reference; `expected_ids`: the token ids TRL must build (checked).
    rl.minibatch_size sequences per optimiser step (DPO: half as many pairs), rl.update_epochs
    passes at most, rl.steps x rl.optimizer_steps_per_batch optimiser steps. Resumes from TRL's
    checkpoint; writes the adapter, log, samples and settings; returns the log."""
    os.environ.setdefault("WANDB_DISABLED", "true")
    from datasets import Dataset

    algo, rl, out = job.algo, job.rl, job.output_dir
    seed_everything(job.seed)
    score_labelled_positions_only()
    per_batch, steps, n = rl.optimizer_steps_per_batch, job.n_steps, world_size()
    common = dict(num_train_epochs=rl.update_epochs, max_length=None,
                  **trainer_arguments(job, total_steps(job), rl.checkpoint_every * per_batch))  # fmt: skip
    extra = dict(extra or {})
    if algo == "kto":
        from trl import KTOConfig as Config
        from trl import KTOTrainer as Trainer

        n_d = sum(bool(r["label"]) for r in rows)
        n_u = len(rows) - n_d
        if n_d == 0 or n_u == 0:
            raise OfflineDataError(f"kto: {n_d} MET and {n_u} Non-MET examples; it needs both")
        und = oc.kto_undesirable_weight or n_d * oc.kto_desirable_weight / n_u
        # TRL pairs each completion with a neighbour's prompt for KTO's reference point, in a
        # fixed order: the rows come shuffled (seeded), read sequentially
        args = Config(per_device_train_batch_size=rl.minibatch_size // n, beta=oc.kto_beta,
                      desirable_weight=oc.kto_desirable_weight, undesirable_weight=und,
                      train_sampling_strategy="sequential", **common)  # fmt: skip
        columns: tuple[str, ...] = ("prompt_ids", "completion_ids")
        extra.update(beta=oc.kto_beta, desirable_weight=oc.kto_desirable_weight,
                     undesirable_weight=und, desirable_examples=n_d, undesirable_examples=n_u,
                     loss="KTO; reference point: KL on mismatched prompt/completion pairs of the batch")  # fmt: skip
    elif algo == "dpo":
        from trl import DPOConfig as Config
        from trl import DPOTrainer as Trainer

        args = Config(per_device_train_batch_size=rl.minibatch_size // 2 // n, beta=oc.dpo_beta,
                      **common)  # fmt: skip
        columns = ("prompt_ids", "chosen_ids", "rejected_ids")
        kinds = args.loss_type if isinstance(args.loss_type, list | tuple) else [args.loss_type]
        extra.update(beta=oc.dpo_beta, loss=f"DPO ({', '.join(map(str, kinds))})")
    elif algo == "rft":
        from trl import SFTConfig as Config
        from trl import SFTTrainer as Trainer

        args = Config(per_device_train_batch_size=rl.minibatch_size // n,
                      completion_only_loss=True, **common)  # fmt: skip
        columns = ()
        extra.update(loss="NLL of the kept responses' tokens (SFT)")
    else:
        raise ValueError(f"rl.algorithm entry {algo!r}: train_offline takes 'kto', 'dpo' or 'rft'")
    history: list[dict[str, Any]] = []
    resume = resume_history(out, history, algo)
    holder = TrainerHolder()
    trainer = Trainer(
        model=job.model, args=args, train_dataset=Dataset.from_list(list(rows)),
        processing_class=trl_tokenizer(job.tokenizer, [r["prompt"] for r in rows[:4]])
        if columns else job.tokenizer,
        peft_config=lora_config(job.policy.lora),
        callbacks=[_log_callback(algo, history, per_batch),
                   *bookkeeping_callbacks(holder, history, per_batch, steps, rl.checkpoint_every, out)],
    )  # fmt: skip
    holder.trainer = trainer
    if columns:
        check_token_ids(trainer.train_dataset, expected_ids, columns, algo)
    write_settings(out, algo, rl, {
        "kl_penalty": "none in training (the reference is the start policy)" if algo == "rft"
        else f"implicit, beta = {extra['beta']} (reference: the start policy, LoRA disabled)",
        "advantage": "none: the reward model chooses the training responses" if algo == "rft"
        else "none (no reward model in training)",
        "training_sequences": len(rows) * (2 if algo == "dpo" else 1),
        "optimizer_steps": total_steps(job), "prompts_per_step": None, "responses_per_prompt": None,
        "responses_per_step": rl.minibatch_size * per_batch, "max_new_tokens": None,
        "temperature": None, "kl_coef_initial": None, **extra,
    })  # fmt: skip
    with autocast(job.policy.autocast, trainer.accelerator.device):
        trainer.train(resume_from_checkpoint=str(resume) if resume is not None else None)
    log_frame = pd.DataFrame(history, columns=[*LOG_COLUMNS, *OFFLINE_COLUMNS])
    finish_trl_run(trainer, job, log_frame)
    return log_frame
