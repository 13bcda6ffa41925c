"""Tests of the risk room: each measure on hand-made data with a known answer, and the stage."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from rlxf_utils import risk
from rlxf_utils.artifacts import RunDir
from rlxf_utils.config import CompareEncoder, RewardConfig, RiskConfig, StudyConfig
from rlxf_utils.data.splits import make_splits
from rlxf_utils.report import risk as prose
from rlxf_utils.report.wording import ABOVE, BELOW, UNCLEAR, phrase, sentence
from rlxf_utils.risk import stage

# ---------------------------------------------------------------------------------------------
# country swap
# ---------------------------------------------------------------------------------------------

COUNTRY_SCORE = {"ALPHA": 0.2, "BETA": 0.5, "GAMMA": 0.9}


def _ctx(countries: list[str]) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "country": countries,
            "arrangement_type": "SBA",
            "econ_descriptor": "1.1. Revenue measures",
        }
    )


def test_swap_reward_reading_only_the_country_is_fully_sensitive():
    calls = []

    def score(contexts, texts):
        calls.append(len(texts))
        return np.array([COUNTRY_SCORE[c["country"]] for c in contexts])

    swaps = risk.country_swap(
        score, _ctx(["ALPHA", "BETA"]), ["adopt a budget", "publish audits"], list(COUNTRY_SCORE)
    )
    assert calls == [6]  # 2 originals + 2 x 2 swaps, in one call
    assert len(swaps) == 4 and set(swaps["swap_country"]) == {"ALPHA", "BETA", "GAMMA"}
    # own country never swapped in
    assert (swaps["country"] != swaps["swap_country"]).all()
    expected = swaps["swap_country"].map(COUNTRY_SCORE) - swaps["country"].map(COUNTRY_SCORE)
    np.testing.assert_allclose(swaps["delta"], expected)
    overall, per = risk.swap_summary(swaps, {"ALPHA": 0.1, "BETA": 0.5, "GAMMA": 0.8})
    # |+0.3| + |+0.7| (ALPHA text) and |-0.3| + |+0.4| (BETA text), over 4 pairs
    assert overall.loc[0, "mean_abs_delta"] == pytest.approx((0.3 + 0.7 + 0.3 + 0.4) / 4)
    assert overall.loc[0, "max_abs_delta"] == pytest.approx(0.7)
    by = per.set_index("country")
    assert list(per["country"]) == ["GAMMA", "BETA", "ALPHA"]  # most favoured first
    assert by.loc["GAMMA", "mean_delta"] == pytest.approx((0.7 + 0.4) / 2)
    assert by.loc["ALPHA", "mean_delta"] == pytest.approx(-0.3)
    assert by.loc["GAMMA", "hist_met_rate"] == pytest.approx(0.8)


def test_swap_constant_or_text_only_reward_shows_no_sensitivity():
    texts = ["adopt a budget law", "publish", "audit the central bank accounts"]
    for score in (
        lambda c, t: np.full(len(t), 0.6),
        lambda c, t: np.array([len(x) / 100 for x in t]),
    ):
        swaps = risk.country_swap(score, _ctx(["ALPHA", "BETA", "GAMMA"]), texts, ["ALPHA", "BETA"])
        assert len(swaps) == 4  # ALPHA and BETA texts get one swap each, GAMMA's two
        assert (swaps["delta"] == 0).all()
        overall, _ = risk.swap_summary(swaps)
        assert overall.loc[0, "mean_abs_delta"] == 0.0


def test_swap_rejects_misaligned_inputs():
    with pytest.raises(risk.RiskError, match="2 contexts but 1 texts"):
        risk.country_swap(lambda c, t: np.zeros(len(t)), _ctx(["ALPHA", "BETA"]), ["x"], ["GAMMA"])
    with pytest.raises(risk.RiskError, match="shape"):
        risk.country_swap(lambda c, t: np.zeros(1), _ctx(["ALPHA"]), ["x"], ["BETA", "GAMMA"])


def test_swap_countries_are_seeded_distinct_and_capped():
    pool = [f"C{i:02d}" for i in range(30)] * 2
    a = risk.choose_swap_countries(pool, 5, seed=7)
    assert a == risk.choose_swap_countries(reversed(pool), 5, seed=7)
    assert len(set(a)) == 5 and a == sorted(a)
    assert a != risk.choose_swap_countries(pool, 5, seed=8)
    assert risk.choose_swap_countries(["X", "Y"], 12, seed=0) == ["X", "Y"]
    with pytest.raises(risk.RiskError, match="at least 2 countries"):
        risk.choose_swap_countries(["X"], 3, seed=0)


# ---------------------------------------------------------------------------------------------
# reward hacking
# ---------------------------------------------------------------------------------------------


def test_length_correlation_on_constructed_data():
    n = np.arange(1, 51)
    up = pd.DataFrame({"policy": "ppo", "n_words": n, "reward": 0.01 * n})
    down = pd.DataFrame({"policy": "grpo", "n_words": n, "reward": 1.0 / n})  # monotone, not linear
    corr, bins = risk.length_reward(pd.concat([up, down]), "n_words", "reward", bins=5)
    c = corr.set_index("policy")
    assert c.loc["ppo", "spearman"] == pytest.approx(1.0)
    assert c.loc["ppo", "pearson"] == pytest.approx(1.0)
    assert c.loc["grpo", "spearman"] == pytest.approx(-1.0)
    assert -1.0 < c.loc["grpo", "pearson"] < -0.5  # linear correlation misses part of a curve
    assert "all generated" in c.index and c.loc["all generated", "n"] == 100
    b = bins[bins["policy"] == "ppo"]
    assert len(b) == 5 and b["n"].sum() == 50 and (b["n"] == 10).all()
    assert b["mean_reward"].is_monotonic_increasing
    assert b["mean_length"].tolist() == pytest.approx([5.5, 15.5, 25.5, 35.5, 45.5])


def test_length_correlation_undefined_for_constant_length():
    df = pd.DataFrame({"policy": "ppo", "n_tokens": 24, "reward": np.linspace(0, 1, 8)})
    corr, bins = risk.length_reward(df, "n_tokens", "reward", bins=5)
    assert math.isnan(corr.loc[0, "spearman"]) and math.isnan(corr.loc[0, "pearson"])
    assert len(bins) == 1 and bins.loc[0, "n"] == 8


def test_checkpoint_gains_from_the_shared_base_row():
    frontier = pd.DataFrame(
        {
            "algo": ["base", "ppo", "ppo", "grpo"],
            "step": [0, 2, 4, 4],
            "reward": [0.50, 0.60, 0.70, 0.55],
            "audit_reward": [0.40, 0.41, 0.38, 0.45],
            "kl": [0.0, 1.0, 2.0, 0.5],
        }
    )
    g = risk.checkpoint_gains(frontier)
    assert "base" not in set(g["algo"])
    ppo = g[g["algo"] == "ppo"].set_index("step")
    assert list(ppo.index) == [0, 2, 4] and set(ppo["baseline"]) == {"base step 0"}
    assert ppo.loc[4, "reward_gain"] == pytest.approx(0.20)
    assert ppo.loc[4, "audit_gain"] == pytest.approx(-0.02)
    assert ppo.loc[4, "gap"] == pytest.approx(0.22)
    assert g[g["algo"] == "grpo"].iloc[-1]["audit_gain"] == pytest.approx(0.05)
    own = risk.checkpoint_gains(frontier[frontier["algo"] == "ppo"])
    assert set(own["baseline"]) == {"ppo step 2"} and own["reward_gain"].iloc[-1] == pytest.approx(
        0.10
    )


def test_rising_ngrams_and_policy_kinds():
    samples = pd.DataFrame(
        {
            "policy": ["base"] * 4 + ["ppo"] * 4 + ["history_met"] * 2 + ["random_policy"],
            "response": ["reform the tax code"] * 4
            + ["Strengthen GOVERNANCE."] * 3
            + ["reform the tax code"]
            + ["x"] * 3,
        }
    )
    assert risk.generated_policies(samples["policy"]) == ["base", "ppo"]
    assert risk.tuned_policies(samples["policy"]) == ["ppo"]
    ng = risk.rising_ngrams(samples, top=3)
    assert ng.loc[0, "ngram"] == "strengthen governance"  # punctuation and case ignored
    assert ng.loc[0, "share_base"] == 0.0 and ng.loc[0, "share_policy"] == pytest.approx(0.75)
    assert ng.loc[0, "responses_with"] == 3
    assert ng["ngram"].tolist() == ["strengthen governance"]  # rises > 0 only
    with pytest.raises(risk.RiskError, match="no 'base' policy"):
        risk.rising_ngrams(samples[samples["policy"] != "base"])


# ---------------------------------------------------------------------------------------------
# diversity
# ---------------------------------------------------------------------------------------------


def test_area_entropy_kl_coverage_on_known_distributions():
    areas = ["fiscal", "monetary", "trade", "labour"]
    reference = areas * 5  # uniform over 4 areas
    samples = pd.DataFrame(
        {
            "policy": ["same"] * 8 + ["collapsed"] * 8,
            "top_area": areas * 2 + ["fiscal"] * 8,
            "econ_area": ["fiscal"] * 16,
        }
    )
    div, shares = risk.area_table(samples, reference, "history")
    d = div.set_index("policy")
    assert d.loc["history", "entropy"] == pytest.approx(math.log(4))
    assert d.loc["same", "entropy"] == pytest.approx(math.log(4))
    assert d.loc["same", "kl_to_reference"] == pytest.approx(0.0, abs=1e-12)
    assert d.loc["collapsed", "entropy"] == pytest.approx(0.0)
    assert d.loc["collapsed", "n_areas"] == 1 and d.loc["collapsed", "coverage"] == 0.25
    # add-half smoothing: collapsed has counts (8, 0, 0, 0) + 0.5 over n + 2; reference (5,5,5,5) + 0.5
    p = np.array([8.5, 0.5, 0.5, 0.5]) / 10
    q = np.full(4, 0.25)
    assert d.loc["collapsed", "kl_to_reference"] == pytest.approx(float((p * np.log(p / q)).sum()))
    assert d.loc["collapsed", "on_topic"] == 1.0 and d.loc["same", "on_topic"] == 0.25
    s = shares.set_index("area")
    assert s["collapsed"].to_dict() == {"fiscal": 1.0, "labour": 0.0, "monetary": 0.0, "trade": 0.0}
    assert s.sum().to_numpy() == pytest.approx(np.ones(3))


def test_within_prompt_diversity_uses_prompts_with_several_samples():
    samples = pd.DataFrame(
        {
            "policy": ["a", "a", "a", "a", "b", "b", "b"],
            "prompt_id": [0, 0, 1, 1, 0, 0, 1],
            "response": [
                "adopt the budget",
                "adopt the budget",  # identical: 2 unique of 4 bigrams
                "publish audit reports",
                "raise tax revenue",  # all distinct
                "one two three",
                "four five six",
                "only one sample here",  # prompt with one sample: skipped
            ],
        }
    )
    out = risk.within_prompt_diversity(samples).set_index("policy")
    assert out.loc["a", "within_prompt_distinct_2"] == pytest.approx((0.5 + 1.0) / 2)
    assert out.loc["a", "n_prompts_multi"] == 2
    assert out.loc["b", "within_prompt_distinct_2"] == pytest.approx(1.0)
    assert out.loc["b", "n_prompts_multi"] == 1


# ---------------------------------------------------------------------------------------------
# drift
# ---------------------------------------------------------------------------------------------


def test_drift_per_year_on_synthetic_predictions():
    pred = pd.DataFrame(
        {
            "test_year": pd.array([2011] * 4 + [2012] * 3 + [None], dtype="Int64"),
            "y": [1, 1, 0, 0, 1, 1, 1, 0],
            "p": [0.9, 0.8, 0.2, 0.4, 0.4, 0.6, 0.8, 0.5],
            "p_majority": 0.6,
        }
    )
    d = risk.drift_by_year(pred, "p").set_index("test_year")
    assert list(d.index) == [2011, 2012]  # the row without a year is dropped
    assert d.loc[2011, "n"] == 4 and d.loc[2011, "met_rate"] == 0.5
    assert d.loc[2011, "accuracy"] == 1.0 and d.loc[2011, "auc"] == 1.0
    assert d.loc[2011, "mean_p"] == pytest.approx(0.575)
    assert d.loc[2011, "calibration_gap"] == pytest.approx(0.075)
    assert d.loc[2011, "brier"] == pytest.approx((0.01 + 0.04 + 0.04 + 0.16) / 4)
    assert d.loc[2012, "accuracy"] == pytest.approx(2 / 3)
    assert math.isnan(d.loc[2012, "auc"])  # one class in 2012
    assert d.loc[2011, "majority_accuracy"] == 0.5 and d.loc[2012, "majority_accuracy"] == 1.0


def test_base_rate_by_year_marks_the_sides_of_the_cutoff():
    labelled = pd.DataFrame(
        {
            "test_year": pd.array([2009, 2009, 2010, 2011, 2011, 2011], dtype="Int64"),
            "y": [1, 0, 1, 1, 1, 0],
        }
    )
    b = risk.base_rate_by_year(labelled, cutoff=2010).set_index("test_year")
    assert b["n"].to_dict() == {2009: 2, 2010: 1, 2011: 3}
    assert b.loc[2011, "met_rate"] == pytest.approx(2 / 3)
    assert b.loc[2010, "side"].startswith("train") and b.loc[2011, "side"] == "test"
    s = risk.drift_summary(
        risk.drift_by_year(labelled.assign(p=0.7), "p"), risk.base_rate_by_year(labelled), 2010
    )
    assert s["met_rate_train_years"] == pytest.approx(2 / 3)
    assert s["met_rate_test_years"] == pytest.approx(2 / 3)


# ---------------------------------------------------------------------------------------------
# group bias and regions
# ---------------------------------------------------------------------------------------------


def test_group_metrics_pool_small_groups():
    groups = ["A"] * 6 + ["B"] * 3 + ["C"] * 2
    y = [1, 1, 1, 0, 0, 0] + [1, 1, 1] + [0, 0]
    p = [0.9, 0.8, 0.7, 0.1, 0.2, 0.6] + [0.4, 0.4, 0.4] + [0.4, 0.4]
    g = risk.group_metrics(y, p, groups, min_group_size=5).set_index("group")
    assert list(g.index) == ["A", "other"]
    assert g.loc["other", "n"] == 5 and g.loc["other", "pooled"] == "B, C"
    assert g.loc["A", "accuracy"] == pytest.approx(5 / 6)
    assert g.loc["A", "auc"] == pytest.approx(1.0)
    assert g.loc["A", "mean_p"] == pytest.approx(3.3 / 6)
    assert g.loc["other", "met_rate"] == pytest.approx(0.6)
    assert g.loc["other", "calibration_gap"] == pytest.approx(0.4 - 0.6)
    assert g.loc["other", "ece"] == pytest.approx(0.2)  # one bin: |0.4 - 0.6|
    assert math.isnan(risk.group_metrics([1, 1], [0.5, 0.6], ["A", "A"], 1).loc[0, "auc"])
    assert risk.pool_small_groups(["A", "A", "B"], 1).tolist() == ["A", "A", "B"]


def _regions_file(tmp_path: Path, rows: list[str], header: str = "country,region,region_name"):
    path = tmp_path / "regions.csv"
    path.write_text("\n".join([header, *rows]) + "\n", encoding="utf-8")
    return path


def test_regions_file_missing_a_country_is_a_clear_error(tmp_path):
    path = _regions_file(tmp_path, ['"Kenya",AFR,African', '"KOREA,  REPUBLIC OF",APD,Asia'])
    regions = risk.load_regions(path)
    assert set(regions["country"]) == {"KENYA", "KOREA, REPUBLIC OF"}  # normalised like the data
    got = risk.assign_regions(["KENYA", "KOREA, REPUBLIC OF"], regions, path)
    assert got.tolist() == ["AFR", "APD"]
    with pytest.raises(ValueError) as err:
        risk.assign_regions(["KENYA", "PERU", "GHANA"], regions, path)
    msg = str(err.value)
    assert str(path) in msg and "GHANA" in msg and "PERU" in msg and "KENYA" not in msg


def test_regions_file_shape_errors(tmp_path):
    with pytest.raises(risk.RiskError, match=r"missing column\(s\) \['region'\]"):
        risk.load_regions(_regions_file(tmp_path, ["KENYA,AFR"], header="country,dept"))
    with pytest.raises(risk.RiskError, match="more than one region"):
        risk.load_regions(_regions_file(tmp_path, ["KENYA,AFR,x", "KENYA,MCD,y"]))
    with pytest.raises(risk.RiskError, match="not found"):
        risk.load_regions(tmp_path / "nope.csv")


# ---------------------------------------------------------------------------------------------
# label variants
# ---------------------------------------------------------------------------------------------

TOY_STATUSES = ["M", "PM", "MD", "NM", "CAN", "MOD", "SB", "W", " md "]
NOT_ASSESSED = ["SB", "PC", "PA", ""]
MAPPINGS = {v: m.model_dump() for v, m in RiskConfig().label_mappings.items()}


def test_label_variants_change_labels_as_expected():
    toy = pd.DataFrame({"row_id": range(len(TOY_STATUSES)), "status": TOY_STATUSES})

    def y(variant):
        return risk.relabel(toy, MAPPINGS[variant], NOT_ASSESSED).set_index("row_id")["y"]

    paper, md, ex = y("paper"), y("md_as_met"), y("exclude_cancelled_modified")
    assert 6 not in paper.index  # SB: not assessed, excluded under every variant
    assert paper.to_dict() == {0: 1, 1: 1, 2: 0, 3: 0, 4: 0, 5: 0, 7: 0, 8: 0}
    assert md.to_dict() == {0: 1, 1: 1, 2: 1, 3: 0, 4: 0, 5: 0, 7: 0, 8: 1}  # ' md ' normalised
    assert ex.to_dict() == {0: 1, 1: 1, 2: 0, 3: 0, 7: 0, 8: 0}
    with pytest.raises(risk.RiskError, match="no 'met' statuses"):
        risk.relabel(toy, {"met": []}, NOT_ASSESSED)
    with pytest.raises(risk.RiskError, match="missing column"):
        risk.relabel(toy.drop(columns="status"), MAPPINGS["paper"], NOT_ASSESSED)
    # a mapping read from params: MET = the given statuses, after normalisation
    strict = risk.relabel(
        toy, RiskConfig().label_mappings["paper"].model_copy(update={"met": ["M"]}), NOT_ASSESSED
    ).set_index("row_id")["y"]
    assert strict.to_dict() == {0: 1, 1: 0, 2: 0, 3: 0, 4: 0, 5: 0, 7: 0, 8: 0}


def test_label_mappings_are_validated_against_the_data_labels(tmp_path):
    base = {"run": {"name": "t"}, "data": {"path": str(tmp_path / "x.csv")}}
    ok = StudyConfig.model_validate(base)
    assert ok.risk.label_mappings["paper"].met == ok.data.labels.met
    bad_paper = {**base, "risk": {"label_mappings": {**MAPPINGS, "paper": {"met": ["M"]}}}}
    with pytest.raises(ValueError, match=r"label_mappings\.paper.*must equal data\.labels"):
        StudyConfig.model_validate(bad_paper)
    unknown = {**base, "risk": {"label_variants": ["paper", "lenient"]}}
    with pytest.raises(ValueError, match=r"\['lenient'\] are not in label_mappings"):
        StudyConfig.model_validate(unknown)
    clash = {**base, "risk": {"label_mappings": {**MAPPINGS, "sb": {"met": ["M", "PM", "SB"]}}}}
    with pytest.raises(ValueError, match="not-assessed statuses.*'sb'"):
        StudyConfig.model_validate(clash)
    both = {**base, "risk": {"label_mappings": {**MAPPINGS, "x": {"met": ["M"], "exclude": ["m"]}}}}
    with pytest.raises(ValueError, match=r"\['M'\] are in both 'met' and 'exclude'"):
        StudyConfig.model_validate(both)


def _synthetic_conditions(n: int = 240, seed: int = 0) -> pd.DataFrame:
    """Labelled MONA-like rows whose status is carried by a word in the text; years 2005-2014."""
    rng = np.random.default_rng(seed)
    statuses = rng.choice(["M", "PM", "MD", "NM", "CAN", "MOD", "W"], size=n)
    word = {"M": "adopt", "PM": "adopt", "MD": "submit", "NM": "privatize", "CAN": "liquidate"}
    texts = [
        f"{word.get(s, 'restructure')} the {rng.choice(['budget', 'bank', 'tax', 'law'])} plan"
        for s in statuses
    ]
    df = pd.DataFrame(
        {
            "row_id": np.arange(n),
            "country": rng.choice(["KENYA", "GHANA", "PERU", "CHILE", "NEPAL"], n),
            "arrangement_type": rng.choice(["ECF", "SBA"], n),
            "arrangement_id": rng.integers(0, 40, n).astype(str),
            "econ_descriptor": rng.choice(["1.1. Tax policy", "2.3. Central bank", "3. Trade"], n),
            "description": texts,
            "test_year": pd.array(rng.integers(2005, 2015, n), dtype="Int64"),
            "status": statuses,
        }
    )
    df["y"] = pd.array(df["status"].isin(["M", "PM"]).astype(int), dtype="Int8")
    df["label"] = np.where(df["y"] == 1, "MET", "Non-MET")
    return df


def test_label_sensitivity_retrains_per_variant():
    df = _synthetic_conditions()
    split = make_splits(df, seed=1)["random"]
    cfg = RewardConfig(tfidf_min_df=1)
    table, scores = risk.label_sensitivity(
        df, split, MAPPINGS, cfg, seed=1, not_assessed=NOT_ASSESSED, n_boot=200
    )
    t = table.set_index("variant")
    train = df[df["row_id"].isin(split["train"])]
    assert t.loc["paper", "spearman_vs_reference"] == 1.0
    assert t.loc["paper", "train_labels_changed"] == 0
    assert t.loc["md_as_met", "train_labels_changed"] == int((train["status"] == "MD").sum())
    assert t.loc["md_as_met", "n_train"] == len(train)
    n_can_mod = int(train["status"].isin(["CAN", "MOD"]).sum())
    assert t.loc["exclude_cancelled_modified", "n_train"] == len(train) - n_can_mod
    assert t.loc["exclude_cancelled_modified", "train_rows_dropped"] == n_can_mod
    assert t.loc["exclude_cancelled_modified", "train_labels_changed"] == 0
    assert t.loc["md_as_met", "train_rows_dropped"] == 0
    common = set(split["test"]) - set(df.loc[df["status"].isin(["CAN", "MOD"]), "row_id"])
    assert set(scores["row_id"]) == common and (t["n_common"] == len(common)).all()
    # the text carries the label, so every variant beats chance and ranks texts its own way
    assert (t["auc"] > 0.8).all()
    assert t.loc["md_as_met", "spearman_vs_reference"] < 0.99
    # the interval resamples arrangements and holds the estimate
    assert (t["spearman_low"] <= t["spearman_vs_reference"]).all()
    assert (t["spearman_vs_reference"] <= t["spearman_high"]).all()
    assert t.loc["paper", "spearman_low"] == 1.0
    assert t.loc["md_as_met", "met_statuses"] == "M+PM+MD"


# ---------------------------------------------------------------------------------------------
# the stage, on a synthetic run dir, with and without notebook 04's artifacts
# ---------------------------------------------------------------------------------------------


class _CountryReward:
    """A stand-in reward model: P(MET) set by the country plus a little from the text length."""

    def score(self, contexts, texts, batch_size=None):
        base = {"KENYA": 0.3, "GHANA": 0.5, "PERU": 0.6, "CHILE": 0.7, "NEPAL": 0.4}
        return np.array(
            [base[c["country"]] + len(t) / 1000 for c, t in zip(contexts, texts, strict=True)]
        )


def _synthetic_run(tmp_path: Path, with_eval: bool) -> tuple[StudyConfig, RunDir]:
    df = _synthetic_conditions()
    run = RunDir(tmp_path / "run")
    splits = make_splits(df, seed=3, temporal_cutoff_year=2010)
    run.write_parquet("data/conditions.parquet", df)
    run.write_json("data/splits.json", splits)
    rng = np.random.default_rng(0)
    for protocol in ("grouped", "temporal"):
        te = df[df["row_id"].isin(splits[protocol]["test"])].copy()
        te["p_encoder"] = np.clip(
            0.5 + 0.3 * (te["y"].astype(float) - 0.5) + rng.normal(0, 0.2, len(te)), 0.01, 0.99
        )
        te["p_majority"] = 0.6
        run.write_parquet(f"reward/predictions_{protocol}.parquet", te)
    regions = _regions_file(
        tmp_path, ["KENYA,AFR,a", "GHANA,AFR,a", "PERU,WHD,w", "CHILE,WHD,w", "NEPAL,APD,p"]
    )
    if with_eval:
        rows = []
        for pol in ["base", "ppo", "best_of_n", "history_met", "random_policy"]:
            for prompt in range(6):
                for k in range(2):
                    words = (
                        ["strengthen", "governance"] * (k + 1)
                        if pol == "ppo"
                        else ["tax", "reform", str(prompt), str(k)]
                    )
                    rows.append(
                        {
                            "policy": pol,
                            "prompt_id": prompt,
                            "sample_id": k,
                            "country": ["KENYA", "GHANA"][prompt % 2],
                            "arrangement_type": "SBA",
                            "econ_descriptor": "1.1. Tax policy",
                            "econ_area": "tax policy",
                            "response": " ".join(words),
                            "reward": 0.5 + 0.01 * len(words),
                            "audit_reward": 0.5,
                            "n_tokens": 24,
                            "top_area": "tax policy" if pol != "ppo" else "central bank",
                        }
                    )
        run.write_parquet("eval/samples.parquet", pd.DataFrame(rows))
        run.write_parquet(
            "eval/frontier.parquet",
            pd.DataFrame(
                {
                    "algo": ["base", "ppo", "ppo"],
                    "step": [0, 2, 4],
                    "reward": [0.5, 0.55, 0.6],
                    "audit_reward": [0.5, 0.5, 0.49],
                    "kl": [0.0, 0.5, 1.0],
                }
            ),
        )
    cfg = StudyConfig.model_validate(
        {
            "run": {"name": "t", "seed": 3},
            "data": {"path": str(tmp_path / "unused.csv")},
            "reward": {"tfidf_min_df": 1},
            "evaluation": {"n_boot": 100},
            "risk": {
                "regions_path": str(regions),
                "min_group_size": 5,
                "swap_texts": 6,
                "swap_generated": 4,
                "swap_countries": 3,
            },
        }
    )
    return cfg, run


@pytest.mark.parametrize("with_eval", [False, True])
def test_run_risk_stage_writes_every_table_and_flags_what_is_missing(tmp_path, with_eval):
    cfg, run = _synthetic_run(tmp_path, with_eval)
    run.write_text("figures/risk_area_shares.png", "left by an earlier run")
    stage = risk.run_risk_stage(cfg, run, reward_model=_CountryReward())
    names = {
        "risk_met_rate_by_year",
        "risk_drift_by_year",
        "risk_group_bias",
        "risk_country_swap",
        "risk_country_swap_by_country",
        "risk_length_reward",
        "risk_length_reward_bins",
        "risk_rising_ngrams",
        "risk_checkpoint_gains",
        "risk_area_diversity",
        "risk_area_shares",
        "risk_diversity_changes",
        "risk_label_variants",
    }
    assert set(stage.tables) == names
    for name in names:
        assert run.exists(f"tables/{name}.csv") and run.exists(f"tables/{name}.md")
    summary = json.loads(run.path("risk/summary.json").read_text())
    assert summary["drift"]["test_years"] == [2011, 2012, 2013, 2014]
    assert summary["alpha"] == 0.05 and summary["n_boot"] == 100
    tests = summary["drift"]["tests"]
    shift = tests["base_rate_shift"]
    assert shift["low"] <= shift["estimate"] <= shift["high"]
    assert [r["test_year"] for r in tests["vs_majority"]] == [2011, 2012, 2013, 2014]
    assert set(summary["group_bias"]) >= {"overall", "region", "arrangement_type", "econ_area"}
    # the stand-in reward reads the country: the swap must see it
    assert summary["country_swap"]["by_source"][0]["mean_abs_delta"] > 0.05
    for fig in ("risk_drift", "risk_group_bias", "risk_country_swap", "risk_label_variants"):
        assert run.exists(f"figures/{fig}.png")
    flagged = {"note": "missing", "artifact": "eval/samples.parquet", "notebook": "notebook 04"}
    if not with_eval:
        assert flagged in stage.notes and summary["notes"] == stage.notes  # fields, no sentence
        assert stage.notes.count(flagged) == 1  # three families lack the samples: one note
        assert stage.tables["risk_area_diversity"].iloc[0].to_dict() == flagged
        assert stage.tables["risk_checkpoint_gains"].loc[0, "artifact"] == "eval/frontier.parquet"
        assert (
            summary["diversity"] is None and summary["country_swap"]["generated_included"] is False
        )
        assert not run.exists("figures/risk_area_shares.png")  # no stale figure survives
    else:
        assert stage.notes == []
        div = stage.tables["risk_area_diversity"].set_index("policy")
        assert div.loc["ppo", "entropy"] == 0.0 and div.loc["ppo", "coverage"] == 0.0
        assert div.loc["base", "kl_to_reference"] == pytest.approx(0.0, abs=1e-12)
        assert stage.tables["risk_rising_ngrams"].loc[0, "ngram"] == "strengthen governance"
        gains = stage.tables["risk_checkpoint_gains"]
        assert gains["gap"].iloc[-1] == pytest.approx(0.11)
        assert summary["country_swap"]["generated_included"] is True
        # the last checkpoint, measured on the samples with an interval over prompts
        cg = {r["algo"]: r for r in summary["checkpoint_gains"]}
        ppo = cg["ppo"]
        assert ppo["reward_gain_low"] <= ppo["reward_gain"] <= ppo["reward_gain_high"]
        # measured on the samples (ppo's words add 0.02-0.04 over base's 0.04), not the frontier
        assert ppo["reward_gain"] == pytest.approx(0.5 + 0.03 - 0.54) and ppo["n_prompts"] == 6
        ch = stage.tables["risk_diversity_changes"].set_index("measure")
        assert set(ch["policy"]) == {"ppo"} and ch.loc["entropy", "change"] == 0.0
        lr = stage.tables["risk_length_reward"].set_index("policy")
        assert lr.loc["ppo", "spearman"] == pytest.approx(1.0)  # reward grows with words here
        assert run.exists("figures/risk_area_shares.png")


def test_a_compared_encoder_as_rl_reward_is_read_where_it_was_trained(tmp_path):
    """reward_source = a compared encoder trained on the reward protocol only: its column feeds
    group bias; drift (temporal protocol) becomes a note naming why, not a crash."""
    cfg, run = _synthetic_run(tmp_path, with_eval=False)
    pred = run.read_parquet("reward/predictions_grouped.parquet")
    run.write_parquet("reward/predictions_grouped.parquet", pred.assign(p_mpnet=pred["p_encoder"]))
    cfg.reward = cfg.reward.model_copy(
        update={"compare_encoders": [CompareEncoder(name="mpnet", encoder="embedded:mpnet",
                                                    protocols=["grouped"])],
                "reward_source": "mpnet"}
    )  # fmt: skip
    stage = risk.run_risk_stage(cfg, run, reward_model=_CountryReward())
    summary = json.loads(run.path("risk/summary.json").read_text())
    assert summary["prediction_column"] == "p_mpnet" and summary["drift"] is None
    assert {"note": "not_temporal", "reward": "mpnet", "protocols": ["grouped"]} in stage.notes
    words = [prose.note_text(n) for n in stage.notes]
    assert any("'mpnet' was not trained on the temporal protocol" in n for n in words)
    assert "overall" in summary["group_bias"]


def test_run_risk_stage_names_a_country_missing_from_the_regions_file(tmp_path):
    cfg, run = _synthetic_run(tmp_path, with_eval=False)
    cfg.risk.regions_path.write_text("country,region,region_name\nKENYA,AFR,a\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"regions\.csv.*\['CHILE', 'GHANA', 'NEPAL', 'PERU'\]"):
        risk.run_risk_stage(cfg, run, reward_model=_CountryReward())


# ---------------------------------------------------------------------------------------------
# the stage's families, each alone on the synthetic run's inputs
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def close_figures():
    import matplotlib.pyplot as plt

    yield
    plt.close("all")


def _inputs(tmp_path: Path, with_eval: bool = True) -> stage.RiskInputs:
    cfg, run = _synthetic_run(tmp_path, with_eval)
    return stage.load_inputs(cfg, run, _CountryReward())


@pytest.mark.parametrize("with_eval", [False, True])
def test_each_family_writes_the_tables_and_figures_it_declares(tmp_path, with_eval, close_figures):
    inp = _inputs(tmp_path, with_eval)
    for family in stage.RISK_FAMILIES.values():
        measured = family.measure(inp)
        assert tuple(measured.tables) == family.tables, family.key
        assert tuple(measured.figures) == (
            family.figures if measured.summary is not None else ()
        ), family.key
    assert stage.record_start_policy(inp).summary == "base"  # no eval/summary.json here
    assert sorted(stage.RISK_FIGURES) == [
        "risk_area_shares", "risk_checkpoint_gains", "risk_country_swap", "risk_drift",
        "risk_group_bias", "risk_label_variants", "risk_length_reward",
    ]  # fmt: skip


def test_drift_family_measures_the_years_after_the_cutoff_or_says_why_not(tmp_path, close_figures):
    inp = _inputs(tmp_path, with_eval=False)
    m = stage.measure_drift(inp)
    assert m.summary["test_years"] == [2011, 2012, 2013, 2014]
    base = m.tables["risk_met_rate_by_year"].set_index("test_year")
    in_2012 = inp.labelled[inp.labelled["test_year"] == 2012]
    assert base.loc[2012, "met_rate"] == pytest.approx(in_2012["y"].astype(float).mean())
    assert set(m.summary["tests"]) >= {"base_rate_shift", "vs_majority"}
    gone = stage.measure_drift(dataclasses.replace(inp, temporal=None))
    assert gone.summary is None and not gone.figures
    assert [prose.note_text(n) for n in gone.notes] == [
        "notebook 02 (temporal protocol) did not run: reward/predictions_temporal.parquet missing "
        "(reward.protocols = ['random', 'grouped', 'temporal'])"
    ]
    # the note table holds the note's fields; the report words them the same way
    note_row = gone.tables["risk_drift_by_year"].iloc[0].to_dict()
    assert prose.note_text(note_row) == prose.note_text(gone.notes[0])
    assert gone.tables["risk_met_rate_by_year"].equals(m.tables["risk_met_rate_by_year"])


def test_group_bias_family_summarises_the_whole_test_set(tmp_path, close_figures):
    inp = _inputs(tmp_path, with_eval=False)
    m = stage.measure_group_bias(inp)
    overall = m.summary["overall"]
    assert overall["n"] == len(inp.pred)
    assert overall["met_rate"] == pytest.approx(inp.pred["y"].astype(float).mean())
    assert overall["mean_p"] == pytest.approx(inp.pred["p_encoder"].mean())
    region = m.tables["risk_group_bias"].query("dimension == 'region'")
    assert set(region["group"]) <= {"AFR", "WHD", "APD", "other"}
    assert m.summary["region"]["n_groups"] == int((region["n"] > 0).sum())


def test_country_swap_family_on_texts_of_one_country(tmp_path, close_figures):
    """Every drawn text is Kenyan (0.3 under the stand-in reward) or Nepali (0.4), and none of
    the swapped-in countries': country c moves a text by base[c] - its own base, whatever it says."""
    inp = _inputs(tmp_path, with_eval=False)
    rates = {"GHANA": 0.2, "PERU": 0.5, "CHILE": 0.8}
    train = pd.DataFrame(
        {"row_id": np.arange(30), "country": np.repeat(list(rates), 10),
         "y": [int(i < 10 * r) for r in rates.values() for i in range(10)]}
    )  # fmt: skip
    texts = inp.pred[inp.pred["country"].isin(["KENYA", "NEPAL"])]
    own = texts["country"].map({"KENYA": 0.3, "NEPAL": 0.4}).mean()
    cfg = inp.cfg.model_copy(update={"risk": inp.cfg.risk.model_copy(update={"swap_texts": 999})})
    m = stage.measure_country_swap(
        dataclasses.replace(
            inp, cfg=cfg, labelled=train, splits={"grouped": {"train": list(range(30))}}, pred=texts
        )
    )
    s = m.summary
    assert s["countries"] == ["CHILE", "GHANA", "PERU"]
    assert s["most_favoured"] == "CHILE" and s["most_favoured_delta"] == pytest.approx(0.7 - own)
    assert s["least_favoured"] == "GHANA" and s["least_favoured_delta"] == pytest.approx(0.5 - own)
    assert s["spearman_delta_vs_hist_met_rate"] == pytest.approx(1.0)
    assert s["n_countries_up"] == 3 and s["n_countries_down"] == 0
    assert s["generated_included"] is False
    assert s["by_source"][0]["mean_abs_delta"] == pytest.approx(0.6 - own)
    per = m.tables["risk_country_swap_by_country"].set_index("country")
    assert per.loc["PERU", "hist_met_rate"] == pytest.approx(0.5)
    assert per.loc["PERU", "mean_delta"] == pytest.approx(0.6 - own)
    with_gen = stage.measure_country_swap(_inputs(tmp_path / "eval", with_eval=True))
    assert with_gen.summary["generated_included"] is True
    assert list(with_gen.tables["risk_country_swap"]["source"]) == ["historical", "generated"]


