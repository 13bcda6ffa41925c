"""Draws kept in `eval/draws/` (`evaluation.draws`): read back only when everything that decides
them is the same, replaced when it is not, and as usable as a fresh draw."""

from __future__ import annotations

from contextlib import contextmanager
from types import MethodType, SimpleNamespace

import pytest
from test_ppo import tiny_tokenizer
from tiny import tiny_llama

from rlxf_utils.artifacts import RunDir
from rlxf_utils.config import PROJECT_ROOT, load_config
from rlxf_utils.evaluation import draws
from rlxf_utils.evaluation.inputs import PhaseTimer
from rlxf_utils.evaluation.sampling import frame_logprobs
from rlxf_utils.models.policies import PolicySet

PROMPTS = ["w10 w11 w12", "w13", "w14 w15"]
KW = dict(max_new_tokens=8, temperature=1.0, top_p=1.0, postprocess="none", progress=False,
          seed=7, batch_size=4)  # fmt: skip


def _pset():
    tok = tiny_tokenizer()
    model = tiny_llama(tok, 0, init=0.3).eval()

    @contextmanager
    def use(name):
        yield model

    pset = SimpleNamespace(use=use, tok=tok, start_name="sft", particles={}, model=model)
    for name in ("generate", "sequence_logprobs"):  # PolicySet's own, on the fake
        setattr(pset, name, MethodType(getattr(PolicySet, name), pset))
    return pset


@pytest.fixture
def setup(tmp_path, monkeypatch):
    cfg = load_config(PROJECT_ROOT / "params/smoke.yaml")
    run = RunDir(tmp_path / "run")
    run.write_text("policy/sft/adapter/adapter_model.safetensors", "sft weights")
    run.write_text("policy/ppo/adapter/adapter_model.safetensors", "ppo weights")
    calls = []
    real = draws.sample_tuned

    def counted(*args, **kwargs):
        calls.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(draws, "sample_tuned", counted)
    return cfg, run, _pset(), calls


def _draw(setup, name="sft", kw=KW, kind="samples", timer=None):
    cfg, run, pset, _ = setup
    return draws.draw(cfg, run, pset, kind, name, PROMPTS, 2, kw, 4, desc=name, timer=timer,
                      phase=f"{kind} {name}")  # fmt: skip


def _kept(run: RunDir) -> list[str]:
    return sorted(p.name for p in run.path(draws.FOLDER).iterdir())


def test_a_draw_is_read_back_only_when_all_that_decides_it_is_the_same(setup):
    cfg, run, pset, calls = setup
    first = _draw(setup)
    assert calls == ["sft"] and len(_kept(run)) == 2  # the frame and its record
    timer = PhaseTimer("evaluation")
    again = _draw(setup, timer=timer)
    assert calls == ["sft"]  # read back, not drawn
    assert again.equals(first)  # token ids as lists of ints, as drawn
    assert again["response_ids"].tolist() == first["response_ids"].tolist()
    assert timer.reused == ["samples sft"] and timer.seconds["samples sft"] >= 0
    # read back, it scores as the fresh draw does
    assert frame_logprobs(pset.model, pset.tok, again, 4) == pytest.approx(
        frame_logprobs(pset.model, pset.tok, first, 4)
    )
    # another sampling seed, another kind, another policy: drawn, each kept beside the others
    _draw(setup, kw={**KW, "seed": 8})
    _draw(setup, kind="pool")
    _draw(setup, name="ppo")
    assert calls == ["sft", "sft", "sft", "ppo"]
    assert len(_kept(run)) == 6  # the seed-8 draw replaced the seed-7 one of samples-sft
    assert len([p for p in _kept(run) if p.startswith("samples-sft-")]) == 2
    _draw(setup)  # the seed-7 draw again: it was replaced, so it is drawn anew
    assert calls[-1] == "sft" and len(calls) == 5


def test_new_weights_or_code_draw_afresh(setup, monkeypatch):
    cfg, run, pset, calls = setup
    _draw(setup, name="ppo")
    run.write_text("policy/sft/adapter/adapter_model.safetensors", "sft retrained")
    _draw(setup, name="ppo")  # the start policy changed: logp_ref (and the policy) with it
    assert calls == ["ppo", "ppo"]
    monkeypatch.setattr("rlxf_utils.models.kept.code_digest", lambda code: "other code")
    _draw(setup, name="ppo")
    assert calls == ["ppo", "ppo", "ppo"]
    assert len(_kept(run)) == 2  # one draw of ppo kept, the last


def test_a_record_that_does_not_match_its_parts_is_not_trusted(setup):
    cfg, run, pset, calls = setup
    _draw(setup)
    record = next(p for p in run.path(draws.FOLDER).iterdir() if p.suffix == ".json")
    record.write_text('{"parts": {"policy": "other"}, "seconds": 1.0}', encoding="utf-8")
    _draw(setup)
    assert calls == ["sft", "sft"]


