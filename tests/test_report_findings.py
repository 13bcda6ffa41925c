"""The words of the findings (abstract and key findings) and of the sections they draw on (the
across-seed comparison, the over-optimisation curve, the gold judge), once: each macro of
`reports/templates/{findings,seeds,overopt,gold}.jinja` rendered from the contexts in the
committed fixture (`tests/golden/report/<section>.json`) must reproduce the golden text
(`tests/golden/report/<section>.md`).

The fixture's contexts are built by the sections' own functions (`findings.rl_finding`,
`seeds.by_verdict`, `overopt.curve`, ...) from small hand-made tables, one case per branch that
chooses different words. After a deliberate change of a template or the vocabulary, rewrite the
golden text (and review its diff): `PYTHONPATH=. python tests/test_report_findings.py`;
`--fixture` also rebuilds the fixture."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from rlxf_utils.report.seeds import finished_checks
from rlxf_utils.report.wording import sentence

GOLDEN = Path(__file__).resolve().parent / "golden" / "report"
SECTIONS = ("findings", "seeds", "overopt", "gold", "control")


def _rendered(section: str) -> str:
    """Each case of the section's fixture: its macro called with its arguments."""
    cases = json.loads((GOLDEN / f"{section}.json").read_text(encoding="utf-8"))
    parts = [f"## {case}\n\n{c['macro']}: {sentence(section, c['macro'], *c['args'])}"
             for case, c in cases.items()]  # fmt: skip
    return "\n\n".join(parts) + "\n"


@pytest.mark.parametrize("section", SECTIONS)
def test_the_section_renders_its_golden_text(section: str) -> None:
    assert _rendered(section) == (GOLDEN / f"{section}.md").read_text(encoding="utf-8")


# -- the fixture ----------------------------------------------------------------------------------
def _methods(rows: list[tuple]) -> pd.DataFrame:
    cols = ["method", "group", "gain", "gain_low", "gain_high", "audit_gain", "audit_gain_low",
            "audit_gain_high", "kl", "vs_best_of_n"]  # fmt: skip
    return pd.DataFrame(rows, columns=cols)


METHODS = [("PPO", "RL", 0.001, -0.004, 0.006, 0.002, -0.001, 0.005, 0.1, "below"),
           ("GRPO", "RL", 0.026, 0.022, 0.032, 0.005, -0.001, 0.011, 13.0, "below"),
           ("ILHF (history)", "ILHF", -0.013, -0.047, -0.00037, 0.009, 0.005, 0.013, 13.1,
            "not distinguishable"),
           ("KTO", "offline", 0.0, -0.01, 0.01, 0.0, -0.01, 0.01, 0.2, "not distinguishable"),
           ("best-of-4", "best-of-N", 0.018, 0.012, 0.024, 0.004, -0.002, 0.010, 0.64, None)]  # fmt: skip


def _metrics(acc_high: float, main: bool = True) -> dict[str, Any]:
    row = {"protocol": "grouped", "model": "encoder", "accuracy": 0.61, "accuracy_low": 0.57,
           "accuracy_high": acc_high, "roc_auc": 0.54, "roc_auc_low": 0.49, "roc_auc_high": 0.58}  # fmt: skip
    tfidf = {**row, "protocol": "random", "model": "tfidf", "accuracy": 0.66, "accuracy_high": 0.69}
    majority = {**row, "model": "majority", "accuracy": 0.9, "accuracy_high": 0.95}
    return {"alpha": 0.05, "reward_source": "encoder" if main else "nope",
            "reward_protocol": "grouped", "metrics": [row, tfidf, majority]}  # fmt: skip


