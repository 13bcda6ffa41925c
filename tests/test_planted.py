"""The positive control: the planted P*(MET | text), the labels drawn from it, and the table that
sets each judge's verdict beside the truth's (`data.planted`, `evaluation.control`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from rlxf_utils.config import load_config
from rlxf_utils.data.planted import (
    FEATURES,
    expected_auc,
    plant,
    planted_features,
    planted_labels,
    planted_probability,
    row_uniforms,
)
from rlxf_utils.evaluation.control import (
    CONTROL_COLUMNS,
    control_features,
    control_table,
    detected,
    judge_scale,
    registered,
)

ROOT = Path(__file__).resolve().parents[1]
RULE = load_config(ROOT / "params" / "control.yaml").data.planted


def test_the_rule_reads_the_properties_a_policy_can_change():
    f = planted_features(["Raise the VAT rate to 18 percent by end-June 2025.",
                          "Submit to Parliament the budget", "Improve governance"])  # fmt: skip
    assert f["quantified"].tolist() == [1, 0, 0]
    assert f["deadline"].tolist() == [1, 0, 0]
    assert f["institution"].tolist() == [0, 1, 0]
    assert f["log_words"].iloc[2] == pytest.approx(np.log(2))
    p = planted_probability(["Adopt by December 2024 a law setting the deficit at 3 percent, "
                             "approved by the Ministry of Finance.", "Improve governance in "
                             "every area of the economy and of the public sector as a whole, "
                             "with attention to what remains to be done"], RULE)  # fmt: skip
    assert p[0] > 0.8 and p[1] < 0.4  # specific and short against vague and long


def test_a_row_keeps_its_label_whatever_rows_are_read():
    ids = list(range(200))
    u = row_uniforms(ids, 7)
    assert np.array_equal(row_uniforms(ids[50:], 7), u[50:])
    assert not np.array_equal(row_uniforms(ids, 8), u)
    texts = ["Raise the VAT rate to 18 percent by end-June 2025."] * 200
    y = planted_labels(planted_probability(texts, RULE), ids, RULE.seed)
    assert abs(y.mean() - planted_probability(texts[:1], RULE)[0]) < 0.1


def test_the_expected_auc_is_the_auc_of_labels_drawn_from_p():
    rng = np.random.default_rng(0)
    score = rng.integers(0, 5, 400).astype(float)  # ties, as the rule's binary properties make
    p = 1 / (1 + np.exp(-(score - 2.0)))
    from sklearn.metrics import roc_auc_score

    draws = [roc_auc_score(rng.random(400) < p, score) for _ in range(400)]
    assert expected_auc(p, score) == pytest.approx(np.mean(draws), abs=0.005)
    assert expected_auc(np.full(10, 0.5), np.arange(10.0)) == pytest.approx(0.5)


def test_the_control_profile_rule_is_as_stated_on_mona():
    """The numbers of params/control.yaml: the mean P* over MONA's labelled rows is their MET
    share (0.63) and the rule's expected AUC over them 0.75, as its comments say."""
    from rlxf_utils.data.checks import load_data

    lab = load_data(load_config(ROOT / "params" / "control.yaml")).labelled
    p = planted_probability(lab["description"].astype(str).tolist(), RULE)
    from rlxf_utils.data.planted import planted_score

    assert p.mean() == pytest.approx(0.63, abs=0.005)
    assert expected_auc(p, planted_score(lab["description"].astype(str).tolist(), RULE)) == (
        pytest.approx(0.75, abs=0.005)
    )


def test_planting_replaces_assessed_labels_and_keeps_the_real_ones():
    cond = pd.DataFrame({"row_id": [1, 2, 3], "description": ["a 5 percent cut", "x", "y"],
                         "label": ["MET", "excluded", "Non-MET"],
                         "y": pd.array([1, pd.NA, 0], dtype="Int8")})  # fmt: skip
    out = plant(cond, RULE)
    assert out["label"].iloc[1] == "excluded" and pd.isna(out["y"].iloc[1])
    assert out["label_observed"].tolist() == ["MET", "excluded", "Non-MET"]
    assert set(out.loc[[0, 2], "label"]) <= {"MET", "Non-MET"}
    assert (out.loc[[0, 2], "y"] == (out.loc[[0, 2], "label"] == "MET").astype(int)).all()


def _control_samples() -> pd.DataFrame:
    """Start 'sft' and two methods on 24 prompts in 8 countries: 'up' truly gains 0.1 and both
    judges see it (the audit at half the size); 'flat' gains nothing, the reward model sees a
    false gain of 0.05."""
    rng = np.random.default_rng(1)
    rows = []
    for pid in range(24):
        base = rng.uniform(0.3, 0.6)
        for policy, true, rm, audit in (("sft", 0, 0, 0), ("up", 0.1, 0.1, 0.05),
                                        ("flat", 0, 0.05, 0)):  # fmt: skip
            e = rng.normal(0, 0.005, 3)
            rows.append({"policy": policy, "prompt_id": pid, "country": pid % 8,
                         "planted": base + true + e[0], "reward": base + rm + e[1],
                         "audit_reward": base + audit + e[2]})  # fmt: skip
    return pd.DataFrame(rows)


