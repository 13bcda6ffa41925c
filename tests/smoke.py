"""The smoke study the slow tests share: built once per `pytest` run, rendered, and read-only
after (a test that reruns or changes something works on `copy_run`'s copy).

`make test` runs two pytest-xdist workers, a file to each (tests/conftest.py). The study is
built by the first worker to ask, in the folder the workers share, under a file lock: a worker
that asks while it is being built waits on the lock, and finds it built, or fails at once if
the build failed (the failing worker's test shows why) instead of building it a second time.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def shared_smoke_run(factory: pytest.TempPathFactory) -> Path:
    """The smoke run's folder, built (whole study, then its report with pandoc + Typst) if no
    test of this `pytest` run has built it yet."""
    from rlxf_utils.pipeline import run_study
    from rlxf_utils.report.render import render_report

    base = factory.getbasetemp()
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:  # each worker's basetemp is popen-gwN inside the run's own folder
        base = base.parent
    root = base / "smoke_study"
    root.mkdir(exist_ok=True)
    run, built, failed = root / "smoke", root / "built", root / "failed"
    with (root / "lock").open("w") as lock:
        t0 = time.monotonic()
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or its process dies
        waited = time.monotonic() - t0
        if failed.is_file():
            pytest.fail(f"the smoke study failed while {failed.read_text()} built it (waited "
                        f"{waited:.0f} s): that worker's first smoke test shows why")  # fmt: skip
        if not built.is_file():
            try:
                run_study(ROOT / "params/smoke.yaml", run, progress=False)
                render_report(run, engine="pandoc")
            except BaseException:
                failed.write_text(worker or "this process")
                raise
            built.write_text(worker or "this process")
    return run


def copy_run(src: Path, dst: Path) -> Path:
    """A copy of a finished run whose weights are hard links (the run writes weights to a new
    file and renames it) and whose other files are copies: papermill's notebooks, the lock,
    the manifest and the report are rewritten in place, which through a link would change the
    smoke run itself (and hide a difference from `compare_runs`)."""

    def copy(a: str, b: str) -> None:
        (os.link if a.endswith((".safetensors", ".pt", ".bin")) else shutil.copy2)(a, b)

    shutil.copytree(src, dst, copy_function=copy)
    return dst
