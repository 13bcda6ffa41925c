"""Notebooks are committed clean, and the runner executes them with papermill (smoke profile)."""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest

from rlxf_utils.pipeline import NotebookFailed, discover_notebooks, git_info, run_study

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("nb_path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_committed_clean_with_parameters_cell(nb_path: Path) -> None:
    nb = nbformat.read(nb_path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), "outputs committed"
    params = [c for c in code if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1
    names = {line.split("=")[0].strip() for line in params[0].source.splitlines() if "=" in line}
    assert names == {"params_file", "run_dir"}
    assert nb.metadata["kernelspec"]["name"] == "rlxf"


def test_discover_in_number_order_and_only() -> None:
    names = [p.name for p in discover_notebooks()]
    assert names == sorted(names) and names[0] == "01_data_exploration.ipynb"
    assert [p.name for p in discover_notebooks(only=["1"])] == ["01_data_exploration.ipynb"]
    with pytest.raises(ValueError, match="99"):
        discover_notebooks(only=["99"])


def _tiny_notebook(path: Path, body: str) -> None:
    nb = nbformat.v4.new_notebook()
    p = nbformat.v4.new_code_cell('params_file = ""\nrun_dir = ""')
    p.metadata["tags"] = ["parameters"]
    nb.cells = [p, nbformat.v4.new_code_cell("x = 1"), nbformat.v4.new_code_cell(body)]
    nb.metadata["kernelspec"] = {"name": "rlxf", "display_name": "rlxf", "language": "python"}
    nbformat.write(nb, path)


@pytest.mark.slow
def test_runner_reports_the_failing_cell(tmp_path: Path) -> None:
    nbdir = tmp_path / "nbs"
    nbdir.mkdir()
    _tiny_notebook(
        nbdir / "01_ok.ipynb",
        "from pathlib import Path\nPath(run_dir, 'ran.txt').write_text(params_file)",
    )
    _tiny_notebook(nbdir / "02_bad.ipynb", "raise ValueError('boom in cell')")
    _tiny_notebook(nbdir / "03_never.ipynb", "x = 2")
    run_dir = tmp_path / "run"
    with pytest.raises(NotebookFailed) as ei:
        run_study(ROOT / "params/smoke.yaml", run_dir, notebook_dir=nbdir, progress=False)
    msg = str(ei.value)
    assert "02_bad.ipynb" in msg and "ValueError: boom in cell" in msg and "raise ValueError" in msg
    assert (run_dir / "ran.txt").read_text() == str(run_dir / "params.yaml")  # the frozen copy
    manifest = json.loads((run_dir / "manifest.json").read_text())
    status = {n["name"]: n["status"] for n in manifest["notebooks"]}
    assert status == {"01_ok": "ok", "02_bad": "failed"}


def _declare(path: Path, **rlxf: list[str]) -> None:
    nb = nbformat.read(path, as_version=4)
    nb.metadata["rlxf"] = rlxf
    nbformat.write(nb, path)


@pytest.mark.slow
def test_runner_skips_what_is_up_to_date_and_reruns_what_changed(tmp_path: Path) -> None:
    """Fingerprints: nothing changed -> skipped; a param, an output, a failure or --force/--from
    rerun exactly that notebook and every later one; the manifest says which were reused."""
    nbdir = tmp_path / "nbs"
    nbdir.mkdir()
    _tiny_notebook(
        nbdir / "01_make.ipynb",
        "from pathlib import Path\nfrom rlxf_utils.config import load_config\n"
        "Path(run_dir, 'a').mkdir(exist_ok=True)\n"
        "Path(run_dir, 'a', 'x.txt').write_text(str(load_config(params_file).run.seed))\n"
        "log = Path(run_dir, 'log.txt'); log.write_text(log.read_text() + '01 ' if log.exists() else '01 ')",
    )
    _declare(nbdir / "01_make.ipynb", params=["run.seed"], inputs=[], outputs=["a"])
    _tiny_notebook(
        nbdir / "02_use.ipynb",
        "import os\nfrom pathlib import Path\nfrom rlxf_utils.config import load_config\n"
        "assert not Path(run_dir, 'fail').exists(), 'failing on purpose'\n"
        "Path(run_dir, 'b').mkdir(exist_ok=True)\n"
        "x = Path(run_dir, 'a', 'x.txt').read_text()\n"
        "Path(run_dir, 'b', 'y.txt').write_text(x + str(load_config(params_file).rl.steps))\n"
        "log = Path(run_dir, 'log.txt'); log.write_text(log.read_text() + '02 ')",
    )
    _declare(nbdir / "02_use.ipynb", params=["rl.steps"], inputs=["a"], outputs=["b"])
    _tiny_notebook(  # no metadata: reads every parameter
        nbdir / "03_last.ipynb",
        "from pathlib import Path\nlog = Path(run_dir, 'log.txt'); log.write_text(log.read_text() + '03 ')",
    )
    (tmp_path / "params").mkdir()
    (tmp_path / "data").symlink_to(ROOT / "data")  # the profile's relative paths still resolve
    params = tmp_path / "params" / "p.yaml"
    params.write_text(f"extends: {ROOT / 'params/smoke.yaml'}\nrun: {{name: t}}\n")
    run_dir = tmp_path / "run"
    log = run_dir / "log.txt"

    def run(**kw) -> list[str]:
        before = log.read_text() if log.exists() else ""
        run_study(params, run_dir, notebook_dir=nbdir, progress=False, **kw)
        return log.read_text()[len(before) :].split()

    assert run() == ["01", "02", "03"]
    assert run() == []  # nothing changed: every notebook reused
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert {n["name"]: n["how"] for n in manifest["notebooks"]} == dict.fromkeys(
        ["01_make", "02_use", "03_last"], "reused"
    )
    assert all(n["reused_from"] for n in manifest["notebooks"])
    # a reused notebook keeps the commit its run recorded (the README stamp reads it)
    git = git_info()
    ran_at = git["commit"] + ("-dirty" if git["dirty"] else "")
    assert [n["commit"] for n in manifest["notebooks"]] == [ran_at] * 3
    # a parameter only 02 (and 03, which reads everything) depends on
    params.write_text(params.read_text() + "rl: {steps: 3}\n")
    assert run() == ["02", "03"]
    assert (run_dir / "b" / "y.txt").read_text().endswith("3")
    # an output edited by hand is not up to date
    (run_dir / "b" / "y.txt").write_text("tampered")
    assert run() == ["02", "03"]
    # a notebook that fails leaves no completion record; the rerun resumes there
    (run_dir / "a" / "x.txt").write_text("changed input")  # 01's output: 01 reruns first
    (run_dir / "fail").write_text("")
    with pytest.raises(NotebookFailed, match="failing on purpose"):
        run()
    assert not (run_dir / ".rlxf/stages/02_use.json").exists()
    (run_dir / "fail").unlink()
    assert run() == ["02", "03"]
    assert run(from_="03") == ["03"] and run(force=True) == ["01", "02", "03"]
    # --only forces the named notebooks; with --skip-fresh (make study's control) they resume
    assert run(only=["02"]) == ["02"] and run(only=["01", "02"], force_only=False) == []
    (run_dir / "b" / "y.txt").write_text("tampered")
    assert run(only=["01", "02"], force_only=False) == ["02"]
    with pytest.raises(ValueError, match="--from 7"):
        run(from_="7")


@pytest.mark.slow
def test_smoke_study_notebook_01(tmp_path: Path) -> None:
    run_dir = run_study(ROOT / "params/smoke.yaml", tmp_path / "smoke", only=["01"], progress=False)
    m = json.loads((run_dir / "manifest.json").read_text())
    assert m["data"]["sha256"] == "df8a2a242868460ebf302904c19b7fa6be95a9249cbc140972d56476d0c20a2a"
    assert m["params"]["run"]["name"] == "smoke"
    assert m["environment"]["packages"]["torch"].startswith("2.13.0")
    assert (
        m["notebooks"][0]["name"] == "01_data_exploration" and m["notebooks"][0]["status"] == "ok"
    )
    assert m["notebooks"][0]["seconds"] > 0 and m["git"].keys() == {"commit", "dirty"}
    for rel in [
        "data/conditions.parquet",
        "data/splits.json",
        "data/contexts.parquet",
        "figures/met_rate_by_year.png",
        "tables/status_mapping.csv",
        "tables/table2_sample.md",
        "notebooks/01_data_exploration.ipynb",
    ]:
        assert (run_dir / rel).is_file(), rel
    summary = json.loads((run_dir / "data/summary.json").read_text())
    assert (
        summary["rows_used"] <= 600 and summary["labelled"] == summary["met"] + summary["non_met"]
    )
    executed = nbformat.read(run_dir / "notebooks/01_data_exploration.ipynb", as_version=4)
    assert not any(
        o.get("output_type") == "error" for c in executed.cells for o in c.get("outputs", [])
    )


class _Workers:
    """Stand-in for `pytest.TempPathFactory` as one xdist worker sees it: its own basetemp
    inside the run's folder."""

    def __init__(self, root: Path, name: str) -> None:
        self.base = root / f"popen-{name}"
        self.base.mkdir(parents=True, exist_ok=True)

    def getbasetemp(self) -> Path:
        return self.base


def _fake_build(monkeypatch: pytest.MonkeyPatch, calls: list[str], fail: bool = False) -> None:
    import threading
    import time

    import rlxf_utils.pipeline
    import rlxf_utils.report.render

    def build(params: Path, run: Path, progress: bool) -> Path:
        calls.append(threading.current_thread().name)
        time.sleep(0.5)  # long enough for the other worker to ask meanwhile
        if fail:
            raise RuntimeError("notebook 03 failed")
        run.mkdir(parents=True)
        return run

    monkeypatch.setattr(rlxf_utils.pipeline, "run_study", build)
    monkeypatch.setattr(rlxf_utils.report.render, "render_report", lambda run, engine: None)


@pytest.mark.parametrize("fail", [False, True], ids=["built", "failed"])
def test_two_workers_share_one_smoke_study(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail: bool
) -> None:
    """Two workers asking for the smoke study at once: one builds it while the other waits on
    the lock; the other then reads the same folder, or, when the build failed, fails at once
    naming the builder instead of building it again (20 minutes on two cores)."""
    import threading

    from smoke import shared_smoke_run

    calls: list[str] = []
    _fake_build(monkeypatch, calls, fail)
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    got: dict[str, object] = {}

    def ask(name: str) -> None:
        try:
            got[name] = shared_smoke_run(_Workers(tmp_path, name))
        except BaseException as e:  # noqa: BLE001 (pytest.fail raises a BaseException)
            got[name] = e

    threads = [threading.Thread(target=ask, args=(n,), name=n) for n in ("gw0", "gw1")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(calls) == 1, calls  # built once
    builder, other = calls[0], {"gw0": "gw1", "gw1": "gw0"}[calls[0]]
    if not fail:
        assert got["gw0"] == got["gw1"] == tmp_path / "smoke_study/smoke"
        assert (tmp_path / "smoke_study/built").is_file()
    else:
        assert isinstance(got[builder], RuntimeError)
        assert "failed while gw0 built it" in str(got[other])  # the env names the builder
        assert not (tmp_path / "smoke_study/built").exists()


def test_under_two_workers_the_smoke_files_come_first_and_last(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The collection order `make test`'s workers share (`--no-loadscope-reorder`): the file
    that builds the smoke study first, the other files that read it last, the rest between in
    their order; a plain `pytest` run keeps the order it collected."""
    from types import SimpleNamespace

    import conftest

    def item(name: str, *fixtures: str) -> SimpleNamespace:
        return SimpleNamespace(path=Path("tests") / name, fixturenames=fixtures, name=name)

    items = [item("test_a.py"), item("test_smoke_seeds.py", "smoke_run"), item("test_b.py"),
             item("test_smoke_study.py", "smoke_run"), item("test_smoke_study.py"),
             item("test_c.py", "tmp_path")]  # fmt: skip
    plain, shuffled = list(items), list(items)
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.delenv("RLXF_TEST_ORDER_SEED", raising=False)
    conftest.pytest_collection_modifyitems(None, plain)
    assert plain == items
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    conftest.pytest_collection_modifyitems(None, items)
    assert [i.name for i in items] == ["test_smoke_study.py", "test_smoke_study.py", "test_a.py",
                                       "test_b.py", "test_c.py", "test_smoke_seeds.py"]  # fmt: skip
    # RLXF_TEST_ORDER_SEED shuffles the files within those ranks, a file's tests kept together
    orders = set()
    for seed in range(40):
        monkeypatch.setenv("RLXF_TEST_ORDER_SEED", str(seed))
        again = list(shuffled)
        conftest.pytest_collection_modifyitems(None, again)
        names = [i.name for i in again]
        assert names[:2] == ["test_smoke_study.py"] * 2 and names[-1] == "test_smoke_seeds.py"
        orders.add(tuple(names[2:5]))
        conftest.pytest_collection_modifyitems(None, shuffled_again := list(shuffled))
        assert [i.name for i in shuffled_again] == names  # the same seed, the same order
    assert len(orders) == 6  # every order of the three middle files comes up
