"""MET-rate tests with arrangement-clustered variances (rlxf_utils.stats.rates)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from rlxf_utils.data.findings import data_findings
from rlxf_utils.report.data import findings_sentences
from rlxf_utils.stats import p_verdict, rate_heterogeneity, rate_shift, wilson_z


def _labelled(n_arr: int = 120, per: int = 8, slope: float = 0.0, seed: int = 0) -> pd.DataFrame:
    """Arrangements with a shared random effect; MET odds change by `slope` per year."""
    rng = np.random.default_rng(seed)
    arr = np.repeat(np.arange(n_arr), per)
    year = np.repeat(rng.integers(2002, 2014, n_arr), per)
    effect = np.repeat(rng.normal(0, 1.0, n_arr), per)
    p = 1 / (1 + np.exp(-(0.5 + slope * (year - 2008) + effect)))
    return pd.DataFrame(
        {
            "y": (rng.random(len(arr)) < p).astype(int),
            "test_year": year,
            "arrangement_id": arr.astype(str),
            "arrangement_type": np.repeat(rng.choice(["ECF", "SBA"], n_arr), per),
            "econ_descriptor": rng.choice(["tax", "bank", "debt"], len(arr)),
        }
    )


def test_trend_is_called_only_when_there_is_one():
    up = data_findings(_labelled(slope=0.4), cutoff=2010, alpha=0.05, min_n=20)
    assert up["trend"]["or_low"] > 1 and up["trend"]["verdict"] == "above"
    down = data_findings(_labelled(slope=-0.4), cutoff=2010, alpha=0.05, min_n=20)
    assert down["trend"]["or_high"] < 1 and down["trend"]["verdict"] == "below"
    assert down["shift"]["diff_high"] < 0 and down["shift"]["verdict"] == "below"
    flat = data_findings(_labelled(slope=0.0, seed=3), cutoff=2010, alpha=0.05, min_n=20)
    assert flat["trend"]["or_low"] < 1 < flat["trend"]["or_high"]
    assert flat["trend"]["p_value"] >= 0.05 and flat["trend"]["verdict"] == "not distinguishable"
    assert data_findings(_labelled(), 2010, alpha=0.1, min_n=20)["level"] == "90%"
    # the stage stores numbers only; the report phrases them at the stored level
    assert not any(k.endswith("sentence") for k in up)
    assert (
        "90% CI" in findings_sentences(data_findings(_labelled(), 2010, 0.1, 20))["trend_sentence"]
    )


def test_p_verdict_calls_a_test_only_below_alpha():
    assert p_verdict(0.01, 0.05) == "above" and p_verdict(0.01, 0.05, up=False) == "below"
    assert p_verdict(0.05, 0.05) == p_verdict(float("nan"), 0.05) == "not distinguishable"
    with pytest.raises(ValueError):
        p_verdict(0.01, 1.5)


def test_clustered_rows_widen_the_interval():
    df = _labelled(n_arr=60, per=20, seed=1)
    clustered = rate_shift(df["y"], df["test_year"] > 2008, df["arrangement_id"])
    independent = rate_shift(df["y"], df["test_year"] > 2008, np.arange(len(df)))
    assert clustered["diff"] == pytest.approx(independent["diff"])
    assert clustered["diff_high"] - clustered["diff_low"] > 1.5 * (
        independent["diff_high"] - independent["diff_low"]
    )
    assert clustered["diff"] == pytest.approx(clustered["rate_after"] - clustered["rate_before"])
    with pytest.raises(ValueError, match="both sides"):
        rate_shift(df["y"], df["test_year"] > 3000, df["arrangement_id"])


def test_heterogeneity_detects_different_rates_and_drops_small_groups():
    rng = np.random.default_rng(0)
    g = np.repeat(["a", "b", "c"], 300)
    same = (rng.random(900) < 0.6).astype(int)
    diff = (rng.random(900) < np.repeat([0.3, 0.6, 0.9], 300)).astype(int)
    clusters = np.arange(900) // 3
    assert rate_heterogeneity(same, g, clusters, 20)["p_value"] > 0.05
    r = rate_heterogeneity(diff, g, clusters, 20)
    assert r["p_value"] < 1e-6 and r["df"] == 2 and r["groups"] == 3
    tiny = rate_heterogeneity(diff, np.where(np.arange(900) < 5, "z", g), clusters, min_n=20)
    assert tiny["groups"] == 3  # the five-row group is left out
    assert np.isnan(rate_heterogeneity(same, ["a"] * 900, clusters, 20)["p_value"])


def test_wilson_z_follows_alpha():
    assert wilson_z(0.05) == pytest.approx(1.959964, abs=1e-6)
    assert wilson_z(0.1) == pytest.approx(1.644854, abs=1e-6)
    with pytest.raises(ValueError, match="alpha"):
        wilson_z(0)


def test_rate_figures_label_their_level():
    from rlxf_utils import plots
    from rlxf_utils.stats import rate_by

    df = _labelled()
    by_type = rate_by(df, "arrangement_type", z=wilson_z(0.1))
    fig = plots.rate_bars(by_type, "arrangement_type", "t", alpha=0.1)
    assert fig.axes[0].get_xlabel() == "MET rate (90% Wilson interval)"
    wide = rate_by(df, "arrangement_type", z=wilson_z(0.01))
    assert (wide["ci_high"] - wide["ci_low"] > by_type["ci_high"] - by_type["ci_low"]).all()
    by_year = rate_by(df, "test_year", z=wilson_z(0.01))
    fig = plots.rate_by_year(by_year, "t", cutoff=2010, alpha=0.01)
    assert fig.axes[0].get_ylabel() == "MET rate (99% Wilson interval)"


def test_the_report_phrases_the_findings_notebook_01_stored_as_numbers(tmp_path):
    from rlxf_utils.artifacts import ArtifactMissing, RunDir
    from rlxf_utils.report.data import data_section

    run = RunDir(tmp_path / "run")
    f = data_findings(_labelled(slope=-0.4), cutoff=2010, alpha=0.05, min_n=20)
    run.write_json("data/summary.json", {"findings": f})
    got = data_section(run)
    assert got == {
        "level": "95%",
        **findings_sentences(run.read_json("data/summary.json")["findings"]),
    }
    # a summary from before the verdict codes: the file, the missing fields and what to rerun
    stale = {**f, "trend": {k: v for k, v in f["trend"].items() if k != "verdict"}}
    run.write_json("data/summary.json", {"findings": stale})
    with pytest.raises(ArtifactMissing, match=r"summary\.json.*trend\.verdict.*rerun notebook 01"):
        data_section(run)
