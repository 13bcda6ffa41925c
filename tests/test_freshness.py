"""A notebook's code fingerprint covers the modules it runs (what its cells import, transitively,
and what is started by name), not the whole package: what `make study` reruns after an edit, read
from the real tree and from small made-up packages."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from rlxf_utils.artifacts import RunDir
from rlxf_utils.config import load_config
from rlxf_utils.freshness import (
    REGISTRY,
    TRAINS,
    StageSpec,
    code_hash,
    code_modules,
    fingerprint,
    package_modules,
    up_to_date,
    write_record,
)

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def _notebook(path: Path, *cells: str) -> Path:
    cell = {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None}
    nb = {"cells": [{**cell, "source": c} for c in cells], "metadata": {}, "nbformat": 4,
          "nbformat_minor": 5}  # fmt: skip
    path.write_text(json.dumps(nb), encoding="utf-8")
    return path


def _package(root: Path, files: dict[str, str]) -> Path:
    pkg = root / "rlxf_utils"
    for rel, text in {"__init__.py": "", **files}.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text, encoding="utf-8")
    return pkg


def test_the_code_is_what_the_cells_import_transitively(tmp_path: Path) -> None:
    """Imports at the top and inside functions, relative ones, `from pkg import module`, and the
    `__init__` of every package on the way; a module nobody imports is not covered."""
    pkg = _package(tmp_path, {
        "stage/__init__.py": "",
        "stage/run.py": "def go():\n    from . import helper\n",
        "stage/helper.py": "from ..low import f\n",
        "low.py": "import rlxf_utils.lower\n",
        "lower.py": "",
        "report/__init__.py": "",
        "report/render.py": "from rlxf_utils.low import f\n",
    })  # fmt: skip
    nb = _notebook(tmp_path / "01_a.ipynb", "%matplotlib inline\nimport pandas as pd\n",
                   "from rlxf_utils.stage import run\n")  # fmt: skip
    assert code_modules(nb, pkg) == ("rlxf_utils", "rlxf_utils.low", "rlxf_utils.lower",
                                     "rlxf_utils.stage", "rlxf_utils.stage.helper",
                                     "rlxf_utils.stage.run")  # fmt: skip
    before = code_hash(nb, pkg)
    assert sorted(before) == sorted(
        f"rlxf_utils/{p}" for p in ("__init__.py", "low.py", "lower.py", "stage/__init__.py",
                                    "stage/helper.py", "stage/run.py")
    )  # fmt: skip
    (pkg / "report" / "render.py").write_text("# a sentence mended\n")
    assert code_hash(nb, pkg) == before
    (pkg / "lower.py").write_text("X = 1\n")  # three imports away, one of them inside a function
    assert code_hash(nb, pkg) != before


def test_modules_started_by_name_count_and_the_registry_s_trainers_count_where_it_trains(
    tmp_path: Path,
) -> None:
    """`python -m rlxf_utils.rl.worker` (a module path in a string) is an edge of the module that
    holds the string; the registry's `"module:function"` trainers are edges of `TRAINS` only."""
    assert REGISTRY == "rlxf_utils.algorithms" and TRAINS == ("rlxf_utils.rl.stage",)
    pkg = _package(tmp_path, {
        "algorithms.py": 'TRAINERS = ["rlxf_utils.rl.ppo:run_ppo"]\n',
        "config.py": "from rlxf_utils.algorithms import TRAINERS\n",
        "rl/__init__.py": "",
        "rl/launch.py": 'CMD = ["-m", "rlxf_utils.rl.worker"]\nHELP = "see rlxf_utils.rl.nothing"\n',
        "rl/worker.py": "def main():\n    from rlxf_utils.rl.stage import train\n",
        "rl/stage.py": "from rlxf_utils import algorithms\n",
        "rl/ppo.py": "",
        "rl/nothing.py": "",
    })  # fmt: skip
    reads = _notebook(tmp_path / "01_reads.ipynb", "from rlxf_utils import config\n")
    trains = _notebook(tmp_path / "03_trains.ipynb", "from rlxf_utils.rl import launch\n")
    assert code_modules(reads, pkg) == ("rlxf_utils", "rlxf_utils.algorithms", "rlxf_utils.config")
    assert code_modules(trains, pkg) == (
        "rlxf_utils", "rlxf_utils.algorithms", "rlxf_utils.rl", "rlxf_utils.rl.launch",
        "rlxf_utils.rl.ppo", "rlxf_utils.rl.stage", "rlxf_utils.rl.worker",
    )  # fmt: skip