def _findings() -> dict[str, tuple[str, list]]:
    from rlxf_utils.report import findings as f

    t = _methods(METHODS)
    none = t.assign(gain_low=-1.0, gain_high=0.032, audit_gain_low=-1.0)
    need = {"ci_level": 0.997, "pairs": 15, "winners": ["grpo", "ppo_mle"]}
    cut = {"rule": "failed", "cap": 128, "rl_cap": 48}
    return {
        "headline as stated, cut answers failed": ("headline", [{
            "stated": {"family": "vs_start", "judge": "audit_reward"}, "cut": cut,
            "budgets": [0.5, 1.0, 2.0, 4.0]}]),
        "headline at a KL budget, under the reward model, as written": ("headline", [{
            "stated": {"family": "kl_budget", "judge": "reward"},
            "cut": {**cut, "rule": "as_written"}, "budgets": None}]),
        "headline not stated (an older run)": ("headline", [{"stated": None, "cut": None,
                                                             "budgets": None}]),
        "reward below the claim": ("reward_finding", [f.reward_finding(_metrics(0.64))]),
        "reward claim within an interval, no main model": (
            "reward_finding", [f.reward_finding(_metrics(0.85, main=False))]),
        "rl: raised, lowered, nulls beside them": ("rl_finding", [f.rl_finding(t, "sft", "99.6%")]),
        "rl: RL policies only, no ILHF": ("rl_finding", [f.rl_finding(t.iloc[0:2], "sft", "99%")]),
        "rl: every interval off zero": (
            "rl_finding", [f.rl_finding(t.iloc[1:3].assign(audit_gain_low=0.001), "sft", "99%")]),
        "rl: the audit's movers among finished responses": ("rl_finding", [f.rl_finding(
            t.iloc[1:3].assign(audit_gain_low=0.001, finished=[0.59, 0.08],
                               audit_gain_finished=[0.011, 0.010],
                               audit_gain_finished_low=[0.001, -0.02],
                               audit_gain_finished_high=[0.021, 0.04]), "sft", "99%",
            start_finished=0.98)]),
        # the same with Lee's bounds within prompts, cut responses scored as failed at 128 tokens
        "rl: the audit's movers among finished responses, bounded": ("rl_finding", [f.rl_finding(
            t.iloc[1:3].assign(audit_gain_low=0.001, finished=[0.59, 0.08],
                               audit_gain_finished=[0.011, 0.010],
                               audit_gain_finished_low=[0.001, -0.02],
                               audit_gain_finished_high=[0.021, 0.04],
                               audit_gain_finished_lee_lower=[-0.004, -0.031],
                               audit_gain_finished_lee_upper=[0.018, 0.047],
                               audit_gain_finished_lee_low=[-0.012, -0.06],
                               audit_gain_finished_lee_high=[0.027, 0.08],
                               audit_gain_finished_lee_prompts=[40, 6]), "sft", "99%",
            start_finished=0.98, cut={"rule": "failed", "cap": 128, "rl_cap": 48})]),
        "rl: none moved": ("rl_finding", [f.rl_finding(none, "sft_met", "99%")]),
        "rl: gold at chance": ("rl_finding", [f.rl_finding(none, "sft", "99%", True)]),
        "rl: no policies": ("rl_finding", [f.rl_finding(t[t["group"] == "offline"], "sft", "99%")]),
        "best-of-N: below only": ("best_of_n_finding", [f.best_of_n_finding(t, "sft")]),
        "best-of-N: all below": ("best_of_n_finding", [f.best_of_n_finding(
            t.iloc[:4].assign(vs_best_of_n="below"), "sft")]),
        "best-of-N: the one method, below": ("best_of_n_finding", [f.best_of_n_finding(
            t.iloc[1:2].assign(vs_best_of_n="below"), "sft")]),
        "best-of-N: the one method, not distinguishable": ("best_of_n_finding", [
            f.best_of_n_finding(t.iloc[1:2].assign(vs_best_of_n="not distinguishable"), "sft")]),
        "best-of-N: one above": ("best_of_n_finding", [f.best_of_n_finding(
            t.assign(vs_best_of_n=["above", "below", "below", "below", None]), "sft")]),
        "best-of-N: one above, none below": ("best_of_n_finding", [f.best_of_n_finding(
            t.assign(vs_best_of_n=["above", "x", "x", "x", None]), "sft")]),
        "best-of-N: two above, no best-of-N row": ("best_of_n_finding", [f.best_of_n_finding(
            t.iloc[:4].assign(vs_best_of_n=["above", "above", "below", "x"]), "sft")]),
        "best-of-N: none distinguishable, no row": ("best_of_n_finding", [f.best_of_n_finding(
            t.iloc[:4].assign(vs_best_of_n="not distinguishable"), "sft")]),
        "best-of-N: not compared": ("best_of_n_finding", [f.best_of_n_finding(
            t.assign(vs_best_of_n=""), "sft")]),
        "offline: undecided under the audit": ("offline_finding", [f.offline_finding(
            {"audit_reward": {**need, "answer": "undecided"}})]),
        "offline: RL needed": ("offline_finding", [f.offline_finding(
            {"audit_reward": {**need, "answer": "rl"}})]),
        "offline: RL not needed, reward model, no level": ("offline_finding", [f.offline_finding(
            {"reward": {**need, "ci_level": None, "answer": "offline", "winners": ["kto"]}})]),
        "offline: RL not needed against the one RL algorithm at comparable KL": ("offline_finding", [
            f.offline_finding({"audit_reward": {**need, "answer": "offline", "winners": ["rft"], "pairs": 1,
                                                "opponents": ["grpo"], "left_out": 17, "kl_ratio": 2.0}})]),
        "offline: did not run": ("offline_finding", [f.offline_finding({})]),
        "seeds: one seed": ("seeds_finding", [None]),
        "seeds: further seeds": ("seeds_finding", [_seed_findings()[0]]),
        "seeds: the run's seed's verdicts checked": ("seeds_finding", [_seed_findings()[3]]),
        "predates": ("predates", ["notebook 04_evaluation"]),
    }  # fmt: skip


