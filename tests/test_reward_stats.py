"""Bootstrap intervals and verdicts of the reward model's test metrics (rlxf_utils.reward.statistics, rlxf_utils.stats.weighted)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from sklearn import metrics as skm

from rlxf_utils.reward.calibration import classification_metrics, expected_calibration_error
from rlxf_utils.reward.statistics import protocol_differences, protocol_statistics
from rlxf_utils.stats import (
    bootstrap_weights,
    level,
    weighted_auc,
    weighted_ece,
    weighted_rates,
    within_group_auc,
)


def _scores(n: int = 300, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    p = np.round(np.clip(0.3 * y + 0.7 * rng.random(n), 0, 1), 2)  # rounded: ties happen
    return y, p


def test_weighted_statistics_equal_sklearn_on_the_resampled_rows():
    y, p = _scores()
    w = bootstrap_weights(len(y), 4, seed=3)
    w = np.vstack([np.ones(len(y)), w])  # unit weights, then four bootstrap draws
    auc, ece = weighted_auc(w, y, p), weighted_ece(w, y, p)
    rates = weighted_rates(w, y, p)
    for k in range(len(w)):
        rows = np.repeat(np.arange(len(y)), w[k].astype(int))
        assert auc[k] == pytest.approx(skm.roc_auc_score(y[rows], p[rows]))
        assert ece[k] == pytest.approx(expected_calibration_error(y[rows], p[rows]))
        m = classification_metrics(y[rows], p[rows])
        for key in ("accuracy", "precision", "recall", "f1"):
            assert rates[key][k] == pytest.approx(m[key])


def test_cluster_bootstrap_draws_whole_clusters():
    clusters = np.repeat(["a", "b", "c", "d"], [1, 2, 3, 4])
    w = bootstrap_weights(len(clusters), 200, seed=0, clusters=clusters)
    for c in "abcd":
        cols = w[:, clusters == c]
        assert (cols == cols[:, :1]).all()  # one count per cluster and draw
    assert (w[:, clusters == "a"].sum(axis=1) + w[:, clusters != "a"].sum(axis=1) > 0).all()
    assert set(np.unique(w[:, 0])) > {0.0, 1.0}  # some draws repeat a cluster
    with pytest.raises(ValueError, match="cluster labels"):
        bootstrap_weights(3, 10, 0, clusters=["a"])


def test_within_group_auc_weights_groups_by_their_pairs():
    # group a: 1 pair ranked right (AUC 1); group b: 9 pairs all ranked wrong (AUC 0);
    # group c holds one class and has no pairs. Pair-weighted: 1/10, not the mean 0.5.
    y = [1, 0, 1, 1, 1, 0, 0, 0, 1, 1]
    p = [0.9, 0.1, 0.1, 0.2, 0.3, 0.7, 0.8, 0.9, 0.5, 0.6]
    g = ["a", "a", "b", "b", "b", "b", "b", "b", "c", "c"]
    r = within_group_auc(y, p, g, n_boot=500, seed=0)
    assert r["auc"] == pytest.approx(0.1)
    assert (r["n_groups"], r["n_pairs"]) == (2, 10)
    # resampling the two groups gives all-a (1), all-b (0) or a mix: the interval spans them
    assert r["low"] == pytest.approx(0.0) and r["high"] == pytest.approx(1.0)
    # a score that knows only each group's base rate ranks nothing within a group
    yy, _ = _scores(400, seed=1)
    gg = np.repeat(np.arange(8), 50)
    base = pd.Series(yy).groupby(gg).transform("mean").to_numpy()
    assert within_group_auc(yy, base, gg, n_boot=200)["auc"] == pytest.approx(0.5)
    none = within_group_auc([1, 1], [0.2, 0.3], ["a", "b"])
    assert np.isnan(none["auc"]) and none["n_groups"] == 0


def _pred(n: int = 600, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    z = rng.normal(0, 1, n)
    good = 1 / (1 + np.exp(-3 * z))  # calibrated and sharp: y is drawn from it
    y = (rng.random(n) < good).astype(int)
    weak = 1 / (1 + np.exp(-(0.3 * z + rng.normal(0, 1, n))))  # little signal
    return pd.DataFrame(
        {
            "y": y,
            "arrangement_id": rng.integers(0, 60, n).astype(str),
            "country": rng.choice(["A", "B", "C"], n),
            "arrangement_type": rng.choice(["ECF", "SBA"], n),
            "econ_descriptor": rng.choice(["tax", "bank"], n),
            "p_encoder": good,
            "p_encoder_raw": 1 / (1 + np.exp(-3 * z - 1.5)),  # the same ranking, shifted
            "p_tfidf": weak,
            "p_tfidf_raw": weak,
        }
    )


def test_protocol_statistics_calls_clear_differences_and_not_ties():
    pred = _pred()
    table, comp, acc = protocol_statistics(
        pred, ["encoder", "tfidf", "encoder_raw", "tfidf_raw"], n_boot=400, alpha=0.05, seed=1
    )
    c = comp.set_index(["comparison", "measure"])
    assert c.loc[("encoder vs TF-IDF", "accuracy"), "verdict"] == "above"
    assert c.loc[("encoder vs TF-IDF", "roc_auc"), "verdict"] == "above"
    assert c.loc[("encoder calibrated vs raw", "ece"), "verdict"] == "below"
    tie = c.loc[("TF-IDF calibrated vs raw", "ece")]  # the same scores: a difference of exactly 0
    assert (tie["diff"], tie["diff_low"], tie["diff_high"]) == (0.0, 0.0, 0.0)
    assert tie["verdict"] == "not distinguishable"
    enc = table.set_index("model").loc["encoder"]
    assert enc["accuracy_low"] < enc["accuracy_high"] and enc["n_context_groups"] >= 2
    assert set(acc) == {"encoder", "tfidf", "encoder_raw", "tfidf_raw"}
    assert len(acc["encoder"]) == 400
    # at a looser alpha the interval is narrower
    t90, _, _ = protocol_statistics(pred, ["encoder"], n_boot=400, alpha=0.2, seed=1)
    assert t90.loc[0, "accuracy_high"] - t90.loc[0, "accuracy_low"] < (
        enc["accuracy_high"] - enc["accuracy_low"]
    )


def test_protocol_differences_compare_against_the_first_protocol():
    a, b = _pred(seed=0), _pred(seed=1)
    b["p_encoder"] = b["p_tfidf"]  # the encoder is much weaker under the second protocol
    reps, points = {}, {}
    for name, pred in (("random", a), ("grouped", b)):
        _, _, reps[name] = protocol_statistics(pred, ["encoder", "tfidf"], n_boot=300, seed=2)
        points[name] = {
            m: classification_metrics(pred["y"], pred[f"p_{m}"])["accuracy"]
            for m in ("encoder", "tfidf")
        }
    d = protocol_differences(reps, points, alpha=0.05).set_index("model")
    assert (d["reference"] == "random").all() and (d["protocol"] == "grouped").all()
    assert d.loc["encoder", "verdict"] == "below"
    assert d.loc["tfidf", "verdict"] == "not distinguishable"  # the same kind of model both times


def test_level_follows_alpha():
    assert level(0.05) == "95%" and level(0.1) == "90%" and level(0.01) == "99%"
    assert level(0.025) == "97.5%"
    with pytest.raises(ValueError, match="alpha"):
        level(1.5)
