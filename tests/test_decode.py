"""The compact decode loop and merged LoRA weights (issue 44): a row's tokens do not depend on its
batch, the distribution is the old path's, merged weights sample the unmerged policy, and PPO's
ratio stays against the policy that sampled."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from test_ppo import small_cfg, tiny_policy, toy_contexts, toy_reward
from tiny import tiny_llama, word_tokenizer

from rlxf_utils.models import decode
from rlxf_utils.models.decode import draw, merged_lora, row_uniforms, sample_compact
from rlxf_utils.models.generation import autocast, encode_prompts, generate
from rlxf_utils.rl.core import logprobs_from_logits
from rlxf_utils.rl.ppo import PPOTrainer

pytestmark = pytest.mark.usefixtures("one_thread")

WORDS = [f"w{i}" for i in range(30)]


class Bigram(torch.nn.Module):
    """Logits from the last token alone (a table lookup): exactly the same whatever the batch.
    It writes a dummy key per token into the cache, so dropping rows is exercised."""

    def __init__(self, vocab: int, seed: int = 0):
        from transformers import LlamaConfig

        super().__init__()
        self.config = LlamaConfig(vocab_size=vocab, hidden_size=8, num_hidden_layers=1,
                                  num_attention_heads=1, num_key_value_heads=1)  # fmt: skip
        table = 2 * torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(seed))
        table[:, 0] += 1.0  # the end token (id 0): responses end at different lengths
        self.table = torch.nn.Parameter(table, requires_grad=False)

    def forward(self, input_ids, attention_mask=None, past_key_values=None, **_):
        b, n = input_ids.shape
        past_key_values.update(torch.zeros(b, 1, n, 1), torch.zeros(b, 1, n, 1), 0)
        return types.SimpleNamespace(logits=self.table[input_ids])


def _tok():
    tok = word_tokenizer(WORDS)
    tok.padding_side = "left"
    return tok


def test_draw_follows_the_probabilities_and_never_draws_a_filtered_token():
    probs = torch.tensor([0.5, 0.0, 0.2, 0.3, 0.0])
    scores = probs.log().expand(40_000, -1)  # log 0 = -inf: filtered out, as top-p does
    u = row_uniforms(7, range(40_000), 1)[:, 0]
    freq = np.bincount(draw(scores, u).numpy(), minlength=5) / 40_000
    assert freq[1] == freq[4] == 0
    np.testing.assert_allclose(freq, probs.numpy(), atol=0.01)
    # u so close to 1 that u x total rounds to the total: still the last possible token
    assert draw(probs.log()[None], torch.tensor([1.0 - 1e-17])).item() == 3


def test_a_rows_tokens_do_not_depend_on_its_batch():
    """The same row (prompt, global index) gives the same tokens alone, in any batch, at any
    position; finished rows are padded; the cap holds."""
    tok, model = _tok(), Bigram(len(_tok()))
    prompts = ["w1 w2", "w3", "w4 w5 w6", "w7", "w8 w9", "w10"]
    kw = dict(max_new_tokens=12, temperature=0.8, top_p=0.9, stop_ids=[0], pad_id=0, seed=5)

    def run(order: list[int]) -> dict[int, list[int]]:
        enc = encode_prompts(tok, [prompts[i] for i in order], return_tensors="pt", padding=True)
        out = sample_compact(model, enc["input_ids"], enc["attention_mask"], rows=order, **kw)
        assert out.ids.shape[1] <= 12
        return {r: out.ids[i].tolist() for i, r in enumerate(order)}

    whole = run(list(range(6)))
    assert whole == run([5, 3, 1, 0, 2, 4])  # other positions, other padding
    for r in range(6):
        alone = run([r])[r]
        assert whole[r][: len(alone)] == alone and set(whole[r][len(alone) :]) <= {0}
    ends = [row.index(0) + 1 if 0 in row else len(row) for row in whole.values()]
    assert len(set(ends)) > 1 and min(ends) < 12  # rows did leave early: the test has teeth
    # `generate`: any batch size gives every response the same tokens
    gkw = dict(max_new_tokens=12, temperature=1.0, top_p=1.0, postprocess="none", seed=3,
               progress=False)  # fmt: skip
    runs = [generate(model, tok, prompts, 3, batch_size=b, **gkw) for b in (1, 4, 18)]
    assert all(r["response_ids"].tolist() == runs[0]["response_ids"].tolist() for r in runs)
    # batched by prompt length (1 to 3 words), returned in (prompt, sample) order
    assert runs[1][["prompt_id", "sample_id"]].values.tolist() == [[i, j] for i in range(6) for j in range(3)]  # fmt: skip
    other = generate(model, tok, prompts, 3, batch_size=4, **{**gkw, "seed": 4})
    assert other["response_ids"].tolist() != runs[0]["response_ids"].tolist()


def _random_lora_policy(seed: int = 0):
    """A tiny Llama with a LoRA whose B is not zero (the merged weights differ from the base)."""
    model, tok = tiny_policy(seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    return model.eval(), tok


def _token_logprobs(model, enc, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """Teacher-forced log-probs of response `ids` (B, R) under `model`, one full-batch pass."""
    full = torch.cat([enc["input_ids"], ids], 1)
    mask = torch.cat([enc["attention_mask"], torch.ones_like(ids)], 1)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=full, attention_mask=mask, position_ids=pos).logits
    R = ids.shape[1]
    return logprobs_from_logits(logits[:, -R - 1 : -1].float() / temperature, ids)


def _old_path_logprobs(model, tok, enc, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """Log-probs of response `ids` as transformers' `generate` (the old path, unmerged LoRA)
    computes them while decoding: its tokens forced to `ids`, its raw logits read back."""
    from transformers import LogitsProcessorList

    from rlxf_utils.rl.rollout import ForcedPrefix

    B, R = ids.shape
    force = ForcedPrefix(ids, torch.full((B,), R), enc["input_ids"].shape[1])
    out = model.generate(
        **enc, do_sample=True, temperature=temperature, top_p=1.0, top_k=0, max_new_tokens=R,
        pad_token_id=tok.pad_token_id, eos_token_id=[tok.eos_token_id],
        logits_processor=LogitsProcessorList([force]), output_logits=True,
        return_dict_in_generate=True,
    )  # fmt: skip
    assert torch.equal(out.sequences[:, -R:], ids)
    return logprobs_from_logits(torch.stack(out.logits, 1).float() / temperature, ids)


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
@pytest.mark.parametrize("seed", [0, 1])
def test_compact_merged_samples_have_the_old_paths_logprobs(precision, seed):
    """The new path (merged LoRA, rows leaving the batch) draws each token from the distribution
    the old path (transformers' generate, unmerged LoRA, the whole batch) gives it: per-token
    log-probs equal within fp32 rounding; under bf16 autocast, as close to the fp32 policy's as
    the old path's own (bf16 rounding, not another distribution)."""
    model, tok = _random_lora_policy()
    prompts, _ = toy_contexts(8)
    enc = encode_prompts(tok, prompts, return_tensors="pt", padding=True)
    dtype = None if precision == "float32" else precision
    with torch.no_grad(), autocast(dtype, "cpu"):
        with merged_lora(model):
            out = sample_compact(
                model, enc["input_ids"], enc["attention_mask"], max_new_tokens=10,
                temperature=0.7, top_p=1.0, stop_ids=[tok.eos_token_id], pad_id=tok.pad_token_id,
                seed=seed,
            )  # fmt: skip
        old = _old_path_logprobs(model, tok, enc, out.ids, 0.7)
    with torch.no_grad():
        exact = _token_logprobs(model, enc, out.ids, 0.7)  # fp32, one teacher-forced pass
    keep = out.logprobs != 0  # response tokens (0 past the end)
    assert keep.sum() > 20
    if dtype is None:
        assert (out.logprobs - old)[keep].abs().max().item() < 1e-4
        return
    new_err, old_err = (out.logprobs - exact)[keep].abs(), (old - exact)[keep].abs()
    assert new_err.mean() <= 1.25 * old_err.mean() + 1e-3, (new_err.mean(), old_err.mean())
    assert new_err.max() <= 2 * old_err.max() + 0.02, (new_err.max(), old_err.max())


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_merged_lora_is_the_unmerged_policy_and_leaves_it_as_it_was(precision):
    model, tok = _random_lora_policy()
    enc = encode_prompts(tok, toy_contexts(8)[0], return_tensors="pt", padding=True)
    with torch.no_grad():
        exact = model(**enc).logits  # fp32, unmerged
        with model.disable_adapter():
            base = model(**enc).logits
    for n, p in model.named_parameters():  # evaluation's adapters are frozen, PPO's are not
        if "lora_A" in n:
            p.requires_grad_(False)
    params = {n: (p, p.detach().clone(), p.requires_grad) for n, p in model.named_parameters()}
    dtype = None if precision == "float32" else precision
    with torch.no_grad(), autocast(dtype, "cpu"):
        unmerged = model(**enc).logits.float()
        with merged_lora(model):
            merged = model(**enc).logits.float()
        again = model(**enc).logits.float()
    assert (exact - base).abs().max() > 1.0  # the adapter matters: the test has teeth
    if dtype is None:
        assert (merged - unmerged).abs().max() < 1e-4
    else:  # W + BA rounded to bf16 once instead of W and BA x apart: bf16 rounding, no worse
        err = lambda x: (x - exact).abs().max().item()  # noqa: E731
        assert err(merged) <= 1.5 * err(unmerged) + 1e-3, (err(merged), err(unmerged))
    torch.testing.assert_close(again, unmerged, rtol=0, atol=0)
    for n, p in model.named_parameters():  # the very same parameters, values and flags
        orig, value, grad = params[n]
        assert p is orig and torch.equal(p, value) and p.requires_grad == grad


def test_merged_lora_leaves_a_plain_model_alone():
    model = tiny_llama(_tok())
    weights = [p for p in model.parameters()]
    with merged_lora(model):
        assert [p for p in model.parameters()] == weights


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_ppos_ratio_is_to_the_policy_that_sampled(tmp_path, monkeypatch, precision):
    """PPO samples from merged weights and recomputes its old log-probs on the unmerged policy:
    they agree with the sampler's own log-probs within rounding, so the ratio is to the policy
    that sampled."""
    import rlxf_utils.rl.rollout as rollout

    seen = []

    def spy(*args, **kw):
        out = sample_compact(*args, **kw)
        seen.append(out)
        return out

    monkeypatch.setattr(rollout, "sample_compact", spy)  # where PPO samples
    model, tok = _random_lora_policy()
    model.train()
    for n, p in model.named_parameters():
        p.requires_grad_("lora_" in n)
    prompts, contexts = toy_contexts(8)
    dtype = None if precision == "float32" else precision
    tr = PPOTrainer(model, tok, prompts, contexts, toy_reward, small_cfg(temperature=1.0),
                    tmp_path, seed=0, autocast_dtype=dtype)  # fmt: skip
    ro = tr.rollout(tr._next_batch())
    pp = tr.prepare(ro)
    (sampled,) = seen
    assert torch.equal(
        sampled.ids[ro.response_mask.bool()], ro.response_ids[ro.response_mask.bool()]
    )
    mask = pp.mask.bool()
    diff = (sampled.logprobs[mask] - pp.old_logprobs[mask]).abs().max().item()
    assert diff < (1e-4 if dtype is None else 0.1), diff


def test_a_prompts_samples_share_one_prefill_and_draw_what_separate_prefills_draw():
    """Rows repeating a prompt (a prompt's k samples, an RL group) prefill it once; each row then
    draws what it draws with a prefill of its own (fp32: the same tokens, log-probs within
    rounding). The first forward sees the distinct prompts only: the sharing has teeth."""
    model, tok = _random_lora_policy(seed=3)
    prompts = ["w1 w2 w3", "w4", "w1 w2 w3", "w5 w6", "w4", "w1 w2 w3"]  # 3 distinct
    enc = encode_prompts(tok, prompts, return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=10, temperature=1.0, top_p=1.0, stop_ids=[tok.eos_token_id],
              pad_id=tok.pad_token_id, seed=11)  # fmt: skip
    seen: list[int] = []

    def step(**inputs):
        seen.append(inputs["input_ids"].shape[0])
        return model(**inputs)

    shared = sample_compact(model, enc["input_ids"], enc["attention_mask"], step=step, **kw)
    assert seen[0] == 3 and seen[1] <= 6
    for r in range(6):  # each row alone: nothing to share
        one = sample_compact(model, enc["input_ids"][r : r + 1], enc["attention_mask"][r : r + 1],
                             rows=[r], **kw)  # fmt: skip
        n = one.ids.shape[1]
        assert shared.ids[r, :n].tolist() == one.ids[0].tolist()
        torch.testing.assert_close(shared.logprobs[r, :n], one.logprobs[0], atol=1e-5, rtol=0)
    assert len({tuple(shared.ids[r].tolist()) for r in (0, 2, 5)}) > 1  # own streams per row
    assert decode.shared_prefill(enc["input_ids"][:2], enc["attention_mask"][:2], None) is None
    names = ["a", "b", "a", "a", "b", "b"]  # rows 0, 2 and 5 share a prompt, not an adapter
    first, inverse = decode.shared_prefill(enc["input_ids"], enc["attention_mask"], names)
    assert first.tolist() == [0, 1, 3, 5] and inverse.tolist() == [0, 1, 0, 2, 1, 3]


def test_a_forced_prefix_is_continued_token_for_token():
    tok, model = _tok(), Bigram(len(_tok()))
    enc = encode_prompts(tok, ["w1", "w2 w3", "w4"], return_tensors="pt", padding=True)
    prefix = torch.tensor([[5, 6, 7], [8, 9, 10], [0, 0, 0]]), torch.tensor([3, 1, 0])
    out = sample_compact(model, enc["input_ids"], enc["attention_mask"], max_new_tokens=6,
                         temperature=1.0, top_p=1.0, stop_ids=[0], pad_id=0, seed=2,
                         prefix=prefix).ids  # fmt: skip
    assert out[0, :3].tolist() == [5, 6, 7] and out[1, 0].item() == 8


@pytest.mark.parametrize("merge", [True, False])
def test_transformers_generate_through_peft_samples_from_merged_weights(merge):
    """TRL's and ILHF's rollouts call `generate` through peft: with `policy.merge_lora` the
    model's own generate merges the LoRA (adapters off, W + BA in the base layer), except in
    peft's mixed-adapter batches; afterwards every weight and flag is as before."""
    from peft.tuners.lora import LoraLayer

    from rlxf_utils.config import LoraSettings
    from rlxf_utils.models.generation import cache_in_autocast_dtype
    from rlxf_utils.models.loading import apply_lora

    tok = word_tokenizer(WORDS)
    tok.padding_side = "left"
    base = cache_in_autocast_dtype(tiny_llama(tok, init=0.3), merge_lora=merge)
    model = apply_lora(base, LoraSettings(rank=4, alpha=8, target_modules=["q_proj", "v_proj"]))
    layer = next(m for m in model.modules() if isinstance(m, LoraLayer))
    seen = []
    layer.register_forward_hook(lambda m, a, o: seen.append(m.disable_adapters))
    enc = encode_prompts(tok, ["w1 w2", "w3"], return_tensors="pt", padding=True)
    with torch.no_grad():
        model.generate(**enc, do_sample=True, max_new_tokens=3, pad_token_id=tok.pad_token_id)
    assert seen and all(s == merge for s in seen)
    assert not layer.disable_adapters
    assert all(p.requires_grad for n, p in model.named_parameters() if "lora_" in n)


def test_auto_batch_is_what_free_memory_holds():
    """`evaluation.batch_size: auto`: on an accelerator, 80% of free memory over one row's bytes
    (KV cache at full length dominates for a Llama-2-7B shape), a multiple of 8, capped; on a
    CPU the bench's 64; never more rows than there are."""
    from transformers import LlamaConfig

    from rlxf_utils.models.decode import MAX_AUTO_BATCH, auto_batch_size, sequence_bytes

    big = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=32, vocab_size=32000)  # fmt: skip
    per_row = sequence_bytes(big, 128, 128, 2)
    kv = 2 * 32 * 32 * 128 * 256 * 2  # 128 MiB: a 7B model's KV cache for 256 tokens in bf16
    assert kv < per_row < 1.5 * kv
    fake = types.SimpleNamespace(
        config=big, parameters=lambda: iter([torch.zeros(1, dtype=torch.bfloat16)])
    )
    free = 40 * 2**30  # e.g. an H100 after the weights and their merged copy
    b = auto_batch_size(fake, 128, 128, free_bytes=free)
    assert b % 8 == 0 and b * per_row <= 0.8 * free < (b + 8) * per_row
    assert 200 < b < 260  # ~0.8 x 40 GiB / ~137 MiB
    assert auto_batch_size(fake, 128, 128, free_bytes=2**50) == MAX_AUTO_BATCH
    assert auto_batch_size(fake, 128, 128, free_bytes=free, n_items=20) == 20
    assert auto_batch_size(fake, 128, 128, free_bytes=per_row) == 1  # less than one row: one
    # a CPU model: the measured 64, and `generate(batch_size='auto')` gives the same tokens
    tok, model = _tok(), Bigram(len(_tok()))
    assert auto_batch_size(model, 8, 8) == 64 and auto_batch_size(model, 8, 8, n_items=5) == 5
    gkw = dict(max_new_tokens=6, temperature=1.0, top_p=1.0, postprocess="none", seed=3,
               progress=False)  # fmt: skip
    prompts = ["w1 w2", "w3"]
    auto = generate(model, tok, prompts, 3, batch_size="auto", **gkw)
    fixed = generate(model, tok, prompts, 3, batch_size=2, **gkw)
    assert auto["response_ids"].tolist() == fixed["response_ids"].tolist()
    with pytest.raises(ValueError, match="batch_size=0; expected a positive int or 'auto'"):
        generate(model, tok, prompts, 1, batch_size=0, **gkw)