def _pooled(gain_low: list[float], floors: bool = True) -> pd.DataFrame:
    """Pooled rows of eval_seeds for PPO, GRPO and KTO."""
    low = np.array(gain_low)
    return pd.DataFrame({
        "label": ["PPO", "GRPO", "KTO"], "seeds": 3, "gain": low + 0.01, "gain_low": low,
        "gain_high": low + 0.02, "audit_gain": [0.001, -0.02, 0.0],
        "audit_gain_low": [-0.004, -0.03, -0.003], "audit_gain_high": [0.006, -0.01, 0.003],
        "target_mde": 0.004, "gain_seeds_needed": [5.0, math.inf, math.nan],
        "gain_mde_floor": [0.002, 0.003, 0.006 if floors else math.nan],
        "audit_gain_seeds_needed": [math.nan, math.nan, math.nan],
        "audit_gain_mde_floor": [0.01, 0.02, math.nan] if floors else math.nan,
    })  # fmt: skip


def _check(key: str, label: str, one: tuple, pooled: tuple, held: bool) -> dict[str, Any]:
    """A verdict of the run's own seed (`one`: est, low, high) against its seeds' (`pooled`)."""
    return {"key": key, "label": label, **dict(zip(("est", "low", "high"), one, strict=True)),
            "pooled": dict(zip(("est", "low", "high"), pooled, strict=True)), "held": held}  # fmt: skip


def _seed_findings() -> list[dict[str, Any]]:
    return [{"gold": None, **f} for f in _seed_finding_cases()]


