"""The run directory: the only hand-off between notebooks, written atomically in one layout.

Every write goes to a temporary file in the same folder and is renamed into place, so an
interrupted run never leaves a half-written artifact that a later stage would read.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

__all__ = ["ArtifactMissing", "RunDir", "atomic_path", "to_jsonable"]


_UMASK = os.umask(0)
os.umask(_UMASK)


class ArtifactMissing(FileNotFoundError):
    """An artifact an earlier stage should have written is absent; the message names it."""


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


class RunDir:
    """One run's folder (`runs/<name>/`): typed read/write helpers with atomic writes.

    Layout: `data/` (parquet, json), `figures/` (png), `tables/` (csv + md), stage folders such
    as `reward_model/` and `policy/<algo>/`, `notebooks/` (executed copies), `manifest.json`.
    """

    def __init__(self, root: str | Path):
        self.root = Path(root)
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
        target = self.path(rel)
        with atomic_path(target) as tmp:
            tmp.write_text(text, encoding="utf-8")
        return target

    def write_json(self, rel: str | Path, obj: Any) -> Path:
        return self.write_text(rel, json.dumps(to_jsonable(obj), indent=2, sort_keys=False) + "\n")

    def write_jsonl(self, rel: str | Path, rows: Iterable[dict[str, Any]]) -> Path:
        lines = [json.dumps(to_jsonable(r), ensure_ascii=False) for r in rows]
        return self.write_text(rel, "\n".join(lines) + ("\n" if lines else ""))

    def write_parquet(self, rel: str | Path, df: pd.DataFrame) -> Path:
        target = self.path(rel)
        with atomic_path(target, ".parquet") as tmp:
            df.to_parquet(tmp, index=False)
        return target

    def write_table(
        self, name: str, df: pd.DataFrame, floatfmt: str = ".3f", index: bool = False
    ) -> Path:
        """Write `tables/<name>.csv` and a markdown twin `tables/<name>.md` for the report."""
        csv_target = self.path(f"tables/{name}.csv")
        with atomic_path(csv_target, ".csv") as tmp:
            df.to_csv(tmp, index=index)
        self.write_text(f"tables/{name}.md", markdown_table(df, floatfmt=floatfmt, index=index))
        return csv_target

    def write_figure(self, name: str, fig: Any, dpi: int = 150) -> Path:
        """Save a matplotlib figure as `figures/<name>.png`."""
        target = self.path(f"figures/{name}.png")
        with atomic_path(target, ".png") as tmp:
            fig.savefig(tmp, dpi=dpi, bbox_inches="tight", format="png")
        return target

    # -- readers ---------------------------------------------------------------------------
    def read_json(self, rel: str | Path, stage: str | None = None) -> Any:
        return json.loads(self.require(rel, stage).read_text(encoding="utf-8"))

    def read_jsonl(self, rel: str | Path, stage: str | None = None) -> list[dict[str, Any]]:
        text = self.require(rel, stage).read_text(encoding="utf-8")
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def read_parquet(self, rel: str | Path, stage: str | None = None) -> pd.DataFrame:
        return pd.read_parquet(self.require(rel, stage))

    def read_table(self, name: str, stage: str | None = None) -> pd.DataFrame:
        return pd.read_csv(self.require(f"tables/{name}.csv", stage))


def is_present(x: Any) -> bool:
    """Not None and not a float NaN (a value a sentence can quote)."""
    return x is not None and not (isinstance(x, float) and math.isnan(x))


def fmt_num(x: Any, digits: int = 3) -> str:
    """A number for prose: fixed `digits`, or 'n/a' when missing."""
    return f"{x:.{digits}f}" if is_present(x) else "n/a"


def fmt_pct(x: Any, digits: int = 1) -> str:
    """A share as a percentage for prose, or 'n/a' when missing."""
    return f"{100 * x:.{digits}f}%" if is_present(x) else "n/a"


def fmt_p(p: Any) -> str:
    """A p-value for prose: 'p = 0.013', 'p < 0.001', or 'p n/a' when missing."""
    if not is_present(p):
        return "p n/a"
    return "p < 0.001" if p < 0.001 else f"p = {p:.3f}"


def listing(items: Sequence[str]) -> str:
    """'a', 'a and b', 'a, b and c' for prose ('nothing' when empty)."""
    items = list(items)
    if not items:
        return "nothing"
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _fmt_cell(v: Any, floatfmt: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)) or v is pd.NA:
        return ""
    if isinstance(v, float | np.floating):
        return format(float(v), floatfmt)
    return str(v).replace("|", "\\|").replace("\n", " ")


def markdown_table(df: pd.DataFrame, floatfmt: str = ".3f", index: bool = False) -> str:
    """A pipe table (pandoc and Quarto read it) without the optional `tabulate` dependency."""
    if index:
        df = df.reset_index()
    cols = [str(c) for c in df.columns]
    numeric = [pd.api.types.is_numeric_dtype(df[c]) for c in df.columns]
    header = "| " + " | ".join(c.replace("|", "\\|") for c in cols) + " |"
    # Dash counts set pandoc's relative column widths when cells wrap: a short column gets its
    # longest cell plus a margin (so numbers and labels never break), a wordy one at most 44.
    longest = [max([len(_fmt_cell(v, floatfmt)) for v in df[col].head(200)] or [0]) for col in df]
    widths = [4 + max(3, len(c), min(40, n)) for c, n in zip(cols, longest, strict=True)]
    align = (
        "|"
        + "|".join(
            ("-" * w + ":") if n else (":" + "-" * w) for n, w in zip(numeric, widths, strict=True)
        )
        + "|"
    )
    rows = [
        "| " + " | ".join(_fmt_cell(v, floatfmt) for v in rec) + " |"
        for rec in df.itertuples(index=False, name=None)
    ]
    return "\n".join([header, align, *rows]) + "\n"
