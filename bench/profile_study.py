"""Where a finished run's wall time went, and the slow tests' (issue 60's map): a table and a figure.

Reads only what the run recorded (nothing is rerun), for each notebook and each stage:

- the notebook's seconds: `manifest.json` (`notebooks[].seconds`);
- its cells: the executed notebook's papermill metadata (`notebooks/<nb>.ipynb`: the notebook's
  `start_time`, each cell's `start_time` and `duration`). Kernel start-up is the notebook's start
  to its first cell; the first cell that imports is start-up too (imports, parameters);
- notebook 02's reward stage (the cell calling `run_reward_stage`): compute is the encoders' and
  TF-IDF's training seconds and the encoders' test-set scoring (`reward/metrics.json` `timing`:
  every `*_train_s`, and each `*_score_texts_per_s` as the protocol's test rows over the rate,
  the rows from `tables/split_sizes.csv`);
- notebook 03's launched stages (the cells calling `sft_step` and `rl_step`), one row per
  process: wall time from `policy/<name>/launch.log`'s creation to the last of its writes
  (`launch.log`, `complete.json`, `data.json`, `timing.json`); compute is the training steps'
  seconds (`train_log.parquet` `step_time_s`). Where the process wrote `timing.json`
  (`rlxf_utils.rl.timing`), start-up is the launcher plus the imports, loading the reward model
  and contexts plus the start policy and its adapter, I/O the writing after the loop. Without it
  (runs before that file), start-up is launch to `started.json` (the imports *and* loading the
  reward model: `basis` says "file times"); the cell's own remainder is a "(kernel)" row;
- notebook 04's evaluation (the cell calling `run_evaluation_stage`): one row per phase of
  `eval/summary.json` `seconds` (`evaluation.inputs.PhaseTimer`): "loading" is loading,
  "writing" I/O, every other phase compute; phases read back from an earlier run's draws
  (`reused_draws`) are left out; the cell's remainder is a "(rest)" row;
- rest: everything not named, always total - the named parts (the notebook's own rest row holds
  the time between cells and papermill's overhead).

With `--pytest-log`, a pytest log with `--durations` output (`pytest --durations=0 -m slow`, or the
project's default `--durations=15`): each listed test's setup, call and teardown seconds; a
setup of at least `--fixture-min` seconds is a fixture's (the smoke study's, for
`tests/test_smoke_*.py`: built there, or under `make test`'s two workers waited for there while
the other worker built it), shown as its own row.

    .venv/bin/python bench/profile_study.py --run-dir runs/default [--pytest-log test.log] \
        [--out bench/results/profile_default]

Writes `<out>.csv` (one row per notebook, stage or cell; `level` says which), `<out>.md`,
`<out>.png` (a horizontal stacked bar per notebook and stage), and with a pytest log
`<out>_tests.csv` and a second panel. Timings read on shared cores are that day's cores'.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

import pandas as pd

#: The categories, in the order the table and the bars show them.
CATEGORIES = ("compute_s", "startup_s", "loading_s", "io_s", "rest_s")
COLORS = {"compute_s": "#1f77b4", "startup_s": "#d62728", "loading_s": "#ff7f0e",
          "io_s": "#2ca02c", "rest_s": "#c7c7c7"}  # fmt: skip
#: Cells shorter than this are summed into one "other cells" row per notebook.
MIN_CELL_S = 1.0


def _row(level: str, notebook: str, stage: str, total: float, basis: str, **parts: float) -> dict:
    """One row: `parts` named, rest = total - their sum (so the categories add up to total)."""
    named = {c: float(parts.get(c, 0.0)) for c in CATEGORIES if c != "rest_s"}
    bad = set(parts) - set(named)
    if bad:
        raise ValueError(f"unknown categories {sorted(bad)}: expected {CATEGORIES[:-1]}")
    return {"level": level, "notebook": notebook, "stage": stage, "total_s": float(total),
            **named, "rest_s": float(total) - sum(named.values()), "basis": basis}  # fmt: skip


def _time(s: str) -> float:
    return datetime.fromisoformat(s).timestamp()


def _birth(path: Path) -> float | None:
    """A file's creation time (Linux `stat %W`), or None where the filesystem does not keep it."""
    try:
        out = subprocess.run(["stat", "-c", "%W", str(path)], capture_output=True, text=True)
        t = float(out.stdout.strip())
    except (OSError, ValueError):
        return None
    return t if t > 0 else None


