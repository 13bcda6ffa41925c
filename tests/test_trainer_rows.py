"""The rows each trainer recorded lie in its own pool, and the pools' trainers share none.

`tests/test_data.py` checks the pools notebook 01 carves (`data.splits.carve_policy_pool`) and
what `eligible_rows` returns; this goes one step further, to what each trainer wrote down as
the rows it learned from, on a run dir of the smoke profile's data stage (511 labelled rows)
with tiny models:

- `sft`, `sft_met`: `policy/<name>/data.json` `row_ids` (`rl.sft.run_sft_stage`, trained);
- KTO: `policy/kto/data.parquet` `row_id`; DPO: its `row_a`, `row_b` (`rl.offline.run_offline`,
  TRL's training itself replaced: the rows are chosen and recorded before it);
- ILHF (history): the pairs' `row_a`, `row_b` (`rl.ilhf.encoded_history_pairs`, the frame
  `ilhf.py` writes to `policy/ilhf_history/pairs.parquet`);
- the reward model and the audit: `reward_model/bundle.json` `trained_on_rows`
  (`reward.protocol.run_protocol` with its TF-IDF scorer, `reward.bundle.train_disjoint_audit`,
  `save_reward_bundle`).

Not here: RL's own arms (PPO, GRPO, ...) and RFT learn from prompts of the training contexts,
not from rows (`tests/test_data.py` checks those contexts are the policy pool's); the MLE
references of PPO + MLE and D²LOLS (`rl.sft.met_references`) record no row ids.
"""

from __future__ import annotations

import json

import pandas as pd
import pytest
from test_ppo import tiny_tokenizer
from tiny import tiny_llama

