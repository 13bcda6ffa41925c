from __future__ import annotations

import csv
from pathlib import Path

import pytest

from rlxf_utils.cli import main

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def loose(tmp_path: Path) -> str:
    """A profile whose data.checks accept the few-row exports these tests read."""
    p = tmp_path / "loose.yaml"
    checks = ("max_unrecognised_share: 1.0", "max_empty_description_share: 1.0",
              "min_labelled_rows: 1", "min_rows_per_label: 1")  # fmt: skip
    p.write_text(f"extends: {ROOT / 'params/smoke.yaml'}\ndata:\n  checks:\n"
                 + "".join(f"    {c}\n" for c in checks))  # fmt: skip
    return str(p)


def test_data_summary_on_real_file(mona_path: Path, capsys) -> None:
    assert main(["data", "summary", str(mona_path)]) == 0
    out = capsys.readouterr().out
    assert "schema:     mona_2002_vintage" in out
    assert "labelled:   5631 (MET 3546, Non-MET 2085, MET share 0.630)" in out
    assert "'Mod' -> 'MOD'" in out and "repairs:    none" in out


def test_data_summary_reports_repairs(small_mona: Path, tmp_path: Path, capsys) -> None:
    raw = small_mona.read_bytes()
    cut = tmp_path / "cut.csv"
    cut.write_bytes(raw[: len(raw) - 40])
    assert main(["data", "summary", str(cut)]) == 0
    assert "truncated" in capsys.readouterr().out


