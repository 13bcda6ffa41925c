"""A profile that lists a subset of `rl.algorithm` ends like the default (issue 80): a run
without RLGF, ILHF and the offline methods goes through notebooks 03-05, the report and `rlxf
publish` (`make study`'s last step), writes every table it has nothing for with its header,
leaves no table or figure of an earlier run's notebooks 03-05 behind, and publishes a bundle
whose links resolve.

The run is a copy of the shared smoke study (tests/smoke.py) rerun as a user would after
dropping the families from `rl.algorithm`: `rlxf run --only 03,04,05` with a profile extending
params/smoke.yaml. Notebook 03 retrains nothing (an algorithm's up-to-date marker leaves
`rl.algorithm` out) and rewrites its tables from the algorithms that remain; notebook 04 reads
its draws back from `eval/draws/`; 01 and 02 do not depend on `rl.algorithm`.

One rerun drops the three families together, where the issue asks for each in turn: a rerun
costs 1.5-3 minutes on two shared cores (03, 04 and 05 are all needed: each writes tables per
algorithm, so reusing one leaves the dropped family's rows in the run), and three of them would
add minutes to `make test`. Every family's absent path runs in the one rerun; each family in
turn absent (and subsets without PPO, or D²LOLS without its parts) passed `run_to_bundle` when
this test was written."""

from __future__ import annotations

import importlib.util
import json
import re
import time
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pandas as pd
import pytest
from smoke import ROOT, copy_run

from rlxf_utils.algorithms import ALGORITHMS
from rlxf_utils.cli import main
from rlxf_utils.config import load_config
from rlxf_utils.report.publish_check import browser_executable, browser_problems
from rlxf_utils.rl.sft import SFT_SUMMARY_COLUMNS


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.urls += [v for k, v in attrs if k in ("href", "src") and v]


def dangling_links(bundle: Path, page: str) -> list[str]:
    """The links of `page` (relative to `bundle`) to a file of the bundle that is not there."""
    parser = _Links()
    parser.feed((bundle / page).read_text(encoding="utf-8"))
    missing = []
    for url in parser.urls:
        parts = urlsplit(url)
        if parts.scheme or parts.netloc or not parts.path:  # data:, an anchor on the page itself
            continue
        if not ((bundle / page).parent / unquote(parts.path)).resolve().is_file():
            missing.append(f"{page}: {url}")
    return missing


def stale_rows(tables: Path, algos: list[str]) -> list[str]:
    """Table headers and cells (or items of a cell listing several, 'ppo, kto') that name one
    of `algos` by id or display name. RLGF's `scheme` column is left out: D²LOLS's schemes are
    PPO++'s and AggreVaTeD's, by name, whether those two ran or not."""
    names = {n for a in algos for n in (a, ALGORITHMS[a].label)}
    found = []
    for csv in sorted(tables.glob("*.csv")):
        frame = pd.read_csv(csv, dtype=str, keep_default_na=False)
        found += [f"{csv.name}: column {c}" for c in frame.columns if c in names]
        for col in frame.columns.drop("scheme", errors="ignore"):
            cells = {v for v in frame[col] if names & set(v.split(", "))}
            found += [f"{csv.name}: {col} = {v}" for v in sorted(cells)]
    return found