def _steps_seconds(path: Path) -> float:
    """The training steps' seconds: `step_time_s` summed (0 when the log has none)."""
    if not path.is_file():
        return 0.0
    df = pd.read_parquet(path)
    return float(df["step_time_s"].sum()) if "step_time_s" in df else 0.0


def _cell_label(src: str) -> str:
    """A cell's name: its first statement that is not an import or a comment."""
    for line in src.splitlines():
        s = line.strip()
        if s and not s.startswith(("#", "import ", "from ")):
            return s[:60]
    return src.strip().splitlines()[0][:60] if src.strip() else "(empty)"


def stage_rows(
    run: Path, notebook: str, names: Iterable[str], window: tuple[float, float] | None = None
) -> list[dict[str, Any]]:
    """One row per launched stage process (`policy/<name>/`), see the module's docstring. With
    `window` (the launching cell's start and end), a stage whose process started outside it is
    left out: it was reused from an earlier run, and this run did not launch it."""
    rows = []
    for name in names:
        folder = run / "policy" / name
        log = folder / "launch.log"
        if not log.is_file():
            continue
        marks = [folder / f for f in ("launch.log", "complete.json", "timing.json", "data.json")]
        if name == "sft":
            marks.append(run / "policy" / "sft_met" / "data.json")
        end = max(p.stat().st_mtime for p in marks if p.is_file())
        timing_file = folder / "timing.json"
        timing = json.loads(timing_file.read_text()) if timing_file.is_file() else None
        start = _birth(log)
        if window is not None and start is not None and not window[0] - 2 <= start <= window[1]:
            continue
        total = end - start if start is not None else (timing or {}).get("total_s")
        if total is None:
            continue
        logs = [folder / "train_log.parquet"]
        if name == "sft":
            logs.append(run / "policy" / "sft_met" / "train_log.parquet")
        compute = sum(_steps_seconds(p) for p in logs)
        label = f"{name} (process)"
        if timing is not None:
            parts = {
                "compute_s": compute,
                "startup_s": timing.get("launcher_s", 0.0) + timing.get("imports_s", 0.0),
                "loading_s": timing.get("reward_loaded_s", 0.0) + timing.get("policy_loaded_s", 0.0),
                "io_s": timing.get("written_s", 0.0) if name != "sft" else 0.0,
            }  # fmt: skip
            total = max(total, sum(parts.values()))
            rows.append(_row("stage", notebook, label, total, "timing.json", **parts))
        else:
            started = folder / "started.json"
            startup = started.stat().st_mtime - start if started.is_file() and start else 0.0
            rows.append(_row("stage", notebook, label, total, "file times",
                             compute_s=compute, startup_s=max(0.0, startup)))  # fmt: skip
        rows[-1]["span"] = (end - total, end)
    return rows


