"""KL(start || start) through evaluation's real path: the start policy (`sft`) is sampled and
scored as a policy, and its KL to RL's reference (the merged start policy, adapters off) is
measured as every policy's is (`sample_tuned`, `kl_table`). It must be zero, not the rounding
between the base + unmerged adapter and the merged weights.

`sample_tuned` copies the start policy's own log-probs into its `logp_ref` (one model), so a
zero read from `kl_table` alone could not fail. Each log-prob and each KL is therefore also
computed independently, here: adapters loaded with peft into fresh base models, one unpadded
forward per response, float64 log-softmax, summed by hand."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_ppo import tiny_tokenizer
from tiny import tiny_llama

from rlxf_utils.artifacts import RunDir
from rlxf_utils.config import ComputeConfig, LoraSettings, PolicyConfig
from rlxf_utils.evaluation.sampling import frame_logprobs, sample_tuned
from rlxf_utils.evaluation.tables import kl_table
from rlxf_utils.models.policies import PolicySet

pytestmark = pytest.mark.usefixtures("one_thread")


def _base():
    tok = tiny_tokenizer()
    return tiny_llama(tok, 0, init=0.3).eval(), tok


def _by_hand(run: RunDir, name: str, merged: bool):
    """Policy `name` built apart from the evaluation's `PolicySet`: a fresh base with the saved
    adapter (merged into the weights: how RL's reference is built; or not: how a policy is)."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(_base()[0], str(run.path(f"policy/{name}/adapter")))
    return (model.merge_and_unload() if merged else model).eval()


def _logprobs_by_hand(model, frame, autocast: str | None) -> np.ndarray:
    """Sum of log p(response token | prompt, earlier tokens), one sequence at a time (no
    padding, no batching, no `logits_to_keep`), the log-softmax in float64; the forward under
    torch's own autocast to `autocast` when the policy config names one."""
    out = []
    dtype = getattr(torch, autocast) if autocast else torch.float32
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype, enabled=autocast is not None):
        for p, r in zip(frame["prompt_ids"], frame["response_ids"], strict=True):
            p, r = [int(i) for i in p], [int(i) for i in r]
            logits = model(input_ids=torch.tensor([p + r])).logits[0].double()
            logp = torch.log_softmax(logits[len(p) - 1 : -1], dim=-1)  # predicts each token of r
            out.append(float(logp[torch.arange(len(r)), torch.tensor(r)].sum()))
    return np.array(out)


