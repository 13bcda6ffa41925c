from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import read_rows, write_csv

from rlxf_utils.data.contexts import build_contexts
from rlxf_utils.data.labels import derive_test_year, label_statuses, normalise_status
from rlxf_utils.data.mona import load_mona, subsample_arrangements
from rlxf_utils.data.schema import DataError
from rlxf_utils.data.splits import (
    carve_policy_pool,
    make_splits,
    near_duplicates_across,
    nest_evaluation_holdout,
    pool_of_rows,
    pool_table,
)
from rlxf_utils.prompts import serialize_frame
from rlxf_utils.stats import rate_by

SHA = "df8a2a242868460ebf302904c19b7fa6be95a9249cbc140972d56476d0c20a2a"


@pytest.fixture(scope="module")
def full():
    return load_mona(
        Path(__file__).resolve().parent.parent / "data/raw/MONA_From2002.csv", expected_sha256=SHA
    )


# -- schemas -----------------------------------------------------------------------------------
def test_vintage_schema_real_file(full) -> None:
    rep = full.report
    assert rep.schema == "mona_2002_vintage"
    assert rep.rows_read == 6549 and rep.sha256 == SHA
    assert rep.label_counts == {"MET": 3546, "Non-MET": 2085, "excluded": 918}
    assert rep.repairs == [] and rep.unknown_statuses == {}
    df = full.frame
    assert df["row_id"].is_unique
    assert df["arrangement_type"].ne("").all()
    assert set(df["condition_type"]) <= {"SPC", "PA", "SB", "SAC"}
    assert df["test_year"].notna().all()


def test_current_schema_reads_to_the_same_table(
    small_mona: Path, current_schema_mona: Path
) -> None:
    a = load_mona(small_mona).frame
    b = load_mona(current_schema_mona)
    assert b.report.schema == "imf_current_export"
    b = b.frame
    for col in [
        "country",
        "arrangement_type",
        "econ_descriptor",
        "description",
        "status",
        "label",
        "test_year",
        "condition_type",
    ]:
        assert a[col].tolist() == b[col].tolist(), col
    assert b["econ_code"].str.startswith("20.").all()


def test_current_schema_without_arrangement_type(tmp_path: Path) -> None:
    header = [
        "Country Name",
        "Economic Code",
        "Economic Descriptor",
        "Description",
        "Description Code",
        "Test Date",
        "PC Status",
    ]
    rows = [
        [
            "Kenya",
            "20.6",
            "1.6. Expenditure auditing",
            "Audit the accounts.",
            "SB",
            "6/30/2010",
            "Met",
        ],
        [
            "Kenya",
            "20.6",
            "1.6. Expenditure auditing",
            "Publish audit.",
            "SB",
            "2011-03-31",
            " NM ",
        ],
    ]
    t = load_mona(write_csv(tmp_path / "c.csv", header, rows))
    assert t.frame["arrangement_type"].tolist() == ["unknown", "unknown"]
    assert t.frame["test_year"].tolist() == [2010, 2011]
    assert t.frame["condition_type"].tolist() == ["SB", "SB"]
    # 'Met' spelled out is the code M, not an unknown status counted as Non-MET
    assert t.report.unknown_statuses == {}
    assert t.frame["status"].tolist() == ["M", "NM"]
    assert t.frame["label"].tolist() == ["MET", "Non-MET"]


# -- statuses and labels -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("raw", "norm"),
    [("Mod", "MOD"), (" M ", "M"), ("MMod", "MMOD"), ("", ""), (None, ""), ("p m", "PM")],
)
def test_normalise_status(raw, norm) -> None:
    assert normalise_status(raw) == norm


def test_label_mapping_default_and_custom() -> None:
    s = pd.Series(["M", "PM", "NM", "MD", "SB", "PC", "PA", "", "W", "XYZ"])
    assert label_statuses(s, ["M", "PM"], ["SB", "PC", "PA", ""]).tolist() == [
        "MET",
        "MET",
        "Non-MET",
        "Non-MET",
        "excluded",
        "excluded",
        "excluded",
        "excluded",
        "Non-MET",
        "Non-MET",
    ]
    assert label_statuses(s, ["M", "PM", "md"], ["SB", "PC", "PA", ""])[3] == "MET"


def test_status_report_counts_every_raw_code(full) -> None:
    st = full.report.status_table
    assert st["count"].sum() == 6549
    mod = st[st["status"] == "MOD"].set_index("status_raw")["count"].to_dict()
    assert mod == {"MOD": 283, "Mod": 41}
    assert "UNKNOWN CODE" not in set(st["meaning"])


def test_unknown_status_warns_with_counts(small_mona: Path, tmp_path: Path, caplog) -> None:
    header, rows = read_rows(20)
    si = header.index("Status")
    rows[0][si] = "ZZ"
    rows[1][si] = "zz "
    with caplog.at_level(logging.WARNING):
        t = load_mona(write_csv(tmp_path / "u.csv", header, rows))
    assert t.report.unknown_statuses == {"ZZ": 2}
    assert "ZZ" in caplog.text
    assert len(t.frame) == 20
    assert "WARNING unknown status" in t.report.render()