def test_length_family_correlates_reward_with_words(tmp_path, close_figures):
    m = stage.measure_length_reward(_inputs(tmp_path))
    lr = m.tables["risk_length_reward"].set_index("policy")
    # ppo writes 2 or 4 words and earns 0.01 a word; base always 4 words (no correlation)
    assert lr.loc["ppo", "spearman"] == pytest.approx(1.0)
    assert math.isnan(lr.loc["base", "spearman"])
    assert lr.loc["ppo", "n"] == 12 and "history_met" not in lr.index
    # audit reward and token counts are constant here: their correlations are undefined
    assert lr[["audit_spearman", "tokens_spearman"]].isna().all().all()
    assert m.summary["length_column"] == "n_words"
    assert [r["policy"] for r in m.summary["by_policy"]] == list(lr.index)
    assert lr.loc["all generated", "n"] == 36  # base, ppo and best_of_n; not the references
    assert lr.loc["all generated", "spearman"] == pytest.approx(1.0)  # base's 4 words earn 0.54
    bins = m.tables["risk_length_reward_bins"].set_index("policy")
    assert bins.loc["ppo", "mean_reward"] == pytest.approx(0.53)
    gone = stage.measure_length_reward(_inputs(tmp_path / "none", with_eval=False))
    assert gone.summary is None and gone.notes == [stage.SAMPLES_NOTE]
    assert set(gone.tables) == {"risk_length_reward", "risk_length_reward_bins"}


