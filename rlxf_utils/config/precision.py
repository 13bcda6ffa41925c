"""Which arithmetic 'auto' precision settings resolve to on this machine.

bf16 autocast pays only where the hardware runs bf16 matrix products natively: GPUs that support
bf16, and CPUs whose oneDNN bf16 path torch uses (AVX-512 cores; `avx512_bf16`/AMX make it
fast). Elsewhere (an AVX2-only CPU, e.g. an AMD Zen 3 EPYC) torch falls back to a reference GEMM:
measured on such a machine (an AMD EPYC, family 25 model 1; `bench/precision.py`), a
512x576x1536 bf16 product took 713 ms against 13 ms in fp32, 55x slower, and a forward pass of the
embedded policy 5.5x slower: a default of bf16 there stalled the smoke study's mpnet encoder for
over ten minutes in its first training step.

`policy.autocast`, `reward.train_precision` and `reward.score_precision` accept 'auto', which
`StudyConfig` resolves once, when the parameters are read, to bf16 where `native_bf16` holds and to
fp32 elsewhere. The run's frozen `params.yaml` (and so every notebook's fingerprint) holds the
resolved value: what ran, not what was asked. An explicit 'bf16' / 'bfloat16' is kept as written.

`RLXF_NATIVE_BF16=0|1` in the environment overrides the check (tests, and a user who knows
better than torch's detection)."""

from __future__ import annotations

import functools
import os

#: The environment variable that overrides `native_bf16`'s detection ('0' or '1').
OVERRIDE_ENV = "RLXF_NATIVE_BF16"


@functools.cache
def _detected(device: str) -> bool:
    import torch

    if device in ("auto", "cuda") and torch.cuda.is_available():
        return bool(torch.cuda.is_bf16_supported())
    if device == "cuda":  # asked for a GPU this process cannot see: the stage will say so
        return False
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def native_bf16(device: str = "auto") -> bool:
    """Whether `device` ('auto', 'cpu' or 'cuda', as `compute.device`) runs bf16 matrix products
    natively (a GPU with bf16, a CPU on torch's oneDNN bf16 path), or `RLXF_NATIVE_BF16`'s say."""
    forced = os.environ.get(OVERRIDE_ENV, "").strip()
    if forced:
        if forced not in ("0", "1"):
            raise ValueError(f"{OVERRIDE_ENV}={forced!r}: expected '0' or '1' (or unset)")
        return forced == "1"
    return _detected(device)


def resolve(
    value: str | None, device: str, bf16: str = "bf16", fp32: str | None = "fp32"
) -> str | None:
    """`value` with 'auto' replaced: `bf16` where `device` runs bf16 natively, else `fp32` (the
    reward keys' names by default; `policy.autocast` passes 'bfloat16' and None)."""
    if value != "auto":
        return value
    return bf16 if native_bf16(device) else fp32