@pytest.mark.parametrize("autocast", [None, "bfloat16"])  # bfloat16: the default's on bf16 CPUs
def test_the_start_policys_kl_to_itself_is_zero_through_evaluation(tmp_path, monkeypatch, autocast):
    from rlxf_utils.config.precision import native_bf16
    from rlxf_utils.models.loading import apply_lora

    if autocast and not native_bf16("cpu"):  # the tolerances below are oneDNN's bf16 rounding's
        pytest.skip("this CPU has no native bf16 (torch's reference GEMM rounds otherwise: 0.28 "
                    "nats a response measured); the default runs fp32 here")  # fmt: skip

    run = RunDir(tmp_path / "run")
    for seed, name in enumerate(("sft", "sft_met")):  # adapters far from zero: merging rounds
        model, _ = _base()
        peft = apply_lora(model, LoraSettings(rank=4, alpha=8, target_modules=["q_proj", "v_proj"]))
        torch.manual_seed(seed)
        with torch.no_grad():
            for n, p in peft.named_parameters():
                if "lora_" in n:
                    p.normal_(0, 0.5)
        peft.save_pretrained(str(run.path(f"policy/{name}/adapter")))
    for where in (
        "rlxf_utils.models.policies.load_policy",
        "rlxf_utils.models.loading.load_policy",
    ):
        monkeypatch.setattr(where, lambda cfg, device=None: _base())
    policy = PolicyConfig(autocast=autocast)
    cfg = SimpleNamespace(policy=policy, rl=SimpleNamespace(start_policy="sft"),
                          sft=SimpleNamespace(enabled=True), compute=ComputeConfig(device="cpu"))  # fmt: skip
    pset = PolicySet(cfg, run, [])
    gen_kw = dict(max_new_tokens=12, temperature=1.0, top_p=1.0, postprocess="none", seed=0,
                  batch_size=8, progress=False, sampler=policy.sampler, merge=policy.merge_lora,
                  compile_step=False)  # fmt: skip
    prompts = ["w10 w11 w12", "w13", "w14 w15", "w16 w17 w18 w19"]
    with pset.use("sft") as a, pset.reference() as b:
        assert a is b  # the start policy is RL's reference itself
    frames = [sample_tuned(pset, name, prompts, 4, gen_kw, 8, desc=name).assign(policy=name)
              for name in ("sft", "sft_met")]  # fmt: skip
    import pandas as pd

    kl = kl_table(pd.concat(frames, ignore_index=True), ["sft", "sft_met"], 4).set_index("policy")
    # the reference scores the start policy's samples as the start policy does: the copied
    # `logp_ref` (the sampling pass's, `logp_drawn`) is what the reference's own pass computes,
    # to rounding (before: 8.5e-7 nats apart in float32, -0.040 under bfloat16 autocast, sft
    # scored on the base + its unmerged adapter; the pass and the sampling's KV cache differ by
    # at most 7e-6 in float32 and 0.096 nats a response under bfloat16 on this tiny model)
    tol, tol_kl = (1e-4, 1e-4) if autocast is None else (0.25, 0.05)  # nats per response (below)
    with pset.reference() as ref:
        again = frame_logprobs(ref, pset.tok, frames[0], 8)
    np.testing.assert_allclose(again, frames[0]["logp_ref"].to_numpy(), atol=tol)
    # independently: each policy's log-probs and each KL from models built by hand, apart from
    # the PolicySet (the start policy, as RL's reference, is its merged weights; every policy's
    # own log-probs are those of the weights that drew its samples, its adapter merged: under
    # bfloat16 the unmerged adapter is another distribution, 0.049 nats a response away here).
    # Under bfloat16 autocast both sides carry bfloat16's rounding, not the same (batching,
    # padding, the KV cache): looser. And a response drawn from the sampling pass's softmax is
    # likelier under that pass than under a second pass whose rounding differs (the KL between
    # the two passes' distributions: here, whose logits are far larger than a trained model's,
    # +0.022 nats a response for sft_met): the hand's KL, from a second pass, is that much lower
    reference = _by_hand(run, "sft", merged=True)
    for name, frame in zip(("sft", "sft_met"), frames, strict=True):
        policy_model = _by_hand(run, name, merged=True)
        hand_policy = _logprobs_by_hand(policy_model, frame, autocast)
        hand_ref = _logprobs_by_hand(reference, frame, autocast)
        np.testing.assert_allclose(frame["logp_policy"], hand_policy, atol=tol, err_msg=name)
        np.testing.assert_allclose(frame["logp_ref"], hand_ref, atol=tol, err_msg=name)
        hand_kl = float(np.mean(hand_policy - hand_ref))
        assert abs(kl.loc[name, "kl"] - hand_kl) < tol_kl, (name, kl.loc[name, "kl"], hand_kl)
        if name == "sft_met":  # another policy: the measure is not zero by itself
            assert hand_kl > 0.05, hand_kl
    assert abs(kl.loc["sft", "kl"]) < tol_kl, kl  # KL(start || start), measured: zero


def test_the_policys_own_pass_runs_only_where_the_draws_cannot_give_it():
    """A policy's own log-probs come from its sampling pass when it drew from its own softmax
    (no second forward pass: issue 60), equal to that pass's numbers in float32; at another
    temperature (the draws' distribution is not the policy's), or for an ensemble (its density
    is the mixture's, not the answering particle's), the policy's own pass runs."""
    from test_draws import KW, PROMPTS, _pset

    from rlxf_utils.evaluation.sampling import policy_frame_logprobs

    pset = _pset()
    calls = []
    own = pset.sequence_logprobs

    def counted(name, *args, **kwargs):
        calls.append(name)
        return own(name, *args, **kwargs)

    pset.sequence_logprobs = counted
    kw = {**KW, "sampler": "compact", "merge": True, "compile_step": False}
    drawn = sample_tuned(pset, "sft", PROMPTS, 3, kw, 4, desc="sft", judges=False)
    assert calls == [] and "logp_drawn" not in drawn
    again = policy_frame_logprobs(pset, "sft", drawn, 4)
    np.testing.assert_allclose(drawn["logp_policy"], again, atol=1e-4)
    assert np.abs(drawn["logp_policy"]).min() > 0  # summed over each response, not left at 0
    calls.clear()
    warm = sample_tuned(pset, "sft", PROMPTS, 3, {**kw, "temperature": 0.7}, 4, desc="t", judges=False)  # fmt: skip
    assert calls == ["sft"] and "logp_drawn" not in warm
    calls.clear()
    pset.particles = {"sft": []}  # an ensemble by name (no particles to draw in this fake)
    sample_tuned(pset, "sft", PROMPTS, 3, kw, 4, desc="ens", judges=False)
    assert calls == ["sft"]