def test_ngrams_family_needs_the_start_and_a_tuned_policy(tmp_path):
    inp = _inputs(tmp_path)
    m = stage.measure_rising_ngrams(inp)
    assert m.summary == {"ppo": m.tables["risk_rising_ngrams"]["ngram"].head(5).tolist()}
    assert m.summary["ppo"][0] == "strengthen governance"
    no_base = inp.samples[inp.samples["policy"] != "base"]
    gone = stage.measure_rising_ngrams(dataclasses.replace(inp, samples=no_base))
    assert gone.summary is None
    assert [prose.note_text(n) for n in gone.notes] == [
        "no base and tuned policies in eval/samples.parquet (policies: ['ppo', 'best_of_n'])"
    ]


def test_gains_family_reads_the_frontier_and_the_samples(tmp_path, close_figures):
    inp = _inputs(tmp_path)
    # frontier alone: ppo's last checkpoint gained 0.6 - 0.5 in reward, 0.49 - 0.5 in audit
    alone = stage.measure_checkpoint_gains(dataclasses.replace(inp, samples=None))
    (last,) = alone.summary
    assert (last["algo"], last["step"]) == ("ppo", 4)
    assert last["reward_gain"] == pytest.approx(0.1) and last["gap"] == pytest.approx(0.11)
    assert "reward_gain_low" not in last
    assert alone.tables["risk_checkpoint_gains"]["gap"].tolist() == pytest.approx([0, 0.05, 0.11])
    # with the samples, the last checkpoint's gains are theirs, with intervals over prompts
    (last,) = stage.measure_checkpoint_gains(inp).summary
    assert last["reward_gain"] == pytest.approx(0.53 - 0.54) and last["audit_gain"] == 0.0
    assert last["reward_gain_low"] <= last["reward_gain"] <= last["reward_gain_high"]
    base_only = inp.frontier[inp.frontier["algo"] == "base"]
    gone = stage.measure_checkpoint_gains(dataclasses.replace(inp, frontier=base_only))
    said = prose.note_text(gone.notes[0])
    assert said == "eval/frontier.parquet holds no tuned checkpoint (only the base policy)"
    gone = stage.measure_checkpoint_gains(dataclasses.replace(inp, frontier=None))
    assert [prose.note_text(n) for n in gone.notes] == [
        "notebook 04 did not run: eval/frontier.parquet missing"
    ]


