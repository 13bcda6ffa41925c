"""The data section's words, once: its sentences rendered from the author's template
(`reports/templates/data.jinja`) on a constructed run must reproduce the golden file.

The fixture (`tests/golden/report/data_findings.json`) holds the `findings` of data/summary.json
for a few runs that take each branch (a rising and a falling trend, a flat one, groups too few to
test), computed by `data.findings.data_findings` from synthetic MONA-like rows. After a deliberate
change of the template or the vocabulary, rewrite the golden text (and review its diff):
`PYTHONPATH=. python tests/test_report_data.py`; `--fixture` also recomputes the fixture."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from rlxf_utils.artifacts import RunDir
from rlxf_utils.report.data import SENTENCES, data_section
from rlxf_utils.report.wording import sentence

GOLDEN = Path(__file__).resolve().parent / "golden" / "report"
FIXTURE = GOLDEN / "data_findings.json"
TEXT = GOLDEN / "data.md"


def _rendered(tmp: Path) -> str:
    """Each fixture case written as a run's data/summary.json and rendered by the report."""
    parts = []
    for case, findings in json.loads(FIXTURE.read_text(encoding="utf-8")).items():
        run = RunDir(tmp / case.replace(" ", "_"))
        run.write_json("data/summary.json", {"findings": findings})
        variables = data_section(run)
        parts.append(
            f"## {case}\n\n" + "\n\n".join(f"{k}: {variables[k]}" for k in ("level", *SENTENCES))
        )
    return "\n\n".join(parts) + "\n"


def test_the_data_section_renders_its_golden_text(tmp_path: Path) -> None:
    assert _rendered(tmp_path) == TEXT.read_text(encoding="utf-8")


def test_a_template_asking_for_a_field_the_run_lacks_names_it(tmp_path: Path) -> None:
    findings = next(iter(json.loads(FIXTURE.read_text(encoding="utf-8")).values()))
    del findings["shift"]["rate_after"]
    with pytest.raises(ValueError, match=r"data\.jinja: macro 'shift_sentence'.*rate_after"):
        sentence("data", "shift_sentence", findings)
    with pytest.raises(ValueError, match=r"data\.jinja: no macro 'nope'"):
        sentence("data", "nope", findings)


def _fixture() -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import numpy as np
    from test_rates import _labelled

    from rlxf_utils.data.findings import data_findings

    differ = _labelled(seed=5)  # arrangement types whose MET rates differ
    ecf = differ["arrangement_type"] == "ECF"
    differ.loc[ecf, "y"] = (np.random.default_rng(5).random(int(ecf.sum())) < 0.9).astype(int)
    cases = {
        "rising trend, groups tested": (_labelled(slope=0.4), 0.05, 20),
        "arrangement types differ": (differ, 0.05, 20),
        "falling trend at alpha 0.1": (_labelled(slope=-0.4), 0.1, 20),
        "flat, too few groups": (_labelled(slope=0.0, seed=3), 0.05, 10_000),
    }
    return {k: data_findings(df, 2010, a, n) for k, (df, a, n) in cases.items()}


if __name__ == "__main__":  # rewrite the golden text (and with --fixture, the fixture first)
    import tempfile

    if "--fixture" in sys.argv:
        FIXTURE.write_text(
            json.dumps(_fixture(), indent=1, sort_keys=True) + "\n", encoding="utf-8"
        )
    with tempfile.TemporaryDirectory() as tmp:
        TEXT.write_text(_rendered(Path(tmp)), encoding="utf-8")
    print(f"wrote {TEXT}")


