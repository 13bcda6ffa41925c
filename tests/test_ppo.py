"""PPO internals on hand-made numbers, learning on a tiny random model, exact resume."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tiny import tiny_llama, word_tokenizer

from rlxf_utils.config import PROJECT_ROOT, LoraSettings, RLConfig, load_config
from rlxf_utils.models.generation import encode_prompts, eos_ids, generate
from rlxf_utils.models.loading import apply_lora
from rlxf_utils.rl.core import (
    AdaptiveKLController,
    FixedKLController,
    compute_gae,
    explained_variance,
    kl_controller,
    policy_loss,
    prompt_schedule,
    value_loss,
    whiten,
)
from rlxf_utils.rl.ppo import PPOTrainer

WORDS = [f"w{i}" for i in range(60)]
TARGET = "w7"


def tiny_tokenizer():
    """A word-level tokenizer over 60 words, EOS doubling as pad (like SmolLM2)."""
    tok = word_tokenizer(WORDS)
    tok.padding_side = "left"
    return tok


def tiny_policy(seed: int = 0, lora_rank: int = 8):
    """A 2-layer random Llama with LoRA adapters and the tiny tokenizer."""
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
        update_epochs=2, kl_coef=0.01, sample_every=2, checkpoint_every=2,
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
    """By hand: the smoothed KL s_t = KL_1, then (s_{t-1} + KL_t) / 2 at weight 0.5; the error
    log2(s_t / target) clipped at +-1; beta moves by 1.5 ** error up and 1.5 ** (error / 2) down."""
    g = math.log(1.5)
    ctl = AdaptiveKLController(0.1, target=6.0, beta_range=(0.01, 100.0), step_ratio=1.5,
                               smoothing=0.5)  # fmt: skip
    ctl.update(12.0)  # twice the target: full error, x1.5
    assert math.isclose(ctl.value, 0.15) and ctl.smoothed == 12.0
    ctl.update(0.0)  # smoothed (12 + 0) / 2 = 6: on target, unchanged (no look-ahead)
    assert math.isclose(ctl.value, 0.15) and ctl.smoothed == 6.0
    ctl.update(0.0)  # smoothed 3, half the target: full error down, at half the rate
    assert math.isclose(ctl.value, 0.15 * math.exp(-g / 2))
    ctl.update(5.0)  # smoothed 4 = 2/3 of the target: log2(2/3) at half the rate
    assert math.isclose(ctl.value, 0.15 * math.exp(-g / 2 + g / 2 * math.log2(4 / 6)))
    ctl.update(float("nan"))  # a NaN KL leaves it alone
    assert math.isclose(ctl.value, 0.15 * math.exp(-g / 2 + g / 2 * math.log2(4 / 6)))
    again = AdaptiveKLController(1.0, 6.0)
    again.load_state_dict(ctl.state_dict())  # a resumed run goes on from the same smoothed KL
    assert (again.value, again.smoothed) == (ctl.value, ctl.smoothed) == (again.value, 4.0)
    for bad, match in (
        ({"step_ratio": 1.0}, "kl_step_ratio"),
        ({"smoothing": 0.0}, "kl_smoothing"),
    ):
        with pytest.raises(ValueError, match=match):
            AdaptiveKLController(0.1, 6.0, **bad)
    for _ in range(20):
        ctl.update(100.0)
    assert ctl.value == 100.0  # the range holds it
    ctl.update(math.nan)  # a step without a KL leaves beta alone
    assert ctl.value == 100.0
    assert math.isclose(AdaptiveKLController(0.1, 6.0).value, 0.1)
    with pytest.raises(ValueError, match="kl_coef_range"):
        AdaptiveKLController(0.1, 6.0, beta_range=(1.0, 0.5))
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
        steps=30, batch_size=16, minibatch_size=8, update_epochs=4, learning_rate=1e-2,
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
    # killed between the checkpoint and its frontier snapshot: the resume writes the snapshot
    import shutil

    shutil.rmtree(tmp_path / "cut/snapshots/step_000002")
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

    for snap in snaps:  # the resumed run has the same snapshots, the restored one included
        a_, b_ = (load_file(str(tmp_path / run_ / "snapshots" / snap / "adapter_model.safetensors"))
                  for run_ in ("full", "cut"))  # fmt: skip
        assert all(torch.allclose(a_[k], b_[k], atol=1e-6) for k in a_), snap

    last = load_file(str(tmp_path / "full/snapshots/step_000004/adapter_model.safetensors"))
    final = load_file(str(tmp_path / "full/adapter/adapter_model.safetensors"))
    assert last.keys() == final.keys()
    assert all(torch.equal(last[k], final[k]) for k in last)


# -- like for like: the update, the reference, the controller, the critic, prompts, end tokens ----
def varied_contexts(n: int = 8) -> tuple[list[str], list[dict]]:
    """Prompts of 1..n words: every batch is left-padded to a different extent."""
    prompts = [" ".join(WORDS[10 + i : 11 + 2 * i]) for i in range(n)]
    contexts = [
        {"country": f"C{i}", "arrangement_type": "SBA", "econ_descriptor": "1.1"} for i in range(n)
    ]
    return prompts, contexts


def dense_reward(contexts: list[dict], texts: list[str]) -> np.ndarray:
    """Share of response words among the first 30: varies in every batch, so the policy moves."""
    low = set(WORDS[:30])
    return np.array([np.mean([w in low for w in t.split()] or [0.0]) for t in texts], np.float32)


def test_first_minibatch_has_ratio_one(tmp_path, monkeypatch):
    """Before any optimiser step the update's log-probs are the rollout's: ratio 1, no clipping."""
    calls = []

    def spy(logprobs, old_logprobs, advantages, mask, clip_range):
        out = policy_loss(logprobs, old_logprobs, advantages, mask, clip_range)
        log_ratio = ((logprobs - old_logprobs) * mask).abs().max().item()
        calls.append(
            {"log_ratio": log_ratio, "clip_frac": out[1].item(), "approx_kl": out[2].item()}
        )
        return out

    monkeypatch.setattr("rlxf_utils.rl.ppo.policy_loss", spy)
    model, tok = tiny_policy(seed=0)
    prompts, contexts = varied_contexts(8)
    # temperature != 1: both passes must divide the logits by it
    cfg = small_cfg(
        steps=2,
        batch_size=8,
        minibatch_size=4,
        update_epochs=2,
        temperature=0.7,
        learning_rate=1e-2,
    )
    tr = PPOTrainer(model, tok, prompts, contexts, dense_reward, cfg, tmp_path, seed=0)
    for step in range(2):  # step 2: the policy has moved away from the reference
        idx = tr._next_batch()
        assert len({len(prompts[i].split()) for i in idx}) > 1  # rows are padded differently
        calls.clear()
        tr.train_step()
        assert len(calls) == 4  # 2 epochs x 2 minibatches
        first = calls[0]
        assert first["log_ratio"] < 1e-5, (step, first)
        assert abs(first["approx_kl"]) < 1e-6 and first["clip_frac"] < 1e-6, (step, first)
        assert calls[-1]["log_ratio"] > 1e-4  # later minibatches do see a moved policy
    # ... and the ratio is to the rollout policy, not the reference
    assert tr.history[-1]["kl"] > 1e-4


def test_reference_is_the_starting_policy(tmp_path):
    """With adapters off, the PPO-trained model computes exactly the model it started from."""
    import copy

    tok = tiny_tokenizer()
    base = tiny_llama(tok, seed=1, init=0.3)
    start = copy.deepcopy(base).eval()
    lora = LoraSettings(rank=8, alpha=16, target_modules=["q_proj", "v_proj", "o_proj"])
    model = apply_lora(base, lora)
    prompts, contexts = toy_contexts(8)
    cfg = small_cfg(steps=3, learning_rate=1e-2, checkpoint_every=10)
    tr = PPOTrainer(model, tok, prompts, contexts, dense_reward, cfg, tmp_path / "ppo", seed=0)
    log = tr.train(progress=False)
    assert abs(log.kl.iloc[0]) < 1e-5  # step 1: zero-initialised LoRA, the policy is the reference
    enc = encode_prompts(
        tok, [*prompts, "w1", "w2 w3 w4 w5 w6 w7"], return_tensors="pt", padding=True
    )
    enc = {k: v.to(tr.device) for k, v in enc.items()}  # the trainer's device (a GPU if any)
    pos = (enc["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    policy = tr.unwrapped.policy
    start.to(tr.device)
    with torch.no_grad():
        want = start(**enc, position_ids=pos).logits
        with policy.disable_adapter():
            ref = policy(**enc, position_ids=pos).logits
        tuned = policy(**enc, position_ids=pos).logits
    torch.testing.assert_close(ref, want, rtol=0, atol=1e-6)
    assert (tuned - want).abs().max() > 1e-3  # training moved the adapters: the check has teeth


@pytest.mark.parametrize("profile", ["smoke", "default", "paper"])
def test_beta_moves_under_shipped_settings(profile):
    rl = load_config(PROJECT_ROOT / "params" / f"{profile}.yaml").rl
    if not rl.adaptive_kl:
        pytest.skip(f"{profile}: fixed beta")
    up, down = kl_controller(rl), kl_controller(rl)
    # a KL persistently twice the target (or zero) moves beta by the full ratio every step (by
    # its square root down), no further than its range
    (low, high), r = rl.kl_coef_range, rl.kl_step_ratio
    for _ in range(rl.steps):
        up.update(2 * rl.target_kl)
        down.update(0.0)
    assert up.value == pytest.approx(min(rl.kl_coef * r**rl.steps, high)), (profile, up.value)
    assert down.value == pytest.approx(max(rl.kl_coef * r ** (-rl.steps / 2), low)), profile
    assert up.value > rl.kl_coef or rl.kl_coef == high


def test_the_critic_learns_the_return(tmp_path):
    """A critic that starts off the reward's scale (bias 0, not set from the batch) moves towards
    a constant return of 0.7 as it trains: the value loss reaches the head."""
    model, tok = tiny_policy(seed=0)
    prompts, contexts = toy_contexts(8)

    def constant(ctx, texts):
        return np.full(len(texts), 0.7, dtype=np.float32)

    cfg = small_cfg(steps=6, critic_init="mean", value_learning_rate=5e-2, kl_coef=0.0,
                    adaptive_kl=False)  # fmt: skip
    tr = PPOTrainer(model, tok, prompts, contexts, constant, cfg, tmp_path, seed=0)
    tr.value_initialised.add("value_head")  # keep the zero bias: the head must learn 0.7
    values = [tr.train_step()["value_mean"] for _ in range(6)]
    assert abs(values[-1] - 0.7) < 0.5 * abs(values[0] - 0.7), values


def test_critic_starts_on_the_rewards_scale(tmp_path):
    model, tok = tiny_policy(seed=0)
    prompts, contexts = toy_contexts(8)

    def constant(ctx, texts):
        return np.full(len(texts), 0.7, dtype=np.float32)

    cfg = small_cfg(steps=2, critic_init="mean")
    tr = PPOTrainer(model, tok, prompts, contexts, constant, cfg, tmp_path, seed=0)
    head = tr.unwrapped.value_head.summary
    assert not head.weight.any() and head.bias.item() == 0  # zero-initialised
    row = tr.train_step()
    assert abs(row["reward_mean"] - 0.7) < 1e-6
    assert abs(head.bias.item() - 0.7) < 0.05  # set from the first batch (and one update since)
    # the bias is set once: a later batch's scores do not reset it
    head.bias.data.fill_(0.3)
    tr.train_step()
    assert abs(head.bias.item() - 0.7) > 0.1

    # a varying reward: the critic starts at the first batch's mean score
    model, tok = tiny_policy(seed=1)
    cfg = small_cfg(steps=1, critic_init="mean")
    tr = PPOTrainer(model, tok, prompts, contexts, toy_reward, cfg, tmp_path / "b", seed=1)
    row = tr.train_step()
    assert abs(row["value_mean"] - row["reward_mean"]) < 1e-6
    assert math.isnan(row["explained_variance_prior"])  # no prior with critic_init: mean


def test_critic_initialised_from_the_reward_model(tmp_path):
    """critic_init: reward: before any update V(s_t) is the reward of the prefix y_<t in its
    context (the head is zero), the bias stays 0, and the prior's own fit is logged."""
    model, tok = tiny_policy(seed=2)
    prompts, contexts = toy_contexts(8)

    def by_context_and_length(ctx, texts):  # depends on both, as the reward model does
        return np.asarray(
            [0.1 * int(c["country"][-1]) + 0.01 * len(t) for c, t in zip(ctx, texts, strict=True)],
            dtype=np.float32,
        )

    cfg = small_cfg(steps=1)
    assert cfg.critic_init == "reward"  # the default
    tr = PPOTrainer(model, tok, prompts, contexts, by_context_and_length, cfg, tmp_path, seed=2)
    idx = tr._next_batch()
    ro = tr.rollout(idx)
    pp = tr.prepare(ro)
    lengths = ro.response_mask.sum(1).tolist()
    for i, n in enumerate(lengths):
        for t in range(int(n)):
            text = tok.decode(ro.response_ids[i, :t], skip_special_tokens=True)
            want = by_context_and_length([contexts[idx[i]]], [text])[0]
            assert pp.old_values[i, t].item() == pytest.approx(float(want), abs=1e-5), (i, t)
        assert not pp.value_prior[i, int(n) :].any()  # nothing past the response
    assert tr.unwrapped.value_head.summary.bias.item() == 0
    row = tr.train_step()
    assert np.isfinite(row["explained_variance_prior"])


