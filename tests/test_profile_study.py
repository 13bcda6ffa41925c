"""bench/profile_study.py reads a run's own records into where its wall time went, and
rl.timing records a launched stage's start-up, loading, loop and writing."""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path

import pandas as pd
import pytest

from rlxf_utils.config import PROJECT_ROOT
from rlxf_utils.rl import timing

_SPEC = importlib.util.spec_from_file_location(
    "profile_study", PROJECT_ROOT / "bench" / "profile_study.py"
)
ps = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(ps)

T0 = 1_800_000_000.0  # the fake run's clock
LAUNCH = T0 + 3.0  # ppo's launch.log is created here


def _iso(t: float) -> str:
    return pd.Timestamp(t, unit="s", tz="UTC").isoformat()


def _notebook(path: Path, start: float, cells: list[tuple[str, float, list[str]]]) -> None:
    """An executed notebook with papermill's metadata: cells (source, seconds, tags) back to back
    from `start` + 0.5 (the kernel's start-up)."""
    t, out = start + 0.5, []
    for src, dur, tags in cells:
        meta = {"papermill": {"start_time": _iso(t), "duration": dur}, "tags": tags}
        out.append({"cell_type": "code", "source": src, "metadata": meta, "outputs": []})
        t += dur
    nb = {"metadata": {"papermill": {"start_time": _iso(start)}}, "cells": out}
    path.write_text(json.dumps(nb))


def _touch(path: Path, t: float, text: str = "{}") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    os.utime(path, (t, t))


@pytest.fixture
def fake_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    run = tmp_path / "run"
    (run / "notebooks").mkdir(parents=True)
    manifest = {"params": {"rl": {"algorithm": ["ppo"]}},
                "notebooks": [{"name": "02_reward_model", "seconds": 30.0},
                              {"name": "03_ppo_finetuning", "seconds": 100.0},
                              {"name": "04_evaluation", "seconds": 60.0}]}  # fmt: skip
    (run / "manifest.json").write_text(json.dumps(manifest))
    _notebook(run / "notebooks/02_reward_model.ipynb", T0 - 30, [
        ("import pandas as pd", 1.0, []),
        ("stage = run_reward_stage(cfg, run)", 25.0, []),
    ])  # fmt: skip
    timing = {"grouped": {"tfidf_train_s": 0.5, "encoder_train_s": 10.0,
                          "encoder_score_texts_per_s": 50.0, "encoder_epochs_run": 2.0},
              "random": {"encoder_train_s": 4.0, "encoder_score_texts_per_s": 20.0}}  # fmt: skip
    _touch(run / "reward/metrics.json", T0, json.dumps({"timing": timing}))
    sizes = "protocol,part,rows\ngrouped,train,900\ngrouped,test,100\nrandom,test,40\n"
    _touch(run / "tables/split_sizes.csv", T0, sizes)
    _notebook(run / "notebooks/03_ppo_finetuning.ipynb", T0, [
        ('params_file = "x"', 0.01, ["parameters"]),
        ("import logging\ncfg = load_config(params_file)", 2.0, []),
        ("logs, t = rl_stage.rl_step(cfg, params_file, run, reward_fn, contexts)", 80.0, []),
        ('display(Image("x.png"))', 0.3, []),
    ])  # fmt: skip
    _notebook(run / "notebooks/04_evaluation.ipynb", T0 + 100, [
        ("from rlxf_utils import x", 1.5, []),
        ("stage = run_evaluation_stage(cfg, run)", 55.0, []),
    ])  # fmt: skip
    ppo = run / "policy/ppo"
    _touch(ppo / "launch.log", LAUNCH + 60.0, "log")
    _touch(ppo / "started.json", LAUNCH + 7.0)
    _touch(ppo / "complete.json", LAUNCH + 70.0)
    pd.DataFrame({"step": [1, 2], "step_time_s": [20.0, 30.0]}).to_parquet(
        ppo / "train_log.parquet"
    )
    seconds = {"loading": 5.0, "samples base": 99.0, "samples ppo": 30.0, "rewards": 10.0,
               "writing": 2.0}  # fmt: skip
    # the base's draw was read back from an earlier run: its seconds were not spent in this one
    summary = {"seconds": seconds, "reused_draws": ["samples base"]}
    _touch(run / "eval/summary.json", T0 + 160, json.dumps(summary))
    # the launch.log's creation time: fixed (a file's birth time cannot be set)
    monkeypatch.setattr(ps, "_birth", lambda p: LAUNCH if p.name == "launch.log" else None)
    return run


