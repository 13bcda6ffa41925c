"""One level and one interval method per number, stated where it is shown (issue 59, item 5):
best-of-N comparisons on the study's cluster t at the family's level (the KL's interval too),
and the figures whose bars mix levels say each."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from rlxf_utils.evaluation.best_of_n import best_of_n_kl_bound, versus_best_of_n
from rlxf_utils.stats import cluster_t
from rlxf_utils.stats.intervals import level_span

#: 36 prompts in 9 countries of uneven size.
COUNTRY = np.repeat(list("ABCDEFGHI"), [1, 2, 3, 4, 5, 6, 7, 4, 4])


def _frames(kl_noise: float) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, pd.Series]:
    n = COUNTRY.size
    rng = np.random.default_rng(3)
    per_prompt = pd.DataFrame({k: 0.5 + 0.05 * j + 0.02 * rng.standard_normal(n)
                               for j, k in enumerate((1, 2, 4, 8))})  # fmt: skip
    kl_mid = (best_of_n_kl_bound(2) + best_of_n_kl_bound(4)) / 2
    kl = kl_mid + kl_noise * rng.standard_normal(n)
    kl += kl_mid - kl.mean()
    samples = pd.DataFrame({"policy": "ppo", "prompt_id": np.arange(n),
                            "reward": 0.6 + 0.03 * rng.standard_normal(n), "logp_ref": -20.0,
                            "logp_policy": -20.0 + kl})  # fmt: skip
    summary = pd.DataFrame({"policy": ["ppo", "grpo"], "kl": [kl_mid, kl_mid]})
    both = pd.concat([samples, samples.assign(policy="grpo")], ignore_index=True)
    return both, per_prompt, summary, pd.Series(COUNTRY, index=np.arange(n))


def test_best_of_n_differences_are_cluster_t_at_the_family_level():
    samples, per_prompt, summary, clusters = _frames(kl_noise=0.0)  # the KL known exactly
    out = versus_best_of_n(samples, per_prompt, summary, ["ppo", "grpo"], 200, 0.05, 0, clusters)
    r = out.set_index("policy").loc["ppo"]
    mid = (best_of_n_kl_bound(2) + best_of_n_kl_bound(4)) / 2
    w = (mid - best_of_n_kl_bound(2)) / (best_of_n_kl_bound(4) - best_of_n_kl_bound(2))
    curve = (1 - w) * per_prompt[2] + w * per_prompt[4]
    d = samples[samples["policy"] == "ppo"].set_index("prompt_id")["reward"] - curve
    want = cluster_t(d.to_numpy(), COUNTRY, 0.05 / 2)  # a family of two policies
    assert r["ci_level"] == pytest.approx(1 - 0.05 / 2)
    assert r["diff"] == pytest.approx(d.mean())
    assert (r["diff_low"], r["diff_high"]) == pytest.approx((want["low"], want["high"]), abs=1e-12)
    assert r["p_family"] == pytest.approx(min(1.0, 2 * want["p"]))
    assert r["kl_low"] == pytest.approx(mid) == r["kl_high"]  # no KL error to carry


def test_best_of_n_kl_interval_is_at_the_differences_level_and_carries_into_it():
    samples, per_prompt, summary, clusters = _frames(kl_noise=0.5)
    noisy = versus_best_of_n(samples, per_prompt, summary, ["ppo", "grpo"], 200, 0.05, 0, clusters)
    exact = versus_best_of_n(_frames(0.0)[0], per_prompt, summary, ["ppo", "grpo"], 200, 0.05, 0,
                             clusters)  # fmt: skip
    r, e = noisy.iloc[0], exact.iloc[0]
    kl_pp = samples[samples["policy"] == "ppo"].set_index("prompt_id")
    want = cluster_t((kl_pp["logp_policy"] - kl_pp["logp_ref"]).to_numpy(), COUNTRY, 0.05 / 2)
    assert (r["kl_low"], r["kl_high"]) == pytest.approx((want["low"], want["high"]), abs=1e-12)
    assert r["diff"] == pytest.approx(e["diff"])  # the KL's error widens, never moves, it
    assert r["diff_high"] - r["diff_low"] > e["diff_high"] - e["diff_low"]
    assert r["method"] == "cluster t over countries"


def test_the_easy_hard_figure_states_both_levels_it_draws():
    from rlxf_utils.evaluation.rlgf import plot_easy_hard

    rows = [{"policy": p, "label": p, "half": h, "ave_r": 0.6, "ave_r_low": 0.55,
             "ave_r_high": 0.65, "gain": 0.01 if p != "sft" else np.nan,
             "gain_low": -0.01 if p != "sft" else np.nan, "gain_high": 0.03 if p != "sft" else np.nan,
             "gain_ci_level": 1 - 0.05 / 6 if p != "sft" else np.nan, "median_met_rate": 0.6}
            for p in ("sft", "ppo", "grpo") for h in ("easy", "hard")]  # fmt: skip
    title = plot_easy_hard(pd.DataFrame(rows), "sft", 0.05)._suptitle.get_text()
    assert "Ave(R) 95% CI" in title and "gain 99.2% simultaneous cluster t CI" in title


def test_the_seeds_figure_states_the_seeds_and_the_pooled_levels():
    from rlxf_utils.report.wording import sentence
    from rlxf_utils.seeds import plot_seeds

    per = [{"algorithm": "ppo", "label": "PPO", "seed": s, "ci_level": 1 - 0.05 / 5,
            **{f"{m}{e}": v for m in ("gain", "audit_gain")
               for e, v in (("", 0.01), ("_low", -0.01), ("_high", 0.03))}}
           for s in ("0", "1", "2")]  # fmt: skip
    pooled = {**per[0], "seed": "pooled", "ci_level": 1 - 0.05 / 2}
    title = plot_seeds(pd.DataFrame([*per, pooled]), "sft")._suptitle.get_text()
    assert "each seed with its own 99% simultaneous cluster t interval" in title
    assert "mean over seeds with its 97.5% simultaneous interval" in title
    caption = sentence("seeds", "figure", "97.5%", "99%")
    assert (
        "own 99% simultaneous cluster t interval" in caption and "its 97.5% simultaneous" in caption
    )


def test_level_span_says_one_level_or_the_range():
    assert level_span([0.99, 0.99, np.nan]) == "99%"
    assert level_span([0.99, 1 - 0.05 / 8]) == "99% to 99.4%"
    assert level_span([]) == "family-level" and level_span([np.nan], missing="") == ""


def test_the_methods_figure_and_the_uncertainty_sentence_state_the_family_level():
    from rlxf_utils.evaluation.offline import plot_methods
    from rlxf_utils.report.evaluation import uncertainty_context
    from rlxf_utils.report.wording import sentence

    t = pd.DataFrame({"method": ["PPO"], "group": ["RL"], "gain": [0.01], "gain_low": [0.0],
                      "gain_high": [0.02], "audit_gain": [0.0], "audit_gain_low": [-0.01],
                      "audit_gain_high": [0.01]})  # fmt: skip
    title = plot_methods(t, 0.05 / 4)._suptitle.get_text()
    assert "98.8% simultaneous cluster t intervals over countries" in title
    s = pd.DataFrame({"policy": ["sft", "ppo"], "ave_r": [0.5, 0.6],
                      **{f"reward_sd{e}": [0.04, 0.05] for e in ("", "_low", "_high")},
                      **{f"sd_gain{e}": [np.nan, 0.01] for e in ("", "_low", "_high")}}
                     ).set_index("policy")  # fmt: skip
    c = uncertainty_context(s, ["ppo"], "sft", "95%", None, "98.8%")
    text = sentence("eval", "uncertainty_sentence", c)
    assert "95% cluster-bootstrap intervals of each mean SD" in text
    assert "98.8% simultaneous cluster t intervals over countries of the paired change" in text
