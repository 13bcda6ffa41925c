"""Equal experience (`rl.experience`): one context order for every method, what each trainer
used, counted optimiser steps, the per-method table, and profiles whose methods match RL."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch

from rlxf_utils.config import load_config
from rlxf_utils.rl.core import prompt_schedule
from rlxf_utils.rl.experience import (
    EXPERIENCE_FILE,
    context_key,
    context_visits,
    counting_optimizer_steps,
    experience_table,
    record_experience,
    take_in_context_order,
)

ROOT = Path(__file__).resolve().parents[1]


def _ctx(*countries: str) -> list[dict[str, str]]:
    return [{"country": c, "arrangement_type": "SBA", "econ_descriptor": "1.1"} for c in countries]


def test_context_visits_are_rls_schedule_and_go_on_past_it():
    flat = [i for step in prompt_schedule(7, 9, 3, seed=5) for i in step]  # 27 visits: 3+ passes
    assert list(itertools.islice(context_visits(7, 5), 27)) == flat
    assert list(itertools.islice(context_visits(7, 6), 27)) != flat  # the seed decides


def test_take_in_context_order_walks_rls_visits():
    contexts = _ctx("A", "B", "C")
    items = pd.DataFrame(_ctx(*("A" * 5 + "B" + "D" * 3)))  # C has none; D is no training context
    order = [contexts[i]["country"] for i in itertools.islice(context_visits(3, 0), 3)]
    got = take_in_context_order(items, contexts, seed=0, per_visit=2, n=3)
    countries = items["country"].iloc[got].tolist()
    # the first visits, 2 items each where a context has them, B's only one, C none
    expect = [c for c in order for _ in range({"A": 2, "B": 1, "C": 0}[c])][:3]
    assert countries == expect and len(set(got)) == len(got)
    every = take_in_context_order(items, contexts, seed=0, per_visit=2, n=100)
    assert sorted(every) == [0, 1, 2, 3, 4, 5]  # all of A and B, never D, then it stops
    assert take_in_context_order(items, [], seed=0, per_visit=2, n=3).size == 0


def test_optimizer_steps_are_counted_per_optimizer():
    a, b = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    oa, ob = torch.optim.AdamW(a.parameters()), torch.optim.SGD(b.parameters(), lr=0.1)
    with counting_optimizer_steps() as counted:
        for i in range(5):
            for m, opt in ((a, oa), (b, ob)):
                if m is b and i >= 3:
                    continue
                m(torch.ones(1, 2)).sum().backward()
                opt.step()
    assert counted == {"optimizer_steps": 5, "optimizers": 2, "optimizer_steps_total": 5}
    with counting_optimizer_steps() as none:
        pass
    assert none == {"optimizer_steps": 0, "optimizers": 0, "optimizer_steps_total": None}


def _job(tmp_path: Path, algo: str, **kw) -> SimpleNamespace:
    rl = SimpleNamespace(prompts_per_step=2, num_generations=3, update_epochs=2)
    out = tmp_path / algo
    out.mkdir()
    (out / "settings.json").write_text(json.dumps({"update_epochs": 2}), encoding="utf-8")
    return SimpleNamespace(algo=algo, output_dir=out, rl=rl, prompts=["p"] * 4,
                           contexts=_ctx("A", "B", "C", "D"), seed=1, **kw)  # fmt: skip


def test_record_and_table_from_what_each_trainer_used(tmp_path):
    ppo = _job(tmp_path, "ppo")
    rec = record_experience(ppo, 3, {"optimizer_steps": 12, "optimizers": 1}, resumed=False)
    visited = {context_key(ppo.contexts[i]) for s in prompt_schedule(4, 3, 2, 1) for i in s}
    assert rec["sequences"] == 3 * 2 * 3 and set(rec["contexts"]) == visited
    assert json.loads((ppo.output_dir / EXPERIENCE_FILE).read_text())["sequences"] == 18
    dpo = _job(tmp_path, "dpo")
    pd.DataFrame(_ctx("A", "A", "E")).to_parquet(dpo.output_dir / "data.parquet")  # 3 pairs
    rec_dpo = record_experience(dpo, 3, {"optimizer_steps": 4, "optimizers": 1}, resumed=True)
    assert rec_dpo["sequences"] == 6 and rec_dpo["optimizer_steps"] is None
    table = experience_table([rec, rec_dpo], "ppo").set_index("algo")
    assert table.loc["ppo", "sequences_per_step"] == 18 * 2 / 12
    assert table.loc["ppo", "contexts_shared_with_rl"] == len(visited)
    assert table.loc["dpo", "distinct_contexts"] == 2
    assert table.loc["dpo", "contexts_shared_with_rl"] == int("A\x1fSBA\x1f1.1" in visited)
    assert np.isnan(table.loc["dpo", "optimizer_steps"]) and bool(table.loc["dpo", "resumed"])
    # a resumed run whose optimiser held its step count: the whole run's steps, as uninterrupted
    full = {"optimizer_steps": 4, "optimizers": 1, "optimizer_steps_total": 12}
    assert record_experience(ppo, 3, full, resumed=True) == rec


def test_a_resumed_optimizer_counts_the_steps_before_it():
    """The step hook reads Adam's own count, which a checkpoint restores: 3 steps, a new process
    (a fresh optimiser loading the state) and 2 more count 5 run steps, 2 this process's."""
    from rlxf_utils.rl.experience import counting_optimizer_steps

    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([w], lr=0.1)
    for _ in range(3):
        w.grad = torch.ones(3)
        opt.step()
    resumed = torch.optim.AdamW([w], lr=0.1)
    resumed.load_state_dict(opt.state_dict())
    with counting_optimizer_steps() as counted:
        for _ in range(2):
            w.grad = torch.ones(3)
            resumed.step()
    assert counted == {"optimizer_steps": 2, "optimizers": 1, "optimizer_steps_total": 5}