# -- the Comments rule -------------------------------------------------------------------------
def test_comments_never_reach_model_input(tmp_path: Path) -> None:
    header, rows = read_rows(30)
    ci = header.index("Comments")
    for r in rows:
        r[ci] = "SENTINEL-OUTCOME the deadline was missed; a waiver was granted"
    t = load_mona(write_csv(tmp_path / "c.csv", header, rows))
    assert not any("comment" in c.lower() for c in t.frame.columns)
    assert not t.frame.astype(str).apply(lambda col: col.str.contains("SENTINEL")).any().any()
    texts = serialize_frame(t.frame)
    assert texts and not any("SENTINEL" in x for x in texts)


# -- bad input ---------------------------------------------------------------------------------
def test_missing_and_empty_file(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"nope\.csv: file not found"):
        load_mona(tmp_path / "nope.csv")
    (tmp_path / "e.csv").write_text("")
    with pytest.raises(DataError, match=r"e\.csv: the file is empty"):
        load_mona(tmp_path / "e.csv")
    (tmp_path / "h.csv").write_text("CountryName,ArrType,EconDescrpt,Descpt,TestDate,Status\r\n")
    with pytest.raises(DataError, match="only a header row"):
        load_mona(tmp_path / "h.csv")


def test_missing_columns_named_with_what_was_found(tmp_path: Path) -> None:
    header, rows = read_rows(5)
    drop = [header.index("Status"), header.index("Descpt")]
    h2 = [h for i, h in enumerate(header) if i not in drop]
    r2 = [[v for i, v in enumerate(r) if i not in drop] for r in rows]
    with pytest.raises(DataError) as ei:
        load_mona(write_csv(tmp_path / "m.csv", h2, r2))
    msg = str(ei.value)
    assert (
        "m.csv" in msg
        and "'Descpt'" in msg
        and "'Status'" in msg
        and "found columns" in msg
        and "CountryName" in msg
    )


def test_truncated_last_line_is_repaired_out_loud(small_mona: Path, tmp_path: Path) -> None:
    raw = small_mona.read_bytes()
    # cut inside the last record, after its first few fields
    last_start = raw.rstrip(b"\r\n").rfind(b"\n") + 1
    cut = tmp_path / "cut.csv"
    cut.write_bytes(raw[: last_start + 60])
    t = load_mona(cut)
    assert t.report.rows_read == 299
    assert any("truncated" in r for r in t.report.repairs)
    # a cut inside a quoted field (unterminated quote)
    quoted = raw[: last_start + raw[last_start:].index(b'"') + 5]
    cut.write_bytes(quoted)
    t = load_mona(cut)
    assert t.report.rows_read == 299 and any("unterminated quote" in r for r in t.report.repairs)


def test_short_row_in_the_middle_is_an_error(tmp_path: Path) -> None:
    header, rows = read_rows(10)
    rows[3] = rows[3][:5]
    with pytest.raises(DataError, match=r"record 4 .*5 fields, expected 20"):
        load_mona(write_csv(tmp_path / "s.csv", header, rows))


def test_non_utf8_bytes_decoded_as_cp1252(small_mona: Path, tmp_path: Path) -> None:
    header, rows = read_rows(10)
    rows[0][header.index("Descpt")] = "Adopt the caf\u00e9 law \u2013 phase 1"
    p = tmp_path / "w.csv"
    write_csv(p, header, rows)
    p.write_bytes(p.read_text(encoding="utf-8").encode("cp1252"))
    t = load_mona(p)
    assert t.report.encoding == "cp1252"
    assert any("cp1252" in r for r in t.report.repairs)
    assert t.frame["description"][0] == "Adopt the caf\u00e9 law \u2013 phase 1"


def test_sha_mismatch(small_mona: Path) -> None:
    with pytest.raises(DataError, match=r"sha256 is [0-9a-f]{64}, expected 0{64}.*data\.sha256"):
        load_mona(small_mona, expected_sha256="0" * 64)


# -- test years --------------------------------------------------------------------------------
def test_derive_test_year() -> None:
    a, b = pd.Timestamp("2006-06-26"), pd.Timestamp("2010-01-13")
    assert derive_test_year("09/21/2007", a, b, "R6")[1:] == (2007, "test_date")
    assert derive_test_year("1 Jan 2013", a, b, "R6")[1:] == (2013, "test_date")
    assert derive_test_year("Program Prior Action", a, b, "R6")[1:] == (2006, "approval_date")
    # third of six reviews: halfway between approval (2006-06) and the sixth review (2010-01)
    assert derive_test_year("Third Review Prior action", a, b, "R6")[1:] == (
        2008,
        "interpolated_review_date",
    )
    assert derive_test_year("Combined Fifth and Sixth Reviews Prior Action", a, b, "R6")[1:] == (
        2010,
        "interpolated_review_date",
    )
    assert derive_test_year("Continuous", a, b, "R6")[1:] == (2010, "board_date")
    assert derive_test_year("Continuous", a, None, "")[1:] == (2006, "approval_date")
    assert derive_test_year("whenever", None, None, "")[1:] == (None, "unknown")


# -- splits ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def splits(full):
    return full.labelled, make_splits(
        full.labelled, seed=7, test_fraction=0.2, validation_fraction=0.1, temporal_cutoff_year=2010
    )


