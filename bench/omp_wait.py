"""Two torch processes sharing the cores: OpenMP's active wait against its passive wait.

`make test` runs two pytest-xdist workers beside the smoke study's own processes (kernels,
training lanes), so two processes with a thread per core can run at once. torch's OpenMP
runtime here (libgomp) spins while a thread waits for work, by default; with more threads than
cores, a spinning thread holds a core another process's thread needs. This runs the embedded
policy's decoding-step shape (30 layers of 576 x 1536 products at batch 4, the step that
dominates the smoke study's evaluation) in a process of `torch.get_num_threads()` threads,
alone and two at once, with libgomp's default wait and with `OMP_WAIT_POLICY=PASSIVE` (what
tests/conftest.py sets for `make test`'s workers and the processes they start), and checks
that the outputs are the same bytes under both.

    .venv/bin/python bench/omp_wait.py [--steps 300]   # -> bench/results/omp_wait_<cpu>.{json,png}
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from precision import cpu_facts  # bench/precision.py, beside this script

ROOT = Path(__file__).resolve().parent.parent


def work(steps: int) -> None:
    """The child: `steps` decoding-shaped steps after a warm-up; prints seconds and a hash."""
    import torch

    torch.manual_seed(0)
    up, down = torch.randn(576, 1536) * 0.03, torch.randn(1536, 576) * 0.03
    x = torch.randn(4, 576)

    def step() -> torch.Tensor:
        h = x
        for _ in range(30):
            h = h + torch.nn.functional.silu(h @ up) @ down
            h = h / h.norm(dim=-1, keepdim=True)
        return h

    for _ in range(5):
        step()
    t0 = time.perf_counter()
    for _ in range(steps):
        out = step()
    seconds = time.perf_counter() - t0
    digest = hashlib.sha256(out.numpy().tobytes()).hexdigest()[:16]
    print(json.dumps({"seconds": seconds, "sha256": digest, "threads": torch.get_num_threads()}))


def arm(policy: str | None, together: int, steps: int) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    cmd = [sys.executable, __file__, "--child", "--steps", str(steps)]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(together)]  # fmt: skip
    return [json.loads(p.communicate()[0]) for p in procs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    if a.child:
        work(a.steps)
        return
    cpu = cpu_facts()
    rows = []
    for policy in (None, "PASSIVE"):
        for together in (1, 2):
            res = arm(policy, together, a.steps)
            rows.append({"wait": policy or "libgomp default (active)", "processes": together,
                         "seconds": [r["seconds"] for r in res], "sha256": res[0]["sha256"],
                         "threads_each": res[0]["threads"]})  # fmt: skip
            print(rows[-1], flush=True)
    same = len({r["sha256"] for r in rows}) == 1
    tag = "avx512bf16" if cpu["avx512_bf16"] else "avx2"
    out = a.out or ROOT / f"bench/results/omp_wait_{tag}"
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"cpu": cpu, "cpu_count": os.cpu_count(), "steps": a.steps, "rows": rows,
              "outputs_identical": same, "load_average_before": os.getloadavg(),
              "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}  # fmt: skip
    out.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 2.8))
    labels = [f"{r['wait']}, {r['processes']} at once" for r in rows]
    ax.barh(labels, [max(r["seconds"]) for r in rows], color=["#b55", "#b55", "#58a", "#58a"])
    for i, r in enumerate(rows):
        ax.text(max(r["seconds"]), i, f" {max(r['seconds']):.1f} s", va="center")
    ax.invert_yaxis()
    ax.set_xlabel(f"seconds for {a.steps} decoding-shaped steps (slowest process)")
    ax.set_title(f"{rows[0]['threads_each']} torch threads per process on "
                 f"{os.cpu_count()} cores; outputs identical: {same}", fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    print(f"wrote {out}.json and .png")


if __name__ == "__main__":
    main()