def test_critic_warmup_leaves_the_policy_alone(tmp_path):
    """The value head reads detached hidden states: critic-only steps never move the LoRA policy."""
    model, tok = tiny_policy(seed=1)
    prompts, contexts = toy_contexts(8)
    cfg = small_cfg(steps=2, value_warmup_steps=1, learning_rate=1e-2)
    tr = PPOTrainer(model, tok, prompts, contexts, dense_reward, cfg, tmp_path, seed=1)

    def lora_state():
        return {
            n: p.detach().clone()
            for n, p in tr.unwrapped.policy.named_parameters()
            if p.requires_grad
        }

    before = lora_state()
    head = tr.unwrapped.value_head.summary.weight.detach().clone()
    row = tr.train_step()
    assert row["value_loss"] > 0
    assert all(torch.equal(before[n], p) for n, p in lora_state().items())
    assert not torch.equal(head, tr.unwrapped.value_head.summary.weight)  # the critic learned
    tr.train_step()  # after the warm-up the policy moves
    assert any(not torch.equal(before[n], p) for n, p in lora_state().items())


def test_prompt_schedule_passes_seed_and_prefix():
    sched = prompt_schedule(5, 10, 2, seed=3)
    assert len(sched) == 10 and all(len(s) == 2 for s in sched)
    flat = [i for s in sched for i in s]
    for p in range(4):  # 20 draws = 4 passes, each over every prompt once
        assert sorted(flat[5 * p : 5 * p + 5]) == list(range(5))
    assert flat[:5] != flat[5:10] or flat[5:10] != flat[10:15]  # a new permutation per pass
    assert sched == prompt_schedule(5, 10, 2, seed=3)
    assert sched != prompt_schedule(5, 10, 2, seed=4)
    assert prompt_schedule(5, 17, 2, seed=3)[:10] == sched  # more steps keep the prefix


