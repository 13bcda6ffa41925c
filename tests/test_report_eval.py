"""The evaluation section's words, once: each macro of `reports/templates/eval.jinja` rendered
from the contexts in the committed fixture (`tests/golden/report/eval.json`) must reproduce the
golden text (`tests/golden/report/eval.md`).

The fixture's contexts are built by the section's own functions (`evaluation.algos_context`,
`history_context`, `design_context`, ...) from small hand-made rows of notebook 04's summary and
tables, one case per branch that chooses different words. After a deliberate change of the
template or the vocabulary, rewrite the golden text (and review its diff):
`PYTHONPATH=. python tests/test_report_eval.py`; `--fixture` also rebuilds the fixture."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from rlxf_utils.evaluation.questions import unmatched_pairs
from rlxf_utils.report.wording import sentence

GOLDEN = Path(__file__).resolve().parent / "golden" / "report"
nan = math.nan


def _rendered() -> str:
    """Each case of the fixture: its macro called with its arguments."""
    cases = json.loads((GOLDEN / "eval.json").read_text(encoding="utf-8"))
    parts = [f"## {case}\n\n{c['macro']}: {sentence('eval', c['macro'], *c['args'])}"
             for case, c in cases.items()]  # fmt: skip
    return "\n\n".join(parts) + "\n"


def test_the_section_renders_its_golden_text() -> None:
    assert _rendered() == (GOLDEN / "eval.md").read_text(encoding="utf-8")


# -- the fixture: contexts built by the section's own code from hand-made rows -------------------
def _row(ave_r: float, gain: tuple, audit: tuple, sd: tuple = (nan,) * 6, **more: Any) -> dict:
    """One policy's summary row: Ave(R) and its interval, the gain, audit gain and gap with their
    family intervals, and the reward heads' SD and its paired change."""
    g, a = (
        dict(zip(("", "_low", "_high"), gain, strict=True)),
        dict(zip(("", "_low", "_high"), audit, strict=True)),
    )
    return {"ave_r": ave_r, "ave_r_low": ave_r - 0.01, "ave_r_high": ave_r + 0.01,
            **{f"gain{k}": v for k, v in g.items()}, "gain_p_family": 0.0123,
            **{f"audit_gain{k}": v for k, v in a.items()}, "audit_gain_p_family": 0.5,
            "gap_low": g["_low"] - a["_high"], "gap_high": g["_high"] - a["_low"],
            "reward_sd": sd[0], "reward_sd_low": sd[1], "reward_sd_high": sd[2],
            "sd_gain": sd[3], "sd_gain_low": sd[4], "sd_gain_high": sd[5],
            "kl": 1.234, "perplexity": 52.71, "n_prompts": 24, **more}  # fmt: skip


def _summary() -> pd.DataFrame:
    sd = (0.04, 0.03, 0.05)
    return pd.DataFrame({
        "sft": _row(0.549, (nan,) * 3, (nan,) * 3, (*sd, nan, nan, nan), perplexity=52.6),
        "ppo": _row(0.6, (0.05, 0.02, 0.08), (0.001, -0.01, 0.03), (0.05, 0.04, 0.06, 0.01, 0.004, 0.016)),
        "grpo": _row(0.55, (-0.0001, -0.0004, 0.0003), (-0.05, -0.08, -0.02), (0.03, 0.02, 0.04, -0.01, -0.016, -0.004)),
        "kto": _row(0.548, (-0.02, -0.03, -0.01), (0.002, -0.004, 0.006), (0.04, 0.03, 0.05, 0.0, -0.01, 0.01)),
        "dpo": _row(0.549, (0.0, -0.003, 0.003), (0.01, -0.05, 0.07)),
        "history_met": _row(0.61, (nan,) * 3, (nan,) * 3, n_prompts=7),
        "history_nonmet": _row(0.58, (nan,) * 3, (nan,) * 3, n_prompts=7),
    }).T  # fmt: skip


GOLD = {"auc": 0.56, "low": 0.48, "high": 0.64, "rows": 300, "level": "95%", "can_judge": False}
CONTRAST = {"reward": {"n": 7, "n_clusters": 4, "mean_diff": 0.03, "ci_low": 0.01, "ci_high": 0.05},
            "audit_reward": {"n": 7, "n_clusters": 4, "mean_diff": -0.01, "ci_low": -0.04,
                             "ci_high": 0.02}}  # fmt: skip


def _design(rows: list[tuple]) -> pd.DataFrame:
    cols = ["judge", "design", "prompts", "countries", "samples_per_prompt", "mde", "cost_s"]
    return pd.DataFrame(rows, columns=cols)


