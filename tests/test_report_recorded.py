"""The reward and ILHF sections' words, once: every sentence macro of
`reports/templates/{reward,ilhf}.jinja`, rendered from the contexts `rlxf_utils/report/reward.py`
and `ilhf.py` built for a set of runs that take each branch, must reproduce the golden file.

Each fixture (`tests/golden/report/<section>_contexts.json`) holds, per case, each macro's name
and the context it was called with (numbers, verdict codes, ids and labels): recorded from the
smoke run's artifacts and variants of them that choose other words. After a deliberate change of
a template or the vocabulary, rewrite the golden texts (and review their diff):
`PYTHONPATH=. python tests/test_report_recorded.py`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlxf_utils.report.wording import sentence

GOLDEN = Path(__file__).resolve().parent / "golden" / "report"
SECTIONS = ("reward", "ilhf")


def _rendered(section: str) -> str:
    """Each recorded call of `section` rendered under its case's heading."""
    parts, case = [], None
    fixture = GOLDEN / f"{section}_contexts.json"
    for call in json.loads(fixture.read_text(encoding="utf-8")):
        if call["case"] != case:
            case = call["case"]
            parts.append(f"## {case}")
        parts.append(f"{call['macro']}: {sentence(section, call['macro'], *call['args'])}")
    return "\n\n".join(parts) + "\n"


@pytest.mark.parametrize("section", SECTIONS)
def test_the_section_renders_its_golden_text(section: str) -> None:
    assert _rendered(section) == (GOLDEN / f"{section}.md").read_text(encoding="utf-8")


if __name__ == "__main__":  # rewrite the golden texts
    for name in SECTIONS:
        (GOLDEN / f"{name}.md").write_text(_rendered(name), encoding="utf-8")
        print(f"wrote {GOLDEN / name}.md")