def test_split_parts_disjoint_and_complete(splits) -> None:
    lab, sp = splits
    for name in ("random", "grouped"):
        parts = [set(sp[name][p]) for p in ("train", "val", "test")]
        assert not (parts[0] & parts[1]) and not (parts[0] & parts[2]) and not (parts[1] & parts[2])
        assert set().union(*parts) == set(lab["row_id"])
    t = sp["temporal"]
    assert not (set(t["train"]) & set(t["test"]))


def test_random_split_is_stratified_80_20(splits) -> None:
    lab, sp = splits
    y = lab.set_index("row_id")["y"].astype(float)
    assert abs(len(sp["random"]["test"]) / len(lab) - 0.2) < 0.01
    assert abs(y.loc[sp["random"]["test"]].mean() - y.mean()) < 0.01


def test_grouped_split_never_straddles_an_arrangement(splits) -> None:
    lab, sp = splits
    arr = lab.set_index("row_id")["arrangement_id"]
    sides = [set(arr.loc[sp["grouped"][p]]) for p in ("train", "val", "test")]
    assert not (sides[0] & sides[2]) and not (sides[0] & sides[1]) and not (sides[1] & sides[2])
    assert 0.15 < len(sp["grouped"]["test"]) / len(lab) < 0.3


def test_temporal_split_respects_cutoff(splits) -> None:
    lab, sp = splits
    year = lab.set_index("row_id")["test_year"]
    assert year.loc[sp["temporal"]["train"] + sp["temporal"]["val"]].max() <= 2010
    assert year.loc[sp["temporal"]["test"]].min() >= 2011


def test_splits_reproduce_with_seed_and_change_without(full) -> None:
    lab = full.labelled
    a = make_splits(lab, seed=3)
    assert a == make_splits(lab, seed=3)
    assert a["random"]["test"] != make_splits(lab, seed=4)["random"]["test"]


def test_empty_split_part_is_a_clear_error(full) -> None:
    with pytest.raises(
        DataError, match=r"split 'temporal' has an empty 'test'.*temporal_cutoff_year"
    ):
        make_splits(full.labelled, seed=1, temporal_cutoff_year=2025)


def test_subsample_keeps_whole_arrangements(full) -> None:
    sub = subsample_arrangements(full.frame, 600, seed=1)
    assert 0 < len(sub) <= 600
    sizes = full.frame.groupby("arrangement_id").size()
    got = sub.groupby("arrangement_id").size()
    assert got.to_dict() == sizes.loc[got.index].to_dict()


# -- near-duplicates, contexts, rates -----------------------------------------------------------
def test_near_duplicates_hand_made() -> None:
    train = [
        "Adopt the budget law",
        "Publish the audit of the central bank",
        "Raise the VAT rate to 16 percent",
    ]
    test = [
        "adopt the  budget LAW",
        "Publish the audit of the central bank accounts",
        "Privatise the railway",
    ]
    r = near_duplicates_across(train, test, threshold=0.7)
    assert r["exact_in_train"] == 1 and r["near_in_train"] == 2 and r["test_rows"] == 3


def test_contexts_held_out_by_country(full) -> None:
    ctx = build_contexts(full.labelled, seed=1, eval_fraction=0.2)
    assert not ctx.duplicated(["country", "arrangement_type", "econ_descriptor"]).any()
    tr, ev = (set(ctx.loc[ctx["split"] == s, "country"]) for s in ("train", "eval"))
    assert tr and ev and not (tr & ev)
    assert ctx["n"].sum() == len(full.labelled)
    assert np.allclose(ctx["met_rate"], ctx["n_met"] / ctx["n"])


@pytest.mark.parametrize("protocol", ["grouped", "random", "temporal"])
def test_evaluation_holdout_is_unseen_by_reward_and_audit(splits, protocol) -> None:
    lab, sp = splits
    ctx = build_contexts(lab, seed=1, eval_fraction=0.2)
    held = ctx.loc[ctx["split"] == "eval", "country"].unique()
    nested, h = nest_evaluation_holdout(lab, sp, protocol, held, seed=1)
    country = lab.set_index("row_id")["country"]
    reward_rows = set(nested[protocol]["train"]) | set(nested[protocol]["val"])
    audit_rows = set(h["audit_train"]) | set(h["audit_val"])
    ref = set(h["reference"])
    # the leak checks: references are rows neither model trained on; the audit shares no row
    assert ref and not (ref & reward_rows) and not (ref & audit_rows)
    assert audit_rows and not (audit_rows & reward_rows)
    assert ref == set(country.index[country.isin(held)])  # every row of the evaluation countries
    assert ref <= set(nested[protocol]["test"]) and audit_rows <= set(nested[protocol]["test"])
    assert set(country.loc[list(reward_rows)]).isdisjoint(held)
    arr = lab.set_index("row_id")["arrangement_id"]
    assert not (set(arr.loc[h["audit_train"]]) & set(arr.loc[h["audit_val"]]))
    others = [p for p in sp if p != protocol]
    assert all(nested[p] == sp[p] for p in others)  # only the reward protocol is nested
    if protocol == "grouped":  # still a grouped split
        assert not (set(arr.loc[list(reward_rows)]) & set(arr.loc[nested[protocol]["test"]]))
    with pytest.raises(DataError, match="reward_protocol"):
        nest_evaluation_holdout(lab, sp, "nope", held, seed=1)


