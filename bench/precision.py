"""Does this machine run bf16 natively? What 'auto' precision resolves to here, and why.

Times one matrix product of the policy's MLP shape (512 tokens x 576 -> 1536) and one forward
pass of the embedded policy (SmolLM2-135M, 4 x 32 tokens) in float32 and under bf16 autocast, on
two threads, and records what torch reports of the CPU (its vector ISA, oneDNN's bf16 path) and
`rlxf_utils.config.precision.native_bf16`. On an AVX2-only CPU torch has no oneDNN bf16 path and
multiplies bf16 in a reference kernel: the ratio shows what a default of bf16 would cost there.

    .venv/bin/python bench/precision.py   # -> bench/results/precision_<cpu>.{json,png}
"""

from __future__ import annotations

import json
import os
import platform
import re
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def cpu_facts() -> dict:
    flags, model = set(), platform.processor()
    try:
        text = Path("/proc/cpuinfo").read_text()
        flags = set(re.search(r"^flags\s*:(.*)$", text, re.M).group(1).split())
        model = re.search(r"^model name\s*:(.*)$", text, re.M).group(1).strip()
        fam = re.search(r"^cpu family\s*:(.*)$", text, re.M).group(1).strip()
        mod = re.search(r"^model\s*:(.*)$", text, re.M).group(1).strip()
        model = f"{model} (family {fam}, model {mod})"
    except (OSError, AttributeError):
        pass
    return {
        "model": model,
        "avx512f": "avx512f" in flags,
        "avx512_bf16": "avx512_bf16" in flags,
        "amx_bf16": "amx_bf16" in flags,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "onednn_bf16_path": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
    }


def _timed(fn, repeats: int) -> float:
    fn()  # warm-up
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def main() -> None:
    from rlxf_utils.config import PolicyConfig
    from rlxf_utils.config.precision import native_bf16
    from rlxf_utils.models import loading

    torch.set_num_threads(2)
    a, b = torch.randn(512, 576), torch.randn(576, 1536)
    model, tok = loading.load_policy(PolicyConfig())
    ids = tok(["The authorities will adopt a medium-term fiscal framework and"] * 4,
              return_tensors="pt", padding="max_length", max_length=32)  # fmt: skip
    rows = []
    for name, dtype in (("fp32", None), ("bf16 autocast", torch.bfloat16)):

        def ctx(dtype=dtype):
            return torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None)

        def matmul(ctx=ctx) -> None:
            with ctx():
                a @ b

        def forward(ctx=ctx) -> None:
            with torch.no_grad(), ctx():
                model(**ids)

        mm = _timed(matmul, 10)
        fw = _timed(forward, 2)
        rows.append({"precision": name, "matmul_ms": round(1e3 * mm, 2),
                     "matmul_gflops": round(2 * 512 * 576 * 1536 / mm / 1e9, 1),
                     "forward_s": round(fw, 3)})  # fmt: skip
        print(rows[-1], flush=True)
    cpu = cpu_facts()
    result = {
        "cpu": cpu,
        "native_bf16": native_bf16("cpu"),
        "threads": 2,
        "load_average": os.getloadavg(),
        "torch": torch.__version__,
        "rows": rows,
        "bf16_over_fp32": {
            "matmul": round(rows[1]["matmul_ms"] / rows[0]["matmul_ms"], 2),
            "forward": round(rows[1]["forward_s"] / rows[0]["forward_s"], 2),
        },
    }
    tag = "avx512_bf16" if cpu["avx512_bf16"] else ("avx512" if cpu["avx512f"] else "avx2")
    out = ROOT / f"bench/results/precision_{tag}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(8, 3))
    for ax, key, label in ((axes[0], "matmul_ms", "512x576x1536 product (ms)"),
                           (axes[1], "forward_s", "SmolLM2-135M forward, 4x32 tokens (s)")):  # fmt: skip
        ax.bar([r["precision"] for r in rows], [r[key] for r in rows], color=["#4c72b0", "#dd8452"])
        ax.set_title(label, fontsize=9)
    fig.suptitle(f"{cpu['model']}: native bf16 {result['native_bf16']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)
    print(json.dumps(result["bf16_over_fp32"]), "->", out)


if __name__ == "__main__":
    main()
