"""Equal experience: one seeded order of the training contexts that every method draws from, and
what each trainer actually used (distinct contexts, training sequences, optimiser steps,
sequences per optimiser step), recorded as it trains and tabled for notebook 03.

RL visits the policy pool's contexts in `rl.core.prompt_schedule`'s order: passes over seeded
permutations, `rl.prompts_per_step` a step, `rl.num_generations` responses each. The methods that
learn from history (KTO's rows, DPO's and ILHF's pairs) walk the same visits and take, per visit,
as many sequences as RL samples there (`num_generations`; pairs: half as many); a context holds
only so many historical rows, so they walk on past RL's visits until they have RL's number of
sequences (`take_in_context_order`). RFT asks RL's visits, each `num_generations` times.
"""

from __future__ import annotations

import contextlib
import importlib
import json
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from rlxf_utils.artifacts import RunDir, write_json
from rlxf_utils.prompts import CONTEXT_FIELDS
from rlxf_utils.rl.core import prompt_schedule

#: Each trainer's record of what it trained on, in its output folder.
EXPERIENCE_FILE = "experience.json"

#: The table's columns (`experience_table`).
EXPERIENCE_COLUMNS = ("algo", "distinct_contexts", "contexts_shared_with_rl", "sequences",
                      "optimizer_steps", "sequences_per_step", "optimizers", "passes", "resumed")  # fmt: skip


def context_visits(n_contexts: int, seed: int) -> Iterator[int]:
    """Context indices in RL's order without end: `prompt_schedule`'s steps, flattened, and the
    passes after them (the same seeded permutations)."""
    rng = np.random.default_rng(seed)
    while True:
        yield from rng.permutation(n_contexts).tolist()


def context_key(record: Mapping[str, Any]) -> str:
    """A context as one string (its `CONTEXT_FIELDS`)."""
    return "\x1f".join(str(record[k]) for k in CONTEXT_FIELDS)


def take_in_context_order(
    items: pd.DataFrame, contexts: Sequence[Mapping[str, Any]], seed: int, per_visit: int, n: int
) -> np.ndarray:
    """Positions of up to `n` of `items` (rows or pairs with `CONTEXT_FIELDS`), taken by walking
    `context_visits` over `contexts`: at each visit up to `per_visit` not yet taken of that
    context's items (in a seeded order). Stops at `n` or when the contexts' items run out; items
    of a context not in `contexts` are never taken."""
    rng = np.random.default_rng([seed, 45])
    keys = [context_key(r) for r in items[list(CONTEXT_FIELDS)].to_dict("records")]
    queues: dict[str, list[int]] = {}
    for pos, k in enumerate(keys):
        queues.setdefault(k, []).append(pos)
    queues = {k: rng.permutation(v).tolist() for k, v in sorted(queues.items())}
    order = [context_key(c) for c in contexts]
    target = min(n, sum(len(queues.get(k, [])) for k in set(order)))
    taken: list[int] = []
    visits = context_visits(len(order), seed) if order else iter(())
    while len(taken) < target:  # every pass visits every context: each takes one at least
        i = next(visits)
        q = queues.get(order[i], [])
        got, queues[order[i]] = q[:per_visit], q[per_visit:]
        taken += got[: target - len(taken)]
    return np.asarray(taken, dtype=np.int64)


_STEPS: Counter[int] = Counter()
#: Each optimiser's own step count after its last step (Adam's `state["step"]`, which a resumed
#: run restores from its checkpoint): the steps of the whole run, not only this process's.
_TOTAL: dict[int, int] = {}
_HOOK: list[Any] = []


def _count(optimizer: Any, args: Any, kwargs: Any) -> None:
    _STEPS[id(optimizer)] += 1
    state = next((st for st in optimizer.state.values() if isinstance(st, dict) and "step" in st),
                 None)  # fmt: skip
    if state is not None:
        _TOTAL[id(optimizer)] = int(state["step"])


@contextlib.contextmanager
def counting_optimizer_steps() -> Iterator[dict[str, int]]:
    """Counts every torch optimiser's steps in this process while it is open (a global step hook:
    ours, TRL's and accelerate's wrapped optimisers alike); yields a dict filled on exit with
    `optimizer_steps` (the most steps any one optimiser took: ILHF's particles and RLGF's critics
    have their own), `optimizers` (how many stepped) and `optimizer_steps_total` (the most steps
    any of them holds in its own state, a resumed run's steps before it included; None where
    the optimiser keeps no step count)."""
    if not _HOOK:
        hooks = importlib.import_module("torch.optim.optimizer")
        _HOOK.append(hooks.register_optimizer_step_post_hook(_count))
    before = Counter(_STEPS)
    out: dict[str, int] = {}
    try:
        yield out
    finally:
        delta = {k: v - before.get(k, 0) for k, v in _STEPS.items() if v > before.get(k, 0)}
        out["optimizer_steps"] = max(delta.values(), default=0)
        out["optimizers"] = len(delta)
        totals = [_TOTAL[k] for k in delta if k in _TOTAL]
        out["optimizer_steps_total"] = max(totals) if totals else None


