"""The evaluation stage's building blocks: generation, adapters on one base, history, summary."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
from test_ppo import tiny_tokenizer
from tiny import tiny_llama

from rlxf_utils import alignment, models
from rlxf_utils.artifacts import ArtifactMissing, RunDir
from rlxf_utils.config import LoraSettings, PolicyConfig


def _base(seed: int = 0):
    tok = tiny_tokenizer()
    return tiny_llama(tok, seed, init=0.3).eval(), tok


def test_trim_response_keeps_the_first_end_token() -> None:
    assert models.trim_response([5, 6, 0, 0, 0], {0}) == [5, 6, 0]
    assert models.trim_response([5, 6, 7], {0}) == [5, 6, 7]  # ran to max_new_tokens
    assert models.trim_response([2, 9, 3], {9, 3}) == [2, 9]


def test_generate_is_batched_seeded_and_trimmed() -> None:
    model, tok = _base()
    prompts = ["w10 w11 w12", "w13", "w14 w15"]
    kw = dict(max_new_tokens=6, temperature=1.0, top_p=1.0, postprocess="none", progress=False)
    a = models.generate(model, tok, prompts, 2, seed=3, batch_size=4, **kw)
    b = models.generate(model, tok, prompts, 2, seed=3, batch_size=4, **kw)
    assert len(a) == 6 and a[["prompt_id", "sample_id"]].values.tolist() == [
        [0, 0], [0, 1], [1, 0], [1, 1], [2, 0], [2, 1]
    ]  # fmt: skip
    assert a["response_ids"].tolist() == b["response_ids"].tolist()  # same seed, same samples
    for row in a.itertuples():
        assert row.prompt_ids == tok(prompts[row.prompt_id])["input_ids"]  # padding removed
        assert 1 <= row.n_tokens <= 6 and len(row.response_ids) == row.n_tokens
        assert tok.eos_token_id not in row.response_ids[:-1]  # nothing after the first end token
    c = models.generate(model, tok, prompts, 2, seed=4, batch_size=4, **kw)
    assert c["response_ids"].tolist() != a["response_ids"].tolist()
    # log-probs of the generated ids under the model: finite, negative
    lp = alignment._logprobs(model, tok, a, batch_size=4)
    assert lp.shape == (6,) and np.all(np.isfinite(lp)) and np.all(lp < 0)


def test_policy_set_switches_adapters_on_one_base(tmp_path, monkeypatch) -> None:
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    from rlxf_utils.models import apply_lora

    trained, tok = _base()
    peft = apply_lora(trained, LoraSettings(rank=4, alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    run = RunDir(tmp_path / "run")
    peft.save_pretrained(str(run.path("policy/ppo/adapter")))
    zeros = {k: torch.zeros_like(v) for k, v in get_peft_model_state_dict(peft).items()}
    save_file(zeros, str(run.path("policy/ppo/snapshots/step_000001/adapter_model.safetensors")))

    monkeypatch.setattr(alignment, "load_policy", lambda cfg, device=None: _base())
    cfg = SimpleNamespace(
        policy=PolicyConfig(),
        rl=SimpleNamespace(start_policy="base"),
        sft=SimpleNamespace(enabled=False),
    )
    pset = alignment.PolicySet(cfg, run, ["ppo"])
    ref, _ = _base()
    ids = torch.tensor([tok("w10 w11 w12")["input_ids"]])
    with torch.no_grad():
        want_base = ref(ids).logits
        with pset.use("base") as m:
            got_base = m(ids).logits
        with pset.use("ppo") as m:
            got_ppo = m(ids).logits
        name = pset.load_snapshot(
            "ppo", run.path("policy/ppo/snapshots/step_000001/adapter_model.safetensors")
        )
        with pset.use(name) as m:
            got_snap = m(ids).logits
        with pset.use("ppo") as m:
            again = m(ids).logits
    torch.testing.assert_close(got_base, want_base)
    assert (got_ppo - want_base).abs().max() > 1e-3  # the adapter is active
    torch.testing.assert_close(got_snap, want_base)  # zero LoRA weights = the base
    torch.testing.assert_close(again, got_ppo)  # loading a snapshot leaves the final adapter alone

    with pytest.raises(ArtifactMissing, match="grpo"):
        alignment.PolicySet(cfg, run, ["grpo"])


def _labelled() -> pd.DataFrame:
    return pd.DataFrame(
        {
            "country": ["A", "A", "A", "A", "B", "B"],
            "arrangement_type": ["SBA"] * 6,
            "econ_descriptor": ["1.1"] * 6,
            "description": ["a met 1", "a met 2", "a met 3", "a not", "b met", "b met 2"],
            "y": [1, 1, 1, 0, 1, 1],
            "row_id": [10, 11, 12, 13, 14, 15],
        }
    )


def test_history_references_match_context_and_label() -> None:
    lab = _labelled()
    ctx = [
        {"country": "A", "arrangement_type": "SBA", "econ_descriptor": "1.1"},
        {"country": "B", "arrangement_type": "SBA", "econ_descriptor": "1.1"},
        {"country": "C", "arrangement_type": "SBA", "econ_descriptor": "1.1"},
    ]
    h = alignment.history_references(lab, ctx, k=2, seed=0)
    counts = h.groupby(["policy", "prompt_id"]).size().to_dict()
    assert counts[("history_met", 0)] == 2 and counts[("history_nonmet", 0)] == 1
    assert counts[("history_met", 1)] == 2 and ("history_nonmet", 1) not in counts
    assert ("history_met", 2) not in counts  # no history for country C
    assert all(counts[("random_policy", p)] == 2 for p in range(3))
    met = h[h.policy == "history_met"]
    assert (lab.loc[met.hist_idx, "y"] == 1).all()
    assert (lab.loc[met.hist_idx, "country"].to_numpy() == np.array(["A", "A", "B", "B"])).all()
    assert (h["response"].to_numpy() == lab.loc[h.hist_idx, "description"].to_numpy()).all()
    assert h.equals(alignment.history_references(lab, ctx, k=2, seed=0))  # seeded


def test_history_references_draw_only_reference_rows() -> None:
    lab = _labelled()
    ctx = [
        {"country": "A", "arrangement_type": "SBA", "econ_descriptor": "1.1"},
        {"country": "B", "arrangement_type": "SBA", "econ_descriptor": "1.1"},
    ]
    reference = [11, 13, 15]  # rows no reward or audit model trained on
    h = alignment.history_references(lab, ctx, k=3, seed=0, reference_ids=reference)
    assert set(lab.loc[h.hist_idx, "row_id"]) <= set(reference)  # random policy included
    assert len(h[h.policy == "random_policy"]) == 6
    counts = h.groupby(["policy", "prompt_id"]).size().to_dict()
    assert counts[("history_met", 0)] == 1 and counts[("history_nonmet", 0)] == 1
    assert counts[("history_met", 1)] == 1
    with pytest.raises(ValueError, match="reference row"):
        alignment.history_references(lab, ctx, k=1, seed=0, reference_ids=[999])


def test_best_of_n_pool_is_drawn_apart_from_the_compared_samples() -> None:
    from contextlib import contextmanager

    model, tok = _base()

    @contextmanager
    def use(name):
        yield model

    pset = SimpleNamespace(use=use, tok=tok, start_name="sft")
    prompts = ["w10 w11 w12", "w13", "w14 w15"]
    kw = dict(max_new_tokens=8, temperature=1.0, top_p=1.0, postprocess="none", progress=False,
              seed=7, batch_size=4)  # fmt: skip
    own = alignment.sample_tuned(pset, "sft", prompts, 3, kw, 4, desc="sft", judges=False)
    pool = alignment.best_of_n_pool(pset, prompts, 3, kw, 4)
    for pid in range(len(prompts)):
        a = {tuple(r) for r in own.loc[own.prompt_id == pid, "response_ids"]}
        b = {tuple(r) for r in pool.loc[pool.prompt_id == pid, "response_ids"]}
        assert a.isdisjoint(b)  # another seed: no candidate is one of the compared samples
    again = alignment.best_of_n_pool(pset, prompts, 3, kw, 4)
    assert again["response_ids"].tolist() == pool["response_ids"].tolist()  # still seeded


def _samples(gain: float, n_prompts: int = 30, k: int = 3) -> pd.DataFrame:
    rng = np.random.default_rng(0)
    rows = []
    for pol, shift in (("base", 0.0), ("ppo", gain), ("best_of_n", 0.0)):
        for p in range(n_prompts):
            for j in range(k if pol != "best_of_n" else 1):
                r = 0.5 + 0.05 * math.sin(p) + shift + rng.normal(0, 0.01)
                rows.append({"policy": pol, "prompt_id": p, "sample_id": j, "reward": r,
                             "audit_reward": 0.6 + rng.normal(0, 0.01), "logp_policy": -5.0 + shift,
                             "logp_ref": -5.0, "logp_base": -5.0, "n_tokens": 5, "finished": j % 2 == 0,
                             "response": f"w{p} w{j} text", "country": f"C{p % 10}",
                             "grounded_met_rate": 0.6, "max_sim": 0.5})  # fmt: skip
    return pd.DataFrame(rows)


def test_summary_table_finds_a_real_gain_and_only_it() -> None:
    s, paired = alignment.summary_table(
        _samples(0.1), ["base", "ppo"], "base", 4, n_boot=500, alpha=0.05, seed=0
    )
    s = s.set_index("policy")
    assert s.loc["ppo", "gain"] == pytest.approx(0.1, abs=0.01)
    # 10 countries: the exact Wilcoxon p is at least 2 / 2**10, times 2 for Holm
    assert s.loc["ppo", "gain_low"] > 0.08 and s.loc["ppo", "gain_p_holm"] < 0.01
    assert abs(s.loc["ppo", "audit_gain"]) < 0.01 and s.loc["ppo", "audit_gain_p_holm"] > 0.05
    assert s.loc["ppo", "kl"] == pytest.approx(0.1)  # logp_policy - logp_ref
    assert s.loc["base", "kl"] == 0.0
    assert s.loc["best_of_n", "kl"] == pytest.approx(math.log(4) - 3 / 4)
    assert s.loc["base", "perplexity"] == pytest.approx(math.exp(1.0))
    assert s.loc["ppo", "finished"] == pytest.approx(2 / 3)  # samples 0 and 2 of 3 finished
    assert set(paired["measure"]) == {"reward", "audit_reward", "gap"}
    assert s.loc["ppo", "gap"] == pytest.approx(0.1, abs=0.01) and s.loc["ppo", "gap_low"] > 0
    assert (paired["n_clusters"] == 10).all()  # tests run over the 10 countries, not 30 prompts
    null, _ = alignment.summary_table(
        _samples(0.0), ["base", "ppo"], "base", 4, n_boot=500, alpha=0.05, seed=0
    )
    assert null.set_index("policy").loc["ppo", "gain_p_holm"] > 0.05


def test_display_country() -> None:
    assert models.display_country("GAMBIA, THE") == "Gambia, the"
    assert models.display_country("BOSNIA AND HERZEGOVINA") == "Bosnia and Herzegovina"
    assert models.display_country("MACEDONIA (FYR)") == "Macedonia (FYR)"


def test_expected_max_of_n_is_exact_order_statistics() -> None:
    import itertools

    from rlxf_utils import evaluation as ev

    pool = [0.3, 0.9, 0.1, 0.5, 0.7]
    for n in (1, 2, 3, 5):
        subsets = list(itertools.combinations(pool, n))
        assert ev.expected_max_of_n(pool, n) == pytest.approx(np.mean([max(c) for c in subsets]))
    assert ev.best_of_n_kl_bound(1) == 0.0
    with pytest.raises(ValueError, match="pool of at least"):
        ev.expected_max_of_n(pool, 6)


def test_versus_best_of_n_interpolates_in_kl() -> None:
    from rlxf_utils import evaluation as ev

    per_prompt = pd.DataFrame({1: [0.5] * 20, 2: [0.6] * 20, 4: [0.7] * 20})
    kl_mid = (ev.best_of_n_kl_bound(2) + ev.best_of_n_kl_bound(4)) / 2
    samples = pd.DataFrame(
        {"policy": "ppo", "prompt_id": np.arange(20), "reward": 0.8 + 0.01 * np.sin(np.arange(20))}
    )
    summary = pd.DataFrame({"policy": ["ppo"], "kl": [kl_mid]})
    out = alignment.versus_best_of_n(samples, per_prompt, summary, ["ppo"], 500, 0.05, 0)
    r = out.iloc[0]
    assert r["best_of_n_at_kl"] == pytest.approx(0.65)
    assert r["verdict"] == "above" and not r["beyond_curve"]
    assert r["best_of_n_kl"] == pytest.approx(kl_mid)
    summary["kl"] = 5.0  # beyond the largest N: compared with N = 4, and flagged
    r = alignment.versus_best_of_n(
        samples.assign(reward=0.7), per_prompt, summary, ["ppo"], 500, 0.05, 0
    ).iloc[0]
    assert r["beyond_curve"] and r["verdict"] == "not distinguishable"
    assert r["best_of_n_kl"] == pytest.approx(ev.best_of_n_kl_bound(4))  # the curve's end
