"""Which machine settings change the study's numbers: the embedded policy's logits on one batch,
hashed bit for bit, under bf16 autocast and in float32, for each CPU instruction set oneDNN may
use (`ONEDNN_MAX_CPU_ISA` caps it, as an older or another vendor's CPU would) and each thread
count. Equal hashes: the same samples; different hashes: the bits differ, so the sampled tokens
can diverge after a few steps and every downstream number moves within its sampling error.

    .venv/bin/python bench/numerics.py      # -> bench/results/numerics.json

The checkout's folder is not among the settings: two clones give identical artifacts
(`rlxf compare`, docs/reruns.md "What varies across machines").
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench/results/numerics.json"

CHILD = """
import hashlib, json, sys, torch
from rlxf_utils.config import PolicyConfig
from rlxf_utils.models import loading
torch.set_num_threads(int(sys.argv[1]))
m, tok = loading.load_policy(PolicyConfig())
ids = tok(["The authorities will adopt a medium-term fiscal framework"] * 8, return_tensors="pt")
with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
    bf16 = m(**ids).logits.float().numpy().tobytes()
with torch.no_grad():
    fp32 = m(**ids).logits.numpy().tobytes()
print(json.dumps({k: hashlib.sha256(v).hexdigest()[:16] for k, v in
                  (("bf16", bf16), ("fp32", fp32))}))
"""

#: oneDNN's instruction-set caps, newest first (None: what this CPU offers).
ISAS = (None, "AVX512_CORE_BF16", "AVX512_CORE", "AVX2")


def logits_hash(threads: int, isa: str | None) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("ONEDNN_MAX_CPU_ISA", None)
    if isa:
        env["ONEDNN_MAX_CPU_ISA"] = isa
    out = subprocess.run([sys.executable, "-c", CHILD, str(threads)], env=env, check=True,
                         capture_output=True, text=True).stdout  # fmt: skip
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    flags = ""
    if Path("/proc/cpuinfo").is_file():
        info = Path("/proc/cpuinfo").read_text().splitlines()
        model = next(
            (ln.split(":", 1)[1].strip() for ln in info if ln.startswith("model name")), ""
        )
        flags = next((ln.split(":", 1)[1] for ln in info if ln.startswith("flags")), "")
    else:
        model = platform.processor()
    rows = []
    for threads in (2, 1):
        for isa in ISAS if threads == 2 else (None,):
            h = logits_hash(threads, isa)
            rows.append({"threads": threads, "onednn_max_isa": isa or "this CPU's", **h})
            print(rows[-1], flush=True)
    result = {
        "cpu": model,
        "cpu_flags": sorted(f for f in flags.split() if "avx512" in f or "amx" in f),
        "load_average_at_start": os.getloadavg()[0],
        "rows": rows,
        "reading": "one hash per setting; a setting whose hash differs from the first row's "
        "changes the logits' bits and so, through sampling, every downstream number",
        "sha_of_this_script": hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16],
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(OUT)


if __name__ == "__main__":
    main()
