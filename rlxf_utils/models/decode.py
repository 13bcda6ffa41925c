"""Decoding at the hardware's pace: a KV cache and frozen weights kept in the autocast dtype, a
LoRA policy sampled from merged weights, and an explicit decode loop whose finished rows leave
the batch, each row drawing from its own random stream.

transformers' `generate` keeps every row of a batch until the last one ends, feeding finished
rows padding: at the default's settings answers average ~20 of 48 tokens, so more than half of
a batch's token slots came after the answer. `sample_compact` drops a row (its KV cache, mask
and positions) as soon as it emits an end token. Its draws are inverse-CDF on one uniform per
token from a stream seeded by (seed, the row's global index): a row's tokens do not depend on
the batch it shares, its position or the batch size (only, in low precision, on the rounding of
GEMMs of another size). The distribution is transformers' own: the same float32 logits, the same
temperature / top-k / top-p warpers, the same end tokens and cap.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
from transformers.cache_utils import DynamicCache, DynamicLayer


class _AutocastKVLayer(DynamicLayer):
    """A KV-cache layer that stores keys and values in the autocast dtype while autocast is on.

    Under bf16 autocast, Llama-style keys leave the rotary embedding in float32 (an fp32 cos/sin
    times a bf16 projection), so the default cache grows in fp32 and attention (an autocast op)
    casts the whole cache to bf16 again at every decoding step. Casting each new key and value
    once, as they enter, gives attention the very same bf16 tensors (bit-identical samples) with
    half the bytes to concatenate and no per-step cast (bench/generation.py: x1.09 at 16
    responses per batch, x1.16 at 64, identical tokens)."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ):
        kind = key_states.device.type
        if torch.is_autocast_enabled(kind):
            dtype = torch.get_autocast_dtype(kind)
            key_states, value_states = key_states.to(dtype), value_states.to(dtype)
        return super().update(key_states, value_states, *args, **kwargs)


def autocast_kv_cache(model: Any) -> Any | None:
    """A fresh dynamic KV cache for `model` whose layers keep the autocast dtype, or None when the
    model's cache has other layer types (sliding windows...): those keep transformers' default."""
    cache = DynamicCache(config=model.config)
    if not cache.layers or any(type(layer) is not DynamicLayer for layer in cache.layers):
        return None
    cache.layers = [_AutocastKVLayer() for _ in cache.layers]
    return cache


@contextlib.contextmanager
def frozen_weights_in_autocast_dtype(model: Any) -> Iterator[None]:
    """Inside this context, under autocast, every frozen float32 `nn.Linear` weight of `model`
    (the base model's projections and LM head under LoRA; inactive adapters) is a copy already
    in the autocast dtype; on leaving, the original parameters are back (a tied LM head is tied
    again). Outside autocast, or with nothing to cast, it does nothing.

    Autocast re-casts a weight at every call unless it requires grad (its cast cache is for
    trainable leaves, and `autocast()` turns even that off), so each decoding step of a LoRA
    policy cast all 135M frozen base weights again: at 16 responses per batch, longer than the
    step's matmuls. Casting once gives every matmul the very same bf16 operands (the same
    rounding of the same weights): identical tokens and log-probs (tests/test_models.py;
    bench/generation.py: x1.6 at 16 responses per batch, x1.25 at 64). Trainable weights are
    untouched; the copy costs the frozen weights' size in the autocast dtype while the context is
    open. Embeddings keep float32 (their lookup is no autocast op). For no-grad work only
    (generation, scoring): a backward pass inside would reach the copies, not the weights."""
    kind = _device_type(model)
    if not torch.is_autocast_enabled(kind):
        yield
        return
    dtype = torch.get_autocast_dtype(kind)
    saved = [
        (mod, mod.weight)
        for mod in model.modules()
        if isinstance(mod, torch.nn.Linear)
        and isinstance(mod.weight, torch.nn.Parameter)
        and not mod.weight.requires_grad
        and mod.weight.dtype == torch.float32
    ]
    try:
        with torch.no_grad():
            for mod, weight in saved:
                mod.weight = torch.nn.Parameter(weight.to(dtype), requires_grad=False)
        yield
    finally:
        for mod, weight in saved:
            mod.weight = weight


