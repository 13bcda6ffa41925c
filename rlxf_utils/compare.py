"""Two run directories compared artifact by artifact: did a rerun (another commit, a resumed run,
another machine) reproduce the study?

Each file is compared as bytes first. Where the bytes differ, tables and JSON are compared again
without the columns and keys that are timings (`TIMING`): wall time differs between runs by
design. What differs between runs of the same study by design is not compared (`VOLATILE`): the
runner's records and fingerprints, the executed notebooks, the rendered report, the stages' logs
and resume state.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from rlxf_utils.artifacts import sha256_file

__all__ = ["TIMING", "VOLATILE", "ArtifactComparison", "artifact_content", "compare_runs"]

#: Paths that differ between two runs of the same study by design: the runner's records
#: (`manifest.json`: times, commit, versions; `params.yaml`: absolute paths; `.rlxf/`: code and input fingerprints), the executed
#: notebooks (times, paths), the rendered report (it prints timings and versions), the stages'
#: logs, resume state (checkpoints hold logs with step times) and the RL stages' bookkeeping
#: (`started.json` / `complete.json` hash input folders whose metrics hold timings).
VOLATILE = re.compile(
    r"^(manifest\.json|params\.yaml|\.rlxf/|notebooks/|report/)|/launch\.log$|/(checkpoints|trl)/"
    r"|^policy/[^/]+/(started|complete)\.json$"
)
#: Columns of tables and keys of JSON that are timings (or ratios of timings: `cost_vs_ppo`).
TIMING = re.compile(r"(_s|seconds|per_s|_time|cost_vs_ppo)$")


def _strip(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _strip(v) for k, v in obj.items() if not TIMING.search(str(k))}
    if isinstance(obj, list):
        return [_strip(v) for v in obj]
    return obj


def artifact_content(path: Path) -> str:
    """A file as comparable content: a table or JSON without its timing columns/keys, any other
    file by its sha256."""
    if path.suffix in (".parquet", ".csv"):
        df = pd.read_parquet(path) if path.suffix == ".parquet" else pd.read_csv(path)
        df = df[[c for c in df.columns if not TIMING.search(str(c))]]
        return df.to_json(orient="split", double_precision=15)
    if path.suffix == ".json":
        return json.dumps(_strip(json.loads(path.read_text(encoding="utf-8"))), sort_keys=True)
    return sha256_file(path)


@dataclass
class ArtifactComparison:
    """Per artifact path: 'identical' (same bytes), 'timings' (equal apart from timings; a
    markdown table whose csv twin is), 'differs', 'missing' (only in the first run) or 'extra'
    (only in the second); `volatile` lists the paths not compared."""

    status: dict[str, str]
    volatile: list[str]

    def paths(self, status: str) -> list[str]:
        return sorted(p for p, s in self.status.items() if s == status)

    @property
    def same(self) -> bool:
        """Every compared artifact is present in both runs and equal (timings aside)."""
        return set(self.status.values()) <= {"identical", "timings"}

    def counts(self) -> dict[str, int]:
        out = {
            s: len(self.paths(s)) for s in ("identical", "timings", "differs", "missing", "extra")
        }
        return {**out, "volatile": len(self.volatile)}


def _files(root: Path) -> dict[str, Path]:
    return {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*")) if p.is_file()}


def compare_runs(first: str | Path, second: str | Path) -> ArtifactComparison:
    """Compare every artifact of run dir `second` with run dir `first`."""
    a, b = _files(Path(first)), _files(Path(second))
    status: dict[str, str] = {}
    volatile = sorted(r for r in set(a) | set(b) if VOLATILE.search(r))
    for rel in sorted(set(a) | set(b)):
        if VOLATILE.search(rel):
            continue
        if rel not in b:
            status[rel] = "missing"
        elif rel not in a:
            status[rel] = "extra"
        elif a[rel].read_bytes() == b[rel].read_bytes():
            status[rel] = "identical"
        elif a[rel].suffix == ".md" and a[rel].with_suffix(".csv").exists():
            status[rel] = "md"  # the rendering of its csv twin: judged with it below
        else:
            same = artifact_content(a[rel]) == artifact_content(b[rel])
            status[rel] = "timings" if same else "differs"
    for rel, s in status.items():
        if s == "md":
            twin = status.get(rel[: -len(".md")] + ".csv", "differs")
            status[rel] = "timings" if twin in ("identical", "timings") else "differs"
    return ArtifactComparison(status, volatile)
