"""ILHF (inclusive learning, the LM as its own reward) and its ensemble, on tiny models."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
from test_ppo import WORDS, small_cfg, tiny_tokenizer, toy_contexts
from tiny import tiny_llama

from rlxf_utils.config import ILHFConfig, LoraSettings, RLConfig
from rlxf_utils.models.ensemble import (
    add_particles,
    is_ensemble,
    load_particles,
    mixture_logprobs,
    particle_parameters,
    thompson_draw,
)
from rlxf_utils.models.generation import generate
from rlxf_utils.rl.didactic import didactic
from rlxf_utils.rl.history_pairs import history_pairs
from rlxf_utils.rl.ilhf import (
    ILHFHistoryTrainer,
    ILHFOnlineTrainer,
    ILHFTrainer,
    double_or_nothing,
    ilhf_loss,
    pair_probability,
)

pytestmark = pytest.mark.usefixtures("one_thread")
LORA = LoraSettings(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "o_proj"])


def ensemble(particles=3, prior_scale=0.01, seed=0):
    tok = tiny_tokenizer()
    model = tiny_llama(tok, 0, init=0.3)
    return add_particles(model, LORA, particles, prior_scale, seed), tok


# ---------------------------------------------------------------------------------------------
# The loss
# ---------------------------------------------------------------------------------------------
def test_loss_equals_the_formula_by_hand():
    la = torch.tensor([-3.0, -10.0, -2.0], dtype=torch.float64)
    lb = torch.tensor([-4.0, -9.0, -2.0], dtype=torch.float64)
    p = torch.tensor([1.0, 0.25, 0.5], dtype=torch.float64)
    got = ilhf_loss(la, lb, p)
    # by hand: q_a = e^la / (e^la + e^lb); KL(P||Q) = sum p log p - p log q
    expected = []
    for a, b, pa in zip(la.tolist(), lb.tolist(), p.tolist(), strict=True):
        qa = math.exp(a) / (math.exp(a) + math.exp(b))
        kl = 0.0
        for pi, qi in ((pa, qa), (1 - pa, 1 - qa)):
            if pi > 0:
                kl += pi * math.log(pi / qi)
        expected.append(kl)
    assert got.item() == pytest.approx(np.mean(expected), rel=1e-6)
    # hard label: -log pi(win) + log(pi(A) + pi(B)); equal likelihoods at P = 1/2: zero loss
    assert ilhf_loss(la[:1], lb[:1], p[:1]).item() == pytest.approx(
        3.0 + math.log(math.exp(-3.0) + math.exp(-4.0)), rel=1e-6
    )
    assert ilhf_loss(la[2:], lb[2:], p[2:]).item() == pytest.approx(0.0, abs=1e-7)
    # weights: double-or-nothing zeroes the first pair, doubles the others
    w = torch.tensor([0.0, 2.0, 2.0], dtype=torch.float64)
    assert ilhf_loss(la, lb, p, w).item() == pytest.approx(2 * sum(expected[1:]) / 3, rel=1e-6)


def test_loss_gradient_moves_towards_the_label():
    la = torch.tensor([-2.0], requires_grad=True)
    lb = torch.tensor([-2.0], requires_grad=True)
    ilhf_loss(la, lb, torch.tensor([0.9])).backward()
    assert la.grad.item() < 0 < lb.grad.item()  # raise A's likelihood, lower B's


def test_pair_probability_is_bradley_terry_on_log_scores():
    a, b = np.array([0.6, 0.2, 0.0]), np.array([0.3, 0.2, 0.0])
    p = pair_probability(a, b)
    sig = 1 / (1 + np.exp(-(np.log(0.6) - np.log(0.3))))
    assert p[0] == pytest.approx(sig) and p[1] == 0.5 and p[2] == 0.5


def test_double_or_nothing_and_thompson_draws():
    w = double_or_nothing(20000, np.random.default_rng(0))
    assert set(np.unique(w)) == {0.0, 2.0} and w.mean() == pytest.approx(1.0, abs=0.03)
    z = thompson_draw(30000, 3, seed=5)
    counts = np.bincount(z, minlength=3) / len(z)
    assert np.allclose(counts, 1 / 3, atol=0.015)  # uniform over particles
    assert (thompson_draw(100, 3, 5) == z[:100]).all()  # seeded


def test_mixture_logprobs():
    got = mixture_logprobs([np.log([0.2, 0.5]), np.log([0.4, 0.5])])
    assert np.allclose(np.exp(got), [0.3, 0.5])


# ---------------------------------------------------------------------------------------------
# The paper's didactic example: inclusive vs agglomerative
# ---------------------------------------------------------------------------------------------
def test_didactic_ilhf_reaches_the_population_while_reinforce_collapses():
    ilhf = didactic("ilhf", steps=400, seed=0)
    # pretraining 0.77 / 0.23, the population prefers response 0 two times in three
    assert ilhf["p1"].iloc[0] == pytest.approx(0.23)
    assert ilhf["p1"].tail(100).mean() == pytest.approx(1 / 3, abs=0.03)
    for beta in (0.1, 1.0):
        rf = didactic("reinforce", steps=400, kl_coef=beta, seed=0)
        end = rf["p1"].tail(50).mean()
        # REINFORCE with a KL penalty ends below both the population (1/3) and pretraining (0.23):
        # its optimum is pi_pre * exp(r / beta), which over-concentrates on the majority response
        optimum = 0.23 * 2 ** (-0.5 / beta) / (0.23 * 2 ** (-0.5 / beta) + 0.77 * 2 ** (0.5 / beta))
        assert end < 0.2
        assert end == pytest.approx(optimum, abs=0.03)
    assert didactic("reinforce", steps=400, kl_coef=0.1)["p1"].iloc[-1] < 0.03  # collapse
    with pytest.raises(ValueError, match="method"):
        didactic("ppo")


# ---------------------------------------------------------------------------------------------
# Pairs from history
# ---------------------------------------------------------------------------------------------
def history_frame() -> pd.DataFrame:
    rows = []
    rid = 0
    for c in ("A", "B", "C"):
        for k, y in enumerate([1, 0, 1, 0, 0]):
            rows.append({"row_id": rid, "country": c, "arrangement_type": "SBA",
                         "econ_descriptor": "1.1 Fiscal", "description": f"cond {c} {k}", "y": y})  # fmt: skip
            rid += 1
    # a repeated description (same arrangement's reviews) and a lone context
    rows.append({"row_id": rid, "country": "A", "arrangement_type": "SBA", "econ_descriptor": "1.1 Fiscal",
                 "description": "cond  A 0", "y": 1})  # fmt: skip
    rows.append({"row_id": rid + 1, "country": "D", "arrangement_type": "ECF", "econ_descriptor": "2.1 Monetary",
                 "description": "only one", "y": 1})  # fmt: skip
    return pd.DataFrame(rows)


def test_history_pairs_stay_within_a_context_and_label_by_outcome():
    rows = history_frame()
    pairs = history_pairs(rows, max_pairs=100, per_context=50, seed=0)
    by_id = rows.set_index("row_id")
    assert len(pairs) == 3 * 10  # C(5, 2) distinct pairs per context; the repeat and D add none
    for r in pairs.itertuples():
        a, b = by_id.loc[r.row_a], by_id.loc[r.row_b]
        assert a.country == b.country == r.country  # never mixes contexts
        assert r.text_a != r.text_b
        expected = 0.5 if a.y == b.y else float(a.y > b.y)
        assert r.p_a == expected
    assert {0.0, 0.5, 1.0} <= set(pairs["p_a"])  # both orders and same-outcome pairs
    capped = history_pairs(rows, max_pairs=7, per_context=3, seed=1)
    assert len(capped) == 7 and capped.groupby("country").size().max() <= 3


def test_history_pairs_use_only_rows_the_rl_stage_may_see():
    from rlxf_utils.data.contexts import eligible_rows

    labelled = history_frame()
    labelled["arrangement_id"] = labelled["country"]
    contexts = pd.DataFrame(
        {"country": ["A", "B", "C", "D"], "split": ["train", "train", "eval", "train"]}
    )
    in_eval = set(contexts.loc[contexts["split"] == "eval", "country"])
    holdout = {"policy": [i for i, c in zip(labelled["row_id"], labelled["country"], strict=True)
                          if i % 5 != 4 and c not in in_eval]}  # fmt: skip
    rows = eligible_rows(labelled, holdout, "all")
    pairs = history_pairs(rows, 100, 50, 0)
    used = set(pairs["row_a"]) | set(pairs["row_b"])
    assert used and used <= set(holdout["policy"])  # the policy pool's rows only
    assert "C" not in set(pairs["country"])  # no held-out (eval) country


# ---------------------------------------------------------------------------------------------
# The ensemble
# ---------------------------------------------------------------------------------------------
def test_particles_differ_after_perturbation_and_start_near_the_model():
    model, tok = ensemble(particles=3, prior_scale=0.01)
    b = {n: torch.cat([q.flatten() for k, q in model.named_parameters() if f"lora_B.{n}." in k])
         for n in ("p0", "p1", "p2")}  # fmt: skip
    assert all(
        len(particle_parameters(model, n)) == 2 * 3 * 2 for n in b
    )  # A, B x 3 modules x 2 layers
    assert not torch.equal(b["p0"], b["p1"]) and not torch.equal(b["p1"], b["p2"])
    assert 0.005 < float(b["p0"].std()) < 0.02  # B ~ N(0, 0.01^2)
    # a zero prior scale: every particle is the model itself
    flat, _ = ensemble(particles=2, prior_scale=0.0)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        flat.set_adapter("p0")
        a = flat(input_ids=ids).logits
        with flat.disable_adapter():
            base = flat(input_ids=ids).logits
    assert torch.allclose(a, base)
    with torch.no_grad():
        model.set_adapter("p0")
        l0 = model(input_ids=ids).logits
        model.set_adapter("p1")
        l1 = model(input_ids=ids).logits
    assert not torch.allclose(l0, l1)


def test_update_trains_each_particle_towards_the_preference():
    model, tok = ensemble(particles=2)
    ic = ILHFConfig(particles=2, learning_rate=1e-2, prior_reg=0.0, bootstrap=False)
    tr = ILHFTrainer(model, tok, ic, small_cfg(), "/tmp/unused", "ilhf_history")
    prompt = tok("w10 w11", add_special_tokens=False)["input_ids"]
    a, b = tok("w20 w21 <eos>")["input_ids"], tok("w30 w31 <eos>")["input_ids"]
    pairs = [(prompt, a, b, 1.0)] * 4

    def margin(name):
        model.set_adapter(name)
        with torch.no_grad():
            lp = tr.sequence_logprobs([prompt, prompt], [a, b])
        return float(lp[0] - lp[1])

    before = {n: margin(n) for n in ("p0", "p1")}
    for s in range(15):
        stats = tr.update(pairs, 1.0, 4, 4, draw_seed=s)
    after = {n: margin(n) for n in ("p0", "p1")}
    assert all(after[n] > before[n] + 1.0 for n in before)  # both particles learned A > B
    assert stats["pref_accuracy"] == 1.0 and stats["mixed_pairs"] == 4


def test_prior_pull_keeps_particles_near_their_start():
    torch.manual_seed(0)
    moved = {}
    for eta in (0.0, 50.0):
        model, tok = ensemble(particles=1)
        ic = ILHFConfig(particles=1, learning_rate=1e-2, prior_reg=eta, bootstrap=False)
        tr = ILHFTrainer(model, tok, ic, small_cfg(), "/tmp/unused", "ilhf_history")
        prompt = tok("w10", add_special_tokens=False)["input_ids"]
        pairs = [(prompt, tok("w20 <eos>")["input_ids"], tok("w30 <eos>")["input_ids"], 1.0)] * 4
        for s in range(20):
            tr.update(pairs, 1.0, 4, 4, draw_seed=s)
        moved[eta] = float(tr._prior("p0"))
    assert moved[50.0] < 0.5 * moved[0.0]


def test_the_papers_prior_scaling_pulls_n_times_harder_than_map():
    """Algorithm 2 adds eta ||phi - phi_0||^2 to each minibatch's loss (`paper`); `map` divides
    it by the pairs of an epoch. At the paper's eta = 1, over 16 pairs the paper's pull keeps the
    particle closer to its start than the MAP reading does."""
    from rlxf_utils.rl.ilhf import prior_coefficient

    assert prior_coefficient(ILHFConfig(prior_reg=1.0, prior_scaling="paper"), 256) == 1.0
    assert prior_coefficient(ILHFConfig(prior_reg=1.0), 256) == 1.0 / 256
    moved = {}
    for scaling in ("map", "paper"):
        torch.manual_seed(0)
        model, tok = ensemble(particles=1)
        ic = ILHFConfig(particles=1, learning_rate=1e-2, prior_reg=1.0, prior_scaling=scaling)
        tr = ILHFTrainer(model, tok, ic, small_cfg(), "/tmp/unused", "ilhf_history")
        prompt = tok("w10", add_special_tokens=False)["input_ids"]
        pairs = [(prompt, tok("w20 <eos>")["input_ids"], tok("w30 <eos>")["input_ids"], 1.0)] * 16
        for s in range(10):
            tr.update(pairs, 1.0, 4, len(pairs), draw_seed=s)
        moved[scaling] = float(tr._prior("p0"))
    assert moved["paper"] < moved["map"]


def test_one_particle_is_plain_ilhf_without_bootstrap(monkeypatch):
    """particles: 1 draws no double-or-nothing weights (they resample nothing for one model)."""
    calls = []
    real = __import__("rlxf_utils.rl.ilhf", fromlist=["double_or_nothing"]).double_or_nothing
    monkeypatch.setattr("rlxf_utils.rl.ilhf.double_or_nothing",
                        lambda *a, **k: calls.append(1) or real(*a, **k))  # fmt: skip
    model, tok = ensemble(particles=1)
    tr = ILHFTrainer(model, tok, ILHFConfig(particles=1, bootstrap=True), small_cfg(),
                     "/tmp/unused", "ilhf_history")  # fmt: skip
    prompt = tok("w10", add_special_tokens=False)["input_ids"]
    pairs = [(prompt, tok("w20 <eos>")["input_ids"], tok("w30 <eos>")["input_ids"], 1.0)] * 4
    tr.update(pairs, 1.0, 4, 4, draw_seed=0)
    assert calls == []
    model, tok = ensemble(particles=2)
    tr = ILHFTrainer(model, tok, ILHFConfig(particles=2, bootstrap=True), small_cfg(),
                     "/tmp/unused", "ilhf_history")  # fmt: skip
    tr.update(pairs, 1.0, 4, 4, draw_seed=0)
    assert calls  # two particles: each draws its weights


def test_thompson_generation_uses_the_drawn_particle():
    model, tok = ensemble(particles=2, prior_scale=0.5)  # particles far apart: distinct samples
    prompts = ["w10 w11 w12"] * 6
    kw = dict(
        max_new_tokens=6, temperature=1.0, top_p=1.0, postprocess="none", seed=3, progress=False
    )
    mixed = generate(model, tok, prompts, 1, adapter_names=["p0", "p1"] * 3, **kw)
    assert list(mixed["prompt_id"]) == list(range(6))
    # each response of the mixed batch is likelier under the particle that wrote it
    lp = {}
    ilhf_tr = ILHFTrainer(model, tok, ILHFConfig(particles=2), small_cfg(), "/tmp/unused", "x")
    for name in ("p0", "p1"):
        model.set_adapter(name)
        with torch.no_grad():
            lp[name] = ilhf_tr.sequence_logprobs(
                mixed["prompt_ids"].tolist(), [r or [0] for r in mixed["response_ids"]]
            ).numpy()
    own = np.where(np.arange(6) % 2 == 0, lp["p0"] - lp["p1"], lp["p1"] - lp["p0"])
    assert own.mean() > 0


# ---------------------------------------------------------------------------------------------
# Online ILHF, saving, loading and resume
# ---------------------------------------------------------------------------------------------
def toy_reward(contexts, texts):
    low = set(WORDS[:30])
    return np.array([0.05 + 0.9 * np.mean([w in low for w in t.split()] or [0.0]) for t in texts])


def online(tmp_path, steps=4, checkpoint_every=2):
    model, tok = ensemble(particles=2)
    prompts, contexts = toy_contexts(8)
    cfg: RLConfig = small_cfg(steps=steps, checkpoint_every=checkpoint_every, batch_size=8,
                              minibatch_size=4, num_generations=2)  # fmt: skip
    ic = ILHFConfig(particles=2, learning_rate=3e-3)
    return ILHFOnlineTrainer(model, tok, ic, cfg, tmp_path, "ilhf_online", seed=0,
                             prompts=prompts, contexts=contexts, reward_fn=toy_reward)  # fmt: skip


def test_online_runs_saves_and_loads_as_an_ensemble(tmp_path):
    tr = online(tmp_path)
    log = tr.train(progress=False)
    assert list(log["step"]) == [1, 2, 3, 4]
    assert log["reward_mean"].notna().all() and log["kl"].notna().all()
    assert (log["pairs"] == 4).all()  # 8 responses, 2 per prompt: 4 pairs a step
    adapter = tmp_path / "adapter"
    assert is_ensemble(adapter)
    tok = tiny_tokenizer()
    fresh, names = load_particles(tiny_llama(tok, 0, init=0.3), adapter, "ilhf_online")
    assert names == ["ilhf_online__p0", "ilhf_online__p1"]
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        tr.model.set_adapter("p1")
        want = tr.model(input_ids=ids).logits
        fresh.set_adapter("ilhf_online__p1")
        got = fresh(input_ids=ids).logits
    assert torch.allclose(want, got, atol=1e-6)


def test_online_resume_matches_uninterrupted(tmp_path):
    want = online(tmp_path / "a").train(progress=False)
    online(tmp_path / "b").train(steps=2, progress=False)  # interrupted after step 2
    assert [p.name for p in (tmp_path / "b/checkpoints").iterdir()] == ["step_000002"]
    resumed = online(tmp_path / "b")  # a fresh process: rebuilt from scratch
    assert resumed.load_checkpoint() and resumed.step == 2  # it resumes, not restarts
    got = resumed.train(progress=False)
    cols = ["reward_mean", "ilhf_loss", "kl"]
    assert np.allclose(got[cols].to_numpy(float), want[cols].to_numpy(float), atol=1e-5)


def history(tmp_path):
    model, tok = ensemble(particles=2)
    prompt = tok("w10", add_special_tokens=False)["input_ids"]
    pairs = [(prompt, tok(f"w{20 + i} <eos>")["input_ids"], tok(f"w{40 + i} <eos>")["input_ids"],
              1.0 if i % 2 else 0.5) for i in range(16)]  # fmt: skip
    ic = ILHFConfig(particles=2, learning_rate=3e-3, history_batch_pairs=4, history_epochs=1.0)
    cfg = small_cfg(checkpoint_every=2)
    return ILHFHistoryTrainer(model, tok, ic, cfg, tmp_path, "ilhf_history", seed=0, pairs=pairs)


def test_history_resume_matches_uninterrupted(tmp_path):
    """16 pairs in steps of 4: 4 steps; a run cut after step 2 resumes from its checkpoint and
    ends where an uninterrupted one does (same pairs, bootstrap draws and particles)."""
    from rlxf_utils.rl.experience import counting_optimizer_steps

    want = history(tmp_path / "a")
    with counting_optimizer_steps() as counted:  # as notebook 03 counts them: per particle
        log_a = want.train(progress=False)
    assert list(log_a["step"]) == [1, 2, 3, 4]
    assert counted == {"optimizer_steps": 4, "optimizers": 2, "optimizer_steps_total": 4}
    history(tmp_path / "b").train(steps=2, progress=False)
    resumed = history(tmp_path / "b")
    assert resumed.load_checkpoint() and resumed.step == 2
    with counting_optimizer_steps() as counted:  # 2 steps here, the run's 4 from the particles
        log_b = resumed.train(progress=False)
    assert counted == {"optimizer_steps": 2, "optimizers": 2, "optimizer_steps_total": 4}
    cols = ["ilhf_loss", "prior_loss"]
    np.testing.assert_allclose(log_b[cols].to_numpy(float), log_a[cols].to_numpy(float), atol=1e-5)
    for (n, p1), (_, p2) in zip(want.model.named_parameters(), resumed.model.named_parameters(),
                                strict=True):  # fmt: skip
        assert torch.allclose(p1, p2, atol=1e-6), n


def test_run_marker_and_bad_model(tmp_path):
    tok = tiny_tokenizer()
    with pytest.raises(TypeError, match="particles"):
        ILHFTrainer(tiny_llama(tok), tok, ILHFConfig(), small_cfg(), tmp_path, "x")
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "ensemble.json").write_text("{not json")
    with pytest.raises(ValueError, match="ensemble.json"):
        load_particles(tiny_llama(tok), tmp_path / "adapter", "x")


def test_snapshots_pack_every_particle_and_evaluation_loads_them_as_the_ensemble(
    tmp_path, monkeypatch
):
    """Each checkpoint keeps the whole ensemble as one frontier snapshot (every particle packed in
    `adapter_model.safetensors`); evaluation's `PolicySet.load_snapshot` loads it as an ensemble,
    each particle equal to the trainer's at that step and the final ensemble left as it was."""
    from safetensors.torch import load_file, save_file

    from rlxf_utils.artifacts import RunDir
    from rlxf_utils.config import ComputeConfig, PolicyConfig
    from rlxf_utils.models.ensemble import is_packed, unpack_particles
    from rlxf_utils.models.policies import PolicySet

    run = RunDir(tmp_path / "run")
    out = run.path("policy/ilhf_online")
    ids = torch.tensor([[5, 6, 7]])

    def logits(model, adapter):
        model.set_adapter(adapter)
        with torch.no_grad():
            return model(input_ids=ids).logits

    tr = online(out)
    tr.train(steps=2, progress=False)
    at2 = {p: logits(tr.model, p) for p in ("p0", "p1")}
    tr.train(steps=4, progress=False)
    final = {p: logits(tr.model, p) for p in ("p0", "p1")}
    snaps = sorted(p.parent.name for p in (out / "snapshots").glob("*/adapter_model.safetensors"))
    assert snaps == ["step_000002", "step_000004"]
    packed = load_file(str(out / "snapshots/step_000002/adapter_model.safetensors"))
    assert is_packed(packed) and list(unpack_particles(packed, "x")) == ["p0", "p1"]

    tok = tiny_tokenizer()
    monkeypatch.setattr("rlxf_utils.models.policies.load_policy",
                        lambda cfg, device=None: (tiny_llama(tok, 0, init=0.3).eval(), tok))  # fmt: skip
    cfg = SimpleNamespace(policy=PolicyConfig(autocast=None), rl=SimpleNamespace(start_policy="base"),
                          sft=SimpleNamespace(enabled=False), compute=ComputeConfig(device="cpu"))  # fmt: skip
    pset = PolicySet(cfg, run, ["ilhf_online"])
    name = pset.load_snapshot(
        "ilhf_online", out / "snapshots/step_000002/adapter_model.safetensors"
    )
    assert pset.particles[name] == ["snapshot__p0", "snapshot__p1"]
    model = pset.home[name]
    for p in ("p0", "p1"):
        torch.testing.assert_close(logits(model, f"snapshot__{p}"), at2[p])
        torch.testing.assert_close(logits(model, f"ilhf_online__{p}"), final[p])  # untouched
        assert (at2[p] - final[p]).abs().max() > 1e-4  # training moved it after step 2
    # the snapshot samples as the ensemble does: a particle drawn per prompt
    kw = dict(max_new_tokens=4, temperature=1.0, top_p=1.0, postprocess="none", progress=False,
              seed=3, batch_size=4)  # fmt: skip
    assert len(pset.generate(name, ["w10 w11", "w12"], 2, "snap", kw)) == 4
    # a file whose particles are not the ensemble's is refused, naming it
    bad = tmp_path / "bad.safetensors"
    save_file({k: v for k, v in packed.items() if k.startswith("p0::")}, str(bad))
    with pytest.raises(ValueError, match="bad.safetensors.*particles"):
        pset.load_snapshot("ilhf_online", bad)
