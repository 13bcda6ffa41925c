"""Sequence log-probabilities of responses under a policy, and the KL and perplexity read from
them."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from rlxf_utils.models.decode import autocast_kv_cache
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
    share_prompts: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Sum of log p(response token | prompt, earlier tokens) per pair, and response token counts.

    Prompts and responses are strings (tokenised here: the prompt as `models.generation.encode_prompts`
    does unless `add_special_tokens` says otherwise, the response without) or token-id lists (used as is, e.g. the ids the policy generated;
    this avoids re-tokenisation drift at the boundary). Prompts must be exactly what the
    model was conditioned on (chat template applied). Prompt and padding positions are masked;
    position ids follow the attention mask so left and right padding give the same numbers.
    Works with any HF causal LM (`model(input_ids, attention_mask, position_ids).logits`). For a
    LoRA policy, reference log-probs come from the same model inside `with model.disable_adapter():`.

    `share_prompts` (default on): when pairs repeat a prompt (evaluation scores each prompt's k
    samples under the start policy and the base), each batch of at most `batch_size` responses
    runs its distinct prompts once into a KV cache and its responses against it, as
    `models.decode`'s sampler shares a prompt's prefill among its k samples: on a compute-bound
    CPU the cost is the tokens run, and the prompt is most of them (`_shared_logprobs`;
    bench/logprobs.py). The numbers are the one-pass path's up to rounding (float32: within
    6e-5 on the real policy's sums of up to -160; bf16 autocast: within what the one-pass path
    moves itself between padding sides or batch sizes). Otherwise (no prompt repeats, `batch_size`
    1, a model whose forward takes no KV cache, a cache with non-dynamic layers such as sliding
    windows) one forward pass per batch runs prompt + response, pairs batched by length, padded
    on `padding_side` (the tokenizer's by default); the shared path pads prompts left and
    responses right whatever `padding_side` says.
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

    n_tok = np.array([len(s) - k for s, k in seqs], dtype=np.int64)
    batches = _prompt_batches(seqs, n_tok, batch_size) if share_prompts else None
    if batches and _shared_tokens(seqs, n_tok, batches) >= _one_pass_tokens(seqs, n_tok, batch_size):  # fmt: skip
        batches = None  # padding would cost more tokens than the shared prompts save
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode(), frozen_weights_in_autocast_dtype(model):
            logp = _shared_logprobs(model, seqs, n_tok, batches, pad_id) if batches else None
            if logp is None:
                logp = _one_pass_logprobs(model, seqs, n_tok, batch_size, pad_id, side)
    finally:
        model.train(was_training)
    return logp, n_tok


def _one_pass_logprobs(
    model: Any,
    seqs: Sequence[tuple[list[int], int]],
    n_tok: np.ndarray,
    batch_size: int,
    pad_id: int,
    side: str,
) -> np.ndarray:
    """One forward pass per batch over prompt + response, pairs batched by total length."""
    import torch

    logp = np.zeros(len(seqs), dtype=np.float64)
    device = next(model.parameters()).device
    for idx in _one_pass_batches(seqs, n_tok, batch_size):
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
        tok_lp = _token_logprobs(logits[:, :-1][sel], ids[:, off + 1 :][sel])
        sums = torch.zeros(len(idx), dtype=torch.float64, device=device)
        sums.index_add_(0, rows, tok_lp.double())
        logp[idx] = sums.cpu().numpy()
    return logp


def _token_logprobs(logits: Any, targets: Any) -> Any:
    """Each row's log-probability of its target token, in float32 (the logits of the selected
    positions only: no (batch, length, vocab) log-softmax copy)."""
    lg = logits.float()
    return lg.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lg.logsumexp(-1)


def _prompt_batches(
    seqs: Sequence[tuple[list[int], int]], n_tok: np.ndarray, batch_size: int
) -> list[list[int]] | None:
    """Batches of at most `batch_size` pairs (non-empty responses only) for the shared path, or
    None when no prompt repeats (nothing to share) or a batch holds one pair.

    Pairs are grouped by prompt ids; a group stays in one batch unless it has more than
    `batch_size` pairs (then it is cut into pieces of `batch_size`, each batch prefilling its
    own prompts). Groups are ordered by their longest response, then their prompt's length, and
    packed in that order: responses are right-padded to the batch's longest, and a batch's rows
    outnumber its distinct prompts k to 1, so response padding is what ordering must limit."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for j, (s, k) in enumerate(seqs):
        if n_tok[j]:
            groups.setdefault(tuple(s[:k]), []).append(j)
    if batch_size < 2 or all(len(g) == 1 for g in groups.values()):
        return None
    pieces: list[list[int]] = []
    for g in sorted(groups.values(), key=lambda g: (max(n_tok[g]), seqs[g[0]][1])):
        g = sorted(g, key=lambda j: n_tok[j])
        pieces += [g[i : i + batch_size] for i in range(0, len(g), batch_size)]
    batches: list[list[int]] = [[]]
    for piece in pieces:
        if len(batches[-1]) + len(piece) > batch_size:
            batches.append([])
        batches[-1] += piece
    return batches