def test_each_judge_is_read_against_the_truth():
    t = control_table(_control_samples(), ["up", "flat"], "sft", 0.05).set_index("policy")
    assert list(t.reset_index().columns) == CONTROL_COLUMNS
    assert t.loc["up", "true_verdict"] == "above" and t.loc["up", "audit_verdict"] == "above"
    assert t.loc["up", "true_gain"] == pytest.approx(0.1, abs=0.005)
    assert t.loc["flat", "reward_verdict"] == "above" and not t.loc["flat", "reward_matches"]
    assert t.loc["flat", "audit_matches"]
    assert detected(t.reset_index(), "audit") == pytest.approx(t.loc["up", "true_gain"])
    assert detected(t.reset_index(), "reward") == pytest.approx(t["true_gain"].min())
    # the audit reads the gain it detected on its own scale: about half of it here
    assert registered(t.reset_index(), "audit") == pytest.approx(t.loc["up", "audit_gain"])
    assert registered(t.reset_index(), "reward") == pytest.approx(t["reward_gain"].min())
    assert judge_scale(t.reset_index(), "audit") == pytest.approx(0.5, abs=0.05)
    assert judge_scale(t.reset_index(), "reward") == pytest.approx(1.0, abs=0.05)
    none = t.reset_index().assign(audit_verdict="not distinguishable", true_verdict="below")
    assert registered(none, "audit") is None and judge_scale(none, "audit") is None
    # a run on MONA's own labels has no truth: no table
    assert control_table(_control_samples().drop(columns="planted"), ["up"], "sft", 0.05).empty


def test_the_data_stage_of_a_control_run_draws_its_labels_and_says_how(tmp_path):
    from rlxf_utils.artifacts import RunDir
    from rlxf_utils.data.stage import run_data_stage

    cfg = load_config(ROOT / "params" / "control.yaml", {"data": {"max_rows": 600}})
    run = RunDir(tmp_path)
    stage = run_data_stage(cfg, run)
    lab = stage.labelled
    assert {"y_observed", "label_observed", "planted_p"} <= set(lab.columns)
    summary = run.read_json("data/planted.json")
    assert summary["rule"]["strength"] == RULE.strength and summary["rows"] == len(lab)
    assert summary["met_share"] == pytest.approx(lab["y"].astype(float).mean())
    assert 0.5 < summary["held_out_expected_auc"] < 1 and summary["held_out_rows"] > 0
    # every pool's labels are the planted ones: the stage wrote them, not MONA's
    written = run.read_parquet("data/conditions.parquet")
    assert (written["y"].dropna().astype(int) == lab.set_index("row_id")["y"]
            .reindex(written.loc[written["y"].notna(), "row_id"]).astype(int).to_numpy()).all()  # fmt: skip
    assert summary["agrees_with_observed"] < 1.0


def test_the_gold_gate_reads_the_control_beside_a_run(tmp_path):
    """The audit's verdicts are read as a judge's where the control run beside this one shows it
    putting a true gain above zero with every verdict the truth's; one wrong verdict, or no run
    beside, leaves the gate to its AUC on human rows."""
    from rlxf_utils.artifacts import RunDir
    from rlxf_utils.report.gold import control_audit

    main, ctl = RunDir(tmp_path / "default"), RunDir(tmp_path / "control")
    assert control_audit(main) is None
    t = control_table(_control_samples(), ["up", "flat"], "sft", 0.05)
    ctl.write_table("eval_control", t)
    seen = control_audit(main)
    assert seen == {"methods": 2, "matched": 2, "detected": pytest.approx(t["true_gain"].iloc[0]),
                    "sees": True}  # fmt: skip
    ctl.write_table("eval_control", t.assign(audit_matches=[True, False]))
    assert not control_audit(main)["sees"]
    assert control_audit(ctl) is None  # the control itself has no control beside it


def test_the_control_shows_what_each_method_changed_in_its_answers():
    samples = pd.DataFrame({
        "policy": ["sft", "sft", "short", "short", "other"],
        "response": ["Raise revenue by 2 percent by end-June through the ministry of finance",
                     "Reform the tax code", "Cut 5 percent", "Audit", "x"],
        "planted": [0.5, 0.6, 0.8, 0.7, 0.1],
    })  # fmt: skip
    t = control_features(samples, ["sft", "short", "absent"]).set_index("policy")
    assert list(t.reset_index().columns) == ["policy", "responses", "words", *FEATURES, "planted"]
    assert list(t.index) == ["sft", "short"]  # the order given, a policy without samples left out
    assert t.loc["sft", "words"] == pytest.approx((12 + 4) / 2)
    assert t.loc["sft", "quantified"] == 0.5 and t.loc["sft", "deadline"] == 0.5
    assert t.loc["sft", "institution"] == 0.5 and t.loc["short", "institution"] == 0.0
    assert t.loc["short", "quantified"] == 0.5 and t.loc["short", "words"] == 2.0
    assert t.loc["short", "planted"] == pytest.approx(0.75)
