"""Domain fine-tuning (SFT) of the policy before RL: a prompt built from a context -> its description.

The paper's Table 3 compares an LLM before and after "fine-tuning with domain specific
information"; InstructGPT-style pipelines start RL from such a supervised policy. Two LoRA
adapters are trained on the same base model:

* `sft`: every outcome (MET and Non-MET): the domain policy, the start of every RL algorithm and
  its KL reference;
* `sft_met`: MET rows only: supervised learning from experience, the baseline RL must beat.

Data: only the policy pool's rows (`data.contexts.eligible_rows`: rows of training countries that
no reward model, audit or reference holds; `data.splits.carve_policy_pool`).
The prompt is exactly the RL prompt (`models.generation.build_prompts`, tokenised by `encode_prompts`); the
target is the historical description followed by the end token; the loss is on the target
only. A lean loop (length-sorted batches, left padding so only the tail's logits are computed,
bf16 autocast when `policy.autocast` says so) rather than TRL's `SFTTrainer`: see `bench/rl.py`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from rlxf_utils.algorithms import SFT_POLICIES
from rlxf_utils.artifacts import RunDir, atomic_dir
from rlxf_utils.config import OptimizerConfig, SFTConfig, StudyConfig
from rlxf_utils.data.contexts import eligible_rows
from rlxf_utils.data.splits import load_holdout, load_splits
from rlxf_utils.freshness import input_hashes
from rlxf_utils.models.generation import autocast, build_prompts, encode_prompts, eos_ids
from rlxf_utils.models.loading import apply_lora, load_policy
from rlxf_utils.prompts import CONTEXT_FIELDS
from rlxf_utils.rl.optim import adamw
from rlxf_utils.runtime import resolve_device, seed_everything

log = logging.getLogger(__name__)


__all__ = [
    "SFT_POLICIES",
    "SFTExample",
    "build_examples",
    "response_loss",
    "response_token_nll",
    "target_ids",
    "run_sft_stage",
    "train_sft",
]


log = logging.getLogger(__name__)


@dataclass
class SFTExample:
    """One training pair as token ids: the formatted prompt and the target (ending in EOS)."""

    prompt_ids: list[int]
    response_ids: list[int]


def target_ids(descriptions: Iterable[Any], tokenizer: Any, model: Any) -> list[list[int]]:
    """SFT's target for each description: its tokens (whitespace normalised, no special tokens)
    followed by the end token (the tokenizer's EOS, else the lowest of `models.generation.eos_ids`)."""
    texts = [" ".join(str(t).split()) for t in descriptions]
    if not texts:
        return []
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    end = int(eos) if eos is not None else min(eos_ids(model, tokenizer))
    return [[*r, end] for r in ids]


def build_examples(
    rows: pd.DataFrame,
    tokenizer: Any,
    model: Any,
    template: str,
    policy_cfg: Any,
    max_response_tokens: int,
) -> tuple[list[SFTExample], int]:
    """Token ids of (RL prompt of the row's context, description + end token); and how many
    rows were left out because their target is longer than `max_response_tokens`."""
    prompts = build_prompts(rows.to_dict("records"), tokenizer, template, policy_cfg)
    p_ids = encode_prompts(tokenizer, prompts)["input_ids"]
    out, dropped = [], 0
    for p, target in zip(p_ids, target_ids(rows["description"], tokenizer, model), strict=True):
        if len(target) > max_response_tokens:
            dropped += 1
            continue
        out.append(SFTExample(list(p), target))
    return out, dropped


def _batches(
    examples: Sequence[SFTExample], batch_size: int, rng: np.random.Generator
) -> list[list[int]]:
    """Length-sorted batches (little padding) in shuffled order."""
    order = sorted(
        range(len(examples)),
        key=lambda i: len(examples[i].prompt_ids) + len(examples[i].response_ids),
    )
    chunks = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    rng.shuffle(chunks)
    return chunks


def collate(examples: Sequence[SFTExample], pad_id: int) -> dict[str, torch.Tensor]:
    """Left-padded prompt + target; `target_mask` marks target tokens; `n_tail` covers all targets."""
    seqs = [e.prompt_ids + e.response_ids for e in examples]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    target = torch.zeros((len(seqs), width), dtype=torch.bool)
    for row, (e, s) in enumerate(zip(examples, seqs, strict=True)):
        ids[row, width - len(s) :] = torch.tensor(s)
        attn[row, width - len(s) :] = 1
        target[row, width - len(e.response_ids) :] = True
    n_tail = max(len(e.response_ids) for e in examples)
    return {"input_ids": ids, "attention_mask": attn, "target_mask": target, "n_tail": n_tail}


def response_token_nll(model: Any, batch: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Negative log-likelihood of each target token of a `collate`d batch: (B, n_tail) NLL,
    zero off the targets, and the (B, n_tail) target mask.

    Left padding puts every target at the end, so only the last `n_tail + 1` positions' logits
    are computed (`logits_to_keep`): the (B, T, V) tensor over prompt tokens is never built.
    """
    ids, attn, tail = batch["input_ids"], batch["attention_mask"], int(batch["n_tail"])
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
    out = model(
        input_ids=ids, attention_mask=attn, position_ids=position_ids,
        logits_to_keep=tail + 1, use_cache=False,
    )  # fmt: skip
    return target_nll(out.logits[:, :-1], batch)  # the logits predicting positions -tail..-1


def target_nll(logits: torch.Tensor, batch: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """`response_token_nll` from the logits predicting a batch's last `n_tail` positions (B,
    n_tail, V): wherever they were computed (RLGF's MLE term: through the DDP-wrapped module)."""
    tail = int(batch["n_tail"])
    targets = batch["input_ids"][:, -tail:]
    mask = batch["target_mask"][:, -tail:]
    logits = logits.float()
    nll = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none"
    )
    return nll.view_as(targets) * mask, mask


def response_loss(model: Any, batch: Mapping[str, Any]) -> tuple[torch.Tensor, int]:
    """Mean negative log-likelihood of the target tokens (prompt and padding masked out)."""
    nll, mask = response_token_nll(model, batch)
    n = int(mask.sum())
    return nll.sum() / max(n, 1), n


def train_sft(
    model: Any,
    tokenizer: Any,
    examples: Sequence[SFTExample],
    cfg: SFTConfig,
    optimizer: OptimizerConfig,
    autocast_dtype: str | None = None,
    seed: int = 0,
    progress: bool = True,
    desc: str = "SFT",
) -> pd.DataFrame:
    """LoRA fine-tuning on `examples` with the study's one optimiser (`rl.optimizer`, built by
    `rl.optim.adamw` at `cfg.learning_rate`: constant schedule, its clipping); returns the step log."""
    if not examples:
        raise ValueError("SFT has no training examples; check sft.max_examples and the data")
    seed_everything(seed)
    rng = np.random.default_rng(seed)
    device = next(model.parameters()).device
    params = [p for p in model.parameters() if p.requires_grad]
    opt = adamw(params, optimizer, cfg.learning_rate)  # constant schedule: no scheduler
    n_batches = math.ceil(len(examples) / cfg.batch_size)
    total = max(1, math.ceil(n_batches * cfg.epochs))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows, step = [], 0
    model.train()
    bar = tqdm(total=total, desc=desc, disable=not progress)
    t_start = time.perf_counter()
    while step < total:
        for chunk in _batches(examples, cfg.batch_size, rng):
            if step >= total:
                break
            t0 = time.perf_counter()
            batch = collate([examples[i] for i in chunk], pad)
            batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
            with autocast(autocast_dtype, device):
                loss, n_tok = response_loss(model, batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, optimizer.max_grad_norm)
            opt.step()
            step += 1
            dt = time.perf_counter() - t0
            n_all = int(batch["attention_mask"].sum())
            rows.append({"step": step, "loss": loss.item(), "target_tokens": n_tok, "tokens": n_all,
                         "lr": opt.param_groups[0]["lr"], "step_time_s": dt, "tokens_per_s": n_all / dt})  # fmt: skip
            bar.update(1)
            bar.set_postfix(loss=f"{rows[-1]['loss']:.3f}")
            if not progress and step % max(1, total // 10) == 0:  # a log line per tenth instead
                log.info("%s: step %d/%d, loss %.3f", desc, step, total, rows[-1]["loss"])
    bar.close()
    model.eval()
    log.info("%s: %d steps, %.0f s", desc, step, time.perf_counter() - t_start)
    return pd.DataFrame(rows)


#: `run_sft_stage`'s columns: with `sft.enabled: false` notebook 03 writes the header alone.
SFT_SUMMARY_COLUMNS = ("policy", "outcomes", "eligible_rows", "examples", "left_out_too_long",
                       "met_share", "steps", "seconds", "tokens_per_s", "loss_first", "loss_last")  # fmt: skip


def run_sft_stage(cfg: StudyConfig, run: RunDir, progress: bool = True) -> pd.DataFrame:
    """Train `sft` and `sft_met`; write `policy/<name>/{adapter/, train_log.parquet, data.json}`.

    Returns one row per policy: examples used, rows left out for length, steps, time, tokens/s,
    first and last loss. A policy whose adapter and `data.json` exist with the same settings is
    reused (written last, so an interrupted training never looks finished).
    """

    sc = cfg.sft
    if sc.num_threads is not None:
        torch.set_num_threads(sc.num_threads)
    labelled, _ = load_splits(run)
    holdout = load_holdout(run)
    summary = []
    settings = sft_settings(cfg, run)
    for name, outcomes in SFT_POLICIES.items():
        info = _finished(run, name, settings)
        if info is not None:  # same data, model and settings: reuse
            log.info("%s: up to date (%s): reading its outputs", name, sft_summary_path(run, name))
            summary.append({k: v for k, v in info.items() if k not in ("row_ids", "settings")})
            continue
        rows = eligible_rows(labelled, holdout, outcomes)
        n_eligible = len(rows)
        limit = sc.max_examples if outcomes == "all" else sc.max_examples_met
        if limit is not None and len(rows) > limit:
            rows = rows.sample(n=limit, random_state=cfg.run.seed).reset_index(drop=True)
        model, tok = load_policy(cfg.policy, device=resolve_device(cfg.compute.device))
        examples, dropped = build_examples(
            rows, tok, model, cfg.rl.prompt_template, cfg.policy, sc.max_response_tokens
        )
        seed_everything(cfg.run.seed)  # LoRA's random init: the same whatever ran before
        model = apply_lora(model, cfg.policy.lora)
        t0 = time.perf_counter()
        frame = train_sft(
            model, tok, examples, sc, cfg.rl.optimizer,
            autocast_dtype=cfg.policy.autocast, seed=cfg.run.seed, progress=progress, desc=name,
        )  # fmt: skip
        seconds = time.perf_counter() - t0
        out = run.path(f"policy/{name}")
        atomic_dir(out / "adapter", lambda d, m=model: m.save_pretrained(d))
        run.write_parquet(f"policy/{name}/train_log.parquet", frame.assign(policy=name))
        info = {
            "policy": name,
            "outcomes": outcomes,
            "eligible_rows": n_eligible,
            "examples": len(examples),
            "left_out_too_long": dropped,
            "met_share": float(rows["y"].mean()) if len(rows) else math.nan,
            "steps": len(frame),
            "seconds": seconds,
            "tokens_per_s": float(frame["tokens"].sum() / frame["step_time_s"].sum()),
            "loss_first": float(frame["loss"].head(5).mean()),
            "loss_last": float(frame["loss"].tail(5).mean()),
            "row_ids": sorted(int(i) for i in rows["row_id"]),
            "settings": settings,
        }
        run.write_json(f"policy/{name}/data.json", info)
        summary.append({k: v for k, v in info.items() if k not in ("row_ids", "settings")})
        del model
    return pd.DataFrame(summary)


def sft_settings(cfg: StudyConfig, run: RunDir) -> dict[str, Any]:
    """What a supervised policy depends on (kept in its `data.json`, written last)."""
    return {
        "sft": cfg.sft.model_dump(mode="json", exclude={"num_threads"}),
        "optimizer": cfg.rl.optimizer.model_dump(mode="json"),  # the one optimiser, SFT's too
        "policy": cfg.policy.model_dump(mode="json"),
        "prompt_template": cfg.rl.prompt_template,
        "reward_protocol": cfg.reward.reward_protocol,
        "seed": cfg.run.seed,
        "inputs": input_hashes(run.root, ["data"]),  # the rows it learns from
    }


def _finished(run: RunDir, name: str, settings: Mapping[str, Any]) -> dict[str, Any] | None:
    """The `data.json` of a policy trained with `settings` whose adapter is there, else None."""
    done = sft_summary_path(run, name)
    if not (done.is_file() and run.exists(f"policy/{name}/adapter/adapter_config.json")):
        return None
    info = run.read_json(f"policy/{name}/data.json")
    return info if info.get("settings") == settings else None


def is_trained(cfg: StudyConfig, run: RunDir) -> bool:
    """True when both supervised policies are trained with the current settings and data."""
    settings = sft_settings(cfg, run)
    return all(_finished(run, name, settings) is not None for name in SFT_POLICIES)


def sft_summary_path(run: RunDir, name: str) -> Path:
    """Where `run_sft_stage` records what a supervised policy was trained on."""
    return run.path(f"policy/{name}/data.json")


def loss_figure(logs: pd.DataFrame) -> Any:
    """Training loss (target tokens' mean NLL) per step for each supervised policy."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    for name, g in logs.groupby("policy", sort=False):
        ax.plot(g["step"], g["loss"], alpha=0.35)
        ax.plot(
            g["step"], g["loss"].rolling(10, min_periods=1).mean(), label=f"{name} (mean of 10)"
        )
    ax.set(xlabel="step", ylabel="NLL per target token", title="Domain fine-tuning loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def met_references(
    cfg: Any, run_dir: Any, contexts: Sequence[Mapping[str, Any]], tokenizer: Any, model: Any
) -> list[list[list[int]]]:
    """Per context: token ids (+ end token) of its historical MET descriptions among the rows
    the policy pool (`data.contexts.eligible_rows`: rows no reward model or judge learns from),
    at most `sft.max_response_tokens` long (as SFT's targets)."""
    rd = RunDir(run_dir)
    labelled, _ = load_splits(rd)
    rows = eligible_rows(labelled, load_holdout(rd), "met")
    keys = CONTEXT_FIELDS
    by_key: dict[tuple[str, ...], list[list[int]]] = {}
    targets = target_ids(rows["description"], tokenizer, model)
    for rec, target in zip(
        rows[list(keys)].astype(str).itertuples(index=False), targets, strict=True
    ):
        if len(target) <= cfg.sft.max_response_tokens:
            by_key.setdefault(tuple(rec), []).append(target)
    return [by_key.get(tuple(str(c[k]) for k in keys), []) for c in contexts]