def test_rate_by_wilson_interval() -> None:
    df = pd.DataFrame({"g": ["a"] * 10 + ["b"] * 4, "y": [1] * 7 + [0] * 3 + [1, 1, 1, 1]})
    r = rate_by(df, "g", z=1.96).set_index("g")
    assert r.loc["a", "met_rate"] == pytest.approx(0.7)
    assert r.loc["a", "ci_low"] == pytest.approx(0.3968, abs=1e-3) and r.loc[
        "a", "ci_high"
    ] == pytest.approx(0.8922, abs=1e-3)
    assert r.loc["b", "ci_high"] == pytest.approx(1.0) and r.loc["b", "ci_low"] < 1


# -- MONA files as users have them: xlsx, other delimiters, messy headers, spelled statuses ----
COMPARED = ["country", "arrangement_type", "econ_descriptor", "description", "status", "label"]


def write_xlsx(path: Path, sheets: dict[str, list[list]]) -> Path:
    from openpyxl import Workbook

    wb = Workbook()
    wb.remove(wb.active)
    for title, rows in sheets.items():
        ws = wb.create_sheet(title)
        for r in rows:
            ws.append(r)
    wb.save(path)
    return path


def write_delimited(path: Path, header: list[str], rows: list[list[str]], sep: str) -> Path:
    import csv

    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh, delimiter=sep, lineterminator="\r\n")
        w.writerow(header)
        w.writerows(rows)
    return path


def _as_cell(value: str):
    """A CSV value as a spreadsheet would hold it: dates as dates, round-tripping numbers as numbers."""
    import datetime

    try:
        return datetime.datetime.strptime(value, "%m/%d/%Y")
    except ValueError:
        pass
    try:
        f = float(value)
    except ValueError:
        return value
    return f if repr(f) == value else value


def test_xlsx_export_reads_like_the_csv(current_schema_mona: Path, tmp_path: Path) -> None:
    import csv

    with open(current_schema_mona, newline="", encoding="utf-8") as fh:
        header, *rows = list(csv.reader(fh))
    cells = [[_as_cell(v) for v in r] for r in rows]
    assert any(isinstance(c, float) for r in cells for c in r)  # econ codes as numbers
    n_dates = sum(hasattr(c, "year") for r in cells for c in r)
    assert n_dates > 100  # test and approval dates as date cells
    book = write_xlsx(
        tmp_path / "mona.xlsx",
        {
            "About": [["MONA export, downloaded for the study"], ["see the next sheet"]],
            "Data": [["Monitoring of Fund Arrangements"], [], header, *cells],
        },
    )
    x = load_mona(book)
    c = load_mona(current_schema_mona)
    assert x.report.schema == "imf_current_export" and x.report.encoding == "xlsx"
    fmt = x.report.source_format
    assert "sheet 'Data', header on row 3" in fmt and "'About'" in fmt
    assert x.report.rows_read == 300 and x.report.label_counts == c.report.label_counts
    for col in [*COMPARED, "econ_code", "test_year", "condition_type"]:
        assert x.frame[col].tolist() == c.frame[col].tolist(), col


def test_xlsx_without_the_columns_names_its_sheets(tmp_path: Path) -> None:
    book = write_xlsx(
        tmp_path / "other.xlsx",
        {"Summary": [["Country", "Total"], ["Kenya", 3]], "Blank": []},
    )
    with pytest.raises(DataError) as ei:
        load_mona(book)
    msg = str(ei.value)
    assert "other.xlsx: no sheet has the columns" in msg
    assert "'Summary' (first row ['Country', 'Total'])" in msg and "'Blank' (empty)" in msg
    assert "'PC Status'" in msg and "'Descpt'" in msg  # what was expected


