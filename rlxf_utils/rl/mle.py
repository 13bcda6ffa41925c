"""The RLGF paper's MLE term (Chang et al., 2023, section 6): eta x the negative log-likelihood of a
historical MET description of each minibatch context, added by every algorithm the registry marks
`mle` (the RLGF algorithms and `ppo_mle`). `rl.ppo.PPOTrainer.extra_loss` calls `mle_loss`."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from rlxf_utils.algorithms import algorithm
from rlxf_utils.rl.rollout import Rollout
from rlxf_utils.rl.sft import SFTExample, collate, met_references, target_nll
from rlxf_utils.rl.trainer import TrainJob


def mle_loss(trainer: Any, ro: Rollout, mb: torch.Tensor) -> torch.Tensor | None:
    """eta * mean NLL of one historical MET description per context in the minibatch, through
    the trainer's (DDP-wrapped) module: `update` backpropagates it on its own, so that DDP
    averages its gradient over the processes like the PPO loss's. None when eta is 0 or no
    context of the minibatch has a reference."""
    if trainer.mle_coef == 0:
        return None
    ctx = sorted({ro.context_idx[int(i)] for i in mb})
    rng = np.random.default_rng([trainer.seed, trainer.step, 2])
    examples = []
    for c in ctx:
        refs = trainer.references[c]
        if refs:
            examples.append(
                SFTExample(context_prompt(trainer, c), refs[int(rng.integers(len(refs)))])
            )
    if not examples:
        return None
    batch = collate(examples, trainer.tokenizer.pad_token_id)
    batch = {k: v.to(trainer.device) if torch.is_tensor(v) else v for k, v in batch.items()}
    with trainer._autocast():
        logits, _ = trainer.module(
            batch["input_ids"], batch["attention_mask"], int(batch["n_tail"]), with_values=False
        )
    nll, mask = target_nll(logits, batch)
    return trainer.mle_coef * nll.sum() / mask.sum().clamp(min=1)


def context_prompt(trainer: Any, c: int) -> list[int]:
    """The prompt ids of context `c` (encoded once per trainer)."""
    if c not in trainer._prompt_ids:
        trainer._prompt_ids[c] = trainer.encode([c])["input_ids"][0].tolist()
    return trainer._prompt_ids[c]


def mle_settings(job: TrainJob, model: Any) -> dict[str, Any]:
    """The MLE term's arguments for a trainer (`references`, `mle_coef`): the RLGF paper's
    eta x NLL of historical MET descriptions for an algorithm registered with `mle`, else none."""
    if not algorithm(job.algo).mle:
        return {"references": None, "mle_coef": 0.0}
    cfg, run_dir = job.require_study()
    refs = met_references(cfg, run_dir, job.contexts, job.tokenizer, model)
    return {"references": refs, "mle_coef": cfg.rlgf.mle_coef}
