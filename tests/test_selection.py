"""Lee's (2009) trimming bounds within countries (`stats.selection`): hand-worked examples and a
simulated coverage test at the default evaluation's design."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from rlxf_utils.stats.selection import lee_bounds, lee_cell_bounds


def _frame() -> pd.DataFrame:
    """Two policies, four responses each on four prompts; `None`: a response cut at the cap.
    Countries: X holds prompts 0 and 2, Y prompts 1 and 3.

    prompt 0: A finished 0.2, 0.4, 0.9 (3 of 4), B 0.5 (1 of 4);
    prompt 1: A 0.6 (1 of 4), B 0.1, 0.3 (2 of 4);
    prompt 2: A finished none, B 0.8 (1 of 4);
    prompt 3: A 0.5, 0.7, B 0.2, 0.4 (2 of 4 each).
    Every response weighs 1/4 of its prompt. Country X: always-finishing mass M = min(3/4, 1/4)
    + min(0, 1/4) = 1/4; A's pool (0.2, 0.4, 0.9) trimmed to mass 1/4 is 0.2 at the lowest, 0.9
    at the highest; B's pool (0.5, 0.8: prompt 2, where A finished nothing, enters) 0.5 and 0.8:
    bounds 0.2 - 0.8 = -0.6 and 0.9 - 0.5 = +0.4, untrimmed 0.5 - 0.65 = -0.15. Country Y:
    M = 1/4 + 2/4 = 3/4; A's pool (0.5, 0.6, 0.7) has mass 3/4, untrimmed, mean 0.6; B's
    (0.1, 0.2, 0.3, 0.4) mass 1 is trimmed to 3/4: 0.2 at the lowest, 0.3 at the highest: bounds
    0.3 and 0.4, untrimmed 0.35. Weighted by M: lower (-0.6 / 4 + 0.3 x 3/4) = 0.075, upper 0.4,
    untrimmed 0.225; trimming left out 4 of the 12 finished responses."""
    values = {
        ("a", 0): [0.2, 0.4, 0.9, None], ("b", 0): [0.5, None, None, None],
        ("a", 1): [0.6, None, None, None], ("b", 1): [0.1, 0.3, None, None],
        ("a", 2): [None] * 4, ("b", 2): [0.8, None, None, None],
        ("a", 3): [0.5, 0.7, None, None], ("b", 3): [0.2, 0.4, None, None],
    }  # fmt: skip
    rows = [
        {"policy": pol, "prompt_id": p, "sample_id": j, "finished": v is not None,
         "reward": 0.0 if v is None else v, "country": "XY"[p % 2]}
        for (pol, p), vs in values.items()
        for j, v in enumerate(vs)
    ]  # fmt: skip
    return pd.DataFrame(rows)


def _cell(a: list[float], n_a: int, b: list[float], n_b: int, **kw) -> dict | None:
    """`lee_cell_bounds` on one prompt: the finished values and the responses written of each."""
    vals = [*a, *[0.0] * (n_a - len(a)), *b, *[0.0] * (n_b - len(b))]
    fin = [True] * len(a) + [False] * (n_a - len(a)) + [True] * len(b) + [False] * (n_b - len(b))
    return lee_cell_bounds([True] * n_a + [False] * n_b, [0] * (n_a + n_b), fin, vals, **kw)


def test_a_cell_of_one_prompt_trims_the_side_that_finished_more() -> None:
    """The plug-in bounds on single prompts: A 3 of 4 against B 1 of 4 keeps one of A's (0.2 for
    the lower bound, 0.9 for the upper); A 1 of 4 against B 2 of 4 keeps one of B's (its highest,
    0.3, for the lower bound of A - B); nobody finished on one side: no bounds."""
    for a, b, want in (([0.2, 0.4, 0.9], [0.5], (-0.3, 0.4)), ([0.6], [0.1, 0.3], (0.3, 0.5)),
                       ([0.5, 0.7], [0.2, 0.4], (0.3, 0.3))):  # fmt: skip
        res = _cell(a, 4, b, 4, bias_correction=False)
        assert (res["lower"], res["upper"]) == pytest.approx(want)
    assert _cell([], 4, [0.8], 4) is None


def test_the_jackknife_of_a_small_cell_by_hand() -> None:
    """A finished 0 and 1 (2 of 2), B 0.4 and 0.6 (2 of 4): M = 1/2, plug-in bounds 0 - 0.5 and
    1 - 0.5. Leaving out A's 0 gives bounds (0.5, 0.5), its 1 (-0.5, -0.5): mean (0, 0), so A's
    stratum adds (2 - 1) x (0 - -0.5) = 0.5 to the lower bound's bias; leaving out B's 0.4 gives
    (-0.6, 0.4), its 0.6 (-0.4, 0.6), either unfinished (-0.25, 0.25) (A trimmed to mass 2/3 of
    its 1: 0 whole and a third of 1): mean (-0.375, 0.375), adding (4 - 1) x 0.125. Bias 0.875
    each way: corrected bounds -1.375 and +1.375 (two responses say little about A's tails)."""
    res = _cell([0.0, 1.0], 2, [0.4, 0.6], 4)
    assert (res["lower_raw"], res["upper_raw"]) == pytest.approx((-0.5, 0.5))
    assert (res["lower"], res["upper"]) == pytest.approx((-1.375, 1.375))
    assert res["mass"] == pytest.approx(0.5) and res["naive"] == pytest.approx(0.0)


def test_the_bounds_of_the_hand_worked_example() -> None:
    df = _frame()
    res = lee_bounds(df, "a", "b", "reward", cluster_col="country", bias_correction=False)
    assert res["lower"] == pytest.approx(0.075)
    assert res["upper"] == pytest.approx(0.4)
    assert res["naive"] == pytest.approx(0.225)
    assert res["prompts"] == 4 and res["n_clusters"] == 2  # prompt 2 is not dropped
    assert res["trimmed"] == pytest.approx(4 / 12)
    assert res["finished"] == pytest.approx(6 / 16) == res["base_finished"]
    # corrected: X keeps its bounds (leaving out B's 0.5 leaves no always-finishing mass), Y's
    # jackknife moves both inward, as far as its untrimmed gain 0.35 and no further
    cor = lee_bounds(df, "a", "b", "reward", cluster_col="country")
    assert cor["lower"] == pytest.approx(-0.6 / 4 + 0.35 * 3 / 4)
    assert cor["upper"] == pytest.approx(0.4 / 4 + 0.35 * 3 / 4)
    assert cor["low"] <= cor["lower"] <= cor["naive"] <= cor["upper"] <= cor["high"]


def test_without_clusters_every_prompt_is_a_cell() -> None:
    """Prompt 0: M = 1/4, bounds (-0.3, 0.4); prompt 1: 1/4, (0.3, 0.5); prompt 2 has no
    always-finishing response; prompt 3: 1/2, (0.3, 0.3): weighted by M 0.15 and 0.375."""
    res = lee_bounds(_frame(), "a", "b", "reward", bias_correction=False)
    assert (res["lower"], res["upper"]) == pytest.approx((0.15, 0.375))
    assert res["prompts"] == 3 == res["n_clusters"]


def test_no_cell_with_an_always_finishing_response_gives_no_bounds() -> None:
    df = _frame()
    res = lee_bounds(df[df["prompt_id"] == 2], "a", "b", "reward", cluster_col="country")
    assert math.isnan(res["lower"]) and math.isnan(res["upper"]) and res["prompts"] == 0


# -- simulated coverage at the default's design -------------------------------------------------
#: The default evaluation's shape (as in tests/test_power.py): 48 prompts in 17 countries.
SIZES = np.array([8, 6, 5, 4, 4, 3, 3, 3, 2, 2, 2, 1, 1, 1, 1, 1, 1])
#: Half the width of a prompt's values (uniform around its mean).
HALF = 0.4


def _simulated(rng: np.random.Generator, q_policy: float, q_start: float) -> pd.DataFrame:
    """The default's design: 4 responses per prompt per policy; a prompt's values uniform on its
    mean +- HALF, the mean 0.5 + a country's and a prompt's effect (each uniform on +-0.05), so
    in [0, 1] like P(MET); both policies draw from the same distribution (no effect) and finish
    each response with their share, whatever its value."""
    g = np.repeat(np.arange(SIZES.size), SIZES)
    mu = 0.5 + rng.uniform(-0.05, 0.05, SIZES.size)[g] + rng.uniform(-0.05, 0.05, g.size)
    prompt = np.tile(np.repeat(np.arange(g.size), 4), 2)
    is_policy = np.arange(prompt.size) < prompt.size // 2
    return pd.DataFrame({
        "policy": np.where(is_policy, "ppo", "sft"), "prompt_id": prompt, "country": g[prompt],
        "reward": mu[prompt] + rng.uniform(-HALF, HALF, prompt.size),
        "finished": rng.random(prompt.size) < np.where(is_policy, q_policy, q_start),
    })  # fmt: skip


@pytest.mark.parametrize(
    ("q_policy", "q_start", "outward"),
    [(1.0, 0.5, 0.1), (0.98, 0.9, 0.5)],
    ids=["finishes-all-vs-half", "near-the-real-shares"],
)
def test_the_bounds_cover_the_true_identified_set_at_the_defaults_design(
    q_policy: float, q_start: float, outward: float
) -> None:
    """300 simulated evaluations (seeded): 48 prompts in 17 countries of 1 to 8 prompts, 4
    responses per prompt per policy, no effect. On every prompt the true identified set is
    +- HALF x (1 - q_start / q_policy) (trimming a uniform to its lowest or highest share p
    moves its mean by HALF x (1 - p)): +-0.2 for shares 1.0 against 0.5, +-0.0327 for 0.98
    against 0.9, whatever the prompt's and the country's effects.

    Asserted: the interval [low, high] at a nominal 95% covers the true set in at least 90% of
    the evaluations (the Monte-Carlo standard error of a 95% coverage over 300 is 1.3 points, so
    0.90 is four below), and the mean point bounds are narrower than the true ones by at most 10%
    of the true half-width and wider by at most `outward` of it (estimating each prompt's
    always-finishing share from 4 responses trims more than the true share when the shares are
    close).

    Measured (this seed, 300 evaluations a scenario, about 2.5 s each on one core; coverage,
    mean lower / upper bound against the truth):
    - within-prompt trimming (before): 1.0 vs 0.5: 0.490, -0.1481 / +0.1501 against +-0.2 (25%
      narrow: fails both asserts); 0.98 vs 0.9: 0.953, -0.0335 / +0.0351 (passes);
    - country cells with the jackknife (now): 1.0 vs 0.5: 0.973, -0.1971 / +0.2011; 0.98 vs 0.9:
      0.987, -0.0409 / +0.0434 (25% and 33% wide: the shares estimated per prompt)."""
    rng = np.random.default_rng(20240578)
    true = HALF * (1 - q_start / q_policy)
    reps, covered, lower, upper = 300, 0, [], []
    for _ in range(reps):
        res = lee_bounds(_simulated(rng, q_policy, q_start), "ppo", "sft", "reward",
                         cluster_col="country", alpha=0.05)  # fmt: skip
        lower.append(res["lower"])
        upper.append(res["upper"])
        covered += res["low"] <= -true and res["high"] >= true
    mean_lower, mean_upper = float(np.mean(lower)), float(np.mean(upper))
    summary = f"coverage {covered / reps:.3f}, bounds {mean_lower:+.4f} / {mean_upper:+.4f} vs +-{true:.4f}"  # fmt: skip
    assert covered / reps >= 0.90, summary
    assert -true * (1 + outward) <= mean_lower <= -true * 0.9, summary
    assert true * 0.9 <= mean_upper <= true * (1 + outward), summary
