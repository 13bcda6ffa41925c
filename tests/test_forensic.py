"""Tests of the forensic arm: the one Comments reader, its inputs, metrics with CIs, the stage."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import read_rows, write_csv
from test_reward import _cfg, _tiny_factory

import rlxf_utils
from rlxf_utils.artifacts import RunDir
from rlxf_utils.config import ConfigError, ForensicConfig, load_config
from rlxf_utils.data.mona import load_mona
from rlxf_utils.data.schema import DataError
from rlxf_utils.data.splits import make_splits
from rlxf_utils.prompts import serialize_frame
from rlxf_utils.report import forensic as rs
from rlxf_utils.reward import forensic as F
from rlxf_utils.reward.calibration import classification_metrics

PKG = Path(rlxf_utils.__file__).resolve().parent
ROOT = PKG.parent


def _labelled(path: Path) -> pd.DataFrame:
    t = load_mona(path)
    return t.labelled


# -- the loader --------------------------------------------------------------------------------
def test_loader_joins_comments_and_dates_by_row_id(small_mona: Path) -> None:
    header, rows = read_rows(300)
    lab = _labelled(small_mona)
    out = F.load_forensic_fields(small_mona, lab)
    assert len(out) == len(lab) and out["row_id"].tolist() == lab["row_id"].tolist()
    ci, ti, ai = header.index("Comments"), header.index("TestDate"), header.index("ArrID")
    for rid in out["row_id"].sample(25, random_state=0):
        r = out.set_index("row_id").loc[rid]
        assert r["comments"] == " ".join(rows[rid][ci].split())
        assert r["forensic_test_date"] == " ".join(rows[rid][ti].split())
        assert r["forensic_arrangement_id"] == rows[rid][ai].strip()
    assert (out["comments"] != "").any()


def test_loader_refuses_a_file_whose_rows_differ(tmp_path: Path, small_mona: Path) -> None:
    lab = _labelled(small_mona)
    header, rows = read_rows(300)
    rid = int(lab["row_id"].iloc[10])
    rows[rid][header.index("Descpt")] = "A different condition text."
    changed = write_csv(tmp_path / "changed.csv", header, rows)
    with pytest.raises(DataError, match=rf"changed\.csv: 1 row\(s\) .*'description'.*row_id {rid}"):
        F.load_forensic_fields(changed, lab)
    short = write_csv(tmp_path / "short.csv", header, rows[:50])
    with pytest.raises(DataError, match=r"short\.csv: .*row_id \d+ but the file has 50 records"):
        F.load_forensic_fields(short, lab)
    with pytest.raises(KeyError, match="description"):
        F.load_forensic_fields(small_mona, lab.drop(columns=["description"]))
    with pytest.raises(DataError, match="file not found"):
        F.load_forensic_fields(tmp_path / "nope.csv", lab)


# -- inputs ------------------------------------------------------------------------------------
def _frame() -> pd.DataFrame:
    return pd.DataFrame(
        {
            "row_id": [0, 1],
            "country": ["GHANA", "PERU"],
            "arrangement_type": ["ECF", "SBA"],
            "econ_descriptor": ["1.1. Tax policy", "2.3. Central bank"],
            "description": ["Adopt the budget.", "Audit the bank."],
            "comments": ["Met at P1R1.", "A waiver was granted."],
            "forensic_test_date": ["09/21/2007", "Second Review Prior action"],
            "forensic_approval_date": ["06/26/2006", ""],
            "forensic_board_date": ["01/13/2010", "2 Jul 2006"],
            "forensic_review_type": ["R6", "R2"],
            "forensic_review_sequence": ["L", "EL"],
            "forensic_initial_end_date": ["", ""],
            "forensic_revised_end_date": ["", ""],
            "forensic_arrangement_id": ["570", "PERU|SBA|"],
        }
    )


def test_inputs_per_variant_hold_what_they_name() -> None:
    f = _frame()
    assert F.forensic_inputs(f, "description") == ["Adopt the budget.", "Audit the bank."]
    assert F.forensic_inputs(f, "paper_input") == serialize_frame(f)
    assert not any("Met at" in x for x in F.forensic_inputs(f, "paper_input"))
    com = F.forensic_inputs(f, "staff_comments")
    assert "Met at P1R1." in com[0] and "Adopt" not in com[0]
    dates = F.forensic_inputs(f, "dates")
    assert "test_date_y2007 test_date_m2007_09" in dates[0] and "board_date_m2010_01" in dates[0]
    assert "test_date: Second Review Prior action" in dates[1] and "board_date_y2006" in dates[1]
    assert "Met at" not in dates[0] and "Adopt" not in dates[0]
    assert F.forensic_inputs(f, "arrangement_id") == ["arrangement_570", "arrangement_PERU|SBA|"]
    comb = F.forensic_inputs(f, "combined")
    for part in ("arrangement_570", "test_date_y2007", "Met at P1R1.", "Country: GHANA", "Adopt"):
        assert part in comb[0]
    with pytest.raises(ValueError, match="unknown forensic variant 'status'"):
        F.forensic_inputs(f, "status")
    with pytest.raises(KeyError, match="load_forensic_fields"):
        F.forensic_inputs(f.drop(columns=["comments"]), "staff_comments")


# -- metrics -----------------------------------------------------------------------------------
def test_bootstrap_metrics_resample_whole_arrangements() -> None:
    """Conditions of one arrangement share their outcome and score here, so resampling rows
    treats 40 arrangements as 400 independent rows; resampling arrangements widens the interval."""
    rng = np.random.default_rng(5)
    arrangement = np.repeat(np.arange(40), 10)
    y = np.repeat((rng.random(40) < 0.6).astype(int), 10)
    p = np.repeat(0.15 * y[::10] + rng.random(40) * 0.85, 10)
    rows = F.bootstrap_metrics(y, p, n_boot=400, alpha=0.05, seed=2)
    whole = F.bootstrap_metrics(y, p, n_boot=400, alpha=0.05, seed=2, clusters=arrangement)
    assert rows["n_clusters"] == 400 and whole["n_clusters"] == 40
    assert whole["accuracy"] == rows["accuracy"] == classification_metrics(y, p)["accuracy"]
    for m in F.METRICS:
        assert whole[f"{m}_high"] - whole[f"{m}_low"] > 1.5 * (
            rows[f"{m}_high"] - rows[f"{m}_low"]
        ), m


def test_bootstrap_metrics_cis_bracket_the_point_and_follow_alpha() -> None:
    rng = np.random.default_rng(0)
    y = (rng.random(400) < 0.6).astype(int)
    p = np.clip(0.25 * y + rng.random(400) * 0.75, 0, 1)
    a = F.bootstrap_metrics(y, p, n_boot=400, alpha=0.05, seed=1)
    assert a == F.bootstrap_metrics(y, p, n_boot=400, alpha=0.05, seed=1)
    assert a["n"] == 400
    for m in F.METRICS:
        assert a[f"{m}_low"] <= a[m] <= a[f"{m}_high"], m
    assert a["accuracy"] == pytest.approx(classification_metrics(y, p)["accuracy"])
    b = F.bootstrap_metrics(y, p, n_boot=400, alpha=0.5, seed=1)
    assert b["f1_high"] - b["f1_low"] < a["f1_high"] - a["f1_low"]
    with pytest.raises(ValueError, match="alpha"):
        F.bootstrap_metrics(y, p, 100, 1.5, 0)
    with pytest.raises(ValueError, match="equal, non-empty"):
        F.bootstrap_metrics(y, p[:-1], 100, 0.05, 0)


# -- models per variant ------------------------------------------------------------------------
def _synthetic(n: int = 240, seed: int = 0) -> tuple[pd.DataFrame, dict[str, list[int]]]:
    """Comments state the outcome, descriptions are noise: only the comments variant can learn."""
    rng = np.random.default_rng(seed)
    y = (rng.random(n) < 0.6).astype(int)
    f = pd.concat([_frame()] * (n // 2), ignore_index=True)
    f["row_id"] = np.arange(n)
    f["description"] = [" ".join(rng.choice(["plan", "law", "tax", "bank"], 4)) for _ in range(n)]
    f["comments"] = np.where(y == 1, "met on time", "waiver granted delayed")
    f["y"] = y
    ids = list(range(n))
    return f, {"train": ids[:150], "val": ids[150:180], "test": ids[180:]}


def test_run_forensic_finds_the_leak_and_scores_the_encoder() -> None:
    f, split = _synthetic()
    cfg = _cfg(epochs=1)
    table, pred = F.run_forensic(
        f, split, cfg, seed=0, variants=["description", "staff_comments"], encoder_variants=["staff_comments"],
        n_boot=200, alpha=0.05, model_factory=_tiny_factory(F.forensic_inputs(f, "staff_comments")),
    )  # fmt: skip
    t = table.set_index(["model", "variant"])
    assert list(table["model"]) == ["majority", "tfidf", "tfidf", "encoder"]
    assert t.loc[("tfidf", "staff_comments"), "accuracy_low"] > 0.95
    assert t.loc[("tfidf", "description"), "accuracy_high"] < 0.9
    assert not t.loc[("tfidf", "staff_comments"), "allowed_by_protocol"]
    assert t.loc[("tfidf", "description"), "allowed_by_protocol"]
    maj = t.loc[("majority", "none")]
    assert maj["recall"] == 1.0 and maj["accuracy"] == pytest.approx(f["y"].iloc[180:].mean())
    assert len(pred) == 60 and pred["p_encoder_staff_comments"].between(0, 1).all()
    with pytest.raises(ValueError, match="unknown forensic variant"):
        F.run_forensic(f, split, cfg, 0, ["status"])
    with pytest.raises(KeyError, match="split lacks 'val'"):
        F.run_forensic(f, {"train": [], "test": []}, cfg, 0, ["staff_comments"])
    with pytest.raises(KeyError, match=r"split\.test: 1 row_ids"):
        F.run_forensic(f, {**split, "test": [10_000]}, cfg, 0, ["staff_comments"])


# -- the stage ---------------------------------------------------------------------------------
def _tiny_run(tmp_path: Path, small_mona: Path) -> tuple[RunDir, object]:
    t = load_mona(small_mona)
    run = RunDir(tmp_path / "run")
    splits = make_splits(t.labelled, 0, 0.2, 0.1, 2006)
    run.write_parquet("data/conditions.parquet", t.frame)
    run.write_json("data/splits.json", splits)
    run.write_json("data/load_report.json", t.report.as_dict())
    cfg = load_config(
        ROOT / "params" / "smoke.yaml",
        overrides={
            "data": {"path": str(small_mona), "sha256": None},
            "evaluation": {"n_boot": 200},
        },
    )
    return run, cfg


def test_stage_writes_its_outputs_and_never_touches_reward_model(
    tmp_path: Path, small_mona: Path
) -> None:
    run, cfg = _tiny_run(tmp_path, small_mona)
    bundle = run.path("reward_model/bundle.json")
    bundle.write_text('{"kind": "rlxf-reward-bundle"}')
    before = {p: p.stat().st_mtime_ns for p in run.root.rglob("*")}
    st = F.run_forensic_stage(cfg, run)
    after = {p for p in run.root.rglob("*") if p.is_file()}
    new = {str(p.relative_to(run.root)) for p in after if p not in before}
    assert new == {
        "reward/forensic.parquet", "reward/forensic.json", "tables/reward_forensic.csv",
        "tables/reward_forensic.md", "figures/reward_forensic.png",
    }  # fmt: skip
    assert sorted(p.name for p in run.path("reward_model").iterdir()) == ["bundle.json"]
    assert bundle.stat().st_mtime_ns == before[bundle]
    table = run.read_parquet("reward/forensic.parquet")
    assert set(table["variant"]) == {"none", *cfg.forensic.variants}
    assert (table["paper_claim"] == F.PAPER_CLAIM).all()
    meta = json.loads(run.path("reward/forensic.json").read_text())
    assert meta["feeds_rl"] is False and meta["alpha"] == cfg.evaluation.alpha
    assert "p. 17" in meta["paper_claim_source"] and meta["stage_seconds"] > 0
    assert len(st.table) == len(table)


def test_stage_refuses_a_changed_file_and_a_disabled_arm(tmp_path: Path, small_mona: Path) -> None:
    run, cfg = _tiny_run(tmp_path, small_mona)
    report = run.read_json("data/load_report.json")
    run.write_json("data/load_report.json", {**report, "sha256": "0" * 64})
    with pytest.raises(DataError, match="differs from the file notebook 01 read"):
        F.run_forensic_stage(cfg, run)
    cfg.forensic.enabled = False
    with pytest.raises(ValueError, match="forensic.enabled is false"):
        F.run_forensic_stage(cfg, run)


# -- the Comments rule: forensic.py is the one named exception ----------------------------------
#: Deny-lists that name the column in order to keep it out (not reads).
DENY_LISTS = {("data/schema.py", "OUTCOME_COLUMNS"), ("prompts.py", "FORBIDDEN_FIELDS")}
#: the forensic arm, the one module that may read the post-assessment Comments
ARM = "reward/forensic.py"


def _comment_literals(tree: ast.AST) -> list[tuple[int, str | None]]:
    """(line, assigned name or None) of every string constant 'comments' (any case)."""
    found = []
    for stmt in ast.walk(tree):
        if isinstance(stmt, ast.Assign | ast.AnnAssign):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            for node in ast.walk(stmt.value) if stmt.value else []:
                if isinstance(node, ast.Constant) and str(node.value).lower() == "comments":
                    found.append((node.lineno, names[0] if names else None))
    seen = {ln for ln, _ in found}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and node.value.strip().lower() == "comments"
            and node.lineno not in seen
        ):
            found.append((node.lineno, None))
    return found


def test_only_forensic_reads_the_comments_column() -> None:
    offenders = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if rel != ARM:
            for line, name in _comment_literals(tree):
                if (rel, name) not in DENY_LISTS:
                    offenders.append(f"{rel}:{line} names the Comments column")
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Name)
                    and node.id == "OUTCOME_COLUMNS"
                    and rel != "data/schema.py"
                ):
                    offenders.append(f"{rel}:{node.lineno} uses data.OUTCOME_COLUMNS")
                if isinstance(node, ast.ImportFrom | ast.Import):
                    base = getattr(node, "module", None) or ""
                    mods = [base, *(f"{base}.{a.name}" for a in node.names)]
                    if any(m.endswith("reward.forensic") for m in mods):
                        offenders.append(f"{rel}:{node.lineno} imports the forensic module")
    assert not offenders, f"only rlxf_utils/{ARM} may read Comments:\n" + "\n".join(offenders)
    # and the scan does see a reader: the arm itself uses the column list
    src = (PKG / ARM).read_text(encoding="utf-8")
    assert "OUTCOME_COLUMNS" in src and "def load_forensic_fields" in src


def test_the_scan_catches_a_new_reader() -> None:
    tree = ast.parse('x = frame["Comments"]\nOUTCOME_COLUMNS = ("Comments",)\n')
    found = sorted(_comment_literals(tree), key=lambda t: t[0])
    assert found == [(1, "x"), (2, "OUTCOME_COLUMNS")]
    assert sorted(_comment_literals(ast.parse('f(d["comments"])'))) == [(1, None)]


def test_forensic_saves_no_model() -> None:
    tree = ast.parse((PKG / ARM).read_text(encoding="utf-8"))
    calls = [
        n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
    ]
    assert not [c for c in calls if c.startswith("save") or c == "save_pretrained"]
    strings = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]  # fmt: skip
    writes = [s for s in strings if s.startswith(("reward/", "tables/", "figures/"))]
    assert writes and not [s for s in strings if s.startswith("reward_model")]


# -- config ------------------------------------------------------------------------------------
def test_forensic_config_validation(tmp_path: Path) -> None:
    assert ForensicConfig().variants[1] == "paper_input" and ForensicConfig().encoder_variants == []
    with pytest.raises(ValueError, match="paper_input"):
        ForensicConfig(variants=["staff_comments"])
    with pytest.raises(ValueError, match=r"encoder_variants lists \['dates'\] more than once"):
        ForensicConfig(encoder_variants=["dates", "dates"])
    with pytest.raises(ConfigError, match=r"forensic\.variants\.1"):
        load_config(
            ROOT / "params" / "smoke.yaml",
            overrides={"forensic": {"variants": ["paper_input", "status"]}},
        )


# -- the report's prose ------------------------------------------------------------------------
def _row(variant: str, allowed: bool, low: float, high: float, model: str = "tfidf") -> dict:
    mid = (low + high) / 2
    r = {"variant": variant, "model": model, "allowed_by_protocol": allowed}
    for m in ("accuracy", "precision", "recall", "f1"):
        r.update({m: mid, f"{m}_low": low, f"{m}_high": high})
    return r


def test_claim_position_reads_the_intervals_not_the_points() -> None:
    above = pd.Series(_row("a", False, 0.83, 0.9))
    assert rs.claim_position(above, 0.82) == "above"
    straddle = pd.Series({**_row("b", False, 0.83, 0.9), "accuracy_low": 0.81, "accuracy": 0.86})
    assert rs.claim_position(straddle, 0.82) == "not distinguishable"  # a `stats.VERDICTS` code
    one_below = pd.Series({**_row("c", False, 0.83, 0.9), "recall_low": 0.75, "recall_high": 0.80})
    assert rs.claim_position(one_below, 0.82) == "below"


def test_forensic_verdict_is_chosen_from_the_intervals() -> None:
    # which variants stand where, and which conclusion; the words are the golden file's
    # (tests/test_report_forensic.py)
    majority = _row("none", True, 0.6, 0.66, model="majority")
    leak = pd.DataFrame(
        [majority, _row("paper_input", True, 0.63, 0.69), _row("staff_comments", False, 0.83, 0.87),
         _row("dates", False, 0.8, 0.84)]
    )  # fmt: skip
    groups, conclusion, reaching = rs.claim_groups(leak, 0.82)
    assert (conclusion, reaching) == ("only forbidden", ["staff_comments"])
    allowed, forbidden = groups
    assert allowed["allowed"] and not forbidden["allowed"]
    assert [r["variant"] for r in allowed["short"]] == ["paper_input"] and not allowed["up"]
    assert allowed["best"]["variant"] == "paper_input"
    assert [r["variant"] for r in forbidden["up"]] == ["staff_comments"]
    assert [r["variant"] for r in forbidden["mid"]] == ["dates"]  # the majority class is left out
    assert forbidden["up"][0]["label"] == "TF-IDF + LR"
    v = rs.forensic_verdict(leak, 0.82, 0.05)
    assert "95%" in v and "82%" in v and "staff comments (TF-IDF + LR)" in v
    allowed_up = leak.assign(**{c: 0.85 for c in ("accuracy_low", "precision_low", "recall_low", "f1_low")})  # fmt: skip
    assert rs.claim_groups(allowed_up, 0.82)[1] == "allowed"
    assert "90%" in rs.forensic_verdict(allowed_up, 0.82, 0.1)
    nothing = pd.DataFrame([majority, _row("paper_input", True, 0.6, 0.7), _row("dates", False, 0.6, 0.7)])  # fmt: skip
    assert rs.claim_groups(nothing, 0.82)[1:] == ("none", [])
    unclear = pd.DataFrame([_row("paper_input", True, 0.8, 0.84), _row("staff_comments", False, 0.83, 0.9)])  # fmt: skip
    assert rs.claim_groups(unclear, 0.82)[1:] == ("forbidden", ["staff_comments"])


def test_forensic_section_from_the_stage_and_when_off(tmp_path: Path, small_mona: Path) -> None:
    run, cfg = _tiny_run(tmp_path, small_mona)
    F.run_forensic_stage(cfg, run)
    v, inc = rs.forensic_section(run, {"forensic": {"enabled": True}})
    assert v["claim"] == "82%" and v["protocol"] == "random" and "p. 17" in v["claim_source"]
    assert (
        v["fields"].startswith("`Comments`, `TestDate`") and "encoder_variants" in v["encoder_note"]
    )
    md = inc["reward_forensic.md"]
    assert "| staff comments | TF-IDF + LR | no |" in md and r"accuracy \[95% CI\]" in md
    assert "82%" in v["verdict"] and "staff comments" in v["verdict"]
    off, inc_off = rs.forensic_section(run, {"forensic": {"enabled": False}})
    assert "not run" in off["verdict"] and "not run" in inc_off["reward_forensic.md"]
