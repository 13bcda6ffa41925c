"""The RL, RLGF and offline sections' words, once: their sentences rendered from the author's
templates (`reports/templates/rl.jinja`, `rlgf.jinja`, `offline.jinja`) on small constructed
contexts must reproduce the golden files `tests/golden/report/{rl,rlgf,offline}.md`.

The fixtures (`tests/golden/report/{rl,rlgf,offline}.json`) hold, per case, each macro's context
(numbers, verdict codes, ids), built by the sections' own context functions
(`report.rl.moves_context`, `report.rlgf.guidance_context`, `report.offline.answer_context`, ...)
from hand-made rows of notebook 03 and 04's tables that take every branch choosing different
words. After a deliberate change of a template or the vocabulary, rewrite the golden text (and
review its diff): `PYTHONPATH=. python tests/test_report_rl.py`; `--fixture` also rebuilds the
fixtures."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

from rlxf_utils.report.wording import sentence

GOLDEN = Path(__file__).resolve().parent / "golden" / "report"
SECTIONS = ("rl", "rlgf", "offline")


def _rendered(section: str) -> str:
    """Every case of the section's fixture: each macro's sentence on its context."""
    cases = json.loads((GOLDEN / f"{section}.json").read_text(encoding="utf-8"))
    return "\n\n".join(
        f"## {case}\n\n"
        + "\n\n".join(f"{macro}: {sentence(section, macro, c)}" for macro, c in macros.items())
        for case, macros in cases.items()
    ) + "\n"  # fmt: skip


@pytest.mark.parametrize("section", SECTIONS)
def test_the_section_renders_its_golden_text(section: str) -> None:
    assert _rendered(section) == (GOLDEN / f"{section}.md").read_text(encoding="utf-8")


# -- the fixtures: contexts built by the sections' own code from hand-made table rows -----------
def _rl_cases() -> dict[str, dict[str, Any]]:
    import pandas as pd

    from rlxf_utils.report.rl import kl_context, moves_context, ppo_context, sft_context

    nan = math.nan
    summary = pd.DataFrame(
        {"reward_first": [0.6, 0.31, nan, nan], "reward_last": [0.65, 0.29, nan, nan],
         "reward_first_step": [1, 5, nan, nan], "kl_last": [1.5, -0.04, nan, nan],
         "step_time_s": [12.2, 7.0, 6.0, 31.6], "explained_variance_last_third": [0.41, nan, nan, nan],
         "explained_variance_low": [0.2, nan, nan, nan], "explained_variance_high": [0.6, nan, nan, nan],
         "explained_variance_prior_last_third": [0.35, nan, nan, nan],
         "beta_first": [0.05, 0.05, nan, nan], "beta_last": [0.0712, 0.04, nan, nan]},
        index=pd.Index(["PPO", "D²LOLS", "ILHF (history)", "KTO"], name="algorithm"),
    )  # fmt: skip
    adaptive = {
        "adaptive_kl": True,
        "kl_coef": 0.05,
        "target_kl": 6.0,
        "kl_coef_range": [0.01, 100.0],
        "kl_step_ratio": 1.5,
        "kl_smoothing": 0.5,
        "steps": 16,
        "grpo_loss_type": "dapo",
    }
    fixed = {**adaptive, "adaptive_kl": False, "kl_coef": 0.001}
    sft = pd.DataFrame(
        {"policy": ["sft", "sft_met"], "examples": [21, 22], "outcomes": ["all", "met"],
         "steps": [3, 3], "seconds": [8.4, 7.6], "tokens_per_s": [205.2, 208.0],
         "loss_first": [4.583, 4.57], "loss_last": [3.9, 4.571]}
    )  # fmt: skip
    # PPO's critic without a prior whose interval lies below zero; every algorithm silent but one
    low = summary.iloc[[0, 2]].assign(
        explained_variance_last_third=-0.3, explained_variance_low=-0.5,
        explained_variance_high=-0.1, explained_variance_prior_last_third=nan
    )  # fmt: skip
    return {
        "adaptive KL, PPO with a prior, a guided start, two silent, SFT, reward-model critic": {
            "algorithms": {"algorithms": list(summary.index)},
            "moves": moves_context(summary),
            "ppo_sentence": ppo_context(summary, adaptive),
            "kl_regime_sentence": kl_context(adaptive),
            "sft_sentence": sft_context(sft),
            "critic_sentence": {"init": "reward"},
            "sft_table_missing": {},
        },
        "fixed KL, PPO without a prior, one silent, no SFT, mean critic": {
            "algorithms": {"algorithms": list(low.index)},
            "moves": moves_context(low),
            "ppo_sentence": ppo_context(low, fixed),
            "kl_regime_sentence": kl_context(fixed),
            "sft_sentence": sft_context(sft.iloc[0:0]),
            "critic_sentence": {"init": "mean"},
        },
        "no PPO, every algorithm silent": {
            "algorithms": {"algorithms": ["KTO"]},
            "moves": moves_context(summary.iloc[[3]]),
            "ppo_sentence": ppo_context(summary.iloc[[3]], adaptive),
        },
    }


def _guidance_rows(rows: list[tuple]) -> Any:
    import pandas as pd

    cols = ["question", "measure", "policy", "versus", "diff", "low", "high", "verdict", "ci_level"]
    return pd.DataFrame(rows, columns=cols)


def _rlgf_cases() -> dict[str, dict[str, Any]]:
    import pandas as pd

    from rlxf_utils.report.rlgf import critics_context, easy_hard_context, guidance_context

    nan = math.nan
    g, r = "guidance_vs_ppo", "rl_vs_sft_met"
    U, A, B = "not distinguishable", "above", "below"
    algos = ["ppo", "ppo_mle", "ppo_pp", "d2lols", "grpo"]
    guidance = _guidance_rows([
        (g, "reward", "ppo_pp", "ppo_mle", 0.1, 0.05, 0.15, A, 0.975),
        (g, "audit_reward", "ppo_pp", "ppo_mle", 0.01, -0.02, 0.04, U, 0.975),
        (g, "reward", "d2lols", "ppo_mle", -0.00004, -0.0001, 0.0001, U, 0.975),
        (g, "audit_reward", "d2lols", "ppo_mle", 0.001, -0.006, 0.008, U, 0.975),
        (r, "reward", "ppo", "sft_met", -0.08, -0.12, -0.04, B, 0.99),
        (r, "audit_reward", "ppo", "sft_met", -0.05, -0.09, -0.01, B, 0.99),
        (r, "reward", "grpo", "sft_met", 0.02, -0.01, 0.05, U, nan),
        (r, "audit_reward", "grpo", "sft_met", 0.09, 0.01, 0.17, A, nan),
    ])  # fmt: skip
    plain = _guidance_rows([
        (g, "reward", "ppo_pp", "ppo", -0.1, -0.15, -0.05, B, 0.95),
        (g, "audit_reward", "ppo_pp", "ppo", -0.2, -0.3, -0.1, B, 0.95),
    ])  # fmt: skip
    log = pd.DataFrame(
        {"algorithm": ["PPO", "D²LOLS", "D²LOLS", "LOLS"],
         "critic": ["V (the policy's)", "V_g (the guide's, on its tokens)",
                    "V_θ (the policy's, on its tokens)", "V_g (the guide's, on its tokens)"],
         "explained_variance": [0.1, 0.9, -0.03, nan], "steps": [2, 1, 1, 2],
         "explained_variance_prior": [0.1, 0.88, -0.03, nan]}
    )  # fmt: skip

    def half_rows(pol: str, label: str, gains: dict[str, tuple]) -> list[dict]:
        return [{"policy": pol, "label": label, "half": h, "gain": v[0], "gain_low": v[1],
                 "gain_high": v[2], "gain_verdict": v[3], "median_met_rate": 0.6667}
                for h, v in gains.items()]  # fmt: skip

    none = (nan, nan, nan, "")
    easy_hard = pd.DataFrame(
        half_rows("base", "zero-shot (base)", {"easy": (0.0001, -0.036, 0.036, U),
                  "hard": (-0.0001, -0.004, 0.003, U), "hard_minus_easy": (-0.0002, -0.0003, -0.00003, B)})
        + half_rows("sft", "SFT", {"easy": none, "hard": none, "hard_minus_easy": none})
        + half_rows("grpo", "GRPO", {"easy": (0.02, -0.01, 0.05, U), "hard": (0.12, 0.08, 0.16, A),
                    "hard_minus_easy": (0.1, 0.05, 0.15, A)})
        + half_rows("ppo", "PPO", {"easy": (-0.1, -0.15, -0.05, B), "hard": none,
                    "hard_minus_easy": none})
        + half_rows("kto", "KTO", {"easy": none, "hard": none, "hard_minus_easy": none})
    )  # fmt: skip
    full = guidance_context(guidance, algos, 0.05)
    return {
        "guided algorithms against PPO + MLE, RL against sft_met, every table": {
            "ran_sentence": {"algorithms": algos, "guided": ["ppo_pp", "d2lols"], "guide": "sft_met"},
            "critics_sentence": critics_context(log),
            "claims_sentence": {"ran": True, "budgets": [0.5, 1.0, 2.0], "versus": [
                {"policy": "ppo", "missing": [1.0, 2.0], "rows": [
                    {"budget": 0.5, "measure": "reward", "est": 0.01, "low": -0.01, "high": 0.03, "verdict": U},
                    {"budget": 0.5, "measure": "audit_reward", "est": -0.02, "low": -0.04, "high": -0.005, "verdict": B}]},
                {"policy": "ppo_pp", "missing": [0.5, 1.0, 2.0], "rows": []}]},
            "guidance_sentence": full["guidance"],
            "rl_vs_sft_met_sentence": full["rl_vs_sft_met"],
            "easy_hard_sentence": easy_hard_context(easy_hard, "sft", 0.05, preamble=False),
            "context_key": {"fields": ["country", "arrangement_type", "econ_descriptor"]},
            "notebook_verdicts": {**full, "easy_hard": easy_hard_context(easy_hard, "sft", 0.1)},
        },
        "one guided algorithm against plain PPO, sft_met not evaluated": {
            "ran_sentence": {"algorithms": ["ppo", "ppo_pp"], "guided": ["ppo_pp"], "guide": "sft"},
            "critics_sentence": critics_context(log.iloc[[3]]),
            **{f"{k}_sentence": v for k, v in guidance_context(plain, ["ppo", "ppo_pp"], 0.1).items()},
            "easy_hard_sentence": easy_hard_context(easy_hard.iloc[3:6], "sft", 0.05),
        },
        "guided algorithms not compared with PPO": {
            "guidance_sentence": guidance_context(guidance[guidance.question == r], algos, 0.05)["guidance"],
        },
        "no guided algorithm": {
            "ran_sentence": {"algorithms": ["ppo", "grpo"], "guided": [], "guide": "sft_met"},
            "critics_sentence": critics_context(pd.DataFrame()),
            "claims_sentence": {"ran": False, "budgets": None, "versus": []},
            "guidance_sentence": guidance_context(guidance[guidance.question == r], ["ppo", "grpo"], 0.05)["guidance"],
            "no_comparison_note": guidance_context(None, ["ppo", "grpo"], 0.05)["guidance"],
            "easy_hard_sentence": easy_hard_context(easy_hard.iloc[0:0], "sft", 0.05),
            "no_split_note": {},
        },
        "PPO did not run, a run directory without the RLGF tables": {
            "guidance_sentence": guidance_context(guidance[guidance.question == r], ["ppo_pp", "grpo"], 0.05)["guidance"],
            "predates_note": {"missing": ["eval_rlgf", "eval_guidance"], "stage": "notebook 04_evaluation"},
            "predates_sentence": {"stage": "notebook 04_evaluation"},
            "claims_sentence": {"ran": True, "budgets": None, "versus": []},
        },
    }  # fmt: skip


def _offline_cases() -> dict[str, dict[str, Any]]:
    import pandas as pd

    from rlxf_utils.report.offline import answer_context, methods_context

    nan = math.nan
    base = {"measure": "audit_reward", "winners": [], "ci_level": 0.99, "pairs": 4, "beaten": []}
    table = pd.DataFrame(
        {"method": ["KTO", "DPO", "best-of-4"], "group": ["offline", "offline", "best-of-N"],
         "gain": [0.1, -0.00001, 0.02], "gain_low": [0.08, -0.0003, 0.01],
         "gain_high": [0.12, 0.0003, 0.03], "audit_gain": [0.05, -0.04, -0.01],
         "audit_gain_low": [0.03, -0.07, -0.03], "audit_gain_high": [0.07, -0.01, 0.01],
         "kl": [2.5, -0.02, 0.84], "vs_best_of_n": ["below", "not distinguishable", nan]}
    )  # fmt: skip
    return {
        "RL needed, under the audit": {
            "answer_sentence": answer_context({**base, "answer": "rl", "winners": ["ppo", "grpo"]}),
            "method_clauses": methods_context(table, "offline"),
        },
        "offline enough, under the reward model": {
            "answer_sentence": answer_context({**base, "measure": "reward", "answer": "offline", "winners": ["kto"]}),
            "method_clauses": methods_context(table, "best-of-N"),
        },
        "undecided, two pairs differ": {
            "answer_sentence": answer_context({**base, "answer": "undecided", "beaten": [("ppo", "kto", "above"), ("grpo", "dpo", "below")]}),
            "method_clauses": methods_context(table, "RL"),
        },
        "offline enough against the one RL algorithm at comparable KL": {
            "answer_sentence": answer_context({**base, "answer": "offline", "winners": ["rft"], "pairs": 1,
                                               "opponents": ["grpo"], "left_out": 17, "kl_ratio": 2.0}),
        },
        "undecided, no pair differs, no level": {
            "answer_sentence": answer_context({**base, "answer": "undecided", "ci_level": None}),
        },
        "not compared, a run directory without the comparison": {
            "answer_sentence": answer_context({**base, "answer": "not compared"}),
            "predates_note": {"stage": "notebook 04_evaluation"},
        },
    }  # fmt: skip


if __name__ == "__main__":  # rewrite the golden text (and with --fixture, the fixtures first)
    if "--fixture" in sys.argv:
        for section, cases in (("rl", _rl_cases()), ("rlgf", _rlgf_cases()),
                               ("offline", _offline_cases())):  # fmt: skip
            text = json.dumps(cases, indent=1, ensure_ascii=False) + "\n"
            (GOLDEN / f"{section}.json").write_text(text, encoding="utf-8")
    for section in SECTIONS:
        (GOLDEN / f"{section}.md").write_text(_rendered(section), encoding="utf-8")
        print(f"wrote {GOLDEN / section}.md")


def test_a_side_by_side_table_of_many_algorithms_stacks_in_blocks() -> None:
    """Thirteen algorithms side by side ran past the PDF's margin: the settings table shows at
    most seven at once, each later block opening with a row of its algorithms' names."""
    import pandas as pd

    from rlxf_utils.report.rl import MAX_SIDE_BY_SIDE, stacked_columns

    names = [f"A{i}" for i in range(13)]
    df = pd.DataFrame([{"setting": s, **{a: f"{s}-{a}" for a in names}} for s in ("loss", "lr")])
    out = stacked_columns(df, "setting")
    assert list(out.columns) == ["setting", *names[:MAX_SIDE_BY_SIDE]]
    assert out["setting"].tolist() == ["loss", "lr", "setting", "loss", "lr"]
    assert out.iloc[2].tolist() == ["setting", *names[7:], ""]  # the second block's names
    assert out.iloc[3].tolist() == ["loss", *[f"loss-{a}" for a in names[7:]], ""]
    few = df[["setting", *names[:3]]]
    assert stacked_columns(few, "setting").equals(few)
