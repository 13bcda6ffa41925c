"""The verdict vocabulary: which code an interval earns (numbers), and the words once (golden).

Run as a script to rewrite the golden vocabulary after a deliberate change of a phrase:
`PYTHONPATH=. python tests/test_wording.py`."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from rlxf_utils.report import wording
from rlxf_utils.report.wording import ABOVE, BELOW, EQUIVALENT, UNCLEAR, vocabulary
from rlxf_utils.stats import VERDICTS, bound_verdict

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden" / "wording" / "vocabulary.json"
NAN = math.nan


@pytest.mark.parametrize(
    ("low", "high", "margin", "code"),
    [
        (0.01, 0.2, None, ABOVE),  # the interval, never the estimate, decides
        (-0.3, -0.01, None, BELOW),
        (-0.01, 0.5, None, UNCLEAR),
        (0.0, 0.5, None, UNCLEAR),  # a bound on zero holds zero
        (NAN, 0.5, None, UNCLEAR),  # a missing bound: no verdict
        (None, None, None, UNCLEAR),
        (-0.004, 0.006, 0.01, EQUIVALENT),  # wholly within ±margin
        (-0.004, 0.016, 0.01, UNCLEAR),  # reaches past the margin
        (0.001, 0.006, 0.01, ABOVE),  # the direction first, however small
        (-0.004, 0.006, NAN, UNCLEAR),
    ],
)
def test_an_interval_earns_one_verdict_code(low, high, margin, code) -> None:
    assert bound_verdict(low, high, margin) == code
    assert code in VERDICTS


def test_say_reads_the_code_of_the_interval_and_legacy_values_read_as_codes() -> None:
    for low, high, code in ((0.1, 0.2, ABOVE), (-0.2, -0.1, BELOW), (-0.1, 0.1, UNCLEAR)):
        for key in vocabulary():
            said = wording.say(key, low, high, level="95%", alpha="5%")
            assert said == wording.phrase(key, code, level="95%", alpha="5%")
    # runs from before the codes stored 'higher' / 'lower'; 'not tested' and NaN read as unclear
    assert wording.verdict_code("higher") == ABOVE and wording.verdict_code("lower") == BELOW
    assert wording.verdict_code("not tested") == UNCLEAR and wording.verdict_code(NAN) == UNCLEAR
    # a key without an equivalence phrase reads equivalence as a null
    assert wording.phrase("gain", EQUIVALENT) == wording.phrase("gain", UNCLEAR)
    assert wording.margin_verdict(-0.004, 0.006, 0.01).endswith("within ±0.010")
    with pytest.raises(KeyError, match="no 'nope'.*'gain'"):
        wording.phrase("nope", ABOVE)


def test_every_phrase_set_has_the_three_codes_and_fills_its_fields() -> None:
    for key, words in vocabulary().items():
        assert {ABOVE, BELOW, UNCLEAR} <= set(words) <= set(VERDICTS), key
        for text in words.values():
            assert text == text.strip() and text, key
            assert set(re.findall(r"{(\w+)}", text)) <= {"level", "alpha"}, key


def test_the_null_phrase_of_a_comparison_is_spelled_once() -> None:
    files = [*sorted((ROOT / "rlxf_utils").rglob("*.py")), *sorted(wording.TEMPLATES.iterdir())]
    hits = [
        str(p.relative_to(ROOT))
        for p in files
        for line in p.read_text(encoding="utf-8").splitlines()
        if "told apart" in line and not line.lstrip().startswith("#")
    ]
    assert hits == ["reports/templates/vocabulary.yaml"], hits


def test_a_phrase_set_without_its_codes_is_refused_naming_the_file_and_key(tmp_path) -> None:
    bad = tmp_path / "vocabulary.yaml"
    bad.write_text('told_apart: "x"\nphrases:\n  gain:\n    above: "raised"\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"vocabulary.yaml: phrases.gain needs"):
        vocabulary(bad)


def test_one_formatter_each_for_numbers_percentages_and_p_values() -> None:
    assert wording.num(0.12345) == "0.123" and wording.num(None) == "n/a"
    assert wording.num(0.0004, 1, signed=True, scale=100) == "+0.04"  # shows its sign's digit
    assert wording.num(-0.0123, 1, signed=True, scale=100) == "-1.2"
    assert wording.pct(0.8234) == "82.3%" and wording.pct(NAN) == "n/a"
    assert wording.pct_ci(0.82, 0.791, 0.846) == "82.0% [79.1%, 84.6%]"
    assert [wording.pval(p) for p in (0.0132, 0.0004, NAN)] == ["0.013", "<0.001", "n/a"]
    assert [wording.pval(p, prose=True) for p in (0.0132, 0.0004, None)] == [
        "p = 0.013",
        "p < 0.001",
        "p n/a",
    ]


def _vocabulary_text() -> str:
    return json.dumps(vocabulary(), indent=1, ensure_ascii=False, sort_keys=True) + "\n"


def test_the_vocabulary_matches_its_golden_file() -> None:
    """The words, once: a phrase changed on purpose is a changed golden file in the diff (rewrite
    it with `PYTHONPATH=. python tests/test_wording.py`)."""
    assert _vocabulary_text() == GOLDEN.read_text(encoding="utf-8")


if __name__ == "__main__":  # rewrite the golden vocabulary (after a deliberate change of a phrase)
    GOLDEN.write_text(_vocabulary_text(), encoding="utf-8")
    print(f"wrote {GOLDEN}")


# -- the tables' columns, in reports/templates/tables.yaml -------------------------------------
SPEC = """
t:
  policy: r.policy | name
  "gain [{{ lvl }} CI]": ci(r.gain, r.low, r.high, signed=True)
  "{{ 'SD' if with_sd }}": r.sd
  text: r.text