def _device_type(model: Any) -> str:
    param = next(model.parameters(), None)
    return param.device.type if param is not None else "cpu"


def row_uniforms(seed: int, rows: Sequence[int], n: int) -> torch.Tensor:
    """(len(rows), n) float64 uniforms in [0, 1): row r's are the first n of its own stream,
    seeded by (seed, r) through numpy's SeedSequence (well mixed, independent of the others)."""
    out = torch.empty(len(rows), n, dtype=torch.float64)
    for i, r in enumerate(rows):
        state = int(np.random.SeedSequence([int(seed), int(r)]).generate_state(1, np.uint64)[0])
        gen = torch.Generator().manual_seed(state & (2**63 - 1))
        out[i] = torch.rand(n, generator=gen, dtype=torch.float64)
    return out


def draw(scores: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row from softmax(scores) by inverse CDF at uniforms `u` (B,): the first
    token whose cumulative probability exceeds u x the total. Tokens of probability 0 (filtered
    to -inf) are never drawn."""
    probs = torch.softmax(scores.float(), dim=-1).double()
    cdf = probs.cumsum(-1)
    idx = torch.searchsorted(cdf, (u.to(cdf) * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    over = idx >= probs.shape[1]  # u x total rounded up to the total: the last possible token
    if over.any():
        last = probs.shape[1] - 1 - (probs[over].flip(-1) > 0).long().argmax(-1)
        idx[over] = last
    return idx


@dataclass
class Sampled:
    """What `sample_compact` returns: response ids (B, L) with `pad_id` after the first end
    token, L the longest response; the log-probability of each sampled token under the
    distribution it was drawn from (after temperature and top-p; 0 past the end)."""

    ids: torch.Tensor
    logprobs: torch.Tensor


@torch.no_grad()
def sample_compact(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    stop_ids: Sequence[int],
    pad_id: int,
    seed: int,
    rows: Sequence[int] | None = None,
    top_k: int = 0,
    prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
    adapter_names: Sequence[str] | None = None,
    step: Any = None,
) -> Sampled:
    """Sample a response for each left-padded prompt of the batch, dropping rows as they end.

    `rows`: each row's global index (its random stream; default 0..B-1). `prefix` = (ids (B, H),
    lengths (B,)): row i's first lengths[i] tokens are ids[i] (RLGF's roll-in, continued token
    for token). `adapter_names`: peft's mixed-adapter batch, one adapter per row. `step`: the
    forward to call (default `model`; a compiled one). Runs under the caller's autocast, with
    the KV cache and frozen weights in the autocast dtype as `generate` does.

    Rows with the same prompt (and adapter), such as a prompt's k samples or an RL group's
    responses, share one prefill: the prompt's keys, values and next-token logits are computed
    once and copied to each of its rows (`shared_prefill`).
    """
    device, B = input_ids.device, input_ids.shape[0]
    rows = list(range(B)) if rows is None else list(rows)
    warpers = [TemperatureLogitsWarper(temperature)] if temperature != 1.0 else []
    warpers += [TopKLogitsWarper(top_k)] if top_k else []
    warpers += [TopPLogitsWarper(top_p)] if top_p < 1.0 else []
    u = row_uniforms(seed, rows, max_new_tokens).to(device)
    stop = torch.tensor(sorted(stop_ids), device=device)
    ids_out = torch.full((B, max_new_tokens), pad_id, dtype=torch.long, device=device)
    lp_out = torch.zeros(B, max_new_tokens, device=device)
    alive = torch.arange(B, device=device)  # the original row of each row still in the batch
    names = list(adapter_names) if adapter_names else None
    cache = autocast_kv_cache(model) or DynamicCache(config=model.config)
    mask = attention_mask.long()
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # as generate: real tokens from 0
    ids, n = input_ids, 0
    forward = step or model
    share = shared_prefill(input_ids, attention_mask, names)
    with frozen_weights_in_autocast_dtype(model):
        for t in range(max_new_tokens):
            prefill = t == 0 and share is not None  # the distinct prompts only
            sel = share[0] if prefill else slice(None)
            extra = {}
            if names:
                extra["adapter_names"] = [names[i] for i in share[0].tolist()] if prefill else names
            out = forward(
                input_ids=ids[sel], attention_mask=mask[sel], position_ids=pos[sel],
                past_key_values=cache, use_cache=True, logits_to_keep=1, **extra,
            )  # fmt: skip
            logits = out.logits[:, -1]
            if prefill:  # each row takes its prompt's keys, values and logits
                logits = logits[share[1]]
                cache.batch_select_indices(share[1])
            scores = logits.float()
            for w in warpers:
                scores = w(ids, scores)
            tok = draw(scores, u[alive, t])
            if prefix is not None:
                forced = prefix[1][alive] > t
                if forced.any() and t < prefix[0].shape[1]:
                    tok = torch.where(forced, prefix[0][alive, t], tok)
            ids_out[alive, t] = tok
            lp_out[alive, t] = torch.log_softmax(scores, -1).gather(1, tok[:, None]).squeeze(1)
            n = t + 1
            done = torch.isin(tok, stop)
            if done.all():
                break
            if done.any():  # finished rows leave: their cache, mask, positions
                keep = (~done).nonzero().squeeze(1)
                cache.batch_select_indices(keep)
                alive, tok, mask, pos = alive[keep], tok[keep], mask[keep], pos[keep]
                names = [names[i] for i in keep.tolist()] if names else None
            ids = tok[:, None]
            mask = torch.cat([mask, mask.new_ones(len(alive), 1)], 1)
            pos = pos[:, -1:] + 1
    return Sampled(ids_out[:, :n], lp_out[:, :n])


def shared_prefill(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, adapter_names: Sequence[str] | None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(first row of each distinct prompt, each row's index into them) when some rows repeat a
    prompt (same padded ids and mask, same adapter), else None: the prefill runs on the distinct
    prompts only and each row copies its prompt's cache and logits (one prefill for a prompt's
    k samples)."""
    keys: dict[tuple, int] = {}
    first: list[int] = []
    inverse: list[int] = []
    ids, mask = input_ids.tolist(), attention_mask.tolist()
    for i in range(len(ids)):
        key = (tuple(ids[i]), tuple(mask[i]), adapter_names[i] if adapter_names else None)
        if key not in keys:
            keys[key] = len(first)
            first.append(i)
        inverse.append(keys[key])
    if len(first) == len(ids):
        return None
    device = input_ids.device
    return torch.tensor(first, device=device), torch.tensor(inverse, device=device)


