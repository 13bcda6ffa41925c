"""Reward uncertainty: the encoder's features, the bootstrap heads, their cache and the summary."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
from test_alignment import _samples
from test_reward import _synthetic_conditions, _tiny_factory

from rlxf_utils.artifacts import RunDir
from rlxf_utils.config import EvaluationConfig, RewardConfig, load_config
from rlxf_utils.evaluation.figures import plot_reward_uncertainty
from rlxf_utils.evaluation.sampling import add_rewards
from rlxf_utils.evaluation.tables import summary_table
from rlxf_utils.prompts import serialize_frame
from rlxf_utils.reward.model import RewardModel, RewardModelError, output_layer, serialize_inputs
from rlxf_utils.reward.tfidf import train_tfidf
from rlxf_utils.reward.uncertainty import (
    FOLDER,
    MARKER,
    RewardHeads,
    RewardHeadsError,
    fit_or_load,
)

ROOT = Path(__file__).resolve().parent.parent
TEXTS = [
    "adopt the budget law",
    "privatize",
    "submit a new tax plan for the central bank of the new law",
    "reform pension arrears",
    "audit",
    "publish the plan to restructure the bank",
    "approve",
]


def _bert(seed: int = 0):
    torch.manual_seed(seed)
    return _tiny_factory(TEXTS)()


def _roberta_style(kind: str):
    """A RoBERTa or MPNet classifier (dense -> tanh -> out_proj head) on the tiny BERT vocabulary."""
    from transformers import (
        MPNetConfig,
        MPNetForSequenceClassification,
        RobertaConfig,
        RobertaForSequenceClassification,
    )

    _, tok = _bert()
    torch.manual_seed(1)
    size = dict(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                intermediate_size=64, max_position_embeddings=80, num_labels=2, pad_token_id=0)  # fmt: skip
    if kind == "roberta":
        return RobertaForSequenceClassification(RobertaConfig(**size)), tok
    return MPNetForSequenceClassification(MPNetConfig(**size)), tok


def _reward(model_tok, **kw) -> RewardModel:
    model, tok = model_tok
    return RewardModel(model, tok, 48, **{"temperature": 1.3, "bias": 0.2, "offset": -0.1, **kw})


@pytest.mark.parametrize("kind", ["bert", "roberta", "mpnet"])
def test_features_times_the_final_layer_reproduce_the_logits(kind: str) -> None:
    rm = _reward(_bert() if kind == "bert" else _roberta_style(kind))
    layer = output_layer(rm.model)
    assert layer is (rm.model.classifier if kind == "bert" else rm.model.classifier.out_proj)
    margins, feats = rm.margins_and_features(TEXTS, batch_size=3)  # 3 batches, length-sorted
    assert feats.shape == (len(TEXTS), 32) and feats.dtype == np.float64
    w = layer.weight.detach().double().numpy()
    b = layer.bias.detach().double().numpy()
    logits = feats @ w.T + b
    np.testing.assert_allclose(margins, logits[:, 1] - logits[:, 0] + rm.bias, atol=1e-5)
    assert np.array_equal(margins, rm.margins_texts(TEXTS, batch_size=3))  # one loop, one answer
    with torch.no_grad():  # and the features are the texts' own, not a neighbour's in the batch
        enc = rm.tokenizer(TEXTS[2], return_tensors="pt")
        direct = rm.model(**enc).logits[0].double().numpy()
    np.testing.assert_allclose(logits[2], direct, atol=1e-5)
    np.testing.assert_allclose(rm.score_texts(TEXTS), rm.calibrated(margins))
    m0, f0 = rm.margins_and_features([])
    assert m0.shape == (0,) and f0.shape == (0, 32)


def test_features_from_a_layer_that_does_not_make_the_logits_are_refused() -> None:
    from transformers.modeling_outputs import SequenceClassifierOutput

    rm = _reward(_bert())
    rm.model.register_forward_hook(
        lambda m, a, out: SequenceClassifierOutput(logits=out.logits + 1)
    )
    with pytest.raises(RewardModelError, match="did not produce the model's logits"):
        rm.margins_and_features(TEXTS)
    rm.margins_texts(TEXTS)  # scoring alone needs no features


def _noisy(n: int = 300, d: int = 6, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d))
    y = (rng.random(n) < 1 / (1 + np.exp(-x[:, 0]))).astype(int)
    return x, y


def test_one_head_has_no_spread_and_bootstrap_heads_disagree() -> None:
    x, y = _noisy()
    far = np.random.default_rng(5).normal(size=(50, 6)) * 4  # away from the training rows
    one = RewardHeads.fit(x, y, 1, seed=0)
    mean, sd = one.predict(far)
    assert one.n_heads == 1 and np.all(sd == 0) and mean.shape == (50,)
    many = RewardHeads.fit(x, y, 8, seed=0)
    mean, sd = many.predict(far)
    assert (sd > 0).all() and ((mean > 0) & (mean < 1)).all()
    assert np.ptp(many.coef, axis=0).min() > 0  # every coefficient differs across heads
    np.testing.assert_allclose(mean, many.probabilities(far).mean(axis=1))
    np.testing.assert_allclose(sd, many.probabilities(far).std(axis=1))
    again = RewardHeads.fit(x, y, 8, seed=0)
    assert np.array_equal(again.coef, many.coef)  # seeded
    assert not np.array_equal(RewardHeads.fit(x, y, 8, seed=1).coef, many.coef)
    near = x[:50]
    assert sd.mean() > many.predict(near)[1].mean()  # surer where the training rows are
    with pytest.raises(ValueError, match="both classes"):
        RewardHeads.fit(x, np.zeros(len(y), int), 2, seed=0)
    with pytest.raises(ValueError, match=r"features must be \(n, 6\)"):
        many.predict(far[:, :5])


def test_heads_round_trip_and_corrupt_folders_give_clear_errors(tmp_path: Path) -> None:
    x, y = _noisy()
    heads = RewardHeads.fit(x, y, 3, seed=0, settings={"heads": 3, "protocol": "grouped"},
                              row_ids=np.arange(len(y)) + 100)  # fmt: skip
    folder = heads.save(tmp_path / "u")
    back = RewardHeads.load(folder)
    assert back.settings == heads.settings and np.array_equal(back.row_ids, heads.row_ids)
    for a, b in zip(back.predict(x[:20]), heads.predict(x[:20]), strict=True):
        np.testing.assert_allclose(a, b)
    assert sorted(p.name for p in folder.iterdir()) == ["heads.npz", "rlxf_reward_heads.json"]
    marker = folder / "rlxf_reward_heads.json"
    good = json.loads(marker.read_text())
    marker.write_text("{ not json")
    with pytest.raises(RewardHeadsError, match=r"rlxf_reward_heads\.json: not valid JSON"):
        RewardHeads.load(folder)
    marker.write_text(json.dumps({**good, "kind": "rlxf-reward-encoder"}))
    with pytest.raises(RewardHeadsError, match="field 'kind' is 'rlxf-reward-encoder'"):
        RewardHeads.load(folder)
    marker.write_text(json.dumps({**good, "settings": None}))
    with pytest.raises(RewardHeadsError, match="field 'settings'"):
        RewardHeads.load(folder)
    marker.write_text(json.dumps({**good, "n_heads": 4}))
    with pytest.raises(RewardHeadsError, match=r"heads\.npz: coef \(3, 6\).*'n_heads'"):
        RewardHeads.load(folder)
    (folder / "heads.npz").unlink()
    with pytest.raises(RewardHeadsError, match=r"heads\.npz: missing"):
        RewardHeads.load(folder)


# ---------------------------------------------------------------------------------------------
# fit_or_load on a run dir
# ---------------------------------------------------------------------------------------------


def _run(tmp_path: Path) -> tuple[RunDir, pd.DataFrame, dict]:
    df = _synthetic_conditions(240, seed=3).assign(
        label=lambda d: np.where(d.y == 1, "MET", "Non-MET")
    )
    df["econ_area"] = "tax"
    ids = df["row_id"].tolist()
    splits = {
        "grouped": {"train": ids[:120], "val": ids[120:160], "test": ids[160:]},
        "random": {"train": ids[100:220], "val": ids[:50], "test": ids[220:]},
    }
    run = RunDir(tmp_path / "run")
    run.write_parquet("data/conditions.parquet", df)
    run.write_json("data/splits.json", splits)
    return run, df, splits


def _cfg(heads: int = 3, rows: int = 60, protocol: str = "grouped") -> SimpleNamespace:
    return SimpleNamespace(
        evaluation=SimpleNamespace(reward_heads=heads, reward_heads_rows=rows),
        reward=SimpleNamespace(reward_protocol=protocol, score_batch_size=16),
        run=SimpleNamespace(seed=0),
    )


def test_fit_or_load_reads_only_the_protocols_training_rows_and_refits_on_change(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    run, df, splits = _run(tmp_path)
    rm = _reward(_tiny_factory(serialize_frame(df))())
    seen: list[list[str]] = []
    real = rm.margins_and_features

    def spy(texts, batch_size=64, progress=False):
        seen.append(list(texts))
        return real(texts, batch_size, progress)

    monkeypatch.setattr(rm, "margins_and_features", spy)
    heads = fit_or_load(run, _cfg(), rm)
    assert heads.n_heads == 3 and len(heads.row_ids) == 60
    assert set(heads.row_ids) <= set(splits["grouped"]["train"])
    rows = df.set_index("row_id", drop=False).loc[heads.row_ids]
    assert seen == [serialize_frame(rows)]  # serialised as the reward model saw them in training
    assert (run.root / FOLDER / "rlxf_reward_heads.json").is_file()
    again = fit_or_load(run, _cfg(), rm)
    assert len(seen) == 1 and np.array_equal(again.coef, heads.coef)  # reused, not refitted
    assert fit_or_load(run, _cfg(heads=4), rm).n_heads == 4 and len(seen) == 2
    other = fit_or_load(run, _cfg(heads=4, protocol="random"), rm)
    assert len(seen) == 3 and set(other.row_ids) <= set(splits["random"]["train"])
    everything = fit_or_load(run, _cfg(heads=4, rows=500, protocol="random"), rm)
    assert sorted(everything.row_ids) == sorted(splits["random"]["train"])  # fewer rows than asked
    with torch.no_grad():  # a retrained reward model: new features, new heads
        output_layer(rm.model).weight.add_(0.01)
    fit_or_load(run, _cfg(heads=4, rows=500, protocol="random"), rm)
    assert len(seen) == 5
    (run.root / FOLDER / "rlxf_reward_heads.json").write_text("garbage")
    with caplog.at_level(logging.WARNING):
        fit_or_load(run, _cfg(heads=4, rows=500, protocol="random"), rm)
    assert len(seen) == 6 and "not valid JSON" in caplog.text
    with pytest.raises(KeyError, match="no 'temporal'.train"):
        fit_or_load(run, _cfg(protocol="temporal"), rm)
    assert fit_or_load(run, _cfg(heads=0), rm) is None
    audit = train_tfidf(serialize_frame(df), df["y"].astype(int), None, None,
                          RewardConfig(tfidf_min_df=1), 0)  # fmt: skip
    with caplog.at_level(logging.INFO):
        assert fit_or_load(run, _cfg(), audit) is None
    assert "no encoder features" in caplog.text and len(seen) == 6


def test_add_rewards_fills_reward_sd_from_the_scoring_pass() -> None:
    rm = _reward(_bert())
    x_texts = TEXTS * 6
    contexts = [{"country": "KENYA", "arrangement_type": "ECF", "econ_descriptor": "tax"},
                {"country": "PERU", "arrangement_type": "SBA", "econ_descriptor": "bank"}]  # fmt: skip
    df = pd.DataFrame({"prompt_id": [i % 2 for i in range(len(x_texts))], "response": x_texts})
    texts = serialize_inputs([contexts[i] for i in df["prompt_id"]], x_texts)
    _, feats = rm.margins_and_features(texts)
    y = np.random.default_rng(0).permutation(np.arange(len(x_texts)) % 2)  # noisy labels
    heads = RewardHeads.fit(feats, y, 4, seed=0)
    audit = SimpleNamespace(score=lambda ctx, t, batch_size=None: np.full(len(t), 0.5))
    out = add_rewards(df.copy(), contexts, rm, audit, 5, heads)
    np.testing.assert_allclose(
        out["reward"], rm.score([contexts[i] for i in df["prompt_id"]], x_texts)
    )
    # the same features up to float rounding of other batch paddings (batch 5 here, 64 there)
    np.testing.assert_allclose(out["reward_sd"], heads.predict(feats)[1], rtol=1e-4)
    assert (out["reward_sd"] > 0).all() and (out["audit_reward"] == 0.5).all()
    plain = add_rewards(df.copy(), contexts, rm, audit, 5)
    np.testing.assert_allclose(plain["reward"], out["reward"])
    assert plain["reward_sd"].isna().all()


# ---------------------------------------------------------------------------------------------
# summary table, figure and config
# ---------------------------------------------------------------------------------------------


def test_summary_table_carries_reward_sd_and_its_paired_change() -> None:
    samples = _samples(0.1)
    rng = np.random.default_rng(2)
    shift = samples["policy"].map({"base": 0.0, "ppo": 0.05, "best_of_n": 0.0})
    samples["reward_sd"] = 0.02 + shift + rng.normal(0, 0.002, len(samples))
    s, paired = summary_table(samples, ["base", "ppo"], "base", 4, 500, 0.05, 0)
    s = s.set_index("policy")
    cols = ["reward_sd", "reward_sd_low", "reward_sd_high", "sd_gain", "sd_gain_low",
            "sd_gain_high", "sd_gain_p_family"]  # fmt: skip
    assert set(cols) <= set(s.columns)
    assert s.loc["ppo", "reward_sd"] == pytest.approx(0.07, abs=0.002)
    assert s.loc["base", "reward_sd_low"] < 0.02 < s.loc["base", "reward_sd_high"]
    assert (
        s.loc["ppo", "sd_gain"] == pytest.approx(0.05, abs=0.002)
        and s.loc["ppo", "sd_gain_low"] > 0
    )
    assert abs(s.loc["best_of_n", "sd_gain"]) < 0.002 and s.loc["best_of_n", "sd_gain_low"] < 0
    assert set(paired["measure"]) == {"reward", "audit_reward", "gap", "reward_sd", "reward_finished", "audit_reward_finished", "finished_share"}  # fmt: skip
    assert (paired.loc[paired.measure == "reward_sd", "n_clusters"] == 10).all()
    fig = plot_reward_uncertainty(s.reset_index(), "base", 0.05)
    assert len(fig.axes[0].lines) > 0
    # without heads (TF-IDF reward or reward_heads 0) the columns are there and empty
    for frame in (samples.assign(reward_sd=np.nan), samples.drop(columns="reward_sd")):
        s0, p0 = summary_table(frame, ["base", "ppo"], "base", 4, 200, 0.05, 0)
        assert s0[cols].isna().all().all() and "reward_sd" not in set(p0["measure"])
        assert not plot_reward_uncertainty(s0, "base", 0.05).axes[0].lines


def test_reward_heads_params_are_validated_and_set_in_every_profile() -> None:
    assert EvaluationConfig().reward_heads == 10 and EvaluationConfig().reward_heads_rows == 2000
    with pytest.raises(ValueError, match="reward_heads"):
        EvaluationConfig(reward_heads=-1)
    with pytest.raises(ValueError, match="reward_heads_rows"):
        EvaluationConfig(reward_heads_rows=10)
    smoke = load_config(ROOT / "params/smoke.yaml").evaluation
    default = load_config(ROOT / "params/default.yaml").evaluation
    assert 0 < smoke.reward_heads <= default.reward_heads
    assert smoke.reward_heads_rows < default.reward_heads_rows


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------


def _sd_samples(shift: float) -> pd.DataFrame:
    samples = _samples(0.1)
    rng = np.random.default_rng(2)
    move = samples["policy"].map({"base": 0.0, "ppo": shift, "best_of_n": 0.0})
    return samples.assign(reward_sd=0.02 + move + rng.normal(0, 0.002, len(samples)))


def _report_run(tmp_path: Path, samples: pd.DataFrame, heads: bool) -> RunDir:
    run = RunDir(tmp_path / "run")
    summary, paired = summary_table(samples, ["base", "ppo"], "base", 4, 300, 0.05, 0)
    run.write_json("eval/summary.json", {
        "algorithms": ["ppo"], "start_policy": "base", "alpha": 0.05, "n_prompts": 30,
        "samples_per_prompt": 3, "best_of_n": 4, "summary": summary.to_dict("records")})  # fmt: skip
    run.write_table("eval_paired", paired)
    run.write_table("eval_table3", pd.DataFrame(
        {"prompt": ["p"], "policy": ["ppo"], "response": ["r"], "reward": [0.5]}))  # fmt: skip
    if heads:
        x, y = _noisy()
        RewardHeads.fit(x, y, 3, 0, settings={"n_rows": 300}).save(run.path(FOLDER))
    return run


def test_report_gives_reward_sd_beside_ave_r_and_a_verdict_from_its_interval(tmp_path) -> None:
    from rlxf_utils.report.evaluation import eval_section, uncertainty_context
    from rlxf_utils.stats import bound_verdict

    run = _report_run(tmp_path / "up", _sd_samples(0.05), heads=True)
    v, inc = eval_section(run)
    header = inc["eval_summary.md"].splitlines()[0]
    assert header.index(r"Ave(R) \[95% CI\]") < header.index(r"reward SD \[95% CI\]")
    s = pd.DataFrame(run.read_json("eval/summary.json")["summary"]).set_index("policy")
    c = uncertainty_context(s, ["ppo"], "base", "95%", run.read_json(f"{FOLDER}/{MARKER}"))
    assert c["heads"] == {"n": 3, "rows": 300} and [p["policy"] for p in c["policies"]] == ["ppo"]
    for shift, verdict in ((0.05, "above"), (-0.01, "below"), (0.0, "not distinguishable")):
        s, _ = summary_table(_sd_samples(shift), ["base", "ppo"], "base", 4, 300, 0.05, 0)
        change = uncertainty_context(s.set_index("policy"), ["ppo"], "base", "95%", None)["policies"][0]["change"]  # fmt: skip
        assert bound_verdict(change["low"], change["high"]) == verdict
    run = _report_run(tmp_path / "none", _samples(0.1), heads=False)
    v, inc = eval_section(run)
    s = pd.DataFrame(run.read_json("eval/summary.json")["summary"]).set_index("policy")
    assert not uncertainty_context(s, ["ppo"], "base", "95%", None)["measured"]
    row = next(r for r in inc["eval_summary.md"].splitlines() if r.startswith("| PPO "))
    assert row.split("|")[4].strip() == "·"  # policy, prompts, Ave(R), reward SD
