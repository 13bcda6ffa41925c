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

from rlxf_utils.artifacts import ArtifactMissing, RunDir
from rlxf_utils.config import ComputeConfig, LoraSettings, PolicyConfig
from rlxf_utils.evaluation.best_of_n import pool_sampling, versus_best_of_n
from rlxf_utils.evaluation.figures import plot_frontier
from rlxf_utils.evaluation.history import history_references
from rlxf_utils.evaluation.sampling import frame_logprobs, sample_tuned
from rlxf_utils.evaluation.tables import frontier_points, summary_table
from rlxf_utils.markdown import display_country
from rlxf_utils.models.generation import autocast, generate, trim_response
from rlxf_utils.models.policies import PolicySet


def _base(seed: int = 0):
    tok = tiny_tokenizer()
    return tiny_llama(tok, seed, init=0.3).eval(), tok


def test_trim_response_keeps_the_first_end_token() -> None:
    assert trim_response([5, 6, 0, 0, 0], {0}) == [5, 6, 0]
    assert trim_response([5, 6, 7], {0}) == [5, 6, 7]  # ran to max_new_tokens
    assert trim_response([2, 9, 3], {9, 3}) == [2, 9]


def test_generate_is_batched_seeded_and_trimmed() -> None:
    model, tok = _base()
    prompts = ["w10 w11 w12", "w13", "w14 w15"]
    kw = dict(max_new_tokens=6, temperature=1.0, top_p=1.0, postprocess="none", progress=False)
    a = generate(model, tok, prompts, 2, seed=3, batch_size=4, **kw)
    b = generate(model, tok, prompts, 2, seed=3, batch_size=4, **kw)
    assert len(a) == 6 and a[["prompt_id", "sample_id"]].values.tolist() == [
        [0, 0], [0, 1], [1, 0], [1, 1], [2, 0], [2, 1]
    ]  # fmt: skip
    assert a["response_ids"].tolist() == b["response_ids"].tolist()  # same seed, same samples
    for row in a.itertuples():
        assert row.prompt_ids == tok(prompts[row.prompt_id])["input_ids"]  # padding removed
        assert 1 <= row.n_tokens <= 6 and len(row.response_ids) == row.n_tokens
        assert tok.eos_token_id not in row.response_ids[:-1]  # nothing after the first end token
    c = generate(model, tok, prompts, 2, seed=4, batch_size=4, **kw)
    assert c["response_ids"].tolist() != a["response_ids"].tolist()
    # log-probs of the generated ids under the model: finite, negative
    lp = frame_logprobs(model, tok, a, batch_size=4)
    assert lp.shape == (6,) and np.all(np.isfinite(lp)) and np.all(lp < 0)


def test_policy_set_switches_adapters_on_one_base(tmp_path, monkeypatch) -> None:
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    from rlxf_utils.models.loading import apply_lora

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

    monkeypatch.setattr("rlxf_utils.models.policies.load_policy", lambda cfg, device=None: _base())
    cfg = SimpleNamespace(
        policy=PolicyConfig(),
        rl=SimpleNamespace(start_policy="base"),
        sft=SimpleNamespace(enabled=False),
        compute=ComputeConfig(device="cpu"),
    )
    pset = PolicySet(cfg, run, ["ppo"])
    ref, _ = _base()
    ids = torch.tensor([tok("w10 w11 w12")["input_ids"]])
    with torch.no_grad():
        with autocast(pset.autocast_dtype, "cpu"):  # the policy settings' (RLXF_TEST_AUTOCAST)
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
        PolicySet(cfg, run, ["grpo"])


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
    h = history_references(lab, ctx, k=2, seed=0)
    counts = h.groupby(["policy", "prompt_id"]).size().to_dict()
    assert counts[("history_met", 0)] == 2 and counts[("history_nonmet", 0)] == 1
    assert counts[("history_met", 1)] == 2 and ("history_nonmet", 1) not in counts
    assert ("history_met", 2) not in counts  # no history for country C
    assert all(counts[("random_policy", p)] == 2 for p in range(3))
    met = h[h.policy == "history_met"]
    assert (lab.loc[met.hist_idx, "y"] == 1).all()
    assert (lab.loc[met.hist_idx, "country"].to_numpy() == np.array(["A", "A", "B", "B"])).all()
    assert (h["response"].to_numpy() == lab.loc[h.hist_idx, "description"].to_numpy()).all()
    assert h.equals(history_references(lab, ctx, k=2, seed=0))  # seeded


def test_history_references_draw_only_reference_rows() -> None:
    lab = _labelled()
    ctx = [
        {"country": "A", "arrangement_type": "SBA", "econ_descriptor": "1.1"},
        {"country": "B", "arrangement_type": "SBA", "econ_descriptor": "1.1"},
    ]
    reference = [11, 13, 15]  # rows no reward or audit model trained on
    h = history_references(lab, ctx, k=3, seed=0, reference_ids=reference)
    assert set(lab.loc[h.hist_idx, "row_id"]) <= set(reference)  # random policy included
    assert len(h[h.policy == "random_policy"]) == 6
    counts = h.groupby(["policy", "prompt_id"]).size().to_dict()
    assert counts[("history_met", 0)] == 1 and counts[("history_nonmet", 0)] == 1
    assert counts[("history_met", 1)] == 1
    with pytest.raises(ValueError, match="reference row"):
        history_references(lab, ctx, k=1, seed=0, reference_ids=[999])


