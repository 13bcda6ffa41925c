"""What every parameter section shares: the project root, the error a bad file raises, and the
base model (unknown keys are errors, values are checked on assignment)."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict

PROJECT_ROOT = (
    Path(__file__).resolve().parents[2]
)  # the checkout: rlxf_utils/config/base.py -> ../../


def portable_path(path: str | Path) -> str:
    """`path` as an artifact records it: relative to the checkout when it lies inside it
    ('data/raw/MONA_From2002.csv'), else as given. Artifacts then read the same from whatever
    folder the study is cloned into, and the hashes taken over them do not change with it."""
    p = Path(path)
    try:
        return p.resolve().relative_to(PROJECT_ROOT).as_posix()
    except ValueError:
        return str(path)


class ConfigError(ValueError):
    """A parameters file that cannot be used; the message names the file, the key and the fix."""


class Section(BaseModel):
    """Base of every parameter section: unknown keys are errors, values are checked on assignment."""

    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, frozen=False, use_attribute_docstrings=True
    )