def compiled_forward(model: Any) -> Any:
    """`model`'s forward through `torch.compile` (inductor, dynamic shapes: the batch shrinks and
    the cache grows every step), for `sample_compact(step=...)`; compiled once per model."""
    step = getattr(model, "_rlxf_compiled_forward", None)
    if step is None:
        step = torch.compile(model.forward, dynamic=True)
        model._rlxf_compiled_forward = step
    return step


@contextlib.contextmanager
def merged_lora(model: Any) -> Iterator[None]:
    """Inside this context, a peft LoRA model runs its active adapter merged into a copy of the
    weights: each adapted layer's base weight is W + scale x B A (computed in float32, stored in
    the autocast dtype when autocast is on, else in W's), and the adapter layers are off. On
    leaving, the original weights and adapters are back, bit for bit (nothing is merged in
    place, so bf16 weights do not drift through merge / unmerge round trips). A model without
    LoRA, or with adapters already off, is left as it is. `model` may be the peft model or the
    model inside it (transformers' `generate`, reached through peft or TRL).

    Sampling then costs what the plain model costs: no per-layer adapter matmuls (issue 44: the
    unmerged adapter cost 1.8x on an H100). The logits differ from the unmerged model's only by
    rounding (tests/test_decode.py). For no-grad work only."""
    from peft.tuners.lora import LoraLayer

    layers = [
        m
        for m in model.modules()
        if isinstance(m, LoraLayer)
        and not m.disable_adapters
        and any(a in m.lora_A for a in m.active_adapters)
    ]
    if not layers:
        yield
        return
    kind = next(model.parameters()).device.type
    saved = []
    with torch.no_grad():
        for layer in layers:
            base = layer.get_base_layer()
            w = base.weight
            merged = w.float() + sum(
                layer.get_delta_weight(a).float()
                for a in layer.active_adapters
                if a in layer.lora_A
            )
            dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else w.dtype
            grads = [(p, p.requires_grad) for p in layer.parameters() if p is not w]
            saved.append((layer, base, w, grads))
            base.weight = torch.nn.Parameter(merged.to(dtype), requires_grad=False)
            layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer, base, w, grads in saved:
            base.weight = w
            layer.enable_adapters(True)  # peft sets the adapters' requires_grad: put it back
            for p, flag in grads:
                p.requires_grad_(flag)


