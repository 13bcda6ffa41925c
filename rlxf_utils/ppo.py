"""PPO for causal language models, classic RLHF form (Ziegler et al. 2019; Stiennon et al. 2020).

One readable file in the CleanRL spirit: every implementation detail is named and commented once.

    prompts   a schedule shared with GRPO/RLOO (`prompt_schedule`): the same prompts at every step
    rollout   sample `num_generations` responses per prompt (temperature, top-p, max new tokens; left
              padding, KV cache; the same end tokens as evaluation, `models.eos_ids`)
    score     reward model on (context, post-processed response) -> one scalar per response
    forward   one no-grad pass of the policy gives log-probs, entropy and values (value head on the
              policy's last hidden states); one pass with the LoRA adapters disabled gives the
              reference log-probs (the frozen starting policy, no second copy of the weights)
    reward    per-token  r_t = -beta * (log pi(a_t) - log pi_ref(a_t)),  plus the score on the last token
    critic    V(s_t) = the reward model's score of the prefix y_<t in its context (`critic_init:
              reward`, Stiennon et al.'s value function initialised from the reward model) + a
              zero-initialised linear head on the policy's last hidden states (detached: the
              critic does not move the policy); `critic_init: mean`: the head alone, its bias at
              the first batch's mean score; optional critic-only warm-up steps
    GAE       advantages and returns (gamma, lambda), advantages whitened over the batch
    update    several epochs of shuffled minibatches: clipped surrogate + clipped value loss,
              gradient clipping, early stop when the approximate KL to the rollout policy is too big
    beta      adaptive KL controller (Ziegler et al.: beta *= 1 + K_beta * clip(KL / target - 1, +-0.2),
              K_beta = 0.1 per step) or a fixed coefficient

Device placement goes through `accelerate`, so the same code runs on CPU, one GPU or several GPUs
(`accelerate launch`). Checkpoints hold everything needed for an exact resume on CPU.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from rlxf_utils.artifacts import atomic_path, to_jsonable
from rlxf_utils.config import RLConfig
from rlxf_utils.models import autocast, encode_prompts, eos_ids, postprocess_response

__all__ = [
    "LOG_COLUMNS",
    "AdaptiveKLController",
    "FixedKLController",
    "ForcedPrefix",
    "PPOTrainer",
    "PolicyWithValue",
    "RewardFn",
    "ValueHead",
    "compute_gae",
    "entropy_from_logits",
    "explained_variance",
    "logprobs_from_logits",
    "masked_mean",
    "masked_var",
    "policy_loss",
    "prompt_schedule",
    "value_loss",
    "whiten",
]

log = logging.getLogger(__name__)

RewardFn = Callable[[list[dict[str, Any]], list[str]], np.ndarray]
"""reward_fn(contexts, texts) -> one scalar per text (here: the reward model's calibrated P(MET))."""

#: One row per step; GRPO/RLOO (rlxf_utils.rl) write the same columns, NaN where not meaningful.
LOG_COLUMNS: tuple[str, ...] = (
    "algo",
    "step",
    "reward_mean",
    "reward_std",
    "kl",
    "kl_per_token",
    "kl_coef",
    "entropy",
    "value_mean",
    "clip_frac",
    "approx_kl",
    "policy_loss",
    "value_loss",
    "explained_variance",
    "explained_variance_prior",
    "response_length",
    "scheme",
    "learner_share",
    "tokens_per_s",
    "gen_time_s",
    "step_time_s",
    "processes",
    "rank_weight_spread",
)


# ---------------------------------------------------------------------------------------------
# Masked statistics
# ---------------------------------------------------------------------------------------------
#: Sums a tensor over every process (identity on one process): statistics "over the batch" are
#: over the global batch when each process holds a share of it.
SumFn = Callable[[torch.Tensor], torch.Tensor]


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def masked_mean(
    x: torch.Tensor, mask: torch.Tensor, dim: int | None = None, reduce: SumFn = _identity
) -> torch.Tensor:
    """Mean of `x` over positions where `mask` is 1 (`reduce`: over every process's share)."""
    if dim is None:
        return reduce((x * mask).sum()) / reduce(mask.sum()).clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def masked_var(
    x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True, reduce: SumFn = _identity
) -> torch.Tensor:
    """Variance of `x` over masked positions (Bessel-corrected by default)."""
    mean = masked_mean(x, mask, reduce=reduce)
    var = masked_mean((x - mean) ** 2, mask, reduce=reduce)
    if unbiased:
        n = reduce(mask.sum())
        var = var * n / (n - 1).clamp(min=1)
    return var


def whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    shift_mean: bool = True,
    eps: float = 1e-8,
    reduce: SumFn = _identity,
) -> torch.Tensor:
    """Advantage whitening: zero mean, unit variance over the masked tokens of the whole batch
    (with `reduce`, the batch of every process: ranks then scale their advantages alike)."""
    mean, var = masked_mean(x, mask, reduce=reduce), masked_var(x, mask, reduce=reduce)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * mask