def _seed_finding_cases() -> list[dict[str, Any]]:
    return [
        {"n": 3, "labels": ["PPO", "GRPO"], "level": "97.5%", "reward": ["PPO"], "audit": [],
         "top": None, "checks": [], "finished": []},
        {"n": 2, "labels": ["PPO", "GRPO", "KTO"], "level": "98.3%", "reward": [], "audit": [],
         "top": 0.0123, "checks": [], "finished": []},
        {"n": 2, "labels": ["PPO"], "level": "95%", "reward": [], "audit": [], "top": None,
         "checks": [], "finished": []},
        # the run's seed raised GRPO under both judges; over seeds only the reward model's holds
        {"n": 3, "labels": ["PPO", "GRPO"], "level": "97.5%", "reward": ["GRPO"], "audit": [],
         "top": None, "checks": [
             _check("gain", "GRPO", (0.0069, 0.0045, 0.0093), (0.0055, 0.0022, 0.0087), True),
             _check("audit_gain", "GRPO", (0.0115, 0.0033, 0.0196), (0.0042, -0.0137, 0.0221),
                    False)],
         "finished": [{"label": "GRPO", "finished": 0.69, "checks": []}]},
        # none held: one reversed over seeds, one no longer distinguishable
        {"n": 2, "labels": ["PPO", "KTO"], "level": "97.5%", "reward": ["PPO"], "audit": [],
         "top": None, "checks": [
             _check("gain", "PPO", (-0.004, -0.007, -0.001), (0.003, 0.001, 0.005), False),
             _check("audit_gain", "KTO", (0.01, 0.002, 0.018), (0.002, -0.01, 0.014), False)],
         "finished": [{"label": "PPO", "finished": 0.98, "checks": []}]},
        # a mover that finishes few of its responses: the length caveat
        {"n": 3, "labels": ["GRPO", "ILHF (history)"], "level": "99%", "reward": ["GRPO"],
         "audit": ["ILHF (history)"], "top": None,
         "checks": [_check("gain", "GRPO", (0.0069, 0.0045, 0.0093), (0.0055, 0.0022, 0.0087),
                           True)],
         "finished": [{"label": "GRPO", "finished": 0.69, "checks": []},
                      {"label": "ILHF (history)", "finished": 0.14, "checks": []}]},
        # the same with each mover's gain among finished responses alone over seeds: GRPO's holds,
        # ILHF (history)'s (on one prompt) does not
        {"n": 3, "labels": ["GRPO", "ILHF (history)"], "level": "99%", "reward": ["GRPO"],
         "audit": ["ILHF (history)"], "top": None, "checks": [],
         "finished": [
             {"label": "GRPO", "finished": 0.69, "checks": finished_checks(pd.Series(
                 {"gain": 0.0055, "gain_low": 0.0012, "gain_high": 0.0097, "gain_finished": 0.0048,
                  "gain_finished_low": 0.0016, "gain_finished_high": 0.008,
                  "gain_finished_prompts": 40}), ["gain"])},
             {"label": "ILHF (history)", "finished": 0.14, "checks": finished_checks(pd.Series(
                 {"audit_gain": 0.013, "audit_gain_low": 0.0013, "audit_gain_high": 0.0247,
                  "audit_gain_finished": 0.003, "audit_gain_finished_low": -0.0119,
                  "audit_gain_finished_high": 0.0179, "audit_gain_finished_prompts": 1}),
                 ["audit_gain"])}]},
    ]  # fmt: skip


def _seeds() -> dict[str, tuple[str, list]]:
    from rlxf_utils.report.seeds import by_verdict, seeds_needed

    def context(pooled: pd.DataFrame, margin: float | None = 0.01) -> dict[str, Any]:
        return {"n": 3, "labels": list(pooled["label"]), "level": "98.3%", "margin": margin,
                "start": "sft", "needed": seeds_needed(pooled),
                "measures": [by_verdict(pooled, c, margin) for c in ("gain", "audit_gain")],
                "gold": None}  # fmt: skip

    mixed = _pooled([0.01, -0.005, -0.008])  # reward: PPO above; audit: GRPO below, equivalences
    nulls = _pooled([-0.015, -0.01, -0.012], floors=False)
    one = nulls.iloc[:1].assign(target_mde=math.nan, audit_gain_low=0.001)
    finding = _seed_findings()
    return {
        "one seed": ("one_seed", []),
        "one seed's count": ("count_words", [1]),
        "seeds' count": ("count_words", [3]),
        "figure": ("figure", ["97.5%"]),
        "raised, lowered, nulls, equivalences; seeds needed and floors": ("seeds_sentence", [context(mixed)]),
        "none moved under the reward model, no margin": ("seeds_sentence", [context(nulls, None)]),
        "one algorithm, audit raised, no target": ("seeds_sentence", [context(one)]),
        "finding: some moved": ("seed_finding", [finding[0]]),
        "finding: none moved, a bound": ("seed_finding", [finding[1]]),
        "finding: none moved, no bound": ("seed_finding", [finding[2]]),
        "finding: the run's seed's verdicts, one held, one not": ("seed_finding", [finding[3]]),
        "finding: the run's seed's verdicts, none held": ("seed_finding", [finding[4]]),
        "finding: a mover that finishes few responses": ("seed_finding", [finding[5]]),
        "finding: the movers' gains among finished responses over seeds": ("seed_finding", [finding[6]]),
        # an audit at chance: no pooled move under it is read, whichever way it lies
        "audit at chance: pooled verdicts": ("seeds_sentence", [{**context(mixed), "gold": _gold(False)}]),
        "finding: audit at chance, a mover under it": ("seed_finding", [{**finding[5], "gold": _gold(False)}]),
    }  # fmt: skip


