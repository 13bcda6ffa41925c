"""The forensic section's words, once: its verdict and notes rendered from the author's template
(`reports/templates/forensic.jinja`) must reproduce the golden file.

The fixture (`tests/golden/report/forensic_cases.json`) holds a smoke run's
`reward/forensic.parquet` rows (the interval columns) and hand-built tables that take each
conclusion (only forbidden inputs reach the claim, allowed ones do, nothing does, the allowed
ones are not shown to fall short), with the encoder variants the note names. After a deliberate
change of the template or the vocabulary, rewrite the golden text (and review its diff):
`PYTHONPATH=. python tests/test_report_forensic.py`."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from rlxf_utils.report.forensic import forensic_verdict
from rlxf_utils.report.wording import sentence

GOLDEN = Path(__file__).resolve().parent / "golden" / "report"
FIXTURE = GOLDEN / "forensic_cases.json"
TEXT = GOLDEN / "forensic.md"


def _rendered() -> str:
    parts = []
    for case, c in json.loads(FIXTURE.read_text(encoding="utf-8")).items():
        verdict = forensic_verdict(pd.DataFrame(c["rows"]), c["claim"], c["alpha"])
        note = sentence("forensic", "encoder_note", c["encoder_variants"])
        parts.append(f"## {case}\n\nverdict: {verdict}\n\nencoder_note: {note}")
    parts.append(f"## arm off\n\nverdict: {sentence('forensic', 'not_run')}")
    return "\n\n".join(parts) + "\n"


def test_the_forensic_section_renders_its_golden_text() -> None:
    assert _rendered() == TEXT.read_text(encoding="utf-8")


if __name__ == "__main__":  # rewrite the golden text
    TEXT.write_text(_rendered(), encoding="utf-8")
    print(f"wrote {TEXT}")