def test_trainer_batch_follows_the_schedule(tmp_path):
    model, tok = tiny_policy(seed=0)
    prompts, contexts = toy_contexts(6)
    cfg = small_cfg(steps=3, batch_size=8, num_generations=2, minibatch_size=4, update_epochs=1)
    tr = PPOTrainer(model, tok, prompts, contexts, toy_reward, cfg, tmp_path, seed=5)
    seen = []
    rollout = tr.rollout

    def spy(idx):
        seen.append(list(idx))
        return rollout(idx)

    tr.rollout = spy
    for _ in range(3):
        tr.train_step()
    sched = prompt_schedule(len(prompts), 3, cfg.prompts_per_step, seed=5)
    assert seen == [[i for i in s for _ in range(2)] for s in sched]


@pytest.mark.parametrize("sampler", ["compact", "transformers"])
def test_rollout_stops_at_the_end_tokens_generate_uses(tmp_path, sampler):
    """A generation config with an extra end id: PPO's mask and `models.generation.generate` both
    stop there (with transformers' sampler, one torch seed: the very same samples)."""
    model, tok = tiny_policy(seed=0)
    extra = tok.convert_tokens_to_ids("w3")
    model.generation_config.eos_token_id = [tok.eos_token_id, extra]
    stop = {tok.eos_token_id, extra}

    def favour_extra(module, args, output):  # the extra end token ~1 in 4: it ends responses early
        output = output.clone()
        output[..., extra] += 3.0
        return output

    model.base_model.model.lm_head.register_forward_hook(favour_extra)
    prompts, contexts = toy_contexts(8)
    cfg = small_cfg(max_new_tokens=10, batch_size=8)
    tr = PPOTrainer(
        model, tok, prompts, contexts, toy_reward, cfg, tmp_path, seed=0, sampler=sampler
    )
    assert set(tr.stop_ids) == eos_ids(model, tok) == stop
    torch.manual_seed(11)
    ro = tr.rollout(list(range(8)))
    df = generate(
        tr.unwrapped.policy, tok, prompts, 1, max_new_tokens=10, temperature=cfg.temperature,
        top_p=cfg.top_p, postprocess="none", seed=11, batch_size=8, progress=False, sampler=sampler,
    )  # fmt: skip
    R = ro.response_ids.shape[1]
    stopped_at_extra = 0
    for row in range(8):
        kept = ro.response_ids[row][ro.response_mask[row].bool()].tolist()
        assert ro.response_mask[row].tolist() == [1] * len(kept) + [0] * (R - len(kept))
        assert not stop & set(kept[:-1])  # no end token before the last kept one
        if len(kept) < cfg.max_new_tokens:
            assert kept[-1] in stop
        stopped_at_extra += kept[-1] == extra
        resp = df.response_ids[row]
        assert df.finished[row] == (resp[-1] in stop) and not stop & set(resp[:-1])
        if sampler == "transformers":
            assert kept == resp  # the same samples, trimmed the same way
    assert stopped_at_extra >= 2  # the extra id did end responses (the test has teeth)
    assert sum(r[-1] == extra for r in df.response_ids) >= 2