def _vs_best_of_n() -> pd.DataFrame:
    return pd.DataFrame({
        "policy": ["ppo", "grpo", "kto"], "ave_r": [0.6, 0.55, 0.548], "kl": [1.234, 9.0, 0.5],
        "best_of_n_at_kl": [0.58, 0.57, 0.549], "best_of_n_kl": [1.234, 1.12, nan],
        "beyond_curve": [False, True, False], "verdict": ["above", "below", "not distinguishable"],
        "diff": [0.02, -0.02, -0.001], "diff_low": [0.01, -0.03, -0.004],
        "diff_high": [0.03, -0.01, 0.002], "ci_level": 0.9833,
    })  # fmt: skip


def _cases() -> dict[str, tuple[str, list]]:
    from rlxf_utils.report import evaluation as ev

    s, algos = _summary(), ["ppo", "grpo", "kto", "dpo"]
    paired = pd.DataFrame({"measure": ["reward"] * 3 + ["audit_reward"] * 3,
                           "policy": ["sft_met", "ppo", "grpo"] * 2, "ci_level": 0.9833,
                           "mde": [0.0004, 0.0005, 0.0003, 0.07, 0.08, nan]})  # fmt: skip
    at_chance = ev.algos_context(s, algos, "sft", "98.3%", 0.01, GOLD)
    judges = ev.algos_context(s, algos[:2], "sft", "99%", None, {**GOLD, "can_judge": True})
    design = _design([
        ("reward model", "this run", 6, 4, 2, 0.001, 180), ("reward model", "cheapest reaching +0.004", 6, 4, 1, 0.004, 120),
        ("audit", "this run", 6, 4, 2, 0.084, 180), ("audit", "every held-out context", 27, 4, 2, 0.065, 900),
        ("gold", "this run", 6, 4, 1, 0.1, 90),
        ("second audit", "this run", 48, 17, 4, 0.011, 1944), ("second audit", "every held-out context", 301, 19, 4, 0.0065, 12194),
        ("second audit", "countries needed for MDE 0.004", 608, 38, 4, 0.00397, 24624)])  # fmt: skip
    guidance = pd.DataFrame({"question": ["guidance_vs_ppo", "rl_vs_sft_met", "rl_vs_sft_met"],
                             "measure": ["reward", "reward", "audit_reward"]})  # fmt: skip
    heads = {"n_heads": 5, "settings": {"n_rows": 166}}
    uncertainty = ev.uncertainty_context(s, algos, "sft", "95%", heads, "98.3%")
    return {
        "gains: raised, equivalent, lowered, a gold at chance said once": ("algo_sentences", [at_chance]),
        "gains: a gold that judges, no margin": ("algo_sentences", [judges]),
        "gains: no algorithm": ("algo_sentences", [ev.algos_context(s, [], "sft", "99%", None, None)]),
        "conclusion": ("conclusion", [at_chance]),
        "conclusion: no algorithm": ("conclusion", [{"algos": []}]),
        "history: both judges": ("history_sentence", [ev.history_context(s, CONTRAST)]),
        "history: the reward model only": ("history_sentence", [ev.history_context(s, {"reward": CONTRAST["reward"]})]),
        "history: not both": ("history_sentence", [ev.history_context(s.drop(index="history_nonmet"), CONTRAST)]),
        "family: both MDEs": ("family_sentence", [ev.family_context(paired, "sft", "98.3%", 0.8)]),
        "family: before MDEs": ("family_sentence", [ev.family_context(paired.drop(columns="mde"), "base", "95%", 0.9)]),
        "design: reaching, none reaching, neither": ("design_sentence", [ev.design_context(design, 0.004)]),
        "design: no target": ("design_sentence", [ev.design_context(design.iloc[2:], None)]),
        "design: no components": ("design_sentence", [ev.design_context(pd.DataFrame(), 0.004)]),
        "families: every family": ("families", [ev.families_context(
            {"eval_guidance": guidance, "eval_rl_vs_offline": guidance.iloc[1:].assign(question="rl_vs_offline")},
            paired, _vs_best_of_n(), "sft")]),
        "families: pairs matched in KL, two left out": ("families", [ev.families_context(
            {"eval_guidance": guidance}, paired, _vs_best_of_n(), "sft",
            unmatched_pairs([("guidance_vs_ppo", "d2lols", "ppo"), ("rl_vs_offline", "grpo", "dpo"),
                             ("rl_vs_offline", "ppo", "kto")],
                            {"d2lols": 0.9, "ppo": 0.4, "grpo": 17.5, "dpo": 3.1, "kto": 2.0}, 2.0),
            2.0)]),
        "families: pairs matched in KL, none left out": ("families", [ev.families_context(
            {"eval_guidance": guidance}, paired, _vs_best_of_n(), "sft", pd.DataFrame(), 2.0)]),
        "families: none measured, no level": ("families", [ev.families_context(
            {"eval_guidance": pd.DataFrame()}, paired.iloc[0:0], _vs_best_of_n().drop(columns="ci_level"), "sft")]),
        "best-of-N: above, below beyond the curve, not told apart": ("bon_sentences", [ev.bon_context(_vs_best_of_n(), [1, 2, 4])]),
        "best-of-N: none compared": ("bon_sentences", [ev.bon_context(pd.DataFrame(), [])]),
        "perplexity": ("ppl_sentence", [[["base", 60.44], ["ppo", 52.71]]]),
        "finished": ("finished_sentence", [[["base", 0.0], ["sft", 0.083]]]),
        "grounding": ("grounding_sentence", [[["best_of_n", 0.6814], ["history_met", 0.686]]]),
        "uncertainty: heads, more, less and no change": ("uncertainty_sentence", [uncertainty]),
        "uncertainty: no heads' marker, no policy": ("uncertainty_sentence", [ev.uncertainty_context(s, [], "sft", "95%", None)]),
        "uncertainty: not measured": ("uncertainty_sentence", [ev.uncertainty_context(s, algos, "dpo", "95%", None)]),
        "multiplicity rule": ("multiplicity_rule", []),
        "gold rule: a gold at chance": ("gold_rule", [GOLD]),
        "gold rule: a gold that judges": ("gold_rule", [{**GOLD, "low": 0.52, "can_judge": True}]),
        "gold rule: not measured": ("gold_rule", [None]),
        "no components": ("no_components", []),
        "no design": ("no_design", []),
        "no perplexity": ("no_perplexity", []),
        "notebook: a policy": ("policy_item", [judges["algos"][0], {**judges, "start_ppl": 52.6}]),
        "notebook: best-of-N": ("best_of_n_item", [{"n": 4, "ave_r": 0.549, "gain": -0.00001, "audit_gain": 0.002, "kl": 0.19}]),
        "notebook: history, a contrast": ("history_item", [{"refs": [
            {"policy": "history_met", "ave_r": 0.61, "prompts": 7}, {"policy": "history_nonmet", "ave_r": 0.58, "prompts": 7},
            {"policy": "random_policy", "ave_r": None, "prompts": None}],
            "contrast": {"n": 7, "clusters": 4, "diff": 0.03, "low": 0.01, "high": 0.05}}]),
        "notebook: history, none": ("history_item", [{"refs": [
            {"policy": "history_met", "ave_r": None, "prompts": None}], "contrast": None}]),
        "notebook: the gap": ("gap_item", [{"policy": "ppo", "gain": 0.05, "audit_gain": 0.001, "gap": 0.049, "low": 0.01, "high": 0.09}]),
        "notebook: uncertainty": ("uncertainty_item", [uncertainty["policies"][0], uncertainty]),
        "notebook: no uncertainty": ("no_uncertainty_item", []),
        "notebook: against best-of-N beyond the curve": ("versus_best_of_n_item", [ev.bon_context(_vs_best_of_n(), [4])[1]]),
        "notebook: grounding": ("grounding_item", [{"policy": "ppo", "met": 0.669, "low": 0.6, "high": 0.74, "max_sim": 0.812}]),
        "cut responses scored as failed at evaluation's own cap": ("cut_rule", [ev.cut_rule(
            {"cut_responses": "failed", "max_new_tokens": 128, "rl_max_new_tokens": 48})]),
        "cut responses scored as written at RL's cap": ("cut_rule", [ev.cut_rule(
            {"cut_responses": "as_written", "max_new_tokens": 48, "rl_max_new_tokens": 48})]),
        "cut responses: a run from before the rule": ("cut_rule", [ev.cut_rule({})]),
    }  # fmt: skip


def _plain(x: Any) -> Any:
    """numpy scalars as Python's, for JSON."""
    return x.item() if isinstance(x, np.generic) else str(x)


def _write_fixture() -> None:
    out = {case: {"macro": m, "args": args} for case, (m, args) in _cases().items()}
    (GOLDEN / "eval.json").write_text(
        json.dumps(out, indent=1, default=_plain, ensure_ascii=False) + "\n", encoding="utf-8"
    )


if __name__ == "__main__":  # rewrite the golden text (and with --fixture, the fixture first)
    if "--fixture" in sys.argv:
        _write_fixture()
    (GOLDEN / "eval.md").write_text(_rendered(), encoding="utf-8")
    print(f"wrote {GOLDEN / 'eval.md'}")