#: `evaluation.batch_size: auto` on a CPU: the largest batch bench/generation.py measured to
#: pay on two cores (64 ran 1.6x the responses/s of 16; larger GEMMs, the same answers).
CPU_AUTO_BATCH = 64
#: ... and at most this many rows on an accelerator, whatever its free memory.
MAX_AUTO_BATCH = 1024


def sequence_bytes(config: Any, prompt_tokens: int, max_new_tokens: int, dtype_bytes: int) -> int:
    """Accelerator memory one sampled row can hold at its peak: its KV cache at full length
    (2 x layers x KV heads x head dim x tokens), the prefill's widest activations (the MLP's
    intermediate and the attention scores over the prompt) and two float32 rows of logits. An
    upper bound, not a measurement: `auto_batch_size` spends only a fraction of free memory."""
    hidden = int(config.hidden_size)
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    layers = int(config.num_hidden_layers)
    inter = int(getattr(config, "intermediate_size", None) or 4 * hidden)
    total = prompt_tokens + max_new_tokens
    kv = 2 * layers * kv_heads * head_dim * total * dtype_bytes
    prefill = prompt_tokens * (2 * inter + 4 * hidden) * dtype_bytes
    scores = heads * prompt_tokens * prompt_tokens * 4
    logits = 2 * int(config.vocab_size) * 4 * 2
    return kv + prefill + scores + logits


def auto_batch_size(
    model: Any,
    prompt_tokens: int,
    max_new_tokens: int,
    *,
    free_bytes: int | None = None,
    fraction: float = 0.8,
    n_items: int | None = None,
) -> int:
    """The generation batch for `evaluation.batch_size: auto`: on a CPU `CPU_AUTO_BATCH`; on an
    accelerator, as many rows as `fraction` of its free memory holds (`torch.cuda.mem_get_info`
    after the weights, merged LoRA included, are in place) at `sequence_bytes` each, rounded down
    to a multiple of 8, at least 1 and at most `MAX_AUTO_BATCH` (and never more than the
    `n_items` there are)."""
    param = next(model.parameters())
    if param.device.type != "cuda" and free_bytes is None:
        batch = CPU_AUTO_BATCH
    else:
        if free_bytes is None:
            free_bytes, _ = torch.cuda.mem_get_info(param.device)
        kind = param.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else param.dtype
        config = getattr(model, "config", None)
        per_row = sequence_bytes(config, prompt_tokens, max_new_tokens, dtype.itemsize)
        batch = int(fraction * free_bytes // per_row)
        batch = min(MAX_AUTO_BATCH, batch - batch % 8 if batch >= 8 else max(batch, 1))
    return max(1, min(batch, n_items)) if n_items else batch
