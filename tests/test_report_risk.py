"""The risk section's words, once: its paragraphs rendered from the author's template
(`reports/templates/risk.jinja`) must reproduce the golden file.

The fixture (`tests/golden/report/risk_summaries.json`) holds three `risk/summary.json`s: a
smoke run's (trimmed to a few policies), one whose intervals take every other branch (verdicts
clear at alpha 0.1, each reading of a checkpoint's gains, a grouping of one group, a correlation
that is undefined) and one whose inputs are missing (notes instead of numbers). After a
deliberate change of the template or the vocabulary, rewrite the golden text (and review its
diff): `PYTHONPATH=. python tests/test_report_risk.py`."""

from __future__ import annotations

import json
from pathlib import Path

from rlxf_utils.report.risk import base_rate_sentence, interpret
from rlxf_utils.report.wording import sentence

GOLDEN = Path(__file__).resolve().parent / "golden" / "report"
FIXTURE = GOLDEN / "risk_summaries.json"
TEXT = GOLDEN / "risk.md"


def _rendered() -> str:
    """Each fixture case's findings as the report shows them (and the notebook, where the
    markdown differs: a lead and bullets), its notes and its clause for the conclusion."""
    parts = []
    for case, summary in json.loads(FIXTURE.read_text(encoding="utf-8")).items():
        parts.append(f"## {case}")
        for key, finding in interpret(summary).items():
            parts.append(f"### {key}\n\n{finding.paragraph()}")
            if finding.items or finding.note:
                parts.append(f"notebook:\n\n{finding.markdown()}")
        parts.append(f"notes: {sentence('risk', 'notes', summary['notes'])}")
        parts.append(f"base_rate_shift: {base_rate_sentence(summary['drift'], summary['alpha'])}")
    return "\n\n".join(parts) + "\n"


def test_the_risk_section_renders_its_golden_text() -> None:
    assert _rendered() == TEXT.read_text(encoding="utf-8")


if __name__ == "__main__":  # rewrite the golden text
    TEXT.write_text(_rendered(), encoding="utf-8")
    print(f"wrote {TEXT}")
