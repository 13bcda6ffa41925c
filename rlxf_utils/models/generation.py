"""Prompting and sampling: chat formatting, left-padded encoding, autocast, end tokens, response
post-processing and batched generation (the decode loop itself, the KV cache and weights in the
autocast dtype and merged LoRA weights: `models.decode`)."""

from __future__ import annotations

import contextlib
import re
import types
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
import torch
from transformers import (
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from rlxf_utils.config import PolicyConfig, RLConfig
from rlxf_utils.config.precision import resolve as resolve_precision
from rlxf_utils.models import decode
from rlxf_utils.models.decode import autocast_kv_cache, frozen_weights_in_autocast_dtype
from rlxf_utils.prompts import build_policy_prompt


def _generate_with_autocast_cache(self: Any, *args: Any, **kwargs: Any) -> Any:
    if kwargs.get("past_key_values") is None and torch.is_autocast_enabled(self.device.type):
        cache = autocast_kv_cache(self)
        if cache is not None:
            kwargs["past_key_values"] = cache
    merge = self.rlxf_merge_lora and not kwargs.get("adapter_names")
    merged = decode.merged_lora(self) if merge else contextlib.nullcontext()
    with merged, frozen_weights_in_autocast_dtype(self):
        return type(self).generate(self, *args, **kwargs)


def cache_in_autocast_dtype(model: PreTrainedModel, merge_lora: bool = False) -> PreTrainedModel:
    """Make `model.generate` (also when called through peft or TRL, which reach this model's
    method), whenever it runs under autocast, use `autocast_kv_cache` and
    `frozen_weights_in_autocast_dtype`: the same samples, faster. Outside autocast generation is
    unchanged; a cache the caller passes is kept. With `merge_lora` (`policy.merge_lora`;
    `model.rlxf_merge_lora` switches it), a LoRA added later samples from merged weights
    (`decode.merged_lora`; not in peft's mixed-adapter batches): TRL's GRPO and RLOO rollouts,
    ILHF's single-adapter ones and PPO's with `sampler: transformers`."""
    model.generate = types.MethodType(_generate_with_autocast_cache, model)
    model.rlxf_merge_lora = merge_lora
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
    """torch.autocast for `policy.autocast` ('bfloat16') on `device`; a no-op context for None.
    'auto' (a `PolicyConfig` not read through `StudyConfig`, which resolves it): bf16 where
    `device` runs it natively (`config.precision`)."""
    kind = torch.device(device).type
    dtype = resolve_precision(dtype, kind, "bfloat16", None)
    if dtype is None:
        return contextlib.nullcontext()
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


#: `generate`'s column of each response's log-probability under the model that drew it, summed
#: over its tokens through the end token, from the sampling pass itself: only where the draws
#: follow the model's own softmax (the compact sampler at temperature 1 without top-p).
LOGP_DRAWN = "logp_drawn"


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
    batch_size: int | str = 16,
    desc: str = "generate",
    progress: bool = True,
    adapter_names: Sequence[str] | None = None,
    sampler: str = "compact",
    merge: bool = True,
    compile_step: bool = False,
) -> pd.DataFrame:
    """k sampled responses per prompt, batched with left padding and the KV cache.

    `adapter_names` (one per prompt): the LoRA adapter that answers each prompt, in one batch
    (peft's mixed-adapter batches; an ILHF ensemble's Thompson draw).

    `sampler` (`policy.sampler`): 'compact' (`models.decode.sample_compact`: finished rows leave
    the batch; response (i, j) draws from its own stream seeded by (seed, i x k + j), so it is
    the same whatever the batch size) or 'transformers' (`model.generate`, one torch seed per
    call: the path before issue 44, kept for the bench). The compact sampler batches prompts
    of like length together (less left padding) and prefills a prompt once for its k samples
    (`decode.shared_prefill`); rows come back in (prompt, sample) order. `merge` (`policy.merge_lora`): a LoRA
    policy samples from its adapter merged into a copy of the weights (`decode.merged_lora`; not
    with `adapter_names`). `compile_step` (`policy.compile_decode`): the compact loop's forward
    through `torch.compile`.

    Rows: prompt_id, sample_id, prompt_ids, response_ids (trimmed after the first end token),
    raw (decoded), response (post-processed, what the reward model scores), n_tokens, finished
    (the response ended with an end token before `max_new_tokens`); and `logp_drawn`
    (`LOGP_DRAWN`) where the compact sampler drew from the model's own softmax (temperature 1,
    no top-p): the log-probability the sampling pass computed for each drawn token, summed, so
    that the policy's own density needs no second pass (`evaluation.sampling.sample_tuned`).
    Its logits are the sampling pass's (merged LoRA, the KV cache): they differ from a separate
    forward pass's by rounding only.
    """
    from tqdm.auto import tqdm

    if sampler not in ("compact", "transformers"):
        raise ValueError(f"sampler={sampler!r}; expected 'compact' or 'transformers'")
    torch.manual_seed(seed)
    model.eval()
    stop = eos_ids(model, tokenizer)
    device = next(model.parameters()).device
    items = [(i, j) for i in range(len(prompts)) for j in range(k)]
    rows: list[dict[str, Any]] = []
    merged = decode.merged_lora(model) if merge and not adapter_names else _unmerged(model)
    step = decode.compiled_forward(model) if compile_step and sampler == "compact" else None
    lengths = [len(i) for i in encode_prompts(tokenizer, list(prompts))["input_ids"]] if prompts else []  # fmt: skip
    unwarped = temperature == 1.0 and top_p >= 1.0  # the draws follow the model's own softmax
    if sampler == "compact":  # prompts of like length share a batch: less left padding to
        items.sort(key=lambda item: lengths[item[0]])  # prefill; a row's draws stay its own
    with merged:
        if batch_size == "auto":  # sized once the merged weights take their memory
            longest = max(lengths, default=1)
            batch_size = decode.auto_batch_size(model, longest, max_new_tokens, n_items=len(items))
        elif not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r}; expected a positive int or 'auto'")
        starts = range(0, len(items), batch_size)
        for start in tqdm(starts, desc=desc, disable=not progress, leave=False):
            batch = items[start : start + batch_size]
            enc = encode_prompts(
                tokenizer, [prompts[i] for i, _ in batch], return_tensors="pt", padding=True
            ).to(device)
            names = [adapter_names[i] for i, _ in batch] if adapter_names else None
            lp = None
            if sampler == "compact":
                drawn = decode.sample_compact(
                    model, enc["input_ids"], enc["attention_mask"],
                    max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                    stop_ids=sorted(stop), pad_id=tokenizer.pad_token_id, seed=seed,
                    rows=[i * k + j for i, j in batch], adapter_names=names, step=step,
                )  # fmt: skip
                out, lp = drawn.ids, drawn.logprobs if unwarped else None
            else:
                out = model.generate(
                    **enc, do_sample=True, temperature=temperature, top_p=top_p, top_k=0,
                    max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                    eos_token_id=sorted(stop) or None,
                    **({"adapter_names": names} if names else {}),
                )[:, enc["input_ids"].shape[1] :]  # fmt: skip
            rows += _response_rows(enc, out, batch, stop, tokenizer, postprocess, lp)
    rows.sort(key=lambda r: (r["prompt_id"], r["sample_id"]))
    return pd.DataFrame(rows)