def test_best_of_n_pool_is_drawn_apart_from_the_compared_samples() -> None:
    from contextlib import contextmanager

    model, tok = _base()

    @contextmanager
    def use(name):
        yield model

    from types import MethodType

    pset = SimpleNamespace(use=use, tok=tok, start_name="sft", particles={})
    for name in ("generate", "sequence_logprobs"):  # PolicySet's own, on the fake
        setattr(pset, name, MethodType(getattr(PolicySet, name), pset))
    prompts = ["w10 w11 w12", "w13", "w14 w15"]
    kw = dict(max_new_tokens=8, temperature=1.0, top_p=1.0, postprocess="none", progress=False,
              seed=7, batch_size=4)  # fmt: skip
    own = sample_tuned(pset, "sft", prompts, 3, kw, 4, desc="sft", judges=False)
    # the pool as notebook 04 draws it: the start policy with `pool_sampling`'s settings
    pool = sample_tuned(pset, "sft", prompts, 3, pool_sampling(kw), 4, desc="pool", judges=False)
    for pid in range(len(prompts)):
        a = {tuple(r) for r in own.loc[own.prompt_id == pid, "response_ids"]}
        b = {tuple(r) for r in pool.loc[pool.prompt_id == pid, "response_ids"]}
        assert a.isdisjoint(b)  # another seed: no candidate is one of the compared samples
    again = sample_tuned(pset, "sft", prompts, 3, pool_sampling(kw), 4, desc="pool", judges=False)
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
    s, paired = summary_table(
        _samples(0.1), ["base", "ppo"], "base", 4, n_boot=500, alpha=0.05, seed=0
    )
    s = s.set_index("policy")
    assert s.loc["ppo", "gain"] == pytest.approx(0.1, abs=0.01)
    # the family's simultaneous interval (m = 2 comparisons: 97.5%) lies far above zero
    assert s.loc["ppo", "gain_low"] > 0.08 and s.loc["ppo", "gain_p_family"] < 0.01
    # the audit saw none of the shift: its gain and whole interval stay within 0.005 of zero
    assert s.loc["ppo", "audit_gain_low"] > -0.005 and s.loc["ppo", "audit_gain_high"] < 0.005
    assert s.loc["ppo", "kl"] == pytest.approx(0.1)  # logp_policy - logp_ref
    assert s.loc["best_of_n", "kl"] == pytest.approx(math.log(4) - 3 / 4)
    assert s.loc["base", "perplexity"] == pytest.approx(math.exp(1.0))
    assert s.loc["ppo", "finished"] == pytest.approx(2 / 3)  # samples 0 and 2 of 3 finished
    assert set(paired["measure"]) == {"reward", "audit_reward", "gap", "reward_finished",
                                      "audit_reward_finished", "finished_share"}  # fmt: skip
    assert s.loc["ppo", "gap"] == pytest.approx(0.1, abs=0.01) and s.loc["ppo", "gap_low"] > 0
    assert (paired["n_clusters"] == 10).all()  # tests run over the 10 countries, not 30 prompts
    null, _ = summary_table(
        _samples(0.0), ["base", "ppo"], "base", 4, n_boot=500, alpha=0.05, seed=0
    )
    assert null.set_index("policy").loc["ppo", "gain_p_family"] > 0.05


def test_a_gain_made_by_cut_responses_is_gone_among_finished_ones() -> None:
    # ppo finishes one response in three (base: all); its cut ones score +0.05 under the audit,
    # its finished ones what base's do: a full audit gain of about +0.033, none among finished
    frame = _samples(0.0)
    ppo = frame["policy"] == "ppo"
    frame["finished"] = ~ppo | (frame["sample_id"] == 0)
    frame.loc[ppo & ~frame["finished"], "audit_reward"] += 0.05
    s, paired = summary_table(frame, ["base", "ppo"], "base", 4, n_boot=500, alpha=0.05, seed=0)
    s = s.set_index("policy")
    assert s.loc["ppo", "audit_gain"] == pytest.approx(0.1 / 3, abs=0.005)
    assert s.loc["ppo", "audit_gain_low"] > 0
    assert abs(s.loc["ppo", "audit_gain_finished"]) < 0.005
    assert s.loc["ppo", "audit_gain_finished_low"] < 0 < s.loc["ppo", "audit_gain_finished_high"]
    assert s.loc["ppo", "audit_gain_finished_verdict"] != "above"
    fin = paired[paired["measure"] == "audit_reward_finished"].set_index("policy")
    assert fin.loc["ppo", "n"] == 30 and fin.loc["ppo", "n_clusters"] == 10
    # with the cut responses scored like the finished ones, both gains vanish alike
    frame.loc[ppo & ~frame["finished"], "audit_reward"] -= 0.05
    s2, _ = summary_table(frame, ["base", "ppo"], "base", 4, n_boot=500, alpha=0.05, seed=0)
    assert s2.set_index("policy").loc["ppo", "audit_gain_low"] < 0


def test_a_check_on_one_country_of_finished_responses_has_no_interval() -> None:
    frame = _samples(0.1)
    ppo = frame["policy"] == "ppo"
    frame["finished"] = ~ppo | (frame["country"] == "C3")  # ppo finishes in one country only
    s, _ = summary_table(frame, ["base", "ppo"], "base", 4, n_boot=500, alpha=0.05, seed=0)
    r = s.set_index("policy").loc["ppo"]
    assert r["gain_finished"] == pytest.approx(0.1, abs=0.01)  # the point is kept
    assert math.isnan(r["gain_finished_low"]) and math.isnan(r["gain_finished_high"])
    assert r["gain_finished_verdict"] is None or pd.isna(r["gain_finished_verdict"])
    assert r["gain_low"] > 0.08  # the full gain, over ten countries, keeps its interval


def test_display_country() -> None:
    assert display_country("GAMBIA, THE") == "Gambia, the"
    assert display_country("BOSNIA AND HERZEGOVINA") == "Bosnia and Herzegovina"
    assert display_country("MACEDONIA (FYR)") == "Macedonia (FYR)"


