"""Tests of the reward room: shared serialisation, metrics, calibration, save/load, audit model."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from sklearn import metrics as skm
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import LogisticRegression

from rlxf_utils.config import RewardConfig
from rlxf_utils.prompts import serialize_frame
from rlxf_utils.reward.bundle import load_reward, save_reward_bundle, train_disjoint_audit
from rlxf_utils.reward.calibration import (
    calibration_report,
    classification_metrics,
    expected_calibration_error,
    fit_platt,
    prior_bias,
)
from rlxf_utils.reward.model import RewardModel, RewardModelError, serialize_inputs
from rlxf_utils.reward.protocol import run_protocol, split_validation
from rlxf_utils.reward.tables import accuracy_table, comparison_tables, reference_check_table
from rlxf_utils.reward.tfidf import TfidfAuditModel, train_tfidf
from rlxf_utils.reward.training import train_encoder

os.environ.setdefault("HF_HUB_OFFLINE", "1")

WORDS_MET = ["adopt", "budget", "submit", "publish", "approve", "audit"]
WORDS_NOT = ["privatize", "restructure", "liquidate", "reform", "pension", "arrears"]
FILLER = ["the", "of", "to", "plan", "law", "bank", "central", "tax", "for", "new"]


def _synthetic_conditions(n: int = 240, seed: int = 0) -> pd.DataFrame:
    """Conditions whose label is carried by the text (a MET word vs a Non-MET word) plus noise."""
    rng = np.random.default_rng(seed)
    y = (rng.random(n) < 0.6).astype(int)
    texts = []
    for yi in y:
        key = rng.choice(WORDS_MET if yi else WORDS_NOT)
        filler = list(rng.choice(FILLER, size=rng.integers(2, 8)))
        filler.insert(int(rng.integers(0, len(filler) + 1)), key)
        texts.append(" ".join(filler))
    return pd.DataFrame(
        {
            "row_id": np.arange(n),
            "country": rng.choice(["KENYA", "GHANA", "PERU"], n),
            "arrangement_type": rng.choice(["ECF", "SBA"], n),
            "econ_descriptor": rng.choice(["1.1. Tax policy", "2.3. Central bank"], n),
            "arrangement_id": rng.integers(0, 30, n).astype(str),
            "description": texts,
            "status": np.where(y == 1, "M", "NM"),
            "comments": "SECRET-OUTCOME-NOTE",
            "y": pd.array(y, dtype="Int64"),
        }
    )


def _tiny_factory(texts: list[str]):
    """A 2-layer BERT from a BertConfig and a WordPiece tokenizer over the corpus' own words."""
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizer

    words = sorted(
        {
            w
            for t in texts
            for w in t.lower().replace(".", " . ").replace(":", " : ").replace(",", " , ").split()
        }
    )
    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words])}

    def factory():
        tok = BertTokenizer(vocab=vocab)
        cfg = BertConfig(
            vocab_size=len(vocab),
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=128,
            num_labels=2,
        )
        return BertForSequenceClassification(cfg), tok

    return factory


def _cfg(**kw) -> RewardConfig:
    base = dict(
        epochs=4,
        batch_size=16,
        learning_rate=3e-3,
        warmup_ratio=0.1,
        max_length=48,
        freeze_embeddings=False,
        early_stopping_patience=None,
        progress=False,
        num_threads=1,
        tfidf_min_df=1,
    )
    base.update(kw)
    return RewardConfig(**base)


# --------------------------------------------------------------------------------------------
def test_serialisation_is_shared_and_excludes_outcome_fields():
    df = _synthetic_conditions(20)
    texts = serialize_inputs(df, df["description"].tolist())
    assert texts == serialize_frame(df)
    records = df.to_dict("records")  # whole rows, outcome fields included, must not leak
    assert serialize_inputs(records, df["description"].tolist()) == texts
    # flipping every outcome field leaves the model input unchanged, while a context field does not
    flipped = df.assign(
        status=np.where(df["status"] == "M", "NM", "M"), comments="other", y=1 - df["y"]
    )
    assert serialize_inputs(flipped.to_dict("records"), df["description"].tolist()) == texts
    assert serialize_inputs(df.assign(country="CHILE"), df["description"].tolist()) != texts
    with pytest.raises(ValueError, match="one text per context"):
        serialize_inputs(df, df["description"].tolist()[:-1])
    with pytest.raises(KeyError, match="country"):
        serialize_inputs(df.drop(columns="country"), df["description"].tolist())


