"""KTO, DPO and rejection-sampling fine-tuning (`rl.offline`) on a tiny model built from a config:
one short run learns what each is given; the data each is built from; TRL's token ids checked."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from test_ppo import small_cfg, tiny_tokenizer
from tiny import tiny_llama

from rlxf_utils.algorithms import ALGORITHMS, OFFLINE_ALGORITHMS
from rlxf_utils.config import LoraSettings, OfflineConfig, PolicyConfig, load_config
from rlxf_utils.models.generation import encode_prompts
from rlxf_utils.models.logprobs import sequence_logprobs
from rlxf_utils.rl import offline
from rlxf_utils.rl.core import LOG_COLUMNS, prompt_schedule
from rlxf_utils.rl.history_pairs import history_pairs
from rlxf_utils.rl.trainer import TrainJob

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parents[1]
LORA = LoraSettings(rank=4, alpha=8, target_modules=["q_proj", "v_proj"])
# prompts end in a space: TRL tokenises prompt + completion as one string, like the chat
# template's "assistant\n" ending of the real prompts
PROMPTS = ["w11 w12 ", "w13 w14 ", "w15 w16 ", "w17 w18 "]
GOOD, BAD = "w20 w21 w22", "w30 w31 w32"


def _job(tmp_path, algo, steps=2, **rl):
    tok = tiny_tokenizer()
    model = tiny_llama(tok, 0, init=0.3)
    cfg = small_cfg(steps=steps, batch_size=8, minibatch_size=4, update_epochs=1,
                    learning_rate=1e-2, checkpoint_every=1, **rl)  # fmt: skip
    contexts = [{"country": f"C{i}", "arrangement_type": "SBA", "econ_descriptor": "1.1"}
                for i in range(len(PROMPTS))]  # fmt: skip
    job = TrainJob(algo, model, tok, PROMPTS, contexts, None, cfg, PolicyConfig(lora=LORA),
                   tmp_path / algo, seed=0, progress=False)  # fmt: skip
    return job


def _gain(out: Path, prompts, texts) -> np.ndarray:
    """log pi(text | prompt) - log pi_ref(text | prompt) under the saved adapter (LoRA off:
    the start policy, the reference)."""
    from peft import PeftModel

    tok = tiny_tokenizer()
    model = PeftModel.from_pretrained(tiny_llama(tok, 0, init=0.3), str(out / "adapter"))
    lp, _ = sequence_logprobs(model, tok, prompts, texts, append_eos=True, padding_side="left")
    with model.disable_adapter():
        ref, _ = sequence_logprobs(model, tok, prompts, texts, append_eos=True, padding_side="left")
    return lp - ref


def _ids(tok, prompts, texts):
    p = [tok(x, add_special_tokens=False)["input_ids"] for x in prompts]
    t = [[*tok(x, add_special_tokens=False)["input_ids"], tok.eos_token_id] for x in texts]
    return p, t


def test_registry_and_config_know_the_three():
    assert OFFLINE_ALGORITHMS == ("kto", "dpo", "rft")
    for a in OFFLINE_ALGORITHMS:
        assert ALGORITHMS[a].family == "offline" and "offline" in ALGORITHMS[a].sections
    oc = OfflineConfig()
    assert oc.kto_beta == 0.1 and oc.dpo_beta == 0.1  # TRL's defaults, the papers'
    with pytest.raises(ValueError, match="examples"):
        OfflineConfig(examples=1)


def test_kto_raises_desirable_and_lowers_undesirable(tmp_path):
    job = _job(tmp_path, "kto")
    rows = [{"prompt": p, "completion": t, "label": t == GOOD}
            for p in PROMPTS for t in (GOOD, BAD)]  # fmt: skip
    p_ids, t_ids = _ids(job.tokenizer, [r["prompt"] for r in rows], [r["completion"] for r in rows])
    log = offline.train_offline(job, OfflineConfig(kto_beta=0.5), rows, list(zip(p_ids, t_ids, strict=True)))  # fmt: skip
    assert list(log.columns) == [*LOG_COLUMNS, *offline.OFFLINE_COLUMNS]
    assert list(log.step) == [1, 2] and log.policy_loss.notna().all()
    assert (log.step_time_s > 0).all()
    good = _gain(job.output_dir, PROMPTS, [GOOD] * 4)
    bad = _gain(job.output_dir, PROMPTS, [BAD] * 4)
    assert good.mean() > 0 > bad.mean()  # relative to the reference
    settings = json.loads((job.output_dir / "settings.json").read_text())
    assert settings["optimizer_steps"] == 2 * job.rl.optimizer_steps_per_batch
    assert settings["undesirable_weight"] == 1.0  # 4 desirable, 4 undesirable: balanced
    assert sorted(p.name for p in (job.output_dir / "snapshots").iterdir()) == ["step_000001"]


def test_dpo_raises_the_chosen_over_the_rejected(tmp_path):
    job = _job(tmp_path, "dpo")
    rows = [{"prompt": p, "chosen": GOOD, "rejected": BAD} for p in PROMPTS]
    p_ids, g = _ids(job.tokenizer, PROMPTS, [GOOD] * 4)
    _, b = _ids(job.tokenizer, PROMPTS, [BAD] * 4)
    log = offline.train_offline(job, OfflineConfig(dpo_beta=0.5), rows, list(zip(p_ids, g, b, strict=True)))  # fmt: skip
    assert log.pref_accuracy.notna().all() and log.reward_margin.iloc[-1] > 0
    margin = _gain(job.output_dir, PROMPTS, [GOOD] * 4) - _gain(job.output_dir, PROMPTS, [BAD] * 4)
    assert (margin > 0).all()
    assert (job.output_dir / "adapter" / "adapter_model.safetensors").is_file()


def test_rft_raises_the_kept_responses(tmp_path):
    job = _job(tmp_path, "rft")
    p_ids, t_ids = _ids(job.tokenizer, PROMPTS, [GOOD] * 4)
    rows = [{"input_ids": p + t, "completion_mask": [0] * len(p) + [1] * len(t)}
            for p, t in zip(p_ids, t_ids, strict=True)]  # fmt: skip
    from rlxf_utils.rl.experience import counting_optimizer_steps

    with counting_optimizer_steps() as counted:  # TRL's optimiser, as notebook 03 counts it
        offline.train_offline(job, OfflineConfig(), rows)
    n = offline.total_steps(job)
    assert counted == {"optimizer_steps": n, "optimizers": 1, "optimizer_steps_total": n}
    assert (_gain(job.output_dir, PROMPTS, [GOOD] * 4) > 0).all()


def test_trl_token_ids_are_checked():
    built = [{"prompt_ids": [1, 2], "completion_ids": [3, 0]}]
    offline.check_token_ids(built, [([1, 2], [3, 0])], ("prompt_ids", "completion_ids"), "kto")
    with pytest.raises(
        ValueError, match="kto: TRL tokenised example 0 differently.*completion_ids"
    ):
        offline.check_token_ids(built, [([1, 2], [3, 4, 0])], ("prompt_ids", "completion_ids"), "kto")  # fmt: skip


def test_dpo_pairs_are_met_over_non_met_of_one_context():
    rows = pd.DataFrame({
        "country": ["A"] * 4 + ["B"] * 3, "arrangement_type": "SBA", "econ_descriptor": "1.1",
        "row_id": range(7), "description": ["a", "b", "c", "d", "e", "f", "g"],
        "y": [1, 1, 0, 0, 1, 1, 1],
    })  # fmt: skip
    pairs = history_pairs(rows, 100, 10, 0, mixed_only=True)
    assert len(pairs) == 4 and set(pairs["country"]) == {"A"}  # B has no Non-MET description
    assert (pairs["y_a"] != pairs["y_b"]).all()


def _study(tmp_path, examples):
    cfg = load_config(ROOT / "params" / "smoke.yaml")
    return cfg.model_copy(update={"offline": OfflineConfig(examples=examples, max_tokens=4)})


def _rows():
    desc = [f"w{20 + i} w{21 + i}" for i in range(10)] + ["w1 w2 w3 w4 w5 w6"]  # the last: too long
    rows = pd.DataFrame({
        "country": ["A", "A", "A", "A", "B", "B", "B", "C", "C", "C", "C"],
        "arrangement_type": "SBA", "econ_descriptor": "1.1", "row_id": range(11),
        "description": desc, "y": [1, 0, 1, 0, 1, 0, 0, 1, 1, 0, 1],
    })  # fmt: skip
    ctx = pd.DataFrame({"country": ["A", "B", "C"], "arrangement_type": "SBA",
                        "econ_descriptor": "1.1", "econ_area": "Fiscal", "split": "train"})  # fmt: skip
    return rows, ctx


def test_kto_and_dpo_data_come_from_the_rows_the_rl_stage_may_see(tmp_path, monkeypatch):
    rows, ctx = _rows()
    monkeypatch.setattr(offline, "training_rows", lambda cfg, run_dir: (rows, ctx))
    tok = tiny_tokenizer()
    cfg = _study(tmp_path, 6)
    contexts = ctx.drop(columns=["econ_area", "split"]).to_dict("records")
    job = TrainJob("kto", tiny_llama(tok), tok, [], contexts, None, cfg.rl, cfg.policy, tmp_path,
                   seed=0, study=cfg, run_dir=tmp_path)  # fmt: skip
    frame, prompts, ids = offline.kto_examples(job)
    assert len(frame) == len(prompts) == len(ids) == 6
    assert set(frame["row_id"]) <= set(range(10))  # the long description never
    # RL's visits of the 3 contexts, num_generations (2) rows each: every context, 2 rows each
    assert cfg.rl.num_generations == 2 and frame.groupby("country").size().to_dict() == {
        "A": 2,
        "B": 2,
        "C": 2,
    }
    by_id = rows.set_index("row_id")
    assert (frame["label"] == frame["row_id"].map(by_id["y"]).astype(bool)).all()
    for (p, t), text, prompt, country in zip(ids, frame["text"], prompts, frame["country"], strict=True):  # fmt: skip
        assert t == [*tok(text, add_special_tokens=False)["input_ids"], tok.eos_token_id]
        assert p == list(encode_prompts(tok, [prompt])["input_ids"][0])
        assert f"performance of {country}," in prompt  # the row's own context
    job.algo = "dpo"
    frame, prompts, ids = offline.dpo_pairs(job)
    assert len(frame) == 3 and frame["country"].nunique() == 3  # examples / 2 pairs, 1 a visit
    for r in frame.itertuples():
        assert by_id.loc[r.row_a].country == by_id.loc[r.row_b].country == r.country
        met = {r.row_a, r.row_b} & set(rows.row_id[rows.y == 1])
        assert len(met) == 1 and by_id.loc[met.pop()].description == r.chosen
    cfg = _study(tmp_path, 40)
    job = TrainJob("dpo", tiny_llama(tok), tok, [], contexts, None, cfg.rl, cfg.policy, tmp_path,
                   seed=0, study=cfg, run_dir=tmp_path)  # fmt: skip
    with pytest.raises(offline.OfflineDataError, match="dpo: .* pairs .* 20 wanted"):
        offline.dpo_pairs(job)


def test_rft_pool_keeps_each_prompts_best_and_is_reused(tmp_path):
    from test_ppo import toy_reward

    tok = tiny_tokenizer()
    cfg = load_config(ROOT / "params" / "smoke.yaml")
    cfg = cfg.model_copy(update={"offline": OfflineConfig(examples=6, rft_candidates=3)})
    rl = small_cfg(max_new_tokens=4)
    contexts = [{"country": c, "arrangement_type": "SBA", "econ_descriptor": "1.1"} for c in "ABCD"]
    job = TrainJob("rft", tiny_llama(tok, 0, init=0.3), tok, PROMPTS, contexts,
                   toy_reward, rl, cfg.policy, tmp_path, seed=0, study=cfg, run_dir=tmp_path)  # fmt: skip
    pool = offline.rft_pool(job, batch_size=8)
    assert len(pool) == 6 * 3 and pool["kept"].sum() == 6
    # RL's first 3 context visits (prompt_schedule's), each asked num_generations (2) times
    visits = [i for step in prompt_schedule(4, 3, 1, 0) for i in step]
    kept = pool[pool["kept"]].sort_values("prompt_id")
    assert kept["context_id"].tolist() == [v for v in visits for _ in range(2)]
    assert kept["country"].tolist() == ["ABCD"[i] for i in kept["context_id"]]
    best = pool.groupby("prompt_id")["reward"].max()
    kept = pool[pool["kept"]].set_index("prompt_id")["reward"]
    pd.testing.assert_series_equal(kept.sort_index(), best.sort_index(), check_names=False)
    torch.manual_seed(123)
    again = offline.rft_pool(job, batch_size=8)  # read back, not sampled again
    pd.testing.assert_frame_equal(again, pool)


def test_minibatches_must_give_kto_two_examples_and_dpo_whole_pairs():
    from rlxf_utils.config import StudyConfig

    base = load_config(ROOT / "params" / "smoke.yaml").model_dump()

    def with_rl(algos, minibatch, batch=4):
        d = {**base, "rl": {**base["rl"], "algorithm": algos, "minibatch_size": minibatch,
                            "batch_size": batch}}  # fmt: skip
        return StudyConfig.model_validate(d)

    assert with_rl(["kto", "dpo"], 2).rl.minibatch_size == 2
    with pytest.raises(ValueError, match="KTO needs at least 2"):
        with_rl(["kto"], 1)
    with pytest.raises(ValueError, match="DPO takes minibatch_size / 2 pairs"):
        with_rl(["dpo"], 3, batch=6)
    assert with_rl(["ppo"], 1).rl.minibatch_size == 1  # only the offline methods ask


def test_an_interrupted_dpo_run_resumes_where_it_stopped(tmp_path, monkeypatch):
    """Stopped after its first step (TRL's checkpoint with the log rows), DPO resumes there,
    training only the second step, and ends where an uninterrupted run ends (adapter and log)."""
    from safetensors.torch import load_file

    trained = []  # optimiser steps each call logged
    make = offline._log_callback

    def counting(algo, history, per_batch):
        cb = make(algo, history, per_batch)
        on_log = cb.on_log

        def log(args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                trained[-1] += 1
            on_log(args, state, control, logs, **kw)

        cb.on_log = log
        return cb

    monkeypatch.setattr(offline, "_log_callback", counting)

    rows = [{"prompt": p, "chosen": GOOD, "rejected": BAD} for p in PROMPTS * 2]
    oc = OfflineConfig(dpo_beta=0.5)

    def go(out, steps):
        trained.append(0)
        job = _job(out, "dpo", steps=steps)
        p_ids, g = _ids(job.tokenizer, PROMPTS * 2, [GOOD] * 8)
        _, b = _ids(job.tokenizer, PROMPTS * 2, [BAD] * 8)
        return job, offline.train_offline(job, oc, rows, list(zip(p_ids, g, b, strict=True)))

    whole_job, whole = go(tmp_path / "whole", 2)
    cut_job, first = go(tmp_path / "cut", 1)
    assert list(first.step) == [1] and list((cut_job.output_dir / "trl").glob("checkpoint-*"))
    _, resumed = go(tmp_path / "cut", 2)
    per_batch = whole_job.rl.optimizer_steps_per_batch
    assert trained == [2 * per_batch, per_batch, per_batch]  # resumed: only step 2 trained
    assert list(resumed.step) == [1, 2]
    np.testing.assert_allclose(resumed.policy_loss, whole.policy_loss, rtol=1e-5)
    a = load_file(str(whole_job.output_dir / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(cut_job.output_dir / "adapter" / "adapter_model.safetensors"))
    for k in a:
        np.testing.assert_allclose(a[k].numpy(), b[k].numpy(), atol=1e-6, err_msg=k)


def test_pair_targets_draws_among_every_context_not_the_first():
    from rlxf_utils.rl.history_pairs import pair_targets

    tok = tiny_tokenizer()
    pairs = pd.DataFrame({"country": [f"C{i:02d}" for i in range(30)],
                          "text_a": ["w1 w2"] * 29 + ["w1 w2 w3 w4 w5 w6"], "text_b": "w3"})  # fmt: skip
    kept, a, b = pair_targets(pairs, tok, tiny_llama(tok), max_tokens=4, n=5, seed=0)
    assert len(kept) == 5 and "C29" not in set(kept["country"])  # too long: never
    assert list(kept["country"]) == sorted(kept["country"])  # in their order
    assert list(kept["country"]) != [f"C{i:02d}" for i in range(5)]  # drawn, not the first five
    assert a == [[*tok("w1 w2", add_special_tokens=False)["input_ids"], tok.eos_token_id]] * 5
    everything, _, _ = pair_targets(pairs, tok, tiny_llama(tok), max_tokens=4, n=100, seed=0)
    assert len(everything) == 29
