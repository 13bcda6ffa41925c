"""The process a launched stage runs in (`python -m rlxf_utils.rl.worker`, under `accelerate
launch`): SFT, or one RL algorithm, reading the run dir and writing its outputs there."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from rlxf_utils.artifacts import RunDir
from rlxf_utils.config import load_config
from rlxf_utils.processes import die_with_parent
from rlxf_utils.rl.launch import NEXT_STAGE
from rlxf_utils.rl.memory import memory_table
from rlxf_utils.rl.timing import MARKS, mark, write_stage_timing
from rlxf_utils.runtime import hub_environment, is_main_process, process_state


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rlxf_utils.rl.worker", description=__doc__)
    p.add_argument("stage", choices=["sft", "rl"], nargs="?")
    p.add_argument("--params", type=Path)
    p.add_argument("--run-dir", type=Path)
    p.add_argument("--algo", default=None,
                   help="an rl.algorithm, or several joined by commas: one process trains them in turn")  # fmt: skip
    p.add_argument(
        "--memory", action="store_true", help="print docs/profiles-and-gpus.md's memory table"
    )
    args = p.parse_args(argv)
    if not args.memory and not (args.stage and args.params and args.run_dir):
        p.error("a stage with --params and --run-dir, or --memory")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    if args.memory:
        print(memory_table(), end="")
        return 0
    die_with_parent()  # the launcher's worker: gone when the launcher is
    cfg = load_config(args.params)
    hub_environment(cfg)
    logging.basicConfig(
        level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stdout
    )
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        process_state()  # join the process group before anything else creates a state
    run = RunDir(args.run_dir)
    # What trains imports transformers, which reads the hub's offline switch once, at import:
    # these imports wait until `hub_environment` has set it from the parameters.
    if args.stage == "sft":
        from rlxf_utils.rl.sft import run_sft_stage

        mark("imports")
        run_sft_stage(cfg, run, progress=False)
        mark("written")
        if is_main_process():  # where the stage's time went (`rl.timing`)
            write_stage_timing(run.root, "sft")
        return 0
    algos = (args.algo or "").split(",")
    unknown = [a for a in algos if a not in cfg.rl.algorithm]
    if unknown:
        raise SystemExit(f"--algo {args.algo!r}: expected one of rl.algorithm {cfg.rl.algorithm}")
    from rlxf_utils.rl.stage import run_algorithm, training_inputs

    mark("imports")
    contexts, reward_fn, _ = training_inputs(cfg, run)
    mark("reward_loaded")
    for i, algo in enumerate(algos):
        started = None
        if i:  # the next algorithm in this warm process: a fresh start but for the imports
            print(f"{NEXT_STAGE}{algo}", flush=True)  # the launcher's log moves to its folder
            fresh_process_state()
            MARKS.clear()
            started = time.time()
        run_algorithm(algo, cfg, run.root, reward_fn, contexts=contexts, progress=False)
        mark("written")
        if "train_end" in MARKS and is_main_process():  # it trained: where its time went
            write_stage_timing(run.root, algo, started=started)
    return 0


def fresh_process_state() -> None:
    """What one algorithm leaves in the process that the next would not find in a process of
    its own, cleared: accelerate's shared Accelerator and gradient state (the first
    `Accelerator` would otherwise fix the next one's settings), and the freed model's memory.
    The launcher groups only one-process stages (`rl.launch.warm_groups`): the process state
    (device, CPU or not) stays; each algorithm seeds itself (`run_algorithm`)."""
    import gc

    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state()
    GradientState._reset_state()
    gc.collect()


if __name__ == "__main__":  # pragma: no cover - exercised through run_stage in the tests
    raise SystemExit(main())
