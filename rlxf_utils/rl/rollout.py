"""What one batch of sampled responses carries through a PPO-family update: the `Rollout`
(prompts, responses, scores and, for RLGF, who wrote which token), what the update derives from
it (`Prepared`), and `ForcedPrefix`, the logits processor that makes one policy continue another's
prefix token for token (RLGF's roll-in), and `sample_rollout`, how a PPO-family rollout samples."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlxf_utils.models.decode import merged_lora, sample_compact


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


def sample_rollout(
    model: Any,
    enc: Mapping[str, torch.Tensor],
    *,
    compact: bool,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    stop_ids: Sequence[int],
    pad_id: int,
    seed: int,
    rows: Sequence[int] | None,
    prefix: tuple[torch.Tensor, torch.Tensor] | None,
    autocast: Callable[[], Any],
    generation_kwargs: Mapping[str, Any],
) -> tuple[torch.Tensor, torch.Tensor]:
    """A response per prompt of `enc` from `model`: (response ids padded after the first end
    token, response mask up to and including it).

    `compact`: `models.decode.sample_compact` from the LoRA merged into a copy of the weights,
    dropping finished rows, row i drawing from the stream of (`seed`, `rows[i]`, default i).
    Otherwise transformers' `generate` (the path before issue 44), with `generation_kwargs`
    overriding its defaults (benchmarks). `prefix` = (ids (B, H), lengths (B,)): the first
    `lengths[i]` tokens of response i are forced to `ids[i]` (RLGF's roll-in). `autocast`: the
    caller's autocast context."""
    if compact:
        with autocast(), merged_lora(model):
            response = sample_compact(
                model, enc["input_ids"], enc["attention_mask"], max_new_tokens=max_new_tokens,
                temperature=temperature, top_p=top_p, stop_ids=stop_ids, pad_id=pad_id,
                seed=seed, rows=rows, prefix=prefix,
            ).ids  # fmt: skip
    else:
        from transformers import LogitsProcessorList

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
            max_new_tokens=max_new_tokens,
            pad_token_id=pad_id,
            eos_token_id=list(stop_ids),
            use_cache=True,  # KV cache: each new token attends to cached keys/values
            logits_processor=processors,
        )
        kwargs.update(generation_kwargs)  # benchmarks and tests may override the defaults
        with autocast():
            out = model.generate(
                input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], **kwargs
            )
        response = out[:, enc["input_ids"].shape[1] :]
    # Response mask: tokens up to and including the first end token (pad may equal EOS).
    is_eos = torch.isin(response, torch.tensor(list(stop_ids), device=response.device))
    after_eos = (is_eos.cumsum(-1) - is_eos.long()) > 0
    response_mask = (~after_eos).long()
    response = torch.where(response_mask.bool(), response, torch.full_like(response, pad_id))
    return response, response_mask