named:
  columns: [setting, value]
  rows:
    steps: cfg.steps
    optimiser: "none if cfg.get('opt') is none else cfg.opt"
"""


def test_a_table_spec_names_ids_signs_numbers_and_shows_data_as_text(tmp_path) -> None:
    spec = tmp_path / "tables.yaml"
    spec.write_text(SPEC, encoding="utf-8")
    rows = [{"policy": "ppo_mle", "gain": -0.012, "low": -0.02, "high": -0.004, "sd": 0.5,
             "text": "<script>x</script> *bold*"}]  # fmt: skip
    md = wording.table("t", rows, path=spec, lvl="95%", with_sd=False).splitlines()
    assert md[0] == r"| policy | gain \[95% CI\] | text |"  # the empty header drops its column
    cells = [c.strip() for c in md[2].split("|")[1:-1]]
    assert cells[0] == "PPO + MLE"  # the display name, where the cell is written
    assert cells[1] == r"-0.012 \[-0.020, -0.004\]"  # signed, one CI format
    assert cells[2] == r"\<script\>x\</script\> \*bold\*"  # text, never markup
    with_sd = wording.table("t", rows, path=spec, lvl="95%", with_sd=True)
    assert with_sd.splitlines()[0].split("|")[3].strip() == "SD"
    with pytest.raises(ValueError, match=r"tables.yaml: table 't'.*'lvl'"):
        wording.table("t", rows, path=spec, with_sd=False)
    with pytest.raises(ValueError, match=r"tables.yaml: no table 'u'"):
        wording.table("u", rows, path=spec)


def test_a_table_of_named_values_leaves_out_a_value_that_is_none(tmp_path) -> None:
    spec = tmp_path / "tables.yaml"
    spec.write_text(SPEC, encoding="utf-8")
    two = wording.table("named", path=spec, cfg={"steps": 3, "opt": "AdamW"}).splitlines()
    assert [r.split("|")[1:3] for r in two[2:]] == [[" steps ", " 3 "], [" optimiser ", " AdamW "]]
    one = wording.table("named", path=spec, cfg={"steps": 3}).splitlines()
    assert len(one) == 3 and "optimiser" not in one[2]


def test_every_table_in_the_spec_is_written_by_the_report() -> None:
    import yaml

    names = set(yaml.safe_load(wording.TABLES_FILE.read_text(encoding="utf-8")))
    code = "".join(
        p.read_text(encoding="utf-8") for p in (ROOT / "rlxf_utils" / "report").glob("*.py")
    )
    assert {n for n in names if not re.search(rf'table\(\s*"{n}"', code)} == set()


def test_a_report_table_gives_each_column_room_for_its_longest_word() -> None:
    md = "| kind | gain |\n|:---|---:|\n| supervised | +0.001 \\[−0.002, +0.004\\] a\\|b |\n"
    sep = wording.fit_words(md).splitlines()[1]
    left, right = sep.strip("|").split("|")
    assert left == ":" + "-" * (3 * 10 // 2 + 4)  # 'supervised': 10 characters, aligned left
    assert right.endswith(":") and len(right) - 1 == 3 * len("\\[−0.002,") // 2 + 4
    wide = "| a |\n|:" + "-" * 40 + "|\n| x |\n"
    assert wording.fit_words(wide) == wide  # a column already wider keeps its dashes


def test_a_column_among_many_wide_ones_keeps_its_word_s_share_of_the_line() -> None:
    wide = " ".join(["0.735 [0.667, 0.823]"] * 2)  # long but wrappable: 44 dashes each
    md = "| inputs |" + " x |" * 8 + "\n|:---|" + "-" * 44 + "|" + ("-" * 44 + "|") * 7 + "\n| staff_comments |" + f" {wide} |" * 8 + "\n"  # fmt: skip
    widths = [len(c) for c in wording.fit_words(md).splitlines()[1].strip("|").split("|")]
    words = [len("staff_comments")] + [len("[0.667,")] * 8
    for w, n in zip(widths, words, strict=True):
        assert w / sum(widths) >= (n + 2) / wording.LINE_CHARS - 1e-9  # room for the word
    assert widths[0] > 1 + 3 * len("staff_comments") // 2 + 4  # more than 1.5 words, here