def test_expected_max_of_n_is_exact_order_statistics() -> None:
    import itertools

    from rlxf_utils.evaluation.best_of_n import best_of_n_kl_bound, expected_max_of_n

    pool = [0.3, 0.9, 0.1, 0.5, 0.7]
    for n in (1, 2, 3, 5):
        subsets = list(itertools.combinations(pool, n))
        assert expected_max_of_n(pool, n) == pytest.approx(np.mean([max(c) for c in subsets]))
    assert best_of_n_kl_bound(1) == 0.0
    with pytest.raises(ValueError, match="pool of at least"):
        expected_max_of_n(pool, 6)


def test_versus_best_of_n_interpolates_in_kl() -> None:
    from rlxf_utils.evaluation.best_of_n import best_of_n_kl_bound

    per_prompt = pd.DataFrame({1: [0.5] * 20, 2: [0.6] * 20, 4: [0.7] * 20})
    kl_mid = (best_of_n_kl_bound(2) + best_of_n_kl_bound(4)) / 2
    samples = pd.DataFrame(
        {"policy": "ppo", "prompt_id": np.arange(20), "reward": 0.8 + 0.01 * np.sin(np.arange(20))}
    )
    summary = pd.DataFrame({"policy": ["ppo"], "kl": [kl_mid]})
    out = versus_best_of_n(samples, per_prompt, summary, ["ppo"], 500, 0.05, 0)
    r = out.iloc[0]
    assert r["best_of_n_at_kl"] == pytest.approx(0.65)
    assert r["verdict"] == "above" and not r["beyond_curve"]
    assert r["best_of_n_kl"] == pytest.approx(kl_mid)
    summary["kl"] = 5.0  # beyond the largest N: compared with N = 4, and flagged
    r = versus_best_of_n(
        samples.assign(reward=0.7), per_prompt, summary, ["ppo"], 500, 0.05, 0
    ).iloc[0]
    assert r["beyond_curve"] and r["verdict"] == "not distinguishable"
    assert r["best_of_n_kl"] == pytest.approx(best_of_n_kl_bound(4))  # the curve's end


def test_versus_best_of_n_carries_the_policys_kl_error() -> None:
    """A policy whose KL estimate is noisy gets a wider interval than one whose KL is exact at the
    same mean: each resample reads the curve at the resampled KL."""
    from rlxf_utils.evaluation.best_of_n import best_of_n_kl_bound

    n = 40
    per_prompt = pd.DataFrame({1: [0.5] * n, 2: [0.6] * n, 4: [0.7] * n, 8: [0.8] * n})
    kl_mid = best_of_n_kl_bound(4)
    rng = np.random.default_rng(1)
    reward = 0.7 + 0.01 * rng.standard_normal(n)
    noisy = kl_mid + rng.normal(0, 1.0, n)
    noisy += kl_mid - noisy.mean()
    base = pd.DataFrame({"policy": "ppo", "prompt_id": np.arange(n), "reward": reward,
                         "logp_ref": -20.0})  # fmt: skip
    summary = pd.DataFrame({"policy": ["ppo"], "kl": [kl_mid]})
    exact = versus_best_of_n(base.assign(logp_policy=-20.0 + kl_mid), per_prompt, summary,
                             ["ppo"], 500, 0.05, 0).iloc[0]  # fmt: skip
    carried = versus_best_of_n(base.assign(logp_policy=-20.0 + noisy), per_prompt, summary,
                               ["ppo"], 500, 0.05, 0).iloc[0]  # fmt: skip
    assert exact["diff"] == pytest.approx(carried["diff"])
    assert carried["kl_resampled"] and carried["kl_low"] < kl_mid < carried["kl_high"]
    assert exact["kl_low"] == pytest.approx(kl_mid) == exact["kl_high"]
    width = lambda r: r["diff_high"] - r["diff_low"]  # noqa: E731
    assert width(carried) > 2 * width(exact)
    assert carried["bound_favours"] == "RL policy"


# ---------------------------------------------------------------------------------------------
# The RLGF paper's evaluation (rlgf_eval) and its report section
# ---------------------------------------------------------------------------------------------

ALGOS = ["ppo", "ppo_pp", "grpo", "d2lols"]