def _gold(can_judge: bool) -> dict[str, Any]:
    return {"auc": 0.56, "low": 0.52 if can_judge else 0.48, "high": 0.64, "rows": 300,
            "level": "95%", "can_judge": can_judge}  # fmt: skip


CEILING = {"rows": [{"judge": "reward model", "diff": 0.131, "low": 0.1, "high": 0.16},
                    {"judge": "audit", "diff": 0.065, "low": -0.0004, "high": 0.13}],
           "alpha": 0.05, "n": 7, "clusters": 4}  # fmt: skip


def _overopt() -> dict[str, tuple[str, list]]:
    from rlxf_utils.report.overopt import curve

    def pts(rows: list[tuple]) -> pd.DataFrame:
        cols = ["method", "label", "point", "source", "sqrt_kl", "proxy", "proxy_low",
                "proxy_high", "gold", "gold_low", "gold_high"]  # fmt: skip
        return pd.DataFrame(rows, columns=cols)

    table = pts([("best_of_n", "best-of-n", 2, "best_of_n", 0.5, 0.01, 0.005, 0.02, 0.0, -0.1, 0.1),
                 ("best_of_n", "best-of-n", 8, "best_of_n", 1.2, 0.02, 0.01, 0.03, 0.01, -0.1, 0.12),
                 ("ppo", "PPO", 4, "snapshot", 0.7, 0.2, 0.1, 0.3, -0.1, -0.2, -0.05),
                 ("ppo", "PPO", 8, "final", 1.5, 0.25, 0.15, 0.35, -0.12, -0.2, -0.06),
                 ("grpo", "GRPO", 4, "snapshot", 0.9, 0.0002, -0.003, 0.004, 0.001, -0.2, 0.3),
                 ("grpo", "GRPO", 8, "final", 0.6, 0.0, -0.1, 0.1, 0.0, -0.3, 0.3)])  # fmt: skip
    start = {"start": "sft", "alpha": 0.004, "margin": 0.01}
    fits = [{"method": "best_of_n", "family": "best_of_n", "reward": "proxy", "alpha": 0.31,
             "alpha_se": 0.02, "beta": -0.0001, "beta_se": 0.001, "beta_low": -0.003, "r2": 0.93,
             "points": 4},
            {"method": "ppo", "family": "rl", "reward": "gold", "alpha": -0.02, "alpha_se": 0.07,
             "beta": None, "beta_se": math.nan, "beta_low": None, "r2": 0.04, "points": 5},
            {"method": "ppo", "family": "rl", "reward": "proxy", "alpha": 0.1, "alpha_se": 0.01,
             "beta": 0.05, "beta_se": 0.01, "beta_low": 0.02, "r2": 0.5, "points": 5},
            {"method": "grpo", "family": "rl", "reward": "gold", "alpha": 0.1, "alpha_se": 0.01,
             "beta": 0.05, "beta_se": 0.01, "beta_low": 0.01, "r2": 0.5, "points": 6}]  # fmt: skip
    return {
        "predates": ("predates", ["notebook 04_evaluation"]),
        "no point measured": ("curve_sentence", [{**start, "points": [], "gold": None,
                                                  "ceiling": None}]),
        "points, a gold that judges, the ceiling": ("curve_sentence", [{
            **start, "points": curve(table, 0.01, _gold(True)), "gold": _gold(True),
            "ceiling": CEILING}]),
        "points, a gold at chance, no margin": ("curve_sentence", [{
            **start, "margin": None, "points": curve(table.iloc[1:], None, _gold(False)),
            "gold": _gold(False), "ceiling": None}]),
        "no fit": ("fit_sentence", [[]]),
        "one fit": ("fit_sentence", [fits[:1]]),
        "three fits": ("fit_sentence", [fits]),
        "budgets: no run of them": ("budget_sentence", [None]),
        "budgets: one reached by all, one by one method, one told apart": ("budget_sentence", [
            _budget_context()]),
        "budgets: none distinguishable": ("budget_sentence", [_budget_context(distinct=False)]),
        "budgets: a curve passes one with no point near": ("budget_sentence",
                                                           [_budget_context(far=True)]),
        "budgets: the finished share beside them": ("budget_sentence",
                                                    [_budget_context(finished=True)]),
        "distinct share": ("distinct_sentence", [{"candidates": 4.0, "distinct": 0.95,
                                                  "fraction": 0.987}]),
        "distinct share not recorded": ("distinct_sentence", [{"candidates": 0, "distinct": None,
                                                               "fraction": None}]),
    }  # fmt: skip


