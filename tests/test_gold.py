"""A judge that can judge (issue 46, item 7): the attainable ceiling under each judge
(`evaluation.history.ceiling_table`) and the gold's own discrimination deciding what a null
under it says (`report.gold`)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from rlxf_utils.artifacts import RunDir
from rlxf_utils.evaluation.history import ceiling_table, history_contrast
from rlxf_utils.report.findings import rl_finding
from rlxf_utils.report.gold import ceiling, gold_auc, gold_cannot_judge
from rlxf_utils.report.overopt import point
from rlxf_utils.stats import cluster_t


def _history() -> pd.DataFrame:
    """8 prompts in 4 countries; MET descriptions score 0.1 + 0.01 x prompt above Non-MET under
    the reward model and half that under the audit; prompt 7 has no Non-MET history."""
    rows = []
    for p in range(8):
        base = 0.4 + 0.02 * p
        for j in range(2):
            rows.append({"policy": "history_met", "prompt_id": p, "sample_id": j,
                         "country": f"C{p // 2}", "reward": base + 0.1 + 0.01 * p + 0.001 * j,
                         "audit_reward": base / 2 + 0.05 + 0.005 * p})  # fmt: skip
            if p < 7:
                rows.append({"policy": "history_nonmet", "prompt_id": p, "sample_id": j,
                             "country": f"C{p // 2}", "reward": base - 0.001 * j,
                             "audit_reward": base / 2})  # fmt: skip
    return pd.DataFrame(rows)


def test_the_ceiling_is_met_over_nonmet_with_a_cluster_t_interval_over_countries():
    t = ceiling_table(history_contrast(_history(), 200, 0.05, 0), 0.05).set_index("judge")
    assert list(t.index) == ["reward model", "audit"]
    d = 0.1 + 0.01 * np.arange(7) + 0.001  # per prompt: the two samples' means, MET - Non-MET
    r = t.loc["reward model"]
    assert (r["n"], r["n_clusters"]) == (7, 4)  # only prompts with both
    assert r["diff"] == pytest.approx(d.mean())
    want = cluster_t(d, [f"C{p // 2}" for p in range(7)], 0.05)
    assert (r["ci_low"], r["ci_high"]) == pytest.approx((want["low"], want["high"]))
    assert r["ci_level"] == pytest.approx(0.95) and r["method"] == "cluster t over countries"
    assert t.loc["audit", "diff"] == pytest.approx((0.05 + 0.005 * np.arange(7)).mean())
    assert ceiling_table({}, 0.05).empty


def _run_with(tmp_path, auc_low: float) -> RunDir:
    run = RunDir(tmp_path)
    if not run.exists("eval/summary.json"):
        run.write_json("eval/summary.json", {"alpha": 0.05})
    run.write_table("reward_reference_check", pd.DataFrame({
        "model": ["encoder (protocol train rows)", "audit (disjoint rows)"], "rows": [300, 300],
        "met_share": [0.6, 0.6], "mean_p": [0.6, 0.5], "auc": [0.7, 0.56],
        "auc_low": [0.65, auc_low], "auc_high": [0.75, 0.64]}))  # fmt: skip
    return run


def test_a_gold_at_chance_cannot_confirm_or_refute_a_gain(tmp_path):
    gold = gold_auc(_run_with(tmp_path, 0.48))
    assert gold == {"auc": 0.56, "low": 0.48, "high": 0.64, "rows": 300, "level": "95%",
                    "above_chance": False, "control": None, "can_judge": False}  # fmt: skip
    assert gold_cannot_judge(gold, -0.01, 0.02)
    # a rise or a fall under a gold at chance is no verdict either (issue 59, item 4)
    assert gold_cannot_judge(gold, 0.01, 0.02) and gold_cannot_judge(gold, -0.02, -0.01)
    assert not gold_cannot_judge(gold, float("nan"), float("nan"))  # no interval, no claim
    p = pd.Series({"proxy": 0.05, "proxy_low": 0.03, "proxy_high": 0.07,
                       "gold": 0.004, "gold_low": -0.004, "gold_high": 0.012})  # fmt: skip
    assert point(p, gold=gold)["gold"]["cannot_judge"]  # the proxy's interval is a verdict still
    assert "cannot_judge" not in point(p, gold=gold)["proxy"]
    able = gold_auc(RunDir(_run_with(tmp_path / "b", 0.52).root))
    assert able["can_judge"] and not gold_cannot_judge(able, -0.01, 0.02)
    assert not point(p, gold=able)["gold"]["cannot_judge"]
    assert gold_auc(RunDir(tmp_path / "none")) is None


def test_the_ceiling_reads_the_table(tmp_path):
    run = RunDir(tmp_path)
    assert ceiling(run) is None
    run.write_table("eval_ceiling", ceiling_table(history_contrast(_history(), 200, 0.05, 0), 0.05))
    c = ceiling(run)
    assert (c["n"], c["clusters"], c["alpha"]) == (7, 4, pytest.approx(0.05))
    assert [r["judge"] for r in c["rows"]] == ["reward model", "audit"]
    assert [round(r["diff"], 3) for r in c["rows"]] == [0.131, 0.065]
    assert all(r["low"] < r["diff"] < r["high"] for r in c["rows"])


def test_the_rl_finding_says_what_a_gold_at_chance_cannot_tell():
    rows = pd.DataFrame([("PPO", "RL", 0.02, 0.01, 0.03, 0.001, -0.004, 0.006, 0.1, "below")],
                        columns=["method", "group", "gain", "gain_low", "gain_high", "audit_gain",
                                 "audit_gain_low", "audit_gain_high", "kl", "vs_best_of_n"])  # fmt: skip
    at_chance = rl_finding(rows, "sft", "99%", gold_at_chance=True)
    assert at_chance["gold_at_chance"] and at_chance["level"] == "99%"
    # the audit's null (its bound) is kept for a judge that can judge
    assert rl_finding(rows, "sft", "99%")["audit"] == {"up": [], "down": [], "nulls": 1,
                                                       "top": 0.006}  # fmt: skip


@pytest.mark.parametrize("auc_low", [0.48, 0.52])
def test_the_per_policy_sentences_read_the_gold_by_its_discrimination(tmp_path, auc_low):
    from test_eval_design import _report_run

    from rlxf_utils.report.evaluation import algos_context
    from rlxf_utils.stats import ci_sign

    run, s, _ = _report_run(tmp_path, {"ppo": 0.05, "grpo": 0.0})
    _run_with(run.root, auc_low)  # the reference check, into the same run
    s = s.set_index("policy")
    algos = algos_context(s, ["ppo", "grpo"], "sft", "99%", 0.01, gold_auc(run))["algos"]
    nulls = [
        a
        for a in ("ppo", "grpo")
        if ci_sign(s.loc[a, "audit_gain_low"], s.loc[a, "audit_gain_high"]) == 0
    ]
    assert nulls  # the constructed audit gains leave at least one null
    at_chance = [a["policy"] for a in algos if a["audit"]["cannot_judge"]]
    said = [a["policy"] for a in algos if a["gold_words"]]
    if auc_low < 0.5:  # every audit claim, null or not, is one the gold cannot judge
        assert at_chance == ["ppo", "grpo"] and said == ["ppo"]  # its AUC, said once
    else:
        assert at_chance == [] and said == []


# -- every audit claim read against the audit's own discrimination (issue 59, item 4) -----------
CHANCE = {"auc": 0.53, "low": 0.47, "high": 0.59, "rows": 300, "level": "95%", "can_judge": False}
ABLE = {**CHANCE, "low": 0.51, "can_judge": True}
HEDGE = "unable to tell MET from Non-MET above chance cannot interpret"


def _summary(audit: tuple[float, float, float]) -> pd.DataFrame:
    """One RL policy whose reward gain and audit gain (`audit`: est, low, high) are injected."""
    return pd.DataFrame({
        "policy": ["sft", "ppo"], "ave_r": [0.55, 0.6], "ave_r_low": [0.54, 0.59],
        "ave_r_high": [0.56, 0.61], "gain": [float("nan"), 0.05], "gain_low": [float("nan"), 0.02],
        "gain_high": [float("nan"), 0.08], "gain_p_family": [float("nan"), 0.01],
        "audit_gain": [float("nan"), audit[0]], "audit_gain_low": [float("nan"), audit[1]],
        "audit_gain_high": [float("nan"), audit[2]], "audit_gain_p_family": [float("nan"), 0.02],
        "kl": [0.0, 1.2], "gap_low": [float("nan"), -0.01], "gap_high": [float("nan"), 0.04],
    }).set_index("policy")  # fmt: skip


@pytest.mark.parametrize("audit, word", [((0.03, 0.01, 0.05), "up, a rise"),
                                         ((-0.03, -0.05, -0.01), "down, a fall")])  # fmt: skip
def test_an_audit_raise_or_fall_under_an_audit_at_chance_is_hedged(audit, word):
    from rlxf_utils.report.evaluation import algos_context
    from rlxf_utils.report.wording import sentence

    at_chance = algos_context(_summary(audit), ["ppo"], "sft", "99%", None, CHANCE)
    text = sentence("eval", "algo_sentences", at_chance)
    assert f"moved the audit model's reward {word} that an audit {HEDGE}" in text
    assert "the audit's AUC on 300 held-out rows, 0.530 [0.470, 0.590]" in text
    assert "the audit model's reward (" not in text  # no plain 'raised/lowered the audit ...'
    conclusion = sentence("eval", "conclusion", at_chance)
    assert HEDGE in conclusion and "the disjoint-rows audit reward" not in conclusion
    # an audit that can judge gives its verdict plainly
    able = sentence("eval", "algo_sentences",
                    algos_context(_summary(audit), ["ppo"], "sft", "99%", None, ABLE))  # fmt: skip
    plain = "raised" if audit[0] > 0 else "lowered"
    assert f"{plain} the audit model's reward (" in able and HEDGE not in able


def test_the_gold_curve_findings_and_offline_clauses_hedge_a_move_under_a_gold_at_chance():
    from rlxf_utils.report.offline import methods_context
    from rlxf_utils.report.wording import sentence

    p = pd.Series({"proxy": 0.05, "proxy_low": 0.03, "proxy_high": 0.07,
                   "gold": 0.03, "gold_low": 0.01, "gold_high": 0.05})  # fmt: skip
    hedged = sentence("overopt", "pair", point(p, gold=CHANCE), None)
    assert f"while the gold rose, a rise that a gold {HEDGE}" in hedged
    assert "raised the gold" in sentence("overopt", "pair", point(p, gold=ABLE), None)
    rows = pd.DataFrame([("PPO", "RL", 0.02, 0.01, 0.03, 0.02, 0.01, 0.03, 0.1, "")],
                        columns=["method", "group", "gain", "gain_low", "gain_high", "audit_gain",
                                 "audit_gain_low", "audit_gain_high", "kl", "vs_best_of_n"])  # fmt: skip
    finding = sentence(
        "findings", "rl_finding", rl_finding(rows, "sft", "99%", gold_at_chance=True)
    )
    assert "at chance on held-out rows, can neither confirm nor refute a gain: PPO" in finding
    assert "moved it up" in finding and "moves such a judge cannot interpret" in finding
    assert "moves such a judge" not in sentence(
        "findings", "rl_finding", rl_finding(rows, "sft", "99%")
    )
    clause = sentence("offline", "method_clauses", methods_context(rows, "RL", True))
    assert HEDGE in clause and "raised the audit" not in clause


def test_the_rule_is_stated_once_with_the_runs_own_auc():
    from rlxf_utils.report.wording import sentence

    rule = sentence("eval", "gold_rule", CHANCE)
    assert "a rise, a fall and a null under it alike" in rule
    assert (
        "AUC on 300 held-out rows, 0.530 [0.470, 0.590] (95% CI), does not exclude chance" in rule
    )
    assert rule.endswith("so its verdicts are all read that way")
    assert sentence("eval", "gold_rule", ABLE).endswith("so its verdicts stand")
    assert "did not measure it" in sentence("eval", "gold_rule", None)


def test_the_rlgf_questions_and_the_risk_readings_hedge_an_audit_at_chance():
    from rlxf_utils.report.risk import gain_reading, gains_text
    from rlxf_utils.report.rlgf import comparisons
    from rlxf_utils.report.wording import sentence

    g = pd.DataFrame({"question": "guidance_vs_ppo", "measure": ["reward", "audit_reward"],
                      "policy": "ppo_pp", "versus": "ppo", "diff": [0.1, -0.05],
                      "low": [0.05, -0.08], "high": [0.15, -0.02], "verdict": ["above", "below"],
                      "ci_level": 0.975})  # fmt: skip
    (c,) = comparisons(g, ["ppo_pp"], "ppo", 0.05, gold_at_chance=True)
    assert "audit model's verdict is one an audit at chance" in sentence("rlgf", "comparison", c)
    (plain,) = comparisons(g, ["ppo_pp"], "ppo", 0.05)
    assert "at chance" not in sentence("rlgf", "comparison", plain)
    # a checkpoint whose audit reward falls: reward hacking only for an audit that can judge
    r = {"algo": "ppo", "step": 8, "baseline": "sft", "reward_gain": 0.05, "reward_gain_low": 0.02,
         "reward_gain_high": 0.08, "audit_gain": -0.03, "audit_gain_low": -0.05,
         "audit_gain_high": -0.01, "gap": 0.08, "gap_low": 0.05, "gap_high": 0.11}  # fmt: skip
    assert gain_reading(r) == "audit falls" and gain_reading(r, gold_at_chance=True) == "unjudged"
    hedged = gains_text([r], 0.05, gold_at_chance=True).paragraph()
    assert "cannot tell whether that gain is specific" in hedged and "reward hacking" not in hedged
    assert "reward hacking" in gains_text([r], 0.05).paragraph()
    # no training gain: nothing for any audit to judge, the reading stands
    assert gain_reading({**r, "reward_gain_low": -0.01}, gold_at_chance=True) == "not raised"