def _check_sums(df: pd.DataFrame) -> None:
    parts = df[list(ps.CATEGORIES)].sum(axis=1)
    assert parts.to_numpy() == pytest.approx(df["total_s"].to_numpy(), abs=1e-6)


def test_profile_reads_file_times_and_every_category_adds_up(fake_run: Path) -> None:
    df = ps.profile_run(fake_run)
    _check_sums(df)
    stage = df[(df["level"] == "stage")].set_index("stage").loc["ppo (process)"]
    assert stage["total_s"] == pytest.approx(70.0)  # launch.log created -> complete.json
    assert stage["compute_s"] == pytest.approx(50.0)  # the steps' step_time_s
    assert stage["startup_s"] == pytest.approx(7.0)  # launch -> started.json
    assert stage["rest_s"] == pytest.approx(13.0) and stage["basis"] == "file times"
    nb = df[df["level"] == "notebook"].set_index("notebook")
    n3 = nb.loc["03_ppo_finetuning"]
    assert n3["total_s"] == 100.0
    # kernel start 0.5 + the imports cell 2.0 + the stage's 7.0
    assert n3["startup_s"] == pytest.approx(9.5)
    assert n3["compute_s"] == pytest.approx(50.0)
    assert n3["rest_s"] == pytest.approx(100.0 - 9.5 - 50.0)
    kernel = df[df["stage"].str.endswith("(kernel)")].iloc[0]
    assert kernel["total_s"] == pytest.approx(80.0 - 70.0)  # the cell less its process
    # training 0.5 + 10 + 4 s; scoring 100 rows at 50/s and 40 rows at 20/s (epochs not seconds)
    assert nb.loc["02_reward_model", "compute_s"] == pytest.approx(14.5 + 2.0 + 2.0)
    n4 = nb.loc["04_evaluation"]
    assert (n4["compute_s"], n4["loading_s"], n4["io_s"]) == pytest.approx((40.0, 5.0, 2.0))
    assert n4["startup_s"] == pytest.approx(0.5 + 1.5)
    phases = df[df["notebook"] == "04_evaluation"].set_index("stage")["total_s"]
    assert phases["phase: samples ppo"] == 30.0 and "phase: samples base" not in phases
    assert phases["cell 1: stage = run_evaluation_stage(cfg, run) (rest)"] == pytest.approx(8.0)
    assert n4["rest_s"] == pytest.approx(60.0 - 40 - 5 - 2 - 2.0)
    assert (df["rest_s"] > -0.05).all()


def test_profile_uses_the_stages_timing_file(fake_run: Path) -> None:
    t = {"launcher_s": 1.0, "imports_s": 3.0, "reward_loaded_s": 2.0, "policy_loaded_s": 4.0,
         "train_start_s": 0.5, "train_end_s": 55.0, "written_s": 1.5, "total_s": 70.0}  # fmt: skip
    _touch(fake_run / "policy/ppo/timing.json", LAUNCH + 70.0, json.dumps(t))
    df = ps.profile_run(fake_run)
    _check_sums(df)
    r = df[df["stage"] == "ppo (process)"].iloc[0]
    assert r["basis"] == "timing.json"
    assert (r["startup_s"], r["loading_s"], r["io_s"], r["compute_s"]) == pytest.approx(
        (4.0, 6.0, 1.5, 50.0)
    )
    assert r["rest_s"] == pytest.approx(70.0 - 4 - 6 - 1.5 - 50)


