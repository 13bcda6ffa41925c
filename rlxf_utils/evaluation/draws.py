"""Samples drawn once: a policy's responses on the held-out prompts, kept in `eval/draws/` under a
key of everything that decides them, and read back instead of drawn again.

A further training seed (`rlxf seeds`) evaluates the start policy, the supervised policies and
best-of-N's pool with the run's own sampling seed on the same prompts: the very draws of the
run's notebook 04, which the seed reads from the run's `eval/draws/` (linked into the seed, as
`seeds.REUSED` lists) instead of drawing them again. A rerun of notebook 04 after one algorithm
changed redraws only that algorithm's samples. Table 3's completions, the held-out log-probs and
the RL snapshots' samples (the frontier) are kept here the same way, per policy (`kept_pass`).

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

import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from rlxf_utils.artifacts import RunDir, sha256_file
from rlxf_utils.evaluation.sampling import sample_tuned
from rlxf_utils.models.kept import kept_frame, sampling_parts

log = logging.getLogger(__name__)

#: Where a run keeps its draws (one parquet and one JSON record per kind and policy).
FOLDER = "eval/draws"
#: The code a draw depends on, relative to the package: what samples and what scores log-probs.
DRAW_CODE = ("models", "evaluation/sampling.py")


def draw_parts(cfg: Any, run: RunDir, name: str, prompts: Sequence[str], k: int,
               gen_kw: Mapping[str, Any], logprob_batch: int, judges: bool) -> dict[str, Any]:  # fmt: skip
    """Everything that decides policy `name`'s draw: two draws with equal parts are the same
    (`models.kept.sampling_parts`, with the log-prob batch and whether the judges scored it)."""
    parts = sampling_parts(cfg, run, name, prompts, k, gen_kw, DRAW_CODE)
    return {**parts, "logprob_batch": int(logprob_batch), "judges": bool(judges)}


def draw(cfg: Any, run: RunDir, pset: Any, kind: str, name: str, prompts: Sequence[str], k: int,
         gen_kw: Mapping[str, Any], logprob_batch: int, desc: str, judges: bool = True,
         timer: Any = None, phase: str | None = None) -> pd.DataFrame:  # fmt: skip
    """`sampling.sample_tuned`'s frame for policy `name` (`kind`: 'samples', 'pool', ...), read
    from `eval/draws/` where a draw with the same parts is there, else drawn and kept there. A
    draw read back adds the seconds it took when drawn to `timer`'s `phase` (`timer.reuse`)."""
    parts = draw_parts(cfg, run, name, prompts, k, gen_kw, logprob_batch, judges)
    df, seconds, reused = kept_frame(
        run, FOLDER, kind, name, parts,
        lambda: sample_tuned(pset, name, prompts, k, gen_kw, logprob_batch, desc=desc, judges=judges),
    )  # fmt: skip
    if reused and timer is not None and phase is not None:
        timer.reuse(phase, seconds)
    return df


def kept_pass(cfg: Any, run: RunDir, kind: str, name: str, prompts: Sequence[str],
              settings: Mapping[str, Any], make: Callable[[], pd.DataFrame], timer: Any,
              label: str, k: int = 1, snapshot: Path | None = None) -> pd.DataFrame:  # fmt: skip
    """`make()`'s frame for policy `name`, kept beside the draws: a pass that depends only on
    the policy's weights, `prompts`, k and `settings` (table 3's completions, the held-out
    log-probs, an RL snapshot's samples), so that a rerun after one algorithm changed, or a
    further seed, makes it again for that algorithm alone. `snapshot`: the adapter file of one
    of `name`'s snapshots, which `make` loads; its hash joins the key and the frame is kept as
    `<name>.<its folder>`. Read back, the frame is listed in `timer`'s `reused` as `label`; its
    seconds are not counted (no phase of the design's costs is made this way)."""
    parts = sampling_parts(cfg, run, name, prompts, k, settings, DRAW_CODE)
    keep_as = name
    if snapshot is not None:
        parts["snapshot"] = sha256_file(snapshot)
        keep_as = f"{name}.{snapshot.parent.name}"
    df, seconds, reused = kept_frame(run, FOLDER, kind, keep_as, parts, make)
    if reused:
        timer.read_back(label, seconds)
    return df