def test_diversity_family_against_history_or_the_requested_areas(tmp_path, close_figures):
    inp = _inputs(tmp_path)
    m = stage.measure_diversity(inp)
    assert m.summary["reference"] == "history (pooled)" and not m.notes
    div = m.tables["risk_area_diversity"].set_index("policy")
    assert div.loc["history (pooled)", "kind"] == "reference"
    assert div.loc["ppo", "coverage"] == 0.0 and div.loc["base", "coverage"] == 1.0
    assert div.loc["base", "kl_to_reference"] == pytest.approx(0.0, abs=1e-12)
    ch = m.tables["risk_diversity_changes"].set_index("measure")
    assert ch.loc["kl_to_reference", "change"] == pytest.approx(div.loc["ppo", "kl_to_reference"])
    # base pools 'tax reform p 0' and 'tax reform p 1' (4 distinct of 6 bigrams), ppo
    # 'strengthen governance' and its double (2 of 4)
    assert ch.loc["within_prompt_distinct_2", "change"] == pytest.approx(0.5 - 4 / 6)
    no_hist = inp.samples[~inp.samples["policy"].str.startswith("history")]
    alt = stage.measure_diversity(dataclasses.replace(inp, samples=no_hist))
    assert alt.summary["reference"] == "requested areas (prompts)"
    assert [prose.note_text(n) for n in alt.notes] == [
        "no history policies in eval/samples.parquet: areas compared with the prompts' areas"
    ]
    ref = alt.tables["risk_area_diversity"].set_index("policy").loc["requested areas (prompts)"]
    assert ref["n"] == 12 and ref["entropy"] == 0.0  # base's 12 prompts, all on tax policy