def test_stages_side_by_side_share_the_wall_they_covered(
    fake_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two lanes (`compute.parallel_stages`): GRPO's 50 s ran inside PPO's 70 s, so their rows
    scale to the 70 s of wall time they covered, and the cell's kernel rest stays 80 - 70."""
    manifest = json.loads((fake_run / "manifest.json").read_text())
    manifest["params"]["rl"]["algorithm"] = ["ppo", "grpo"]
    (fake_run / "manifest.json").write_text(json.dumps(manifest))
    grpo = fake_run / "policy/grpo"
    _touch(grpo / "launch.log", LAUNCH + 55.0, "log")
    _touch(grpo / "complete.json", LAUNCH + 60.0)
    pd.DataFrame({"step": [1], "step_time_s": [40.0]}).to_parquet(grpo / "train_log.parquet")
    births = {"ppo": LAUNCH, "grpo": LAUNCH + 10.0}
    monkeypatch.setattr(ps, "_birth", lambda p: births.get(p.parent.name))
    df = ps.profile_run(fake_run)
    _check_sums(df)
    side = df[df["stage"].str.contains("side by side")].set_index("stage")["total_s"]
    share = 70.0 / 120.0
    assert side.to_dict() == pytest.approx({
        "ppo (process, side by side: share of the wall)": 70.0 * share,
        "grpo (process, side by side: share of the wall)": 50.0 * share,
    })  # fmt: skip
    assert df[df["stage"].str.endswith("(kernel)")].iloc[0]["total_s"] == pytest.approx(10.0)
    steps = df.loc[df["stage"].str.contains("side by side"), "compute_s"]
    assert steps.sum() == pytest.approx((50.0 + 40.0) * share)
    alone = [{"span": (0.0, 5.0), "stage": "x"}, {"span": (5.0, 9.0), "stage": "y"}]
    assert ps.wall_shares([dict(r) for r in alone]) == [{"stage": "x"}, {"stage": "y"}]


def test_profile_names_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="manifest.json"):
        ps.profile_run(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"notebooks": []}))
    with pytest.raises(ValueError, match="'notebooks'"):
        ps.profile_run(tmp_path)


PYTEST_LOG = """\
..........s.......
============================= slowest durations ==============================
700.12s setup    tests/test_smoke_study.py::test_smoke_study_renders_the_report
31.50s call     tests/test_smoke_study.py::test_smoke_study_renders_the_report
90.00s call     tests/test_smoke_study.py::test_a_killed_study_resumes_to_the_same_artifacts
2.00s setup    tests/test_rl.py::test_ppo_runs
12.25s call     tests/test_rl.py::test_ppo_runs
0.50s teardown tests/test_rl.py::test_ppo_runs

(40 durations < 0.005s hidden.  Use -vv to show these durations.)
18 passed, 690 deselected in 850.00s (0:14:10)
"""


def test_pytest_durations_split_the_smoke_fixture_from_its_test() -> None:
    raw = ps.parse_durations(PYTEST_LOG)
    assert len(raw) == 3
    ppo = raw.set_index("test").loc["tests/test_rl.py::test_ppo_runs"]
    assert (ppo["setup_s"], ppo["call_s"], ppo["teardown_s"], ppo["total_s"]) == pytest.approx(
        (2.0, 12.25, 0.5, 14.75)
    )
    table = ps.tests_table(raw, fixture_min=30.0)
    fixture = table[table["kind"] == "fixture"]
    assert len(fixture) == 1 and fixture.iloc[0]["test"].startswith("smoke study fixture")
    assert fixture.iloc[0]["total_s"] == pytest.approx(700.12)
    # nothing lost or counted twice
    assert table["total_s"].sum() == pytest.approx(700.12 + 31.5 + 90.0 + 14.75)
    assert table.iloc[0]["kind"] == "fixture"  # the largest item first
    with pytest.raises(ValueError, match="durations"):
        ps.parse_durations("3 passed in 1.0s\n")