def test_broken_workbooks_are_clear_errors(tmp_path: Path) -> None:
    fake = tmp_path / "fake.xlsx"
    fake.write_bytes(b"PK\x03\x04 not really a workbook")
    with pytest.raises(DataError, match=r"fake\.xlsx: not a readable \.xlsx workbook"):
        load_mona(fake)
    old = tmp_path / "old.xls"
    old.write_bytes(b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1" + b"\0" * 100)
    with pytest.raises(DataError, match=r"old\.xls: an Excel 97-2003 workbook.*save it as \.xlsx"):
        load_mona(old)
    header, rows = read_rows(3)
    only_header = write_xlsx(tmp_path / "h.xlsx", {"S": [header]})
    with pytest.raises(DataError, match=r"h\.xlsx, sheet 'S': only a header row"):
        load_mona(only_header)


@pytest.mark.parametrize(("sep", "name"), [(";", "semicolon"), ("\t", "tab")])
def test_other_delimiters_read_like_comma(
    small_mona: Path, tmp_path: Path, sep: str, name: str
) -> None:
    header, rows = read_rows(300)
    assert any(";" in v for r in rows for v in r) and any("," in v for r in rows for v in r)
    p = write_delimited(tmp_path / "d.csv", header, rows, sep)
    t = load_mona(p)
    ref = load_mona(small_mona)
    assert t.report.source_format == f"CSV, {name}-separated"
    assert ref.report.source_format == "CSV, comma-separated"
    assert t.frame.equals(ref.frame)


def test_excel_sep_hint_line(tmp_path: Path, small_mona: Path) -> None:
    header, rows = read_rows(300)
    p = write_delimited(tmp_path / "d.csv", header, rows, ";")
    p.write_bytes(b"sep=;\r\n" + p.read_bytes())
    t = load_mona(p)
    assert t.report.source_format == "CSV, semicolon-separated"
    assert t.frame.equals(load_mona(small_mona).frame)


def test_wrong_width_message_names_the_delimiter(tmp_path: Path) -> None:
    header, rows = read_rows(10)
    p = write_delimited(tmp_path / "w.csv", header, rows, ";")
    text = p.read_text(encoding="utf-8").splitlines(keepends=True)
    text[4] = text[4].replace(";", ",", 3)
    p.write_text("".join(text), encoding="utf-8", newline="")
    with pytest.raises(DataError, match=r"w\.csv: record 4 .*expected 20 .*semicolon-separated"):
        load_mona(p)


def test_header_names_match_whatever_case_and_spacing(tmp_path: Path, small_mona: Path) -> None:
    header, rows = read_rows(300)
    messy = [f" {h.upper()}\u00a0 " if i % 2 else h.lower() for i, h in enumerate(header)]
    t = load_mona(write_csv(tmp_path / "m.csv", messy, rows))
    assert t.report.schema == "mona_2002_vintage"
    assert t.frame.equals(load_mona(small_mona).frame)
    # the current export's names with doubled inner spaces and odd case
    cur = ["country  name", "ECONOMIC DESCRIPTOR", " Description", "Test\tDate", "pc status"]
    t = load_mona(
        write_csv(tmp_path / "c.csv", cur, [["Kenya", "1.6. Audit", "Audit.", "", "Met"]])
    )
    assert t.report.schema == "imf_current_export"
    assert t.frame[["country", "status", "label"]].values.tolist() == [["KENYA", "M", "MET"]]


def test_colliding_header_names_are_a_clear_error(tmp_path: Path) -> None:
    header = ["Country Name", "Economic Descriptor", "Description", "Test Date", "PC Status"]
    rows = [["Kenya", "1.6. Audit", "Audit the accounts.", "6/30/2010", "M"]]
    with pytest.raises(DataError) as ei:
        load_mona(
            write_csv(tmp_path / "dup.csv", [*header, "Description "], [r + ["x"] for r in rows])
        )
    msg = str(ei.value)
    assert msg.startswith(str(tmp_path / "dup.csv") + ": ")
    assert "column 3 'Description' and column 6 'Description '" in msg
    assert "expected each column name once" in msg
    book = write_xlsx(tmp_path / "dup.xlsx", {"MONA": [[*header, "DESCRIPTION"], rows[0] + ["x"]]})
    with pytest.raises(
        DataError, match=r"dup\.xlsx, sheet 'MONA': column C 'Description' and column F"
    ):
        load_mona(book)


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        ("Met", "M"),
        ("fully met", "M"),
        ("Not met", "NM"),
        ("NOT-MET", "NM"),
        ("Not implemented", "NM"),
        ("Partially met", "PM"),
        ("Partly  met", "PM"),
        ("Waived", "W"),
        ("Delayed", "DL"),
        ("Met with delay", "MD"),
        ("Modified", "MOD"),
        ("Cancelled", "CAN"),
        ("Canceled", "CAN"),
        ("Waived/modified", "WM"),
        ("Met/Modified", "MMOD"),
        ("Prior action", "PA"),
        ("N.M.", "NM"),
        ("Unheard of", "UNHEARDOF"),
        ("-", "-"),
    ],
)
def test_spelled_out_statuses_become_codes(raw, code) -> None:
    assert normalise_status(raw) == code


def test_every_code_and_spelling_normalises_to_its_code() -> None:
    from rlxf_utils.data.schema import KNOWN_STATUSES, STATUS_WORDS

    for code in KNOWN_STATUSES:
        assert normalise_status(code) == code
        assert normalise_status(code.lower()) == code
    for code, words in STATUS_WORDS.items():
        assert code in KNOWN_STATUSES
        for w in words:
            assert normalise_status(w) == code, w
            assert normalise_status(w.upper().replace(" ", "  ")) == code, w


def _status_file(tmp_path: Path, statuses: list[str]) -> Path:
    header = ["Country Name", "Economic Descriptor", "Description", "Test Date", "PC Status"]
    rows = [
        ["Kenya", "1.6. Audit", f"Condition {i}.", "6/30/2010", s] for i, s in enumerate(statuses)
    ]
    return write_csv(tmp_path / "st.csv", header, rows)


SPELLED = ["Met", "Partially met", "Not met", "Waived", "Delayed", "Modified", "Cancelled",
           "Met with delay", "Structural benchmark", "Pending review", "pending review", "??"]  # fmt: skip


