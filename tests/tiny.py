"""Tiny models built from a config, shared by the tests (no real weights, seconds on one CPU)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def word_tokenizer(
    words: Sequence[str], specials: Sequence[str] = ("<eos>", "<unk>"), pad: str = "<eos>"
):
    """A whitespace word-level tokenizer: specials first (ids 0..), then `words`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {
        **{s: i for i, s in enumerate(specials)},
        **{w: i + len(specials) for i, w in enumerate(words)},
    }
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, eos_token="<eos>", pad_token=pad, unk_token="<unk>"
    )


def tiny_llama(tok, seed: int = 0, init: float = 0.02, vocab_size: int | None = None, **fields):
    """A random 2-layer Llama (hidden 32) sized to `tok`; `init` sets how peaked its outputs are;
    `fields`: further LlamaConfig fields (e.g. tie_word_embeddings=True, as SmolLM2 has)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size or len(tok), hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, initializer_range=init, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id, **fields,
    )  # fmt: skip
    return LlamaForCausalLM(config)
