"""Prompting and sampling: chat formatting, left-padded encoding, autocast, a KV cache and frozen
weights kept in the autocast dtype, end tokens, response post-processing and batched generation."""

from __future__ import annotations

import contextlib
import re
import types
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pandas as pd
import torch
from transformers import (
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.cache_utils import DynamicCache, DynamicLayer

from rlxf_utils.config import PolicyConfig, RLConfig
from rlxf_utils.prompts import build_policy_prompt


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


def _generate_with_autocast_cache(self: Any, *args: Any, **kwargs: Any) -> Any:
    if kwargs.get("past_key_values") is None and torch.is_autocast_enabled(self.device.type):
        cache = autocast_kv_cache(self)
        if cache is not None:
            kwargs["past_key_values"] = cache
    with frozen_weights_in_autocast_dtype(self):
        return type(self).generate(self, *args, **kwargs)


def cache_in_autocast_dtype(model: PreTrainedModel) -> PreTrainedModel:
    """Make `model.generate` (also when called through peft or TRL, which reach this model's
    method), whenever it runs under autocast, use `autocast_kv_cache` and
    `frozen_weights_in_autocast_dtype`: the same samples, faster. Outside autocast generation is
    unchanged; a cache the caller passes is kept."""
    model.generate = types.MethodType(_generate_with_autocast_cache, model)
    return model


def format_prompt(
    tokenizer: PreTrainedTokenizerBase,
    text: str,
    use_chat_template: bool = True,
    system_prompt: str | None = None,
) -> str:
    """The policy's input string: the chat template when the tokenizer has one, plain text otherwise."""
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": text})
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return text if system_prompt is None else f"{system_prompt}\n\n{text}"


def build_prompts(
    contexts: Sequence[Mapping[str, Any]],
    tokenizer: PreTrainedTokenizerBase,
    template: str,
    cfg: PolicyConfig,
) -> list[str]:
    """Policy inputs for each context: the paper's template, then the chat format."""
    return [
        format_prompt(
            tokenizer, build_policy_prompt(c, template), cfg.use_chat_template, cfg.system_prompt
        )
        for c in contexts
    ]


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str], **kwargs: Any
) -> Any:
    """Token ids of formatted prompts, identical in SFT, PPO, TRL and evaluation.

    A chat template already writes every special token (LLaMA-2's emits BOS itself), so a
    templated prompt (one that starts with BOS or another special token's text) is tokenised
    with `add_special_tokens=False`: no doubled BOS. A plain-text prompt gets the tokenizer's
    usual special tokens.
    """
    specials = tuple(
        t for t in {getattr(tokenizer, "bos_token", None), *getattr(tokenizer, "all_special_tokens", [])} if t
    )  # fmt: skip
    templated = [bool(specials) and p.startswith(specials) for p in prompts]
    if len(set(templated)) > 1:
        raise ValueError("prompts mix templated and plain text; format them all the same way")
    add = not (templated[0] if templated else False)
    return tokenizer(list(prompts), add_special_tokens=add, **kwargs)


def autocast(dtype: str | None, device: str | torch.device = "cpu") -> Any:
    """torch.autocast for `policy.autocast` ('bfloat16') on `device`; a no-op context for None."""
    if dtype is None:
        return contextlib.nullcontext()
    kind = torch.device(device).type
    # cache_enabled=False: autocast otherwise casts each trainable weight once per context and
    # reuses the copy, so a whole training loop run inside one context (TRL's train()) would
    # keep sampling and scoring with the weights it started from
    return torch.autocast(device_type=kind, dtype=DTYPES[dtype], cache_enabled=False)


_SPECIAL = re.compile(r"<\|[^|>]{1,40}\|>|</?s>")


_ROLE_PREFIX = re.compile(r"^\s*(assistant|answer|proposed condition|condition)\s*[:\-]\s*", re.I)


def postprocess_response(text: str, mode: str = "strip_boilerplate") -> str:
    """Text that the reward model scores: 'none' keeps it; 'strip_boilerplate' drops chat tokens,
    a leading role/label prefix and surrounding whitespace (applied identically in evaluation)."""
    if mode == "none":
        return text
    if mode != "strip_boilerplate":
        raise ValueError(
            f"rl.response_postprocess={mode!r}; expected 'none' or 'strip_boilerplate'"
        )
    text = _SPECIAL.sub(" ", text)
    text = _ROLE_PREFIX.sub("", text)
    return " ".join(text.split())


