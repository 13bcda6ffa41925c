"""The findings the abstract and the key-findings section state (`rlxf_utils.report.findings`):
each chosen from an interval."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest

from rlxf_utils.artifacts import RunDir
from rlxf_utils.names import humanise
from rlxf_utils.report.findings import (
    best_of_n_finding,
    findings_section,
    offline_finding,
    reward_finding,
    rl_finding,
)
from rlxf_utils.report.wording import num, typeset_minus


def _metrics(acc_high: float, auc: tuple[float, float, float]) -> dict:
    row = {"protocol": "grouped", "model": "encoder", "accuracy": 0.61, "accuracy_low": 0.57,
           "accuracy_high": acc_high, "roc_auc": auc[0], "roc_auc_low": auc[1], "roc_auc_high": auc[2]}  # fmt: skip
    tfidf = {**row, "protocol": "random", "model": "tfidf", "accuracy": 0.66, "accuracy_high": 0.69}
    majority = {**row, "model": "majority", "accuracy": 0.9, "accuracy_high": 0.95}
    return {"alpha": 0.05, "reward_source": "encoder", "reward_protocol": "grouped",
            "metrics": [row, tfidf, majority]}  # fmt: skip


def test_reward_finding_reads_the_claim_and_chance_from_the_intervals() -> None:
    low = reward_finding(_metrics(0.64, (0.54, 0.49, 0.58)))
    assert low["below"]  # every interval below the paper's 82%
    assert low["best"] == {"accuracy": 0.66, "low": 0.57, "high": 0.69, "protocol": "random",
                           "label": "TF-IDF + LR"}  # the best, not majority  # fmt: skip
    assert low["main"] == {"auc": 0.54, "low": 0.49, "high": 0.58, "protocol": "grouped"}
    high = reward_finding(_metrics(0.85, (0.60, 0.55, 0.65)))
    assert not high["below"]  # the interval reaching highest, not the best point estimate
    assert (high["best"]["accuracy"], high["best"]["high"]) == (0.61, 0.85)


def _methods() -> pd.DataFrame:
    rows = [("PPO", "RL", 0.001, -0.004, 0.006, 0.002, -0.001, 0.005, 0.1, "below"),
            ("GRPO", "RL", 0.026, 0.022, 0.032, 0.005, -0.001, 0.011, 13.0, "below"),
            ("ILHF (history)", "ILHF", 0.010, 0.005, 0.017, 0.009, 0.005, 0.013, 13.1, "not distinguishable"),
            ("KTO", "offline", 0.0, -0.01, 0.01, 0.0, -0.01, 0.01, 0.2, "not distinguishable"),
            ("best-of-4", "best-of-N", 0.018, 0.012, 0.024, 0.004, -0.002, 0.010, 0.64, None)]  # fmt: skip
    cols = ["method", "group", "gain", "gain_low", "gain_high", "audit_gain", "audit_gain_low",
            "audit_gain_high", "kl", "vs_best_of_n"]  # fmt: skip
    return pd.DataFrame(rows, columns=cols)


def _names(moved: dict) -> tuple[list[str], list[str]]:
    return [r["method"] for r in moved["up"]], [r["method"] for r in moved["down"]]


def test_rl_finding_names_only_the_methods_whose_interval_excludes_zero() -> None:
    f = rl_finding(_methods(), "sft", "99.6%")
    assert (f["n"], f["start"], f["level"], f["gold_at_chance"]) == (3, "sft", "99.6%", False)
    # PPO's interval holds 0; KTO is offline, not counted
    assert _names(f["reward"]) == (["GRPO", "ILHF (history)"], [])
    assert f["reward"]["up"][0] == {"method": "GRPO", "est": 0.026, "low": 0.022, "high": 0.032,
                                    "finished": None, "check": None}  # fmt: skip
    # the nulls as a bound: the largest gain the other intervals allow
    assert (f["reward"]["nulls"], f["reward"]["top"]) == (1, 0.006)
    assert _names(f["audit"]) == (["ILHF (history)"], [])
    assert (f["audit"]["nulls"], f["audit"]["top"]) == (2, 0.011)
    # a mover's gain among finished responses, where it has an interval, rides with it
    checked = _methods().assign(finished=0.5, audit_gain_finished=0.004,
                                audit_gain_finished_low=[-0.001, 0.001, 0.002, 0.0, 0.0],
                                audit_gain_finished_high=0.01)  # fmt: skip
    up = rl_finding(checked, "sft", "99.6%", start_finished=0.98)
    assert up["start_finished"] == 0.98
    # a selected subset, described; no Lee bounds where the table carries none
    assert up["audit"]["up"][0]["check"] == {"est": 0.004, "low": 0.002, "high": 0.01, "lee": None}
    gone = rl_finding(checked.assign(audit_gain_finished_low=math.nan), "sft", "99.6%")
    assert gone["audit"]["up"][0]["check"] is None
    nulls = rl_finding(_methods().assign(audit_gain_low=-0.001), "sft", "99.6%")["audit"]
    assert (nulls["up"], nulls["nulls"], nulls["top"]) == ([], 3, 0.013)
    none = rl_finding(_methods().assign(gain_low=-1.0, audit_gain_low=-1.0), "sft", "99%")
    assert _names(none["reward"]) == ([], []) and none["reward"]["top"] == 0.032
    assert rl_finding(_methods().iloc[3:], "sft", "99%") is None  # no RL policy


def test_best_of_n_finding_counts_the_verdicts() -> None:
    f = best_of_n_finding(_methods(), "sft")
    assert (f["n"], f["above"], f["below"]) == (4, [], 2)
    assert f["bon"]["method"] == "best-of-4" and f["bon"]["kl"] == 0.64
    above = _methods().assign(vs_best_of_n=["above", "below", "below", "below", None])
    assert best_of_n_finding(above, "sft")["above"] == ["PPO"]
    assert best_of_n_finding(above, "sft")["below"] == 3
    assert best_of_n_finding(_methods().assign(vs_best_of_n=""), "sft") is None


def test_offline_finding_states_the_need_rl_answer() -> None:
    base = {"ci_level": 0.99, "pairs": 6, "winners": [], "measure": "audit_reward"}
    undecided = offline_finding({"audit_reward": {**base, "answer": "undecided"}})
    assert undecided["answer"] == "undecided" and undecided["audit"]
    assert undecided["alpha"] == pytest.approx(0.01) and undecided["pairs"] == 6
    rl = offline_finding({"audit_reward": {**base, "answer": "rl", "winners": ["grpo"]}})
    assert (rl["answer"], rl["winners"]) == ("rl", ["grpo"])
    off = offline_finding({"reward": {**base, "ci_level": None, "answer": "offline"}})
    assert (off["answer"], off["audit"], off["alpha"]) == ("offline", False, None)
    assert offline_finding({})["answer"] is None  # the offline methods did not run


def test_a_bound_that_rounds_to_zero_keeps_its_sign() -> None:
    """A signed number that is not zero shows its first significant digit: '-0.000' cannot say on
    which side of zero an interval's bound lies (issue 47)."""
    assert num(-0.00037, signed=True) == "-0.0004"
    assert num(0.00037, signed=True) == "+0.0004"
    assert num(-0.013, signed=True) == "-0.013"
    assert num(0.0, signed=True) == "+0.000"
    assert num(-1e-12, signed=True) == "-0.000000"  # at most six decimals
    assert num(-0.00037) == "-0.000"  # unsigned numbers are not differences: as asked
    assert num(-0.004, 1, signed=True, scale=100) == "-0.4"


