"""One warm RL process against side-by-side lanes (`compute.parallel_stages`) on this machine.

On a copy of a finished run (hard links; its data, reward model and SFT adapters), deletes the
named algorithms' outputs and trains them again, twice, back to back: first in one warm process
with every core (`parallel_stages: 1`), then dealt to `--lanes` warm processes side by side with
the cores shared among them, through notebook 03's own path (`rl.stage.train_or_read_all`).
Records both wall times and whether every adapter file came out byte-identical (to the other
arm's and to the run's own), and draws the two arms' per-algorithm process spans.

    .venv/bin/python bench/lanes.py --run-dir SMOKE_RUN [--algorithms ppo_mle grpo rloo kto]
        [--lane-threads share|all]   # -> bench/results/lanes_<cpu>[_all].{json,png}
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import yaml
from precision import cpu_facts  # bench/precision.py, beside this script

ROOT = Path(__file__).resolve().parent.parent


def _arm(run_dir: Path, work: Path, algos: list[str], lanes: int,
         lane_threads: str = "share") -> tuple[dict, Path]:  # fmt: skip
    """Train `algos` again on a hard-linked copy of `run_dir` with `lanes` side-by-side lanes
    (`compute.lane_threads`); returns what the arm measured and the copy."""
    from rlxf_utils.artifacts import RunDir
    from rlxf_utils.config import load_config
    from rlxf_utils.rl.launch import stage_threads
    from rlxf_utils.rl.stage import train_or_read_all, training_inputs

    dst = work / f"lanes_{lanes}"
    subprocess.run(["cp", "-al", str(run_dir), str(dst)], check=True)
    for a in algos:
        shutil.rmtree(dst / "policy" / a)
    raw = yaml.safe_load((run_dir / "params.yaml").read_text(encoding="utf-8"))
    raw.setdefault("compute", {}).update(parallel_stages=lanes, lane_threads=lane_threads)
    params = work / f"params_{lanes}.yaml"
    params.write_text(yaml.safe_dump(raw), encoding="utf-8")
    cfg = load_config(params)
    run = RunDir(dst)
    contexts, reward_fn, _ = training_inputs(cfg, run)
    t0 = time.perf_counter()
    train_or_read_all(algos, cfg, params, run, reward_fn, contexts)
    wall = time.perf_counter() - t0
    spans = {}
    for a in algos:
        folder = dst / "policy" / a
        end = (folder / "complete.json").stat().st_mtime
        total = json.loads((folder / "timing.json").read_text())["total_s"]
        spans[a] = (end - total, end)
    origin = min(s for s, _ in spans.values())
    return {
        "lanes": lanes,
        "threads_per_process": stage_threads(cfg, "rl", 1),
        "wall_s": round(wall, 1),
        "spans_s": {a: [round(s - origin, 1), round(e - origin, 1)] for a, (s, e) in spans.items()},
    }, dst


def _adapters(run: Path, algos: list[str]) -> dict[str, bytes]:
    return {
        str(p.relative_to(run)): p.read_bytes()
        for a in algos
        for p in sorted((run / "policy" / a / "adapter").rglob("*.safetensors"))
    }


def _figure(arms: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(arms), 1, figsize=(8, 1.2 + 1.1 * len(arms)), sharex=True)
    for ax, arm in zip(axes, arms, strict=True):
        names = list(arm["spans_s"])
        for i, name in enumerate(names):
            s, e = arm["spans_s"][name]
            ax.barh(i, e - s, left=s, color="#4c72b0")
        ax.set_yticks(range(len(names)), names, fontsize=8)
        ax.set_title(
            f"{arm['lanes']} lane(s), {arm['threads_per_process']} thread(s) each: "
            f"{arm['wall_s']:.0f} s",
            fontsize=9,
        )
    axes[-1].set_xlabel("seconds from the first launch (each algorithm's process span)")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", type=Path, required=True, help="a finished run (e.g. a smoke run)")
    ap.add_argument("--algorithms", nargs="+", default=["ppo_mle", "grpo", "rloo", "kto"])
    ap.add_argument("--lanes", type=int, default=2)
    ap.add_argument("--lane-threads", choices=["share", "all"], default="share",
                    help="the lanes' threads (compute.lane_threads): the cores shared, or all each")  # fmt: skip
    ap.add_argument("--out", type=Path, default=None, help="default bench/results/lanes_<cpu>")
    args = ap.parse_args(argv)
    run_dir = args.run_dir.resolve()
    if not (run_dir / "params.yaml").is_file():
        raise SystemExit(f"{run_dir / 'params.yaml'}: not a run directory (no params.yaml)")
    cpu = cpu_facts()
    tag = "avx512bf16" if cpu["avx512_bf16"] else cpu["torch_cpu_capability"].lower()
    tag += "_all" if args.lane_threads == "all" else ""
    out = args.out or ROOT / "bench" / "results" / f"lanes_{tag}"
    with tempfile.TemporaryDirectory(prefix="rlxf-lanes-") as tmp:
        (one_arm, one_dir), (side_arm, side_dir) = (
            _arm(run_dir, Path(tmp), args.algorithms, n, args.lane_threads) for n in (1, args.lanes)
        )
        arms = [one_arm, side_arm]
        own = _adapters(run_dir, args.algorithms)
        one, side = _adapters(one_dir, args.algorithms), _adapters(side_dir, args.algorithms)
    result = {
        "what": "notebook 03's RL step, one warm process against side-by-side lanes",
        "run_dir": str(run_dir),
        "algorithms": args.algorithms,
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "load_average_at_end": os.getloadavg(),
        "arms": arms,
        "speedup": round(arms[0]["wall_s"] / arms[1]["wall_s"], 3),
        "adapters": len(own),
        "adapters_identical_between_arms": one == side,
        "adapters_identical_to_the_run": {"one process": one == own, "lanes": side == own},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    _figure(arms, out.with_suffix(".png"))
    print(json.dumps({k: result[k] for k in ("speedup", "adapters_identical_between_arms",
                                              "adapters_identical_to_the_run")}))  # fmt: skip
    print(f"wrote {out.with_suffix('.json')} and .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