@contextlib.contextmanager
def _unmerged(model: Any) -> Iterator[None]:
    """`generate(merge=False)`: the LoRA unmerged in transformers' `generate` too."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    flag = getattr(inner, "rlxf_merge_lora", None)
    if flag is not None:
        inner.rlxf_merge_lora = False
    try:
        yield
    finally:
        if flag is not None:
            inner.rlxf_merge_lora = flag


def _response_rows(enc: Any, out: torch.Tensor, batch: Sequence[tuple[int, int]], stop: set[int],
                   tokenizer: Any, postprocess: str,
                   logprobs: torch.Tensor | None = None) -> list[dict[str, Any]]:  # fmt: skip
    rows = []
    sums = None
    if logprobs is not None:  # each response's tokens, through its end token, in float64
        sums = logprobs.double().cumsum(1).cpu().numpy()
    for row, (i, j) in enumerate(batch):
        prompt = enc["input_ids"][row][enc["attention_mask"][row].bool()].tolist()
        resp = trim_response(out[row].tolist(), stop)
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
        if sums is not None:
            rows[-1][LOGP_DRAWN] = float(sums[row, len(resp) - 1]) if resp else 0.0
    return rows


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


def trained_sampling_seed(training_seed: int) -> int:
    """The sampling seed of a trained policy: a stream of its training seed's own, never the start
    policy's (`run.seed`). Were it the training seed itself, the run's own seed (training seed =
    `run.seed`) would sample its policies with the start policy's random numbers, whose paired
    differences then share those draws, while a further seed's would not: the seeds would not be
    exchangeable."""
    return int(np.random.SeedSequence([int(training_seed), 0x5EED]).generate_state(1)[0])


def sampling_kwargs(cfg: Any, progress: bool = True, trained: bool = False) -> dict[str, Any]:
    """The sampling settings every evaluated policy shares (those of RL, at evaluation's own token
    cap `cfg.eval_max_new_tokens`: `evaluation.max_new_tokens`, null: `rl.max_new_tokens`), with
    the sampling seed `run.seed`; `trained=True`: the seed of the policies RL trained, a stream of
    their training seed (`trained_sampling_seed` of `rl.seed`, null: `run.seed`), so a further training seed (`rlxf seeds`)
    samples its own policies with its own draws while the start policy's samples stay shared
    across seeds."""
    rl = cfg.rl
    seed = trained_sampling_seed(cfg.training_seed) if trained else cfg.run.seed
    return dict(max_new_tokens=cfg.eval_max_new_tokens, temperature=rl.temperature, top_p=rl.top_p,
                postprocess=rl.response_postprocess, seed=seed,
                batch_size=cfg.evaluation.batch_size, progress=progress,
                sampler=cfg.policy.sampler, merge=cfg.policy.merge_lora,
                compile_step=cfg.policy.compile_decode)  # fmt: skip


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