def wall_shares(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Stage rows whose processes ran side by side (`compute.parallel_stages`) overlap in time:
    each row's seconds are scaled by the wall time the processes' union covered over their
    summed seconds, so a notebook's rows still add up to its wall time, and labelled so. Rows
    that did not overlap come back as they were. Drops each row's `span` (start, end)."""
    spans = sorted(r.pop("span") for r in rows)
    summed = sum(e - s for s, e in spans)
    covered, reach = 0.0, float("-inf")
    for s, e in spans:  # the union's length
        covered += max(0.0, e - max(s, reach))
        reach = max(reach, e)
    if summed <= covered + 1e-6:
        return rows
    share = covered / summed
    out = []
    for r in rows:
        parts = {c: r[c] * share for c in CATEGORIES if c != "rest_s"}
        stage = r["stage"].replace(" (process)", " (process, side by side: share of the wall)")
        out.append(
            _row(r["level"], r["notebook"], stage, r["total_s"] * share, r["basis"], **parts)
        )
    return out


def _reward_seconds(run: Path) -> tuple[float, float]:
    """Notebook 02's (training, test-set scoring) seconds: every `*_train_s` of
    `reward/metrics.json` `timing`, and each `*_score_texts_per_s` turned back into seconds with
    its protocol's test rows (`tables/split_sizes.csv`; the rate is those rows over the seconds)."""
    path = run / "reward" / "metrics.json"
    if not path.is_file():
        return 0.0, 0.0
    timing = json.loads(path.read_text()).get("timing") or {}
    sizes_path = run / "tables" / "split_sizes.csv"
    sizes = pd.read_csv(sizes_path) if sizes_path.is_file() else pd.DataFrame()
    test_rows = (
        {r.protocol: float(r.rows) for r in sizes.itertuples() if r.part == "test"}
        if {"protocol", "part", "rows"} <= set(sizes.columns)
        else {}
    )
    train = score = 0.0
    for protocol, per in timing.items():
        for k, v in per.items():
            if v is None:
                continue
            if k.endswith("_train_s"):
                train += float(v)
            elif k.endswith("_score_texts_per_s") and protocol in test_rows and float(v) > 0:
                score += test_rows[protocol] / float(v)
    return train, score


#: `by_kind`'s rows, in order.
KINDS = (
    "training steps (reward encoders, SFT, RL)",
    "evaluation and test-set scoring",
    "start-up, loading, I/O",
    "the rest",
)


def by_kind(run: str | Path, study: pd.DataFrame) -> pd.DataFrame:
    """The whole run's seconds by what they buy (`KINDS`): the training steps (notebook 02's
    encoder epochs, every launched stage's steps), evaluation (notebook 02's test-set scoring,
    notebook 04's compute phases), start-up + loading + I/O, and the rest (cells, kernels, the
    risk stage, the time between), each with its percent of the notebooks' summed seconds."""
    nb = study[study["level"] == "notebook"]
    rows = study[study["level"] != "notebook"]
    total = float(nb["total_s"].sum())
    train, score = _reward_seconds(Path(run))
    steps = float(rows.loc[rows["stage"].str.endswith("(process)"), "compute_s"].sum())
    phases = rows["stage"].str.startswith("phase: ")
    evaluation = score + float(rows.loc[phases, "compute_s"].sum())
    overhead = float(nb[["startup_s", "loading_s", "io_s"]].to_numpy().sum())
    seconds = [train + steps, evaluation, overhead]
    seconds.append(total - sum(seconds))
    out = pd.DataFrame({"kind": KINDS, "seconds": seconds})
    out["minutes"] = out["seconds"] / 60
    out["percent"] = 100 * out["seconds"] / total if total > 0 else float("nan")
    return out


def eval_rows(run: Path, notebook: str) -> list[dict[str, Any]] | None:
    """Notebook 04's phases, one row each (`eval/summary.json` `seconds`): "loading" is loading,
    "writing" I/O, every other phase compute. A phase whose draw was read back from an earlier
    run (`reused_draws`) took no time in this one and is left out; the draws made ahead of the
    stage by its side-by-side lanes (`evaluation.lanes`, the summary's `lanes`) are one row of
    their wall seconds. None without the file."""
    path = run / "eval" / "summary.json"
    if not path.is_file():
        return None
    summary = json.loads(path.read_text())
    reused = set(summary.get("reused_draws") or [])
    rows = []
    lanes = summary.get("lanes") or {}
    if lanes.get("lanes"):
        s = float(lanes["seconds"])
        rows.append(_row("stage", notebook, f"phase: draws in {lanes['lanes']} lanes (side by side)",
                         s, "eval/summary.json", compute_s=s))  # fmt: skip
    for phase, s in (summary.get("seconds") or {}).items():
        if phase in reused:
            continue
        key = {"loading": "loading_s", "writing": "io_s"}.get(phase, "compute_s")
        rows.append(_row("stage", notebook, f"phase: {phase}", float(s), "eval/summary.json",
                         **{key: float(s)}))  # fmt: skip
    return rows


def notebook_rows(run: Path, entry: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of one notebook: its cells (and stages), then the notebook's own total row."""
    name, total = entry["name"], float(entry["seconds"])
    rows: list[dict[str, Any]] = []
    nb_path = run / "notebooks" / f"{name}.ipynb"
    if nb_path.is_file():
        nb = json.loads(nb_path.read_text())
        pm = nb.get("metadata", {}).get("papermill", {})
        cells = [c for c in nb["cells"] if c["cell_type"] == "code"
                 and c.get("metadata", {}).get("papermill", {}).get("duration") is not None]  # fmt: skip
        if cells and pm.get("start_time"):
            first = _time(cells[0]["metadata"]["papermill"]["start_time"])
            rows.append(_row("cell", name, "kernel start", first - _time(pm["start_time"]),
                             "papermill", startup_s=first - _time(pm["start_time"])))  # fmt: skip
        imports_seen, small = False, 0.0
        for i, c in enumerate(cells):
            src = "".join(c["source"])
            dur = float(c["metadata"]["papermill"]["duration"])
            tags = c.get("metadata", {}).get("tags", [])
            if "parameters" in tags or "injected-parameters" in tags:
                small += dur
                continue
            label = f"cell {i}: {_cell_label(src)}"
            if not imports_seen and re.search(r"^(import|from) ", src, re.M):
                imports_seen = True
                rows.append(_row("cell", name, f"cell {i}: imports and parameters", dur,
                                 "papermill", startup_s=dur))  # fmt: skip
            elif "sft_step(" in src or "rl_step(" in src:
                sft = "sft_step(" in src
                names = ["sft"] if sft else _algorithms(run)
                t0 = _time(c["metadata"]["papermill"]["start_time"])
                sub = wall_shares(stage_rows(run, name, names, (t0, t0 + dur)))
                rows += sub
                rest = dur - sum(r["total_s"] for r in sub)
                rows.append(_row("cell", name, f"{label} (kernel)", rest, "papermill"))
            elif "run_reward_stage(" in src:
                rows.append(_row("cell", name, label, dur, "reward/metrics.json",
                                 compute_s=sum(_reward_seconds(run))))  # fmt: skip
            elif "run_evaluation_stage(" in src and eval_rows(run, name) is not None:
                sub = eval_rows(run, name) or []
                rows += sub
                rest = dur - sum(r["total_s"] for r in sub)
                rows.append(_row("cell", name, f"{label} (rest)", rest, "papermill"))
            elif dur < MIN_CELL_S:
                small += dur
            else:
                rows.append(_row("cell", name, label, dur, "papermill"))
        if small:
            rows.append(_row("cell", name, "other cells", small, "papermill"))
    named = {c: sum(r[c] for r in rows) for c in CATEGORIES if c != "rest_s"}
    rows.append(_row("notebook", name, "(all)", total, "manifest.json", **named))
    return rows


def _algorithms(run: Path) -> list[str]:
    """The RL algorithms the run's parameters list (`rl.algorithm`), else every `policy/<x>/`
    with a `launch.log` other than SFT's, in the order they were launched."""
    manifest = json.loads((run / "manifest.json").read_text())
    algos = manifest.get("params", {}).get("rl", {}).get("algorithm")
    if algos:
        return list(algos)
    found = [p.parent for p in (run / "policy").glob("*/launch.log") if p.parent.name != "sft"]
    return [p.name for p in sorted(found, key=lambda p: (p / "launch.log").stat().st_mtime)]


def profile_run(run: str | Path) -> pd.DataFrame:
    """Every notebook's rows (`notebook_rows`) for the notebooks the manifest records."""
    run = Path(run)
    path = run / "manifest.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not a run directory (no manifest.json)")
    manifest = json.loads(path.read_text())
    entries = [e for e in manifest.get("notebooks", []) if e.get("seconds") is not None]
    if not entries:
        raise ValueError(f"{path}: 'notebooks' records no notebook with its 'seconds'")
    rows = [r for e in entries for r in notebook_rows(run, e)]
    return pd.DataFrame(rows)


_DURATION = re.compile(r"^\s*([0-9.]+)s\s+(setup|call|teardown)\s+(\S+)")


def parse_durations(text: str) -> pd.DataFrame:
    """A pytest log's `--durations` section: one row per test with its setup, call and teardown
    seconds (0 where pytest did not list them). Raises ValueError when the log has none."""
    lines = text.splitlines()
    start = next(
        (i for i, s in enumerate(lines) if re.search(r"slowest (\d+ )?durations", s)), None
    )
    if start is None:
        raise ValueError("no '--durations' section ('slowest ... durations') in the pytest log")
    seconds: dict[str, dict[str, float]] = {}
    for line in lines[start + 1 :]:
        m = _DURATION.match(line)
        if m:
            t = seconds.setdefault(m.group(3), {"setup_s": 0.0, "call_s": 0.0, "teardown_s": 0.0})
            t[f"{m.group(2)}_s"] += float(m.group(1))
        elif line.startswith("=") or re.match(r"^\d+ (passed|failed)", line):
            break
    df = pd.DataFrame([{"test": k, **v} for k, v in seconds.items()])
    if df.empty:
        return pd.DataFrame(columns=["test", "setup_s", "call_s", "teardown_s", "total_s"])
    df["total_s"] = df[["setup_s", "call_s", "teardown_s"]].sum(axis=1)
    return df.sort_values("total_s", ascending=False, ignore_index=True)


def tests_table(df: pd.DataFrame, fixture_min: float = 30.0) -> pd.DataFrame:
    """The tests' rows, with each setup of at least `fixture_min` seconds split off as a fixture
    row (`kind` 'fixture'; the smoke study's in tests/test_smoke_*.py) and the test keeping
    its call and teardown (`kind` 'test')."""
    rows = []
    for r in df.itertuples():
        if r.setup_s >= fixture_min:
            smoke = r.test.startswith("tests/test_smoke_")
            what = "smoke study fixture, built or waited for" if smoke else "fixture"
            rows.append({"kind": "fixture", "test": f"{what} (set up for {r.test})",
                         "setup_s": r.setup_s, "call_s": 0.0, "teardown_s": 0.0,
                         "total_s": r.setup_s})  # fmt: skip
            rows.append({"kind": "test", "test": r.test, "setup_s": 0.0, "call_s": r.call_s,
                         "teardown_s": r.teardown_s, "total_s": r.call_s + r.teardown_s})  # fmt: skip
        else:
            rows.append({"kind": "test", "test": r.test, "setup_s": r.setup_s, "call_s": r.call_s,
                         "teardown_s": r.teardown_s, "total_s": r.total_s})  # fmt: skip
    out = pd.DataFrame(rows, columns=["kind", "test", "setup_s", "call_s", "teardown_s", "total_s"])
    return out.sort_values("total_s", ascending=False, ignore_index=True)


def _md(df: pd.DataFrame) -> str:
    cols = list(df.columns)
    fmt = [(f"{v:.1f}" if isinstance(v, float) else str(v)) for r in df.itertuples(index=False)
           for v in r]  # fmt: skip
    body = [fmt[i : i + len(cols)] for i in range(0, len(fmt), len(cols))]
    lines = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    return "\n".join(lines + ["| " + " | ".join(b).replace("\n", " ") + " |" for b in body]) + "\n"


def figure(study: pd.DataFrame, tests: pd.DataFrame | None, title: str, min_s: float = 5.0):
    """Horizontal stacked bars: each notebook and each stage or cell of at least `min_s`
    seconds (compute / start-up / loading / I/O / rest), and the slow tests' (setup / call)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = study[(study["level"] == "notebook") | (study["total_s"] >= min_s)]
    shown = shown.iloc[::-1]
    n_tests = 0 if tests is None else min(len(tests), 25)
    heights = [max(2.0, 0.28 * len(shown))] + ([max(2.0, 0.28 * n_tests)] if n_tests else [])
    fig, axes = plt.subplots(len(heights), 1, figsize=(12, sum(heights) + 1.2),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)  # fmt: skip
    ax = axes[0][0]
    labels = [(f"{r.notebook} (total)" if r.level == "notebook" else f"· {r.stage[:45]}")
              for r in shown.itertuples()]  # fmt: skip
    left = pd.Series(0.0, index=shown.index)
    for c in CATEGORIES:
        vals = shown[c].clip(lower=0)
        ax.barh(range(len(shown)), vals, left=left, color=COLORS[c], label=c[:-2])
        left += vals
    ax.set_yticks(range(len(shown)), labels, fontsize=7)
    for tick, level in zip(ax.get_yticklabels(), shown["level"], strict=True):
        tick.set_fontweight("bold" if level == "notebook" else "normal")
    ax.set_xlabel("wall seconds")
    ax.set_title(textwrap.fill(title, 120), fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    if n_tests:
        t = tests.head(n_tests).iloc[::-1]
        ax2 = axes[1][0]
        left = pd.Series(0.0, index=t.index)
        for c, col in (("setup_s", "#d62728"), ("call_s", "#1f77b4"), ("teardown_s", "#2ca02c")):
            ax2.barh(range(len(t)), t[c], left=left, color=col, label=c[:-2])
            left += t[c]
        names = [s.removeprefix("tests/")[-50:] for s in t["test"]]
        ax2.set_yticks(range(len(t)), names, fontsize=6)
        ax2.set_xlabel("pytest seconds")
        ax2.set_title("slow tests (pytest --durations)", fontsize=9)
        ax2.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--pytest-log", type=Path, default=None)
    p.add_argument("--out", type=Path, default=None, help="default bench/results/profile_<run>")
    p.add_argument("--fixture-min", type=float, default=30.0)
    p.add_argument("--note", default="", help="a line for the markdown (e.g. 'cores shared')")
    args = p.parse_args(argv)
    out = args.out or Path(__file__).parent / "results" / f"profile_{args.run_dir.name}"
    out.parent.mkdir(parents=True, exist_ok=True)
    study = profile_run(args.run_dir)
    tests = None
    if args.pytest_log is not None:
        tests = tests_table(parse_durations(args.pytest_log.read_text(errors="replace")),
                            args.fixture_min)  # fmt: skip
    study.round(2).to_csv(out.with_suffix(".csv"), index=False)
    md = [f"# Where the time went: {args.run_dir}", "", args.note, "",
          "Seconds (wall). `rest` = total - the named parts. Written by `bench/profile_study.py`.",
          "", _md(study.round(1)), "", "## By what the seconds buy", "",
          _md(by_kind(args.run_dir, study).round(1))]  # fmt: skip
    if tests is not None:
        tests.round(2).to_csv(out.parent / f"{out.name}_tests.csv", index=False)
        md += ["## Slow tests", "", f"{args.pytest_log}: {tests['total_s'].sum():.1f} s listed",
               "", _md(tests.round(1))]  # fmt: skip
    out.with_suffix(".md").write_text("\n".join(md))
    fig = figure(study, tests, f"{args.run_dir} — {args.note}".rstrip(" —"))
    fig.savefig(out.with_suffix(".png"), dpi=90)
    nb = study[study["level"] == "notebook"]
    print(nb[["notebook", "total_s", *CATEGORIES]].round(1).to_string(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