def _one_pass_batches(
    seqs: Sequence[tuple[list[int], int]], n_tok: np.ndarray, batch_size: int
) -> list[list[int]]:
    """`_one_pass_logprobs`'s batches: pairs sorted by total length, `batch_size` at a time,
    leaving out a batch whose responses are all empty."""
    order = sorted(range(len(seqs)), key=lambda j: len(seqs[j][0]))
    chunks = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    return [idx for idx in chunks if any(n_tok[j] for j in idx)]


def _one_pass_tokens(
    seqs: Sequence[tuple[list[int], int]], n_tok: np.ndarray, batch_size: int
) -> int:
    """Positions (padding included) `_one_pass_logprobs` runs: its batches, each as wide as its
    longest pair."""
    batches = _one_pass_batches(seqs, n_tok, batch_size)
    return sum(len(idx) * max(len(seqs[j][0]) for j in idx) for idx in batches)


def _shared_tokens(
    seqs: Sequence[tuple[list[int], int]], n_tok: np.ndarray, batches: Sequence[Sequence[int]]
) -> int:
    """Positions (padding included) `_shared_logprobs` runs: per batch, its distinct prompts
    padded to the longest, then every response but its last token padded to the longest. Where
    prompts repeat little and response lengths differ, this is more than the one-pass path's
    (`sequence_logprobs` then takes that one: held-out descriptions after their contexts)."""
    total = 0
    for idx in batches:
        prompts = {tuple(seqs[j][0][: seqs[j][1]]) for j in idx}
        total += len(prompts) * max(len(p) for p in prompts)
        total += len(idx) * (int(max(n_tok[j] for j in idx)) - 1)
    return total


def _shared_logprobs(
    model: Any,
    seqs: Sequence[tuple[list[int], int]],
    n_tok: np.ndarray,
    batches: Sequence[Sequence[int]],
    pad_id: int,
) -> np.ndarray | None:
    """`sequence_logprobs` with one prefill per distinct prompt of a batch, or None where the
    model cannot take it (then the one-pass path runs).

    Per batch: the distinct prompts, left-padded, run into a fresh KV cache (the autocast-dtype
    cache `sample_compact` uses: under bf16 autocast attention sees the very bf16 keys it would
    cast) with `logits_to_keep=1`, whose logits predict each response's first token; the cache
    is copied to each row (`batch_select_indices`); the responses, right-padded, without their
    last token (its logits predict nothing), run against it with the prompt's mask in front and
    positions continuing from the prompt's length. None when the cache has non-dynamic layers
    (`autocast_kv_cache`: sliding windows would need their own masks), or when the first
    prefill raises TypeError or leaves the cache empty (a forward without a KV cache)."""
    import torch

    if getattr(model, "config", None) is None or autocast_kv_cache(model) is None:
        return None
    device = next(model.parameters()).device
    logp = np.zeros(len(seqs), dtype=np.float64)
    for b, idx in enumerate(batches):
        distinct: dict[tuple[int, ...], int] = {}
        inverse = [distinct.setdefault(tuple(seqs[j][0][: seqs[j][1]]), len(distinct)) for j in idx]
        width = max(len(p) for p in distinct)
        p_ids = torch.full((len(distinct), width), pad_id, dtype=torch.long)
        p_mask = torch.zeros((len(distinct), width), dtype=torch.long)
        for d, p in enumerate(distinct):
            p_ids[d, width - len(p) :] = torch.tensor(p)
            p_mask[d, width - len(p) :] = 1
        p_pos = (p_mask.cumsum(-1) - 1).clamp(min=0)
        p_ids, p_mask, p_pos = p_ids.to(device), p_mask.to(device), p_pos.to(device)
        cache = autocast_kv_cache(model)
        try:
            first = model(
                input_ids=p_ids, attention_mask=p_mask, position_ids=p_pos,
                past_key_values=cache, use_cache=True, logits_to_keep=1,
            ).logits[:, -1]  # fmt: skip
        except TypeError:
            if b:
                raise
            log.info("model takes no KV cache: one pass over prompt and response")
            return None
        if cache.get_seq_length() != width:
            if b:
                raise RuntimeError("the model left the KV cache unfilled after the first batch")
            return None
        inv = torch.tensor(inverse, device=device)
        cache.batch_select_indices(inv)
        r_len = int(max(n_tok[j] for j in idx))
        tgt = torch.full((len(idx), r_len), pad_id, dtype=torch.long)
        valid = torch.zeros((len(idx), r_len), dtype=torch.bool)
        for row, j in enumerate(idx):
            s, k = seqs[j]
            tgt[row, : len(s) - k] = torch.tensor(s[k:])
            valid[row, : len(s) - k] = True
        tgt, valid = tgt.to(device), valid.to(device)
        sums = _token_logprobs(first[inv], tgt[:, 0]).double()  # every row has a first token
        if r_len > 1:
            r_mask = valid[:, :-1].long()
            attn = torch.cat([p_mask[inv], r_mask], 1)
            pos = p_mask.sum(-1)[inv, None] + torch.arange(r_len - 1, device=device)
            logits = model(
                input_ids=tgt[:, :-1], attention_mask=attn, position_ids=pos,
                past_key_values=cache, use_cache=True,
            ).logits  # fmt: skip
            sel = valid[:, 1:]  # logits at response position t predict token t + 1
            tok_lp = _token_logprobs(logits[sel], tgt[:, 1:][sel])
            sums.index_add_(0, sel.nonzero()[:, 0], tok_lp.double())
        logp[list(idx)] = sums.cpu().numpy()
    return logp


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