from rlxf_utils.artifacts import RunDir
from rlxf_utils.config import PROJECT_ROOT, load_config

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A smoke run dir's data stage, then each trainer's recorded rows: {trainer: row ids}, the
    run, and the labelled rows."""
    from rlxf_utils.data.contexts import load_contexts
    from rlxf_utils.data.splits import load_splits
    from rlxf_utils.data.stage import run_data_stage
    from rlxf_utils.models.generation import build_prompts
    from rlxf_utils.reward import protocol
    from rlxf_utils.reward.bundle import save_reward_bundle, train_disjoint_audit
    from rlxf_utils.rl import offline, sft
    from rlxf_utils.rl.ilhf import encoded_history_pairs
    from rlxf_utils.rl.trainer import TrainJob

    cfg = load_config(PROJECT_ROOT / "params/smoke.yaml")
    cfg.policy.use_chat_template = False  # the tiny tokenizer has none
    run = RunDir(tmp_path_factory.mktemp("rows") / "run")
    run_data_stage(cfg, run)
    labelled, splits = load_splits(run)
    tok = tiny_tokenizer()
    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(sft, "load_policy", lambda policy, device=None: (tiny_llama(tok, 0), tok))
        mp.setattr(offline, "train_offline", lambda *a, **kw: pd.DataFrame())
        sft.run_sft_stage(cfg, run, progress=False)
        contexts = load_contexts(run.root, "train", cfg.rl.max_prompts, cfg.training_seed)
        prompts = build_prompts(contexts, tok, cfg.rl.prompt_template, cfg.policy)

        def job(algo: str) -> TrainJob:
            return TrainJob(algo, tiny_llama(tok, 0), tok, prompts, contexts, None, cfg.rl,
                            cfg.policy, run.path(f"policy/{algo}"), seed=cfg.training_seed,
                            progress=False, study=cfg, run_dir=run.root)  # fmt: skip

        for algo in ("kto", "dpo"):
            offline.run_offline(job(algo))
    finally:
        mp.undo()
    pairs, _ = encoded_history_pairs(cfg, run.root, tok, tiny_llama(tok, 0), job("ilhf_history"))
    kto = run.read_parquet("policy/kto/data.parquet")
    dpo = run.read_parquet("policy/dpo/data.parquet")
    holdout = run.read_json("data/holdout.json")
    res = protocol.run_protocol(labelled, splits, cfg.reward.reward_protocol, cfg.reward,
                                cfg.run.seed, train_encoder_model=False, n_boot=50)  # fmt: skip
    audit = train_disjoint_audit(labelled, holdout, cfg.reward, cfg.run.seed)
    save_reward_bundle(run.path("reward_model"), res, "tfidf", audit)
    judged = json.loads(run.path("reward_model/bundle.json").read_text())["trained_on_rows"]
    rows = {
        "sft": run.read_json("policy/sft/data.json")["row_ids"],
        "sft_met": run.read_json("policy/sft_met/data.json")["row_ids"],
        "kto": kto["row_id"].tolist(),
        "dpo": [*dpo["row_a"], *dpo["row_b"]],
        "ilhf_history": [*pairs["row_a"], *pairs["row_b"]],
        "reward train": judged["reward"]["train"],
        "reward selection": judged["reward"]["selection"],
        "reward calibration": judged["reward"]["calibration"],
        "audit train": judged["audit"]["train"],
        "audit val": judged["audit"]["val"],
    }
    return {k: {int(i) for i in v} for k, v in rows.items()}, run, labelled


#: Each trainer's pool (`data.splits.POOLS`, `data/pools.parquet`).
POOL = {"sft": "policy", "sft_met": "policy", "kto": "policy", "dpo": "policy",
        "ilhf_history": "policy", "reward train": "reward_train",
        "reward selection": "reward_val", "reward calibration": "reward_val",
        "audit train": "audit_train", "audit val": "audit_val"}  # fmt: skip


def test_every_trainer_recorded_rows_of_its_own_pool(recorded) -> None:
    rows, run, labelled = recorded
    pool = run.read_parquet("data/pools.parquet").set_index("row_id")["pool"]
    for trainer, ids in rows.items():
        assert ids, f"{trainer} recorded no rows"
        outside = pool.loc[sorted(ids)][lambda p, t=trainer: p != POOL[t]]
        assert outside.empty, (trainer, outside.value_counts().to_dict())
    met = set(labelled.loc[labelled["y"] == 1, "row_id"])
    assert rows["sft_met"] <= met and not rows["sft"] <= met  # MET rows only; sft: both outcomes
    # the judges' parts are the parts they were given, whole
    h = run.read_json("data/holdout.json")
    sp = run.read_json("data/splits.json")[h["reward_protocol"]]
    assert rows["reward train"] == set(sp["train"])
    assert rows["reward selection"] | rows["reward calibration"] == set(sp["val"])
    assert (rows["audit train"], rows["audit val"]) == (set(h["audit_train"]), set(h["audit_val"]))


def test_the_trainers_of_different_pools_share_no_row_and_no_arrangement(recorded) -> None:
    """The reward model, the audit and the policies learn from disjoint rows, and (whole
    arrangements: MONA repeats a condition across one arrangement's reviews) from disjoint
    arrangements; no trainer learns from an evaluation country's row (the references)."""
    rows, run, labelled = recorded
    groups = {
        "reward model": set().union(*(v for k, v in rows.items() if k.startswith("reward"))),
        "audit": rows["audit train"] | rows["audit val"],
        "policies": set().union(*(v for k, v in rows.items() if POOL[k] == "policy")),
    }
    arrangement = labelled.set_index("row_id")["arrangement_id"].astype(str)
    names = list(groups)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            assert not groups[a] & groups[b], (a, b, sorted(groups[a] & groups[b])[:5])
            if "policies" in (a, b):
                shared = set(arrangement.loc[sorted(groups[a])]) & set(
                    arrangement.loc[sorted(groups[b])]
                )
                assert not shared, (a, b, sorted(shared)[:5])
    reference = set(run.read_json("data/holdout.json")["reference"])
    assert not reference & set().union(*groups.values())
