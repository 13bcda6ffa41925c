"""Notebook 04's draws in side-by-side processes: every policy's samples, best-of-N's pool, the
RL snapshots' samples, Table 3's completions and the held-out log-probs, drawn ahead of the
stage by `compute.parallel_stages` lanes and kept in `eval/draws/`, where the stage then reads
them back (`evaluation.draws`) instead of drawing them one after another in the kernel.

Why it changes no number: a draw is kept under a key of everything that decides it (the
weights, prompts, settings, seed, sampling code, versions, device and thread count), and each
lane runs the very functions the stage's families run (`EvalInputs.draw`, `draw_pool`,
`tables.snapshot_draw`, `table3_draw`, `heldout_draw`). A lane has every core's threads, as the
kernel does (`compute.lane_threads: all`, the only setting under which the lanes run: a lane of
fewer threads would round bf16 differently, and its draws would not be the kernel's), and waits
passively for OpenMP work beside the other lane (`bench/omp_wait.py`). The work is not dealt in
advance: the lanes take the next task from one ordered list, heaviest first, each claiming a
task by creating its file in `eval/lanes/` (a claim is atomic), so neither lane idles while the
other has several tasks left.

    notebook 04 --> run_draw_lanes(cfg, run)      the kernel waits, its threads idle
                      lane 0: python -m rlxf_utils.evaluation.lanes --config C --run-dir R --lane 0
                      lane 1: ... --lane 1          each: load_inputs(reward_models=False), then claim
                                                    tasks and draw them into eval/draws/
                <-- every lane done (a failed lane: `LaneFailed`, its log's tail)
                --> run_evaluation_stage reads every draw back

This module imports no torch at the top: the kernel calls `run_draw_lanes` before it loads a
model."""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from rlxf_utils.artifacts import RunDir
from rlxf_utils.processes import die_with_parent, launch_env

log = logging.getLogger(__name__)

#: Where the lanes claim their tasks (one empty file per task taken), cleared before they start.
CLAIMS = "eval/lanes"
#: Lines of a failed lane's output shown in the error.
TAIL_LINES = 30


class LaneFailed(RuntimeError):
    """An evaluation lane's process exited with an error; the message shows its output's tail."""


def lanes_apply(cfg: Any) -> str | None:
    """Why notebook 04 draws in the kernel alone (None: it draws in lanes first)."""
    comp = cfg.compute
    if comp.parallel_stages < 2:
        return "compute.parallel_stages is 1"
    if comp.processes == "kernel":
        return "compute.processes is kernel"
    if comp.lane_threads != "all":
        return ("compute.lane_threads is 'share': a lane of fewer threads than the kernel rounds "
                "bf16 differently, so its draws could not be read back")  # fmt: skip
    if cfg.evaluation.num_threads is not None:
        return "evaluation.num_threads is set"
    return None


def tasks(inp: Any) -> list[tuple[str, Callable[[], Any]]]:
    """Every draw of the stage as (label, call), heaviest first: best-of-N's pool, each policy's
    samples, the snapshots' samples, then Table 3's completions and the held-out log-probs."""
    from rlxf_utils.evaluation.tables import (
        frontier_snapshots,
        heldout_draw,
        snapshot_draw,
        snapshot_step,
        table3_draw,
        table3_prompts,
    )

    ec, pset, cfg, run = inp.ec, inp.pset, inp.cfg, inp.run
    out: list[tuple[str, Callable[[], Any]]] = [("best-of-N pool", inp.draw_pool)]
    for name in pset.names:
        out.append((f"samples {name}", lambda name=name: inp.draw(
            "samples", name, ec.samples_per_prompt, inp.sampling(name), f"samples {name}")))  # fmt: skip
    if ec.frontier:
        for algo in pset.algos:
            for path in frontier_snapshots(run, algo, cfg):
                out.append((f"frontier {algo} step {snapshot_step(path)}",
                            lambda algo=algo, path=path: snapshot_draw(
                                pset, run, inp.prompts, cfg, inp.timer, algo, path, False)))  # fmt: skip
    _, t3_prompts, _ = table3_prompts(inp.contexts, inp.labelled, cfg)
    held = inp.heldout()
    for name in pset.names:
        out.append((f"table 3 {name}",
                    lambda name=name: table3_draw(pset, cfg, run, inp.timer, name, t3_prompts)))  # fmt: skip
        out.append((f"held-out perplexity {name}", lambda name=name: heldout_draw(
            pset, held, cfg.rl.prompt_template, cfg, ec.logprob_batch_size, run, inp.timer, name)))  # fmt: skip
    return out