def test_label_family_retrains_under_each_mapping(tmp_path, close_figures):
    inp = _inputs(tmp_path, with_eval=False)
    m = stage.measure_label_variants(inp)
    t = m.tables["risk_label_variants"].set_index("variant")
    assert list(t.index) == list(inp.cfg.risk.label_variants)
    assert m.summary == m.tables["risk_label_variants"].to_dict("records")
    assert t.loc["paper", "spearman_vs_reference"] == 1.0
    assert t.loc["paper", "train_labels_changed"] == 0
    train = inp.labelled[inp.labelled["row_id"].isin(inp.splits["grouped"]["train"])]
    assert t.loc["md_as_met", "train_labels_changed"] == int((train["status"] == "MD").sum())


# ---------------------------------------------------------------------------------------------
# intervals behind the verdicts
# ---------------------------------------------------------------------------------------------


def test_drift_tests_resample_arrangements_and_see_a_clear_shift():
    rng = np.random.default_rng(0)
    years = np.repeat(np.arange(2005, 2015), 60)
    arr = np.arange(years.size) // 6  # 6 conditions per arrangement, one year each
    y = (rng.random(years.size) < np.where(years <= 2010, 0.8, 0.3)).astype(int)
    lab = pd.DataFrame({"test_year": years, "y": y, "arrangement_id": arr.astype(str)})
    pred = lab[lab["test_year"] > 2010].assign(p=0.8, p_majority=0.9)
    t = risk.drift_tests(lab, pred, "p", 2010, alpha=0.05, n_boot=300, seed=1)
    s = t["base_rate_shift"]
    assert s["high"] < 0 and s["low"] <= s["estimate"] <= s["high"]
    assert s["estimate"] == pytest.approx(y[years > 2010].mean() - y[years <= 2010].mean())
    cal = t["calibration_in_the_large"]
    assert cal["estimate"] == pytest.approx(0.8 - pred["y"].mean()) and cal["low"] > 0
    # the model and the majority rule both always say MET: no year differs
    assert all(r["difference"] == 0 and r["low"] == r["high"] == 0 for r in t["vs_majority"])
    assert t["accuracy_trend"]["low"] <= t["accuracy_trend"]["estimate"]