def test_spelled_out_statuses_label_like_their_codes(tmp_path: Path) -> None:
    t = load_mona(_status_file(tmp_path, SPELLED[:9]))
    assert t.frame["status"].tolist() == ["M", "PM", "NM", "W", "DL", "MOD", "CAN", "MD", "SB"]
    assert t.frame["label"].tolist() == ["MET", "MET"] + ["Non-MET"] * 6 + ["excluded"]
    assert t.report.unknown_statuses == {}
    st = t.report.status_table.set_index("status_raw")
    assert st.loc["Not met", "status"] == "NM" and st.loc["Not met", "meaning"] == "not met"


def test_unrecognised_status_default_groups_under_non_met(tmp_path: Path, caplog) -> None:
    with caplog.at_level(logging.WARNING):
        t = load_mona(_status_file(tmp_path, SPELLED))
    assert t.report.unknown_statuses == {"PENDINGREVIEW": 2, "??": 1}
    assert t.frame["label"].tolist()[-3:] == ["Non-MET"] * 3
    assert t.report.label_counts == {"Non-MET": 9, "MET": 2, "excluded": 1}
    assert "counted as Non-MET" in caplog.text and "'PENDINGREVIEW': 2" in caplog.text
    assert "WARNING unknown status codes (counted as Non-MET" in t.report.render()


def test_unrecognised_status_excluded(tmp_path: Path, caplog) -> None:
    with caplog.at_level(logging.WARNING):
        t = load_mona(_status_file(tmp_path, SPELLED), unrecognised="exclude")
    assert t.report.unknown_statuses == {"PENDINGREVIEW": 2, "??": 1}
    assert t.frame["label"].tolist()[-3:] == ["excluded"] * 3
    assert t.frame["y"].isna().sum() == 4 and len(t.labelled) == 8
    assert t.report.label_counts == {"Non-MET": 6, "MET": 2, "excluded": 4}
    assert "excluded" in caplog.text and "'??': 1" in caplog.text
    out = t.report.render()
    assert "excluded:   4 (not assessed yet 1; unrecognised status 3)" in out
    assert "WARNING unknown status codes (excluded; data.labels.unrecognised: exclude)" in out


def test_unrecognised_status_error(tmp_path: Path) -> None:
    with pytest.raises(DataError) as ei:
        load_mona(_status_file(tmp_path, SPELLED), unrecognised="error")
    msg = str(ei.value)
    assert "st.csv: column 'PC Status' has 3 unrecognised status value(s)" in msg
    assert "'PENDINGREVIEW': 2" in msg and "first in record 10: 'Pending review'" in msg
    assert "expected a MONA code" in msg and "data.labels.unrecognised is 'error'" in msg
    # nothing unrecognised: the same policy loads
    assert len(load_mona(_status_file(tmp_path, SPELLED[:9]), unrecognised="error").frame) == 9
    # a status the params list is recognised
    t = load_mona(
        _status_file(tmp_path, SPELLED),
        not_assessed=["SB", "PENDINGREVIEW", "??"],
        unrecognised="error",
    )
    assert t.report.unknown_statuses == {} and (t.frame["label"] == "excluded").sum() == 4
    with pytest.raises(DataError, match="expected one of"):
        load_mona(_status_file(tmp_path, SPELLED), unrecognised="maybe")


def test_unrecognised_policy_is_a_param(tmp_path: Path) -> None:
    from rlxf_utils.config import ConfigError, LabelConfig, load_config

    root = Path(__file__).resolve().parent.parent
    for profile in ("smoke", "default", "paper", "full"):
        assert load_config(root / f"params/{profile}.yaml").data.labels.unrecognised == "non_met"
    assert LabelConfig(unrecognised="exclude").unrecognised == "exclude"
    with pytest.raises(ConfigError, match="unrecognised"):
        load_config(
            root / "params/smoke.yaml", overrides={"data": {"labels": {"unrecognised": "drop"}}}
        )


@pytest.mark.parametrize(
    ("encoding", "bom", "how"),
    [("utf-16-le", b"\xff\xfe", "byte-order mark"), ("utf-16-be", b"\xfe\xff", "byte-order mark"),
     ("utf-16-le", b"", "zero bytes"), ("utf-32-le", b"\xff\xfe\x00\x00", "byte-order mark"),
     ("utf-8", b"\xef\xbb\xbf", None)],
)  # fmt: skip
def test_a_spreadsheet_programs_unicode_export_is_read(small_mona, tmp_path, encoding, bom, how):
    """Excel's 'Unicode text' (UTF-16 LE with a BOM, tab-separated), UTF-16 without one, UTF-32
    and UTF-8 with a BOM: read, and the encoding named in the summary."""
    header, rows = read_rows(10)
    rows[0][header.index("Descpt")] = "Adopt the caf\u00e9 law \u2013 phase 1"
    p = tmp_path / "u.csv"
    write_csv(p, header, rows)
    p.write_bytes(bom + p.read_text(encoding="utf-8").replace(",", "\t").encode(encoding))
    t = load_mona(p)
    assert t.report.encoding == encoding
    assert (how is None) == (not t.report.repairs) and (how is None or how in t.report.repairs[0])
    assert t.frame["description"][0] == "Adopt the caf\u00e9 law \u2013 phase 1"
    assert f"encoding:   {encoding}" in t.report.render()