def test_metrics_agree_with_sklearn():
    rng = np.random.default_rng(1)
    y = rng.integers(0, 2, 500)
    p = np.clip(0.3 * y + 0.7 * rng.random(500), 0.01, 0.99)
    m = classification_metrics(y, p)
    pred = (p >= 0.5).astype(int)
    assert m["accuracy"] == pytest.approx(skm.accuracy_score(y, pred))
    assert m["precision"] == pytest.approx(skm.precision_score(y, pred))
    assert m["recall"] == pytest.approx(skm.recall_score(y, pred))
    assert m["f1"] == pytest.approx(skm.f1_score(y, pred))
    assert m["macro_f1"] == pytest.approx(skm.f1_score(y, pred, average="macro"))
    assert m["roc_auc"] == pytest.approx(skm.roc_auc_score(y, p))
    assert m["brier"] == pytest.approx(skm.brier_score_loss(y, p))
    assert m["nll"] == pytest.approx(skm.log_loss(y, p))
    # ECE by hand: two bins, each off by a known amount
    y2 = np.array([1, 0, 0, 0, 1, 1, 1, 0])
    p2 = np.array([0.2, 0.2, 0.2, 0.2, 0.9, 0.9, 0.9, 0.9])
    assert expected_calibration_error(y2, p2, n_bins=10) == pytest.approx(0.5 * 0.05 + 0.5 * 0.15)


def test_platt_scaling_undoes_overconfidence_and_a_shifted_prior():
    rng = np.random.default_rng(2)
    z = rng.normal(0, 1.5, 4000)
    y = (rng.random(4000) < 1 / (1 + np.exp(-z))).astype(int)
    margin = 4.0 * z + 1.5  # four times too confident and shifted towards MET
    t, offset = fit_platt(margin, y)
    assert 3.5 < t < 4.5 and offset == pytest.approx(-1.5 / t, abs=0.1)
    rep = calibration_report(margin, y, t, offset)
    assert rep["nll_after"] < rep["nll_before"] - 0.05
    assert rep["ece_after"] < rep["ece_before"] / 3
    assert rep["brier_after"] < rep["brier_before"]
    assert fit_platt(margin, np.ones_like(y)) == (1.0, 0.0)  # one class: nothing to fit


def test_validation_split_keeps_arrangements_whole_and_classes_stratified():
    df = _synthetic_conditions(200, seed=4)
    sel, cal = split_validation(df, "grouped", seed=0)
    assert set(sel["row_id"]).isdisjoint(cal["row_id"]) and len(sel) + len(cal) == len(df)
    assert set(sel["arrangement_id"]).isdisjoint(cal["arrangement_id"])
    assert 0.35 < len(cal) / len(df) < 0.65
    sel, cal = split_validation(df, "random", seed=0)
    y = df["y"].astype(int)
    assert abs(int(cal["y"].sum()) - y.sum() / 2) <= 1 and abs(len(cal) - len(df) / 2) <= 1
    with pytest.raises(ValueError, match="selection and a calibration half"):
        split_validation(df.iloc[:1], "random", seed=0)


def test_prior_bias_undoes_balanced_weighting():
    y = np.array([1] * 75 + [0] * 25)
    assert prior_bias(y, RewardConfig(class_weighting="balanced")) == pytest.approx(np.log(3.0))
    assert prior_bias(y, RewardConfig(class_weighting="none")) == 0.0


def test_tiny_bert_trains_saves_reloads_and_scores_identically(tmp_path: Path):
    df = _synthetic_conditions(240)
    texts = serialize_frame(df)
    y = df["y"].astype(int).to_numpy()
    factory = _tiny_factory(texts)
    cfg = _cfg()
    rm, log = train_encoder(
        texts[:160], y[:160], texts[160:180], y[160:180], cfg, seed=7, model_factory=factory,
        cal_texts=texts[180:200], cal_y=y[180:200],
    )  # fmt: skip
    assert len(log) >= 1 and {"epoch", "val_roc_auc", "train_seconds"} <= set(log.columns)
    assert rm.meta["calibration"]["slice"] == "calibration" and rm.meta["calibration"]["n"] == 20
    p = rm.score(df.iloc[200:], df["description"].iloc[200:].tolist(), batch_size=7)
    assert p.shape == (40,) and np.all((p > 0) & (p < 1))
    assert skm.roc_auc_score(y[200:], p) > 0.8  # the signal word is learnable in a few steps
    # batch size and order do not change scores (dynamic padding is masked out)
    np.testing.assert_allclose(rm.score_texts(texts[200:], batch_size=40), p, atol=1e-5)
    out = rm.save(tmp_path / "rm")
    assert (out / "model.safetensors").is_file() and (out / "calibration.json").is_file()
    assert not list(out.glob("*.bin")) and not list(out.glob("*.pkl"))
    again = RewardModel.load(out, device="cpu")
    assert again.temperature == pytest.approx(rm.temperature) and again.bias == pytest.approx(
        rm.bias
    )
    assert again.offset == pytest.approx(rm.offset) and rm.offset != 0.0
    np.testing.assert_allclose(again.score_texts(texts[200:], batch_size=7), p, atol=1e-6)


