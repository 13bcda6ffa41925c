"""The evaluation stage's families (`evaluation.families.EVAL_FAMILIES`), those that need no model
run alone on hand-made samples: what each returns, and that they fill the stage's phases."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from rlxf_utils.evaluation import families, inputs, stage
from rlxf_utils.evaluation.tables import vs_start_family
from tests.test_eval_design import POLICIES, _samples

ALGOS = ["ppo", "grpo"]


@pytest.fixture
def close_figures():
    import matplotlib.pyplot as plt

    yield
    plt.close("all")


def _evaluation() -> inputs.Evaluation:
    """Samples of every policy of `POLICIES` (48 prompts, 17 countries) after grounding, with
    the start policy's samples as best-of-N's pool; a stand-in for the loaded inputs."""
    samples = _samples({"ppo": 0.03, "history_met": 0.05})
    hist = samples["policy"].str.startswith("history_")
    samples["hist_idx"] = np.where(hist, np.arange(len(samples)), np.nan)
    samples["econ_descriptor"] = "fiscal"
    samples["prompt_ids"] = samples["response_ids"] = [[1]] * len(samples)
    country = samples.groupby("prompt_id")["country"].first().reset_index(drop=True)
    ec = SimpleNamespace(best_of_n=4, best_of_n_curve=[4, 1, 2, 2], n_boot=200, alpha=0.05,
                         equivalence_margin=0.01, power=0.8, show_samples=2,
                         samples_per_prompt=4, kl_match_ratio=2.0)  # fmt: skip
    inp = SimpleNamespace(
        ec=ec, seed=0, start="sft", algos=ALGOS, country=country, curve_ns=[1, 2, 4],
        pset=SimpleNamespace(names=["base", "sft", "sft_met", *ALGOS]),
        timer=inputs.PhaseTimer("test"),
    )  # fmt: skip
    pool = samples[samples["policy"] == "sft"].assign(policy="pool")
    return inputs.Evaluation(inp, samples=samples, pool=pool, order=list(POLICIES))


def test_the_statistics_families_alone_on_hand_made_samples(close_figures):
    ev = _evaluation()
    rec = families.record_samples(ev)
    assert rec.entries["policies"] == list(POLICIES) and rec.entries["n_prompts"] == 48
    assert rec.entries["reference_rows"] == int((ev.samples["policy"].str[:8] == "history_").sum())
    written = rec.files["eval/samples.parquet"]
    assert "prompt_ids" not in written and len(written) == len(ev.samples)
    assert rec.files["eval/samples.jsonl"] is written
    assert (rec.tables["eval_samples_shown"].groupby("policy").size() == 2).all()

    cmp = families.compare_policies(ev)
    ev.take(cmp)
    assert list(cmp.tables) == ["eval_summary", "eval_paired", "eval_hacking_gap"]
    assert list(cmp.tables["eval_paired"].columns) == families.PAIRED_COLUMNS
    assert set(cmp.tables["eval_hacking_gap"]["policy"]) == {*ALGOS, "sft_met", "best_of_n"}
    assert ev.family == vs_start_family(POLICIES, "sft") == cmp.entries["families"]["vs_start"]
    assert ev.alpha_family == pytest.approx(0.05 / 4)
    assert [r["policy"] for r in cmp.entries["summary"]] == list(ev.summary["policy"])
    assert set(cmp.figures) == {"eval_gains", "eval_reward_uncertainty", "eval_grounding"}

    bon = families.best_of_n_curve_family(ev)
    ev.take(bon)
    assert bon.entries["best_of_n_curve"] == [1, 2, 4]
    assert bon.tables["eval_best_of_n_curve"]["step"].tolist() == [1, 2, 4]
    assert [r["policy"] for r in bon.entries["vs_best_of_n"]] == ALGOS

    ceiling = families.ceiling_family(ev)
    row = ceiling.tables["eval_ceiling"].set_index("measure").loc["reward"]
    assert row["diff"] == pytest.approx(ceiling.entries["history_contrast"]["reward"]["mean_diff"])
    assert row["diff"] == pytest.approx(0.05, abs=0.02)
    # the attainable gain over the start policy, at the level of the gains it stands beside
    att = ceiling.tables["eval_attainable"].set_index("measure")
    assert list(att.index) == ["reward", "audit_reward"] and set(att["vs"]) == {"sft"}
    assert att["ci_level"].tolist() == pytest.approx([1 - ev.alpha_family] * 2)
    ev.take(ceiling)

    offline = families.offline_family(ev)
    assert set(offline.entries["need_rl"]) == {"audit_reward", "reward"}
    assert list(offline.tables) == ["eval_methods", "eval_rl_vs_offline"]
    assert offline.tables["eval_methods"]["group"].iloc[-1] == "attainable"
    # the phases `evaluation.design` costs designs with keep their names
    assert list(ev.inp.timer.seconds) == ["statistics", "offline methods against RL"]
    ev.take(offline)

    # pairs far apart in KL are listed, not compared (evaluation.kl_match_ratio)
    kls = {**families.policy_kls(ev.summary), "ppo": 9.0}
    ev.summary.loc[ev.summary["policy"] == "ppo", "kl"] = 9.0
    match = families.kl_match_family(ev)
    left = match.tables["eval_kl_unmatched"]
    assert match.entries == {"kl_match_ratio": 2.0} and len(left)
    assert all(max(r.kl, 0.5) > 2 * max(r.kl_versus, 0.5) or max(r.kl_versus, 0.5) > 2 * max(r.kl, 0.5)
               for r in left.itertuples())  # fmt: skip
    assert "ppo" in set(left["policy"]) | set(left["versus"])
    # every entry a family returns reaches eval/summary.json (the ratio was once filtered out)
    for fam in (cmp, bon, ceiling, offline, match):
        lost = set(fam.entries) - set(stage.SUMMARY_KEYS)
        assert not lost, lost
    assert left["kl"].tolist() == [kls[p] for p in left["policy"]]


def test_a_family_keeps_only_what_the_evaluation_holds():
    ev = _evaluation()
    ev.take(inputs.Measured({"eval_x": pd.DataFrame()}, products={"family": ["ppo"]}))
    assert ev.family == ["ppo"] and list(ev.tables) == ["eval_x"]
    with pytest.raises(AttributeError, match="not one of the evaluation"):
        ev.take(inputs.Measured(products={"tables": {}}))


def test_the_summary_file_lists_every_entry_once():
    assert len(set(stage.SUMMARY_KEYS)) == len(stage.SUMMARY_KEYS)
    assert stage.SUMMARY_KEYS[0] == "algorithms" and stage.SUMMARY_KEYS[-1] == "seconds"
