"""When a notebook is up to date: what it depends on, its fingerprint and its completion record.

Each study notebook declares in its metadata (`"rlxf"`) what it reads and writes, as a DVC stage
or a Snakemake rule would::

    "rlxf": {"params": ["run.seed", "data", "reward", ...],   # config sections or dotted keys
             "inputs": ["data", "reward_model/encoder", ...],  # run-dir paths it reads
             "outputs": ["reward", "reward_model/bundle.json", ...]}  # run-dir paths it writes

Its fingerprint hashes the notebook file, the package's source (every `rlxf_utils/**/*.py`, by
content, so an uncommitted change counts and a README edit does not), the resolved parameters it
reads, the data file's sha256 when it reads `data`, and the sha256 of every input path. When the
notebook finishes, the runner writes `<run>/.rlxf/stages/<notebook>.json` (atomically, last): the
fingerprint, what went into it, and the sha256 of every output. A notebook is up to date when that
record exists, its fingerprint is unchanged, and its outputs still hash as recorded. The record is
deleted when the notebook starts, so an interrupted notebook never looks complete.

A notebook without the metadata reads every parameter and declares no paths: it is rerun whenever
any parameter or the code changes.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlxf_utils.artifacts import RunDir, hash_path, sha256_file
from rlxf_utils.config import PROJECT_ROOT

__all__ = [
    "REWARD_PATHS",
    "STAGE_DIR",
    "input_hashes",
    "StageSpec",
    "clear_record",
    "code_hash",
    "fingerprint",
    "hash_path",
    "read_record",
    "stage_spec",
    "up_to_date",
    "write_record",
]


STAGE_DIR = ".rlxf/stages"


ALL_PARAMS = ("*",)


#: What notebook 02 writes for RL (not `reward_model/uncertainty/`, notebook 04's cache).
REWARD_PATHS = (
    "reward_model/bundle.json",
    "reward_model/encoder",
    "reward_model/audit",
    "reward_model/tfidf",
)


@dataclass(frozen=True)
class StageSpec:
    """What a notebook reads (parameters, run-dir inputs) and writes (run-dir outputs)."""

    params: tuple[str, ...] = ALL_PARAMS
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()


def stage_spec(notebook: Path) -> StageSpec:
    """The notebook's `metadata.rlxf` declaration; a clear error naming a malformed one."""
    meta = json.loads(Path(notebook).read_text(encoding="utf-8")).get("metadata", {}).get("rlxf")
    if meta is None:
        return StageSpec()
    if not isinstance(meta, dict) or set(meta) - {"params", "inputs", "outputs"}:
        raise ValueError(
            f"{notebook}: metadata.rlxf must be an object with 'params', 'inputs', 'outputs' "
            f"(lists of strings); got {meta!r}"
        )
    out = {}
    for key in ("params", "inputs", "outputs"):
        value = meta.get(key, list(ALL_PARAMS) if key == "params" else [])
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise ValueError(f"{notebook}: metadata.rlxf.{key} must be a list of non-empty strings")
        out[key] = tuple(value)
    return StageSpec(**out)


def input_hashes(root: Path, paths: tuple[str, ...] | list[str]) -> dict[str, str | None]:
    """sha256 of each run-dir path (None where absent): what a reused result was computed from."""
    return {p: hash_path(Path(root) / p) for p in paths}


def code_hash(root: Path = PROJECT_ROOT / "rlxf_utils") -> str:
    """sha256 over the package's Python sources (relative path + content), in sorted order."""
    h = hashlib.sha256()
    for f in sorted(Path(root).rglob("*.py")):
        h.update(f.relative_to(root).as_posix().encode() + b"\0")
        h.update(f.read_bytes())
    return h.hexdigest()


def _params(resolved: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    if keys == ALL_PARAMS:
        return resolved
    out: dict[str, Any] = {}
    for key in keys:
        node: Any = resolved
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                raise KeyError(f"metadata.rlxf.params names {key!r}, which the parameters lack")
            node = node[part]
        out[key] = node
    return out


def fingerprint(
    notebook: Path, cfg: Any, run: RunDir, spec: StageSpec
) -> tuple[str, dict[str, Any]]:
    """(sha256 digest, the parts it hashes) of everything `notebook` depends on."""

    params = _params(cfg.resolved(), spec.params)
    reads_data = spec.params == ALL_PARAMS or any(
        k == "data" or k.startswith("data.") for k in spec.params
    )
    parts = {
        "notebook": sha256_file(Path(notebook)),
        "code": code_hash(),
        "params": params,
        "data_sha256": sha256_file(cfg.data.path) if reads_data else None,
        "inputs": {p: hash_path(run.path(p)) for p in spec.inputs},
    }
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest(), parts


def _record_rel(stem: str) -> str:
    return f"{STAGE_DIR}/{stem}.json"


def read_record(run: RunDir, stem: str) -> dict[str, Any] | None:
    """The completion record of a notebook, or None (absent or unreadable: not complete)."""
    if not run.exists(_record_rel(stem)):
        return None
    try:
        return json.loads(run.path(_record_rel(stem)).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def clear_record(run: RunDir, stem: str) -> None:
    """Forget a notebook's completion (called before it runs)."""
    run.path(_record_rel(stem)).unlink(missing_ok=True)


def write_record(
    run: RunDir, stem: str, digest: str, parts: dict[str, Any], spec: StageSpec, seconds: float
) -> Path:
    """Write the completion record, with the outputs' hashes, as the notebook's last act."""
    return run.write_json(
        _record_rel(stem),
        {
            "notebook": stem,
            "fingerprint": digest,
            "parts": parts,
            "outputs": {p: hash_path(run.path(p)) for p in spec.outputs},
            "ended": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "seconds": round(seconds, 1),
        },
    )


def _changed(old: dict[str, Any], new: dict[str, Any]) -> str:
    """Which parts of a fingerprint differ, e.g. 'parameters rl' or 'input reward_model/encoder'."""
    out = []
    for key, label in (
        ("notebook", "the notebook"),
        ("code", "the package code"),
        ("data_sha256", "the data file"),
    ):
        if old.get(key) != new.get(key):
            out.append(label)
    for key, label in (("params", "parameters"), ("inputs", "input")):
        a, b = old.get(key) or {}, new.get(key) or {}
        diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        if diff:
            out.append(f"{label} {', '.join(diff)}")
    return "; ".join(out) or "its fingerprint"


def up_to_date(
    run: RunDir, stem: str, digest: str, spec: StageSpec, parts: dict[str, Any] | None = None
) -> tuple[bool, str, dict | None]:
    """(up to date?, why not / from when, the record). Outputs must hash as they did at the end."""
    rec = read_record(run, stem)
    if rec is None:
        return False, "no completion record", None
    if rec.get("fingerprint") != digest:
        return False, f"changed: {_changed(rec.get('parts', {}), parts or {})}", rec
    if not run.exists(f"notebooks/{stem}.ipynb"):
        return False, "its executed copy is missing", rec
    recorded = rec.get("outputs", {})
    for p in spec.outputs:
        if recorded.get(p) != hash_path(run.path(p)):
            return False, f"its output {p} changed or is missing", rec
    return True, f"from the run that ended {rec.get('ended')}", rec