# ---------------------------------------------------------------------------------------------
# Log-probabilities, entropy, GAE, losses
# ---------------------------------------------------------------------------------------------
def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(token) under `logits` (…, V) for each position."""
    return torch.gather(F.log_softmax(logits.float(), dim=-1), -1, tokens.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution at each position (nats)."""
    logp = F.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def compute_gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over response tokens (B, T); returns (advantages, returns).

    The value after the last valid token is 0 (the episode ends with the response), so
    delta_t = r_t + gamma * V_{t+1} * m_{t+1} - V_t and A_t = delta_t + gamma * lam * m_{t+1} * A_{t+1}.
    """
    T = rewards.shape[1]
    advantages = torch.zeros_like(rewards)
    last = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(T)):
        next_mask = mask[:, t + 1] if t + 1 < T else torch.zeros_like(mask[:, 0])
        next_value = values[:, t + 1] if t + 1 < T else torch.zeros_like(values[:, 0])
        delta = rewards[:, t] + gamma * next_value * next_mask - values[:, t]
        last = delta + gamma * lam * next_mask * last
        advantages[:, t] = last
    advantages = advantages * mask
    returns = (advantages + values) * mask
    return advantages, returns


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_range: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Clipped surrogate objective (as a loss) with its clip fraction and approximate KL.

    approx KL uses the low-variance estimator mean((r - 1) - log r) (Schulman's k3).
    """
    log_ratio = logprobs - old_logprobs
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_range, 1.0 + clip_range)
    loss = masked_mean(torch.maximum(unclipped, clipped), mask)
    with torch.no_grad():
        clip_frac = masked_mean(((ratio - 1.0).abs() > clip_range).float(), mask)
        approx_kl = masked_mean((ratio - 1.0) - log_ratio, mask)
    return loss, clip_frac, approx_kl


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_range_value: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss 0.5 * max((V - R)^2, (V_clipped - R)^2) and its clip fraction.

    `clip_range_value=None`: the plain squared error (no clipping, clip fraction 0).
    """
    if clip_range_value is None:
        return 0.5 * masked_mean((values - returns) ** 2, mask), torch.zeros(())
    v_clipped = old_values + (values - old_values).clamp(-clip_range_value, clip_range_value)
    loss_unclipped = (values - returns) ** 2
    loss_clipped = (v_clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(loss_unclipped, loss_clipped), mask)
    with torch.no_grad():
        clip_frac = masked_mean((loss_clipped > loss_unclipped).float(), mask)
    return loss, clip_frac


def explained_variance(
    values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, reduce: SumFn = _identity
) -> float:
    """1 - Var(returns - values) / Var(returns) over masked tokens (1 = perfect critic)."""
    var_r = masked_var(returns, mask, reduce=reduce)
    if var_r.item() == 0:
        return float("nan")
    return float(1.0 - masked_var(returns - values, mask, reduce=reduce) / var_r)


# ---------------------------------------------------------------------------------------------
# KL coefficient controllers
# ---------------------------------------------------------------------------------------------
class AdaptiveKLController:
    """Ziegler et al. (2019) adaptive beta: proportional control of the KL towards `target`.

    beta_{t+1} = beta_t (1 + K_beta e_t), e_t = clip(KL_t / target - 1, -0.2, 0.2), once per step:
    with K_beta = 0.1, beta moves by up to 2% a step whatever the batch size (the original
    horizon form, K_beta = batch / horizon, barely moves at a few responses per step).
    """

    def __init__(self, init: float, target: float, rate: float = 0.1):
        self.value, self.target, self.rate = float(init), float(target), float(rate)

    def update(self, current_kl: float, n_steps: int = 1) -> None:
        """Raise beta when KL is above target, lower it when below (error clipped to +-20%)."""
        error = float(np.clip(current_kl / self.target - 1.0, -0.2, 0.2))
        self.value *= 1.0 + self.rate * error

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value, "target": self.target, "rate": self.rate}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        self.value = float(state["value"])


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, value: float):
        self.value = float(value)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient stays fixed."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        self.value = float(state["value"])


# ---------------------------------------------------------------------------------------------
# Policy + value head
# ---------------------------------------------------------------------------------------------
class ValueHead(nn.Module):
    """Scalar value V(s_t) from the policy's last hidden state at each position.

    Zero weights: every state starts at the bias. The trainer adds the reward model's score of
    the prefix (`critic_init: reward`; the bias stays 0) or sets the bias to the first batch's
    mean score (`mean`), so the critic starts on the reward's scale instead of at random on the
    hidden states' scale. The hidden states are detached: the critic reads the policy's
    features, and its loss never moves the policy.
    """

    def __init__(self, hidden_size: int):
        super().__init__()
        self.summary = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.summary.weight)
        nn.init.zeros_(self.summary.bias)
        # Features are layer-normalised and the weighted sum scaled by 1/sqrt(d): one Adam step
        # then moves a value by about lr * sqrt(d), not lr * d (~0.5 per step at lr 1e-3 on raw
        # SmolLM2 states, ten times the spread of the rewards it has to predict).
        self.scale = hidden_size**-0.5

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        h = F.layer_norm(hidden.detach().float(), hidden.shape[-1:])
        return (F.linear(h, self.summary.weight) * self.scale + self.summary.bias).squeeze(-1)


class PolicyWithValue(nn.Module):
    """LoRA policy and value head(s) as one module, so `accelerate`/DDP wraps and syncs them all.

    `value_head` is the policy's critic; `extra_heads` adds more critics on the same features
    (RLGF's AggreVaTeD: `guide_value_head`, the guide's value V^{pi_g}).
    """

    def __init__(self, policy: nn.Module, extra_heads: Sequence[str] = ()):
        super().__init__()
        self.policy = policy
        self.value_head = ValueHead(policy.config.hidden_size)
        self.head_names = ("value_head", *extra_heads)
        with torch.random.fork_rng(devices=[]):  # zero-initialised: draws nothing from the stream
            for name in extra_heads:
                setattr(self, name, ValueHead(policy.config.hidden_size))

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        n_response: int,
        with_values: bool = True,
        critic: str = "value_head",
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits predicting the last `n_response` tokens (B, R, V) and `critic`'s values at those
        states (B, R)."""
        # Left padding: positions count only real tokens, as in generation.
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        out = self.policy(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            output_hidden_states=with_values,
            logits_to_keep=n_response + 1,  # only the response's logits: saves a (B, T, V) tensor
            use_cache=False,
        )
        logits = out.logits[:, :-1]
        if not with_values:
            return logits, None
        hidden = out.hidden_states[-1][:, -(n_response + 1) : -1]
        return logits, getattr(self, critic)(hidden)


