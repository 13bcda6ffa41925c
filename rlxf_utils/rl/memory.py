"""GPU memory per process for the paper profile (LLaMA-2-7B policy with LoRA, BERT-base reward)
under each distributed strategy: docs/profiles-and-gpus.md's table, computed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rlxf_utils.config import PROJECT_ROOT, load_config

#: LLaMA-2-7B's architecture (its published config.json), for counting parameters offline.
LLAMA2_7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32)  # fmt: skip


GIB = 2**30


def parameter_counts(
    model_config: Any, target_modules: Sequence[str], rank: int
) -> tuple[int, int]:
    """(all parameters, LoRA parameters) of a causal LM built from `model_config` on the meta
    device (nothing allocated): LoRA adds rank x (in + out) per targeted linear layer."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    total = sum(p.numel() for p in model.parameters())
    lora = sum(
        rank * (m.in_features + m.out_features)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in target_modules
    )
    return total, lora


def memory_per_gpu(
    n_params: int, n_lora: int, n_reward: int, strategy: str, gpus: int, guide: bool = False
) -> float:
    """Estimated GiB per GPU for RL with a LoRA policy, before activations and the KV cache.

    The policy in bf16 (2 bytes a parameter; the reference is the same weights with adapters off,
    no copy); an RLGF guide is a second bf16 copy. LoRA weights in fp32 (peft upcasts adapters
    of a bf16 model) with their gradient and Adam's two moments: 16 bytes a LoRA parameter, of
    which ZeRO-2/3 shard the gradient and moments (12 bytes) over the GPUs and ZeRO-3 the
    frozen weights too. The reward model scores in fp32 (4 bytes) on every process."""
    if strategy not in ("single", "ddp", "zero2", "zero3"):
        raise ValueError(f"strategy {strategy!r}: expected single, ddp, zero2 or zero3")
    n = 1 if strategy == "single" else gpus
    frozen = 2 * n_params * (2 if guide else 1) / (n if strategy == "zero3" else 1)
    lora = n_lora * (4 + 12 / (n if strategy in ("zero2", "zero3") else 1))
    return (frozen + lora + 4 * n_reward) / GIB


def memory_table(gpus: int = 8) -> str:
    """docs/profiles-and-gpus.md's table: GiB per GPU for the paper profile's policy (LLaMA-2-7B shape, LoRA
    rank and targets from params/paper.yaml) and reward (BERT-base), per accelerate config."""
    from transformers import BertConfig, BertModel, LlamaConfig

    cfg = load_config(PROJECT_ROOT / "params/paper.yaml")
    lora = cfg.policy.lora
    n, n_lora = parameter_counts(LlamaConfig(**LLAMA2_7B), lora.target_modules, lora.rank)
    import torch

    with torch.device("meta"):
        n_reward = sum(p.numel() for p in BertModel(BertConfig()).parameters())
    rows = [
        ("single_gpu_bf16.yaml", "single", 1),
        ("multi_gpu_ddp.yaml", "ddp", gpus),
        ("deepspeed_zero2.yaml", "zero2", gpus),
        ("deepspeed_zero3.yaml", "zero3", gpus),
    ]
    lines = [
        f"Policy {n / 1e9:.2f}B parameters (LLaMA-2-7B shape), LoRA rank {lora.rank} on "
        f"{', '.join(lora.target_modules)}: {n_lora / 1e6:.1f}M trainable; reward BERT-base "
        f"{n_reward / 1e6:.0f}M. GiB per GPU, estimated from these counts (`python -m "
        "rlxf_utils.rl.worker --memory`), before activations and the KV cache:",
        "",
        "| accelerate config | GPUs | PPO, GRPO, RLOO | RLGF (+ the guide's copy) |",
        "| --- | --- | --- | --- |",
    ]
    for name, strategy, g in rows:
        a = memory_per_gpu(n, n_lora, n_reward, strategy, g)
        if strategy == "zero3":  # PPO and RLGF generate with full weights: they refuse ZeRO-3
            lines.append(f"| `{name}` | {g} | {a:.1f} (GRPO, RLOO only) | not supported |")
            continue
        b = memory_per_gpu(n, n_lora, n_reward, strategy, g, guide=True)
        lines.append(f"| `{name}` | {g} | {a:.1f} | {b:.1f} |")
    lines += ["", "SFT and ILHF train on one process: the first row's figure."]
    return "\n".join(lines) + "\n"