def test_one_cluster_gives_no_interval():
    g = risk.group_metrics([1, 0, 1, 1], [0.9, 0.9, 0.9, 0.9], ["A"] * 4, 1, clusters=["x"] * 4)
    assert g.loc[0, "calibration_gap"] == pytest.approx(0.15)
    assert math.isnan(g.loc[0, "gap_low"]) and math.isnan(g.loc[0, "gap_high"])
    rows = risk.group_metrics([1, 0] * 10, [0.9] * 20, ["A"] * 20, 1, n_boot=200)
    assert rows.loc[0, "gap_low"] < 0.4 < rows.loc[0, "gap_high"]


def test_swap_intervals_cluster_generated_responses_by_prompt():
    def score(contexts, texts):
        return np.array(
            [
                COUNTRY_SCORE[c["country"]] + 0.01 * len(t)
                for c, t in zip(contexts, texts, strict=True)
            ]
        )

    texts = ["a", "bb", "ccc", "dddd"]
    swaps = risk.country_swap(
        score, _ctx(["ALPHA"] * 4), texts, ["BETA", "GAMMA"], "generated", clusters=[7, 7, 8, 8]
    )
    assert set(swaps["cluster"]) == {"generated:7", "generated:8"}
    overall, per = risk.swap_summary(swaps, n_boot=200)
    by = per.set_index("country")
    # every text moves by exactly the country gap: the interval is that gap
    assert by.loc["GAMMA", "ci_low"] == pytest.approx(0.7)
    assert by.loc["GAMMA", "ci_high"] == pytest.approx(0.7)
    sd = np.std([0.21, 0.22, 0.23, 0.24], ddof=1)
    assert overall.loc[0, "ratio"] == pytest.approx(((0.3 + 0.7) / 2) / sd)
    with pytest.raises(risk.RiskError, match="3 cluster labels but 4 texts"):
        risk.country_swap(score, _ctx(["ALPHA"] * 4), texts, ["BETA"], clusters=[1, 2, 3])