class ForcedPrefix:
    """A logits processor that forces response i's first `lengths[i]` tokens to `ids[i]`.

    RLGF's roll-in: the roll-out policy continues a prefix another policy wrote, token for token.
    Every other token gets -inf (so temperature and top-p, applied after it, keep the forced one);
    positions past the prefix are left to the model.
    """

    def __init__(self, ids: torch.Tensor, lengths: torch.Tensor, prompt_length: int):
        self.ids, self.lengths, self.prompt_length = ids, lengths, int(prompt_length)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1] - self.prompt_length  # index of the token being chosen
        if t >= self.ids.shape[1]:
            return scores
        force = (self.lengths.to(scores.device) > t).nonzero().squeeze(-1)
        if force.numel():
            forced = self.ids[:, t].to(scores.device)[force]
            scores = scores.clone()
            scores[force] = -float("inf")
            scores[force, forced] = 0.0
        return scores


@dataclass
class Rollout:
    """One batch of sampled responses and everything the update needs."""

    context_idx: list[int]
    input_ids: torch.Tensor  # (B, P + R) prompt (left-padded) + response (right-padded)
    attention_mask: torch.Tensor  # (B, P + R)
    response_ids: torch.Tensor  # (B, R)
    response_mask: torch.Tensor  # (B, R) 1 up to and including the first EOS
    texts: list[str]
    scores: torch.Tensor  # (B,)
    gen_time: float
    # Guided feedback (rlxf_utils.rlgf): which tokens the learner sampled (the policy gradient
    # acts on them only), which tokens the critic regresses on, and which critic; None: all.
    learner_mask: torch.Tensor | None = None  # (B, R)
    value_mask: torch.Tensor | None = None  # (B, R)
    critic: str = "value_head"
    scheme: str = "ppo"
    # The critic's prior (`critic_init: reward`): the reward model's score of each prefix y_<t
    value_prior: torch.Tensor | None = None  # (B, R)


@dataclass
class Prepared:
    """What the update needs from a rollout: old log-probs and values, advantages, returns, masks."""

    mask: torch.Tensor  # (B, R) response tokens
    pg_mask: torch.Tensor  # (B, R) tokens the policy gradient acts on
    vf_mask: torch.Tensor  # (B, R) tokens the critic is fitted on
    old_logprobs: torch.Tensor
    old_values: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    kl_tokens: torch.Tensor
    entropy: torch.Tensor
    value_prior: torch.Tensor  # (B, R) the critic's prior (zeros without one)


def prompt_schedule(n_prompts: int, steps: int, per_step: int, seed: int) -> list[list[int]]:
    """Prompt indices for each step: passes over shuffled prompts (a new permutation per pass).

    Shared by PPO and the TRL runs (whose dataset is laid out in this order, unshuffled), so
    every algorithm sees the same prompts at the same step.
    """
    rng = np.random.default_rng(seed)
    order: list[int] = []
    out = []
    for _ in range(steps):
        idx = []
        while len(idx) < per_step:
            if not order:
                order = rng.permutation(n_prompts).tolist()
            idx.append(order.pop(0))
        out.append(idx)
    return out