def test_the_registry_trains_only_in_the_modules_freshness_names() -> None:
    """`TRAINS` lists every module that runs a registered trainer (`algorithm(id).train(...)`,
    `ALGORITHMS[id].train(...)` or `trainer_of(...)`): a new caller must join it."""
    import ast

    callers = set()
    for mod, path in package_modules().items():
        if mod == REGISTRY:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            via_registry = (
                isinstance(f, ast.Attribute) and f.attr == "train"
                and ((isinstance(f.value, ast.Call) and getattr(f.value.func, "id", "") == "algorithm")
                     or (isinstance(f.value, ast.Subscript)
                         and getattr(f.value.value, "id", "") == "ALGORITHMS"))
            )  # fmt: skip
            if via_registry or getattr(f, "id", "") == "trainer_of":
                callers.add(mod)
    assert callers == set(TRAINS), callers


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the checkout's package, notebooks and report templates, to edit."""
    root = tmp_path_factory.mktemp("tree")
    for name in ("rlxf_utils", "notebooks", "reports"):
        shutil.copytree(ROOT / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    return root


def _touched(root: Path, *patterns: str) -> list[str]:
    """The notebooks (numbers) whose code fingerprint changes when every file matching `patterns`
    (paths or globs under `root`; a folder: its `*.py`) gets a comment appended."""
    files = sorted({f for p in patterns
                    for f in ((root / p).rglob("*.py") if (root / p).is_dir() else root.glob(p))
                    if f.is_file()})  # fmt: skip
    assert files, patterns
    nbs = sorted((root / "notebooks").glob("*.ipynb"))
    before = {nb.name[:2]: code_hash(nb, root / "rlxf_utils") for nb in nbs}
    saved = {f: f.read_bytes() for f in files}
    try:
        for f in files:
            f.write_bytes(saved[f] + b"\n# touched\n")
        after = {nb.name[:2]: code_hash(nb, root / "rlxf_utils") for nb in nbs}
    finally:
        for f, data in saved.items():
            f.write_bytes(data)
    return [n for n in before if before[n] != after[n]]


def _reruns(changed: list[str], notebooks: list[str]) -> list[str]:
    """What the runner reruns: the first notebook whose fingerprint changed and every later one."""
    return [n for n in notebooks if changed and n >= min(changed)]


def test_a_template_or_the_report_s_rendering_reruns_no_notebook(tree: Path) -> None:
    assert _touched(tree, "reports/*", "reports/templates/*") == []  # the qmd, the templates
    # every module of the report, the vocabulary and the sections notebooks show included
    assert _touched(tree, "rlxf_utils/report") == []
    assert _touched(tree, "rlxf_utils/markdown.py") == ["01", "02", "03", "04", "05"]
    assert all(f.startswith("rlxf_utils/") and f.endswith(".py")
               for nb in NOTEBOOKS for f in code_hash(nb))  # fmt: skip


def test_evaluation_reruns_04_and_later_never_01_to_03(tree: Path) -> None:
    changed = _touched(tree, "rlxf_utils/evaluation")
    assert "04" in changed and set(changed) <= {"04", "05"}, changed
    assert _touched(tree, "rlxf_utils/evaluation/stage.py") == ["04"]


def test_reward_reruns_02_and_later_never_01(tree: Path) -> None:
    assert _touched(tree, "rlxf_utils/reward") == ["02", "03", "04", "05"]
    assert _touched(tree, "rlxf_utils/reward/stage.py") == ["02"]


def test_notebook_03_covers_its_worker_and_every_trainer(tree: Path) -> None:
    """Reached by name, not import: the process `rl.launch` starts and the registry's trainers."""
    for rel in ("rl/worker.py", "rl/accelerate_launch.py", "rl/ppo.py", "rl/trl_runs.py",
                "rl/rlgf.py", "rl/ilhf.py", "rl/offline.py"):  # fmt: skip
        assert _touched(tree, f"rlxf_utils/{rel}") == ["03"], rel


def test_the_fingerprint_follows_a_transitive_import(tree: Path, tmp_path: Path) -> None:
    """`fingerprint` itself: notebook 04 imports `evaluation.stage`, which imports
    `evaluation.measures`, ... `stats.intervals`: editing that changes 04's digest; editing the
    report's rendering does not, and the runner's log names the file."""
    nb = tree / "notebooks" / "04_evaluation.ipynb"
    cfg, run, spec = load_config(ROOT / "params" / "smoke.yaml"), RunDir(tmp_path), StageSpec()
    digest, parts = fingerprint(nb, cfg, run, spec, tree / "rlxf_utils")
    write_record(run, nb.stem, digest, parts, spec, 1.0)
    deep = tree / "rlxf_utils" / "stats" / "intervals.py"
    assert "rlxf_utils.stats.intervals" in code_modules(nb, tree / "rlxf_utils")
    render = tree / "rlxf_utils" / "report" / "render.py"
    text, render_text = deep.read_text(), render.read_text()
    try:
        render.write_text(render_text + "\n# a sentence mended\n")
        assert fingerprint(nb, cfg, run, spec, tree / "rlxf_utils")[0] == digest
        deep.write_text(text + "\n# an interval mended\n")
        new, new_parts = fingerprint(nb, cfg, run, spec, tree / "rlxf_utils")
    finally:
        deep.write_text(text)
        render.write_text(render_text)
    assert new != digest
    fresh, why, _ = up_to_date(run, nb.stem, new, spec, new_parts)
    assert not fresh and why == "changed: code rlxf_utils/stats/intervals.py", why


def _rerun_table() -> list[tuple[list[str], str, str]]:
    """docs/reruns.md's table under "Rerunning": (paths edited, fingerprints covering them,
    reruns)."""
    text = (ROOT / "docs" / "reruns.md").read_text(encoding="utf-8")
    section = text.split("\n### Rerunning: what is skipped\n", 1)[1].split("\n## ")[0]
    rows = re.findall(r"^\| ((?:`[^`]+`,? ?)+) \| ([^|]+) \| ([^|]+) \|$", section, flags=re.M)
    return [(re.findall(r"`([^`]+)`", a), b.strip(), c.strip()) for a, b, c in rows]


def test_the_docs_say_what_each_edit_reruns(tree: Path) -> None:
    """Each row: every path it names is covered by exactly the notebooks it lists (a folder or
    several paths: any of their files), and `make study` reruns the first and every later one."""
    numbers = [nb.name[:2] for nb in NOTEBOOKS]
    covers = {nb.name[:2]: set(code_hash(nb, tree / "rlxf_utils")) for nb in NOTEBOOKS}
    rows = _rerun_table()
    assert len(rows) >= 10, rows
    for paths, listed, reruns in rows:
        for path in paths:
            files = {f.relative_to(tree).as_posix() for f in
                     ((tree / path).rglob("*.py") if (tree / path).is_dir() else tree.glob(path))}  # fmt: skip
            assert files or path.startswith("reports/"), path
            hit = [n for n in numbers if covers[n] & files]
            assert listed == (", ".join(hit) or "none"), (path, listed, hit)
            expected = _reruns(hit, numbers)
            shown = "nothing" if not expected else f"{expected[0]}–{expected[-1]}" \
                if len(expected) > 1 else expected[0]  # fmt: skip
            assert reruns == shown, (path, reruns, shown)
