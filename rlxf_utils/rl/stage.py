"""Notebook 03's stage: which algorithms are up to date, running one (fresh, resumed or reused)
from the start policy, and reading their logs back.

Each algorithm trains outside the kernel (`rl.launch.run_stage` -> `rl.worker` ->
`run_algorithm`; consecutive one-process algorithms in turn in one warm process,
`rl.launch.warm_groups`), which writes its log and, last, `policy/<algo>/complete.json` with the run's
marker (`algorithm_marker`: settings, seed, prompts, processes, input hashes); the kernel
computes the marker once, starts the process only when that file does not record it, and then
reads what the process wrote."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from rlxf_utils.algorithms import RL_ALGORITHMS, SFT_POLICIES, algorithm
from rlxf_utils.artifacts import RunDir, atomic_path
from rlxf_utils.config import StudyConfig
from rlxf_utils.data.contexts import load_contexts
from rlxf_utils.data.splits import load_splits
from rlxf_utils.freshness import REWARD_PATHS, input_hashes
from rlxf_utils.models.generation import (
    build_prompts,
    sampling_kwargs,
)
from rlxf_utils.models.kept import kept_frame, sampling_parts
from rlxf_utils.models.loading import load_start_policy
from rlxf_utils.models.policies import PolicySet
from rlxf_utils.prompts import CONTEXT_FIELDS
from rlxf_utils.reward.bundle import load_reward
from rlxf_utils.rl.core import RewardFn
from rlxf_utils.rl.didactic import didactic_figure
from rlxf_utils.rl.experience import (
    EXPERIENCE_FILE,
    counting_optimizer_steps,
    experience_table,
    has_checkpoint,
    record_experience,
    sft_experience,
)
from rlxf_utils.rl.launch import processes_for, run_lanes, run_stage, warm_groups
from rlxf_utils.rl.sft import SFT_SUMMARY_COLUMNS, loss_figure, run_sft_stage
from rlxf_utils.rl.sft import is_trained as sft_is_trained
from rlxf_utils.rl.tables import (
    guidance_table,
    settings_table,
    summary_table,
    training_curves_figure,
    training_table,
)
from rlxf_utils.rl.timing import mark
from rlxf_utils.rl.trainer import TrainJob
from rlxf_utils.runtime import barrier, is_main_process, resolve_device, seed_everything

log = logging.getLogger(__name__)


def make_reward_fn(reward_model: Any, batch_size: int = 32) -> RewardFn:
    """reward_fn(contexts, texts) -> calibrated P(MET) from a `reward.model.RewardModel`."""

    def reward_fn(contexts: list[dict[str, Any]], texts: list[str]) -> np.ndarray:
        ctx = [{k: c[k] for k in CONTEXT_FIELDS} for c in contexts]
        return np.asarray(
            reward_model.score(ctx, list(texts), batch_size=batch_size), dtype=np.float32
        )

    return reward_fn


#: What a run leaves that only that run may resume from: checkpoints (ours and TRL's), frontier
#: snapshots and RFT's scored candidates; removed when the settings or inputs change.
STALE_OUTPUTS = ("checkpoints", "trl", "snapshots", "pool.parquet")


def algorithm_marker(
    algo: str, cfg: StudyConfig, run_dir: str | Path, n_prompts: int, steps: int | None = None
) -> dict[str, Any]:
    """What an RL run depends on: its settings, steps, seed, prompts, process count and the
    hashes of its inputs (`complete.json` when it finished, `started.json` while it trains)."""
    root = Path(run_dir)
    return {
        "rl": cfg.rl.model_dump(mode="json", exclude={"num_threads", "algorithm", "seed"}),
        "policy": cfg.policy.model_dump(mode="json"),
        **{s: getattr(cfg, s).model_dump(mode="json") for s in algorithm(algo).sections},
        "steps": steps or cfg.rl.steps,
        "seed": cfg.training_seed,
        "prompts": n_prompts,
        # each process samples its own share: another process count is another run
        "processes": processes_for(cfg, "rl", algo),
        # what it was trained from: the data, the reward, the start policy (and RLGF's guide)
        "inputs": input_hashes(root, [
            "data", *REWARD_PATHS, f"policy/{cfg.rl.start_policy}/adapter",
            *([f"policy/{cfg.rlgf.guide}/adapter"] if algorithm(algo).family == "rlgf" else []),
        ]),
    }  # fmt: skip


def _matches(path: Path, marker: Mapping[str, Any]) -> bool:
    """True when the marker file `path` exists and records `marker`."""
    return path.is_file() and json.loads(path.read_text(encoding="utf-8")) == marker


def run_algorithm(
    algo: str,
    cfg: StudyConfig,
    run_dir: str | Path,
    reward_fn: RewardFn,
    contexts: Sequence[Mapping[str, Any]] | None = None,
    progress: bool = True,
    steps: int | None = None,
    marker: Mapping[str, Any] | None = None,
) -> pd.DataFrame:
    """Load the start policy afresh, build prompts from the training contexts and run one
    algorithm (in the worker process, or in the kernel with `compute.processes: kernel`).
    `marker`: the caller's `algorithm_marker` for these contexts, if it has one."""
    rd = RunDir(run_dir)
    if contexts is None:
        contexts = load_contexts(rd.root, "train", cfg.rl.max_prompts, cfg.training_seed)
    if any(c.get("split", "train") != "train" for c in contexts):
        raise ValueError("RL must only see split=='train' contexts; held-out contexts were passed")
    if cfg.rl.num_threads is not None:  # on shared cores, 1 thread avoids spin-wait slowdowns
        torch.set_num_threads(cfg.rl.num_threads)
    out = rd.root / "policy" / algo
    # A finished run with the same settings and prompts is reused (the marker is written last),
    # checked before the start policy is loaded and merged.
    marker = marker or algorithm_marker(algo, cfg, rd.root, len(contexts), steps)
    done = out / "complete.json"
    if _matches(done, marker):
        log.info("%s: up to date (%s): reading its outputs", algo, done)
        return rd.read_parquet(f"policy/{algo}/train_log.parquet")
    # Checkpoints resume only the run they belong to: with other settings or inputs, the
    # checkpoints, TRL's checkpoints and the frontier snapshots of the old run are removed.
    started = out / "started.json"
    if is_main_process():  # the others wait until the folder is ready
        if out.exists() and not _matches(started, marker):
            stale = [out / d for d in STALE_OUTPUTS if (out / d).exists()]
            if stale:
                log.info(
                    "%s: settings or inputs changed; removing %s", algo, [p.name for p in stale]
                )
            for d in stale:
                if d.is_dir():
                    shutil.rmtree(d)
                else:
                    d.unlink()
            done.unlink(missing_ok=True)
        out.mkdir(parents=True, exist_ok=True)
        # a process killed while writing leaves the temporary folders of `atomic_dir` behind
        for folder in (out, out / "snapshots", out / "checkpoints"):
            for tmp_dir in folder.glob(".*") if folder.is_dir() else []:
                if tmp_dir.is_dir():
                    shutil.rmtree(tmp_dir, ignore_errors=True)
        with atomic_path(started) as tmp:
            tmp.write_text(json.dumps(marker, indent=2), encoding="utf-8")
    barrier()
    seed_everything(cfg.training_seed)
    model, tok = load_start_policy(
        cfg.policy, cfg.rl.start_policy, rd.root, device=resolve_device(cfg.compute.device)
    )
    prompts = build_prompts(contexts, tok, cfg.rl.prompt_template, cfg.policy)
    log.info("%s: %d training prompts -> %s", algo, len(prompts), out)
    mark("policy_loaded")
    job = TrainJob(algo, model, tok, prompts, contexts, reward_fn, cfg.rl, cfg.policy, out,
                   seed=cfg.training_seed, progress=progress, steps=steps, study=cfg,
                   run_dir=rd.root)  # fmt: skip
    resumed = has_checkpoint(out)
    mark("train_start")
    with counting_optimizer_steps() as counted:
        frame = algorithm(algo).train(job)
    mark("train_end")
    if is_main_process():
        record_experience(job, int(frame["step"].max()) if len(frame) else 0, counted, resumed)
        with atomic_path(done) as tmp:
            tmp.write_text(json.dumps(marker, indent=2), encoding="utf-8")
    return frame