def test_audit_model_round_trips_through_json_and_npz(tmp_path: Path):
    df = _synthetic_conditions(200, seed=3)
    texts = serialize_frame(df)
    y = df["y"].astype(int).to_numpy()
    cfg = _cfg(class_weighting="none")
    audit = train_tfidf(texts[:150], y[:150], texts[150:170], y[150:170], cfg, seed=0)
    # the rebuilt scorer equals scikit-learn's own pipeline (before temperature)
    vec = TfidfVectorizer(ngram_range=(1, 2), min_df=1, max_features=50000, sublinear_tf=True)
    lr = LogisticRegression(C=1.0, max_iter=2000, random_state=0).fit(
        vec.fit_transform(texts[:150]), y[:150]
    )
    np.testing.assert_allclose(
        audit.margins_texts(texts[170:]),
        lr.decision_function(vec.transform(texts[170:])),
        atol=1e-8,
    )
    audit.save(tmp_path / "audit")
    assert sorted(p.name for p in (tmp_path / "audit").iterdir()) == [
        "arrays.npz",
        "rlxf_audit.json",
    ]
    again = TfidfAuditModel.load(tmp_path / "audit")
    np.testing.assert_allclose(
        again.score(df.iloc[170:], df["description"].iloc[170:].tolist()),
        audit.score_texts(texts[170:]),
        atol=1e-12,
    )
    assert skm.roc_auc_score(y[170:], again.score_texts(texts[170:])) > 0.8


def test_corrupt_or_foreign_folders_give_clear_errors(tmp_path: Path):
    with pytest.raises(RewardModelError, match="not a folder"):
        RewardModel.load(tmp_path / "nope")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "config.json").write_text("{}")
    with pytest.raises(RewardModelError, match="rlxf_reward.json"):
        RewardModel.load(foreign)
    (foreign / "rlxf_reward.json").write_text(
        json.dumps({"kind": "something-else", "format_version": 1})
    )
    with pytest.raises(RewardModelError, match="expected 'rlxf-reward-encoder'"):
        RewardModel.load(foreign)
    (foreign / "rlxf_reward.json").write_text("{not json")
    with pytest.raises(RewardModelError, match="not valid JSON"):
        RewardModel.load(foreign)
    marker = {
        "kind": "rlxf-reward-encoder",
        "format_version": 1,
        "max_length": 32,
        "temperature": 1.0,
    }
    (foreign / "rlxf_reward.json").write_text(json.dumps(marker))
    with pytest.raises(RewardModelError, match="safetensors"):
        RewardModel.load(foreign)
    (foreign / "model.safetensors").write_bytes(b"garbage" * 10)
    with pytest.raises(RewardModelError, match="could not load"):
        RewardModel.load(foreign)
    # audit: corrupt arrays
    audit = tmp_path / "audit"
    audit.mkdir()
    (audit / "rlxf_audit.json").write_text(
        json.dumps(
            {
                "kind": "rlxf-tfidf-audit",
                "format_version": 1,
                "vectorizer_params": {},
                "vocabulary": {},
                "temperature": 1.0,
            }
        )
    )
    (audit / "arrays.npz").write_bytes(b"not an npz")
    with pytest.raises(RewardModelError, match="arrays.npz"):
        TfidfAuditModel.load(audit)
    with pytest.raises(RewardModelError, match="bundle.json"):
        load_reward(tmp_path)


