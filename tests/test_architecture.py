"""The package's shape, read from its own imports: no cycles, no private names across modules,
imports inside functions only where a module says why, every room importing only the rooms below
it (the table in docs/architecture.md), and modules of a readable size."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import pytest

from rlxf_utils.freshness import Import, package_imports, package_modules

PKG = Path(__file__).resolve().parent.parent / "rlxf_utils"
ARCHITECTURE_DOC = PKG.parent / "docs" / "architecture.md"

#: Room -> the rooms it may import. A room is a subpackage or a top-level module. No stage
#: imports the report: what stages and the report both need to write tables is `markdown`.
ROOMS: dict[str, set[str]] = {
    "algorithms": set(),
    "names": {"algorithms"},
    "prompts": set(),
    "stats": set(),
    "config": {"algorithms"},
    "runtime": {"config"},
    "processes": set(),
    "markdown": set(),
    "artifacts": {"markdown", "names"},
    "plots": {"stats"},
    "compare": {"artifacts"},
    "freshness": {"config", "artifacts"},
    "data": {"config", "artifacts", "stats", "prompts", "plots"},
    "models": {"config", "algorithms", "artifacts", "prompts", "runtime", "data"},
    "reward": {"config", "artifacts", "stats", "prompts", "plots", "runtime", "data"},
    "rl": {
        "config",
        "algorithms",
        "artifacts",
        "prompts",
        "runtime",
        "processes",
        "freshness",
        "data",
        "models",
        "reward",
    },
    "evaluation": {
        "config",
        "algorithms",
        "plots",
        "artifacts",
        "stats",
        "prompts",
        "runtime",
        "processes",
        "data",
        "models",
        "reward",
        "markdown",
    },
    "risk": {"stats", "prompts", "plots", "data", "reward", "evaluation"},
    "report": {
        "config",
        "algorithms",
        "names",
        "artifacts",
        "stats",
        "prompts",
        "markdown",
        "reward",
        "evaluation",
        "risk",
    },
    "pipeline": {"config", "artifacts", "runtime", "freshness", "data"},
    "seeds": {"config", "algorithms", "artifacts", "pipeline", "stats", "evaluation"},
    "cli": {"config", "artifacts", "data", "pipeline", "report", "compare", "seeds"},
}
#: Modules that import some of the package inside functions, and why (nothing else may).
LOCAL_IMPORTS = {
    "rlxf_utils.cli": "each command imports what it runs: `rlxf --help` starts in a blink",
    "rlxf_utils.rl.worker": "transformers reads the hub's offline switch at import: after "
    "`hub_environment`",
    "rlxf_utils.evaluation.lanes": "a lane's process, like `rl.worker`, imports transformers only "
    "after `hub_environment`",
}
MAX_LINES = (
    700  # "about 600": the PPO trainer, one readable file in the CleanRL spirit, is the largest
)


def _modules() -> dict[str, Path]:
    return package_modules(PKG)


def _room(module: str) -> str:
    parts = module.split(".")[1:]
    return parts[0] if parts else "rlxf_utils"


def _imports() -> list[Import]:
    """(importer, imported module, imported name or None, inside a function) of every import of
    the package by itself: the graph `freshness` also follows for notebooks' fingerprints."""
    return package_imports(PKG)


def test_no_import_cycles_counting_imports_inside_functions() -> None:
    graph = defaultdict(set)
    for a, b, _, _ in _imports():
        graph[a].add(b)

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()]:
                if nxt == goal:
                    return True
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return False

    cycles = sorted(f"{a} -> {b}" for a in list(graph) for b in graph[a] if reaches(b, a))
    assert not cycles, cycles


def test_no_private_name_crosses_a_module() -> None:
    private = sorted(f"{a} imports {b}.{n}" for a, b, n, _ in _imports()
                     if n and n.startswith("_") and not n.startswith("__"))  # fmt: skip
    assert not private, private


def test_imports_inside_functions_only_where_a_module_says_why() -> None:
    local = sorted({a for a, _, _, inside in _imports() if inside})
    assert local == sorted(LOCAL_IMPORTS), local


def test_every_room_imports_only_the_rooms_below_it() -> None:
    rooms = {_room(m) for m in _modules()} - {"rlxf_utils"}
    assert rooms == set(ROOMS), rooms ^ set(ROOMS)
    wrong = sorted({f"{_room(a)} -> {_room(b)} ({a} imports {b})" for a, b, _, _ in _imports()
                    if _room(a) != _room(b) and _room(b) not in ROOMS.get(_room(a), set())})  # fmt: skip
    assert not wrong, wrong


def test_the_check_catches_a_cycle_and_a_layer_break(tmp_path: Path, monkeypatch) -> None:
    """The tests above fail on a package that breaks them (they are not vacuous)."""
    pkg = tmp_path / "rlxf_utils"
    (pkg / "data").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "data" / "__init__.py").write_text("")
    (pkg / "stats.py").write_text("from rlxf_utils.data.splits import _take\n")
    (pkg / "data" / "splits.py").write_text("def f():\n    from rlxf_utils import stats\n")
    monkeypatch.setattr(f"{__name__}.PKG", pkg)
    for check in (test_no_import_cycles_counting_imports_inside_functions,
                  test_no_private_name_crosses_a_module,
                  test_imports_inside_functions_only_where_a_module_says_why,
                  test_every_room_imports_only_the_rooms_below_it):  # fmt: skip
        with pytest.raises(AssertionError):
            check()


def test_modules_stay_readable() -> None:
    big = {m: n for m, p in _modules().items()
           if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}  # fmt: skip
    assert not big, big


def test_the_docs_name_every_room_and_what_it_may_import() -> None:
    """The table of rooms that opens docs/architecture.md (before its first section): one row per
    room, its allowed imports as in `ROOMS`."""
    text = ARCHITECTURE_DOC.read_text(encoding="utf-8").split("\n## ")[0]
    rows = dict(re.findall(r"^\| `([\w.]+)/?` \|[^|]*\| ([^|]*) \|$", text, flags=re.M))
    assert set(rows) == set(ROOMS), set(rows) ^ set(ROOMS)
    for room, allowed in ROOMS.items():
        listed = set(re.findall(r"`([\w.]+)`", rows[room]))
        assert listed == allowed, (room, listed ^ allowed)


def test_notebooks_type_no_verdicts_and_write_no_artifacts() -> None:
    """Notebooks call stage functions and show what they wrote: no `run.write_*` and no verdict
    vocabulary typed into a cell (the sentences come from `rlxf_utils.report`)."""
    import json

    verdicts = re.compile(r"significantly|not distinguishable|cannot be told apart|"
                          r"\"(higher|lower|rose|fell|raised|lowered)\"")  # fmt: skip
    for nb in sorted((PKG.parent / "notebooks").glob("*.ipynb")):
        cells = json.loads(nb.read_text(encoding="utf-8"))["cells"]
        code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        assert "run.write_" not in code, nb.name
        assert not verdicts.search(code), (nb.name, verdicts.search(code).group(0))
