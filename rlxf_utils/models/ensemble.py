"""LoRA particle ensembles (ILHF): named particles around one start policy, saved as one
folder per particle, loaded back, and the mixture density of the ensemble."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from rlxf_utils.models.loading import lora_config

#: Marks a saved ensemble: `policy/<algo>/adapter/ensemble.json` lists the particles' folders.
ENSEMBLE_FILE = "ensemble.json"


def particle_names(n: int) -> list[str]:
    return [f"p{m}" for m in range(n)]


def add_particles(model: nn.Module, lora: Any, n: int, prior_scale: float, seed: int) -> Any:
    """`model` wrapped with `n` LoRA adapters p0..p{n-1}, each with a fresh A (PEFT's init, seeded
    per particle) and B ~ N(0, prior_scale^2): particle m starts at a perturbation of `model`."""
    from peft import get_peft_model

    names = particle_names(n)
    peft_model = None
    for m, name in enumerate(names):
        torch.manual_seed(seed * 1000 + m)
        if peft_model is None:
            peft_model = get_peft_model(model, lora_config(lora), adapter_name=name)
        else:
            peft_model.add_adapter(name, lora_config(lora))
        gen = torch.Generator().manual_seed(seed * 1000 + m)
        with torch.no_grad():
            for pname, p in peft_model.named_parameters():
                if f"lora_B.{name}." in pname:
                    p.copy_(torch.randn(p.shape, generator=gen) * prior_scale)
    peft_model.set_adapter(names[0])
    return peft_model


def particle_parameters(model: nn.Module, name: str) -> list[nn.Parameter]:
    """The LoRA parameters of particle `name`."""
    return [p for pname, p in model.named_parameters() if f"lora_A.{name}." in pname
            or f"lora_B.{name}." in pname]  # fmt: skip


def is_ensemble(adapter_dir: str | Path) -> bool:
    """True for a saved ILHF ensemble (`adapter/ensemble.json`)."""
    return (Path(adapter_dir) / ENSEMBLE_FILE).is_file()


def load_particles(model: nn.Module, adapter_dir: str | Path, prefix: str) -> tuple[Any, list[str]]:
    """Load every particle of the ensemble at `adapter_dir` onto `model` (a plain model or a peft
    model) as adapters `<prefix>__p<m>`; returns (the peft model, the adapter names)."""
    from peft import PeftModel

    adapter_dir = Path(adapter_dir)
    marker = adapter_dir / ENSEMBLE_FILE
    try:
        info = json.loads(marker.read_text(encoding="utf-8"))
        parts = list(info["particles"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{marker}: not a readable ILHF ensemble marker ({exc})") from exc
    names = []
    for part in parts:
        path = adapter_dir / part
        if not (path / "adapter_config.json").is_file():
            raise FileNotFoundError(
                f"{path}: particle listed in {marker} has no adapter_config.json"
            )
        name = f"{prefix}__{part}"
        if isinstance(model, PeftModel):
            model.load_adapter(str(path), adapter_name=name)
        else:
            model = PeftModel.from_pretrained(model, str(path), adapter_name=name)
        names.append(name)
    return model, names


def mixture_logprobs(per_particle: Sequence[np.ndarray]) -> np.ndarray:
    """log mean_m pi_m(y|x) from each particle's log-likelihoods (the ensemble policy's density)."""
    stack = np.stack([np.asarray(x, dtype=float) for x in per_particle])
    top = stack.max(axis=0)
    return top + np.log(np.exp(stack - top).mean(axis=0))


def thompson_draw(n_prompts: int, particles: int, seed: int) -> np.ndarray:
    """The particle answering each prompt: uniform on {0..particles-1}, seeded."""
    return np.random.default_rng(seed).integers(0, particles, size=n_prompts)


#: Between a particle's name and its LoRA key in a packed ensemble (`pack_particles`).
PACK_SEP = "::"


def pack_particles(model: nn.Module, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """Every particle's LoRA weights in one flat state, keyed `<particle>::<peft key>`, on the CPU
    and contiguous: what an ensemble's checkpoint and frontier snapshot keep in one
    `adapter_model.safetensors`, as a single adapter's are kept."""
    from peft import get_peft_model_state_dict

    return {f"{n}{PACK_SEP}{k}": v.detach().cpu().contiguous() for n in names
            for k, v in get_peft_model_state_dict(model, adapter_name=n).items()}  # fmt: skip


def is_packed(tensors: Mapping[str, Any]) -> bool:
    """True for a packed ensemble's state (`pack_particles`), False for one adapter's."""
    return bool(tensors) and all(PACK_SEP in k for k in tensors)


def unpack_particles(
    tensors: Mapping[str, torch.Tensor], source: Any
) -> dict[str, dict[str, torch.Tensor]]:
    """The per-particle states of a packed ensemble, in particle order (`p0`, `p1`, ...);
    `source` (the file) names what was not one."""
    if not is_packed(tensors):
        raise ValueError(
            f"{source}: not a packed ensemble (every key '<particle>{PACK_SEP}<LoRA key>')"
        )
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        name, rest = key.split(PACK_SEP, 1)
        out.setdefault(name, {})[rest] = value
    return dict(sorted(out.items(), key=lambda kv: (len(kv[0]), kv[0])))
