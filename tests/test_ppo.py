"""PPO internals on hand-made numbers, learning on a tiny random model, exact resume."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tiny import tiny_llama, word_tokenizer

from rlxf_utils.config import LoraSettings, RLConfig
from rlxf_utils.ppo import (
    AdaptiveKLController,
    FixedKLController,
    PPOTrainer,
    compute_gae,
    explained_variance,
    policy_loss,
    value_loss,
    whiten,
)

WORDS = [f"w{i}" for i in range(60)]
TARGET = "w7"


def tiny_tokenizer():
    """A word-level tokenizer over 60 words, EOS doubling as pad (like SmolLM2)."""
    tok = word_tokenizer(WORDS)
    tok.padding_side = "left"
    return tok


def tiny_policy(seed: int = 0, lora_rank: int = 8):
    """A 2-layer random Llama with LoRA adapters and the tiny tokenizer."""
    from rlxf_utils.models import apply_lora

    tok = tiny_tokenizer()
    model = tiny_llama(
        tok, seed, init=0.3
    )  # a peaked enough unembedding for LoRA to move the output
    lora = LoraSettings(
        rank=lora_rank, alpha=2 * lora_rank, target_modules=["q_proj", "v_proj", "o_proj"]
    )
    return apply_lora(model, lora), tok


def toy_contexts(n: int = 8) -> tuple[list[str], list[dict]]:
    """Prompts of a few words and matching fake contexts."""
    rng = np.random.default_rng(0)
    prompts = [" ".join(rng.choice(WORDS[10:], size=3)) for _ in range(n)]
    contexts = [
        {"country": f"C{i}", "arrangement_type": "SBA", "econ_descriptor": "1.1 Fiscal"}
        for i in range(n)
    ]
    return prompts, contexts


def toy_reward(contexts: list[dict], texts: list[str]) -> np.ndarray:
    """+1 when TARGET appears in the response, else 0."""
    return np.array([float(TARGET in t.split()) for t in texts], dtype=np.float32)


pytestmark = pytest.mark.usefixtures("one_thread")


def small_cfg(**kw) -> RLConfig:
    base = dict(
        steps=4, batch_size=8, minibatch_size=4, max_new_tokens=8, learning_rate=3e-3,
        ppo_epochs=2, kl_coef=0.01, sample_every=2, checkpoint_every=2,
        response_postprocess="none", num_generations=2, approx_kl_stop=None,
    )  # fmt: skip
    base.update(kw)
    return RLConfig(**base)


# -- hand-made numbers ------------------------------------------------------------------------
def test_gae_hand_computed():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.5, 0.5]])
    mask = torch.ones(1, 3)
    adv, ret = compute_gae(rewards, values, mask, gamma=1.0, lam=1.0)
    assert torch.allclose(adv, torch.tensor([[0.5, 0.5, 0.5]]))
    assert torch.allclose(ret, torch.tensor([[1.0, 1.0, 1.0]]))
    adv, _ = compute_gae(rewards, values, mask, gamma=0.9, lam=0.5)
    # delta = [-0.05, -0.05, 0.5]; A2 = 0.5, A1 = -0.05 + 0.45*0.5, A0 = -0.05 + 0.45*A1
    assert torch.allclose(adv, torch.tensor([[0.02875, 0.175, 0.5]]))


def test_gae_respects_mask():
    rewards = torch.tensor([[0.0, 1.0, 0.0]])
    values = torch.tensor([[0.2, 0.4, 9.0]])  # the masked value must not leak in
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    adv, ret = compute_gae(rewards, values, mask, gamma=1.0, lam=1.0)
    assert torch.allclose(adv, torch.tensor([[0.8, 0.6, 0.0]]))
    assert torch.allclose(ret, torch.tensor([[1.0, 1.0, 0.0]]))


def test_whiten():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    w = whiten(x, mask)
    assert torch.allclose(w[0, :3], torch.tensor([-1.0, 0.0, 1.0]), atol=1e-4)
    assert w[0, 3] == 0
    w2 = whiten(x, mask, shift_mean=False)
    assert torch.allclose(w2[0, :3], torch.tensor([1.0, 2.0, 3.0]), atol=1e-4)


def test_kl_controller_direction():
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=100)
    ctl.update(12.0, n_steps=10)  # KL too high -> stronger penalty
    assert ctl.value > 0.1
    high = ctl.value
    ctl.update(1.0, n_steps=10)  # KL too low -> weaker penalty
    assert ctl.value < high
    assert math.isclose(AdaptiveKLController(0.1, 6.0, 100).value, 0.1)
    fixed = FixedKLController(0.2)
    fixed.update(100.0, 10)
    assert fixed.value == 0.2


def test_clipped_policy_loss():
    logp = torch.log(torch.tensor([[1.5, 0.5]]))
    old = torch.zeros(1, 2)
    mask = torch.ones(1, 2)
    loss, clip_frac, approx_kl = policy_loss(logp, old, torch.ones(1, 2), mask, clip_range=0.2)
    assert math.isclose(loss.item(), (-1.2 + -0.5) / 2, rel_tol=1e-5)
    assert clip_frac.item() == 1.0
    expected_kl = ((0.5 - math.log(1.5)) + (-0.5 - math.log(0.5))) / 2
    assert math.isclose(approx_kl.item(), expected_kl, rel_tol=1e-5)
    loss_neg, _, _ = policy_loss(logp, old, -torch.ones(1, 2), mask, clip_range=0.2)
    assert math.isclose(loss_neg.item(), (1.5 + 0.8) / 2, rel_tol=1e-5)


def test_clipped_value_loss_and_ev():
    loss, frac = value_loss(
        torch.tensor([[1.0]]), torch.tensor([[0.0]]), torch.tensor([[2.0]]), torch.ones(1, 1), 0.2
    )
    assert math.isclose(loss.item(), 0.5 * 1.8**2, rel_tol=1e-5)
    assert frac.item() == 1.0
    r = torch.tensor([[1.0, 2.0, 3.0]])
    assert math.isclose(explained_variance(r, r, torch.ones(1, 3)), 1.0)


# -- training on a tiny model -----------------------------------------------------------------
def test_ppo_raises_toy_reward(tmp_path):
    model, tok = tiny_policy(seed=1)
    prompts, contexts = toy_contexts(16)
    cfg = small_cfg(
        steps=30, batch_size=16, minibatch_size=8, ppo_epochs=4, learning_rate=1e-2,
        checkpoint_every=100, kl_coef=0.001, adaptive_kl=False, vf_coef=0.1,
    )  # fmt: skip
    trainer = PPOTrainer(model, tok, prompts, contexts, toy_reward, cfg, tmp_path / "ppo", seed=3)
    log = trainer.train(progress=False)
    first, last = log.reward_mean.iloc[:5].mean(), log.reward_mean.iloc[-5:].mean()
    assert last > first + 0.3, (first, last)
    assert (tmp_path / "ppo/adapter/adapter_model.safetensors").is_file()
    assert (tmp_path / "ppo/train_log.parquet").is_file()
    assert log.notna()[["kl", "entropy", "clip_frac", "approx_kl", "value_loss"]].all().all()


def test_resume_matches_uninterrupted(tmp_path):
    prompts, contexts = toy_contexts(8)
    cfg = small_cfg(steps=4, checkpoint_every=2)

    def run(out, interrupt_at=None):
        model, tok = tiny_policy(seed=0)
        tr = PPOTrainer(model, tok, prompts, contexts, toy_reward, cfg, out, seed=5)

        def cb(step, row):
            if interrupt_at is not None and step == interrupt_at:
                raise KeyboardInterrupt

        tr.train(progress=False, callback=cb)
        return tr

    full = run(tmp_path / "full")
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "cut", interrupt_at=2)
    assert (tmp_path / "cut/checkpoints/step_000002").is_dir()
    resumed = run(tmp_path / "cut")
    a = full.log_frame().drop(columns=["tokens_per_s", "gen_time_s", "step_time_s"])
    b = resumed.log_frame().drop(columns=["tokens_per_s", "gen_time_s", "step_time_s"])
    assert len(b) == 4
    np.testing.assert_allclose(a.select_dtypes("number"), b.select_dtypes("number"), rtol=1e-5)
    for (n1, p1), (_, p2) in zip(
        full.unwrapped.named_parameters(), resumed.unwrapped.named_parameters(), strict=True
    ):
        assert torch.allclose(p1, p2, atol=1e-6), n1
    # every checkpoint's adapter stays as a snapshot (the frontier), and the last is the final one
    snaps = sorted(
        p.parent.name for p in (tmp_path / "full/snapshots").glob("*/adapter_model.safetensors")
    )
    assert snaps == ["step_000002", "step_000004"]
    from safetensors.torch import load_file

    last = load_file(str(tmp_path / "full/snapshots/step_000004/adapter_model.safetensors"))
    final = load_file(str(tmp_path / "full/adapter/adapter_model.safetensors"))
    assert last.keys() == final.keys()
    assert all(torch.equal(last[k], final[k]) for k in last)
