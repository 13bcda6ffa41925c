"""The shared RL core: masked statistics, log-probs and entropy from logits, GAE, the clipped
policy and value losses, explained variance, the KL controllers, the value heads and the prompt
schedule every algorithm shares."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

RewardFn = Callable[[list[dict[str, Any]], list[str]], np.ndarray]
"""reward_fn(contexts, texts) -> one scalar per text (here: the reward model's calibrated P(MET))."""


#: One row per step; GRPO/RLOO (rlxf_utils.rl) write the same columns, NaN where not meaningful.
#: `kl` is nats per response on the learner's own tokens with the estimator `kl_estimator` names
#: (`KL_ESTIMATORS`); `kl_k3` the k3 estimate beside it; `kl_all_tokens` counts every token of the
#: response (RLGF: the guide's too); `reward_learner` scores only responses the learner wrote
#: every token of (RLGF mixes guide-written responses into `reward_mean`).
LOG_COLUMNS: tuple[str, ...] = (
    "algo",
    "step",
    "reward_mean",
    "reward_learner",
    "reward_std",
    "kl",
    "kl_k3",
    "kl_all_tokens",
    "kl_estimator",
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


#: What each family's logged `kl` is (the `kl_estimator` column of its rows).
KL_ESTIMATORS = {
    "ppo": "k1, sum of log pi - log pi_ref over the learner's tokens of each response (k3 beside)",
    "grpo": "TRL's k3 per token x mean response length (the step's first minibatch)",
    "rloo": "TRL's k1 per token x mean response length (the batch's mean summed k1)",
    "ilhf_online": "k1 of the ensemble's mixture density on its own samples",
    "ilhf_history": "none (history mode samples nothing)",
    "offline": "none (no samples of the policy in training; evaluation measures KL to the start policy)",
}


def k3_tokens(log_ratio: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 per token, (r - 1) - log r with r = pi_ref / pi = exp(-log_ratio): unbiased for
    KL(pi || pi_ref) on samples from pi, never negative."""
    return torch.expm1(-log_ratio) + log_ratio


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


class AdaptiveKLController:
    """Adaptive beta that moves smoothly: in log space, on a smoothed KL, a bounded factor a step.

        s_t = KL_1 (t = 1),  (1 - w) s_{t-1} + w KL_t (t > 1)       w = `rl.kl_smoothing`
        e_t = clip(log2(s_t / target), -1, 1)
        beta_{t+1} = clip(beta_t r^{e_t} (e_t > 0) or beta_t r^{e_t / 2} (e_t < 0),
                          beta_min, beta_max)                        r = `rl.kl_step_ratio`

    At most a factor r a step up (1.5 in the profiles) and sqrt(r) down: every run starts at KL 0,
    and beta must not be wound down before the policy has moved. The error saturates at a factor
    2 off target, and the controller acts on the smoothed KL, not on one minibatch's KL or a
    look-ahead along its last change. The controller it replaces crossed [0.01, 100] in a quarter
    of the run (x10 a step at the default's 16 steps) on a one-step look-ahead, and swung beta
    between its bounds (issue 78); tests/test_kl_control.py shows that one fails the bounds this
    one keeps. `kl_coef_range` stays a guard: the report counts the steps beta sat at a bound.
    """

    #: beta falls at this fraction of the (log) rate at which it rises
    DOWN = 0.5

    def __init__(
        self,
        init: float,
        target: float,
        beta_range: tuple[float, float] = (0.01, 100.0),
        step_ratio: float = 1.5,
        smoothing: float = 0.5,
    ):
        low, high = (float(b) for b in beta_range)
        if not 0 < low < high:
            raise ValueError(f"rl.kl_coef_range must be 0 < low < high; got {beta_range}")
        if not step_ratio > 1:
            raise ValueError(f"rl.kl_step_ratio must be above 1; got {step_ratio}")
        if not 0 < smoothing <= 1:
            raise ValueError(f"rl.kl_smoothing must be in (0, 1]; got {smoothing}")
        self.value = float(np.clip(float(init), low, high))
        self.target, self.low, self.high = float(target), low, high
        self.gain, self.smoothing = math.log(float(step_ratio)), float(smoothing)
        self.smoothed: float | None = None

    def update(self, current_kl: float, n_steps: int = 1) -> None:
        """Move beta once for this step's KL per response (nats); a NaN KL leaves it alone."""
        kl = float(current_kl)
        if not math.isfinite(kl):
            return
        w = self.smoothing
        s = kl if self.smoothed is None else (1 - w) * self.smoothed + w * kl
        self.smoothed = s
        error = -1.0 if s <= 0 else float(np.clip(math.log2(s / self.target), -1, 1))
        step = self.gain * error * (1.0 if error > 0 else self.DOWN)
        self.value = float(np.clip(self.value * math.exp(step), self.low, self.high))

    def state_dict(self) -> dict[str, float | None]:
        return {"value": self.value, "target": self.target, "smoothed": self.smoothed}

    def load_state_dict(self, state: Mapping[str, float | None]) -> None:
        self.value = float(state["value"])  # type: ignore[arg-type]
        prev = state.get("smoothed")
        self.smoothed = None if prev is None else float(prev)


def kl_controller(rl: Any) -> AdaptiveKLController | FixedKLController:
    """The KL coefficient's controller every RL algorithm uses (`rl.adaptive_kl`, `rl.kl_coef`,
    `rl.target_kl`, `rl.kl_coef_range`, `rl.kl_step_ratio`, `rl.kl_smoothing`; `rl` an
    `RLConfig`): updated once per step with the step's mean KL per response, in nats (PPO and
    the RLGF algorithms: `PPOTrainer.train_step`; GRPO and RLOO: `trl_runs.beta_control`)."""
    if not rl.adaptive_kl:
        return FixedKLController(rl.kl_coef)
    return AdaptiveKLController(rl.kl_coef, rl.target_kl, tuple(rl.kl_coef_range),
                                rl.kl_step_ratio, rl.kl_smoothing)  # fmt: skip


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, value: float):
        self.value = float(value)

    def update(self, current_kl: float, n_steps: int = 1) -> None:
        """No-op: the coefficient stays fixed."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        self.value = float(state["value"])


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


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The LoRA weights of a peft model, on the CPU and contiguous (checkpoints and snapshots)."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(model).items()}


def cpu_state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()}
