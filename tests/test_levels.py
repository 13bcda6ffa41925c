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


def test_the_hard_minus_easy_gain_is_the_contrasts_cluster_t_at_the_family_level():
    from rlxf_utils.evaluation.rlgf import easy_hard_table
    from rlxf_utils.stats.intervals import contrast_t

    rng = np.random.default_rng(5)
    n = COUNTRY.size
    rows = []
    for pid in range(n):
        for policy, shift in (("sft", 0.0), ("grpo", 0.02 + 0.03 * (pid % 2))):
            for j in range(2):
                rows.append({"policy": policy, "prompt_id": pid, "sample_id": j,
                             "country": COUNTRY[pid], "reward": 0.5 + shift + 0.02 * rng.standard_normal(),
                             "audit_reward": 0.5})  # fmt: skip
    samples = pd.DataFrame(rows)
    half = np.where(np.arange(n) % 2 == 1, "hard", "easy")
    diff = pd.DataFrame({"prompt_id": np.arange(n), "country": COUNTRY, "half": half,
                         "median_met_rate": 0.6})  # fmt: skip
    t = easy_hard_table(samples, diff, ["sft", "grpo"], "sft", 200, 0.05, 0)
    r = t[(t["policy"] == "grpo") & (t["half"] == "hard_minus_easy")].iloc[0]
    per = samples.groupby(["policy", "prompt_id"])["reward"].mean().unstack("policy")
    gain = (per["grpo"] - per["sft"]).to_numpy()
    want = contrast_t(
        gain, half == "hard", COUNTRY, 0.05 / 3
    )  # the family: easy, hard, hard - easy
    assert r["gain_ci_level"] == pytest.approx(1 - 0.05 / 3)
    assert (r["gain"], r["gain_low"], r["gain_high"]) == pytest.approx(
        (want["mean"], want["low"], want["high"]), abs=1e-12
    )
    assert r["gain"] == pytest.approx(gain[half == "hard"].mean() - gain[half == "easy"].mean())
    # the halves' Ave(R) difference: the same contrast's cluster t, at 1 - alpha (no family)
    own = contrast_t(per["grpo"].to_numpy(), half == "hard", COUNTRY, 0.05)
    assert (r["ave_r"], r["ave_r_low"], r["ave_r_high"]) == pytest.approx(
        (own["mean"], own["low"], own["high"]), abs=1e-12
    )


def test_the_contrasts_cluster_t_holds_its_family_level_at_seventeen_uneven_countries():
    """Coverage of a null hard - easy difference: 48 prompts in 17 countries of 1 to 5, halves
    tied to the country (its contexts' difficulty), a country effect and heavy-tailed noise. On
    these 3,000 draws the linearised cluster t covers 99.2% at the level of a family of 9
    (nominal 99.44%; 99.6-99.7% on two other seeds) and 94.4% at 95%, where the percentile
    cluster bootstrap the table used before (`stats.contrast_bootstrap`, the family's tail
    resamples) covers 98.1% and 92.3% of the same draws (measured once)."""
    from rlxf_utils.stats.intervals import contrast_t

    sizes = np.array([1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 5, 5, 3])
    g = np.repeat(np.arange(17), sizes)
    rng = np.random.default_rng(0)
    draws, family, plain = 3000, 0, 0
    for _ in range(draws):
        u, pc = rng.normal(0, 1, 17)[g], rng.normal(0, 1, 17)[g]
        hard = (pc + rng.normal(0, 0.7, 48)) > np.median(pc)
        x = 0.5 * u + rng.standard_t(4, 48)
        r = contrast_t(x, hard, g, 0.05 / 9)
        family += r["low"] <= 0 <= r["high"]
        r = contrast_t(x, hard, g, 0.05)
        plain += r["low"] <= 0 <= r["high"]
    # SE of a coverage near 99.4% over 3,000 draws: 0.0014; near 95%: 0.004
    assert family / draws >= 0.99 and plain / draws >= 0.935


def test_the_easy_hard_sentence_states_the_gains_family_level():
    from rlxf_utils.report.rlgf import easy_hard_context
    from rlxf_utils.report.wording import sentence

    t = pd.DataFrame([
        {"policy": p, "label": p.upper(), "half": h, "gain": np.nan if p == "sft" else 0.01,
         "gain_low": np.nan if p == "sft" else -0.01, "gain_high": np.nan if p == "sft" else 0.03,
         "gain_verdict": "" if p == "sft" else "not distinguishable",
         "gain_ci_level": np.nan if p == "sft" else 1 - 0.05 / 6, "median_met_rate": 0.6}
        for p in ("sft", "ppo") for h in ("easy", "hard", "hard_minus_easy")])  # fmt: skip
    text = sentence("rlgf", "easy_hard_sentence", easy_hard_context(t, "sft", 0.05))
    assert "99.2% simultaneous cluster t intervals over countries" in text


def test_the_cross_entropy_difference_holds_its_level_at_seventeen_uneven_countries():
    """The ILHF cross-entropy difference, a difference of two ratios of sums over held-out MET
    rows (2 to 30 rows in each of 17 countries), policies exchangeable so the true difference
    is zero: its cluster t on the delta-method linearisation covers 94.8% at 95% and 99.8% at a
    family's 99.5% on these 1,000 draws (99.3% on another seed), where the percentile cluster
    bootstrap of the ratio used before covers 89.7% and 97.0% of the first 300 (measured once,
    with the family's tail resamples)."""
    from rlxf_utils.evaluation.ilhf import xent_difference

    sizes = np.array([2, 3, 3, 4, 5, 6, 6, 8, 8, 10, 12, 12, 15, 18, 20, 25, 30])
    g = np.repeat(np.arange(17), sizes).astype(str)
    n = g.size
    rng = np.random.default_rng(0)
    plain = family = 0
    draws = 1000
    for _ in range(draws):
        tok = 5 + rng.poisson(25, n).astype(float)
        c = rng.normal(0, 0.5, 17)[np.repeat(np.arange(17), sizes)]
        per_token = [3 + c + rng.normal(0, 0.3, 17)[np.repeat(np.arange(17), sizes)]
                     + rng.normal(0, 0.5, n) for _ in range(2)]  # fmt: skip
        rows = pd.DataFrame({"policy": np.repeat(["a", "b"], n), "row": np.tile(np.arange(n), 2),
                             "country": np.tile(g, 2), "y": 1,
                             "nll": np.concatenate([p * tok for p in per_token]),
                             "n_tokens": np.tile(tok, 2)})  # fmt: skip
        d = xent_difference(rows, "a", "b", 0, 0.05, 0)
        plain += d["low"] <= 0 <= d["high"]
        d = xent_difference(rows, "a", "b", 0, 0.005, 0)
        family += d["low"] <= 0 <= d["high"]
    # SE of a coverage near 95% over 1,000 draws: 0.007; near 99.5%: 0.0022
    assert plain / draws >= 0.935 and family / draws >= 0.985
