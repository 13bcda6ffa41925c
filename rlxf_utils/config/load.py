"""Reading a parameters file: profiles that extend another, relative paths, overrides, and
validation errors that name the file, the key and what was expected."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from rlxf_utils.config.base import ConfigError
from rlxf_utils.config.study import StudyConfig


def _loc(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc)


def _format_errors(path: Path, err: ValidationError, model: type[BaseModel]) -> str:
    lines = [f"{path}: invalid parameters ({err.error_count()} problem(s))"]
    for e in err.errors():
        key = _loc(e["loc"]) or "<top level>"
        if e["type"] == "extra_forbidden":
            parent = _model_at(model, e["loc"][:-1])
            allowed = ", ".join(sorted(parent.model_fields)) if parent else "?"
            lines.append(f"  - key '{key}': unknown key; expected one of: {allowed}")
        elif e["type"] == "missing":
            lines.append(f"  - key '{key}': required but missing")
        else:
            got = e.get("input")
            got_s = "" if isinstance(got, dict) else f" (got {got!r})"
            lines.append(f"  - key '{key}': {e['msg']}{got_s}")
    return "\n".join(lines)


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
    if not path.is_file():
        raise ConfigError(f"{path}: parameters file not found")
    if path.resolve() in seen:
        chain = " -> ".join(str(p) for p in (*seen, path.resolve()))
        raise ConfigError(f"{path}: 'extends' loops back on itself ({chain})")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: not a text file (byte {exc.start} is not UTF-8); expected a YAML parameters "
            "file such as params/default.yaml"
        ) from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be read ({exc.strerror or exc})") from None
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
        raise ConfigError(f"{path}: key 'extends': expected a parameters file name, got {parent!r}")
    base_path = (path.resolve().parent / parent).resolve()
    if not base_path.is_file():
        raise ConfigError(f"{path}: key 'extends': file not found at {base_path}")
    return _deep_merge(_read_profile(base_path, (*seen, path.resolve())), raw)


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
    """A file named in the parameters, relative to the parameters file's folder; it must exist."""
    target = value if value.is_absolute() else (params.resolve().parent / value).resolve()
    if not target.is_file():
        raise ConfigError(
            f"{params}: key '{key}': file not found at {target}; expected {expected} "
            "(relative paths are read from the folder of the parameters file that sets them)"
        )
    return target


def _deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out