def read_logs(run_dir: str | Path, algos: Sequence[str]) -> pd.DataFrame:
    """All algorithms' `policy/<algo>/train_log.parquet`, stacked."""
    rd = RunDir(run_dir)
    frames = [rd.read_parquet(f"policy/{a}/train_log.parquet", stage="notebook 03") for a in algos]
    return pd.concat(frames, ignore_index=True)


#: Where notebook 03 keeps each policy's before/after responses (`models.kept`), and the code
#: that decides them (relative to the package).
BEFORE_AFTER = "policy/before_after"
BEFORE_AFTER_CODE = ("models",)


def before_after_samples(
    cfg: StudyConfig,
    run_dir: str | Path,
    contexts: Sequence[Mapping[str, Any]],
    reward_fn: RewardFn,
    policies: Sequence[str],
    n: int = 4,
) -> pd.DataFrame:
    """Responses to the same `n` training prompts from each named policy, with their rewards.

    The policies come from evaluation's `models.policies.PolicySet` on `compute.device`: the base
    weights (zero-shot and the supervised adapters) and the start policy's (the RL adapters)
    are each loaded once, and every policy samples with evaluation's settings and seed. Each
    policy's responses are kept in `policy/before_after/` (`models.kept`) and read back while
    nothing that decides them changed: a rerun after one algorithm retrained samples it alone."""

    ctx = [dict(c) for c in contexts[:n]]
    algos = [p for p in policies if p != "base" and p not in SFT_POLICIES]
    run = RunDir(run_dir)
    pset = PolicySet(cfg, run, algos)
    prompts = build_prompts(ctx, pset.tok, cfg.rl.prompt_template, cfg.policy)
    gen_kw = sampling_kwargs(cfg, progress=False)
    rows: list[dict[str, Any]] = []
    for name in policies:
        parts = sampling_parts(cfg, run, name, prompts, 1, gen_kw, BEFORE_AFTER_CODE)
        df, _, _ = kept_frame(run, BEFORE_AFTER, "samples", name, parts,
                              lambda name=name: pset.generate(name, prompts, 1, name, gen_kw))  # fmt: skip
        texts = df["response"].tolist()
        scores = reward_fn(ctx, texts)
        for c, t, s in zip(ctx, texts, scores, strict=True):
            rows.append(
                {
                    "policy": name,
                    **{k: c[k] for k in CONTEXT_FIELDS},
                    "response": t,
                    "reward": float(s),
                }
            )
    return pd.DataFrame(rows)


