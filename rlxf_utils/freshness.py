"""When a notebook is up to date: what it depends on, its fingerprint and its completion record.

Each study notebook declares in its metadata (`"rlxf"`) what it reads and writes, as a DVC stage
or a Snakemake rule would::

    "rlxf": {"params": ["run.seed", "data", "reward", ...],   # config sections or dotted keys
             "inputs": ["data", "reward_model/encoder", ...],  # run-dir paths it reads
             "outputs": ["reward", "reward_model/bundle.json", ...]}  # run-dir paths it writes

Its fingerprint hashes the notebook file, the package modules it runs (`code_modules`, by content,
so an uncommitted change counts and a README edit does not), the resolved parameters it reads,
the data file's sha256 when it reads `data`, and the sha256 of every input path. When the
notebook finishes, the runner writes `<run>/.rlxf/stages/<notebook>.json` (atomically, last): the
fingerprint, what went into it, and the sha256 of every output. A notebook is up to date when that
record exists, its fingerprint is unchanged, and its outputs still hash as recorded. The record is
deleted when the notebook starts, so an interrupted notebook never looks complete.

The modules a notebook runs are those its code cells import from `rlxf_utils`, and everything they
import in turn (at the top or inside a function, absolute or relative, with the packages whose
`__init__` an import executes), plus the modules reached by name rather than by import: a string
that is a module path (`"rlxf_utils.rl.worker"`, started by `rl.launch` as `python -m ...`) is an
edge of the module that holds it, and the registry's trainers (`"rlxf_utils.rl.ppo:run_ppo"` in
`algorithms`) are edges of the module that trains through it (`TRAINS`). The runner itself
(`pipeline`) is not part of it: it passes a notebook its frozen parameters, which are hashed.

A notebook without the metadata reads every parameter and declares no paths: it is rerun whenever
any parameter or the code it runs changes.
"""

from __future__ import annotations

import ast
import datetime as dt
import functools
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from rlxf_utils.artifacts import RunDir, hash_path, sha256_file
from rlxf_utils.config import PROJECT_ROOT

__all__ = [
    "PACKAGE",
    "REGISTRY",
    "REWARD_PATHS",
    "STAGE_DIR",
    "TRAINS",
    "Import",
    "input_hashes",
    "StageSpec",
    "clear_record",
    "code_hash",
    "code_modules",
    "fingerprint",
    "hash_path",
    "module_graph",
    "notebook_imports",
    "package_imports",
    "package_modules",
    "read_record",
    "stage_spec",
    "up_to_date",
    "write_record",
]


STAGE_DIR = ".rlxf/stages"


ALL_PARAMS = ("*",)


#: What notebook 02 writes for RL (not `reward_model/uncertainty/`, notebook 04's cache).
REWARD_PATHS = (
    "reward_model/bundle.json",
    "reward_model/encoder",
    "reward_model/audit",
    "reward_model/tfidf",
)


@dataclass(frozen=True)
class StageSpec:
    """What a notebook reads (parameters, run-dir inputs) and writes (run-dir outputs)."""

    params: tuple[str, ...] = ALL_PARAMS
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()


def stage_spec(notebook: Path) -> StageSpec:
    """The notebook's `metadata.rlxf` declaration; a clear error naming a malformed one."""
    meta = json.loads(Path(notebook).read_text(encoding="utf-8")).get("metadata", {}).get("rlxf")
    if meta is None:
        return StageSpec()
    if not isinstance(meta, dict) or set(meta) - {"params", "inputs", "outputs"}:
        raise ValueError(
            f"{notebook}: metadata.rlxf must be an object with 'params', 'inputs', 'outputs' "
            f"(lists of strings); got {meta!r}"
        )
    out = {}
    for key in ("params", "inputs", "outputs"):
        value = meta.get(key, list(ALL_PARAMS) if key == "params" else [])
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise ValueError(f"{notebook}: metadata.rlxf.{key} must be a list of non-empty strings")
        out[key] = tuple(value)
    return StageSpec(**out)


def input_hashes(root: Path, paths: tuple[str, ...] | list[str]) -> dict[str, str | None]:
    """sha256 of each run-dir path (None where absent): what a reused result was computed from."""
    return {p: hash_path(Path(root) / p) for p in paths}


#: The package whose modules a notebook's fingerprint covers.
PACKAGE = PROJECT_ROOT / "rlxf_utils"

#: The algorithm registry: it names each trainer as a `"module:function"` string and imports none
#: (it sits below everything, and every stage imports it through `config`).
REGISTRY = "rlxf_utils.algorithms"
#: The modules that train through the registry (`algorithm(id).train(job)`): the trainers it names
#: are their edges, not the registry's, so a stage that only reads the registry does not run them.
TRAINS = ("rlxf_utils.rl.stage",)

#: A string that is a module path, optionally with a function: `rlxf_utils.rl.worker`,
#: `rlxf_utils.rl.ppo:run_ppo`.
_MODULE_PATH = re.compile(r"(rlxf_utils(?:\.\w+)*)(?::\w+)?")


