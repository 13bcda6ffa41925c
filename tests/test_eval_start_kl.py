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


@pytest.mark.parametrize("autocast", [None, "bfloat16"])  # bfloat16: the paper profile's
def test_the_start_policys_kl_to_itself_is_zero_through_evaluation(tmp_path, monkeypatch, autocast):
    from rlxf_utils.models.loading import apply_lora

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
    # `logp_ref` is what the reference path computes (before: 8.5e-7 nats apart in float32,
    # -0.040 under bfloat16 autocast, sft scored on the base + its unmerged adapter)
    with pset.reference() as ref:
        again = frame_logprobs(ref, pset.tok, frames[0], 8)
    np.testing.assert_array_equal(again, frames[0]["logp_ref"].to_numpy())
    # independently: each policy's log-probs and each KL from models built by hand, apart from
    # the PolicySet (the start policy, as RL's reference, is its merged weights). Under bfloat16
    # autocast both sides carry bfloat16's rounding, not the same (batching, padding): looser
    tol, tol_kl = (1e-4, 1e-4) if autocast is None else (0.15, 0.02)  # nats per response
    reference = _by_hand(run, "sft", merged=True)
    for name, frame in zip(("sft", "sft_met"), frames, strict=True):
        policy_model = _by_hand(run, name, merged=name == "sft")
        hand_policy = _logprobs_by_hand(policy_model, frame, autocast)
        hand_ref = _logprobs_by_hand(reference, frame, autocast)
        np.testing.assert_allclose(frame["logp_policy"], hand_policy, atol=tol, err_msg=name)
        np.testing.assert_allclose(frame["logp_ref"], hand_ref, atol=tol, err_msg=name)
        hand_kl = float(np.mean(hand_policy - hand_ref))
        assert abs(kl.loc[name, "kl"] - hand_kl) < tol_kl, (name, kl.loc[name, "kl"], hand_kl)
        if name == "sft_met":  # another policy: the measure is not zero by itself
            assert hand_kl > 0.05, hand_kl
    assert abs(kl.loc["sft", "kl"]) < tol_kl, kl  # KL(start || start), measured: zero