def _rlgf_samples(shift: dict[str, float], n_prompts: int = 40, k: int = 2,
                  hard_shift: dict[str, float] | None = None) -> pd.DataFrame:  # fmt: skip
    """Rewards 0.5 + a policy's shift (+ `hard_shift` on odd, i.e. hard, prompts); prompt p is
    of country C{(p // 2) % 10}, so every country holds easy and hard prompts. `d2lols` differs
    from `ppo` by a per-country amount that averages to zero: its interval must cross zero."""
    rng = np.random.default_rng(1)
    hard_shift = hard_shift or {}
    rows = []
    for p in range(n_prompts):
        c = (p // 2) % 10
        base = 0.5 + 0.03 * math.sin(p)
        for pol in [*shift, "best_of_n"]:
            for j in range(1 if pol == "best_of_n" else k):
                r = base + shift.get(pol, 0.05) + (hard_shift.get(pol, 0.0) if p % 2 else 0.0)
                if pol == "d2lols":
                    r = base + shift["ppo"] + 0.01 * (c - 4.5)
                if pol == "grpo":  # no gain on average, but not the same everywhere
                    r += 0.01 * (c - 4.5)
                rows.append({"policy": pol, "prompt_id": p, "sample_id": j, "reward": r + rng.normal(0, 0.002),
                             "audit_reward": 0.6 + rng.normal(0, 0.01), "logp_policy": -5.0 - shift.get(pol, 0.0),
                             "logp_ref": -5.0, "logp_base": -5.0 - 2 * shift.get(pol, 0.0), "n_tokens": 5,
                             "finished": j == 0, "response": f"w{p} w{j} {pol}", "country": f"C{c}",
                             "arrangement_type": "SBA", "econ_descriptor": f"d{p}",
                             "grounded_met_rate": 0.6, "max_sim": 0.5})  # fmt: skip
    return pd.DataFrame(rows)


def _history(n_prompts: int = 40) -> pd.DataFrame:
    """Four conditions per context: 3 MET on even prompts (easy), 1 MET on odd ones (hard)."""
    rows = []
    for p in range(n_prompts):
        for i in range(4):
            rows.append({"country": f"C{(p // 2) % 10}", "arrangement_type": "SBA",
                         "econ_descriptor": f"d{p}", "y": int(i < (3 if p % 2 == 0 else 1))})  # fmt: skip
    return pd.DataFrame(rows)


SHIFT = {
    "base": 0.0,
    "sft": 0.0,
    "sft_met": 0.04,
    "ppo": 0.05,
    "ppo_pp": 0.15,
    "grpo": 0.0,
    "d2lols": 0.05,
}


def _rlgf_inputs(**kw):
    samples = _rlgf_samples(SHIFT, **kw)
    pols = [p for p in SHIFT]
    summary, _ = summary_table(samples, pols, "sft", 4, n_boot=300, alpha=0.05, seed=0)
    ppl = pd.DataFrame({"policy": pols, "ppl_met": [40.0, 12.0, 11.0, 13.0, 12.5, 14.0, 12.8],
                        "ppl_nonmet": 20.0, "ppl_all": 15.0})  # fmt: skip
    return samples, summary, ppl


def test_rlgf_table_assembles_the_summary_in_the_papers_order() -> None:
    from rlxf_utils.evaluation.rlgf import rlgf_table

    samples, summary, ppl = _rlgf_inputs()
    shuffled = summary.sample(frac=1.0, random_state=3)  # the table's order is its own
    t = rlgf_table(shuffled, ppl, ALGOS)
    assert t["policy"].tolist() == ["base", "sft", "sft_met", *ALGOS, "best_of_n"]
    assert t["label"].tolist() == ["zero-shot (base)", "SFT", "SFT on MET rows", "PPO", "PPO++", "GRPO",
                                   "D²LOLS", "best-of-N"]  # fmt: skip
    assert t.set_index("policy")["kind"].to_dict() == {
        "base": "zero-shot", "sft": "supervised", "sft_met": "supervised", "ppo": "RL",
        "ppo_pp": "RL, guided", "grpo": "RL", "d2lols": "RL, guided", "best_of_n": "best-of-N"}  # fmt: skip
    s, tt = summary.set_index("policy"), t.set_index("policy")
    for col in ("ave_r", "ave_r_low", "ave_r_high", "audit", "audit_low", "audit_high", "kl",
                "distinct_2", "finished"):  # fmt: skip
        assert np.allclose(tt[col], s.loc[tt.index, col], equal_nan=True), col
    assert np.allclose(tt["output_ppl"], s.loc[tt.index, "perplexity"])  # under the zero-shot model
    # logp_base -5.3 over 5 tokens
    assert tt.loc["ppo_pp", "output_ppl"] == pytest.approx(math.exp(5.3 / 5))
    assert tt.loc["ppo_pp", "met_ppl"] == 12.5 and math.isnan(tt.loc["best_of_n", "met_ppl"])
    assert tt.loc["best_of_n", "kl_kind"] == "upper bound"
    # a run without sft_met and with the algorithms in another order
    t2 = rlgf_table(summary[summary.policy != "sft_met"], None, ["grpo", "ppo"])
    assert t2["policy"].tolist() == ["base", "sft", "grpo", "ppo", "best_of_n"]
    assert t2["met_ppl"].isna().all()


def test_median_split_keeps_ties_together_and_refuses_no_split() -> None:
    from rlxf_utils.evaluation.rlgf import median_split

    med, half = median_split([1.0, 1.0, 1.0, 1.0, 0.5, 0.3])
    assert med == 1.0 and half.tolist() == ["easy"] * 4 + ["hard"] * 2  # ties: the balancing side
    med, half = median_split([0.2, 0.5, 0.5, 0.5, 0.9])
    assert med == 0.5 and half.tolist() == [
        "hard",
        "hard",
        "hard",
        "hard",
        "easy",
    ]  # as close: hard
    med, half = median_split([0.1, 0.5, 0.5, 0.5, 0.5, 0.9, 0.95])
    # ties easy: 6 vs 1; ties hard: 2 vs 5, closer; the four equal rates stay together
    assert half.tolist() == ["hard"] * 5 + ["easy"] * 2
    _, half = median_split([0.7, 0.7, 0.7])
    assert half.tolist() == [None, None, None]  # one half would be empty: no split
    _, half = median_split([0.2, math.nan, 0.8])
    assert half.tolist() == ["hard", None, "easy"]


def test_prompt_difficulty_reads_each_contexts_history() -> None:
    from rlxf_utils.evaluation.rlgf import prompt_difficulty

    samples = _rlgf_samples(SHIFT)
    lab = _history()
    lab = pd.concat([lab, pd.DataFrame([{"country": "C9", "arrangement_type": "SBA",
                                          "econ_descriptor": "elsewhere", "y": 0}])])  # fmt: skip
    d = prompt_difficulty(samples[samples.policy == "sft"], lab).set_index("prompt_id")
    assert len(d) == 40 and (d["n_history"] == 4).all()
    assert d.loc[0, "met_rate"] == 0.75 and d.loc[1, "met_rate"] == 0.25
    assert d.loc[0, "met_rate_smoothed"] == pytest.approx(4 / 6)  # (3 + 1) / (4 + 2)
    assert (d.loc[d.index % 2 == 0, "half"] == "easy").all()
    assert (d.loc[d.index % 2 == 1, "half"] == "hard").all()
    # a prompt whose context has no history: smoothed rate 1/2, in whichever half the median puts it
    d2 = prompt_difficulty(samples[samples.policy == "sft"], lab[lab.econ_descriptor != "d3"])
    assert d2.set_index("prompt_id").loc[3, ["n_history", "met_rate_smoothed"]].tolist() == [0, 0.5]


def test_easy_hard_table_finds_a_gain_only_on_hard_prompts() -> None:
    from rlxf_utils.evaluation.rlgf import easy_hard_table, prompt_difficulty

    samples = _rlgf_samples(SHIFT, hard_shift={"grpo": 0.1})
    d = prompt_difficulty(samples[samples.policy == "sft"], _history())
    t = easy_hard_table(
        samples, d, ["base", "sft", "sft_met", "grpo", "best_of_n"], "sft", 400, 0.05, 0
    )
    g = t[t.policy == "grpo"].set_index("half")
    assert (
        g.loc["hard", "gain"] == pytest.approx(0.1, abs=0.005)
        and g.loc["hard", "gain_verdict"] == "above"
    )
    assert (
        abs(g.loc["easy", "gain"]) < 0.005
        and g.loc["easy", "gain_verdict"] == "not distinguishable"
    )
    assert g.loc["hard_minus_easy", "gain"] == pytest.approx(0.1, abs=0.005)
    assert g.loc["hard_minus_easy", "gain_low"] > 0  # a country holds prompts of both halves
    assert g.loc["easy", "n_prompts"] == 20 and g.loc["easy", "n_countries"] == 10
    assert g.loc["hard", "ave_r_low"] < g.loc["hard", "ave_r"] < g.loc["hard", "ave_r_high"]
    sft = t[t.policy == "sft"]
    assert sft["gain"].isna().all() and (sft["gain_verdict"] == "").all()  # the start policy
    # the start policy's easy/hard Ave(R) equals the mean of its per-prompt rewards in each half
    per = samples[samples.policy == "sft"].groupby("prompt_id")["reward"].mean()
    easy_ids = d.loc[d.half == "easy", "prompt_id"]
    assert sft.set_index("half").loc["easy", "ave_r"] == pytest.approx(per.loc[easy_ids].mean())
    # every context with the same rate: no split, an empty table with the same columns
    flat = d.assign(half=None)
    empty = easy_hard_table(samples, flat, ["grpo"], "sft", 100, 0.05, 0)
    assert empty.empty and "gain_verdict" in empty.columns


def test_guidance_verdicts_follow_the_intervals() -> None:
    from rlxf_utils.evaluation.rlgf import guidance_table
    from rlxf_utils.report.rlgf import guidance_context

    samples, _, _ = _rlgf_inputs()
    g = guidance_table(samples, ALGOS, 500, 0.05, 0)
    rew = g[g.measure == "reward"]
    vs_ppo = rew[rew.question == "guidance_vs_ppo"].set_index("policy")
    assert list(vs_ppo.index) == ["ppo_pp", "d2lols"] and (vs_ppo["versus"] == "ppo").all()
    # PPO++ is 0.10 above PPO everywhere: an interval clear of zero
    assert vs_ppo.loc["ppo_pp", "diff"] == pytest.approx(0.10, abs=0.005)
    assert vs_ppo.loc["ppo_pp", "low"] > 0 and vs_ppo.loc["ppo_pp", "verdict"] == "above"
    # D²LOLS: per-country differences from -0.045 to +0.045, mean 0: the interval crosses zero
    assert vs_ppo.loc["d2lols", "low"] < 0 < vs_ppo.loc["d2lols", "high"]
    assert vs_ppo.loc["d2lols", "verdict"] == "not distinguishable"
    vs_sft = rew[rew.question == "rl_vs_sft_met"].set_index("policy")
    assert list(vs_sft.index) == ALGOS and (vs_sft["versus"] == "sft_met").all()
    assert vs_sft.loc["grpo", "verdict"] == "below" and vs_sft.loc["ppo", "verdict"] == "above"
    assert (g["n_clusters"] == 10).all() and g["p_family"].between(0, 1).all()
    assert set(g["measure"]) == {"reward", "audit_reward"}
    # the sentences' contexts: each guided algorithm against PPO, every one against sft_met,
    # each with the verdict codes of its measures (the words: tests/golden/report/rlgf.md)
    c = guidance_context(g, ALGOS, 0.1)
    gc = {x["policy"]: x for x in c["guidance"]["comparisons"]}
    assert list(gc) == ["ppo_pp", "d2lols"] and c["guidance"]["comparator"] == "ppo"
    assert [m["verdict"] for m in gc["ppo_pp"]["measures"]][0] == "above"
    assert {m["verdict"] for m in gc["d2lols"]["measures"]} == {"not distinguishable"}
    # each sentence states its question's family level (two guided algorithms: 1 - 0.05 / 2),
    # not a level of its own (it said the 90% of the alpha passed in)
    from rlxf_utils.stats import level

    assert {level(x["alpha"]) for x in gc.values()} == {"97.5%"}
    rc = {x["policy"]: x for x in c["rl_vs_sft_met"]["comparisons"]}
    assert list(rc) == ALGOS and {level(x["alpha"]) for x in rc.values()} == {
        level(0.05 / len(ALGOS))
    }
    grpo_reward = rc["grpo"]["measures"][0]
    assert (grpo_reward["measure"], grpo_reward["verdict"]) == ("reward", "below")
    # the verb follows the interval's verdict, not the point estimate: a positive estimate whose
    # interval crosses zero is not a win
    fake = g.copy()
    fake.loc[(fake.policy == "ppo_pp") & (fake.measure == "reward"), ["diff", "low", "high", "verdict"]] = [
        0.08, -0.01, 0.17, "not distinguishable"]  # fmt: skip
    (first, *_) = guidance_context(fake, ALGOS, 0.05)["guidance"]["comparisons"]
    assert first["measures"][0] == {"measure": "reward", "verdict": "not distinguishable",
                                    "diff": 0.08, "low": -0.01, "high": 0.17}  # fmt: skip


def test_guidance_without_ppo_or_without_a_guided_algorithm_says_so() -> None:
    from rlxf_utils.evaluation.rlgf import guidance_table
    from rlxf_utils.report.rlgf import guidance_context

    samples, _, _ = _rlgf_inputs()
    no_ppo = samples[samples.policy != "ppo"]
    g = guidance_table(no_ppo, ["ppo_pp", "grpo"], 200, 0.05, 0)
    assert set(g["question"]) == {"rl_vs_sft_met"}
    c = guidance_context(g, ["ppo_pp", "grpo"], 0.05)["guidance"]
    assert c["guided"] == ["ppo_pp"] and c["comparator"] is None and c["comparisons"] == []
    g = guidance_table(samples, ["ppo", "grpo"], 200, 0.05, 0)
    c = guidance_context(g, ["ppo", "grpo"], 0.05)["guidance"]
    assert c["guided"] == [] and c["comparisons"] == []
    g = guidance_table(samples[samples.policy != "sft_met"], ["ppo", "grpo"], 200, 0.05, 0)
    assert g.empty and list(g.columns)[-7:] == [
        "verdict",
        "p_family",
        "ci_level",
        "bound",
        "mde",
        "kl",
        "kl_versus",
    ]
    assert guidance_context(g, ["ppo", "grpo"], 0.05)["rl_vs_sft_met"] == {
        "evaluated": False, "comparisons": []}  # fmt: skip


def test_easy_hard_sentences_read_the_intervals() -> None:
    from rlxf_utils.evaluation.rlgf import easy_hard_table, prompt_difficulty
    from rlxf_utils.report.rlgf import easy_hard_context

    samples = _rlgf_samples(SHIFT, hard_shift={"grpo": 0.1})
    d = prompt_difficulty(samples[samples.policy == "sft"], _history())
    t = easy_hard_table(samples, d, ["sft", "grpo"], "sft", 300, 0.1, 0)
    c = easy_hard_context(t, "sft", 0.1)
    assert c["start"] == "SFT"  # the start is the yardstick, not a policy
    # the gains' intervals are at their family's level, and the sentence says that level
    assert c["alpha"] == pytest.approx(1 - t["gain_ci_level"].dropna().iloc[0]) and c["alpha"] < 0.1
    (grpo,) = c["policies"]
    assert grpo["label"] == "GRPO"
    assert [(h["half"], h["verdict"]) for h in grpo["halves"]] == [
        ("easy", "not distinguishable"), ("hard", "above")]  # fmt: skip
    assert grpo["diff"]["low"] > 0  # its gain is larger on hard prompts
    assert easy_hard_context(t.iloc[0:0], "sft", 0.1) == {"placed": False}


def test_rlgf_figures_and_frontier_use_algorithm_labels() -> None:
    import matplotlib

    matplotlib.use("Agg")
    from rlxf_utils.evaluation.rlgf import rlgf_figures, rlgf_tables

    samples, summary, ppl = _rlgf_inputs()
    tables = rlgf_tables(samples, summary, ppl, _history(), ALGOS, "sft", 200, 0.05, 0)
    assert set(tables) == {"eval_rlgf", "eval_prompt_difficulty", "eval_easy_hard", "eval_guidance"}
    figs = rlgf_figures(tables, "sft", 0.1)
    legend = [t.get_text() for t in figs["eval_reward_perplexity"].legends[0].get_texts()]
    assert legend == tables["eval_rlgf"]["label"].tolist()  # every policy, best-of-N included
    assert "90% CI" in figs["eval_reward_perplexity"]._suptitle.get_text()
    ticks = [t.get_text() for t in figs["eval_easy_hard"].axes[0].get_xticklabels()]
    assert "PPO++" in ticks and "D²LOLS" in ticks
    frontier = pd.DataFrame(
        [{"algo": "sft", "step": 0, "reward": 0.5, "reward_low": 0.4, "reward_high": 0.6, "kl": 0.0, "source": "final"}]
        + [{"algo": a, "step": s, "reward": 0.5 + 0.01 * s, "reward_low": 0.45, "reward_high": 0.6,
            "kl": 0.1 * s, "source": "snapshot" if s == 1 else "final"} for a in ALGOS for s in (1, 2)]
    )  # fmt: skip
    fig = plot_frontier(frontier, "sft", 0.05)
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert labels == ["start (sft)", "PPO", "PPO++", "GRPO", "D²LOLS"]


def test_frontier_points_score_every_algorithms_snapshots(tmp_path, monkeypatch) -> None:
    """The frontier covers every algorithm of rl.algorithm, guided ones included: one row per
    saved snapshot before the final step (the final policy is measured apart)."""
    from contextlib import contextmanager

    run = RunDir(tmp_path / "run")
    for algo in ALGOS:
        for step in (1, 2, 3):  # step 3 = rl.steps: the final policy
            run.path(
                f"policy/{algo}/snapshots/step_{step:06d}/adapter_model.safetensors"
            ).write_bytes(b"")
    loaded = []

    @contextmanager
    def reference():
        yield None

    pset = SimpleNamespace(algos=ALGOS, tok=None, reference=reference,
                           load_snapshot=lambda algo, path: loaded.append((algo, path.parent.name)) or "snapshot")  # fmt: skip

    def fake_sample(pset_, name, prompts, k, kw, batch, desc, judges):
        return pd.DataFrame(
            {"prompt_id": range(len(prompts)), "sample_id": 0, "logp_policy": -4.0, "n_tokens": 5}
        )

    def fake_rewards(df, contexts, reward_model, audit_model, batch, cut_responses):
        assert cut_responses == "failed"  # the snapshots are scored by the evaluation's rule
        df["reward"], df["audit_reward"] = 0.5, 0.6
        return df

    monkeypatch.setattr("rlxf_utils.evaluation.tables.sample_tuned", fake_sample)
    monkeypatch.setattr(
        "rlxf_utils.evaluation.tables.frame_logprobs", lambda m, tok, df, b: np.full(len(df), -5.0)
    )
    monkeypatch.setattr("rlxf_utils.evaluation.tables.add_rewards", fake_rewards)
    # made afresh every time (keeping them is tests/test_draws.py's)
    monkeypatch.setattr("rlxf_utils.evaluation.tables.kept_pass", lambda *a: a[6]())
    cfg = SimpleNamespace(
        evaluation=SimpleNamespace(frontier_max_checkpoints=None, frontier_samples_per_prompt=1,
                                   logprob_batch_size=4, n_boot=100, alpha=0.05,
                                   cut_responses="failed"),
        rl=SimpleNamespace(steps=3, reward_batch_size=4, max_new_tokens=4, temperature=1.0, top_p=1.0,
                           response_postprocess="none"),
        run=SimpleNamespace(seed=0),
    )  # fmt: skip
    monkeypatch.setattr(
        "rlxf_utils.evaluation.tables.sampling_kwargs",
        lambda cfg, progress=True, trained=False: {},
    )
    contexts = [{"country": f"C{i}"} for i in range(3)]
    f, snap_samples = frontier_points(
        pset, run, ["a", "b", "c"], contexts, None, None, cfg, None, False
    )
    assert sorted(zip(f["algo"], f["step"], strict=True)) == sorted(
        (a, s) for a in ALGOS for s in (1, 2)
    )
    assert sorted(loaded) == sorted((a, f"step_{s:06d}") for a in ALGOS for s in (1, 2))
    assert np.allclose(f["kl"], 1.0) and (f["source"] == "snapshot").all()
    # the snapshots' own samples come back for the over-optimisation curve, one frame per point
    assert sorted(set(zip(snap_samples["algo"], snap_samples["step"], strict=True))) == sorted(
        (a, s) for a in ALGOS for s in (1, 2)
    )
    # an algorithm that trained longer than rl.steps (ILHF from history counts its own steps):
    # its step-3 snapshot is a snapshot, not its final policy
    run.write_json(f"policy/{ALGOS[0]}/settings.json", {"steps": 4})
    f, _ = frontier_points(pset, run, ["a", "b", "c"], contexts, None, None, cfg, None, False)
    assert sorted(f.loc[f["algo"] == ALGOS[0], "step"]) == [1, 2, 3]


def _eval_run(tmp_path, algos: list[str], alpha: float = 0.05, with_tables: bool = True) -> RunDir:
    from rlxf_utils.evaluation.rlgf import rlgf_tables

    run = RunDir(tmp_path / "run")
    samples, summary, ppl = _rlgf_inputs()
    keep = ["base", "sft", "sft_met", *algos, "best_of_n"]
    samples = samples[samples.policy.isin(keep)]
    summary = summary[summary.policy.isin(keep)]
    run.write_json(
        "eval/summary.json", {"algorithms": algos, "start_policy": "sft", "alpha": alpha}
    )
    if with_tables:
        tables = rlgf_tables(samples, summary, ppl, _history(), algos, "sft", 300, alpha, 0)
        for name, df in tables.items():
            run.write_table(name, df)
    return run


def test_report_rlgf_section_words_follow_the_intervals(tmp_path) -> None:
    from rlxf_utils.report.rlgf import rlgf_section

    run = _eval_run(tmp_path, ALGOS, alpha=0.1)
    v, inc = rlgf_section(run, {"rlgf": {"guide": "sft_met"}})
    assert v["level"] == "90%" and v["start"] == "SFT"
    assert v["context_key"] == "country × arrangement type × economic descriptor"
    # the sentences' words: tests/golden/report/rlgf.md; here, that the run's numbers reach them
    assert "95%" in v["guidance_sentence"]  # 1 - 0.1 / 2
    # the easy/hard gains' family level (the table's header), not the plain 90% (issue 59, item 5)
    assert "99.5% simultaneous cluster t" in v["easy_hard_sentence"]
    assert v["easy_hard_level"] == "99.5%"
    assert v["median"] == "0.500"  # between (3 + 1) / (4 + 2) (easy) and (1 + 1) / (4 + 2) (hard)
    table = inc["rlgf_table.md"]
    assert r"Ave(R) \[90% CI\]" in table and "PPO++" in table and "≤ " in table  # best-of-N's bound
    rows = [r for r in table.splitlines() if r.startswith("| ")]
    assert [r.split("|")[1].strip() for r in rows[1:]] == [
        "zero-shot (base)", "SFT", "SFT on MET rows", "PPO", "PPO++", "GRPO", "D²LOLS", "best-of-N"]  # fmt: skip
    assert (
        "does guidance beat PPO?" in inc["rlgf_guidance.md"] and "higher" in inc["rlgf_guidance.md"]
    )
    assert (
        "hard − easy" in inc["rlgf_easy_hard.md"]
        and r"gain over SFT \[99.5% CI\]" in inc["rlgf_easy_hard.md"]
    )


def test_report_rlgf_section_without_guidance_or_tables(tmp_path) -> None:
    from rlxf_utils.report.rlgf import guidance_context, rlgf_section

    run = _eval_run(tmp_path / "a", ["ppo", "grpo"])
    v, inc = rlgf_section(run, {})
    c = guidance_context(run.read_table("eval_guidance"), ["ppo", "grpo"], 0.05)
    assert c["guidance"]["guided"] == [] and c["rl_vs_sft_met"]["evaluated"]
    (ppo,) = [x for x in c["rl_vs_sft_met"]["comparisons"] if x["policy"] == "ppo"]
    assert ppo["measures"][0]["verdict"] == "above"  # PPO beats sft_met under the reward model
    # an older run dir: no RLGF tables; the section says so, and its tables stay tables
    v, inc = rlgf_section(_eval_run(tmp_path / "b", ["ppo"], with_tables=False), {})
    assert v["guidance_sentence"] == v["rl_vs_sft_met_sentence"] == v["easy_hard_sentence"]
    assert "notebook 04_evaluation" in v["easy_hard_sentence"] and v["median"] == "n/a"
    for md in inc.values():
        assert md.startswith("| note |") and "tables/eval_rlgf.csv" in md


def test_report_draws_a_placeholder_for_a_figure_the_run_lacks(tmp_path) -> None:
    from rlxf_utils.report.render import OPTIONAL_FIGURES, placeholder_figures

    figs = tmp_path / "figures"
    figs.mkdir()
    (figs / "eval_easy_hard.png").write_bytes(b"real")
    assert placeholder_figures(figs, OPTIONAL_FIGURES) == [
        "eval_reward_perplexity", "eval_reward_uncertainty", "eval_inclusive", "eval_methods",
        "eval_kl_budgets", "reward_encoders",
    ]  # fmt: skip
    assert (figs / "eval_reward_perplexity.png").read_bytes()[:4] == b"\x89PNG"
    assert (figs / "eval_easy_hard.png").read_bytes() == b"real"  # an existing figure is kept


# -- the report's verdict words ----------------------------------------------------------------
def test_a_gain_verdict_follows_the_family_interval_not_the_sign() -> None:
    from rlxf_utils.stats import bound_verdict

    assert bound_verdict(0.01, 0.03) == "above"
    assert bound_verdict(-0.03, -0.01) == "below"
    # a point estimate far from zero is no verdict when its interval holds zero
    assert bound_verdict(-0.01, 0.61) == "not distinguishable"
    assert bound_verdict(float("nan"), 0.1) == "not distinguishable"


@pytest.mark.parametrize("seed", range(40))
def test_a_verdict_never_disagrees_with_its_test(seed) -> None:
    """On clustered data near the boundary, the family interval excludes zero exactly when the
    family p-value is below alpha, and Cohen's d_z is the per-prompt mean difference over the
    per-prompt SD."""
    from rlxf_utils.stats import paired_comparison

    rng = np.random.default_rng(seed)
    n = 24
    clusters = np.repeat(np.arange(8), 3)
    a = rng.normal(0, 1, n) + rng.normal(0, 0.5, 8)[clusters]
    b = a - rng.normal(0.35, 1.0, n)  # an effect near the detection boundary
    m = int(rng.integers(1, 6))
    res = paired_comparison(a, b, n_boot=300, seed=seed, alpha=0.05, clusters=clusters,
                            family_size=m)  # fmt: skip
    excludes = res["ci_low"] > 0 or res["ci_high"] < 0
    assert excludes == (res["p_family"] < 0.05), res
    # the effect size on the prompt unit, computed apart: mean and SD of the per-prompt
    # differences (not the per-cluster ones the reference tests use)
    d = a - b
    assert res["mean_diff"] == pytest.approx(d.mean(), rel=1e-12)
    assert res["cohens_dz"] == pytest.approx(d.mean() / d.std(ddof=1), rel=1e-12)
    assert res["ci_level"] == pytest.approx(1 - 0.05 / m)


def test_history_verdicts_are_read_from_the_interval() -> None:
    from rlxf_utils.report.evaluation import history_context
    from rlxf_utils.stats import bound_verdict

    # the point estimates say "below"
    hist = pd.DataFrame({"ave_r": [0.60, 0.65]}, index=["history_met", "history_nonmet"])
    both = {"n": 24, "n_clusters": 14}

    def contrast(low: float, high: float, audit: tuple[float, float] | None = None) -> dict:
        out = {"reward": {**both, "mean_diff": (low + high) / 2, "ci_low": low, "ci_high": high}}
        if audit:
            out["audit_reward"] = {**both, "mean_diff": sum(audit) / 2, "ci_low": audit[0], "ci_high": audit[1]}  # fmt: skip
        return out

    def verdicts(c: dict) -> list[tuple[str, str]]:
        return [(j["judge"], bound_verdict(j["low"], j["high"])) for j in c["judges"]]

    c = history_context(hist, contrast(0.01, 0.03, (-0.04, 0.02)))
    assert verdicts(c) == [("reward", "above"), ("audit_reward", "not distinguishable")]
    assert (c["n"], c["clusters"], c["met"], c["nonmet"]) == (24, 14, 0.60, 0.65)
    assert verdicts(history_context(hist, contrast(-0.03, -0.01))) == [("reward", "below")]
    assert verdicts(history_context(hist, contrast(-0.03, 0.01))) == [("reward", "not distinguishable")]  # fmt: skip
    assert history_context(hist.iloc[:1], contrast(0.01, 0.03)) is None  # not both


def test_move_sentence_says_when_an_algorithm_logs_no_training_reward() -> None:
    import pandas as pd

    from rlxf_utils.report.rl import moves_context

    nan = float("nan")
    rose = {"reward_first": 0.6, "reward_last": 0.65, "kl_last": 1.5, "step_time_s": 12}
    none = {"reward_first": nan, "reward_last": nan, "kl_last": nan, "step_time_s": 6}
    rows = pd.DataFrame([rose, none, {**none, "step_time_s": 31.6}], index=["PPO", "ILHF", "KTO"])
    c = moves_context(rows)
    assert [r["algorithm"] for r in c["moved"]] == ["PPO"]
    assert c["moved"][0] == {"algorithm": "PPO", "first": 0.6, "last": 0.65, "first_step": 1,
                             "kl": 1.5, "step_time_s": 12}  # fmt: skip
    # said together once, with their step times, never as 'nan'
    assert c["silent"] == {"algorithms": ["ILHF", "KTO"], "step_time_s": [6, 31.6]}
    assert moves_context(rows.iloc[[1]]) == {
        "moved": [], "silent": {"algorithms": ["ILHF"], "step_time_s": [6]}}  # fmt: skip