def test_bytes_no_encoding_reads_are_an_error_naming_what_was_tried(tmp_path: Path) -> None:
    p = tmp_path / "b.csv"
    p.write_bytes(b"Country,Descpt\nKenya,\x81\x8d\xff\xfe broken\n")  # invalid UTF-8 and cp1252
    with pytest.raises(
        DataError, match=r"b\.csv: not text in any encoding tried \(utf-8 \(byte \d+\), cp1252"
    ):
        load_mona(p)
    q = tmp_path / "bad16.csv"
    q.write_bytes(
        b"\xff\xfe" + "Country,Descpt\n".encode("utf-16-le") + b"\x00\xd8"
    )  # lone surrogate
    with pytest.raises(DataError, match=r"bad16\.csv: the byte-order mark says utf-16-le"):
        load_mona(q)


def test_exports_joined_together_lose_their_repeated_headers_out_loud(tmp_path: Path) -> None:
    """Two exports concatenated: the second header row became a Non-MET condition (only a
    warning about its status), and rows present twice went unreported."""
    header, rows = read_rows(40)
    joined = write_csv(tmp_path / "joined.csv", header, rows[:30] + [header] + rows[20:40])
    table = load_mona(joined)
    assert table.report.rows_read == 50
    assert "Status" not in set(table.frame["status_raw"])
    repairs = " ".join(table.report.repairs)
    assert "1 repeated header row(s) dropped (first after record 30)" in repairs
    assert (
        "10 record(s) repeat an earlier record exactly (first: record 31, as record 21)" in repairs
    )
    wb = write_xlsx(tmp_path / "joined.xlsx", {"S": [header, *rows[:5], header, *rows[5:10]]})
    assert "1 repeated header row(s) dropped" in " ".join(load_mona(wb).report.repairs)


def test_a_csv_named_xls_is_read_as_the_csv_it_is(small_mona: Path, tmp_path: Path) -> None:
    named = tmp_path / "export.xls"
    named.write_bytes(small_mona.read_bytes())
    table = load_mona(named)
    assert table.report.rows_read == 300 and table.report.source_format.startswith("CSV")
    assert "named .xls but holds text" in " ".join(table.report.repairs)


def test_a_schema_error_does_not_echo_a_foreign_file(tmp_path: Path) -> None:
    secret = tmp_path / "notes.csv"
    secret.write_text("token=hunter2-very-secret\nsecond line\n")
    with pytest.raises(DataError, match=r"found no MONA column \(1 column\(s\), not shown\)") as e:
        load_mona(secret)
    assert "hunter2" not in str(e.value)


# -- the disjoint pools of rows (issue 45) ---------------------------------------------------
def _pools(lab, sp, protocol, fraction=0.25, seed=1):
    ctx = build_contexts(lab, seed=seed, eval_fraction=0.2)
    held = ctx.loc[ctx["split"] == "eval", "country"].unique()
    nested, h = nest_evaluation_holdout(lab, sp, protocol, held, seed=seed)
    return nested, h, carve_policy_pool(lab, nested, h, fraction, seed)


@pytest.mark.parametrize("protocol", ["grouped", "random", "temporal"])
def test_reward_audit_and_policy_pools_are_disjoint_on_the_real_split(splits, protocol) -> None:
    lab, sp = splits
    nested, h0, (out, h) = _pools(lab, sp, protocol)
    arr = lab.set_index("row_id")["arrangement_id"].astype(str)
    country = lab.set_index("row_id")["country"]
    reward = set(out[protocol]["train"]) | set(out[protocol]["val"])
    audit = set(h["audit_train"]) | set(h["audit_val"])
    policy, ref = set(h["policy"]), set(h["reference"])
    assert reward and audit and policy and ref
    for a, b in (
        (reward, audit),
        (reward, policy),
        (audit, policy),
        (ref, reward | audit | policy),
    ):
        assert not (a & b)
    # whole arrangements: no arrangement of the policies is in a judge's rows (no near copy)
    assert not (set(arr.loc[list(policy)]) & set(arr.loc[list(reward | audit)]))
    assert not set(country.loc[list(policy)]) & set(h["eval_countries"])
    # no protocol's reward model learns from a policy row; every test part is unchanged
    for p in sp:
        assert not (set(out[p]["train"]) | set(out[p]["val"])) & policy
        assert out[p]["test"] == nested[p]["test"]
    # the grouped protocol's val (a few whole arrangements: checkpoint and calibration) is whole
    assert out["grouped"]["val"] == nested["grouped"]["val"]
    # the share asked for, of the training countries' rows (whole arrangements: roughly)
    n_tc = len(lab) - len(ref)
    assert abs(len(policy) / n_tc - 0.25) < 0.05
    # every labelled row is in exactly one pool (pool_of_rows raises on a row in two)
    pools = pool_of_rows(lab, out, h)
    assert len(pools) == len(lab) and pools["row_id"].is_unique
    table = pool_table(lab, pools).set_index("pool")
    assert table["rows"].sum() == len(lab) and table.loc["policy", "rows"] == len(policy)
    assert table.loc["reward_train", "rows"] == len(out[protocol]["train"])
    # deterministic from the data and the seed; another seed draws other arrangements
    assert _pools(lab, sp, protocol)[2][1]["policy"] == h["policy"]
    assert _pools(lab, sp, protocol, seed=2)[2][1]["policy"] != h["policy"]