@pytest.mark.parametrize("profile", ["smoke", "default", "full", "paper"])
def test_every_profile_gives_ilhf_history_and_the_offline_methods_rls_experience(profile):
    cfg = load_config(ROOT / "params" / f"{profile}.yaml")
    rl, ic = cfg.rl, cfg.ilhf
    sequences = cfg.offline.examples or rl.steps * rl.batch_size
    steps = rl.steps * rl.optimizer_steps_per_batch
    assert sequences == rl.steps * rl.batch_size  # the offline methods: RL's responses
    # ILHF (history): as `ILHFHistoryTrainer` counts its steps, two sequences a pair
    assert 2 * ic.history_max_pairs == sequences
    assert math.ceil(ic.history_max_pairs * ic.history_epochs / ic.history_batch_pairs) == steps
    assert 2 * ic.history_batch_pairs == rl.minibatch_size


def test_a_ppo_run_counts_rls_optimiser_steps_and_the_contexts_it_sampled(tmp_path):
    """A tiny PPO run: the counted optimiser steps are steps x optimizer_steps_per_batch, and the
    contexts `used_data` records are those its rollouts asked."""
    from test_ppo import small_cfg, tiny_policy, toy_contexts, toy_reward

    from rlxf_utils.rl.experience import used_data
    from rlxf_utils.rl.ppo import PPOTrainer

    model, tok = tiny_policy(seed=0)
    prompts, contexts = toy_contexts(6)
    cfg = small_cfg(steps=2, batch_size=8, num_generations=2, minibatch_size=4, update_epochs=2)
    tr = PPOTrainer(model, tok, prompts, contexts, toy_reward, cfg, tmp_path, seed=5)
    seen: list[int] = []
    rollout = tr.rollout
    tr.rollout = lambda idx: (seen.extend(idx), rollout(idx))[1]
    with counting_optimizer_steps() as counted:
        log = tr.train(progress=False)
    assert counted["optimizer_steps"] == cfg.steps * cfg.optimizer_steps_per_batch == 8
    job = SimpleNamespace(algo="ppo", output_dir=tmp_path, rl=cfg, prompts=prompts,
                          contexts=contexts, seed=5)  # fmt: skip
    keys, sequences = used_data(job, int(log["step"].max()))
    assert sequences == len(seen) == cfg.steps * cfg.batch_size
    assert sorted(keys) == sorted(context_key(contexts[i]) for i in seen[:: cfg.num_generations])
