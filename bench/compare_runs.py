"""Did a rerun reproduce the study? Compare two run directories artifact by artifact.

    .venv/bin/python bench/compare_runs.py RUN_BEFORE RUN_AFTER [--out bench/results/compare.json]

Bytes first; tables and JSON whose bytes differ are compared again without their timing columns
and keys (`rlxf_utils.compare`). The runner's records, fingerprints, executed notebooks, rendered
report, logs and resume state differ by design and are listed, not compared. Exit status 0 when
every artifact is equal (timings aside), 1 otherwise. Used to check that a refactor left the smoke
and default studies' artifacts unchanged.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rlxf_utils.artifacts import write_json
from rlxf_utils.compare import compare_runs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("before", type=Path, help="the reference run dir")
    p.add_argument("after", type=Path, help="the run dir to check against it")
    p.add_argument("--out", type=Path, help="write the per-artifact result as JSON")
    args = p.parse_args(argv)
    for d in (args.before, args.after):
        if not (d / "manifest.json").is_file():
            p.error(f"{d}: not a run directory (no manifest.json)")
    result = compare_runs(args.before, args.after)
    commits = [
        json.loads((d / "manifest.json").read_text())["git"].get("commit")
        for d in (args.before, args.after)
    ]
    counts = result.counts()
    print(f"{args.before} ({commits[0]}) -> {args.after} ({commits[1]})")
    for status, n in counts.items():
        print(f"  {status:10s} {n:5d}")
    for status in ("differs", "missing", "extra"):
        for path in result.paths(status):
            print(f"  {status}: {path}")
    print("timings aside:", "every artifact equal" if result.same else "ARTIFACTS DIFFER")
    if args.out:
        write_json(args.out, {"before": str(args.before), "after": str(args.after),
                              "commits": commits, "counts": counts, "same": result.same,
                              "status": result.status, "volatile": result.volatile})  # fmt: skip
    return 0 if result.same else 1


if __name__ == "__main__":
    sys.exit(main())