def test_by_kind_splits_the_run_by_what_its_seconds_buy(fake_run: Path) -> None:
    """Training: the encoders' and TF-IDF's 14.5 s and PPO's 50 s of steps; evaluation: the test
    sets' 100/50 + 40/20 s and notebook 04's phases but the reused draw (30 + 10); the four add
    up to the notebooks' 190 s."""
    study = ps.profile_run(fake_run)
    kinds = ps.by_kind(fake_run, study).set_index("kind")["seconds"]
    assert list(kinds.index) == list(ps.KINDS)
    assert kinds.iloc[0] == pytest.approx(14.5 + 50.0)
    assert kinds.iloc[1] == pytest.approx(4.0 + 40.0)
    nb = study[study["level"] == "notebook"]
    assert kinds.iloc[2] == pytest.approx(nb[["startup_s", "loading_s", "io_s"]].sum().sum())
    assert kinds.sum() == pytest.approx(190.0)


def test_main_writes_the_table_and_figure(fake_run: Path, tmp_path: Path) -> None:
    log = tmp_path / "pytest.log"
    log.write_text(PYTEST_LOG)
    out = tmp_path / "out" / "profile_fake"
    assert ps.main(["--run-dir", str(fake_run), "--pytest-log", str(log), "--out", str(out)]) == 0
    csv = pd.read_csv(out.with_suffix(".csv"))
    assert set(csv["notebook"]) == {"02_reward_model", "03_ppo_finetuning", "04_evaluation"}
    assert (out.parent / "profile_fake_tests.csv").is_file()
    assert "Slow tests" in out.with_suffix(".md").read_text()
    assert ps.KINDS[0] in out.with_suffix(".md").read_text()
    assert out.with_suffix(".png").stat().st_size > 0


def test_stage_timing_records_each_interval() -> None:
    marks = {"imports": 110.0, "reward_loaded": 112.0, "policy_loaded": 116.0,
             "train_start": 116.5, "train_end": 170.0, "written": 171.0}  # fmt: skip
    t = timing.stage_timing(marks, started=104.0, launched=100.0, end=171.2)
    assert t["launcher_s"] == 4.0 and t["imports_s"] == 6.0
    assert (t["reward_loaded_s"], t["policy_loaded_s"], t["train_end_s"]) == (2.0, 4.0, 53.5)
    assert t["written_s"] == 1.0 and t["total_s"] == pytest.approx(71.2)
    assert t["marks_s"]["train_end"] == 70.0
    # every key a timing to `rlxf compare`: two runs' files compare equal
    from rlxf_utils.compare import TIMING

    assert all(TIMING.search(k) for k in t)
    with pytest.raises(ValueError, match="timing mark"):
        timing.mark("lunch")


def test_worker_writes_the_timing_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(timing, "MARKS", {})
    monkeypatch.setenv(timing.LAUNCHED_AT, repr(time.time() - 2.0))
    for m in timing.MARK_ORDER:
        timing.mark(m)
    path = timing.write_stage_timing(tmp_path, "ppo")
    t = json.loads(path.read_text())
    assert path == tmp_path / "policy/ppo/timing.json"
    assert t["total_s"] >= 2.0 and set(t["marks_s"]) == set(timing.MARK_ORDER)
    if timing.process_started() is not None:  # Linux
        assert t["launcher_s"] >= 0.0 and "imports_s" in t