def _budget_context(
    distinct: bool = True, far: bool = False, finished: bool = False
) -> dict[str, Any]:
    """`overopt.budget_context` on a run with three methods: at 1 nat all reach and one pair is
    told apart under the reward model, none under the audit; at 4 nats only PPO reaches. `far`:
    a fourth, a method at 29 nats without snapshots, passes both with no point near (span 4),
    and a fifth reaches neither. `finished`: the finished share read beside the gains, PPO's and
    GRPO's below the start policy's at 1 nat, none at 4."""
    from rlxf_utils.artifacts import RunDir
    from rlxf_utils.report.overopt import budget_context

    gains = pd.DataFrame([{"budget": b, "measure": m, "method": a, "reaches": b < 2 or a == "ppo"}
                          for b in (1.0, 4.0) for m in ("reward", "audit_reward")
                          for a in ("ppo", "grpo", "best_of_n")])  # fmt: skip
    if far:
        gains = pd.concat([gains.assign(near=gains["reaches"]), pd.DataFrame(
            [{"budget": b, "measure": m, "method": a, "reaches": a != "kto", "near": False}
             for b in (1.0, 4.0) for m in ("reward", "audit_reward")
             for a in ("ilhf_online", "kto")])], ignore_index=True)  # fmt: skip
    if finished:
        shares = {
            (1.0, "ppo"): -0.12,
            (1.0, "grpo"): -0.05,
            (1.0, "best_of_n"): 0.0,
            (4.0, "ppo"): -0.02,
        }
        gains = pd.concat([gains, pd.DataFrame(
            [{"budget": b, "measure": "finished", "method": a, "reaches": True, "gain": d,
              "low": d - 0.04, "high": d + 0.04} for (b, a), d in shares.items()])],
            ignore_index=True)  # fmt: skip
    pairs = pd.DataFrame([
        {"budget": 1.0, "measure": m, "policy": a, "versus": v, "diff": d, "low": d - 0.01,
         "high": d + 0.01, "ci_level": 0.9983}
        for m, shift in (("reward", 0.0), ("audit_reward", -0.02))
        for a, v, d in (("ppo", "grpo", 0.02 + shift), ("ppo", "best_of_n", 0.005 + shift),
                        ("grpo", "best_of_n", -0.004))])  # fmt: skip
    with __import__("tempfile").TemporaryDirectory() as tmp:
        run = RunDir(Path(tmp))
        run.write_table("eval_kl_budget_gains", gains)
        run.write_table("eval_kl_budget_pairs", pairs)
        if not distinct:  # every pair's interval holds zero
            pairs = pairs.assign(low=pairs["diff"] - 0.05, high=pairs["diff"] + 0.05)
        run.write_table("eval_kl_budget_pairs", pairs)
        return budget_context(run, "notebook 04_evaluation", 4.0 if far else None)


