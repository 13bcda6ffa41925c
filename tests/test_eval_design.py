"""The evaluation's families and size (notebook 04): which comparisons the vs-start family
holds, one level for one number (the over-optimisation curve's final points are the tables'),
and the variance components and design tables (`rlxf_utils.evaluation.design`)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from rlxf_utils.evaluation.design import (
    countries_needed,
    design_table,
    sampling_costs,
    variance_table,
)
from rlxf_utils.evaluation.overopt import overoptimisation_points
from rlxf_utils.evaluation.tables import summary_table, vs_start_family
from rlxf_utils.report.wording import ABOVE, UNCLEAR
from rlxf_utils.stats import family_alpha

POLICIES = ("base", "sft", "sft_met", "ppo", "grpo", "best_of_n", "history_met",
            "history_nonmet", "random_policy")  # fmt: skip
SIZES = [8, 6, 5, 4, 4, 3, 3, 3, 2, 2, 2, 1, 1, 1, 1, 1, 1]  # 48 prompts in 17 countries


def _samples(gains: dict[str, float], k: int = 4, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    country = np.repeat(np.arange(len(SIZES)), SIZES)
    prompt_level = rng.normal(0.6, 0.05, country.size)
    rows = []
    for pol in POLICIES:
        shift = gains.get(pol, 0.0)
        c_eff = rng.normal(0, 0.004, len(SIZES))
        for p, c in enumerate(country):
            b = rng.normal(0, 0.01)
            for j in range(1 if pol == "best_of_n" else k):
                r = prompt_level[p] + shift + c_eff[c] + b + rng.normal(0, 0.05)
                rows.append({"policy": pol, "prompt_id": p, "sample_id": j, "country": f"C{c}",
                             "reward": r, "audit_reward": r - shift / 2, "logp_policy": -5.0,
                             "logp_ref": -5.0, "logp_base": -5.0, "n_tokens": 5, "finished": True,
                             "response": f"w{p} w{j} {pol}", "grounded_met_rate": 0.6,
                             "max_sim": 0.5})  # fmt: skip
    return pd.DataFrame(rows)


def test_the_vs_start_family_holds_only_the_methods_tuned_or_selected_from_the_start() -> None:
    assert vs_start_family(POLICIES, "sft") == ["sft_met", "ppo", "grpo", "best_of_n"]
    s, paired = summary_table(_samples({"ppo": 0.03}), ["base", "sft", "sft_met", "ppo", "grpo"],
                              "sft", 4, 200, 0.05, 0, margin=0.01)  # fmt: skip
    assert set(paired["policy"]) == {"sft_met", "ppo", "grpo", "best_of_n"}
    assert paired["ci_level"].to_numpy() == pytest.approx(1 - 0.05 / 4)  # m = 4, not 8
    s = s.set_index("policy")
    # the zero-shot model and the history rows keep their Ave(R), not a gain in the family
    assert s.loc[["base", "history_met", "random_policy"], "gain"].isna().all()
    assert s.loc["base", "ave_r_low"] < s.loc["base", "ave_r"] < s.loc["base", "ave_r_high"]
    assert s.loc["ppo", "gain_verdict"] == "above" and s.loc["ppo", "gain_low"] > 0
    # a null stated as a bound, with the family's MDE
    r = paired[(paired.measure == "reward") & (paired.policy == "grpo")].iloc[0]
    assert r["bound"] == r["ci_high"] and r["verdict"] in ("equivalent", "not distinguishable")
    assert r["verdict"] == ("equivalent" if r["ci_low"] >= -0.01 and r["ci_high"] <= 0.01
                            else "not distinguishable")  # fmt: skip
    assert 0 < r["mde"] < 0.05 and r["margin"] == 0.01


def test_a_final_policys_point_on_the_curve_is_the_tables_number() -> None:
    samples = _samples({"ppo": 0.03})
    s, paired = summary_table(samples, ["base", "sft", "sft_met", "ppo", "grpo"], "sft", 4, 200,
                              0.05, 0)  # fmt: skip
    pool = samples[samples.policy == "sft"].assign(policy="pool")
    countries = samples.groupby("prompt_id")["country"].first()
    pts = overoptimisation_points(samples, pd.DataFrame(), pool, s, ["ppo"], "sft", [2], 16,
                                  countries, 200, family_alpha(0.05, 4), 0)  # fmt: skip
    fin = pts[(pts.method == "ppo") & (pts.source == "final")].iloc[0]
    row = s.set_index("policy").loc["ppo"]
    assert (fin["proxy"], fin["proxy_low"], fin["proxy_high"]) == pytest.approx(
        (row["gain"], row["gain_low"], row["gain_high"])
    )
    assert (fin["gold_low"], fin["gold_high"]) == pytest.approx(
        (row["audit_gain_low"], row["audit_gain_high"])
    )
    assert fin["ci_level"] == pytest.approx(1 - 0.05 / 4)


def test_variance_components_and_the_design_they_call_for() -> None:
    samples = _samples({"ppo": 0.03, "grpo": 0.01})
    family = vs_start_family(POLICIES, "sft")
    comp = variance_table(samples, family, "sft")
    assert set(comp["judge"]) == {"reward model", "audit"}
    assert len(comp) == 2 * len(family)
    ppo = comp[(comp.policy == "ppo") & (comp.judge == "reward model")].iloc[0]
    # simulated: sample noise 0.05 on each side (var 0.005 of the difference), prompts 0.01
    # on each side (2e-4), countries 0.004 on each side (3.2e-5)
    assert ppo["var_sample"] == pytest.approx(0.005, rel=0.15)
    assert ppo["var_prompt"] == pytest.approx(2e-4, abs=2e-4)
    assert ppo["mean"] == pytest.approx(0.03, abs=0.01)
    bon = comp[(comp.policy == "best_of_n") & (comp.judge == "reward model")].iloc[0]
    assert math.isnan(bon["var_sample"])  # one sample per prompt: no within-prompt component
    used = samples[samples.policy == "sft"].groupby("country")["prompt_id"].nunique().to_dict()
    available = {c: 3 * n for c, n in used.items()}  # 144 contexts in all
    seconds = {"samples sft": 100.0, "samples ppo": 100.0, "rewards": 40.0,
               "best-of-N pool": 96.0, "frontier snapshots": 48.0, "loading": 500.0}  # fmt: skip
    assert sampling_costs(seconds, 48, 4) == pytest.approx((240 / 192, 144 / 48))
    d = design_table(comp, available, used, 4, seconds, len(family), 0.05, 0.8, 0.004)
    rm = d[d.judge == "reward model"].set_index("design")
    now = rm.loc["this run"]
    assert (now["prompts"], now["samples_per_prompt"], now["countries"]) == (48, 4, 17)
    assert now["cost_s"] == pytest.approx(48 * (3 + 4 * 240 / 192))
    best = rm.loc["best at this run's cost"]
    assert best["cost_s"] <= now["cost_s"] + 1e-9 and best["mde"] <= now["mde"]
    every = rm.loc["every held-out context"]
    assert every["prompts"] == 144 and every["mde"] < now["mde"]
    reach = [n for n in rm.index if n.startswith("cheapest reaching")]
    assert all(rm.loc[n, "mde"] <= 0.004 for n in reach)
    assert rm["reaches_target"].tolist() == (rm["mde"] <= 0.004).tolist()


# -- the report: families, MDEs, nulls as bounds ---------------------------------------------
def _report_run(tmp_path, gains):
    import re
    from pathlib import Path

    from rlxf_utils.artifacts import RunDir

    samples = _samples(gains)
    generated = ["base", "sft", "sft_met", "ppo", "grpo"]
    s, paired = summary_table(samples, generated, "sft", 4, 200, 0.05, 0, margin=0.01)
    family = vs_start_family(samples["policy"].unique(), "sft")
    comp = variance_table(samples, family, "sft")
    used = samples[samples.policy == "sft"].groupby("country")["prompt_id"].nunique().to_dict()
    design = design_table(comp, {c: 6 * n for c, n in used.items()}, used, 4,
                          {"samples sft": 300.0, "best-of-N pool": 60.0}, len(family), 0.05, 0.8,
                          0.004)  # fmt: skip
    run = RunDir(tmp_path / "run")
    run.write_json("eval/summary.json", {
        "algorithms": ["ppo", "grpo"], "start_policy": "sft", "alpha": 0.05, "n_prompts": 48,
        "samples_per_prompt": 4, "best_of_n": 4, "power": 0.8, "equivalence_margin": 0.01,
        "target_mde": 0.004, "summary": s.to_dict("records")})  # fmt: skip
    run.write_table("eval_paired", paired)
    run.write_table("eval_variance_components", comp)
    run.write_table("eval_design", design)
    run.write_table("eval_table3", pd.DataFrame(
        {"prompt": ["p"], "policy": ["ppo"], "response": ["r"], "reward": [0.5]}))  # fmt: skip
    qmd = (Path(__file__).resolve().parent.parent / "reports/rlxf_report.qmd").read_text()
    return run, s, set(re.findall(r"\{\{< var eval\.(\w+) >\}\}", qmd))


def test_the_report_states_the_family_its_mde_and_every_null_as_a_bound(tmp_path) -> None:
    from rlxf_utils.report import evaluation as ev
    from rlxf_utils.report.evaluation import eval_section
    from rlxf_utils.stats import bound_verdict

    run, s, used_vars = _report_run(tmp_path, {"ppo": 0.05, "grpo": 0.0})
    variables, files = eval_section(run)
    assert used_vars <= set(variables)  # every eval variable the report quotes exists
    # which rows, sizes and verdicts the sentences read (their words: tests/test_report_eval.py)
    paired = run.read_table("eval_paired")
    fam = ev.family_context(paired, "sft", "99%", 0.8)
    assert fam["policies"][:3] == ["sft_met", "ppo", "grpo"] and len(fam["policies"]) == 4
    assert [m["judge"] for m in fam["mdes"]] == ["reward", "audit_reward"]
    assert ev.families_context({}, paired, pd.DataFrame(), "sft")["vs_start"]["m"] == 4
    design = ev.design_context(run.read_table("eval_design"), 0.004)
    assert all(j["mde"] > 0 for j in design["judges"])
    s = s.set_index("policy")
    gains = {a["policy"]: a["gain"] for a in ev.algos_context(s, ["ppo", "grpo"], "sft", "99%", 0.01, None)["algos"]}  # fmt: skip
    assert bound_verdict(gains["ppo"]["low"], gains["ppo"]["high"]) == ABOVE  # PPO raised
    assert gains["grpo"]["high"] == s.loc["grpo", "gain_high"]  # grpo's null, as its bound
    assert bound_verdict(gains["grpo"]["low"], gains["grpo"]["high"]) == UNCLEAR
    assert variables["margin"] == "0.010" and variables["power"] == "80%"
    assert (
        "| verdict |" in files["eval_paired.md"].replace("  ", " ")
        or "verdict" in files["eval_paired.md"]
    )
    assert "between countries ×10⁴" in files["eval_variance_components.md"]
    assert (
        "this run" in files["eval_design.md"]
        and "every held-out context" in files["eval_design.md"]
    )


def test_equivalence_within_the_margin_is_said_as_such() -> None:
    """Equivalence only where the whole interval lies within ±margin (the words, 'equivalent
    within ±0.010: a gain of at most +0.006', are the golden file's)."""
    from rlxf_utils.report.evaluation import gain

    def equivalent(low: float, high: float, margin: float | None) -> bool:
        return gain(pd.Series({"gain": 0.0, "gain_low": low, "gain_high": high}), "gain", margin)["equivalent"]  # fmt: skip

    assert not equivalent(0.001, 0.02, 0.01)  # excludes zero: a direction, no bound clause
    assert equivalent(-0.004, 0.006, 0.01)
    assert not equivalent(-0.004, 0.016, 0.01)
    assert not equivalent(-0.004, 0.006, None)


def test_where_no_held_out_design_reaches_the_target_it_says_how_many_countries_would() -> None:
    # the default run's audit components (2026-11-27): countries 3.2e-5, prompts 1.0e-5,
    # samples 4.9e-4; 19 held-out countries of about 16 contexts each
    comp = {"var_country": 3.2e-5, "var_prompt": 1.0e-5, "var_sample": 4.9e-4}
    available = {f"C{i}": 16 for i in range(19)}
    need = countries_needed(comp, available, 4, 0.004, 6.8, 13.3, 10, 0.05, 0.8)
    g = int(need["countries"])
    assert need["mde"] <= 0.004 and need["prompts"] == 16 * g and need["df"] == pytest.approx(g - 1)
    # the fewest: one country fewer misses the target; the country floor alone,
    # (z + z) x sqrt(3.2e-5 / G), already needs more than the 19 held out
    fewer = countries_needed(
        comp, available, 4, 0.004, 6.8, 13.3, 10, 0.05, 0.8, max_countries=g - 1
    )
    assert fewer is None and 19 < g < 60
    # in the design table: a row where every held-out context misses the target, none otherwise
    used = {c: 2 for c in available}
    rows = pd.DataFrame([{"policy": "ppo", "judge": "audit", **comp}])
    d = design_table(rows, available, used, 4, {"samples ppo": 100.0}, 10, 0.05, 0.8, 0.004)
    names = list(d["design"])
    assert "countries needed for MDE 0.004" in names
    assert d.set_index("design").loc["countries needed for MDE 0.004", "countries"] == g
    easy = design_table(rows, available, used, 4, {"samples ppo": 100.0}, 10, 0.05, 0.8, 0.02)
    assert not any(n.startswith("countries needed") for n in easy["design"])


def test_uneven_countries_need_more_of_them_than_even_ones_of_the_same_mean() -> None:
    """The default run's 19 held-out countries hold 7 to 30 contexts (mean 15.8): kept uneven,
    the audit's MDE target needs more countries than 19 countries of 16 each would say, as the
    real split at 39 held-out countries showed (MDE 0.0046 against 0.004 needed)."""
    comp = {"var_country": 3.2e-5, "var_prompt": 1.0e-5, "var_sample": 4.9e-4}
    sizes = [7, 10, 10, 10, 11, 11, 14, 14, 15, 15, 16, 17, 18, 18, 19, 21, 21, 24, 30]
    uneven = countries_needed(comp, {f"C{i}": n for i, n in enumerate(sizes)}, 4, 0.004, 6.8,
                              13.3, 10, 0.05, 0.8)  # fmt: skip
    even = countries_needed(comp, {f"C{i}": 16 for i in range(19)}, 4, 0.004, 6.8, 13.3, 10,
                            0.05, 0.8)  # fmt: skip
    assert uneven["countries"] > even["countries"]
    assert uneven["mde"] <= 0.004 and abs(uneven["prompts"] / uneven["countries"] - 15.8) < 1


def test_the_design_is_sized_on_the_familys_most_variable_method() -> None:
    """Each component is its largest over the family (not the median): the design's predicted
    MDE is then at least each method's own on the same design, so the table's MDE holds for
    every method it sizes for, the most variable included. Three methods whose components
    differ: the median would size on the middle one and promise it to the third too."""
    from rlxf_utils.evaluation.design import SIZED_ON
    from rlxf_utils.stats import design_se, mde

    rows = pd.DataFrame([
        {"policy": "ppo", "judge": "audit", "var_country": 1e-5, "var_prompt": 2e-5, "var_sample": 4e-4},
        {"policy": "grpo", "judge": "audit", "var_country": 4e-5, "var_prompt": 1e-5, "var_sample": 9e-4},
        {"policy": "dpo", "judge": "audit", "var_country": 2e-5, "var_prompt": 5e-5, "var_sample": 1e-4},
        {"policy": "best_of_n", "judge": "audit", "var_country": 3e-5, "var_prompt": 6e-5,
         "var_sample": np.nan},
    ])  # fmt: skip
    used = {f"C{i}": n for i, n in enumerate([4, 3, 3, 2, 2, 1, 1])}
    d = design_table(rows, {c: 3 * n for c, n in used.items()}, used, 4, {"samples ppo": 60.0},
                     3, 0.05, 0.8, None)  # fmt: skip
    own = d[d["design"] == "this run"].iloc[0]
    assert (own["var_country"], own["var_prompt"], own["var_sample"]) == (4e-5, 6e-5, 9e-4)
    assert own["sized_on"] == SIZED_ON and "largest" in SIZED_ON
    for _, r in rows.iterrows():  # every method's own MDE on this design, at the table's df
        se = design_se(r.to_dict(), list(used.values()), 4)
        assert mde(se, 3, 0.05, 0.8, own["df"]) <= own["mde"] + 1e-12, r["policy"]


def test_a_design_table_with_one_country_still_has_this_runs_row() -> None:
    """The smoke profile's few prompts may all fall in one country: no country component and no
    t interval (its MDE falls back to z quantiles), and the stage does not stop there."""
    samples = _samples({"ppo": 0.03}).assign(country="C0")
    family = vs_start_family(POLICIES, "sft")
    comp = variance_table(samples, family, "sft")
    assert comp["var_country"].isna().all()
    d = design_table(comp, {"C0": 96}, {"C0": 48}, 4, {"samples sft": 10.0}, 4, 0.05, 0.8, 0.004)
    own = d[(d["design"] == "this run") & (d["judge"] == "reward model")].iloc[0]
    assert own["countries"] == 1 and math.isnan(own["df"]) and own["mde"] > 0