def _lowered_run(tmp_path: Path) -> RunDir:
    """A constructed run whose ILHF (history) lowered the reward model's score and PPO raised it
    under the audit: the files `findings_section` reads, and nothing else."""
    root = tmp_path / "run"
    (root / "reward").mkdir(parents=True)
    (root / "eval").mkdir()
    (root / "tables").mkdir()
    (root / "reward/metrics.json").write_text(json.dumps(_metrics(0.64, (0.60, 0.55, 0.65))))
    (root / "eval/summary.json").write_text(json.dumps({"start_policy": "sft"}))
    t = _methods()
    t.loc[t["method"] == "ILHF (history)", ["gain", "gain_low", "gain_high"]] = (
        -0.013, -0.047, -0.00037)  # fmt: skip
    t.loc[t["method"] == "PPO", ["audit_gain", "audit_gain_low", "audit_gain_high"]] = (
        -0.002, -0.006, -0.0004)  # fmt: skip
    t.to_csv(root / "tables/eval_methods.csv", index=False)
    pd.DataFrame({"measure": ["reward"], "ci_level": [0.9964]}).to_csv(
        root / "tables/eval_paired.csv", index=False
    )
    return RunDir(root)


def test_the_abstract_says_a_method_lowered_the_reward_with_true_minus_signs(
    tmp_path: Path,
) -> None:
    """The abstract as the reader sees it (display names, then minus signs, as the report
    renders it) names a method whose interval lies below zero, with U+2212 signs and a bound that
    rounds to zero printed with the digit that shows its sign."""
    found, _ = findings_section(_lowered_run(tmp_path))
    abstract = typeset_minus(humanise(found["abstract"]))
    m = "\u2212"
    assert f"ILHF (history) ({m}0.013 [{m}0.047, {m}0.0004])" in abstract
    assert f"PPO ({m}0.002 [{m}0.006, {m}0.0004])" in abstract
    assert "GRPO (+0.026 [+0.022, +0.032])" in abstract
    assert "-0." not in abstract  # no hyphen-minus left before a digit


def test_the_papers_accuracy_is_defined_once():
    """The paper's 0.82 (reward-model accuracy, precision, recall and F1) is one constant,
    `reward.model.PAPER_ACCURACY`: no other module of the package writes the number."""
    import ast

    from rlxf_utils.reward.model import PAPER_ACCURACY

    package = Path(__file__).resolve().parents[1] / "rlxf_utils"
    found = [
        f"{path.relative_to(package)}:{node.lineno}"
        for path in sorted(package.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Constant) and node.value == PAPER_ACCURACY
    ]
    assert len(found) == 1 and found[0].startswith("reward/model.py:"), found