def _control_cases() -> dict[str, tuple[str, list]]:
    """The control section's branches: no control run; the audit saw a gain smaller than the
    main study's largest bound, larger than it, or a gain the main study saw too; the audit saw
    nothing."""

    def row(policy: str, true: tuple, reward: tuple, audit: tuple) -> dict[str, Any]:
        def m(t: tuple) -> dict[str, Any]:
            return {"est": t[0], "low": t[1], "high": t[2], "verdict": t[3]}

        return {"policy": policy, "n": 48, "level": 0.9875, "true": m(true), "reward": m(reward),
                "audit": m(audit), "reward_matches": reward[3] == true[3],
                "audit_matches": audit[3] == true[3]}  # fmt: skip

    up, null = "above", "not distinguishable"
    rows = [row("ppo", (0.04, 0.02, 0.06, up), (0.08, 0.05, 0.11, up), (0.03, 0.01, 0.05, up)),
            row("grpo", (0.01, -0.01, 0.03, null), (0.05, 0.02, 0.08, up), (0.0, -0.02, 0.02, null))]  # fmt: skip
    base = {"rows": rows, "auc": 0.748, "auc_all": 0.75, "held_out": 1130, "agrees": 0.61,
            "detected_audit": 0.04, "detected_reward": 0.01, "largest_true": 0.04, "commit": "abc1234",
            "true_above": [0.04], "seen_audit": 0.03, "scale_audit": 0.75,
            "audit_auc": {"control": {"auc": 0.644, "low": 0.613, "high": 0.674, "level": "95%"},
                          "main": {"auc": 0.541, "low": 0.49, "high": 0.59, "level": "95%"}},
            "main": {"bound": 0.021, "methods": 13, "any_above": False}}  # fmt: skip
    return {
        "control: none beside the run": ("control_sentence", [None]),
        "control: seen, and the main bound below it": ("control_sentence", [base]),
        "control: seen, the main bound above it": (
            "control_sentence",
            [{**base, "main": {"bound": 0.06, "methods": 13, "any_above": False}}],
        ),
        "control: seen, and the main study saw one": (
            "control_sentence",
            [
                {
                    **base,
                    "main": {"bound": 0.06, "methods": 13, "any_above": True},
                    "audit_auc": None,
                }
            ],
        ),
        "control: a true gain the audit missed": (
            "control_sentence",
            [{**base, "detected_audit": None}],
        ),
        "control: no true gain to find": (
            "control_sentence",
            [
                {
                    **base,
                    "detected_audit": None,
                    "rows": rows[1:],
                    "largest_true": 0.01,
                    "true_above": [],
                }
            ],
        ),  # fmt: skip
    }


def _gold_cases() -> dict[str, tuple[str, list]]:
    one = {**CEILING, "rows": CEILING["rows"][:1], "alpha": 0.01}
    three = {**CEILING, "rows": [*CEILING["rows"], {**CEILING["rows"][1], "judge": "gold"}]}
    return {
        "a gold that judges": ("auc_words", [_gold(True)]),
        "a gold at chance, as the audit's": ("auc_words", [_gold(False), "the audit's"]),
        "a gold at chance on human rows that the control shows to see a gain": (
            "auc_words",
            [
                {
                    **_gold(False),
                    "above_chance": False,
                    "can_judge": True,
                    "control": {"methods": 5, "matched": 5, "detected": 0.031, "sees": True},
                }
            ],
        ),
        "ceiling, two judges": ("ceiling_sentence", [CEILING]),
        "ceiling, one judge": ("ceiling_sentence", [one]),
        "ceiling, three judges": ("ceiling_sentence", [three]),
    }


def _plain(x: Any) -> Any:
    """numpy scalars as Python's, for JSON."""
    return x.item() if isinstance(x, np.generic) else str(x)


def _write_fixture() -> None:
    for section, cases in (("findings", _findings()), ("seeds", _seeds()),
                           ("overopt", _overopt()), ("gold", _gold_cases()),
                           ("control", _control_cases())):  # fmt: skip
        out = {case: {"macro": m, "args": args} for case, (m, args) in cases.items()}
        (GOLDEN / f"{section}.json").write_text(
            json.dumps(out, indent=1, default=_plain, ensure_ascii=False) + "\n", encoding="utf-8"
        )


if __name__ == "__main__":  # rewrite the golden texts (and with --fixture, the fixtures first)
    if "--fixture" in sys.argv:
        _write_fixture()
    for section in SECTIONS:
        (GOLDEN / f"{section}.md").write_text(_rendered(section), encoding="utf-8")
        print(f"wrote {GOLDEN / f'{section}.md'}")
