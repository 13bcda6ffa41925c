"""Sequence log-probabilities of responses under a policy, and the KL and perplexity read from
them."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from rlxf_utils.models.generation import encode_prompts, frozen_weights_in_autocast_dtype

log = logging.getLogger(__name__)


def _as_ids(
    tokenizer: Any, item: str | Sequence[int], add_special_tokens: bool | None
) -> list[int]:
    if isinstance(item, str):
        if add_special_tokens is None:  # a prompt: tokenised exactly as the policy saw it
            return list(encode_prompts(tokenizer, [item])["input_ids"][0])
        return list(tokenizer(item, add_special_tokens=add_special_tokens)["input_ids"])
    return [int(i) for i in item]


def _forward_logits(model: Any, ids: Any, attn: Any, pos: Any, keep: int | None) -> Any:
    """Logits of the last `keep` positions (all when None), with position ids when the model
    takes them (left padding is then exact) and `logits_to_keep` when it takes that."""
    kw = {"logits_to_keep": keep} if keep is not None else {}
    try:
        return model(input_ids=ids, attention_mask=attn, position_ids=pos, **kw).logits
    except TypeError:
        if kw:  # a model without logits_to_keep: every position
            return _forward_logits(model, ids, attn, pos, None)
        log.warning("model takes no position_ids; left padding may shift positions")
        return model(input_ids=ids, attention_mask=attn).logits


def sequence_logprobs(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str | Sequence[int]],
    responses: Sequence[str | Sequence[int]],
    batch_size: int = 8,
    add_special_tokens: bool | None = None,
    append_eos: bool = False,
    padding_side: str | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Sum of log p(response token | prompt, earlier tokens) per pair, and response token counts.

    Prompts and responses are strings (tokenised here: the prompt as `models.generation.encode_prompts`
    does unless `add_special_tokens` says otherwise, the response without) or token-id lists (used as is, e.g. the ids the policy generated;
    this avoids re-tokenisation drift at the boundary). Prompts must be exactly what the
    model was conditioned on (chat template applied). One forward pass per batch; prompt and
    padding positions are masked; position ids follow the attention mask so left and right
    padding give the same numbers. Pairs are batched by length to limit padding. Works with
    any HF causal LM (`model(input_ids, attention_mask, position_ids).logits`). For a LoRA
    policy, reference log-probs come from the same model inside `with model.disable_adapter():`.
    """
    import torch

    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    side = padding_side or getattr(tokenizer, "padding_side", "right")
    if side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right'; got {side!r}")
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        pad_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    seqs: list[tuple[list[int], int]] = []  # (ids, number of prompt tokens)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        p_ids = _as_ids(tokenizer, p, add_special_tokens)
        r_ids = _as_ids(tokenizer, r, False)
        if append_eos and tokenizer.eos_token_id is not None:
            r_ids = [*r_ids, int(tokenizer.eos_token_id)]
        if not p_ids:
            raise ValueError(f"pair {i}: empty prompt; the first response token has no context")
        seqs.append((p_ids + r_ids, len(p_ids)))

    n = len(seqs)
    logp = np.zeros(n, dtype=np.float64)
    n_tok = np.array([len(s) - k for s, k in seqs], dtype=np.int64)
    order = sorted(range(n), key=lambda j: len(seqs[j][0]))
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode(), frozen_weights_in_autocast_dtype(model):
            for start in range(0, n, batch_size):
                idx = order[start : start + batch_size]
                if all(n_tok[j] == 0 for j in idx):
                    continue
                width = max(len(seqs[j][0]) for j in idx)
                ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
                attn = torch.zeros((len(idx), width), dtype=torch.long)
                target = torch.zeros((len(idx), width), dtype=torch.bool)
                for row, j in enumerate(idx):
                    s, k = seqs[j]
                    off = width - len(s) if side == "left" else 0
                    ids[row, off : off + len(s)] = torch.tensor(s)
                    attn[row, off : off + len(s)] = 1
                    target[row, off + k : off + len(s)] = True
                pos = (attn.cumsum(-1) - 1).clamp(min=0)
                ids, attn, pos = ids.to(device), attn.to(device), pos.to(device)
                # left padding puts every response at the end: the LM head runs only on the last
                # `keep` positions (the longest response and the token before it), not the prompts
                keep = int(max(n_tok[j] for j in idx)) + 1 if side == "left" else width
                logits = _forward_logits(model, ids, attn, pos, keep if keep < width else None)
                off = width - logits.shape[1]  # positions before the kept ones
                # only response positions: the full (batch, length, vocab) float copy is avoided
                sel = target[:, off + 1 :].to(device)
                rows = sel.nonzero()[:, 0]
                lg = logits[:, :-1][sel].float()
                tgt = ids[:, off + 1 :][sel]
                tok_lp = lg.gather(-1, tgt.unsqueeze(-1)).squeeze(-1) - lg.logsumexp(-1)
                sums = torch.zeros(len(idx), dtype=torch.float64, device=device)
                sums.index_add_(0, rows, tok_lp.double())
                sums = sums.cpu().numpy()
                logp[idx] = sums
    finally:
        model.train(was_training)
    return logp, n_tok


def kl_estimate(
    logp_policy: Sequence[float] | np.ndarray,
    logp_ref: Sequence[float] | np.ndarray,
    n_tokens: Sequence[int] | np.ndarray | None = None,
) -> dict[str, float]:
    """Monte-Carlo KL(policy || ref) in nats from responses sampled from the policy.

    For y ~ policy, mean(log p_policy(y) - log p_ref(y)) is an unbiased estimate of the
    sequence-level KL; single terms may be negative, the mean is not in expectation. `kl_se` is
    the standard error over responses; with `n_tokens`, `kl_per_token` = sum of differences /
    sum of tokens.
    """
    lp = np.asarray(logp_policy, dtype=float)
    lr = np.asarray(logp_ref, dtype=float)
    if lp.shape != lr.shape:
        raise ValueError(f"aligned arrays expected; got {lp.shape} vs {lr.shape}")
    d = lp - lr
    n = int(d.size)
    out = {
        "n": n,
        "kl": float(d.mean()) if n else math.nan,
        "kl_se": float(d.std(ddof=1) / math.sqrt(n)) if n > 1 else math.nan,
    }
    if n_tokens is not None:
        tok = np.asarray(n_tokens, dtype=float)
        out["kl_per_token"] = float(d.sum() / tok.sum()) if tok.sum() > 0 else math.nan
    return out


def perplexity(
    logp_ref: Sequence[float] | np.ndarray, n_tokens: Sequence[int] | np.ndarray
) -> float:
    """exp(-sum log p / sum tokens): per-token perplexity of responses under the reference model.

    A fluency proxy: RL that drifts into text the reference finds unlikely raises it.
    """
    lp = np.asarray(logp_ref, dtype=float)
    tok = np.asarray(n_tokens, dtype=float)
    total = tok.sum()
    return float(math.exp(-lp.sum() / total)) if total > 0 else math.nan
