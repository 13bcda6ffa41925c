"""The attainable gain over the start policy (issue 59, item 4): the held-out contexts' own MET
descriptions minus the start policy's responses, paired on the same prompts under each judge, at
the level of the gains it stands beside; and each gain as a share of it in the methods table."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from rlxf_utils.evaluation.history import attainable_gain
from rlxf_utils.evaluation.offline import methods_table

#: Six countries of two prompts each with MET history, and a seventh whose prompts have none.
COUNTRIES = [c for c in "ABCDEF" for _ in range(2)]


def _samples() -> pd.DataFrame:
    """Two samples per prompt for `sft` and `ppo` on 14 prompts, one or two history MET
    descriptions on the first 12 only (prompts 12 and 13, country G, have no MET history)."""
    rng = np.random.default_rng(7)
    rows = []
    for pid in range(14):
        country = COUNTRIES[pid] if pid < 12 else "G"
        for policy, k, shift in (("sft", 2, 0.0), ("ppo", 2, 0.01), ("history_met", 1 + pid % 2, 0.05)):  # fmt: skip
            if policy == "history_met" and pid >= 12:
                continue
            for j in range(k):
                r = 0.5 + shift + 0.02 * rng.standard_normal()
                rows.append({"policy": policy, "prompt_id": pid, "sample_id": j, "country": country,
                             "reward": r, "audit_reward": 0.4 + 0.5 * (r - 0.5)})  # fmt: skip
    return pd.DataFrame(rows)


def _by_hand(s: pd.DataFrame, col: str, alpha: float) -> tuple[float, float, float]:
    """Per prompt, the MET descriptions' mean minus sft's mean on the 12 prompts with both; with
    six equal countries the cluster t interval is the t interval on the six country means of the
    differences, on 5 degrees of freedom."""
    means = s.groupby(["policy", "prompt_id"])[col].mean().unstack("policy")
    d = (means["history_met"] - means["sft"]).dropna()
    assert len(d) == 12
    per_country = d.groupby(np.array(COUNTRIES)).mean().to_numpy()
    half = stats.t.ppf(1 - alpha / 2, 5) * per_country.std(ddof=1) / math.sqrt(6)
    return float(d.mean()), float(d.mean() - half), float(d.mean() + half)


def test_attainable_gain_is_history_met_minus_start_on_the_same_prompts_at_the_family_level():
    s = _samples()
    t = attainable_gain(s, "sft", alpha=0.05, family_size=4).set_index("measure")
    assert list(t.index) == ["reward", "audit_reward"]
    for col in ("reward", "audit_reward"):
        diff, low, high = _by_hand(s, col, 0.05 / 4)
        row = t.loc[col]
        assert (row["n"], row["n_clusters"], row["vs"]) == (12, 6, "sft")
        assert row["diff"] == pytest.approx(diff, abs=1e-12)
        assert (row["ci_low"], row["ci_high"]) == pytest.approx((low, high), abs=1e-12)
        assert row["ci_level"] == pytest.approx(1 - 0.05 / 4)
    assert t.loc["reward", "diff"] == pytest.approx(0.05, abs=0.02)
    # no MET history, or no start policy: no attainable gain
    assert attainable_gain(s[s["policy"] != "history_met"], "sft", 0.05).empty
    assert attainable_gain(s, "base", 0.05).empty


def test_each_gain_stands_beside_the_attainable_one_as_a_share_of_it():
    summary = pd.DataFrame({
        "policy": ["sft", "ppo", "best_of_n"], "gain": [0.0, 0.01, 0.02],
        "gain_low": [0.0, -0.01, 0.01], "gain_high": [0.0, 0.03, 0.03],
        "audit_gain": [0.0, 0.004, -0.002], "audit_gain_low": [0.0, -0.01, -0.01],
        "audit_gain_high": [0.0, 0.02, 0.006], "kl": [0.0, 1.0, 0.84], "finished": [0.9] * 3,
        "kl_kind": ["sampled", "sampled", "upper bound"],
    })  # fmt: skip
    attainable = pd.DataFrame({
        "judge": ["reward model", "audit"], "measure": ["reward", "audit_reward"],
        "vs": ["sft", "sft"], "diff": [0.04, 0.01], "ci_low": [0.02, -0.005],
        "ci_high": [0.06, 0.025],
    })  # fmt: skip
    t = methods_table(summary, pd.DataFrame(), ["ppo"], 4, attainable).set_index("policy")
    assert list(t.index) == ["ppo", "best_of_n", "attainable"]
    a = t.loc["attainable"]
    assert a["method"] == "attainable (history MET − SFT)" and a["group"] == "attainable"
    assert (a["gain"], a["gain_low"], a["gain_high"]) == (0.04, 0.02, 0.06)
    assert (a["audit_gain"], a["audit_gain_low"], a["audit_gain_high"]) == (0.01, -0.005, 0.025)
    assert t.loc["ppo", "share"] == pytest.approx(0.25)
    assert t.loc["best_of_n", "share"] == pytest.approx(0.5)
    assert a["share"] == pytest.approx(1.0)
    # the audit's attainable interval holds zero: no share is given under the audit
    assert t["audit_share"].isna().all()
    # a run without history references keeps the table as it was
    assert "share" not in methods_table(summary, pd.DataFrame(), ["ppo"], 4).columns


def test_the_methods_table_shows_the_attainable_row_and_the_shares():
    from rlxf_utils.report.wording import table

    summary = pd.DataFrame({
        "policy": ["sft", "ppo"], "gain": [0.0, 0.01], "gain_low": [0.0, 0.005],
        "gain_high": [0.0, 0.015], "audit_gain": [0.0, 0.0], "audit_gain_low": [0.0, -0.01],
        "audit_gain_high": [0.0, 0.01], "kl": [0.0, 1.0], "finished": [0.9] * 2,
        "kl_kind": ["sampled"] * 2,
    })  # fmt: skip
    attainable = pd.DataFrame({"measure": ["reward"], "vs": ["sft"], "diff": [0.04],
                               "ci_low": [0.02], "ci_high": [0.06]})  # fmt: skip
    md = table("eval_methods", methods_table(summary, pd.DataFrame(), ["ppo"], 4, attainable),
               start="sft")  # fmt: skip
    line = next(x for x in md.splitlines() if "attainable (history MET" in x)
    assert r"+0.040 \[+0.020, +0.060\]" in line and "100%" in line and "nan" not in line.lower()
    assert "25%" in next(x for x in md.splitlines() if x.startswith("| PPO"))
    assert "share of attainable: reward model" in md
