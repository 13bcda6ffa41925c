"""One tokenisation of the policy's prompts in SFT, PPO, TRL (GRPO/RLOO) and evaluation.

The tokenizer here adds a BOS by default (as LLaMA-2's does) and its chat template writes the BOS
itself: a templated prompt tokenised with the default special tokens would start with two BOS.
"""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from test_ppo import WORDS, small_cfg, toy_reward
from tiny import tiny_llama, word_tokenizer

from rlxf_utils.config import LoraSettings, PolicyConfig
from rlxf_utils.models.generation import build_prompts, encode_prompts
from rlxf_utils.models.loading import apply_lora
from rlxf_utils.models.logprobs import _as_ids
from rlxf_utils.rl.ppo import PPOTrainer
from rlxf_utils.rl.sft import build_examples
from rlxf_utils.rl.trl_runs import trl_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

TEMPLATE = "w1 {arrangement_type} w2 {econ_area}"
CONTEXTS = [
    {"country": f"C{i}", "arrangement_type": WORDS[10 + i], "econ_descriptor": f"1.{i}. {WORDS[20 + i]}"}
    for i in range(5)
]  # fmt: skip


def bos_tokenizer(chat: bool = True):
    """The tiny word tokenizer with `<s>` added by its post-processor; optionally a chat template
    that writes `<s>` itself (LLaMA-2 style)."""
    from tokenizers import processors

    tok = word_tokenizer(WORDS, specials=("<eos>", "<unk>", "<s>"))
    tok.add_special_tokens({"bos_token": "<s>"})  # an added token: split out before words
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.bos_token_id)]
    )
    tok.padding_side = "left"
    if chat:
        tok.chat_template = "<s>{% for m in messages %}{{ m.content }} w3 {% endfor %}w4"
    return tok


def _ids_everywhere(tok, prompts):
    ppo = encode_prompts(tok, prompts)["input_ids"]
    trl = trl_tokenizer(tok, prompts)(text=prompts)["input_ids"]  # how TRL calls its tokenizer
    ev = [_as_ids(tok, p, None) for p in prompts]
    return ppo, trl, ev


def test_templated_prompts_one_bos_everywhere(tmp_path):
    tok = bos_tokenizer()
    bos = tok.bos_token_id
    assert tok("w5")["input_ids"] == [bos, tok.convert_tokens_to_ids("w5")]  # BOS by default
    prompts = build_prompts(CONTEXTS, tok, TEMPLATE, PolicyConfig())
    assert all(p.startswith("<s>") for p in prompts)
    # the trap every path must avoid: default special tokens double the template's BOS
    assert all(ids[:2] == [bos, bos] for ids in tok(prompts)["input_ids"])

    ppo, trl, ev = _ids_everywhere(tok, prompts)
    assert ppo == trl == ev
    for ids in ppo:
        assert ids[0] == bos and ids[1] != bos, ids
    assert ppo[0] == tok.convert_tokens_to_ids(["<s>", "w1", "w10", "w2", "w20", "w3", "w4"])

    # SFT's prompts are the same ids
    rows = pd.DataFrame(CONTEXTS).assign(description="w40 w41")
    model = tiny_llama(tok)
    examples, _ = build_examples(rows, tok, model, TEMPLATE, PolicyConfig(), 8)
    assert [e.prompt_ids for e in examples] == ppo

    # ... and so are the ids PPO's rollout samples from (padding stripped)
    seen = []
    policy = apply_lora(model, LoraSettings(rank=2, alpha=4, target_modules=["q_proj"]))
    cfg = small_cfg(batch_size=4, num_generations=1, minibatch_size=4, max_new_tokens=2)
    tr = PPOTrainer(policy, tok, prompts, CONTEXTS, toy_reward, cfg, tmp_path, seed=0)
    sample = tr.sample

    def spy(model, enc, *args, **kw):
        for ids, mask in zip(enc["input_ids"], enc["attention_mask"], strict=True):
            seen.append(ids[mask.bool()].tolist())
        return sample(model, enc, *args, **kw)

    tr.sample = spy
    with torch.no_grad():
        tr.rollout([0, 1, 2, 3])
    assert seen == ppo[:4]


def test_plain_prompts_keep_the_tokenizers_bos():
    tok = bos_tokenizer(chat=False)
    bos = tok.bos_token_id
    prompts = build_prompts(CONTEXTS, tok, TEMPLATE, PolicyConfig())
    assert not any(p.startswith("<s>") for p in prompts)
    ppo, trl, ev = _ids_everywhere(tok, prompts)
    assert ppo == trl == ev
    assert all(ids[0] == bos and ids[1] != bos for ids in ppo)
    assert trl_tokenizer(tok, prompts) is tok  # nothing to switch off


def test_mixed_prompts_are_refused():
    tok = bos_tokenizer()
    with pytest.raises(ValueError, match="mix templated and plain"):
        encode_prompts(tok, ["<s> w1", "w1"])
