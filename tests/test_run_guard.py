"""What guards a run before and while it works: bad run directories, the data checked before any
kernel, one run per folder (a lock), parameters frozen at the start, and a corrupt manifest."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from rlxf_utils.artifacts import RunDir
from rlxf_utils.cli import main
from rlxf_utils.config import load_config
from rlxf_utils.pipeline import (
    NotebookResult,
    RunLocked,
    freeze_params,
    git_info,
    params_origin,
    run_lock,
    run_study,
    write_manifest,
)

ROOT = Path(__file__).resolve().parent.parent
SMOKE = ROOT / "params/smoke.yaml"


def _params(tmp_path: Path, extra: str) -> Path:
    p = tmp_path / "p.yaml"
    p.write_text(f"extends: {SMOKE}\n{extra}", encoding="utf-8")
    return p


def test_a_run_dir_that_is_a_file_or_cannot_be_written_exits_2(tmp_path: Path, capsys) -> None:
    f = tmp_path / "file.txt"
    f.write_text("x")
    assert main(["run", "--params", str(SMOKE), "--run-dir", str(f)]) == 2
    err = capsys.readouterr().err
    assert "file.txt: --run-dir names a file; expected a folder" in err and "Traceback" not in err
    assert main(["run", "--params", str(SMOKE), "--run-dir", str(f / "sub")]) == 2
    assert "file.txt/sub: the run cannot be written there" in capsys.readouterr().err
    assert main(["run", "--params", str(SMOKE), "--run-dir", "/proc/rlxf-run"]) == 2
    assert "/proc/rlxf-run: the run cannot be written there" in capsys.readouterr().err


def test_a_wrong_sha256_and_a_wrong_file_stop_before_any_kernel(tmp_path: Path, capsys) -> None:
    p = _params(tmp_path, "data: {sha256: " + "a" * 64 + "}\n")
    run_dir = tmp_path / "r"
    assert main(["run", "--params", str(p), "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert "sha256 is" in err and "key 'data.sha256'" in err
    assert not (run_dir / "manifest.json").exists() and not (run_dir / "notebooks").exists()
    # a file of one outcome (every status unknown -> Non-MET) fails data.checks, named
    bad = tmp_path / "bad.csv"
    lines = (ROOT / "data/raw/MONA_From2002.csv").read_text(encoding="utf-8").splitlines()[:400]
    bad.write_text("\n".join(lines).replace(",M,", ",Q,").replace(",NM,", ",Q,") + "\n")
    p2 = _params(tmp_path, f"data: {{path: {bad}, sha256: null, max_rows: null}}\n")
    assert main(["run", "--params", str(p2), "--run-dir", str(run_dir)]) == 2
    assert "bad.csv: " in capsys.readouterr().err
    assert not (run_dir / "notebooks").exists()


def test_a_second_run_into_the_same_folder_is_refused_naming_the_first(tmp_path, capsys) -> None:
    run_dir = tmp_path / "r"
    with run_lock(run_dir):
        with pytest.raises(RunLocked, match=r"r: in use by `rlxf run` \(pid \d+ on .*, since "):
            run_study(SMOKE, run_dir, progress=False)
        assert main(["run", "--params", str(SMOKE), "--run-dir", str(run_dir)]) == 2
        assert "in use by" in capsys.readouterr().err
    # another process holding it: refused as well; once it exits, the lock is gone with it
    code = (f"import sys, time; sys.path.insert(0, {str(ROOT)!r})\n"
            "from pathlib import Path\nfrom rlxf_utils.pipeline import run_lock\n"
            f"with run_lock(Path({str(run_dir)!r})):\n    print('held', flush=True)\n"
            "    time.sleep(30)\n")  # fmt: skip
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunLocked, match=f"pid {holder.pid}"), run_lock(run_dir):
            pass
    finally:
        holder.kill()
        holder.wait()
    with run_lock(run_dir):  # a killed holder leaves no stale lock
        pass


def test_frozen_parameters_read_back_equal_and_keep_absolute_paths(tmp_path: Path) -> None:
    cfg = load_config(SMOKE)
    path = freeze_params(cfg, RunDir(tmp_path / "r"))
    assert path == tmp_path / "r/params.yaml"
    frozen = load_config(path)
    assert frozen.resolved() == cfg.resolved()
    assert frozen.data.path == cfg.data.path and frozen.data.path.is_absolute()


def test_a_rerun_from_the_frozen_copy_keeps_naming_where_the_parameters_came_from(
    tmp_path: Path,
) -> None:
    """`rlxf run --params RUN/params.yaml` reruns from the frozen copy: its origin stays the file
    the run was first resolved from (the manifest's `params_source`, the README's profile), not
    the copy itself."""
    run = RunDir(tmp_path / "r")
    frozen = run.path("params.yaml")
    assert params_origin(run, frozen) == frozen  # nothing frozen yet
    freeze_params(load_config(SMOKE), run)
    assert params_origin(run, frozen) == SMOKE
    assert params_origin(run, tmp_path / "other.yaml") == tmp_path / "other.yaml"
    freeze_params(load_config(frozen), run, params_origin(run, frozen))  # a rerun freezes again
    assert params_origin(run, frozen) == SMOKE
    frozen.write_text(frozen.read_text().split("\n", 1)[1])  # a copy without its first line
    assert params_origin(run, frozen) == frozen


def _notebook(path: Path, body: str) -> None:
    nb = nbformat.v4.new_notebook()
    p = nbformat.v4.new_code_cell('params_file = ""\nrun_dir = ""')
    p.metadata["tags"] = ["parameters"]
    nb.cells = [p, nbformat.v4.new_code_cell(body)]
    nb.metadata["kernelspec"] = {"name": "rlxf", "display_name": "rlxf", "language": "python"}
    nbformat.write(nb, path)


@pytest.mark.slow
def test_editing_the_parameters_during_a_run_changes_nothing_in_it(tmp_path: Path) -> None:
    """Notebook 01 edits the parameters file the run was started with (as a user might while a
    long run goes on); notebook 02 still reads the values the run started with."""
    src = _params(tmp_path, "run: {name: guarded, seed: 7}\n")
    nbdir = tmp_path / "nbs"
    nbdir.mkdir()
    _notebook(nbdir / "01_edit.ipynb",
              f"from pathlib import Path\np = Path({str(src)!r})\n"
              "p.write_text(p.read_text().replace('seed: 7', 'seed: 8'))")  # fmt: skip
    _notebook(nbdir / "02_read.ipynb",
              "from pathlib import Path\nfrom rlxf_utils.config import load_config\n"
              "Path(run_dir, 'seed.txt').write_text(str(load_config(params_file).run.seed))")  # fmt: skip
    run_dir = tmp_path / "run"
    run_study(src, run_dir, notebook_dir=nbdir, progress=False)
    assert "seed: 8" in src.read_text()  # the edit happened
    assert (run_dir / "seed.txt").read_text() == "7"
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["params_file"] == str(run_dir / "params.yaml")
    assert manifest["params_source"] == str(src.resolve())


def test_a_corrupt_manifest_is_an_error_naming_it(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "r")
    (run.root / "manifest.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"manifest\.json: unreadable"):
        write_manifest(run, load_config(SMOKE), [])
    assert (run.root / "manifest.json").read_text() == "{not json"  # left as it was


@pytest.mark.parametrize("name", [".", "..", "...", "a/b", "../x"])
def test_run_name_is_a_plain_folder_name(tmp_path: Path, name: str) -> None:
    from rlxf_utils.config import ConfigError

    with pytest.raises(ConfigError, match=r"key 'run\.name'"):
        load_config(_params(tmp_path, f"run: {{name: '{name}'}}\n"))


def test_a_run_dir_holding_the_sources_is_refused_and_nothing_is_written(tmp_path, capsys) -> None:
    before = sorted(p.name for p in ROOT.iterdir())
    for folder in (ROOT, ROOT / "notebooks", ROOT.parent, Path("/")):
        assert main(["run", "--params", str(SMOKE), "--run-dir", str(folder)]) == 2
        err = capsys.readouterr().err
        assert "(the project or its notebooks' sources) and overwrite them" in err, err
    assert sorted(p.name for p in ROOT.iterdir()) == before


@pytest.fixture
def fake_kernel(monkeypatch):
    """`run_study` up to the first notebook, which a user stops with Ctrl-C: what papermill was
    asked is recorded. No kernel starts; the data check is skipped (other tests cover it)."""
    import papermill

    import rlxf_utils.pipeline as pipeline

    calls: list[dict] = []

    def execute(path, out, **kw):
        calls.append({"path": path, "out": out, **kw})
        raise KeyboardInterrupt

    monkeypatch.setattr(papermill, "execute_notebook", execute)
    monkeypatch.setattr(pipeline, "_kernel_available", lambda name: True)
    monkeypatch.setattr(pipeline, "load_data", lambda cfg: None)
    return calls


def test_a_relative_run_dir_reaches_the_kernels_as_absolute_paths(
    tmp_path: Path, monkeypatch, fake_kernel
) -> None:
    """`rlxf run --run-dir runs/x` (the CLI's own example) and `make study RUN_DIR=runs/x`: the
    kernels run in notebooks/, so every path they are given is absolute."""
    # under `make test` this runs inside a make: no inherited MAKEFLAGS, no "Entering directory"
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    make = subprocess.run(["make", "--no-print-directory", "-n", "study", "RUN_DIR=runs/x"],
                          cwd=ROOT, text=True, capture_output=True, check=True,
                          env=env).stdout.splitlines()  # fmt: skip
    control = next(line for line in make if " run --params params/control.yaml" in line)
    run_line = next(line for line in make if " run --params " in line and line != control)
    report_line = next(line for line in make if " report --run-dir " in line)
    assert run_line.endswith("--run-dir runs/x") and report_line.endswith("report --run-dir runs/x")
    # the positive control beside the run, where its report looks for it
    # ... resumed as the run is: a rerun of `make study` skips the control's finished notebooks
    assert "--run-dir runs/control --only 01,02,03,04 --skip-fresh" in control
    # without RUN_DIR the report's folder is the profile's resolved run.name (smoke extends default)
    make = subprocess.run(["make", "--no-print-directory", "-n", "study", "PARAMS=params/smoke.yaml"],
                          cwd=ROOT, text=True, capture_output=True, check=True,
                          env=env).stdout.splitlines()  # fmt: skip
    assert any(line.endswith("report --run-dir runs/smoke") for line in make), make
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.yaml").write_text(f"extends: {SMOKE}\n", encoding="utf-8")
    assert main(["run", "--params", "p.yaml", "--run-dir", "runs/x"]) == 130
    params = fake_kernel[0]["parameters"]
    assert params == {"params_file": str(tmp_path / "runs/x/params.yaml"),
                      "run_dir": str(tmp_path / "runs/x")}  # fmt: skip
    assert Path(fake_kernel[0]["out"]).is_absolute() and fake_kernel[0]["cwd"].endswith("notebooks")
    assert "--IPKernelApp.log_level=CRITICAL" in fake_kernel[0]["extra_arguments"]
    assert RunDir("runs/x").path("a").is_absolute()
    assert RunDir("runs/x/../x").root == tmp_path / "runs/x"


def test_ctrl_c_prints_one_line_exits_130_and_the_manifest_says_interrupted(
    tmp_path: Path, capsys, fake_kernel
) -> None:
    run_dir = tmp_path / "r"
    assert main(["run", "--params", str(SMOKE), "--run-dir", str(run_dir), "--quiet"]) == 130
    err = capsys.readouterr().err.strip()
    assert err.startswith("interrupted: rlxf run stopped (Ctrl-C)") and "\n" not in err, err
    manifest = json.loads((run_dir / "manifest.json").read_text())
    (entry,) = manifest["notebooks"]
    assert entry["name"] == Path(fake_kernel[0]["path"]).stem and entry["status"] == "interrupted"
    with run_lock(run_dir):  # released
        pass


#: A finished notebook 01, as an earlier run records it.
OK_01 = NotebookResult(name="01_data_exploration", status="ok", started="2026-01-01T00:00:00+00:00",
                       ended="2026-01-01T00:01:00+00:00", seconds=60.0, output="x")  # fmt: skip


def test_a_notebook_killed_mid_run_is_running_in_the_manifest_never_its_old_ok(
    tmp_path: Path, monkeypatch, fake_kernel
) -> None:
    """A run killed from outside (no Ctrl-C, nothing recorded after) over a finished one: the
    manifest names the notebook "running", so the report and README refuse the run."""
    import papermill

    run_dir = tmp_path / "r"
    write_manifest(RunDir(run_dir), load_config(SMOKE), [OK_01])
    seen: list[dict] = []

    def killed(path, out, **kw):
        seen.append(json.loads((run_dir / "manifest.json").read_text()))
        raise OSError("killed")  # stands in for SIGKILL: nothing after the call runs

    monkeypatch.setattr(papermill, "execute_notebook", killed)
    with pytest.raises(OSError):
        run_study(SMOKE, run_dir, progress=False, force=True)
    (entry,) = json.loads((run_dir / "manifest.json").read_text())["notebooks"]
    assert entry["name"] == "01_data_exploration" and entry["status"] == "running"
    assert entry["started"] and not entry["ended"] and seen[0]["notebooks"] == [entry]
    git = git_info()
    assert entry["commit"] == git["commit"] + ("-dirty" if git["dirty"] else "")


def test_skip_fresh_reaches_the_runner_and_only_still_forces_without_it(monkeypatch) -> None:
    import rlxf_utils.pipeline as pipeline

    calls: list[dict] = []
    monkeypatch.setattr(pipeline, "run_study", lambda *a, **kw: calls.append(kw) or Path("r"))
    assert main(["run", "--params", str(SMOKE), "--only", "01,02", "--skip-fresh"]) == 0
    assert main(["run", "--params", str(SMOKE), "--only", "04"]) == 0
    assert [c["force_only"] for c in calls] == [False, True]
    assert [c["only"] for c in calls] == [["01", "02"], ["04"]]


def test_a_failed_check_leaves_no_run_dir_behind(tmp_path: Path, capsys) -> None:
    p = _params(tmp_path, "data: {sha256: " + "a" * 64 + "}\n")
    run_dir = tmp_path / "new" / "r"
    assert main(["run", "--params", str(p), "--run-dir", str(run_dir)]) == 2
    assert "sha256 is" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


def test_the_study_log_carries_no_renamed_checkpointing_warnings(monkeypatch) -> None:
    """transformers 5 warns on every call of the `gradient_checkpointing*` names, which TRL and
    peft still use: the kernels and stages `rlxf run` starts inherit a filter for those, and only
    those (another FutureWarning still shows)."""
    from rlxf_utils.runtime import quiet_library_warnings

    monkeypatch.delenv("PYTHONWARNINGS", raising=False)
    quiet_library_warnings()
    code = ("import warnings, sys; sys.path.insert(0, 'tests')\n"
            "from tiny import tiny_llama, word_tokenizer\n"
            "m = tiny_llama(word_tokenizer(['a', 'b']))\n"
            "m.gradient_checkpointing_enable(); m.is_gradient_checkpointing\n"
            "from transformers import TrainingArguments\n"
            "TrainingArguments(output_dir='.', gradient_checkpointing=True, report_to='none')\n"
            "warnings.warn('another', FutureWarning)\n")  # fmt: skip
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, text=True, capture_output=True)
    assert res.returncode == 0, res.stderr
    assert "gradient_checkpointing" not in res.stderr and "another" in res.stderr, res.stderr