def has_checkpoint(output_dir: Path) -> bool:
    """True when a run in `output_dir` will resume (our checkpoints or TRL's)."""
    return any((output_dir / "checkpoints").glob("step_*")) or any(
        (output_dir / "trl").glob("checkpoint-*")
    )


def used_data(job: Any, steps_run: int) -> tuple[list[str], int]:
    """The contexts (one key per sequence's context) and the number of training sequences the
    trainer in `job.output_dir` used: its data file where it trains on a fixed set (KTO's rows,
    DPO's pairs, RFT's kept responses: `data.parquet`; ILHF's history pairs: `pairs.parquet`),
    else the contexts its `steps_run` steps visited (`prompt_schedule`, `num_generations` each)."""
    out, rl = Path(job.output_dir), job.rl
    for name, per_row in (("data.parquet", 2 if job.algo == "dpo" else 1), ("pairs.parquet", 2)):
        if (out / name).is_file():
            frame = pd.read_parquet(out / name)
            keys = [context_key(r) for r in frame[list(CONTEXT_FIELDS)].to_dict("records")]
            return keys, per_row * len(frame)
    schedule = prompt_schedule(len(job.prompts), steps_run, rl.prompts_per_step, job.seed)
    keys = [context_key(job.contexts[i]) for step in schedule for i in step]
    return keys, len(keys) * rl.num_generations


def record_experience(job: Any, steps_run: int, counted: Mapping[str, int], resumed: bool) -> dict[str, Any]:  # fmt: skip
    """`experience.json` in the trainer's folder: its contexts, sequences, optimiser steps and
    passes over its data. A resumed run counts its steps from its optimisers' own state
    (restored from the checkpoint), so its record equals an uninterrupted run's; None where
    that count is missing (the steps this process took are not the run's)."""
    out = Path(job.output_dir)
    keys, sequences = used_data(job, steps_run)
    settings = json.loads((out / "settings.json").read_text(encoding="utf-8"))
    record = {
        "algo": job.algo,
        "contexts": sorted(set(keys)),
        "sequences": int(sequences),
        "optimizer_steps": _run_steps(counted, resumed),
        "optimizers": int(counted["optimizers"]),
        "passes": float(settings.get("update_epochs") or 1),
    }
    write_json(out / EXPERIENCE_FILE, record)
    return record


def _run_steps(counted: Mapping[str, Any], resumed: bool) -> int | None:
    total = counted.get("optimizer_steps_total")
    if total is not None:
        return int(total)
    return None if resumed else int(counted["optimizer_steps"])


def sft_experience(run: RunDir, name: str, labelled: pd.DataFrame, epochs: float) -> dict[str, Any]:  # fmt: skip
    """The same record for a supervised policy, from its `data.json` (rows) and training log."""
    info = run.read_json(f"policy/{name}/data.json", stage="notebook 03")
    steps = len(run.read_parquet(f"policy/{name}/train_log.parquet", stage="notebook 03"))
    rows = labelled[labelled["row_id"].isin(set(info["row_ids"]))]
    keys = [context_key(r) for r in rows[list(CONTEXT_FIELDS)].to_dict("records")]
    return {"algo": name, "contexts": sorted(set(keys)), "sequences": int(info["examples"]),
            "optimizer_steps": steps, "optimizers": 1, "passes": float(epochs)}  # fmt: skip


def experience_table(records: Sequence[Mapping[str, Any]], rl_algo: str | None) -> pd.DataFrame:
    """One row per method: distinct contexts, how many of them `rl_algo`'s (the reference RL
    run) are, training sequences, optimiser steps, sequences per optimiser step (sequences x
    passes / steps), optimisers, passes and whether a resume left the count unknown."""
    ref = next((set(r["contexts"]) for r in records if r["algo"] == rl_algo), None)
    rows = []
    for r in records:
        steps = r["optimizer_steps"]
        rows.append({
            "algo": r["algo"], "distinct_contexts": len(r["contexts"]),
            "contexts_shared_with_rl": len(set(r["contexts"]) & ref) if ref is not None else np.nan,
            "sequences": r["sequences"],
            "optimizer_steps": np.nan if steps is None else steps,
            "sequences_per_step": np.nan if not steps else r["sequences"] * r["passes"] / steps,
            "optimizers": r["optimizers"], "passes": r["passes"], "resumed": steps is None,
        })  # fmt: skip
    return pd.DataFrame(rows, columns=list(EXPERIENCE_COLUMNS))