# ---------------------------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------------------------
class PPOTrainer:
    """PPO fine-tuning of a LoRA-wrapped causal LM against `reward_fn`; writes to `output_dir`.

    `prompts[i]` is the formatted policy input for `contexts[i]`. Layout of `output_dir`:
    `adapter/` (final LoRA, safetensors), `value_head.safetensors`, `train_log.parquet`,
    `samples.jsonl`, `checkpoints/step_XXXXXX/` (the last two kept) and
    `snapshots/step_XXXXXX/adapter_model.safetensors` (every checkpoint's adapter, for the frontier).
    """

    #: critics besides the policy's own `value_head` (subclasses: rlgf.GuidedPPOTrainer)
    extra_heads: tuple[str, ...] = ()
    algo: str = "ppo"

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        prompts: Sequence[str],
        contexts: Sequence[Mapping[str, Any]],
        reward_fn: RewardFn,
        cfg: RLConfig,
        output_dir: str | Path,
        seed: int = 0,
        accelerator: Any = None,
        n_samples: int = 4,
        generation_kwargs: Mapping[str, Any] | None = None,
        autocast_dtype: str | None = None,
    ):
        from accelerate import Accelerator, DistributedDataParallelKwargs

        if len(prompts) != len(contexts) or not prompts:
            raise ValueError(
                f"need one prompt per context, got {len(prompts)} prompts, {len(contexts)} contexts"
            )
        if not hasattr(model, "disable_adapter"):
            raise TypeError(
                "model must be a peft model (models.apply_lora): the reference is the base"
            )
        self.cfg, self.tokenizer, self.reward_fn = cfg, tokenizer, reward_fn
        self.prompts, self.contexts = list(prompts), [dict(c) for c in contexts]
        self.output_dir = Path(output_dir)
        self.seed, self.n_samples = seed, n_samples
        self.generation_kwargs = dict(generation_kwargs or {})  # extra generate() args (benchmarks)
        self.autocast_dtype = autocast_dtype  # 'bfloat16': matmuls in bf16 (rollout and update)
        # DDP: a critic-only warm-up step leaves the policy's LoRA unused, and RLGF's extra critics
        # sit idle on steps of another scheme, so unused parameters must be allowed
        self.accelerator = accelerator or Accelerator(
            kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)]
        )
        ds = getattr(self.accelerator.state, "deepspeed_plugin", None)
        if ds is not None and getattr(ds, "zero_stage", 0) == 3:
            raise ValueError(
                "PPO and the RLGF algorithms generate with the full weights on every process; "
                "DeepSpeed ZeRO-3 shards them. Use params/accelerate/deepspeed_zero2.yaml or "
                "multi_gpu_ddp.yaml for them (ZeRO-3 suits GRPO/RLOO, which TRL gathers)"
            )
        self.world = self.accelerator.num_processes
        self.rank = self.accelerator.process_index
        if cfg.batch_size % self.world or cfg.minibatch_size % self.world:
            raise ValueError(
                f"rl.batch_size ({cfg.batch_size}) and rl.minibatch_size ({cfg.minibatch_size}) "
                f"must be divisible by the number of processes ({self.world})"
            )
        rank_seed = seed + self.rank  # each process draws its own samples
        _seed_everything(rank_seed)
        self.stop_ids = sorted(eos_ids(model, tokenizer))  # the end tokens evaluation uses
        if cfg.gradient_checkpointing:  # recompute activations in the update: memory for time
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        self.gen = PolicyWithValue(model, self.extra_heads)
        policy_params = [p for p in self.gen.policy.parameters() if p.requires_grad]
        self._policy_params = policy_params
        self._value_params = [
            p for name in self.gen.head_names for p in getattr(self.gen, name).parameters()
        ]
        self.optimizer = torch.optim.AdamW(
            [
                {"params": policy_params, "lr": cfg.learning_rate},
                {"params": self._value_params, "lr": cfg.value_learning_rate or cfg.learning_rate},
            ],
            eps=1e-5,
        )
        self.module, self.optimizer = self.accelerator.prepare(self.gen, self.optimizer)
        self.kl_ctl: AdaptiveKLController | FixedKLController = (
            AdaptiveKLController(cfg.kl_coef, cfg.target_kl, cfg.kl_adapt_rate)
            if cfg.adaptive_kl
            else FixedKLController(cfg.kl_coef)
        )
        self.step = 0
        self.history: list[dict[str, Any]] = []
        self.samples: list[dict[str, Any]] = []
        self.total_steps = cfg.steps
        self.value_initialised: set[str] = set()  # critics whose bias is set (first batch's mean)
        self.schedule: list[list[int]] | None = None  # set by train(): prompts per step

    # -- helpers -------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    @property
    def unwrapped(self) -> PolicyWithValue:
        return self.accelerator.unwrap_model(self.module)

    def _autocast(self) -> Any:
        return autocast(self.autocast_dtype, self.device)

    def _sum(self, t: torch.Tensor) -> torch.Tensor:
        """`t` summed over every process (itself on one process: the one-process arithmetic is
        unchanged)."""
        if self.world == 1:
            return t
        return self.accelerator.reduce(t.detach().to(self.device), reduction="sum")

    def _global_mean(self, x: torch.Tensor) -> float:
        """Mean of a per-response tensor over the global batch (equal shares per process)."""
        return float(self._sum(x.float().sum()) / (x.numel() * self.world))

    def _rank_weight_spread(self) -> float:
        """Largest difference between processes in any trainable tensor's sum (0: identical
        weights, as DDP must keep them); NaN on one process."""
        if self.world == 1:
            return float("nan")
        sums = torch.stack([p.detach().double().sum() for p in self.module.parameters()
                            if p.requires_grad]).to(self.device)  # fmt: skip
        every = self.accelerator.gather(sums.unsqueeze(0))  # (world, n_tensors)
        return float((every.max(0).values - every.min(0).values).abs().max())

    def _next_batch(self) -> list[int]:
        """Prompt indices for this step (`prompt_schedule`), each repeated `num_generations` times;
        with several processes, this process's contiguous share of that global batch."""
        cfg = self.cfg
        if self.schedule is None or self.step >= len(self.schedule):
            self.schedule = prompt_schedule(
                len(self.prompts), max(cfg.steps, self.step + 1), cfg.prompts_per_step, self.seed
            )
        idx = [i for i in self.schedule[self.step] for _ in range(cfg.num_generations)]
        share = len(idx) // self.world
        return idx[self.rank * share : (self.rank + 1) * share]

    # -- phase 1: rollout ----------------------------------------------------------------------
    @torch.no_grad()
    def sample(
        self,
        model: nn.Module,
        enc: Mapping[str, torch.Tensor],
        temperature: float,
        top_p: float,
        prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample a response per prompt of `enc` from `model`; returns (response ids padded after
        the first end token, response mask up to and including it).

        `prefix` = (ids (B, H), lengths (B,)): the first `lengths[i]` tokens of response i are
        forced to `ids[i]` (RLGF's roll-in, continued exactly by the roll-out policy).
        """
        from transformers import LogitsProcessorList

        tok = self.tokenizer
        processors = None
        if prefix is not None and int(prefix[1].max()) > 0:
            processors = LogitsProcessorList(
                [ForcedPrefix(prefix[0], prefix[1], enc["input_ids"].shape[1])]
            )
        kwargs = dict(
            do_sample=True,
            temperature=temperature,
            top_p=top_p,
            top_k=0,
            max_new_tokens=self.cfg.max_new_tokens,
            pad_token_id=tok.pad_token_id,
            eos_token_id=self.stop_ids,
            use_cache=True,  # KV cache: each new token attends to cached keys/values
            logits_processor=processors,
        )
        kwargs.update(self.generation_kwargs)  # benchmarks and tests may override the defaults
        with self._autocast():
            out = model.generate(
                input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], **kwargs
            )
        response = out[:, enc["input_ids"].shape[1] :]
        # Response mask: tokens up to and including the first end token (pad may equal EOS).
        is_eos = torch.isin(response, torch.tensor(self.stop_ids, device=response.device))
        after_eos = (is_eos.cumsum(-1) - is_eos.long()) > 0
        response_mask = (~after_eos).long()
        response = torch.where(
            response_mask.bool(), response, torch.full_like(response, tok.pad_token_id)
        )
        return response, response_mask

    def encode(self, idx: Sequence[int]) -> dict[str, torch.Tensor]:
        """Left-padded prompt ids of contexts `idx` on the trainer's device."""
        enc = encode_prompts(
            self.tokenizer, [self.prompts[i] for i in idx], return_tensors="pt", padding=True
        )
        return {k: v.to(self.device) for k, v in enc.items()}

    def _reward(self, idx: Sequence[int], texts: list[str], what: str) -> np.ndarray:
        """`reward_fn` on (contexts[idx[k]], texts[k]), checked: one finite float per text."""
        scores = np.asarray(
            self.reward_fn([self.contexts[i] for i in idx], texts), dtype=np.float32
        )
        if scores.shape != (len(texts),) or not np.isfinite(scores).all():
            raise ValueError(
                f"reward_fn returned shape {scores.shape} / non-finite values for {what}; "
                f"expected {len(texts)} finite floats"
            )
        return scores

    def score(self, idx: Sequence[int], response: torch.Tensor) -> tuple[list[str], torch.Tensor]:
        """Post-processed texts of `response` and their reward-model scores."""
        texts = self.tokenizer.batch_decode(response, skip_special_tokens=True)
        cleaned = [postprocess_response(t, self.cfg.response_postprocess) for t in texts]
        scores = self._reward(idx, cleaned, "the responses")
        return cleaned, torch.as_tensor(scores, device=self.device)

    @torch.no_grad()
    def rollout(self, idx: Sequence[int]) -> Rollout:
        """Sample one response per entry of `idx` and score it with the reward function."""
        enc = self.encode(idx)
        policy = self.unwrapped.policy
        policy.eval()  # no dropout while sampling and scoring
        t0 = time.perf_counter()
        response, response_mask = self.sample(policy, enc, self.cfg.temperature, self.cfg.top_p)
        gen_time = time.perf_counter() - t0
        return self.finish_rollout(idx, enc, response, response_mask, gen_time)

    def finish_rollout(
        self,
        idx: Sequence[int],
        enc: Mapping[str, torch.Tensor],
        response: torch.Tensor,
        response_mask: torch.Tensor,
        gen_time: float,
        **guided: Any,
    ) -> Rollout:
        """Score the responses and pack prompt + response into a `Rollout` (`guided`: RLGF's
        masks, critic and scheme)."""
        texts, scores = self.score(idx, response)
        prior = (
            self.prefix_scores(idx, response, response_mask)
            if self.cfg.critic_init == "reward"
            else None
        )
        return Rollout(
            context_idx=list(idx),
            input_ids=torch.cat([enc["input_ids"], response], 1),
            attention_mask=torch.cat([enc["attention_mask"], response_mask], 1),
            response_ids=response,
            response_mask=response_mask,
            texts=texts,
            scores=scores,
            gen_time=gen_time,
            value_prior=prior,
            **guided,
        )

    def prefix_scores(
        self, idx: Sequence[int], response: torch.Tensor, response_mask: torch.Tensor
    ) -> torch.Tensor:
        """The reward model's score of every prefix y_<t of every response in its context (B, R),
        0 past the response: the critic's prior. Each distinct (context, prefix) text is scored
        once, in one call of `reward_fn`."""
        B, R = response.shape
        lengths = response_mask.sum(1).tolist()
        ids = response.tolist()
        owners = [(i, t) for i in range(B) for t in range(int(lengths[i]))]
        decoded = self.tokenizer.batch_decode(
            [ids[i][:t] for i, t in owners], skip_special_tokens=True
        )
        unique: dict[tuple[int, str], int] = {}
        where = []
        for (i, _t), text in zip(owners, decoded, strict=True):
            key = (idx[i], postprocess_response(text, self.cfg.response_postprocess))
            where.append(unique.setdefault(key, len(unique)))
        scores = self._reward(
            [c for c, _ in unique], [t for _, t in unique], "the critic's prefixes"
        )
        prior = torch.zeros(B, R)
        if owners:
            rows, cols = zip(*owners, strict=True)
            prior[list(rows), list(cols)] = torch.as_tensor(scores[where])
        return prior.to(self.device)

    # -- phase 2: advantages ------------------------------------------------------------------
    @torch.no_grad()
    def prepare(self, ro: Rollout) -> Prepared:
        """Old log-probs, values and entropy from one no-grad policy pass, the reference's
        log-probs with adapters off, per-token rewards and GAE with the rollout's critic."""
        cfg = self.cfg
        mask = ro.response_mask.float()
        pg_mask = mask if ro.learner_mask is None else mask * ro.learner_mask.float()
        vf_mask = mask if ro.value_mask is None else mask * ro.value_mask.float()
        R = ro.response_ids.shape[1]
        T = cfg.temperature  # log-probs of the sampling distribution: logits / temperature

        # Critic on the reward's scale from the first step: the reward model's score of each
        # prefix (its prior), or, without one, a bias at the first batch's mean score.
        prior = torch.zeros_like(mask) if ro.value_prior is None else ro.value_prior * mask
        if ro.critic not in self.value_initialised:
            if ro.value_prior is None:
                head = getattr(self.unwrapped, ro.critic)
                head.summary.bias.fill_(self._global_mean(ro.scores))
            self.value_initialised.add(ro.critic)

        with self._autocast():
            logits, old_values = self.unwrapped(
                ro.input_ids, ro.attention_mask, R, critic=ro.critic
            )
            old_values = old_values.float() + prior
            old_logprobs = logprobs_from_logits(logits / T, ro.response_ids)
            entropy = masked_mean(entropy_from_logits(logits / T), mask)
            del logits
            with self.unwrapped.policy.disable_adapter():
                ref_logits, _ = self.unwrapped(
                    ro.input_ids, ro.attention_mask, R, with_values=False
                )
            ref_logprobs = logprobs_from_logits(ref_logits / T, ro.response_ids)
            del ref_logits

        # Per-token reward: KL penalty on every token, the reward-model score on the last one.
        kl_tokens = (old_logprobs - ref_logprobs) * mask
        rewards = -self.kl_ctl.value * kl_tokens
        last = (mask.sum(1).long() - 1).clamp(min=0)
        rewards[torch.arange(len(last)), last] += ro.scores
        advantages, returns = compute_gae(rewards, old_values * mask, mask, cfg.gamma, cfg.lam)
        # over the tokens the gradient acts on, in every process's share of the batch
        if cfg.whiten_advantages and self._sum(pg_mask.sum()) > 1:
            advantages = whiten(advantages, pg_mask, reduce=self._sum)
        return Prepared(
            mask=mask, pg_mask=pg_mask, vf_mask=vf_mask, old_logprobs=old_logprobs,
            old_values=old_values, advantages=advantages * pg_mask, returns=returns,
            kl_tokens=kl_tokens, entropy=entropy, value_prior=prior,
        )  # fmt: skip

    def extra_loss(self, ro: Rollout, mb: torch.Tensor) -> torch.Tensor | None:
        """A loss added to each minibatch's (none in PPO; RLGF: the MLE term on references)."""
        return None

    # -- phase 3: the update --------------------------------------------------------------------
    def update(self, ro: Rollout, pp: Prepared) -> dict[str, list[float]]:
        """Several epochs of shuffled minibatches: clipped surrogate on `pg_mask`, value loss on
        `vf_mask` (critic only while warming up), early stop on the approximate KL."""
        cfg = self.cfg
        R = ro.response_ids.shape[1]
        T = cfg.temperature
        warmup = self.step < cfg.value_warmup_steps
        self.module.train()
        B = ro.input_ids.shape[0]  # this process's share of the batch
        size = cfg.minibatch_size // self.world  # its share of each minibatch
        stats: dict[str, list[float]] = {k: [] for k in ("pg", "vf", "clip", "akl", "vclip")}
        stop = False
        for _epoch in range(cfg.update_epochs):
            perm = torch.randperm(B)
            for start in range(0, B, size):
                mb = perm[start : start + size].to(self.device)
                self.optimizer.zero_grad(set_to_none=True)
                # A loss of its own (RLGF's MLE term) runs its forward and backward first: under
                # DDP each backward averages over processes, and two forwards of the wrapped
                # module before one backward are not allowed. Gradients add up in .grad.
                extra = None if warmup else self.extra_loss(ro, mb)
                if extra is not None:
                    self.accelerator.backward(extra)
                with self._autocast():
                    new_logits, new_values = self.module(
                        ro.input_ids[mb], ro.attention_mask[mb], R, critic=ro.critic
                    )
                new_logprobs = logprobs_from_logits(new_logits / T, ro.response_ids[mb])
                new_values = new_values.float() + pp.value_prior[mb]
                pg, clip_frac, approx_kl = policy_loss(
                    new_logprobs, pp.old_logprobs[mb], pp.advantages[mb], pp.pg_mask[mb],
                    cfg.clip_range,
                )  # fmt: skip
                vf, vclip = value_loss(
                    new_values, pp.old_values[mb], pp.returns[mb], pp.vf_mask[mb],
                    cfg.clip_range_value,
                )  # fmt: skip
                loss = cfg.vf_coef * vf if warmup else pg + cfg.vf_coef * vf
                self.accelerator.backward(loss)
                # clipped apart: the critic's gradient never shrinks the policy's step
                self.accelerator.clip_grad_norm_(self._policy_params, cfg.max_grad_norm)
                self.accelerator.clip_grad_norm_(self._value_params, cfg.max_grad_norm)
                self.optimizer.step()
                for k, v in zip(  # detached scalars for the log
                    ("pg", "vf", "clip", "akl", "vclip"),
                    (pg, vf, clip_frac, approx_kl, vclip),
                    strict=True,
                ):
                    stats[k].append(v.item())
                # Early stop: the policy moved too far from the one that sampled the batch
                # (the mean over processes: every process stops after the same minibatch)
                if (
                    not warmup
                    and cfg.approx_kl_stop is not None
                    and self._global_mean(approx_kl) > cfg.approx_kl_stop
                ):
                    stop = True
                    break
            if stop:
                break
        self.module.eval()
        return stats

    def train_step(self) -> dict[str, Any]:
        """Rollout, score, compute advantages and run the PPO epochs; returns the step's log row."""
        t_start = time.perf_counter()
        ro = self.rollout(self._next_batch())
        pp = self.prepare(ro)
        stats = self.update(ro, pp)

        # KL to the reference: summed over tokens, averaged over the global batch's responses;
        # drives the controller (the same value on every process, so beta stays in step).
        B = ro.input_ids.shape[0] * self.world
        mask = pp.mask
        kl_seq = self._global_mean(pp.kl_tokens.sum(1))
        self.kl_ctl.update(kl_seq, B)
        n_tokens = float(self._sum(mask.sum()))
        step_time = time.perf_counter() - t_start
        scores = ro.scores.float()
        every = self.accelerator.gather(scores) if self.world > 1 else scores
        row = {
            "algo": self.algo,
            "step": self.step + 1,
            "reward_mean": float(every.mean()),
            "reward_std": float(every.std()) if B > 1 else 0.0,
            "kl": kl_seq,
            "kl_per_token": float(self._sum(pp.kl_tokens.sum())) / max(n_tokens, 1.0),
            "kl_coef": self.kl_ctl.value,
            "entropy": self._global_mean(pp.entropy),
            "value_mean": float(masked_mean(pp.old_values, pp.vf_mask, reduce=self._sum)),
            "clip_frac": float(np.mean(stats["clip"])),
            "approx_kl": float(np.mean(stats["akl"])),
            "policy_loss": float(np.mean(stats["pg"])),
            "value_loss": float(np.mean(stats["vf"])),
            "explained_variance": explained_variance(
                pp.old_values, pp.returns, pp.vf_mask, reduce=self._sum
            ),
            # the prior alone (NaN without one): what the learned head adds is the difference
            "explained_variance_prior": explained_variance(
                pp.value_prior, pp.returns, pp.vf_mask, reduce=self._sum
            )
            if ro.value_prior is not None
            else float("nan"),
            "response_length": n_tokens / B,
            "scheme": ro.scheme,
            "learner_share": float(self._sum(pp.pg_mask.sum())) / max(n_tokens, 1.0),
            "tokens_per_s": n_tokens / max(ro.gen_time, 1e-9),
            "gen_time_s": ro.gen_time,
            "step_time_s": step_time,
            "processes": self.world,
            "rank_weight_spread": self._rank_weight_spread(),
        }
        self.step += 1
        self.history.append(row)
        if self.step == 1 or self.step % self.cfg.sample_every == 0:
            for i, text, s in list(zip(ro.context_idx, ro.texts, scores.tolist(), strict=True))[
                : self.n_samples
            ]:
                self.samples.append(
                    {"step": self.step, **_ctx(self.contexts[i]), "response": text, "reward": s}
                )
        return row

    # -- loop, checkpoints, outputs ------------------------------------------------------------
    def train(
        self,
        steps: int | None = None,
        resume: bool = True,
        progress: bool = True,
        callback: Callable[[int, dict[str, Any]], None] | None = None,
    ) -> pd.DataFrame:
        """Run until `steps` (default rl.steps), resuming from the last checkpoint; returns the log."""
        steps = steps or self.cfg.steps
        self.total_steps = steps  # schedules that depend on the run's length (RLGF's D²LOLS)
        if resume:
            self.load_checkpoint()
        bar = tqdm(total=steps, initial=self.step, desc=self.algo, disable=not progress)
        while self.step < steps:
            row = self.train_step()
            bar.update(1)
            bar.set_postfix(reward=f"{row['reward_mean']:.3f}", kl=f"{row['kl']:.2f}")
            log.info(
                "%s step %d: reward %.4f kl %.3f beta %.4f entropy %.3f %.1fs",
                self.algo, self.step, row["reward_mean"], row["kl"], row["kl_coef"], row["entropy"], row["step_time_s"],
            )  # fmt: skip
            if self.step % self.cfg.checkpoint_every == 0 or self.step == steps:
                self.save_checkpoint()
            if callback is not None:
                callback(self.step, row)
        bar.close()
        self.save_outputs()
        return self.log_frame()

    def log_frame(self) -> pd.DataFrame:
        """The training log as a table with `LOG_COLUMNS`."""
        return pd.DataFrame(self.history, columns=list(LOG_COLUMNS))

    def save_outputs(self) -> None:
        """Final adapter (safetensors), value head, log and samples, each written atomically."""
        if not self.accelerator.is_main_process:
            return
        from safetensors.torch import save_file

        self.output_dir.mkdir(parents=True, exist_ok=True)
        _atomic_dir(self.output_dir / "adapter", lambda d: self.unwrapped.policy.save_pretrained(d))
        for name in self.unwrapped.head_names:  # value_head.safetensors (+ guide_value_head...)
            with atomic_path(self.output_dir / f"{name}.safetensors") as tmp:
                save_file(_cpu_state(getattr(self.unwrapped, name)), str(tmp))
        with atomic_path(self.output_dir / "train_log.parquet") as tmp:
            self.log_frame().to_parquet(tmp, index=False)
        with atomic_path(self.output_dir / "samples.jsonl") as tmp:
            tmp.write_text(
                "".join(
                    json.dumps(to_jsonable(s), ensure_ascii=False) + "\n" for s in self.samples
                ),
                encoding="utf-8",
            )

    def save_checkpoint(self) -> Path:
        """Adapter, value head, optimiser, KL controller, RNG states, sampler, logs and step."""
        from safetensors.torch import save_file

        root = self.output_dir / "checkpoints"
        target = root / f"step_{self.step:06d}"
        # every process's random state (each samples its own share), kept by the main process
        rngs = [_rng_state()]
        if self.world > 1:
            from accelerate.utils import gather_object

            rngs = gather_object(rngs)
        if not self.accelerator.is_main_process:
            self.accelerator.wait_for_everyone()  # until the main process has written it
            return target

        def write(d: Path) -> None:
            save_file(adapter_state(self.unwrapped.policy), str(d / "adapter_model.safetensors"))
            for name in self.unwrapped.head_names:
                save_file(_cpu_state(getattr(self.unwrapped, name)), str(d / f"{name}.safetensors"))
            torch.save(
                {
                    "step": self.step,
                    "optimizer": self.optimizer.state_dict(),
                    "kl_ctl": self.kl_ctl.state_dict(),
                    "rng": rngs[0],
                    "rng_ranks": rngs,
                    "value_initialised": sorted(self.value_initialised),
                    "history": self.history,
                    "samples": self.samples,
                },
                d / "state.pt",
            )

        _atomic_dir(target, write)
        # the adapter alone of every checkpoint stays (the reward-KL frontier of notebook 04)
        snap = self.output_dir / "snapshots" / target.name
        _atomic_dir(snap, lambda d: shutil.copy2(target / "adapter_model.safetensors", d))
        for old in sorted(root.glob("step_*"))[:-2]:  # keep the last two
            shutil.rmtree(old, ignore_errors=True)
        self.accelerator.wait_for_everyone()
        return target

    def load_checkpoint(self, path: str | Path | None = None) -> bool:
        """Restore the newest checkpoint under `output_dir/checkpoints` (or `path`); False if none."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        if path is None:
            found = sorted((self.output_dir / "checkpoints").glob("step_*"))
            if not found:
                return False
            path = found[-1]
        path = Path(path)
        # killed between the checkpoint and its frontier snapshot: write the snapshot now
        snap = self.output_dir / "snapshots" / path.name
        if self.accelerator.is_main_process and not (snap / "adapter_model.safetensors").is_file():
            _atomic_dir(snap, lambda d: shutil.copy2(path / "adapter_model.safetensors", d))
        self.accelerator.wait_for_everyone()
        set_peft_model_state_dict(
            self.unwrapped.policy, load_file(str(path / "adapter_model.safetensors"))
        )
        for name in self.unwrapped.head_names:
            getattr(self.unwrapped, name).load_state_dict(
                load_file(str(path / f"{name}.safetensors"))
            )
        state = torch.load(path / "state.pt", weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        ranks = state.get("rng_ranks", [state["rng"]])
        if len(ranks) != self.world:  # run_algorithm's marker holds the process count
            raise ValueError(
                f"{path}: saved by {len(ranks)} process(es), resumed by {self.world}; remove the "
                "checkpoints or resume with the same compute.num_processes"
            )
        _set_rng_state(ranks[self.rank])
        init = state.get("value_initialised", True)
        self.value_initialised = (
            set(init) if isinstance(init, (list, tuple, set)) else {"value_head"} if init else set()
        )
        self.history, self.samples, self.step = state["history"], state["samples"], state["step"]
        log.info("resumed %s from %s (step %d)", self.algo, path, self.step)
        return True


# ---------------------------------------------------------------------------------------------
# Small utilities
# ---------------------------------------------------------------------------------------------
def _ctx(c: Mapping[str, Any]) -> dict[str, Any]:
    return {k: c.get(k) for k in ("country", "arrangement_type", "econ_descriptor")}


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The LoRA weights of a peft model, on the CPU and contiguous (checkpoints and snapshots)."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(model).items()}


def _cpu_state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()}


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _atomic_dir(target: Path, write: Callable[[Path], Any]) -> None:
    """Fill a temporary folder with `write`, then swap it into `target` (never half-written)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        write(tmp)
        if target.exists():
            old = target.with_name(f".{target.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
