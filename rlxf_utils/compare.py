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
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from rlxf_utils.artifacts import parse_jsonl, sha256_file

__all__ = [
    "TIMING",
    "VOLATILE",
    "ArtifactComparison",
    "artifact_content",
    "compare_runs",
    "content_differences",
]

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


def _table(path: Path) -> pd.DataFrame:
    """A parquet or csv table without its timing columns."""
    df = pd.read_parquet(path) if path.suffix == ".parquet" else pd.read_csv(path)
    return df[[c for c in df.columns if not TIMING.search(str(c))]]


def artifact_content(path: Path) -> str:
    """A file as comparable content: a table or JSON without its timing columns/keys, any other
    file by its sha256."""
    if path.suffix in (".parquet", ".csv"):
        return _table(path).to_json(orient="split", double_precision=15)
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


def _flat(obj: Any, key: str = "") -> dict[str, Any]:
    """A JSON value as {path: leaf}."""
    if isinstance(obj, dict):
        return {k: v for name, x in obj.items()
                for k, v in _flat(x, f"{key}.{name}" if key else str(name)).items()}  # fmt: skip
    if isinstance(obj, list):
        return {k: v for i, x in enumerate(obj) for k, v in _flat(x, f"{key}[{i}]").items()}
    return {key: obj}


def _cells(path: Path) -> dict[str, Any]:
    """A table's cells as {"row R, column": value} (rows by position, timing columns left out),
    a JSON or JSON-lines file's leaves as {path: value}."""
    if path.suffix in (".parquet", ".csv"):
        df = _table(path)
        return {f"row {i}, {c}": v for c in df.columns for i, v in enumerate(df[c].tolist())}
    text = path.read_text(encoding="utf-8")
    return _flat(_strip(parse_jsonl(text) if path.suffix == ".jsonl" else json.loads(text)))


def _number(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x)


def content_differences(first: Path, second: Path) -> dict[str, Any] | None:
    """What changed between two versions of a table or JSON file (None for another kind): the
    largest absolute change of a number present in both (`largest`: where, before, after, the
    change and its ratio to the larger magnitude), how many numbers and how many other values
    (words, verdicts, a number become missing) changed, the first few of the latter, and how
    many cells or keys only one version has."""
    if first.suffix not in (".parquet", ".csv", ".json", ".jsonl"):
        return None
    a, b = _cells(first), _cells(second)
    largest: dict[str, Any] | None = None
    numbers = 0
    words: list[list[Any]] = []
    for key in (k for k in a if k in b):
        x, y = a[key], b[key]
        nx, ny = _number(x), _number(y)
        both = nx is not None and ny is not None
        if both and not (math.isnan(nx) or math.isnan(ny)):
            if nx != ny:
                numbers += 1
                change = abs(ny - nx)
                if largest is None or change > largest["change"]:
                    scale = max(abs(nx), abs(ny))
                    largest = {"where": key, "before": x, "after": y, "change": change,
                               "relative": change / scale}  # fmt: skip
        elif not (both and math.isnan(nx) and math.isnan(ny)) and repr(x) != repr(y):
            words.append([key, x, y])  # a word, a verdict, a number become missing
    return {"largest": largest, "numbers_changed": numbers, "other_values_changed": len(words),
            "first_other_changes": words[:5],
            "only_in_one": len(set(a) ^ set(b))}  # fmt: skip