def eos_ids(model: Any, tokenizer: Any) -> set[int]:
    """Token ids that end a response (the tokenizer's EOS and the generation config's)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    gen = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids |= set(gen if isinstance(gen, (list, tuple)) else [gen] if gen is not None else [])
    return {int(i) for i in ids}


def trim_response(ids: Sequence[int], stop: set[int]) -> list[int]:
    """Generated ids up to and including the first end token (later ids are padding)."""
    out: list[int] = []
    for t in ids:
        out.append(int(t))
        if int(t) in stop:
            break
    return out


@torch.no_grad()
def generate(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    k: int,
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    postprocess: str,
    seed: int,
    batch_size: int = 16,
    desc: str = "generate",
    progress: bool = True,
    adapter_names: Sequence[str] | None = None,
) -> pd.DataFrame:
    """k sampled responses per prompt, batched with left padding and the KV cache.

    `adapter_names` (one per prompt): the LoRA adapter that answers each prompt, in one batch
    (peft's mixed-adapter batches; an ILHF ensemble's Thompson draw).

    Rows: prompt_id, sample_id, prompt_ids, response_ids (trimmed after the first end token),
    raw (decoded), response (post-processed, what the reward model scores), n_tokens, finished
    (the response ended with an end token before `max_new_tokens`).
    """
    from tqdm.auto import tqdm

    torch.manual_seed(seed)
    model.eval()
    stop = eos_ids(model, tokenizer)
    device = next(model.parameters()).device
    items = [(i, j) for i in range(len(prompts)) for j in range(k)]
    rows: list[dict[str, Any]] = []
    starts = range(0, len(items), batch_size)
    for start in tqdm(starts, desc=desc, disable=not progress, leave=False):
        batch = items[start : start + batch_size]
        enc = encode_prompts(
            tokenizer, [prompts[i] for i, _ in batch], return_tensors="pt", padding=True
        ).to(device)
        out = model.generate(
            **enc,
            do_sample=True,
            temperature=temperature,
            top_p=top_p,
            top_k=0,
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=sorted(stop) or None,
            **({"adapter_names": [adapter_names[i] for i, _ in batch]} if adapter_names else {}),
        )
        width = enc["input_ids"].shape[1]
        for row, (i, j) in enumerate(batch):
            prompt = enc["input_ids"][row][enc["attention_mask"][row].bool()].tolist()
            resp = trim_response(out[row, width:].tolist(), stop)
            raw = tokenizer.decode(resp, skip_special_tokens=True)
            rows.append(
                {
                    "prompt_id": i,
                    "sample_id": j,
                    "prompt_ids": prompt,
                    "response_ids": resp,
                    "raw": raw,
                    "response": postprocess_response(raw, postprocess),
                    "n_tokens": len(resp),
                    "finished": bool(resp) and resp[-1] in stop,
                }
            )
    return pd.DataFrame(rows)


def sample_responses(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    rl: RLConfig,
    seed: int = 0,
    batch_size: int = 8,
    use_adapters: bool = True,
    adapter_names: Sequence[str] | None = None,
) -> list[str]:
    """Sample one post-processed response per prompt (adapters off = the starting policy;
    `adapter_names`: the adapter answering each prompt, e.g. an ILHF ensemble's particles)."""

    ctx = (
        model.disable_adapter()
        if (not use_adapters and hasattr(model, "disable_adapter"))
        else contextlib.nullcontext()
    )
    with ctx:
        df = generate(
            model, tokenizer, prompts, 1, max_new_tokens=rl.max_new_tokens,
            temperature=rl.temperature, top_p=rl.top_p, postprocess=rl.response_postprocess,
            seed=seed, batch_size=batch_size, progress=False, adapter_names=adapter_names,
        )  # fmt: skip
    return df["response"].tolist()


def sampling_kwargs(cfg: Any, progress: bool = True) -> dict[str, Any]:
    """The sampling settings every evaluated policy shares (those of RL, one seed)."""
    rl = cfg.rl
    return dict(max_new_tokens=rl.max_new_tokens, temperature=rl.temperature, top_p=rl.top_p,
                postprocess=rl.response_postprocess, seed=cfg.run.seed,
                batch_size=cfg.evaluation.batch_size, progress=progress)  # fmt: skip


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
