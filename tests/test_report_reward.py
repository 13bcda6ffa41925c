"""The reward section's words, once: every sentence macro of `reports/templates/reward.jinja`, rendered
from the contexts `rlxf_utils/report/reward.py` built for a set of runs that take each branch, must
reproduce the golden file.

The fixture (`tests/golden/report/reward_contexts.json`) holds, per case, each macro's name and
the context it was called with (numbers, verdict codes, ids and labels): recorded from the smoke
run's artifacts and variants of them that choose other words. After a deliberate change of the
template or the vocabulary, rewrite the golden text (and review its diff):
`PYTHONPATH=. python tests/test_report_reward.py`."""

from __future__ import annotations

import json
from pathlib import Path

from rlxf_utils.report.wording import sentence

GOLDEN = Path(__file__).resolve().parent / "golden" / "report"
FIXTURE = GOLDEN / "reward_contexts.json"
TEXT = GOLDEN / "reward.md"


def _rendered() -> str:
    """Each recorded call rendered under its case's heading."""
    parts, case = [], None
    for call in json.loads(FIXTURE.read_text(encoding="utf-8")):
        if call["case"] != case:
            case = call["case"]
            parts.append(f"## {case}")
        parts.append(f"{call['macro']}: {sentence('reward', call['macro'], *call['args'])}")
    return "\n\n".join(parts) + "\n"


def test_the_reward_section_renders_its_golden_text() -> None:
    assert _rendered() == TEXT.read_text(encoding="utf-8")


if __name__ == "__main__":  # rewrite the golden text
    TEXT.write_text(_rendered(), encoding="utf-8")
    print(f"wrote {TEXT}")
