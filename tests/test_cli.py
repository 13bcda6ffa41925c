from __future__ import annotations

from pathlib import Path

from rlxf_utils.cli import main


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