# -- notebook 03's steps: each trains (in its own process) what is not up to date, then writes ---
def sft_step(cfg: StudyConfig, params_file: str | Path, run: RunDir) -> pd.DataFrame:
    """Train `sft` and `sft_met` in their own process unless up to date, then write the SFT table
    (`tables/sft_summary`) and the loss figure (`figures/sft_loss`); returns the table."""
    if cfg.sft.enabled and not sft_is_trained(cfg, run):
        run_stage(cfg, params_file, run.root, "sft")  # its own process; then read what it wrote
    summary = (run_sft_stage(cfg, run) if cfg.sft.enabled
               else pd.DataFrame(columns=list(SFT_SUMMARY_COLUMNS)))  # fmt: skip
    run.write_table("sft_summary", summary)
    if cfg.sft.enabled:
        logs = [run.read_parquet(f"policy/{n}/train_log.parquet") for n in SFT_POLICIES]
        run.write_figure("sft_loss", loss_figure(pd.concat(logs, ignore_index=True)))
    return summary


def training_inputs(cfg: StudyConfig, run: RunDir) -> tuple[list[dict[str, Any]], RewardFn, Any]:
    """RL's training contexts, the reward function on notebook 02's reward model, and the model."""
    contexts = load_contexts(run.root, "train", cfg.rl.max_prompts, cfg.training_seed)
    reward_model, _audit = load_reward(
        run.require("reward_model", stage="notebook 02 (reward model)")
    )
    return contexts, make_reward_fn(reward_model, cfg.rl.reward_batch_size), reward_model


def train_or_read(
    algo: str,
    cfg: StudyConfig,
    params_file: str | Path,
    run: RunDir,
    reward_fn: RewardFn,
    contexts: Sequence[Mapping[str, Any]],
) -> pd.DataFrame:
    """One algorithm's training log: trained in its own process unless `complete.json` already
    records this run's marker (computed once, here), then read from what the process wrote;
    with `compute.processes: kernel`, trained (or reused) in this process."""
    return train_or_read_all([algo], cfg, params_file, run, reward_fn, contexts)[0]


