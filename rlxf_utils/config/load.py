"""Reading a parameters file: profiles that extend another, relative paths, overrides, and
validation errors that name the file, the key and what was expected."""

from __future__ import annotations

import csv
import io
import reprlib
import stat
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from rlxf_utils.config.base import ConfigError
from rlxf_utils.config.study import StudyConfig


def _loc(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc)


#: A bad value is quoted this long at most: enough to recognise it, never the whole of it.
EXCERPT_CHARS = 80
_SHORT = reprlib.Repr()
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlist, _SHORT.maxdict, _SHORT.maxlevel = 60, 60, 6, 4, 3


def excerpt(value: Any) -> str:
    """A short repr of `value` (at most `EXCERPT_CHARS`; nested containers cut), for messages."""
    text = _SHORT.repr(value)
    return text if len(text) <= EXCERPT_CHARS else text[: EXCERPT_CHARS - 3] + "..."


def _format_errors(path: Path, err: ValidationError, model: type[BaseModel]) -> str:
    lines = [f"{path}: invalid parameters ({err.error_count()} problem(s))"]
    for e in err.errors():
        key = _loc(e["loc"]) or "<top level>"
        if e["type"] == "extra_forbidden":
            parent = _model_at(model, e["loc"][:-1])
            allowed = ", ".join(_public_keys(parent)) if parent else "?"
            lines.append(f"  - key '{key}': unknown key; expected one of: {allowed}")
        elif e["type"] == "missing":
            lines.append(f"  - key '{key}': required but missing")
        else:
            got = e.get("input")
            got_s = "" if isinstance(got, dict) else f" (got {excerpt(got)})"
            lines.append(f"  - key '{key}': {e['msg']}{got_s}")
    return "\n".join(lines)


def _public_keys(model: type[BaseModel]) -> list[str]:
    """The keys a parameters file may set in `model`'s section (not the internal `source`)."""
    return sorted(name for name, f in model.model_fields.items() if not f.exclude)


def _model_at(model: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The section class found by walking `loc` from `model` (for listing allowed keys)."""
    current: Any = model
    for part in loc:
        field = current.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return None
        ann = field.annotation
        candidates = [ann, *getattr(ann, "__args__", ())]
        current = next(
            (c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None
        )
        if current is None:
            return None
    return current


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> StudyConfig:
    """Read and validate a parameters file; relative data paths resolve against the file's folder.

    `overrides` is a nested dict merged over the YAML (used by tests and the CLI).
    """
    path = Path(path)
    raw = _read_profile(path)
    if overrides:
        raw = _deep_merge(raw, overrides)
    try:
        cfg = StudyConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_format_errors(path, err, StudyConfig)) from None
    for (section, key), expected in PATH_KEYS.items():
        block = getattr(cfg, section)
        if getattr(block, key) is not None:  # compute.accelerate_config is optional
            setattr(
                block, key, _resolve_file(path, f"{section}.{key}", getattr(block, key), expected)
            )
    cfg.source = path.resolve()
    return cfg


def _read_profile(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A parameters file as a dict; `extends: other.yaml` (relative to the file) is read first and
    this file's keys are merged over it, section by section (a profile lists only its changes)."""
    problem = file_problem(path)
    if problem:
        raise ConfigError(f"{path}: {problem}; expected a YAML parameters file")
    if path.resolve() in seen:
        chain = " -> ".join(str(p) for p in (*seen, path.resolve()))
        raise ConfigError(f"{path}: 'extends' loops back on itself ({chain})")
    raw = read_yaml(path, "a YAML parameters file such as params/default.yaml")
    if raw is None:
        raise ConfigError(f"{path}: the file is empty; expected a mapping with 'run' and 'data'")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(raw).__name__}")
    if seen:  # a parent's own relative paths are read from its folder, not the child's
        _anchor_paths(raw, path)
    parent = raw.pop("extends", None)
    if parent is None:
        return raw
    if not isinstance(parent, str):
        raise ConfigError(
            f"{path}: key 'extends': expected a parameters file name, got {excerpt(parent)}"
        )
    base_path = (path.resolve().parent / parent).resolve()
    problem = file_problem(base_path)
    if problem:
        raise ConfigError(f"{path}: key 'extends': {problem} at {base_path}")
    return _deep_merge(_read_profile(base_path, (*seen, path.resolve())), raw)