def test_near_duplicates_across_pools_by_hand() -> None:
    """Exact copies (after case and spaces) and near ones (the same words, other punctuation)
    of the policies' rows among the reward model's (train and val) and the audit's, counted by
    hand; rows of other pools (a reference, an unused row) are searched by nobody."""
    from rlxf_utils.data.splits import pool_near_duplicates

    texts = {
        1: ("policy", "Adopt the budget"), 2: ("policy", "Pass the banking law"),
        3: ("policy", "Clear arrears now"), 4: ("policy", "Unique policy text xyz"),
        10: ("reward_train", "adopt  the BUDGET"), 11: ("reward_train", "Raise tax revenue"),
        12: ("reward_val", "Clear arrears, now."),
        20: ("audit_train", "Pass the banking law"), 21: ("audit_val", "Something unrelated entirely"),
        30: ("reference", "Unique policy text xyz"), 31: ("unused", "Raise tax revenue"),
    }  # fmt: skip
    labelled = pd.DataFrame({"row_id": list(texts), "description": [t for _, t in texts.values()]})
    pools = pd.DataFrame({"row_id": list(texts), "pool": [p for p, _ in texts.values()]})
    got = pool_near_duplicates(labelled, pools, threshold=0.9).set_index(["pool", "other"])
    assert list(got.index) == [("policy", "reward"), ("policy", "audit"), ("audit", "reward")]
    assert got.loc[("policy", "reward"), ["rows", "exact_in_other", "near_in_other"]].tolist() == [
        4,
        1,
        2,
    ]
    assert got.loc[("policy", "reward"), ["exact_share", "near_share"]].tolist() == [0.25, 0.5]
    assert got.loc[("policy", "audit"), ["rows", "exact_in_other", "near_in_other"]].tolist() == [
        4,
        1,
        1,
    ]
    assert got.loc[("audit", "reward"), ["rows", "exact_in_other", "near_in_other"]].tolist() == [
        2,
        0,
        0,
    ]
    assert (got["threshold"] == 0.9).all()
    # an empty pool has no share to give
    no_audit = pools.assign(
        pool=pools["pool"].replace({"audit_train": "unused", "audit_val": "unused"})
    )
    empty = pool_near_duplicates(labelled, no_audit, threshold=0.9).set_index(["pool", "other"])
    assert empty.loc[("policy", "audit"), "rows"] == 4 and np.isnan(
        empty.loc[("policy", "audit"), "near_share"]
    )
    assert empty.loc[("audit", "reward"), "rows"] == 0


def test_pools_refuse_a_row_in_two_pools_and_an_impossible_share(splits) -> None:
    lab, sp = splits
    _, _, (out, h) = _pools(lab, sp, "grouped")
    bad = dict(h, audit_train=[*h["audit_train"], h["policy"][0]])
    with pytest.raises(DataError, match="two pools"):
        pool_of_rows(lab, out, bad)
    with pytest.raises(DataError, match="policy_fraction"):
        _pools(lab, sp, "grouped", fraction=0.9)


def test_policy_fraction_leaves_the_reward_model_rows() -> None:
    from rlxf_utils.config.data import SplitConfig

    assert SplitConfig(test_fraction=0.2, policy_fraction=0.25).policy_fraction == 0.25
    with pytest.raises(ValueError, match="policy_fraction"):
        SplitConfig(test_fraction=0.5, policy_fraction=0.5)


def test_the_data_stage_writes_the_pools_every_later_stage_reads(tmp_path) -> None:
    """Notebook 01 on the real file (default profile): each row's pool, the contexts' policy
    rows, and what SFT and RL then read (`eligible_rows`, `load_contexts`) are the policy pool."""
    from rlxf_utils.artifacts import RunDir
    from rlxf_utils.config import PROJECT_ROOT, load_config
    from rlxf_utils.data.contexts import eligible_rows, load_contexts
    from rlxf_utils.data.splits import load_holdout, load_splits
    from rlxf_utils.data.stage import run_data_stage

    cfg = load_config(PROJECT_ROOT / "params/default.yaml")
    run = RunDir(tmp_path / "run")
    run_data_stage(cfg, run)
    labelled, splits = load_splits(run)
    holdout = load_holdout(run)
    pools = run.read_parquet("data/pools.parquet").set_index("row_id")["pool"]
    policy = set(holdout["policy"])
    assert set(pools.index[pools == "policy"]) == policy
    assert set(eligible_rows(labelled, holdout)["row_id"]) == policy
    reward = set(splits[cfg.reward.reward_protocol]["train"]) | set(splits[cfg.reward.reward_protocol]["val"])  # fmt: skip
    assert set(pools.index[pools.str.startswith("reward")]) == reward and not reward & policy
    ctx = run.read_parquet("data/contexts.parquet")
    assert ctx["policy_rows"].sum() == len(policy)
    keys = ["country", "arrangement_type", "econ_descriptor"]
    pool_ctx = set(map(tuple, labelled[labelled["row_id"].isin(policy)][keys].to_numpy()))
    train = load_contexts(run.root, "train")
    assert {tuple(c[k] for k in keys) for c in train} == pool_ctx
