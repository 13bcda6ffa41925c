"""The run directory: the only hand-off between notebooks, written atomically in one layout.

Every write goes to a temporary file in the same folder and is renamed into place, so an
interrupted run never leaves a half-written artifact that a later stage would read.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from rlxf_utils.markdown import markdown_table
from rlxf_utils.names import relabel_figure

__all__ = [
    "ArtifactMissing",
    "NotARun",
    "RunDir",
    "atomic_dir",
    "atomic_path",
    "parse_jsonl",
    "read_manifest",
    "sha256_file",
    "to_jsonable",
    "write_json",
    "write_jsonl",
    "write_text",
]


_UMASK = os.umask(0)
os.umask(_UMASK)


class ArtifactMissing(FileNotFoundError):
    """An artifact an earlier stage should have written is absent; the message names it."""


class NotARun(ValueError):
    """A folder that is not a run `rlxf run` wrote, or not one far enough along; the message
    names the folder or file and what was expected."""


#: The run's frozen parameters, beside its manifest: every notebook and stage reads this copy.
FROZEN_PARAMS = "params.yaml"
#: What every manifest `rlxf run` writes holds, and what the report and `rlxf seeds` read.
MANIFEST_FIELDS = ("params.run.title", "params.run.authors", "params.run.wp_number",
                   "data.sha256", "environment.packages", "notebooks")  # fmt: skip


def _lacks(record: dict[str, Any], dotted: str) -> bool:
    value: Any = record
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return True
        value = value[part]
    return False


def read_manifest(run_dir: str | Path) -> dict[str, Any]:
    """`<run_dir>/manifest.json` when it is the record `rlxf run` writes, else `NotARun` saying
    what was found instead. Reads only: nothing is created, even when the folder is missing."""
    root = Path(run_dir)
    expected = "a run folder that `rlxf run` wrote (runs/<run.name>/ with manifest.json)"
    path = root / "manifest.json"
    if not root.is_dir():
        raise NotARun(
            f"{root}: {'not a folder' if root.exists() else 'no such folder'}; expected {expected}"
        )
    if not path.is_file():
        raise NotARun(f"{root}: no manifest.json; expected {expected}")
    record_of = "expected the JSON object `rlxf run` writes there; rerun it, or move the file aside"
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as exc:
        raise NotARun(f"{path}: unreadable ({exc}); {record_of}") from None
    if not isinstance(record, dict):
        raise NotARun(f"{path}: a JSON {type(record).__name__}; {record_of}")
    missing = [f for f in MANIFEST_FIELDS if _lacks(record, f)]
    if missing:
        raise NotARun(f"{path}: lacks {', '.join(missing)}; {record_of}")
    return record


@contextlib.contextmanager
def atomic_path(target: str | Path, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path beside `target`; rename it onto `target` only if the block succeeds."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(
        prefix=f".{target.name}.", suffix=suffix or ".tmp", dir=target.parent
    )
    os.close(fd)
    tmp_path = Path(tmp)
    os.chmod(tmp_path, 0o666 & ~_UMASK)  # mkstemp makes 0600; artifacts are meant to be shared
    try:
        yield tmp_path
        os.replace(tmp_path, target)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def to_jsonable(obj: Any) -> Any:
    """Convert numpy/pandas/Path values to plain JSON types; NaN becomes null."""
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple | set):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return to_jsonable(obj.tolist())
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating | float):
        f = float(obj)
        return None if math.isnan(f) or math.isinf(f) else f
    if isinstance(obj, np.bool_):
        return bool(obj)
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, pd.Timestamp):
        return obj.isoformat()
    if obj is pd.NA or obj is pd.NaT:
        return None
    return obj


def write_text(target: str | Path, text: str) -> Path:
    """`text` (UTF-8) written atomically to `target`."""
    target = Path(target)
    with atomic_path(target) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return target


def write_json(target: str | Path, obj: Any) -> Path:
    """`obj` as indented JSON (numpy and pandas values made plain, NaN as null), atomically."""
    return write_text(target, json.dumps(to_jsonable(obj), indent=2) + "\n")


def write_jsonl(
    target: str | Path, rows: Iterable[dict[str, Any]], ensure_ascii: bool = False
) -> Path:
    """One JSON object per line, atomically (`ensure_ascii`: escape non-ASCII characters)."""
    lines = [json.dumps(to_jsonable(r), ensure_ascii=ensure_ascii) for r in rows]
    return write_text(target, "".join(line + "\n" for line in lines))


def parse_jsonl(text: str) -> list[Any]:
    """`write_jsonl`'s text back as its rows. Split at "\n" only: str.splitlines also breaks at
    U+2028, U+0085 and the like, which JSON strings hold unescaped (a sampled response did)."""
    return [json.loads(line) for line in text.split("\n") if line.strip()]


class RunDir:
    """One run's folder (`runs/<name>/`): typed read/write helpers with atomic writes.

    Layout: `data/` (parquet, json), `figures/` (png), `tables/` (csv + md), stage folders such
    as `reward_model/` and `policy/<algo>/`, `notebooks/` (executed copies), `manifest.json`.
    """

    def __init__(self, root: str | Path):
        # absolute once, here: a kernel or a launched stage that runs in another folder reads
        # the same paths (`..` is folded, links are kept)
        self.root = Path(os.path.abspath(root))
        self.root.mkdir(parents=True, exist_ok=True)

    def __repr__(self) -> str:
        return f"RunDir({str(self.root)!r})"

    def path(self, rel: str | Path) -> Path:
        """Absolute path of `rel` inside the run dir (parents created)."""
        p = self.root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def require(self, rel: str | Path, stage: str | None = None) -> Path:
        """Path of an artifact that must exist; a clear error names it and the stage that writes it."""
        p = self.root / rel
        if not p.exists():
            hint = f" (written by {stage}; run that stage first)" if stage else ""
            raise ArtifactMissing(f"missing artifact {p}{hint}")
        return p

    def exists(self, rel: str | Path) -> bool:
        return (self.root / rel).exists()

    # -- writers ---------------------------------------------------------------------------
    def write_text(self, rel: str | Path, text: str) -> Path:
        return write_text(self.path(rel), text)

    def write_json(self, rel: str | Path, obj: Any) -> Path:
        return write_json(self.path(rel), obj)

    def write_jsonl(self, rel: str | Path, rows: Iterable[dict[str, Any]]) -> Path:
        return write_jsonl(self.path(rel), rows)

    def write_parquet(self, rel: str | Path, df: pd.DataFrame) -> Path:
        target = self.path(rel)
        with atomic_path(target, ".parquet") as tmp:
            df.to_parquet(tmp, index=False)
        return target

    def write_table(
        self, name: str, df: pd.DataFrame, floatfmt: str = ".3f", index: bool = False
    ) -> Path:
        """Write `tables/<name>.csv` (text cells `spreadsheet_safe`) and a markdown twin
        `tables/<name>.md` for the report."""
        csv_target = self.path(f"tables/{name}.csv")
        with atomic_path(csv_target, ".csv") as tmp:
            spreadsheet_safe(df).to_csv(tmp, index=index)
        self.write_text(f"tables/{name}.md", markdown_table(df, floatfmt=floatfmt, index=index))
        return csv_target

    def write_figure(self, name: str, fig: Any, dpi: int = 150) -> Path:
        """Save a matplotlib figure as `figures/<name>.png`, its texts in display names
        (`names.relabel_figure`: the ids stay in the data, the reader sees the names)."""
        target = self.path(f"figures/{name}.png")
        relabel_figure(fig)
        with atomic_path(target, ".png") as tmp:
            fig.savefig(tmp, dpi=dpi, bbox_inches="tight", format="png")
        return target

    # -- readers ---------------------------------------------------------------------------
    def read_json(self, rel: str | Path, stage: str | None = None) -> Any:
        return json.loads(self.require(rel, stage).read_text(encoding="utf-8"))

    def read_jsonl(self, rel: str | Path, stage: str | None = None) -> list[dict[str, Any]]:
        return parse_jsonl(self.require(rel, stage).read_text(encoding="utf-8"))

    def read_parquet(self, rel: str | Path, stage: str | None = None) -> pd.DataFrame:
        return pd.read_parquet(self.require(rel, stage))

    def read_table(self, name: str, stage: str | None = None) -> pd.DataFrame:
        """A table `write_table` wrote, its text cells as they were before `spreadsheet_safe`."""
        return _map_text(pd.read_csv(self.require(f"tables/{name}.csv", stage)), _unquote)


#: A text cell a spreadsheet would run as a formula (=, +, -, @, tab, carriage return first),
#: after any quotes `spreadsheet_safe` put before it.
_FORMULA = re.compile(r"'*[=+\-@\t\r]")
#: A number written as text ('-0.5', '+3e-4'): a spreadsheet reads it as that number.
_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def _quote(v: Any) -> Any:
    if isinstance(v, str) and _FORMULA.match(v) and not _NUMBER.fullmatch(v):
        return "'" + v
    return v


def _unquote(v: Any) -> Any:
    if (
        isinstance(v, str)
        and v.startswith("'")
        and _FORMULA.match(v[1:])
        and not _NUMBER.fullmatch(v[1:])
    ):
        return v[1:]
    return v


def _map_text(df: pd.DataFrame, change: Callable[[Any], Any]) -> pd.DataFrame:
    """`df` with `change` applied to every cell of its text columns (a copy when any)."""
    text = [
        i
        for i, t in enumerate(df.dtypes)
        if pd.api.types.is_object_dtype(t) or isinstance(t, pd.StringDtype)
    ]
    if not text:
        return df
    out = df.copy()
    for i in text:
        out.isetitem(i, out.iloc[:, i].map(change))
    return out


def spreadsheet_safe(df: pd.DataFrame) -> pd.DataFrame:
    """`df` with every text cell that a spreadsheet would run as a formula (`=HYPERLINK(...)`,
    `+cmd`, `@SUM`, `-2+3`) quoted with a leading `'`, which spreadsheets show as text; numbers,
    and text that is just a number, are left as they are. `RunDir.read_table` removes the quote."""
    return _map_text(df, _quote)


def atomic_dir(target: Path, write: Callable[[Path], Any]) -> None:
    """Fill a temporary folder with `write`, then swap it into `target` (never half-written)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        write(tmp)
        if target.exists():
            old = target.with_name(f".{target.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def sha256_file(path: str | Path) -> str:
    """sha256 of a file's bytes (read in 1 MiB chunks), as hex."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def hash_path(path: Path) -> str | None:
    """sha256 of a file, or of a folder's files (sorted relative paths and contents); None if absent."""
    path = Path(path)
    if path.is_file():
        return sha256_file(path)
    if not path.is_dir():
        return None
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(f.relative_to(path).as_posix().encode() + b"\0")
        h.update(bytes.fromhex(sha256_file(f)))
    return h.hexdigest()