class Import(NamedTuple):
    """One import of the package by itself."""

    importer: str
    #: the module imported (for `from pkg import name`, `pkg.name` where that is a module)
    target: str
    #: the name imported from `target` where it is not a module, else None
    name: str | None
    #: inside a function (or any block): not at the module's top level
    inside: bool


def package_modules(package: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file of every module of `package` (a package is its `__init__`)."""
    root = Path(package)
    return {
        ".".join(p.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__"): p
        for p in sorted(root.rglob("*.py"))
    }


def _imports_in(
    tree: ast.AST, module: str, is_package: bool, mods: dict[str, Path]
) -> list[Import]:
    """The imports of `mods` in `tree`, the source of `module` (relative ones resolved)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".") if is_package else module.split(".")[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            targets = [(f"{base}.{a.name}", None) if f"{base}.{a.name}" in mods else (base, a.name)
                       for a in node.names]  # fmt: skip
        else:
            continue
        for target, name in targets:
            if target.split(".")[0] == "rlxf_utils" and target != module:
                out.append(Import(module, target, name, node.col_offset > 0))
    return out


def _named_in(tree: ast.AST, mods: dict[str, Path]) -> set[str]:
    """The modules of `mods` that a string constant in `tree` names (`"rlxf_utils.rl.worker"`)."""
    named = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            m = _MODULE_PATH.fullmatch(node.value)
            if m and m.group(1) in mods:
                named.add(m.group(1))
    return named


@functools.lru_cache(maxsize=1024)
def _edges(
    module: str, source: str, is_package: bool, names: frozenset[str]
) -> tuple[tuple[Import, ...], frozenset[str]]:
    """(its imports, the modules it names) of `module`, whose text is `source` (cached on it:
    the runner fingerprints every notebook, and each reads the whole package)."""
    mods = dict.fromkeys(names, Path())
    tree = ast.parse(source, filename=module)
    return tuple(_imports_in(tree, module, is_package, mods)), frozenset(_named_in(tree, mods))


def _module_edges(package: Path) -> dict[str, tuple[tuple[Import, ...], frozenset[str]]]:
    mods = package_modules(package)
    names = frozenset(mods)
    return {mod: _edges(mod, path.read_text(encoding="utf-8"), path.name == "__init__.py", names)
            for mod, path in mods.items()}  # fmt: skip


def package_imports(package: Path = PACKAGE) -> list[Import]:
    """Every import of the package by itself, in module order (`tests/test_architecture.py` reads
    the package's shape from it)."""
    return [i for imports, _ in _module_edges(package).values() for i in imports]


def module_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the modules running it runs directly: what it imports (anywhere in it), what it
    names as a module path, and for `TRAINS` the registry's trainers."""
    graph: dict[str, set[str]] = {}
    registry: set[str] = set()
    for mod, (imports, named) in _module_edges(package).items():
        graph[mod] = {i.target for i in imports}
        if mod == REGISTRY:
            registry |= named - {mod}
        else:
            graph[mod] |= named - {mod}
    for mod in TRAINS:
        if mod in graph:
            graph[mod] |= registry
    return graph


def _cell_tree(source: str, notebook: Path) -> ast.AST:
    """A code cell's source parsed, its IPython lines (`%magic`, `!shell`) left out."""
    try:
        return ast.parse(source)
    except SyntaxError:
        pass
    kept = [ln for ln in source.splitlines() if not ln.lstrip().startswith(("%", "!"))]
    try:
        return ast.parse("\n".join(kept))
    except SyntaxError as exc:
        raise ValueError(f"{notebook}: a code cell does not parse ({exc}); its imports are "
                         "what its fingerprint covers") from None  # fmt: skip


def notebook_imports(notebook: Path, package: Path = PACKAGE) -> set[str]:
    """The package's modules `notebook`'s code cells import or name as a module path."""
    mods = package_modules(package)
    cells = json.loads(Path(notebook).read_text(encoding="utf-8")).get("cells", [])
    out: set[str] = set()
    for cell in cells:
        if cell.get("cell_type") != "code":
            continue
        source = cell.get("source", "")
        tree = _cell_tree("".join(source) if isinstance(source, list) else source, notebook)
        out |= {i.target for i in _imports_in(tree, "__notebook__", False, mods)} & set(mods)
        out |= _named_in(tree, mods)
    return out


#: The report's words: a notebook shows sentences from these, but no stage writes with them
#: (stages import nothing of the report), so they are in no code fingerprint: mending a sentence
#: reruns no notebook, only `rlxf report`.
REPORT = "rlxf_utils.report"


def _is_report(mod: str) -> bool:
    return mod == REPORT or mod.startswith(REPORT + ".")


def code_modules(notebook: Path, package: Path = PACKAGE) -> tuple[str, ...]:
    """The package's modules `notebook` runs, sorted: what its code cells import, transitively
    (`module_graph`), and every package whose `__init__` importing them executes; the report's
    modules (`REPORT`) and what only they import are left out: they word what a stage computed."""
    graph = module_graph(package)
    seen: set[str] = set()
    todo = sorted(notebook_imports(notebook, package))
    while todo:
        mod = todo.pop()
        if mod in seen or mod not in graph or _is_report(mod):
            continue
        seen.add(mod)
        parents = [".".join(mod.split(".")[:i]) for i in range(1, mod.count(".") + 1)]
        todo += [m for m in (*graph[mod], *parents) if m not in seen]
    return tuple(sorted(seen))


def code_hash(notebook: Path, package: Path = PACKAGE) -> dict[str, str]:
    """File (relative to the checkout) -> sha256 of every module `notebook` runs."""
    mods = package_modules(package)
    root = Path(package).parent
    return {mods[m].relative_to(root).as_posix(): sha256_file(mods[m])
            for m in code_modules(notebook, package)}  # fmt: skip


def _params(resolved: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    if keys == ALL_PARAMS:
        return resolved
    out: dict[str, Any] = {}
    for key in keys:
        node: Any = resolved
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                raise KeyError(f"metadata.rlxf.params names {key!r}, which the parameters lack")
            node = node[part]
        out[key] = node
    return out


def fingerprint(
    notebook: Path, cfg: Any, run: RunDir, spec: StageSpec, package: Path = PACKAGE
) -> tuple[str, dict[str, Any]]:
    """(sha256 digest, the parts it hashes) of everything `notebook` depends on."""

    params = _params(cfg.resolved(), spec.params)
    reads_data = spec.params == ALL_PARAMS or any(
        k == "data" or k.startswith("data.") for k in spec.params
    )
    parts = {
        "notebook": sha256_file(Path(notebook)),
        "code": code_hash(notebook, package),
        "params": params,
        "data_sha256": sha256_file(cfg.data.path) if reads_data else None,
        "inputs": {p: hash_path(run.path(p)) for p in spec.inputs},
    }
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest(), parts


def _record_rel(stem: str) -> str:
    return f"{STAGE_DIR}/{stem}.json"


def read_record(run: RunDir, stem: str) -> dict[str, Any] | None:
    """The completion record of a notebook, or None (absent or unreadable: not complete)."""
    if not run.exists(_record_rel(stem)):
        return None
    try:
        return json.loads(run.path(_record_rel(stem)).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def clear_record(run: RunDir, stem: str) -> None:
    """Forget a notebook's completion (called before it runs)."""
    run.path(_record_rel(stem)).unlink(missing_ok=True)


def write_record(
    run: RunDir, stem: str, digest: str, parts: dict[str, Any], spec: StageSpec, seconds: float
) -> Path:
    """Write the completion record, with the outputs' hashes, as the notebook's last act."""
    return run.write_json(
        _record_rel(stem),
        {
            "notebook": stem,
            "fingerprint": digest,
            "parts": parts,
            "outputs": {p: hash_path(run.path(p)) for p in spec.outputs},
            "ended": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "seconds": round(seconds, 1),
        },
    )


def _changed(old: dict[str, Any], new: dict[str, Any]) -> str:
    """Which parts of a fingerprint differ, e.g. 'parameters rl' or 'input reward_model/encoder'."""
    out = []
    for key, label in (("notebook", "the notebook"), ("data_sha256", "the data file")):
        if old.get(key) != new.get(key):
            out.append(label)
    a, b = old.get("code"), new.get("code")
    if a != b:
        if isinstance(a, dict) and isinstance(b, dict):
            files = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
            more = f" and {len(files) - 3} more" if len(files) > 3 else ""
            out.append(f"code {', '.join(files[:3])}{more}")
        else:
            out.append("the package code")
    for key, label in (("params", "parameters"), ("inputs", "input")):
        a, b = old.get(key) or {}, new.get(key) or {}
        diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        if diff:
            out.append(f"{label} {', '.join(diff)}")
    return "; ".join(out) or "its fingerprint"


def up_to_date(
    run: RunDir, stem: str, digest: str, spec: StageSpec, parts: dict[str, Any] | None = None
) -> tuple[bool, str, dict | None]:
    """(up to date?, why not / from when, the record). Outputs must hash as they did at the end."""
    rec = read_record(run, stem)
    if rec is None:
        return False, "no completion record", None
    if rec.get("fingerprint") != digest:
        return False, f"changed: {_changed(rec.get('parts', {}), parts or {})}", rec
    if not run.exists(f"notebooks/{stem}.ipynb"):
        return False, "its executed copy is missing", rec
    recorded = rec.get("outputs", {})
    for p in spec.outputs:
        if recorded.get(p) != hash_path(run.path(p)):
            return False, f"its output {p} changed or is missing", rec
    return True, f"from the run that ended {rec.get('ended')}", rec