def test_before_after_samples_are_kept_and_only_a_changed_policy_samples_again(setup, monkeypatch):
    """Notebook 03's before/after samples (`rl.stage.before_after_samples`): each policy's kept in
    `policy/before_after/`; a rerun reads them back (the same responses and rewards), and after
    one adapter changed, only that policy samples again."""
    import numpy as np

    from rlxf_utils.prompts import CONTEXT_FIELDS
    from rlxf_utils.rl import stage

    cfg, run, pset, _ = setup
    sampled = []
    real = pset.generate
    pset.generate = lambda name, *a: sampled.append(name) or real(name, *a)
    monkeypatch.setattr(stage, "PolicySet", lambda cfg, run, algos: pset)
    monkeypatch.setattr(stage, "build_prompts", lambda ctx, tok, t, p: PROMPTS[: len(ctx)])
    monkeypatch.setattr(stage, "sampling_kwargs", lambda cfg, progress: KW)
    ctx = [{f: f"{f} {i}" for f in CONTEXT_FIELDS} for i in range(3)]
    reward = lambda c, texts: np.array([len(t) / 100 for t in texts])  # noqa: E731
    go = lambda: stage.before_after_samples(cfg, run.root, ctx, reward, ["base", "sft", "ppo"], n=3)  # noqa: E731
    first = go()
    assert sampled == ["base", "sft", "ppo"] and len(first) == 9
    again = go()
    assert sampled == ["base", "sft", "ppo"]  # every policy read back
    assert again.equals(first)
    run.write_text("policy/ppo/adapter/adapter_model.safetensors", "ppo retrained")
    go()
    assert sampled == ["base", "sft", "ppo", "ppo"]


def test_held_out_log_probs_are_kept_and_only_a_changed_policy_scores_again(setup, monkeypatch):
    """Notebook 04's held-out perplexity (`tables.heldout_perplexity`): each policy's log-probs
    kept in `eval/draws/`; a rerun reads them back (equal tables, listed as reused), and after
    one adapter changed only that policy scores again. Table 3's completions are kept the same
    way (`draws.kept_pass`)."""
    import pandas as pd

    from rlxf_utils.evaluation import tables

    cfg, run, pset, _ = setup
    scored = []
    real = pset.sequence_logprobs
    pset.sequence_logprobs = lambda name, *a, **kw: scored.append(name) or real(name, *a, **kw)
    pset.names = ["base", "sft", "ppo"]
    monkeypatch.setattr(tables, "build_prompts", lambda rows, tok, t, p: PROMPTS[: len(rows)])
    rows = pd.DataFrame({"description": ["w16 w17", "w18", "w19 w10 w11"], "y": [1, 0, 1],
                         "country": ["A", "B", "A"]})  # fmt: skip
    go = lambda timer: tables.heldout_perplexity(pset, rows, "", cfg, 2, run, timer)  # noqa: E731
    first = go(PhaseTimer("evaluation"))
    assert scored == ["base", "sft", "ppo"]
    timer = PhaseTimer("evaluation")
    again = go(timer)
    assert scored == ["base", "sft", "ppo"]  # every policy read back
    assert again[0].equals(first[0]) and again[1].equals(first[1])
    assert timer.reused == [f"held-out perplexity {p}" for p in ("base", "sft", "ppo")]
    run.write_text("policy/ppo/adapter/adapter_model.safetensors", "ppo retrained")
    go(PhaseTimer("evaluation"))
    assert scored == ["base", "sft", "ppo", "ppo"]
    other = rows.assign(description=["w12", "w18", "w19 w10 w11"])  # other texts: scored anew
    tables.heldout_perplexity(pset, other, "", cfg, 2, run, PhaseTimer("evaluation"))
    assert scored[4:] == ["base", "sft", "ppo"]


def test_a_snapshots_pass_is_kept_under_its_own_weights(setup):
    """The frontier's snapshot samples (`draws.kept_pass` with `snapshot`): kept per snapshot,
    read back while the snapshot's file is the same, made again when it changed, and one
    snapshot's frame never stands for another's."""
    import pandas as pd

    cfg, run, _, _ = setup
    made = []

    def go(step: int) -> pd.DataFrame:
        path = run.path(f"policy/ppo/snapshots/step_{step:06d}/adapter_model.safetensors")
        make = lambda: made.append(step) or pd.DataFrame({"step": [step], "x": [0.5]})  # noqa: E731
        return draws.kept_pass(cfg, run, "frontier", "ppo", PROMPTS, KW, make,
                               PhaseTimer("evaluation"), f"frontier ppo step {step}", 2, path)  # fmt: skip

    for step in (1, 2):
        run.write_text(
            f"policy/ppo/snapshots/step_{step:06d}/adapter_model.safetensors", f"s{step}"
        )
    assert go(1)["step"].tolist() == [1] and go(2)["step"].tolist() == [2]
    assert go(1)["step"].tolist() == [1] and go(2)["step"].tolist() == [2]
    assert made == [1, 2]  # the second time both were read back, each its own
    run.write_text("policy/ppo/snapshots/step_000002/adapter_model.safetensors", "retrained")
    go(1), go(2)
    assert made == [1, 2, 2]