def test_length_interval_resamples_prompts():
    # 10 prompts, reward grows with length across prompts; each prompt answered 5 times
    n = np.repeat(np.arange(1, 11), 5)
    df = pd.DataFrame({"policy": "ppo", "prompt_id": n, "n_words": n, "reward": 0.1 * n})
    corr, _ = risk.length_reward(df, "n_words", "reward", n_boot=200)
    assert corr.loc[0, "spearman_low"] == pytest.approx(1.0)
    assert corr.loc[0, "spearman_high"] == pytest.approx(1.0)
    noisy = df.assign(reward=np.random.default_rng(0).normal(size=len(df)))
    c = risk.length_reward(noisy, "n_words", "reward", n_boot=200)[0].loc[0]
    assert c["spearman_low"] < c["spearman"] < c["spearman_high"]
    skipped = risk.length_reward(df, "n_words", "reward", n_boot=0)[0]
    assert math.isnan(skipped.loc[0, "spearman_low"])


def test_final_gains_are_paired_by_prompt():
    rows = []
    for pid in range(12):
        for _ in range(2):
            for pol, r in (("sft", 0.5), ("ppo", 0.6)):
                rows.append(
                    {"policy": pol, "prompt_id": pid, "reward": r + 0.01 * pid, "audit_reward": 0.5}
                )
    samples = pd.DataFrame(rows)
    g = risk.final_gains(samples, "sft", ["ppo", "grpo"], n_boot=200).set_index("algo")
    assert list(g.index) == ["ppo"] and g.loc["ppo", "n_prompts"] == 12  # grpo: no samples
    assert g.loc["ppo", "reward_gain"] == pytest.approx(0.1)
    # paired by prompt: the prompt effect cancels, the interval is the point
    assert g.loc["ppo", "reward_gain_low"] == pytest.approx(0.1)
    assert g.loc["ppo", "gap"] == pytest.approx(0.1) and g.loc["ppo", "audit_gain_high"] == 0.0
    assert risk.final_gains(samples, "base", ["ppo"]).empty


def test_diversity_changes_see_a_collapse():
    areas = ["fiscal", "monetary", "trade", "labour"]
    rows = []
    for pid in range(20):
        for k in range(4):
            rows.append(
                {
                    "policy": "sft",
                    "prompt_id": pid,
                    "top_area": areas[k],
                    "response": f"w{k} x{k} {pid}",
                }
            )
            rows.append(
                {
                    "policy": "ppo",
                    "prompt_id": pid,
                    "top_area": "fiscal",
                    "response": "cut the deficit",
                }
            )
    samples = pd.DataFrame(rows)
    ref = pd.DataFrame({"prompt_id": np.repeat(np.arange(20), 4), "area": areas * 20})
    ch = risk.diversity_changes(samples, "sft", ["ppo"], ref, n_boot=200).set_index("measure")
    assert ch.loc["entropy", "start"] == pytest.approx(math.log(4))
    assert ch.loc["entropy", "value"] == 0.0 and ch.loc["entropy", "ci_high"] < 0
    assert ch.loc["kl_to_reference", "ci_low"] > 0
    d = ch.loc["within_prompt_distinct_2"]
    assert d["start"] == 1.0 and d["value"] == pytest.approx(2 / 8) and d["ci_high"] < 0
    assert risk.diversity_changes(samples, "base", ["ppo"], ref).empty


# ---------------------------------------------------------------------------------------------
# prose chosen from the results
# ---------------------------------------------------------------------------------------------


def _drift(shift_ci: tuple, cal_ci: tuple, trend_ci: tuple, train=0.65, test=0.55, mean_p=0.62):
    def ci(t):
        return {"estimate": (t[0] + t[1]) / 2, "low": t[0], "high": t[1]}

    return {
        "cutoff": 2010,
        "met_rate_train_years": train,
        "met_rate_test_years": test,
        "test_years": [2011, 2012],
        "n_test": 50,
        "mean_p_test": mean_p,
        "observed_met_test": test,
        "accuracy_first_year": 0.7,
        "accuracy_last_year": 0.5,
        "first_year": 2011,
        "last_year": 2012,
        "tests": {
            "base_rate_shift": ci(shift_ci),
            "calibration_in_the_large": ci(cal_ci),
            "accuracy_trend": ci(trend_ci),
            "vs_majority": [
                {"test_year": 2011, "difference": 0.1, "low": 0.02, "high": 0.2},
                {"test_year": 2012, "difference": 0.0, "low": -0.1, "high": 0.1},
            ],
        },
    }


def test_drift_verdicts_follow_the_intervals_not_the_point_estimates():
    # the same point estimates (base rate 65% -> 55%, P(MET) 62% vs 55%, accuracy 70% -> 50%);
    # the words of each verdict are the golden file's (tests/test_report_risk.py)
    clear = prose.drift_text(_drift((-0.15, -0.05), (0.02, 0.12), (-0.3, -0.1))).paragraph()
    assert phrase("base_rate", BELOW) in clear and "(-10.0 percentage points" in clear
    assert phrase("overstates", ABOVE) in clear and phrase("accuracy_trend", BELOW) in clear
    unclear = prose.drift_text(_drift((-0.2, 0.01), (-0.01, 0.12), (-0.3, 0.1))).paragraph()
    for key in ("base_rate", "overstates", "accuracy_trend"):
        assert phrase(key, UNCLEAR) in unclear
        assert phrase(key, ABOVE) not in unclear and phrase(key, BELOW) not in unclear
    up = prose.drift_text(_drift((0.05, 0.15), (-0.12, -0.02), (0.1, 0.3), 0.55, 0.65, 0.6))
    assert phrase("base_rate", ABOVE) in up.paragraph()
    assert phrase("overstates", BELOW) in up.paragraph()
    assert "90% CI" in prose.drift_text(_drift((0.05, 0.15), (0, 1), (0, 1)), alpha=0.1).paragraph()