def test_run_protocol_and_bundle(tmp_path: Path):
    df = _synthetic_conditions(240, seed=5)
    ids = df["row_id"].tolist()
    splits = {"random": {"train": ids[:150], "val": ids[150:180], "test": ids[180:]}}
    cfg = _cfg(epochs=2, protocols=["random"], reward_protocol="random")
    res = run_protocol(
        df, splits, "random", cfg, seed=0, model_factory=_tiny_factory(serialize_frame(df))
    )
    assert set(res.metrics["model"]) == {
        "majority",
        "tfidf",
        "context_only",
        "text_only",
        "encoder",
    }
    assert len(res.predictions) == 60 and res.predictions["p_encoder"].between(0, 1).all()
    table = accuracy_table([res])
    assert list(table.columns) == ["protocol", "paper_claim", "majority", "tfidf_lr", "encoder"]
    assert table.loc[0, "majority"] == pytest.approx(
        max(res.predictions["y"].mean(), 1 - res.predictions["y"].mean())
    )
    # both models are Platt-scaled on the calibration half only, which chose no checkpoint
    va = df.set_index("row_id", drop=False).loc[ids[150:180]].reset_index(drop=True)
    sel, cal = split_validation(va, "random", seed=0)
    assert (res.extra["n_selection"], res.extra["n_calibration"]) == (len(sel), len(cal))
    y_cal = cal["y"].astype(int).to_numpy()
    for scorer in (res.encoder, res.audit):
        t, off = fit_platt(scorer.margins_texts(serialize_frame(cal)), y_cal)
        assert scorer.temperature == pytest.approx(t, rel=1e-5)
        assert scorer.offset == pytest.approx(off, abs=1e-5)
    cal_row = res.calibration.set_index("model").loc["encoder"]
    assert cal_row["n_calibration"] == len(cal) and cal_row["method"] == "platt"
    assert cal_row["ece_verdict"] in {"above", "below", "not distinguishable"}  # verdict codes
    assert cal_row["ece_diff_low"] <= cal_row["ece_diff_high"]
    # every metric carries an interval; comparisons are paired on the same test rows
    m = res.metrics.set_index("model")
    assert ((m["accuracy_low"] <= m["accuracy"]) & (m["accuracy"] <= m["accuracy_high"])).all()
    assert m.loc["majority", "auc_within_context"] == pytest.approx(0.5)  # a constant ranks nothing
    assert {"encoder vs TF-IDF", "encoder calibrated vs raw"} <= set(res.comparisons["comparison"])
    # an outcome column as the text the models read is refused before anything is trained
    with pytest.raises(ValueError, match="outcome fields"):
        run_protocol(df, splits, "random", cfg, seed=0, text_column="comments")
    # the disjoint-rows audit: trained on held-out rows only (data/holdout.json)
    df.loc[df["row_id"] < 180, "description"] += " rewardonly"  # a token only training rows carry
    h = {"reference": ids[180:210], "audit_train": ids[210:232], "audit_val": ids[232:]}
    audit = train_disjoint_audit(df, h, cfg, seed=0)
    assert audit.meta["n_train"] == 22 and audit.meta["trained_on"].endswith("audit_train")
    assert not any("rewardonly" in w for w in audit.vocabulary)  # never saw a reward row
    save_reward_bundle(tmp_path / "reward_model", res, "encoder", audit)
    reward, aud = load_reward(tmp_path / "reward_model")
    assert isinstance(reward, RewardModel) and isinstance(aud, TfidfAuditModel)
    np.testing.assert_allclose(
        reward.score(df.iloc[180:], df["description"].iloc[180:].str.replace(" rewardonly", "").tolist()),
        res.predictions["p_encoder"],
        atol=1e-5,
    )  # fmt: skip
    texts = df["description"].iloc[180:].tolist()
    np.testing.assert_allclose(aud.score(df.iloc[180:], texts), audit.score(df.iloc[180:], texts))
    save_reward_bundle(tmp_path / "tfidf_bundle", res, "tfidf", audit)
    reward, aud = load_reward(tmp_path / "tfidf_bundle")
    assert reward.meta["n_train"] == 150 and aud.meta["n_train"] == 22  # scorer vs audit
    check = reference_check_table(df, h, res, audit, n_boot=100, alpha=0.1, seed=0)
    assert list(check["model"]) == [
        "encoder (protocol train rows)", "tfidf (protocol train rows)", "audit (disjoint rows)"
    ]  # fmt: skip
    assert (check["rows"] == 30).all() and check["auc"].between(0, 1).all()
    assert (check["auc_low"] <= check["auc"]).all() and (check["auc"] <= check["auc_high"]).all()
    with pytest.raises(ValueError, match="nested"):
        reference_check_table(df, {**h, "reference": ids[:10]}, res, audit, 10, 0.1, 0)
    bad = {"random": {"train": [999_999], "val": [], "test": []}}
    with pytest.raises(KeyError, match="random.train"):
        run_protocol(df, bad, "random", cfg, seed=0, train_encoder_model=False)