def run_to_bundle(smoke_run: Path, run_dir: Path, algos: list[str]) -> Path:
    """A copy of the smoke run at `run_dir` rerun with `rl.algorithm: algos` (notebooks 03-05),
    rendered and published as `make study` does, each step checked; returns the bundle."""
    smoke = ROOT / "params/smoke.yaml"
    dropped = [a for a in load_config(smoke).rl.algorithm if a not in algos]
    copy_run(smoke_run, run_dir)
    params = run_dir.with_suffix(".yaml")
    params.write_text(f"extends: {smoke}\nrl:\n  algorithm: [{', '.join(algos)}]\n")
    earlier = (run_dir / "notebooks/02_reward_model.ipynb").stat().st_mtime
    started = time.time()
    run = ["run", "--params", str(params), "--run-dir", str(run_dir), "--only", "03,04,05"]
    assert main([*run, "--quiet"]) == 0
    assert load_config(run_dir / "params.yaml").rl.algorithm == algos  # the frozen copy
    notebooks = json.loads((run_dir / "manifest.json").read_text())["notebooks"]
    assert [n["status"] for n in notebooks] == ["ok"] * 5, notebooks
    assert [n["how"] for n in notebooks[2:]] == ["ran"] * 3, notebooks

    # every table has at least its header; every table and figure is this run's or notebook 01's
    # and 02's (which `rl.algorithm` does not reach): none of 03-05's of the smoke run is left
    empty = [f.name for f in (run_dir / "tables").glob("*.csv") if not f.read_text().strip()]
    assert not empty, f"tables written without a header: {empty}"
    left = [f"{f.parent.name}/{f.name}" for d in ("tables", "figures")
            for f in (run_dir / d).iterdir() if earlier < f.stat().st_mtime < started]  # fmt: skip
    assert not left, f"written by the smoke run's notebooks 03-05 and not by this run: {left}"
    assert stale_rows(run_dir / "tables", dropped) == []
    summary = pd.read_csv(run_dir / "tables/eval_summary.csv")
    assert set(algos) <= set(summary["policy"])
    # the columns a run with SFT off writes as the SFT table's header are the trained one's
    assert tuple(pd.read_csv(run_dir / "tables/sft_summary.csv").columns) == SFT_SUMMARY_COLUMNS

    assert main(["report", "--run-dir", str(run_dir), "--engine", "pandoc"]) == 0
    html = (run_dir / "report/rlxf_report.html").read_text(encoding="utf-8")
    for hole in ("Traceback (most recent call last)", "EmptyDataError", "{{<", "??"):
        assert hole not in html, hole

    assert main(["publish", "--run-dir", str(run_dir)]) == 0  # `make study`'s last step
    bundle = run_dir / "report/review"
    tables = [f"tables/{f.stem}.html" for f in (run_dir / "tables").glob("*.csv")]
    pages = ["index.html", "sources.html", "paper/rlxf_report.html", *tables]
    assert [p for p in pages if not (bundle / p).is_file()] == []
    assert [m for p in pages for m in dangling_links(bundle, p)] == []
    index = (bundle / "index.html").read_text(encoding="utf-8")
    assert len(re.findall(r'href="tables/[^"]+\.html"', index)) == len(tables)
    return bundle


#: The families the rerun drops: every algorithm of them leaves `rl.algorithm`.
DROPPED = ("rlgf", "ilhf", "offline")


@pytest.mark.slow
def test_a_run_without_rlgf_ilhf_and_offline_renders_and_publishes(
    smoke_run: Path, tmp_path: Path
) -> None:
    smoke = load_config(ROOT / "params/smoke.yaml").rl.algorithm
    algos = [a for a in smoke if ALGORITHMS[a].family not in DROPPED]
    assert set(DROPPED) < {ALGORITHMS[a].family for a in smoke}  # each dropped one ran, and more
    bundle = run_to_bundle(smoke_run, tmp_path / "subset", algos)
    if browser_executable() is not None and importlib.util.find_spec("playwright"):
        assert browser_problems(bundle, pages=["index.html", "sources.html"], toc_page=None) == []


def test_notebook_03_tables_keep_their_header_without_their_family(tmp_path: Path) -> None:
    """RLGF's guidance table is written whatever ran (a rerun without RLGF replaces the earlier
    run's rows), its header alone without an RLGF algorithm (PPO's rows are only its cost
    baseline); so is the SFT table with SFT off."""
    from rlxf_utils.artifacts import RunDir
    from rlxf_utils.rl.stage import sft_step
    from rlxf_utils.rl.tables import GUIDANCE_COLUMNS, guidance_table

    ppo = pd.DataFrame({"algo": ["ppo", "ppo_mle"], "scheme": ["ppo", "ppo"], "step": [1, 1],
                        "step_time_s": [1.0, 1.0]})  # fmt: skip
    for logs in (ppo, ppo.drop(columns="scheme"), ppo.assign(algo="grpo", scheme=None)):
        table = guidance_table(logs)
        assert table.empty and list(table.columns) == list(GUIDANCE_COLUMNS)

    cfg = load_config(ROOT / "params/smoke.yaml")
    off = cfg.model_copy(update={"sft": cfg.sft.model_copy(update={"enabled": False})})
    run = RunDir(tmp_path / "run")
    assert sft_step(off, ROOT / "params/smoke.yaml", run).empty
    header = run.path("tables/sft_summary.csv").read_text(encoding="utf-8").strip()
    assert header == ",".join(SFT_SUMMARY_COLUMNS)
