"""RLGF (PPO++, AggreVaTeD, LOLS, D²LOLS) on tiny models: masks, forced prefixes, PPO equivalence,
the guide's critic, schedules and exact resume."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_ppo import (
    WORDS,
    dense_reward,
    small_cfg,
    tiny_policy,
    tiny_tokenizer,
    toy_contexts,
    varied_contexts,
)
from tiny import tiny_llama

from rlxf_utils.algorithms import RLGF_ALGORITHMS
from rlxf_utils.config import RLGFConfig
from rlxf_utils.rl.core import logprobs_from_logits, policy_loss, value_loss
from rlxf_utils.rl.ppo import PPOTrainer
from rlxf_utils.rl.rlgf import (
    AGGREVATED,
    PPO_PP,
    GuidedPPOTrainer,
    ownership_masks,
    scheme_at,
    switch_points,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_guide(seed: int = 7):
    """A different random model on the same tokenizer: its samples differ from the policy's."""
    return tiny_llama(tiny_tokenizer(), seed, init=0.3).eval()


def guided(algo, tmp_path, rlgf=None, references=None, seed=0, **cfg_kw):
    model, tok = tiny_policy(seed=0)
    prompts, contexts = varied_contexts(8)
    cfg = small_cfg(**{"steps": 4, "batch_size": 8, "minibatch_size": 4, **cfg_kw})
    rlgf = rlgf or RLGFConfig(mle_coef=0.0)
    return GuidedPPOTrainer(
        algo, model, tiny_guide(), tok, prompts, contexts, dense_reward, cfg, rlgf, tmp_path,
        references=references, seed=seed,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Draws and masks
# ---------------------------------------------------------------------------------------------
def test_switch_points_follow_the_paper():
    rng = np.random.default_rng(0)
    lengths = np.array([0, 1, 2, 5, 48] * 400)
    h = switch_points(lengths, np.ones(len(lengths), bool), rng)
    assert (h[lengths < 2] == 0).all()  # too short to split
    for n in (2, 5, 48):
        got = h[lengths == n]
        assert got.min() == 1 and got.max() == n - 1  # Uniform{1..L-1}
    assert (switch_points(lengths, np.zeros(len(lengths), bool), rng) == 0).all()


def test_ownership_masks_split_at_h():
    h = torch.tensor([0, 2, 4])
    learner, critic = ownership_masks(h, 4, PPO_PP)
    assert learner.tolist() == [[1, 1, 1, 1], [0, 0, 1, 1], [0, 0, 0, 0]]
    assert critic.tolist() == learner.tolist()
    learner, critic = ownership_masks(h, 4, AGGREVATED)
    assert learner.tolist() == [[0, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
    assert critic.tolist() == [[1, 1, 1, 1], [0, 0, 1, 1], [0, 0, 0, 0]]
    with pytest.raises(ValueError, match="scheme"):
        ownership_masks(h, 4, "ppo")


def test_schemes_per_algorithm():
    rg = RLGFConfig(tau=0.8, switch_fraction=0.4)
    assert [scheme_at("d2lols", s, 10, rg, 0) for s in range(10)] == [AGGREVATED] * 4 + [PPO_PP] * 6
    assert {scheme_at("ppo_pp", s, 10, rg, 0) for s in range(10)} == {PPO_PP}
    assert {scheme_at("aggrevated", s, 10, rg, 0) for s in range(10)} == {AGGREVATED}
    lols = [scheme_at("lols", s, 2000, rg, 3) for s in range(2000)]
    assert abs(lols.count(PPO_PP) / 2000 - 0.8) < 0.04  # PPO++ with probability tau
    assert lols == [scheme_at("lols", s, 2000, rg, 3) for s in range(2000)]  # reproducible
    with pytest.raises(ValueError, match="not an RLGF algorithm"):
        scheme_at("ppo", 0, 10, rg, 0)


def test_forced_prefix_is_reproduced_token_for_token(tmp_path):
    tr = guided("ppo_pp", tmp_path)
    enc = tr.encode(list(range(8)))
    ids, mask = tr.sample(tr.guide, enc, 1.0, 1.0)
    h = torch.arange(8, device=mask.device).clamp(max=mask.sum(1) - 1).clamp(min=0)
    out, out_mask = tr.sample(tr.unwrapped.policy, enc, 1.0, 1.0, prefix=(ids, h))
    for i in range(8):
        assert out[i, : h[i]].tolist() == ids[i, : h[i]].tolist()
    # ... and the roll-out goes its own way after the prefix (a different model samples it)
    assert any(out[i, h[i] :].tolist() != ids[i, h[i] :].tolist() for i in range(8))


# ---------------------------------------------------------------------------------------------
# PPO++ with beta = 0 is PPO
# ---------------------------------------------------------------------------------------------
def test_ppo_pp_with_beta_zero_is_ppo_with_the_same_mle_term(tmp_path, monkeypatch):
    """At the shipped RLGF settings (default.yaml's eta) with beta = 0, PPO++ draws no switch:
    same samples, same losses (MLE term included), same parameters as `ppo_mle` (PPO with the
    term). The term really acts: it is non-zero at every minibatch with a reference."""
    from rlxf_utils.config import PROJECT_ROOT, load_config

    shipped = load_config(PROJECT_ROOT / "params/default.yaml").rlgf
    assert shipped.mle_coef > 0
    rg = shipped.model_copy(update={"beta_ppo_pp": 0.0})
    losses: dict[str, list[float]] = {"ppo": [], "ppo_pp": []}
    extras: dict[str, list[float]] = {"ppo": [], "ppo_pp": []}
    real, real_extra = policy_loss, PPOTrainer.extra_loss
    current = []

    def spy(*a, **k):
        out = real(*a, **k)
        losses[current[0]].append(out[0].item())
        return out

    def spy_extra(self, ro, mb):
        out = real_extra(self, ro, mb)
        extras[current[0]].append(math.nan if out is None else out.item())
        return out

    monkeypatch.setattr("rlxf_utils.rl.ppo.policy_loss", spy)
    monkeypatch.setattr(PPOTrainer, "extra_loss", spy_extra)
    prompts, contexts = varied_contexts(8)
    tok = tiny_tokenizer()
    ref = tok(" ".join(WORDS[40:44]), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    refs = [[ref] if i % 2 else [] for i in range(8)]
    cfg = small_cfg(steps=2, batch_size=8, minibatch_size=4, learning_rate=1e-2)
    model, tok = tiny_policy(seed=0)
    current[:] = ["ppo"]
    ppo = PPOTrainer(model, tok, prompts, contexts, dense_reward, cfg, tmp_path / "a", seed=3,
                     references=refs, mle_coef=rg.mle_coef)  # fmt: skip
    ppo.train(progress=False)
    model, tok = tiny_policy(seed=0)
    current[:] = ["ppo_pp"]
    pp = GuidedPPOTrainer(
        "ppo_pp", model, tiny_guide(), tok, prompts, contexts, dense_reward, cfg, rg,
        tmp_path / "b", seed=3, references=refs,
    )  # fmt: skip
    pp.train(progress=False)
    assert len(losses["ppo"]) == 8 and losses["ppo"] == losses["ppo_pp"]
    fired = [x for x in extras["ppo"] if not math.isnan(x)]
    assert fired and all(x > 0 for x in fired)
    np.testing.assert_array_equal(extras["ppo"], extras["ppo_pp"])
    a, b = ppo.log_frame(), pp.log_frame()
    cols = ["reward_mean", "kl", "policy_loss", "value_loss", "explained_variance", "entropy"]
    np.testing.assert_array_equal(a[cols].to_numpy(), b[cols].to_numpy())
    assert (b["learner_share"] == 1.0).all() and (b["scheme"] == PPO_PP).all()
    for (n, p1), (_, p2) in zip(
        ppo.unwrapped.policy.named_parameters(), pp.unwrapped.policy.named_parameters(), strict=True
    ):
        assert torch.equal(p1, p2), n


# ---------------------------------------------------------------------------------------------
# Gradient ownership and the guide's critic
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("algo", [PPO_PP, AGGREVATED])
def test_policy_gradient_acts_on_the_learners_tokens_only(tmp_path, algo):
    """Per-token gradients of the surrogate w.r.t. the log-probs vanish outside the learner mask."""
    rg = RLGFConfig(beta_ppo_pp=1.0, beta_aggrevated=1.0, mle_coef=0.0)
    tr = guided(algo, tmp_path, rlgf=rg, max_new_tokens=8)
    ro = tr.rollout(tr._next_batch())
    pp = tr.prepare(ro)
    owned = pp.pg_mask.bool()
    assert owned.any() and (~owned & pp.mask.bool()).any()  # both owners wrote tokens
    R = ro.response_ids.shape[1]
    logits, _ = tr.module(ro.input_ids, ro.attention_mask, R, critic=ro.critic)
    logp = logprobs_from_logits(logits, ro.response_ids)
    logp.retain_grad()
    loss, _, _ = policy_loss(logp, pp.old_logprobs, pp.advantages, pp.pg_mask, 0.2)
    loss.backward()
    assert (logp.grad[~owned] == 0).all()
    assert (logp.grad[owned] != 0).any()
    # the learner's tokens are the roll-out's (PPO++) or the roll-in's (AggreVaTeD)
    first_owned = owned.float().argmax(1)
    if algo == PPO_PP:
        assert (first_owned[owned.any(1)] >= 1).all()  # the guide wrote at least one token first
    else:
        assert owned[:, 0][owned.any(1)].all()  # the policy wrote the prefix


@pytest.mark.parametrize("beta_paper", [1.0, 0.0])
def test_aggrevated_is_the_papers_algorithm_2_with_one_minus_its_beta(tmp_path, beta_paper):
    """Algorithm 2 rolls in from beta_paper d^{pi_g} + (1 - beta_paper) d^{pi_theta} and rolls
    out with the guide. A guide-state roll-in, continued by the guide, is a whole guide response
    whose tokens train V_g and no policy token (TRIL's h = 0); a policy roll-in gives a policy
    prefix finished by the guide. With beta_aggrevated = 1 - beta_paper the rollout draws them
    in the paper's shares: beta_paper = 1, only guide responses; 0, (almost) only policy
    prefixes (a policy roll-in shorter than 2 tokens cannot be split)."""
    rg = RLGFConfig(beta_aggrevated=1.0 - beta_paper, mle_coef=0.0)
    assert rg.beta_aggrevated_paper == beta_paper
    tr = guided(AGGREVATED, tmp_path, rlgf=rg, max_new_tokens=8, batch_size=16)
    ro = tr.rollout(tr._next_batch())
    pp = tr.prepare(ro)
    policy_prefix = pp.pg_mask.bool().any(1)
    whole_guide = ~policy_prefix
    # a whole guide response: V_g is fitted on every token of it, no policy gradient
    assert torch.equal(pp.vf_mask.bool()[whole_guide], pp.mask.bool()[whole_guide])
    assert not pp.pg_mask.bool()[whole_guide].any()
    if beta_paper == 1.0:
        assert whole_guide.all()
    else:
        assert policy_prefix.float().mean() >= 0.75, policy_prefix
        assert pp.pg_mask.bool()[policy_prefix][:, 0].all()  # the policy wrote the first token


def test_aggrevated_trains_the_guide_critic_on_guide_tokens_only(tmp_path):
    rg = RLGFConfig(beta_aggrevated=1.0, mle_coef=0.0)
    tr = guided(AGGREVATED, tmp_path, rlgf=rg)
    policy_head = {k: v.clone() for k, v in tr.unwrapped.value_head.state_dict().items()}
    guide_head = {k: v.clone() for k, v in tr.unwrapped.guide_value_head.state_dict().items()}
    ro = tr.rollout(tr._next_batch())
    assert ro.critic == "guide_value_head" and ro.scheme == AGGREVATED
    pp = tr.prepare(ro)
    guide_tokens = ro.response_mask.bool() & (ro.learner_mask == 0)
    assert torch.equal(pp.vf_mask.bool(), guide_tokens)
    # the value loss is blind to returns on the learner's tokens
    R = ro.response_ids.shape[1]
    _, values = tr.module(ro.input_ids, ro.attention_mask, R, critic=ro.critic)
    shifted = pp.returns + 100.0 * (~guide_tokens).float()
    a, _ = value_loss(values, pp.old_values, pp.returns, pp.vf_mask, None)
    b, _ = value_loss(values, pp.old_values, shifted, pp.vf_mask, None)
    assert torch.equal(a, b)
    tr.update(ro, pp)
    after = tr.unwrapped.guide_value_head.state_dict()
    assert any(not torch.equal(guide_head[k], after[k]) for k in after)  # V_g learned
    for k, v in tr.unwrapped.value_head.state_dict().items():  # the policy's critic did not
        assert torch.equal(policy_head[k], v), k


def test_guided_steps_move_the_policy_and_log_their_scheme(tmp_path):
    rg = RLGFConfig(switch_fraction=0.5, mle_coef=0.0)
    tr = guided("d2lols", tmp_path, rlgf=rg, steps=4)
    before = [p.clone() for p in tr._policy_params]
    log = tr.train(progress=False)
    assert log["scheme"].tolist() == [AGGREVATED, AGGREVATED, PPO_PP, PPO_PP]
    assert ((log["learner_share"] > 0) & (log["learner_share"] <= 1)).all()
    assert any(not torch.equal(a, b) for a, b in zip(before, tr._policy_params, strict=True))
    for f in (
        "adapter/adapter_config.json",
        "value_head.safetensors",
        "guide_value_head.safetensors",
    ):
        assert (tmp_path / f).is_file(), f


def test_kl_and_reward_are_logged_on_the_learners_own_tokens(tmp_path, monkeypatch):
    """AggreVaTeD with guide-written tokens: `kl` (k1, driving beta) sums only the learner's
    tokens, `kl_all_tokens` every token; `reward_learner` averages only responses the learner
    wrote whole; the controller is fed the learner's KL."""
    from rlxf_utils.rl.core import AdaptiveKLController

    fed = []
    real = AdaptiveKLController.update

    def spy(self, kl, n):
        fed.append(kl)
        return real(self, kl, n)

    monkeypatch.setattr(AdaptiveKLController, "update", spy)
    rg = RLGFConfig(beta_aggrevated=0.5, mle_coef=0.0)
    tr = guided(AGGREVATED, tmp_path, rlgf=rg, steps=3, learning_rate=5e-2, adaptive_kl=True)
    log = tr.train(progress=False)
    assert fed == log["kl"].tolist()
    assert (log["kl_estimator"].str.startswith("k1")).all()
    assert (log["kl_k3"] >= 0).all()
    mixed = (log["learner_share"] < 1) & (log["step"] > 1)  # step 1: the policy is the reference
    assert mixed.any()
    # guide-written tokens count in kl_all_tokens only
    assert (log.loc[mixed, "kl"] != log.loc[mixed, "kl_all_tokens"]).all()
    # AggreVaTeD: h = 0 responses are the guide's whole, the rest carry guide suffixes, so no
    # response is the learner's own unless the guide wrote nothing after its prefix
    assert log["reward_learner"].isna().any() or (log["reward_learner"] != log["reward_mean"]).any()


def test_ppo_logs_the_same_kl_on_every_token_and_its_k3(tmp_path):
    tr = guided(PPO_PP, tmp_path, rlgf=RLGFConfig(beta_ppo_pp=0.0, mle_coef=0.0), steps=2,
                learning_rate=5e-2)  # fmt: skip
    log = tr.train(progress=False)
    np.testing.assert_array_equal(log["kl"], log["kl_all_tokens"])
    np.testing.assert_array_equal(log["reward_learner"], log["reward_mean"])
    assert not np.allclose(log["kl"], log["kl_k3"])  # two estimators, not one copied


def test_mle_term_pulls_towards_the_references(tmp_path):
    """eta > 0 adds eta * NLL of a reference of the minibatch's contexts; contexts without one add none."""
    tok = tiny_tokenizer()
    ref = tok(" ".join(WORDS[40:44]), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    refs = [[ref]] + [[] for _ in range(7)]
    tr = guided(PPO_PP, tmp_path, rlgf=RLGFConfig(mle_coef=0.5), references=refs)
    ro = tr.rollout([0, 0, 1, 1, 2, 2, 3, 3])
    loss = tr.extra_loss(ro, torch.tensor([0, 1]))
    assert loss is not None and loss.item() > 0
    assert tr.extra_loss(ro, torch.tensor([2, 3, 4])) is None  # no references there
    from rlxf_utils.rl.sft import SFTExample, collate, response_loss

    batch = collate([SFTExample(tr._prompt(0), ref)], tok.pad_token_id)
    batch = {k: v.to(tr.device) if torch.is_tensor(v) else v for k, v in batch.items()}
    nll, _ = response_loss(tr.unwrapped.policy, batch)
    assert loss.item() == pytest.approx(0.5 * nll.item(), rel=1e-5)


@pytest.mark.parametrize("algo", RLGF_ALGORITHMS)
def test_resume_matches_uninterrupted(tmp_path, algo):
    prompts, contexts = toy_contexts(8)
    cfg = small_cfg(steps=4, checkpoint_every=2)
    rg = RLGFConfig(switch_fraction=0.5, tau=0.5, mle_coef=0.1)
    tok = tiny_tokenizer()
    ref = tok(" ".join(WORDS[40:44]), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    refs = [[ref] if i % 2 else [] for i in range(8)]

    def run(out, interrupt_at=None):
        model, tok = tiny_policy(seed=0)
        tr = GuidedPPOTrainer(
            algo, model, tiny_guide(), tok, prompts, contexts, dense_reward, cfg, rg, out,
            references=refs, seed=5,
        )  # fmt: skip

        def cb(step, row):
            if step == interrupt_at:
                raise KeyboardInterrupt

        try:
            tr.train(progress=False, callback=cb)
        except KeyboardInterrupt:
            model, tok = tiny_policy(seed=0)
            tr = GuidedPPOTrainer(
                algo, model, tiny_guide(), tok, prompts, contexts, dense_reward, cfg, rg, out,
                references=refs, seed=5,
            )  # fmt: skip
            tr.train(progress=False)
        return tr

    full = run(tmp_path / "full")
    resumed = run(tmp_path / "cut", interrupt_at=3)  # after the checkpoint at step 2
    drop = ["tokens_per_s", "gen_time_s", "step_time_s"]
    a, b = full.log_frame().drop(columns=drop), resumed.log_frame().drop(columns=drop)
    assert a["scheme"].tolist() == b["scheme"].tolist()
    np.testing.assert_allclose(a.select_dtypes("number"), b.select_dtypes("number"), rtol=1e-5)
    for (n, p1), (_, p2) in zip(
        full.unwrapped.named_parameters(), resumed.unwrapped.named_parameters(), strict=True
    ):
        assert torch.allclose(p1, p2, atol=1e-6), n


def test_met_references_are_met_rows_the_rl_stage_may_see_of_the_same_context(tmp_path):
    """Only the policy pool's rows, MET, of the same context."""
    from test_sft import _toy_data

    from rlxf_utils.artifacts import RunDir
    from rlxf_utils.config import PROJECT_ROOT, load_config
    from rlxf_utils.rl.sft import met_references

    labelled, splits, contexts = _toy_data()
    run = RunDir(tmp_path)
    run.write_parquet("data/conditions.parquet", labelled.assign(label="MET"))
    run.write_json("data/splits.json", splits)
    run.write_parquet("data/contexts.parquet", contexts)
    # the policy pool: rows of A, B, C (101, 103: Non-MET); 109 (D) is a reference, 110 audit
    run.write_json("data/holdout.json", {"policy": [100, 101, 103, 104, 106], "reference": [109],
                                         "audit_train": [110], "audit_val": [],
                                         "eval_countries": ["D"]})  # fmt: skip
    cfg = load_config(PROJECT_ROOT / "params/smoke.yaml")
    cfg.reward.reward_protocol = "grouped"
    tok = tiny_tokenizer()
    ctx = contexts.to_dict("records")
    refs = met_references(cfg, tmp_path, ctx, tok, tiny_guide())
    decoded = [[tok.decode(r[:-1]) for r in rs] for rs in refs]
    eos = tok.eos_token_id
    assert all(r[-1] == eos for rs in refs for r in rs)  # each ends in the end token
    # the pool's MET rows of A, B, C: 100 (A), 104 (B), 106 (C); D is held out
    assert decoded == [["w10 w20"], ["w10 w20"], ["w14 w24"], ["w16 w26"], [], []]
