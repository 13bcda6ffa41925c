"""KL(start || start) through evaluation's real path: the start policy (`sft`) is sampled and
scored as a policy, and its KL to RL's reference (the merged start policy, adapters off) is
measured as every policy's is (`sample_tuned`, `kl_table`). It must be zero, not the rounding
between the base + unmerged adapter and the merged weights."""

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
    # before: 8.5e-7 nats in float32, -0.040 under bfloat16 autocast (sft sampled and scored on
    # the base + its unmerged adapter, the reference on the merged weights)
    assert kl.loc["sft", "kl"] == 0.0, kl
    # the reference scores the start policy's samples as the start policy does (no shortcut)
    with pset.reference() as ref:
        again = frame_logprobs(ref, pset.tok, frames[0], 8)
    np.testing.assert_array_equal(again, frames[0]["logp_policy"].to_numpy())
    assert kl.loc["sft_met", "kl"] > 0.05  # another policy: the measure is not zero by itself
