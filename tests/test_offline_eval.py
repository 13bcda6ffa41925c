"""Evaluation of the offline methods beside RL (`evaluation.offline`): the side-by-side table, RL
against the offline methods on the same prompts, and the answer read from the intervals."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from rlxf_utils.evaluation.offline import methods_table, need_rl, plot_methods, rl_vs_offline


def samples(shift: dict[str, float], n_prompts=40, k=2, seed=0) -> pd.DataFrame:
    """Rewards per policy: a shared per-prompt level plus noise, shifted per policy."""
    rng = np.random.default_rng(seed)
    level = rng.normal(0.5, 0.1, n_prompts)
    rows = []
    for pol, d in shift.items():
        for i in range(n_prompts):
            for j in range(k):
                r = level[i] + d + rng.normal(0, 0.02)
                rows.append({"policy": pol, "prompt_id": i, "sample_id": j, "country": f"C{i % 20}",
                             "reward": r, "audit_reward": r})  # fmt: skip
    return pd.DataFrame(rows)


ALGOS = ["ppo", "grpo", "ilhf_history", "kto", "dpo"]


@pytest.mark.parametrize(
    ("shift", "answer", "winners"),
    [
        ({"ppo": 0.0, "grpo": 0.0, "kto": 0.1, "dpo": 0.0}, "offline", ["kto"]),  # kto beats both
        ({"ppo": 0.0, "grpo": 0.0, "kto": 0.1, "dpo": 0.1}, "offline", ["dpo", "kto"]),
        # ppo beats kto and ties dpo, dpo beats grpo: pairs decided, the question not
        ({"ppo": 0.1, "grpo": 0.0, "kto": 0.0, "dpo": 0.1}, "undecided", []),
        ({"ppo": 0.1, "grpo": 0.0, "kto": 0.0, "dpo": 0.0}, "rl", ["ppo"]),
        ({"ppo": 0.0, "grpo": 0.0, "kto": 0.0, "dpo": 0.0}, "undecided", []),
    ],
)
def test_need_rl_reads_the_answer_from_every_pair(shift, answer, winners):
    s = samples({"sft": 0.0, "ilhf_history": 0.0, **shift})
    comp = rl_vs_offline(s, ALGOS, n_boot=300, alpha=0.05, seed=0)
    assert set(comp["policy"]) == {"ppo", "grpo"} and set(comp["versus"]) == {"kto", "dpo"}
    assert (comp["ci_level"] == 1 - 0.05 / 4).all()  # one family of 4 pairs per measure
    got = need_rl(comp, "audit_reward")
    assert got["answer"] == answer and got["winners"] == winners
    if answer == "undecided" and shift["ppo"] > 0:
        assert {("ppo", "kto", "above"), ("grpo", "dpo", "below")} == set(got["beaten"])


def test_only_pairs_at_comparable_kl_are_compared_and_the_family_shrinks_with_them():
    """GRPO far above the target (17.5 nats) against offline methods near 2-3: its pairs leave
    the family (two instead of four per measure) and are listed with both KLs; PPO at 0.4 and
    KTO at 1.0 count as at least half a nat each, within 2x (at 1.2 KTO would not be)."""
    from rlxf_utils.evaluation.questions import kl_matched, unmatched_pairs

    s = samples({"sft": 0.0, "ilhf_history": 0.0, "ppo": 0.1, "grpo": 0.1, "kto": 0.0, "dpo": 0.0})
    kl = {"ppo": 0.4, "grpo": 17.5, "kto": 1.0, "dpo": 0.9}
    comp = rl_vs_offline(s, ALGOS, n_boot=300, alpha=0.05, seed=0, kl=kl, kl_ratio=2.0)
    assert set(comp["policy"]) == {"ppo"} and set(comp["versus"]) == {"kto", "dpo"}
    assert (comp["ci_level"] == 1 - 0.05 / 2).all()  # m = 2, not 4
    assert comp.set_index("versus")["kl_versus"].to_dict() == {"kto": 1.0, "dpo": 0.9}
    pairs = [("rl_vs_offline", a, b) for a in ("ppo", "grpo") for b in ("kto", "dpo")]
    left = unmatched_pairs(pairs, kl, 2.0)
    assert list(zip(left["policy"], left["versus"], strict=True)) == [
        ("grpo", "kto"),
        ("grpo", "dpo"),
    ]
    assert left["ratio"].tolist() == pytest.approx([17.5 / 1.0, 17.5 / 0.9])
    # PPO beat both offline methods; "every RL algorithm" would be wrong words for GRPO's pairs,
    # which were never compared: the answer names whom PPO met and counts the pairs left out
    got = need_rl(comp, "reward", len(pairs), 2.0)
    assert (got["answer"], got["winners"], got["opponents"]) == ("rl", ["ppo"], ["dpo", "kto"])
    assert (got["pairs"], got["left_out"], got["kl_ratio"]) == (2, 2, 2.0)
    # the rule itself: the floor, the boundary, a missing KL, no ratio
    assert (
        kl_matched(0.0, 1.0, 2.0) and kl_matched(2.0, 4.0, 2.0) and not kl_matched(2.0, 4.01, 2.0)
    )
    assert not kl_matched(float("nan"), 1.0, 2.0) and kl_matched(0.1, 50.0, None)
    # without KLs every pair is compared, as before
    assert len(rl_vs_offline(s, ALGOS, n_boot=300, alpha=0.05, seed=0)) == 8


def test_no_offline_method_no_question():
    s = samples({"sft": 0.0, "ppo": 0.0})
    comp = rl_vs_offline(s, ["ppo"], n_boot=100, alpha=0.05, seed=0)
    assert comp.empty and need_rl(comp, "reward")["answer"] == "not compared"


def test_methods_table_groups_every_method_and_draws():
    summary = pd.DataFrame({
        "policy": ["sft", "sft_met", "ppo", "kto", "ilhf_history", "best_of_n"],
        **{c: [0.0, 0.01, 0.02, 0.03, 0.04, 0.05] for c in ("gain", "audit_gain")},
        **{c: [0.0, -0.01, 0.0, 0.01, 0.02, 0.03] for c in ("gain_low", "audit_gain_low")},
        **{c: [0.0, 0.03, 0.04, 0.05, 0.06, 0.07] for c in ("gain_high", "audit_gain_high")},
        "kl": [0, 1, 2, 3, 4, 0.8], "finished": [0.9] * 6,
        "kl_kind": ["sampled"] * 5 + ["upper bound"],
    })  # fmt: skip
    vs = pd.DataFrame({"policy": ["ppo", "kto"], "verdict": ["below", "not distinguishable"],
                       "diff": [-0.02, 0.0]})  # fmt: skip
    t = methods_table(summary, vs, ["ppo", "ilhf_history", "kto"])
    assert list(t["group"]) == ["RL", "ILHF", "offline", "supervised", "best-of-N"]
    assert list(t["method"])[:3] == ["PPO", "ILHF (history)", "KTO"]
    assert t.set_index("policy").loc["ppo", "vs_best_of_n"] == "below"
    assert t.set_index("policy").loc["best_of_n", "vs_best_of_n"] == ""
    fig = plot_methods(t)
    assert len(fig.axes) == 2 and fig.axes[0].get_yticklabels()[0].get_text() == "PPO"


def test_report_section_answers_from_the_intervals(tmp_path):
    from rlxf_utils.artifacts import RunDir
    from rlxf_utils.report.offline import (
        answer_context,
        answer_sentence,
        methods_context,
        offline_section,
    )
    from rlxf_utils.stats import level

    s = samples({"sft": 0.0, "ppo": 0.0, "grpo": 0.0, "kto": 0.1, "dpo": 0.0, "ilhf_history": 0.0})
    comp = rl_vs_offline(s, ALGOS, n_boot=300, alpha=0.05, seed=0)
    summary = pd.DataFrame({
        "policy": ["sft", "ppo", "kto", "best_of_n"],
        "gain": [0.0, 0.001, 0.1, 0.02], "gain_low": [0.0, -0.01, 0.08, 0.01],
        "gain_high": [0.0, 0.012, 0.12, 0.03], "audit_gain": [0.0, 0.0, 0.05, -0.01],
        "audit_gain_low": [0.0, -0.02, 0.03, -0.03], "audit_gain_high": [0.0, 0.02, 0.07, 0.01],
        "kl": [0.0, 0.5, 2.5, 0.84], "finished": [0.9, 0.9, 0.8, 0.9],
        "kl_kind": ["sampled"] * 3 + ["upper bound"],
    })  # fmt: skip
    run = RunDir(tmp_path)
    run.write_table("eval_methods", methods_table(summary, pd.DataFrame(), ["ppo", "kto"], 4))
    run.write_json("eval/summary.json", {"start_policy": "sft", "need_rl": {
        m: need_rl(comp, m) for m in ("audit_reward", "reward")}})  # fmt: skip
    variables, files = offline_section(run)
    # the words: tests/golden/report/offline.md; here, the answers and numbers they are given
    c = answer_context(need_rl(comp, "audit_reward"))
    assert c["answer"] == "offline" and c["winners"] == ["kto"] and c["pairs"] == 4
    assert level(c["alpha"]) == "98.8%"
    assert "KTO" in variables["answer"] and "98.8%" in variables["answer"]
    (kto,) = methods_context(run.read_table("eval_methods"), "offline")["methods"]
    assert kto["method"] == "KTO" and (kto["gain"], kto["gain_low"], kto["gain_high"]) == (
        0.1,
        0.08,
        0.12,
    )
    assert (
        variables["offline"].startswith("KTO") and "+0.100 [+0.080, +0.120]" in variables["offline"]
    )
    (bon,) = methods_context(run.read_table("eval_methods"), "best-of-N")["methods"]
    assert bon["method"] == "best-of-4" and bon["vs_best_of_n"] is None
    assert variables["references"].startswith("best-of-4") and "nan" not in variables["references"]
    assert "0.84 (bound)" in files["eval_methods.md"] and "best-of-N" in files["eval_methods.md"]
    undecided = {"measure": "reward", "answer": "undecided", "winners": [], "ci_level": 0.99,
                 "pairs": 2, "beaten": [("ppo", "kto", "above")]}  # fmt: skip
    assert "PPO above KTO" in answer_sentence(undecided)  # ids shown by their display names