def test_the_pools_table_names_who_learns_from_each_pool(tmp_path: Path) -> None:
    import pandas as pd

    from rlxf_utils.report.data import POOL_LABELS, pools_table

    run = RunDir(tmp_path / "run")
    pools = pd.DataFrame({"pool": list(POOL_LABELS), "rows": [10, 2, 3, 1, 4, 5, 0],
                          "share": [0.4, 0.08, 0.12, 0.04, 0.16, 0.2, 0.0],
                          "share_of_training_countries": [0.5, 0.1, 0.15, 0.05, 0.2, None, 0.0],
                          "countries": [3, 1, 1, 1, 2, 2, 0], "arrangements": [3, 1, 1, 1, 2, 2, 0],
                          "contexts": [9, 2, 3, 1, 4, 5, 0],
                          "met_share": [0.6, 0.5, 0.7, 1.0, 0.75, 0.8, None]})  # fmt: skip
    run.write_table("data_pools", pools)
    rows = [r.split("|")[1:-1] for r in pools_table(run).splitlines()[2:]]
    assert [r[0].strip() for r in rows] == list(POOL_LABELS.values())  # no raw pool id is shown
    assert [r[2].strip() for r in rows][:2] == ["40.0%", "8.0%"]
    assert rows[5][3].strip() == "·" and rows[6][7].strip() == "·"  # references, unused: no share


def test_the_pool_duplicates_sentence_reads_the_stored_numbers() -> None:
    """The words are the template's (`data.jinja`), the numbers `data/summary.json`'s; whether
    text recurs is chosen from them."""
    from rlxf_utils.artifacts import ArtifactMissing
    from rlxf_utils.report.data import pool_duplicates_sentence

    def row(pool, other, rows, exact, near):
        return {"pool": pool, "other": other, "rows": rows, "exact_in_other": round(exact * rows),
                "exact_share": exact, "near_in_other": round(near * rows), "near_share": near,
                "threshold": 0.9}  # fmt: skip

    rows = [row("policy", "reward", 1200, 0.02, 0.05), row("policy", "audit", 1200, 0.01, 0.03),
            row("audit", "reward", 400, 0.0, 0.1)]  # fmt: skip
    text = " ".join(pool_duplicates_sentence(rows).split())
    assert "yet text recurs across programmes: of its 1,200 rows, 2.0% have an identical" in text
    assert "reward model's rows and 5.0% a near-duplicate (cosine ≥ 0.9)" in text
    assert "among the audit's, 1.0% and 3.0%; and 10.0% of the audit's 400 rows" in text
    none = [{**r, "exact_share": 0.0, "near_share": 0.0} for r in rows]
    assert "judge that learned nearly the same one" in text
    quiet = pool_duplicates_sentence(none)
    assert "and no text recurs across the pools" in quiet and "judge" not in quiet
    with pytest.raises(ArtifactMissing, match="pool_duplicates"):
        pool_duplicates_sentence([])


def test_notebook_01_writes_the_pool_duplicates_the_report_states(tmp_path: Path) -> None:
    """The smoke profile's data stage writes `tables/pool_duplicates.csv` and the same numbers in
    `data/summary.json`, which the report's data variable `pool_duplicates` states."""
    import pandas as pd

    from rlxf_utils.config import PROJECT_ROOT, load_config
    from rlxf_utils.data.stage import describe_data, run_data_stage
    from rlxf_utils.report.render import _data_variables

    cfg = load_config(PROJECT_ROOT / "params/smoke.yaml")
    run = RunDir(tmp_path / "run")
    describe_data(run_data_stage(cfg, run), cfg, run)
    table = run.read_table("pool_duplicates")
    assert [tuple(r) for r in table[["pool", "other"]].to_numpy()] == [
        ("policy", "reward"), ("policy", "audit"), ("audit", "reward")]  # fmt: skip
    pools = run.read_parquet("data/pools.parquet")["pool"].value_counts()
    assert table.loc[0, "rows"] == pools["policy"]
    assert table.loc[2, "rows"] == pools["audit_train"] + pools["audit_val"]
    stored = pd.DataFrame(run.read_json("data/summary.json")["pool_duplicates"])
    pd.testing.assert_frame_equal(stored, table, check_dtype=False)
    said = " ".join(_data_variables(run)["pool_duplicates"].split())
    assert f"of its {table.loc[0, 'rows']:,} rows, {100 * table.loc[0, 'exact_share']:.1f}%" in said
    assert f"{100 * table.loc[2, 'near_share']:.1f}% of the audit's" in said