def test_data_summary_bad_input_exits_2(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    assert main(["data", "summary", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "bad.csv" in err and "missing required column" in err
    assert "Traceback" not in err
    assert main(["data", "summary", str(tmp_path / "none.csv")]) == 2


def test_run_with_bad_params_exits_2_before_work(tmp_path: Path, capsys) -> None:
    p = tmp_path / "p.yaml"
    p.write_text("run: {name: x}\ndata: {path: missing.csv}\n")
    assert main(["run", "--params", str(p), "--run-dir", str(tmp_path / "r")]) == 2
    assert "data.path" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def _export_rows() -> tuple[list[str], list[list[str]]]:
    header = ["Country Name", "Arrangement Type", "Economic Descriptor", "Description", "Test Date",
              "PC Status"]  # fmt: skip
    rows = [
        ["Kenya", "ECF", "1.6. Audit", "Audit the accounts; publish them.", "6/30/2010", "Met"],
        ["Kenya", "ECF", "1.6. Audit", "Adopt the audit law.", "12/31/2010", "Not met"],
        ["Ghana", "ECF", "1.2. Revenue", "Raise the VAT, then review it.", "3/31/2011", "Waived"],
        ["Ghana", "ECF", "1.2. Revenue", "Publish the tax report.", "", "Structural benchmark"],
    ]
    return header, rows


def test_data_summary_reads_an_xlsx_export(tmp_path: Path, capsys, loose) -> None:
    from openpyxl import Workbook

    header, rows = _export_rows()
    wb = Workbook()
    wb.active.title = "Notes"
    wb.active.append(["MONA download"])
    ws = wb.create_sheet("Conditions")
    for r in [header, *rows]:
        ws.append(r)
    wb.save(tmp_path / "mona.xlsx")
    assert main(["data", "summary", str(tmp_path / "mona.xlsx"), "--params", loose]) == 0
    out = capsys.readouterr().out
    assert "format:     Excel workbook, sheet 'Conditions', header on row 1" in out
    assert "schema:     imf_current_export" in out
    assert "labelled:   3 (MET 1, Non-MET 2, MET share 0.333)" in out
    assert "'Not met' -> 'NM'" in out and "WARNING" not in out


@pytest.mark.parametrize(("sep", "name"), [(",", "comma"), (";", "semicolon"), ("\t", "tab")])
def test_data_summary_reads_csv_variants(
    tmp_path: Path, capsys, sep: str, name: str, loose
) -> None:
    header, rows = _export_rows()
    p = tmp_path / "mona.csv"
    with open(p, "w", newline="", encoding="utf-8") as fh:
        csv.writer(fh, delimiter=sep).writerows([header, *rows])
    assert main(["data", "summary", str(p), "--params", loose]) == 0
    out = capsys.readouterr().out
    assert f"format:     CSV, {name}-separated" in out
    assert "labelled:   3 (MET 1, Non-MET 2, MET share 0.333)" in out


def _bad_exit(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and cap.err.startswith("error: ") and "Traceback" not in cap.err
    return cap.err


def test_data_summary_bad_files_exit_2_with_the_reason(tmp_path: Path, capsys) -> None:
    from openpyxl import Workbook

    header, rows = _export_rows()
    dup = tmp_path / "dup.csv"
    with open(dup, "w", newline="", encoding="utf-8") as fh:
        csv.writer(fh).writerows([[*header, "Description "], *[[*r, "x"] for r in rows]])
    err = _bad_exit(["data", "summary", str(dup)], capsys)
    assert "dup.csv: column 4 'Description' and column 7 'Description '" in err

    wb = Workbook()
    wb.active.title = "Totals"
    wb.active.append(["Country", "Count"])
    wb.save(tmp_path / "other.xlsx")
    err = _bad_exit(["data", "summary", str(tmp_path / "other.xlsx")], capsys)
    assert "other.xlsx: no sheet has the columns" in err and "'Totals'" in err

    (tmp_path / "fake.xlsx").write_text("Country Name,Description\n")
    err = _bad_exit(["data", "summary", str(tmp_path / "fake.xlsx")], capsys)
    assert "fake.xlsx: not a readable .xlsx workbook" in err


def test_data_summary_unrecognised_status_policies(tmp_path: Path, capsys, loose) -> None:
    header, rows = _export_rows()
    rows[1][-1] = "Pending"
    p = tmp_path / "st.csv"
    with open(p, "w", newline="", encoding="utf-8") as fh:
        csv.writer(fh).writerows([header, *rows])
    assert main(["data", "summary", str(p), "--params", loose]) == 0
    out = capsys.readouterr().out
    assert "labelled:   3 (MET 1, Non-MET 2" in out and "'PENDING' x1" in out
    assert main(["data", "summary", str(p), "--unrecognised", "exclude", "--params", loose]) == 0
    out = capsys.readouterr().out
    assert "labelled:   2 (MET 1, Non-MET 1" in out
    assert "excluded:   2 (not assessed yet 1; unrecognised status 1)" in out
    err = _bad_exit(["data", "summary", str(p), "--unrecognised", "error"], capsys)
    assert "st.csv: column 'PC Status' has 1 unrecognised status value(s) {'PENDING': 1}" in err


def _mona_lines(n: int) -> list[str]:
    return (Path(__file__).resolve().parent.parent / "data/raw/MONA_From2002.csv").read_text(
        encoding="utf-8").splitlines()[: n + 1]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "found"),
    [("unknown_statuses", "statuses (100%) are no MONA code"),
     ("empty_descriptions", "condition descriptions (100%) are empty"),
     ("one_row", "1 assessed (MET or Non-MET) rows; the splits need at least 100"),
     ("one_outcome", "each outcome needs at least 10")],
)  # fmt: skip
def test_clearly_wrong_data_exits_2_with_what_was_found(
    tmp_path: Path, capsys, case, found
) -> None:
    """A wrong column or a wrong export: loaded, summarised, then refused (data.checks)."""
    rows = list(csv.reader(_mona_lines(300)))
    header, body = rows[0], rows[1:]
    status, descr = header.index("Status"), header.index("Descpt")
    if case == "unknown_statuses":
        body = [[*r[:status], "2010-06-30", *r[status + 1 :]] for r in body]
    elif case == "empty_descriptions":
        body = [[*r[:descr], "", *r[descr + 1 :]] for r in body]
    elif case == "one_row":
        body = [r for r in body if r[status] == "M"][:1]
    else:
        body = [r for r in body if r[status] == "M"]
    p = tmp_path / f"{case}.csv"
    with open(p, "w", newline="", encoding="utf-8") as fh:
        csv.writer(fh).writerows([header, *body])
    assert main(["data", "summary", str(p)]) == 2
    out, err = capsys.readouterr()
    assert "labelled:" in out  # the summary is still shown
    assert f"error: {p}: " in err and found in err and "Traceback" not in err
    # loosened in the parameters: accepted
    params = tmp_path / "loose.yaml"
    params.write_text(f"extends: {Path(__file__).resolve().parent.parent / 'params/smoke.yaml'}\n"
                      "data: {checks: {max_unrecognised_share: 1.0, max_empty_description_share: 1.0,"
                      " min_labelled_rows: 1, min_rows_per_label: 0}}\n")  # fmt: skip
    assert main(["data", "summary", str(p), "--params", str(params)]) == 2  # 0 is not allowed
    assert "min_rows_per_label" in capsys.readouterr().err
    params.write_text(params.read_text().replace("min_rows_per_label: 0", "min_rows_per_label: 1"))
    expected = 0 if case == "empty_descriptions" else 2  # the others hold one outcome
    assert main(["data", "summary", str(p), "--params", str(params)]) == expected


def test_a_binary_params_file_is_named(tmp_path: Path, capsys) -> None:
    p = tmp_path / "params.yaml"
    p.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe")
    assert main(["run", "--params", str(p)]) == 2
    err = capsys.readouterr().err
    assert f"{p}: not a text file" in err and "Traceback" not in err


def test_report_on_a_mistyped_run_dir_creates_nothing(tmp_path: Path, capsys) -> None:
    missing = tmp_path / "runs" / "defualt"
    assert main(["report", "--run-dir", str(missing)]) == 2
    assert f"{missing}: no such folder" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_the_cli_explains_itself(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("rlxf ")
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    text = capsys.readouterr().out
    for words in ("skips each notebook", "resumes", "exit codes: 0", "1 a notebook failed", "2 bad input",
                  "params.yaml", "locked"):  # fmt: skip
        assert words in " ".join(text.split()), words
    with pytest.raises(SystemExit):
        main(["report", "--help"])
    assert "Quarto when it is on PATH" in " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit):
        main(["data", "summary", "--help"])
    assert "--params" in capsys.readouterr().out


GOOD_MANIFEST = {"params": {"run": {"title": "t", "authors": ["a"], "wp_number": "1"}},
                 "data": {"sha256": "0" * 64},
                 "environment": {"packages": {}}, "notebooks": []}  # fmt: skip


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no manifest.json; expected a run folder that `rlxf run` wrote"),
        ('{"params": {"run": ', "manifest.json: unreadable (Expecting value: line 1"),
        ("", "manifest.json: unreadable (Expecting value"),
        ("{}", "manifest.json: lacks params.run.title, params.run.authors"),
        ("[]", "manifest.json: a JSON list; expected the JSON object `rlxf run` writes"),
        ("\xff\xfe", "manifest.json: unreadable"),
        (GOOD_MANIFEST, "manifest.json: no notebook has run; expected a finished run"),
        ({**GOOD_MANIFEST, "notebooks": [{"name": "01_data", "status": "interrupted"}]},
         "notebook 01_data is 'interrupted'; expected a finished run"),
    ],
)  # fmt: skip
def test_report_and_seeds_on_a_run_that_is_not_one_exit_2_and_write_nothing(
    tmp_path: Path, capsys, content, message
) -> None:
    import json

    run_dir = tmp_path / "r"
    run_dir.mkdir()
    if content is not None:
        text = content if isinstance(content, str) else json.dumps(content)
        (run_dir / "manifest.json").write_text(text, encoding="latin-1")
    before = sorted(p.name for p in run_dir.iterdir())
    assert main(["report", "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    assert sorted(p.name for p in run_dir.iterdir()) == before  # no report/_build
    assert main(["seeds", "--run-dir", str(run_dir), "--seeds", "5", "--quiet"]) == 2
    err = capsys.readouterr().err
    if "finished run" not in message:
        assert message in err, err
    else:  # a manifest, but no finished run for seeds to extend
        assert "not a finished run, params.yaml (rlxf run)" in err, err
    assert sorted(p.name for p in run_dir.iterdir()) == before


def test_seeds_on_a_missing_folder_creates_nothing(tmp_path: Path, capsys) -> None:
    missing = tmp_path / "runs" / "nope"
    assert main(["seeds", "--run-dir", str(missing), "--seeds", "5"]) == 2
    assert f"{missing}: no such folder" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_a_report_missing_an_artifact_leaves_no_build_behind(tmp_path: Path, capsys) -> None:
    import json

    run_dir = tmp_path / "r"
    run_dir.mkdir()
    done = {**GOOD_MANIFEST, "notebooks": [{"name": "01_data", "status": "ok"}]}
    (run_dir / "manifest.json").write_text(json.dumps(done))
    assert main(["report", "--run-dir", str(run_dir), "--engine", "pandoc"]) == 2
    assert "missing artifact" in capsys.readouterr().err
    assert sorted(p.name for p in run_dir.iterdir()) == ["manifest.json"]


def test_seeds_passes_the_chosen_algorithms_on(monkeypatch) -> None:
    import pandas as pd

    got = {}

    def fake(run_dir, seeds, progress=True, algorithms=None):
        got.update(run_dir=run_dir, seeds=seeds, algorithms=algorithms)
        return pd.DataFrame()

    monkeypatch.setattr("rlxf_utils.seeds.run_seeds", fake)
    assert main(["seeds", "--run-dir", "r", "--seeds", "3", "4", "--algorithms", "grpo, ppo"]) == 0
    assert got == {"run_dir": "r", "seeds": [3, 4], "algorithms": ["grpo", "ppo"]}
    assert main(["seeds", "--run-dir", "r", "--seeds", "3"]) == 0
    assert got["algorithms"] is None
