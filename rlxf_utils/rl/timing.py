"""Where a launched stage's wall time goes (`policy/<name>/timing.json`, read by
`bench/profile_study.py`): the process's start-up (the launcher, then the imports), loading
(reward model and contexts, then the start policy and its adapter), the training loop, and the
writing after it. Marks are wall-clock times; the file keeps seconds only (every key ends in
`_s`, so `compare` reads it as timings). Nothing here changes what a stage computes."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from rlxf_utils.artifacts import write_json

#: The environment variable `rl.launch.run_stage` sets to the wall time it starts the launcher.
LAUNCHED_AT = "RLXF_LAUNCHED_AT"
#: The marks, in the order a stage passes them (a stage that skips one leaves it out).
MARK_ORDER = ("imports", "reward_loaded", "policy_loaded", "train_start", "train_end", "written")
#: Wall-clock time of each mark this process has passed (`mark`).
MARKS: dict[str, float] = {}


def mark(name: str) -> None:
    """Record that this process has reached `name` (one of `MARK_ORDER`) now."""
    if name not in MARK_ORDER:
        raise ValueError(f"timing mark {name!r}: expected one of {MARK_ORDER}")
    MARKS[name] = time.time()


def process_started() -> float | None:
    """Wall-clock time this process was created (Linux `/proc`), or None where unknown."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(
            float(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime ")
        )
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def stage_timing(
    marks: dict[str, float], started: float | None, launched: float | None, end: float
) -> dict[str, Any]:
    """Seconds between the marks: `launcher_s` (launch to this process), `imports_s`, then each
    mark's interval from the one before it, and `total_s` from the launch (or the process start)
    to `end`. `marks_s`: each mark's seconds from the launch (or the process start)."""
    origin = launched if launched is not None else started
    out: dict[str, Any] = {}
    if launched is not None and started is not None:
        out["launcher_s"] = round(max(0.0, started - launched), 3)
    prev = started
    for name in MARK_ORDER:
        if name not in marks:
            continue
        if prev is not None:
            out[f"{name}_s"] = round(marks[name] - prev, 3)
        prev = marks[name]
    if origin is not None:
        out["total_s"] = round(end - origin, 3)
        out["marks_s"] = {k: round(marks[k] - origin, 3) for k in MARK_ORDER if k in marks}
    return out


def write_stage_timing(run_root: str | Path, label: str, started: float | None = None) -> Path:
    """Write `policy/<label>/timing.json` from this process's marks (`mark`), its start and the
    launcher's start (`LAUNCHED_AT`, set by `rl.launch.run_stage`). `started`: where a warm
    process trains several algorithms, the time this one began after the one before; it then
    has no launcher or imports of its own (the first algorithm's file counts them)."""
    if started is not None:
        timing = stage_timing(dict(MARKS), started, None, time.time())
        return write_json(Path(run_root) / "policy" / label / "timing.json", timing)
    raw = os.environ.get(LAUNCHED_AT)
    try:
        launched = float(raw) if raw else None
    except ValueError:
        launched = None
    timing = stage_timing(dict(MARKS), process_started(), launched, time.time())
    return write_json(Path(run_root) / "policy" / label / "timing.json", timing)