def file_problem(path: Path) -> str | None:
    """Why `path` cannot be read as a file ('file not found', 'a folder, not a file', ...), or
    None when it is a regular file."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return "file not found"
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    if stat.S_ISDIR(mode):
        return "a folder, not a file"
    if not stat.S_ISREG(mode):
        return "not a regular file (a FIFO, socket or device)"
    return None


class _Refused(yaml.YAMLError):
    """YAML that a parameters file may not use; the message says where and why."""


class StrictLoader(yaml.SafeLoader):
    """YAML's safe subset without what lets a file mean something other than it reads: no
    aliases (a few lines of them expand into gigabytes) and no key twice in one mapping (YAML
    keeps the last and drops the first without a word)."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise _Refused(
                f"line {event.start_mark.line + 1}: alias *{event.anchor}: anchors and aliases "
                "are not read in this file; write the value out where it is used"
            )
        return super().compose_node(parent, index)

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        lines: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, str | int | float | bool) and key in lines:
                raise _Refused(
                    f"key {excerpt(key)} appears twice in one mapping (lines {lines[key]} and "
                    f"{line}); YAML would keep only the second: write it once"
                )
            lines[key] = line
        return super().construct_mapping(node, deep)


def read_yaml(path: Path, expected: str) -> Any:
    """`path` read with `StrictLoader`, or a `ConfigError` naming the file, the problem and
    `expected` (what the file should be)."""
    try:
        return yaml.load(path.read_text(encoding="utf-8"), Loader=StrictLoader)
    except _Refused as exc:
        raise ConfigError(f"{path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: not a text file (byte {exc.start} is not UTF-8); expected {expected}"
        ) from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be read ({exc.strerror or exc})") from None


#: Keys (section, field) that name files, relative to the parameters file that sets them, and
#: what each file must be.
PATH_KEYS = {
    ("data", "path"): "a MONA file (CSV or .xlsx)",
    ("risk", "regions_path"): "a CSV with columns country,region",
    ("compute", "accelerate_config"): "an accelerate config file (params/accelerate/)",
}


def _anchor_paths(raw: dict[str, Any], path: Path) -> None:
    """Make the relative file paths `raw` sets absolute against `path`'s folder (in place)."""
    for section, key in PATH_KEYS:
        block = raw.get(section)
        value = block.get(key) if isinstance(block, dict) else None
        if isinstance(value, str) and not Path(value).is_absolute():
            block[key] = str((path.resolve().parent / value).resolve())


def _resolve_file(params: Path, key: str, value: Path, expected: str) -> Path:
    """A file named in the parameters, relative to the parameters file's folder; it must be a
    readable file, and what `CONTENT_CHECKS` asks of it."""
    target = value if value.is_absolute() else (params.resolve().parent / value).resolve()
    problem = file_problem(target)
    if problem is None and key in CONTENT_CHECKS:
        problem = CONTENT_CHECKS[key](target)
    if problem:
        raise ConfigError(
            f"{params}: key '{key}': {problem} at {target}; expected {expected} "
            "(relative paths are read from the folder of the parameters file that sets them)"
        )
    return target


def _regions_problem(path: Path) -> str | None:
    """What keeps `path` from being the regions CSV (columns country and region, every row with
    a region), or None."""
    try:
        rows = list(csv.DictReader(io.StringIO(path.read_text(encoding="utf-8-sig"))))
    except (UnicodeDecodeError, csv.Error, OSError) as exc:
        return f"not a readable CSV ({type(exc).__name__})"
    if not rows:
        return "no rows under a header"
    missing = [c for c in ("country", "region") if c not in rows[0]]
    if missing:
        return f"no column(s) {missing} (found {excerpt(list(rows[0]))})"
    empty = [i + 2 for i, r in enumerate(rows) if not (r.get("region") or "").strip()]
    return f"empty 'region' on line(s) {empty[:5]}" if empty else None


def _accelerate_problem(path: Path) -> str | None:
    """What keeps `path` from being an accelerate config (a YAML mapping), or None."""
    try:
        raw = read_yaml(path, "an accelerate config file")
    except ConfigError as exc:
        return " ".join(str(exc).removeprefix(f"{path}: ").split())
    return None if isinstance(raw, dict) else f"a YAML {type(raw).__name__}, not a mapping"


#: What a file named in the parameters must hold, read before any work (the data file has its
#: own, fuller check: `data.checks`, run by `rlxf run` before any kernel).
CONTENT_CHECKS = {
    "risk.regions_path": _regions_problem,
    "compute.accelerate_config": _accelerate_problem,
}


def _deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out