def test_swap_and_length_verdicts_need_the_interval():
    cs = {
        "countries": list("ABCDEF"),
        "by_source": [{"source": "historical", "n_texts": 5, "n_pairs": 25, "mean_abs_delta": 0.05,
                       "max_abs_delta": 0.2, "orig_sd": 0.04, "ratio": 1.25, "ratio_low": 0.9,
                       "ratio_high": 1.6}],
        "most_favoured": "A", "most_favoured_delta": 0.01,
        "least_favoured": "F", "least_favoured_delta": -0.1,
        "spearman_delta_vs_hist_met_rate": 0.6, "spearman_delta_vs_hist_met_rate_p": 0.2,
        "n_countries_up": 1, "n_countries_down": 2, "generated_included": True,
    }  # fmt: skip
    assert prose.swap_ratio_verdict(cs["by_source"][0]) == UNCLEAR  # the ratio's CI holds 1
    assert prose.swap_favour(cs, 0.05) == UNCLEAR  # p >= alpha: a positive rho is no favour
    assert phrase("ratio", UNCLEAR) in prose.swap_text(cs).paragraph()
    cs["by_source"][0]["ratio_low"] = 1.1
    cs["spearman_delta_vs_hist_met_rate_p"] = 0.01
    assert prose.swap_ratio_verdict(cs["by_source"][0]) == ABOVE
    assert prose.swap_favour(cs, 0.05) == ABOVE and prose.swap_favour(cs, 0.005) == UNCLEAR
    assert prose.swap_favour({**cs, "spearman_delta_vs_hist_met_rate": -0.6}, 0.05) == BELOW
    assert prose.swap_favour({**cs, "spearman_delta_vs_hist_met_rate_p": None}, 0.05) is None
    assert prose.swap_ratio_verdict({**cs["by_source"][0], "ratio": float("nan")}) is None
    row = {"policy": "ppo", "n": 40, "mean_length": 12.0, "spearman": 0.3, "pearson": 0.3}
    lr = {"by_policy": [{**row, "spearman_low": -0.05, "spearman_high": 0.6}]}
    assert phrase("length", UNCLEAR, level="95%") in prose.length_text(lr).paragraph()
    lr = {"by_policy": [{**row, "spearman_low": 0.05, "spearman_high": 0.6}]}
    assert phrase("length", ABOVE) in prose.length_text(lr).paragraph()


def test_interpret_refuses_another_alpha_than_the_stored_one():
    with pytest.raises(risk.RiskError, match="alpha = 0.05, not 0.1"):
        prose.interpret({"alpha": 0.05}, alpha=0.1)


def test_missing_inputs_become_visible_notes():
    note = "notebook 04 did not run: eval/samples.parquet missing"
    f = prose.length_text(None, note=note)
    assert f.markdown() == f"> ⚠ {note}"
    assert f.paragraph() == sentence("risk", "not_measured", note) and note in f.paragraph()
    assert prose.gains_text(None).note == prose.note_text(
        risk.missing_note("eval/frontier.parquet")
    )
    # a run from before the notes were fields stored the sentence itself: shown as it is
    assert prose.note_text(note) == note == prose.note_text({"note": note})
    assert prose.drift_text(None).note is not None


def _gain(reward: tuple, audit: tuple, gap: tuple) -> dict:
    out = {"algo": "ppo", "step": 9, "baseline": "base step 0"}
    for name, (est, low, high) in (("reward_gain", reward), ("audit_gain", audit), ("gap", gap)):
        out |= {name: est, f"{name}_low": low, f"{name}_high": high}
    return out


def test_gains_verdict_depends_on_the_intervals():
    def reading(*args):
        return prose.gain_reading(_gain(*args))

    assert reading((0.1, 0.05, 0.15), (-0.01, -0.03, 0.01), (0.11, 0.06, 0.16)) == "specific"
    assert reading((0.1, 0.05, 0.15), (-0.05, -0.08, -0.02), (0.15, 0.1, 0.2)) == "audit falls"
    assert reading((0.1, 0.05, 0.15), (0.08, 0.03, 0.13), (0.02, -0.01, 0.05)) == "followed"
    assert reading((0.1, 0.05, 0.15), (0.04, 0.01, 0.07), (0.06, 0.03, 0.09)) == "partly specific"
    assert reading((0.1, 0.05, 0.15), (0.0, -0.03, 0.02), (0.1, -0.01, 0.2)) == "unclear"
    # the audit gaining more than the training reward (the gap below zero) is said as such,
    # whether or not the audit's own interval excludes zero
    assert reading((0.004, 0.003, 0.005), (0.014, 0.01, 0.019), (-0.01, -0.015, -0.006)) == "audit gains more"  # fmt: skip
    assert reading((0.004, 0.003, 0.005), (0.01, -0.001, 0.02), (-0.006, -0.01, -0.002)) == "audit gains more"  # fmt: skip
    # a positive point estimate whose interval holds 0 is no gain
    assert reading((0.01, -0.01, 0.03), (0.0, -0.02, 0.02), (0.01, -0.02, 0.04)) == "not raised"
    assert reading((-0.05, -0.08, -0.02), (0.0, -0.02, 0.02), (-0.05, -0.1, 0.0)) == "lowered"
    bare = {"algo": "ppo", "step": 9, "baseline": "base step 0", "reward_gain": 0.1,
            "audit_gain": 0.0, "gap": 0.1}  # fmt: skip
    assert prose.gain_reading(bare) == "not raised"
    assert "no interval" in prose.gains_text([bare]).paragraph()


def test_a_null_gain_states_its_bound_and_a_missing_interval_none():
    # the training reward's gain holds zero: its upper end is said as a bound
    held = prose.gains_text([_gain((0.01, -0.01, 0.03), (0.0, -0.02, 0.02), (0.01, -0.02, 0.04))])
    assert "raise the training reward (a gain of at most +0.0300)" in held.paragraph()
    # the audit's gain holds zero and the gap lies above it: the audit's bound, no gap bound
    specific = _gain((0.1, 0.05, 0.15), (-0.01, -0.03, 0.012), (0.11, 0.06, 0.16))
    text = prose.gains_text([specific]).paragraph()
    assert "does not rise distinguishably (a gain of at most +0.0120)" in text
    assert "gap of at most" not in text
    # an audit interval that is missing: the same reading, with no empty parentheses
    gone = {**specific, "audit_gain_low": None, "audit_gain_high": None}
    text = prose.gains_text([gone]).paragraph()
    assert "does not rise distinguishably and" in text and "()" not in text


@pytest.mark.parametrize("with_eval", [False, True])
def test_report_content_reads_the_stage_artifacts(tmp_path, with_eval):
    from rlxf_utils.artifacts import ArtifactMissing

    cfg, run = _synthetic_run(tmp_path, with_eval)
    with pytest.raises(ArtifactMissing, match="risk/summary.json.*notebook 05"):
        prose.report_content(run)
    risk.run_risk_stage(cfg, run, reward_model=_CountryReward())
    variables, includes = prose.report_content(run)
    assert set(includes) == set(prose.REPORT_TABLES)
    for key in ("drift", "group_bias", "country_swap", "length_reward", "diversity", "notes"):
        assert variables[key] and not re.search(r"\bnan\b", variables[key], re.IGNORECASE)
    if with_eval:
        assert variables["notes"] == sentence("risk", "notes", [])
        assert "strengthen governance" in variables["rising_ngrams"]
    else:
        assert "notebook 04 did not run" in variables["diversity"]  # the stage's note
        assert "eval/samples.parquet missing" in includes["risk_area_diversity.md"]


def test_length_family_reads_the_judges_scores_as_written(tmp_path, close_figures):
    """Under the evaluation's cut rule a cut response scores 0 (`reward`), which would read as a
    dislike of length: the length family reads the scores as written (`reward_as_written`)."""
    inp = _inputs(tmp_path)
    s = inp.samples.copy()
    longest = s["response"].map(lambda t: len(t.split())) == s["response"].map(lambda t: len(t.split())).max()  # fmt: skip
    s["reward_as_written"], s["audit_reward_as_written"] = s["reward"], s["audit_reward"]
    s.loc[longest, ["reward", "audit_reward"]] = 0.0  # the rule's zeros on the longest answers
    m = stage.measure_length_reward(dataclasses.replace(inp, samples=s))
    assert m.tables["risk_length_reward"].set_index("policy").loc[
        "ppo", "spearman"
    ] == pytest.approx(1.0)


def test_average_ranks_are_scipys_rankdata() -> None:
    """The bootstraps' Spearman ranks without scipy's checks: the same numbers, ties and all."""
    from scipy import stats

    from rlxf_utils.stats.correlation import average_ranks

    rng = np.random.default_rng(5)
    for _ in range(300):
        n = int(rng.integers(1, 200))
        x = rng.integers(0, int(rng.integers(1, 20)), n).astype(float)
        x = rng.normal(size=n) if rng.random() < 0.3 else x  # few ties or many
        assert np.array_equal(average_ranks(x), stats.rankdata(x))
