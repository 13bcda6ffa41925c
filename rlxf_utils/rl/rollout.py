"""What one batch of sampled responses carries through a PPO-family update: the `Rollout`
(prompts, responses, scores and, for RLGF, who wrote which token), what the update derives from
it (`Prepared`), and `ForcedPrefix`, the logits processor that makes one policy continue another's
prefix token for token (RLGF's roll-in)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