def train_or_read_all(
    algos: Sequence[str],
    cfg: StudyConfig,
    params_file: str | Path,
    run: RunDir,
    reward_fn: RewardFn,
    contexts: Sequence[Mapping[str, Any]],
) -> list[pd.DataFrame]:
    """`train_or_read` for each of `algos`: those not up to date train in processes grouped by
    `rl.launch.warm_groups` (one warm process for consecutive one-process algorithms, or
    `compute.parallel_stages` of them side by side: `rl.launch.run_lanes`), then every log is
    read from what the processes wrote."""
    markers = {a: algorithm_marker(a, cfg, run.root, len(contexts)) for a in algos}
    if cfg.compute.processes == "kernel":
        return [run_algorithm(a, cfg, run.root, reward_fn, contexts, marker=markers[a])
                for a in algos]  # fmt: skip
    done = {a: run.path(f"policy/{a}/complete.json") for a in algos}
    pending = [a for a in algos if not _matches(done[a], markers[a])]
    for group in warm_groups(cfg, pending):
        run_lanes(cfg, params_file, run.root, group)  # side by side: `compute.parallel_stages`
    for a in pending:
        if not _matches(done[a], markers[a]):
            raise RuntimeError(
                f"{a}: its training process ended without writing {done[a]} for this run's "
                "settings and inputs (were the parameters or an input changed meanwhile?)"
            )
    frames = []
    for a in algos:
        log.info("%s: up to date (%s): reading its outputs", a, done[a])
        frames.append(run.read_parquet(f"policy/{a}/train_log.parquet"))
    return frames


def rl_step(
    cfg: StudyConfig,
    params_file: str | Path,
    run: RunDir,
    reward_fn: RewardFn,
    contexts: Sequence[Mapping[str, Any]],
) -> tuple[pd.DataFrame, dict[str, pd.DataFrame]]:
    """Train every `algorithms.algorithm` unless up to date (`train_or_read_all`), then write the stacked
    logs (`policy/train_logs.parquet`), the settings, the training curves and summary, RLGF's
    guidance and ILHF's training tables. Returns (logs, tables)."""
    frames = train_or_read_all(cfg.rl.algorithm, cfg, params_file, run, reward_fn, contexts)
    logs = pd.concat(frames, ignore_index=True)
    run.write_parquet("policy/train_logs.parquet", logs)
    tables = {"rl_algorithm_settings": settings_table(run.root, cfg.rl.algorithm),
              "rl_train_experience": train_experience(cfg, run)}  # fmt: skip
    run.write_figure("rl_training_curves", training_curves_figure(logs))
    beta_range = tuple(cfg.rl.kl_coef_range) if cfg.rl.adaptive_kl else None
    tables["rl_summary"] = summary_table(logs, alpha=cfg.evaluation.alpha, beta_range=beta_range)
    # every table, with its header alone when no algorithm of its family ran: a rerun of a run dir
    # with fewer algorithms leaves none of the earlier run's rows behind
    tables["rlgf_guidance"] = guidance_table(logs)
    tables["ilhf_training"] = training_table(logs)
    for name, table in tables.items():
        run.write_table(name, table)
    return logs, tables


def train_experience(cfg: StudyConfig, run: RunDir) -> pd.DataFrame:
    """What each method trained on (`rl.experience`): the supervised policies' and every
    algorithm's distinct contexts (and how many are the first RL algorithm's), sequences,
    optimiser steps and sequences per step, from what each trainer recorded."""
    labelled, _ = load_splits(run)
    records = [sft_experience(run, n, labelled, cfg.sft.epochs) for n in SFT_POLICIES
               if cfg.sft.enabled]  # fmt: skip
    records += [run.read_json(f"policy/{a}/{EXPERIENCE_FILE}", stage="notebook 03")
                for a in cfg.rl.algorithm]  # fmt: skip
    online = [a for a in cfg.rl.algorithm if a in RL_ALGORITHMS]
    return experience_table(records, online[0] if online else None)


def didactic_step(run: RunDir) -> pd.DataFrame:
    """ILHF's one-token example against REINFORCE with a KL penalty: `figures/ilhf_didactic` and
    the end points (`tables/ilhf_didactic`)."""
    fig, ends = didactic_figure()
    run.write_figure("ilhf_didactic", fig)
    run.write_table("ilhf_didactic", ends)
    return ends


def samples_step(
    cfg: StudyConfig, run: RunDir, contexts: Sequence[Mapping[str, Any]], reward_fn: RewardFn
) -> pd.DataFrame:
    """The same training prompts answered by the zero-shot model, the supervised policies and
    every RL policy (`tables/rl_samples_before_after`, `policy/samples_before_after.jsonl`)."""
    names = ["base", *(list(SFT_POLICIES) if cfg.sft.enabled else []), *cfg.rl.algorithm]
    samples = before_after_samples(cfg, run.root, contexts, reward_fn, names, n=4)
    run.write_table("rl_samples_before_after", samples)
    run.write_jsonl("policy/samples_before_after.jsonl", samples.to_dict("records"))
    return samples