def test_a_stage_reused_from_an_earlier_run_is_not_counted(
    fake_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # ppo's process started long before this run's notebook 03: complete.json was reused
    monkeypatch.setattr(ps, "_birth", lambda p: LAUNCH - 1000.0)
    df = ps.profile_run(fake_run)
    assert not (df["stage"] == "ppo (process)").any()
    kernel = df[df["stage"].str.endswith("(kernel)")].iloc[0]
    assert kernel["total_s"] == pytest.approx(80.0) and kernel["rest_s"] == pytest.approx(80.0)


def _stand_in_stage(monkeypatch, worker, run_algorithm, algos) -> None:
    """`rl.worker` with a stand-in for `rl.stage` (`run_algorithm`, no model loads) and a
    parameters object naming `algos`; its marks start empty, as a new process's do."""
    import sys
    import types

    fake = types.ModuleType("rlxf_utils.rl.stage")
    fake.run_algorithm = run_algorithm
    fake.training_inputs = lambda cfg, run: ([], None, None)
    monkeypatch.setitem(sys.modules, "rlxf_utils.rl.stage", fake)
    monkeypatch.setattr(worker, "die_with_parent", lambda: None)
    monkeypatch.setattr(worker, "hub_environment", lambda cfg: {})
    cfg = types.SimpleNamespace(rl=types.SimpleNamespace(algorithm=list(algos)))
    monkeypatch.setattr(worker, "load_config", lambda path: cfg)
    timing.MARKS.clear()


@pytest.mark.parametrize("trains", [True, False])
def test_the_rl_worker_writes_its_timing_only_when_it_trained(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, trains: bool
) -> None:
    """`rl.worker` marks the imports, the reward model loaded and the end, and writes
    `policy/<algo>/timing.json` when the stage trained (`run_algorithm` marks the loop); a stage
    found up to date writes none. The stage's own code is a stand-in here (no model loads)."""

    from rlxf_utils.rl import worker

    def run_algorithm(algo, cfg, root, reward_fn, contexts=None, progress=True):
        if trains:  # what the real one marks around its loop
            for m in ("policy_loaded", "train_start", "train_end"):
                timing.mark(m)

    _stand_in_stage(monkeypatch, worker, run_algorithm, ["ppo"])
    monkeypatch.setenv(timing.LAUNCHED_AT, repr(time.time() - 1.0))
    monkeypatch.delenv("RANK", raising=False)
    argv = ["rl", "--params", "params.yaml", "--run-dir", str(tmp_path), "--algo", "ppo"]
    try:
        assert worker.main(argv) == 0
    finally:
        timing.MARKS.clear()
    path = tmp_path / "policy/ppo/timing.json"
    assert path.is_file() == trains
    if trains:
        t = json.loads(path.read_text())
        assert set(t["marks_s"]) == set(timing.MARK_ORDER)
        assert t["total_s"] >= 1.0 and t["train_end_s"] >= 0.0


def test_a_warm_worker_trains_its_algorithms_in_turn_each_with_its_own_timing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--algo ppo,grpo`: one process trains both in turn; before the second it announces it
    (the launcher's cue for the log) and clears the process's state; each writes its timing,
    the second without the launcher and imports it did not pay."""

    from rlxf_utils.rl import worker

    events: list[str] = []

    def run_algorithm(algo, cfg, root, reward_fn, contexts=None, progress=True):
        events.append(algo)
        for m in ("policy_loaded", "train_start", "train_end"):
            timing.mark(m)

    _stand_in_stage(monkeypatch, worker, run_algorithm, ["ppo", "grpo"])
    monkeypatch.setattr(worker, "fresh_process_state", lambda: events.append("cleared"))
    monkeypatch.setenv(timing.LAUNCHED_AT, repr(time.time() - 1.0))
    monkeypatch.delenv("RANK", raising=False)
    argv = ["rl", "--params", "p.yaml", "--run-dir", str(tmp_path), "--algo", "ppo,grpo"]
    try:
        assert worker.main(argv) == 0
    finally:
        timing.MARKS.clear()
    assert events == ["ppo", "cleared", "grpo"]
    assert f"{worker.NEXT_STAGE}grpo" in capsys.readouterr().out.splitlines()
    first, second = (json.loads((tmp_path / f"policy/{a}/timing.json").read_text())
                     for a in ("ppo", "grpo"))  # fmt: skip
    assert {"imports_s", "reward_loaded_s", "policy_loaded_s"} <= set(first)
    assert "imports_s" not in second and "launcher_s" not in second
    assert "reward_loaded_s" not in second and set(second["marks_s"]) == {
        "policy_loaded", "train_start", "train_end", "written"}  # fmt: skip
    with pytest.raises(SystemExit, match="expected one of"):
        worker.main(["rl", "--params", "p.yaml", "--run-dir", str(tmp_path), "--algo", "ppo,dpo"])


def test_fresh_process_state_clears_accelerates_shared_state() -> None:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from rlxf_utils.rl.worker import fresh_process_state

    Accelerator(cpu=True)
    assert AcceleratorState._shared_state and GradientState._shared_state
    fresh_process_state()
    assert not AcceleratorState._shared_state and not GradientState._shared_state
