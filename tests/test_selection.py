"""Lee's (2009) trimming bounds within prompts (`stats.selection`): a hand-worked example."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from rlxf_utils.stats.selection import lee_bounds, lee_prompt_bounds


def _frame() -> pd.DataFrame:
    """Two policies, four responses each on four prompts; `None`: a response cut at the cap.

    prompt 0: A finished 0.2, 0.4, 0.9 (3 of 4), B 0.5 (1 of 4): A is trimmed to one response,
              its lowest (0.2) for the lower bound, its highest (0.9) for the upper: -0.3, +0.4;
    prompt 1: A 0.6 (1 of 4), B 0.1, 0.3 (2 of 4): B is trimmed to one, its highest (0.3) for
              the lower bound of A - B, its lowest (0.1) for the upper: +0.3, +0.5;
    prompt 2: A finished none: no bound there;
    prompt 3: A 0.5, 0.7, B 0.2, 0.4 (2 of 4 each): nothing trimmed, +0.3 both.
    Over prompts 0, 1, 3: lower (-0.3 + 0.3 + 0.3) / 3 = 0.1, upper (0.4 + 0.5 + 0.3) / 3 = 0.4;
    3 of the 11 finished responses there are trimmed; the untrimmed gain (0 + 0.4 + 0.3) / 3."""
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


def test_each_prompt_trims_the_side_that_finished_more() -> None:
    assert lee_prompt_bounds([0.2, 0.4, 0.9], 4, [0.5], 4) == pytest.approx((-0.3, 0.4, 2))
    assert lee_prompt_bounds([0.6], 4, [0.1, 0.3], 4) == pytest.approx((0.3, 0.5, 1))
    assert lee_prompt_bounds([], 4, [0.8], 4) is None
    assert lee_prompt_bounds([0.5, 0.7], 4, [0.2, 0.4], 4) == pytest.approx((0.3, 0.3, 0))


def test_the_bounds_of_the_hand_worked_example() -> None:
    res = lee_bounds(_frame(), "a", "b", "reward", cluster_col="country", alpha=0.05)
    assert res["lower"] == pytest.approx(0.1)
    assert res["upper"] == pytest.approx(0.4)
    assert res["naive"] == pytest.approx(0.7 / 3)
    assert res["prompts"] == 3 and res["n_clusters"] == 2
    assert res["trimmed"] == pytest.approx(3 / 11)
    assert res["finished"] == pytest.approx(6 / 16) == res["base_finished"]
    # the interval covers the bounds, which hold the untrimmed gain here
    assert res["low"] <= res["lower"] <= res["naive"] <= res["upper"] <= res["high"]


def test_no_prompt_with_both_finished_gives_no_bounds() -> None:
    df = _frame()
    res = lee_bounds(df[df["prompt_id"] == 2], "a", "b", "reward")
    assert math.isnan(res["lower"]) and math.isnan(res["upper"]) and res["prompts"] == 0
