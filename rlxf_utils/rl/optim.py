"""The one optimiser of every method (`rl.optimizer`): AdamW for our trainers, the same settings
as TRL TrainingArguments for TRL's."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from rlxf_utils.config import OptimizerConfig


def adamw(params: Iterable[Any], opt: OptimizerConfig, lr: float) -> torch.optim.AdamW:
    """AdamW over `params` (tensors or param groups) with `opt`'s eps, weight decay and betas;
    `lr` for groups that name none. The schedule is constant (`opt.lr_schedule`): no scheduler."""
    return torch.optim.AdamW(
        params, lr=lr, eps=opt.eps, weight_decay=opt.weight_decay, betas=(opt.beta1, opt.beta2)
    )


def trainer_optimizer_arguments(opt: OptimizerConfig) -> dict[str, Any]:
    """The TrainingArguments that give a TRL run `adamw`'s optimiser, schedule and clipping."""
    return dict(
        optim="adamw_torch",
        adam_epsilon=opt.eps,
        adam_beta1=opt.beta1,
        adam_beta2=opt.beta2,
        weight_decay=opt.weight_decay,
        lr_scheduler_type=opt.lr_schedule,
        warmup_steps=0,
        max_grad_norm=opt.max_grad_norm,
    )