def test_reward_config_rejects_bad_values():
    with pytest.raises(ValueError, match="reward_protocol"):
        RewardConfig(protocols=["random"], reward_protocol="grouped")
    with pytest.raises(ValueError, match="extra"):
        RewardConfig(lr=1e-4)
    with pytest.raises(ValueError):
        RewardConfig(reward_source="gpt")


def test_freeze_layers_beyond_depth_is_a_clear_error():
    df = _synthetic_conditions(40)
    texts = serialize_frame(df)
    y = df["y"].astype(int).to_numpy()
    with pytest.raises(ValueError, match="freeze_layers is 5 but the encoder has 2 layers"):
        train_encoder(
            texts[:30],
            y[:30],
            texts[30:],
            y[30:],
            _cfg(freeze_layers=5),
            0,
            model_factory=_tiny_factory(texts),
        )


def test_report_reward_section_words_follow_the_intervals(tmp_path: Path):
    """The report's reward verdicts are read from the interval verdicts, never from point estimates."""
    from rlxf_utils.artifacts import ArtifactMissing, RunDir
    from rlxf_utils.report.reward import reward_section

    df = _synthetic_conditions(240, seed=6)
    ids = df["row_id"].tolist()
    splits = {
        p: {"train": ids[:150], "val": ids[150:180], "test": ids[180:]}
        for p in ("random", "grouped")
    }
    cfg = _cfg(protocols=["random", "grouped"], reward_protocol="grouped", reward_source="tfidf")
    results = [
        run_protocol(df, splits, p, cfg, 0, train_encoder_model=False, n_boot=200, boot_seed=i)
        for i, p in enumerate(("random", "grouped"))
    ]
    comparisons, diffs = comparison_tables(results, alpha=0.05)
    calibration = pd.concat([r.calibration.assign(protocol=r.protocol) for r in results])
    run = RunDir(tmp_path / "run")
    meta = {
        "reward_source": "tfidf", "reward_protocol": "grouped", "alpha": 0.1, "n_boot": 200,
        "metrics": pd.concat([r.metrics for r in results]).to_dict("records"),
        "comparisons": comparisons.to_dict("records"),
        "protocol_differences": diffs.to_dict("records"),
    }  # fmt: skip
    words = {
        "below": "lowered",
        "above": "raised",
        "not distinguishable": "did not significantly change",
    }
    for verdict, word in words.items():
        cal = calibration.assign(ece_verdict=verdict)
        run.write_json("reward/metrics.json", {**meta, "calibration": cal.to_dict("records")})
        variables, tables = reward_section(run)
        assert variables["calibration_verdict"] == word
    assert variables["level"] == "90%" and "90% CI" in tables["reward_tests.md"]
    assert "no encoder was trained" in variables["encoder_vs_tfidf"]
    moves = {
        "below": "falls",
        "above": "rises",
        "not distinguishable": "does not change significantly",
    }
    for verdict, move in moves.items():
        d = diffs.assign(verdict=verdict).to_dict("records")
        run.write_json(
            "reward/metrics.json",
            {**meta, "calibration": cal.to_dict("records"), "protocol_differences": d},
        )
        sentence = reward_section(run)[0]["protocol_sentence"]
        assert f"{move} under the grouped protocol" in sentence
    run.write_json("reward/metrics.json", {k: v for k, v in meta.items() if k != "comparisons"})
    with pytest.raises(ArtifactMissing, match="comparisons"):
        reward_section(run)


def test_a_save_killed_halfway_leaves_the_old_model_whole(tmp_path: Path, monkeypatch):
    """A rerun that dies while saving leaves the previous model as it was (not its marker beside
    half-written arrays) and no temporary folder behind."""
    df = _synthetic_conditions(200, seed=3)
    texts, y = serialize_frame(df), df["y"].astype(int).to_numpy()
    cfg = _cfg(class_weighting="none")
    old = train_tfidf(texts[:150], y[:150], texts[150:170], y[150:170], cfg, seed=0)
    old.save(tmp_path / "audit")
    before = {p.name: p.read_bytes() for p in (tmp_path / "audit").iterdir()}
    new = train_tfidf(texts[:120], y[:120], texts[150:170], y[150:170], cfg, seed=1)

    def dies(fh, **arrays):
        fh.write(b"half")
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr("rlxf_utils.reward.tfidf.np.savez", dies)
    with pytest.raises(KeyboardInterrupt):
        new.save(tmp_path / "audit")
    assert {p.name: p.read_bytes() for p in (tmp_path / "audit").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["audit"]
    np.testing.assert_allclose(TfidfAuditModel.load(tmp_path / "audit").margins_texts(texts[170:]),
                               old.margins_texts(texts[170:]))  # fmt: skip