def claim(run: RunDir, index: int) -> bool:
    """Take task `index` for this lane: True where no lane has taken it (its file is created
    here, atomically), False where another lane had."""
    folder = run.path(CLAIMS)
    folder.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(folder / f"{index:04d}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def draw_lane(cfg: Any, run: RunDir, lane: int) -> list[str]:
    """One lane: the stage's inputs without the reward models, then every task no other lane has
    claimed, in order; returns the labels it drew."""
    from rlxf_utils.evaluation.inputs import load_inputs

    inp = load_inputs(cfg, run, progress=False, reward_models=False)
    done = []
    for index, (label, call) in enumerate(tasks(inp)):
        if not claim(run, index):
            continue
        t0 = time.perf_counter()
        call()
        log.info("evaluation lane %d: %s in %.0f s", lane, label, time.perf_counter() - t0)
        done.append(label)
    return done


def read_params(dumped: dict[str, Any]) -> Any:
    """The parameters a lane reads: `StudyConfig` from the kernel's JSON dump, with its source."""
    from rlxf_utils.config.study import StudyConfig

    cfg = StudyConfig.model_validate(dumped["params"])
    cfg.source = Path(dumped["source"]) if dumped["source"] else None
    return cfg


def lane_command(config: Path, run_dir: Path, lane: int, threads: int) -> list[str]:
    """The command line of evaluation lane `lane`, with `threads` torch threads."""
    return [sys.executable, "-m", "rlxf_utils.evaluation.lanes", "--config", str(config),
            "--run-dir", str(Path(run_dir).resolve()), "--lane", str(lane),
            "--threads", str(threads)]  # fmt: skip


def run_draw_lanes(
    cfg: Any, run: RunDir, echo: Callable[[str], Any] | None = print
) -> dict[str, Any]:
    """Draw the stage's samples in `compute.parallel_stages` side-by-side processes (see the
    module's doc), or nothing where `lanes_apply` says why not; returns what the summary
    records: the lanes, each one's tasks and seconds, and the wall seconds they took together."""
    why = lanes_apply(cfg)
    if why is not None:
        return {"lanes": 0, "why_not": why}
    dumped = {"params": cfg.model_dump(mode="json"), "source": cfg.source and str(cfg.source)}
    if read_params(dumped) != cfg:  # the lanes must read these very settings
        return {"lanes": 0, "why_not": "the parameters do not survive a JSON round trip"}
    n = cfg.compute.parallel_stages
    claims = run.path(CLAIMS)
    if claims.is_dir():
        for old in claims.iterdir():
            old.unlink()
    import torch

    threads = torch.get_num_threads()  # the kernel's: a draw's key holds the thread count
    env = launch_env(cfg.compute.device)
    env["RLXF_PARENT_PID"] = str(os.getpid())
    env["OMP_WAIT_POLICY"] = "PASSIVE"  # every core's threads in each lane: idle ones sleep
    if echo:
        echo(f"evaluation: {n} lanes side by side draw every policy's samples into eval/draws "
             f"({threads} threads each, waiting passively)")  # fmt: skip
    t0 = time.perf_counter()
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="rlxf-lanes-") as tmp:
        config = Path(tmp) / "params.json"
        config.write_text(json.dumps(dumped), encoding="utf-8")
        pool = ThreadPoolExecutor(n, thread_name_prefix="rlxf-eval-lane")
        futures = [pool.submit(_run_lane, lane_command(config, run.root, i, threads), env, i,
                               echo, procs) for i in range(n)]  # fmt: skip
        try:
            while wait(futures, timeout=0.5).not_done:  # short waits: an interrupt is seen at once
                pass
        except BaseException:  # the kernel interrupted: no lane outlives it
            for proc in list(procs):
                proc.kill()
            raise
        finally:
            pool.shutdown(wait=True)
        results = [f.result() for f in futures]  # the first lane that failed raises
    if claims.is_dir():
        for done in claims.iterdir():
            done.unlink()
        claims.rmdir()
    return {"lanes": n, "seconds": round(time.perf_counter() - t0, 1),
            "drawn": {str(i): r for i, r in enumerate(results)}}  # fmt: skip


def _run_lane(cmd: Sequence[str], env: dict[str, str], lane: int,
              echo: Callable[[str], Any] | None, procs: list[subprocess.Popen]) -> list[str]:  # fmt: skip
    """Run one lane's process to its end; its drawn labels (from the line it prints last)."""
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    drawn: list[str] = []
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                            text=True, bufsize=1, errors="replace")  # fmt: skip
    procs.append(proc)
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            tail.append(line.rstrip("\n"))
            if line.startswith(DRAWN):
                drawn = json.loads(line[len(DRAWN) :])
            elif echo and line.startswith(("INFO rlxf_utils.evaluation.lanes", "WARNING", "ERROR")):
                echo(line.rstrip())
        rc = proc.wait()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    if rc != 0:
        shown = "\n".join(f"    {x}" for x in tail)
        raise LaneFailed(
            f"evaluation lane {lane} failed (exit code {rc}); its last lines:\n{shown}"
        )
    return drawn


#: The line a lane prints last: the JSON list of what it drew.
DRAWN = "RLXF lane drew: "


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlxf_utils.evaluation.lanes", description=__doc__)
    p.add_argument("--config", type=Path, required=True, help="the study's parameters as JSON")
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--lane", type=int, required=True)
    p.add_argument("--threads", type=int, required=True, help="torch threads: the kernel's")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    from rlxf_utils.runtime import hub_environment

    die_with_parent()
    cfg = read_params(json.loads(args.config.read_text(encoding="utf-8")))
    hub_environment(cfg)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s",
                        stream=sys.stdout)  # fmt: skip
    done = draw_lane(cfg, RunDir(args.run_dir), args.lane)
    print(DRAWN + json.dumps(done), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
