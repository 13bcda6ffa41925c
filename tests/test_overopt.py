"""The over-optimisation curve (Gao et al., 2022): best-of-n's proxy and gold expectations, the
points' gains and KL, Gao's functional forms and the figure."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pandas as pd
import pytest

from rlxf_utils.evaluation.best_of_n import best_of_n_kl_bound, expected_max_of_n, order_weights
from rlxf_utils.evaluation.overopt import (
    best_of_n_expectations,
    distinct_share,
    fit_form,
    overoptimisation_fits,
    overoptimisation_points,
    plot_overoptimisation,
)


def test_gold_of_the_proxy_best_is_the_exact_subset_average():
    """The expected gold of the proxy-best of n equals the average over every n-subset."""
    rng = np.random.default_rng(0)
    proxy, gold = rng.random(7), rng.random(7)
    pool = pd.DataFrame({"prompt_id": 0, "reward": proxy, "audit_reward": gold})
    exp = best_of_n_expectations(pool, [1, 3])
    subsets = list(itertools.combinations(range(7), 3))
    brute_gold = np.mean([gold[max(s, key=lambda i: proxy[i])] for s in subsets])
    assert exp["audit_reward"].loc[0, 3] == pytest.approx(brute_gold)
    assert exp["reward"].loc[0, 3] == pytest.approx(expected_max_of_n(proxy, 3))
    assert exp["reward"].loc[0, 1] == pytest.approx(proxy.mean())
    assert order_weights(7, 3).sum() == pytest.approx(1.0)


def test_distinct_share_counts_repeated_candidates():
    pool = pd.DataFrame({"prompt_id": [0, 0, 1, 1], "response": ["a", "a", "b", "c"]})
    d = distinct_share(pool)
    assert d["prompts_all_distinct"] == 0.5 and d["distinct_fraction"] == 0.75


@pytest.mark.parametrize(
    "form, truth",
    [
        ("best_of_n", lambda d: d * (0.3 - 0.1 * d)),
        ("rl", lambda d: d * (0.2 - 0.05 * np.log(np.where(d > 0, d, 1.0)))),
    ],
)
def test_fit_recovers_gaos_coefficients(form, truth):
    d = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0])
    fit = fit_form(d, truth(d), form)
    alpha, beta = (0.3, 0.1) if form == "best_of_n" else (0.2, 0.05)
    assert fit["points"] == 5  # d = 0 carries no information in either form
    assert fit["alpha"] == pytest.approx(alpha) and fit["beta"] == pytest.approx(beta)
    assert fit["r2"] == pytest.approx(1.0)
    assert math.isnan(fit_form(d[:3], truth(d[:3]), form)["alpha"])  # two points: no fit


def _toy(seed: int = 0):
    """12 prompts in 4 countries; the proxy rewards length, the gold does not."""
    rng = np.random.default_rng(seed)
    prompts = np.arange(12)
    countries = pd.Series([f"C{i % 4}" for i in prompts], index=prompts)
    pool = pd.DataFrame(
        [{"prompt_id": p, "sample_id": j, "response": f"r{p}-{j}", "reward": rng.random(),
          "audit_reward": rng.random() * 0.1} for p in prompts for j in range(8)]
    )  # fmt: skip
    # sft drew two samples per prompt (proxy 0.4 and 0.6, mean 0.5); the snapshot only sample 0
    frame = lambda pol, sid, r, g: pd.DataFrame(  # noqa: E731
        {"policy": pol, "prompt_id": prompts, "sample_id": sid, "reward": r, "audit_reward": g}
    )
    samples = pd.concat([frame("sft", 0, 0.4, 0.4), frame("sft", 1, 0.6, 0.4),
                         frame("ppo", 0, 0.7, 0.3), frame("ppo", 1, 0.7, 0.3)])  # fmt: skip
    snaps = pd.DataFrame({"algo": "ppo", "step": 4, "prompt_id": prompts, "sample_id": 0,
                          "reward": 0.5, "audit_reward": 0.4, "logp_policy": -10.0,
                          "logp_ref": -11.0})  # fmt: skip
    summary = pd.DataFrame({"policy": ["sft", "ppo"], "kl": [0.0, 2.25], "kl_se": [0.0, 0.1]})
    return samples, snaps, pool, summary, countries


def test_points_are_paired_gains_against_sqrt_kl():
    samples, snaps, pool, summary, countries = _toy()
    pts = overoptimisation_points(samples, snaps, pool, summary, ["ppo"], "sft", [2, 4, 8], 8,
                                  countries, 200, 0.05, 0)  # fmt: skip
    bon = pts[pts["method"] == "best_of_n"].set_index("point")
    assert list(bon.index) == [1, 2, 4, 8]  # n = 1 always: the pool's own level
    assert bon.loc[1, "proxy"] == 0 and bon.loc[1, "gold"] == 0 and bon.loc[1, "kl"] == 0
    assert bon.loc[8, "kl"] == pytest.approx(best_of_n_kl_bound(8))
    assert bon["proxy"].is_monotonic_increasing  # the max of more candidates
    ppo = pts[pts["method"] == "ppo"].set_index("point")
    # the snapshot (sample 0 only) against sft's own sample 0: 0.5 - 0.4, not 0.5 - 0.5
    assert ppo.loc[4, "kl"] == pytest.approx(1.0) and ppo.loc[4, "proxy"] == pytest.approx(0.1)
    assert ppo.loc[8, "sqrt_kl"] == pytest.approx(1.5)
    assert ppo.loc[8, "proxy"] == pytest.approx(0.2) and ppo.loc[8, "gold"] == pytest.approx(-0.1)
    assert (pts["proxy_low"] <= pts["proxy"]).all() and (pts["proxy"] <= pts["proxy_high"]).all()
    fits = overoptimisation_fits(pts)
    # each method its own fit, none pooled
    assert set(zip(fits["method"], fits["family"], fits["reward"], strict=True)) == {
        ("best_of_n", "best_of_n", "proxy"),
        ("best_of_n", "best_of_n", "gold"),
        ("ppo", "rl", "proxy"),
        ("ppo", "rl", "gold"),
    }
    # best-of-n has 3 points with d > 0: fitted (no interval on beta: one degree of freedom);
    # PPO only 2: not fitted
    bon_fit = fits.set_index(["method", "reward"]).loc[("best_of_n", "proxy")]
    assert bon_fit["points"] == 3 and math.isfinite(bon_fit["beta"])
    assert math.isnan(bon_fit["beta_low"])
    assert math.isnan(fits.set_index(["method", "reward"]).loc[("ppo", "proxy"), "alpha"])
    fig = plot_overoptimisation(pts, fits, "sft")
    assert len(fig.axes) == 2
    # an algorithm that counts its own steps (ILHF from history) has its final point there
    own = overoptimisation_points(samples, snaps, pool, summary, ["ppo"], "sft", [2], {"ppo": 32},
                                  countries, 50, 0.05, 0)  # fmt: skip
    assert set(own.loc[own["method"] == "ppo", "point"]) == {4, 32}


def test_report_section_reads_every_verdict_from_an_interval(tmp_path):
    from rlxf_utils.artifacts import RunDir
    from rlxf_utils.report.overopt import curve, overopt_section
    from rlxf_utils.stats import ci_sign

    samples, snaps, pool, summary, countries = _toy()
    pts = overoptimisation_points(samples, snaps, pool, summary, ["ppo"], "sft", [2, 4, 8], 8,
                                  countries, 200, 0.05, 0)  # fmt: skip
    run = RunDir(tmp_path)
    run.write_json("eval/summary.json", {"alpha": 0.05, "start_policy": "sft",
                                         "overoptimisation": distinct_share(pool)})  # fmt: skip
    run.write_table("eval_overoptimisation", pts)
    run.write_table("eval_overoptimisation_fit", overoptimisation_fits(pts))
    variables, files = overopt_section(run)
    assert variables["level"] == "95%"
    # PPO: proxy +0.2 and gold -0.1 at every prompt: both intervals exclude zero
    bon, ppo = curve(pts, None, None)
    assert (bon["best_of_n"], bon["point"]) == (True, 8)
    assert (ppo["label"], ppo["final"], round(ppo["sqrt_kl"], 2)) == ("PPO", True, 1.5)
    assert ci_sign(ppo["proxy"]["low"], ppo["proxy"]["high"]) == 1
    assert ci_sign(ppo["gold"]["low"], ppo["gold"]["high"]) == -1
    assert "100%" in variables["distinct_sentence"]
    assert "| best-of-n" in files["eval_overoptimisation_fit.md"]


def test_every_method_gets_its_own_fit_none_pooled():
    """Gao's RL form is fitted to each trained method's own points (PPO's recover its alpha and
    beta exactly, whatever GRPO's, KTO's or ILHF's points do); beta's t interval needs four
    points."""
    d = np.array([0.5, 1.0, 1.5, 2.0])
    rows = [{"method": m, "point": i, "sqrt_kl": x, "proxy": y, "gold": y}
            for m, ys in (("ppo", d * (0.3 - 0.1 * np.log(d))), ("grpo", d * (0.5 - 0.0 * np.log(d))),
                          ("kto", [9.0, -9.0, 9.0, 0.0]), ("ilhf_history", [5.0, 5.0, -5.0, 1.0]))
            for i, (x, y) in enumerate(zip(d, ys, strict=True))]  # fmt: skip
    fits = overoptimisation_fits(pd.DataFrame(rows)).set_index(["method", "reward"])
    assert set(fits.index.get_level_values("method")) == {"ppo", "grpo", "kto", "ilhf_history"}
    ppo = fits.loc[("ppo", "proxy")]
    assert ppo["points"] == 4 and ppo["family"] == "rl"
    assert ppo["alpha"] == pytest.approx(0.3) and ppo["beta"] == pytest.approx(0.1)
    assert ppo["beta_low"] == pytest.approx(0.1) and ppo["beta_high"] == pytest.approx(0.1)
    assert fits.loc[("grpo", "proxy"), "beta"] == pytest.approx(0.0, abs=1e-12)
    assert fits.loc[("kto", "proxy"), "beta_low"] < fits.loc[("kto", "proxy"), "beta_high"]
