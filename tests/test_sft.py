"""SFT stage: which rows it may see, its examples, its loss (by hand) and that it learns."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from test_ppo import tiny_policy, tiny_tokenizer
from tiny import tiny_llama

from rlxf_utils.config import OptimizerConfig, PolicyConfig, SFTConfig
from rlxf_utils.data.contexts import eligible_rows, heldout_rows
from rlxf_utils.models.generation import build_prompts, encode_prompts
from rlxf_utils.rl.sft import SFTExample, build_examples, collate, response_loss, train_sft

pytestmark = pytest.mark.usefixtures("one_thread")


# -- data: rows the RL stage may see ----------------------------------------------------------
def _toy_data() -> tuple[pd.DataFrame, dict, pd.DataFrame]:
    """12 labelled rows over 4 countries (D is held out), two protocols with different splits."""
    countries = ["A", "A", "A", "B", "B", "B", "C", "C", "C", "D", "D", "D"]
    labelled = pd.DataFrame(
        {
            "row_id": range(100, 112), "country": countries, "arrangement_type": "w5",
            "econ_descriptor": "1.1. w6", "y": [1, 0, 1, 0, 1, 1, 1, 0, 0, 1, 0, 1],
            "description": [f"w{10 + i} w{20 + i}" for i in range(12)],
        }
    )  # fmt: skip
    splits = {
        # row ids per protocol: train rows of every country, val/test rows mixed in
        "grouped": {
            "train": [100, 101, 103, 104, 106, 109, 110],
            "validation": [102, 107, 111],
            "test": [105, 108],
        },
        "random": {
            "train": [102, 105, 107, 108, 111],
            "validation": [100, 103],
            "test": [101, 104, 106, 109, 110],
        },
    }
    contexts = pd.DataFrame(
        {
            "country": ["A", "A", "B", "C", "D", "D"],
            "arrangement_type": "w5", "econ_descriptor": "1.1. w6",
            "split": ["train", "train", "train", "train", "eval", "eval"],
        }
    )  # fmt: skip
    return labelled, splits, contexts


def test_eligible_rows_are_the_policy_pool_only():
    labelled, _, _ = _toy_data()
    holdout = {"policy": [100, 101, 104, 106, 999], "audit_train": [103], "reference": [109]}
    rows = eligible_rows(labelled, holdout)
    assert sorted(rows["row_id"]) == [100, 101, 104, 106]  # 999: no such labelled row
    assert list(rows.index) == list(range(len(rows)))
    met = eligible_rows(labelled, holdout, outcomes="met")
    assert sorted(met["row_id"]) == [100, 104, 106] and (met["y"] == 1).all()
    with pytest.raises(KeyError, match="policy"):
        eligible_rows(labelled, {"audit_train": [103]})
    with pytest.raises(ValueError, match="outcomes"):
        eligible_rows(labelled, holdout, outcomes="nonmet")


def test_heldout_rows_are_eval_countries_only():
    labelled, _, contexts = _toy_data()
    rows = heldout_rows(labelled, contexts, max_rows=None, seed=0)
    assert sorted(rows["row_id"]) == [109, 110, 111]
    assert set(rows["country"]) == {"D"}
    two = heldout_rows(labelled, contexts, max_rows=2, seed=0)
    assert len(two) == 2 and set(two["country"]) == {"D"}
    assert two.equals(heldout_rows(labelled, contexts, max_rows=2, seed=0))


# -- examples ---------------------------------------------------------------------------------
def test_build_examples_targets_end_with_eos_and_long_ones_are_dropped():
    tok = tiny_tokenizer()
    model = tiny_llama(tok)
    rows = pd.DataFrame(
        {
            "country": ["w1", "w2", "w3"], "arrangement_type": "w5", "econ_descriptor": "1.1. w6",
            # targets of 3 + EOS (kept: exactly the limit), 5 + EOS (dropped), 1 + EOS (kept)
            "description": ["w10  w11\nw12", "w13 w14 w15 w16 w17", "w18"],
        }
    )  # fmt: skip
    template = "w30 {arrangement_type} w31 {econ_area}"
    policy = PolicyConfig(use_chat_template=False)
    examples, dropped = build_examples(rows, tok, model, template, policy, max_response_tokens=4)
    assert dropped == 1 and len(examples) == 2
    eos = tok.eos_token_id
    assert examples[0].response_ids == [*tok.convert_tokens_to_ids(["w10", "w11", "w12"]), eos]
    assert examples[1].response_ids == [tok.convert_tokens_to_ids("w18"), eos]
    # the prompt is exactly the RL prompt, tokenised as PPO and evaluation do
    prompts = build_prompts(rows.iloc[[0, 2]].to_dict("records"), tok, template, policy)
    assert [e.prompt_ids for e in examples] == encode_prompts(tok, prompts)["input_ids"]
    assert examples[0].prompt_ids == tok.convert_tokens_to_ids(["w30", "w5", "w31", "w6"])


# -- the loss ---------------------------------------------------------------------------------
def _examples(tok) -> list[SFTExample]:
    """Varying prompt and target lengths (the longest target is not the longest sequence)."""
    w = tok.convert_tokens_to_ids
    eos = tok.eos_token_id
    return [
        SFTExample(w(["w11", "w12"]), [*w(["w20", "w21", "w22", "w23"]), eos]),
        SFTExample(w(["w13", "w14", "w15", "w16", "w17", "w18"]), [w("w24"), eos]),
        SFTExample(w(["w19", "w25", "w26"]), [*w(["w27", "w28"]), eos]),
    ]


def test_response_loss_matches_hand_computation():
    tok = tiny_tokenizer()
    model = tiny_llama(tok, seed=2, init=0.3).eval()
    examples = _examples(tok)
    batch = collate(examples, tok.pad_token_id)
    assert batch["n_tail"] == 5 and batch["input_ids"].shape == (3, 8)
    with torch.no_grad():
        loss, n = response_loss(model, batch)
        # by hand: each example alone (no padding), full-sequence logits, CE on target tokens only
        total, count = 0.0, 0
        for e in examples:
            ids = torch.tensor([e.prompt_ids + e.response_ids])
            logits = model(input_ids=ids).logits[0].float()
            start = len(e.prompt_ids)
            for t in range(start, ids.shape[1]):  # logits at t - 1 predict token t
                total += F.cross_entropy(logits[t - 1 : t], ids[0, t : t + 1]).item()
                count += 1
    assert n == count == 5 + 2 + 3
    assert math.isclose(loss.item(), total / count, abs_tol=1e-5), (loss.item(), total / count)


def test_train_sft_lowers_the_loss(tmp_path):
    model, tok = tiny_policy(seed=0)
    examples = _examples(tok) * 2  # 6 examples, batches of 3: 2 batches per epoch
    cfg = SFTConfig(batch_size=3, epochs=15, learning_rate=1e-2)
    batch = collate(examples, tok.pad_token_id)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    model.eval()
    with torch.no_grad():
        before = response_loss(model, batch)[0].item()
    frame = train_sft(model, tok, examples, cfg, OptimizerConfig(), seed=0, progress=False)
    with torch.no_grad():
        after = response_loss(model, batch)[0].item()
    assert len(frame) == 30 and frame["loss"].notna().all()
    assert after < 0.5 * before, (before, after)
    assert frame["loss"].tail(5).mean() < frame["loss"].head(5).mean()
    assert not model.training
    # only the LoRA adapters moved: the base (the KL reference of the RL that follows) is intact
    for name, p in model.named_parameters():
        if name in base:
            assert torch.equal(p, base[name]), name
    with pytest.raises(ValueError, match="no training examples"):
        train_sft(model, tok, [], cfg, OptimizerConfig(), progress=False)
