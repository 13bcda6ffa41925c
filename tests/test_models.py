"""Policy loading: GGUF -> safetensors cache (atomic, identical logits), prompts, LoRA, errors."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from test_ppo import tiny_tokenizer
from tiny import tiny_llama

from rlxf_utils import runtime
from rlxf_utils.config import LoraSettings, PolicyConfig
from rlxf_utils.models import generation, loading


def _tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg)
    model.config.quantization_config = {"quant_method": "gguf"}  # what a GGUF load leaves behind
    return model


def test_convert_writes_plain_folder_atomically(tmp_path, monkeypatch):
    monkeypatch.setattr(
        loading.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: _tiny_model()
    )
    monkeypatch.setattr(loading.AutoTokenizer, "from_pretrained", lambda *a, **k: tiny_tokenizer())
    target = tmp_path / "cache" / "m"
    loading._convert_gguf(tmp_path, "x.gguf", target)
    assert (target / "model.safetensors").is_file()
    assert "quantization_config" not in (target / "config.json").read_text()

    # A crash while writing leaves neither a target nor a temporary folder behind.
    tok = tiny_tokenizer()

    def boom(*a, **k):
        raise RuntimeError("disk full")

    tok.save_pretrained = boom
    monkeypatch.setattr(loading.AutoTokenizer, "from_pretrained", lambda *a, **k: tok)
    with pytest.raises(RuntimeError, match="disk full"):
        loading._convert_gguf(tmp_path, "x.gguf", tmp_path / "cache" / "broken")
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["m"]


def test_cache_root_env(monkeypatch, tmp_path):
    monkeypatch.setenv("RLXF_CACHE", str(tmp_path))
    assert runtime.cache_root() == tmp_path
    monkeypatch.delenv("RLXF_CACHE")
    assert runtime.cache_root().parts[-2:] == (".cache", "models")


def test_resolve_policy_source_prefers_local_folders(tmp_path, monkeypatch):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        loading.resolve_policy_source(str(tmp_path / "empty"))
    # a model folder resolves to its path, with `~` expanded
    good = tmp_path / "home" / "m"
    good.mkdir(parents=True)
    (good / "config.json").write_text("{}")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert loading.resolve_policy_source("~/m") == str(good)
    # a name that exists as a local folder is that folder, not a hub id: it is checked as one
    monkeypatch.chdir(tmp_path)
    (tmp_path / "meta-llama" / "Llama-2-7b-chat-hf").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="config.json"):
        loading.resolve_policy_source("meta-llama/Llama-2-7b-chat-hf")


def test_format_prompt_plain_and_chat():
    tok = tiny_tokenizer()
    assert generation.format_prompt(tok, "w1 w2") == "w1 w2"
    tok.chat_template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    )
    assert generation.format_prompt(tok, "hi") == "<user>hi<assistant>"
    assert generation.format_prompt(tok, "hi", system_prompt="S") == "<system>S<user>hi<assistant>"
    assert generation.format_prompt(tok, "hi", use_chat_template=False) == "hi"


def test_apply_lora_checks_target_modules():
    with pytest.raises(ValueError, match="target_modules"):
        loading.apply_lora(_tiny_model(), LoraSettings(target_modules=["nope_proj"]))
    peft_model = loading.apply_lora(_tiny_model(), LoraSettings(rank=2, target_modules=["q_proj"]))
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)


@pytest.mark.slow
def test_embedded_cache_gives_identical_logits():
    """The cached safetensors copy of the embedded GGUF policy reproduces its logits exactly."""
    from transformers import AutoModelForCausalLM

    src = loading.embedded_gguf_dir()
    ref = AutoModelForCausalLM.from_pretrained(
        src, gguf_file=loading.EMBEDDED_GGUF_FILE, dtype=torch.float32
    )
    cached, tok = loading.load_policy(PolicyConfig())
    ids = tok(["The IMF programme requires"], return_tensors="pt")
    with torch.no_grad():
        a = ref(**ids).logits
        b = cached(**ids).logits
    assert torch.equal(a, b)
    assert tok.padding_side == "left" and tok.chat_template


@pytest.mark.slow
def test_an_embedded_policys_adapter_names_no_checkout_path(tmp_path):
    """peft writes the base model's `name_or_path` into each adapter it saves: the embedded
    policy's is its name, not the cache folder's absolute path, so adapters (and the hashes
    taken over them) are the same in every checkout (issue 47)."""
    import json

    from rlxf_utils.config import PROJECT_ROOT, portable_path

    model, _ = loading.load_policy(PolicyConfig())
    assert model.name_or_path == loading.EMBEDDED_BASE_NAME
    peft_model = loading.apply_lora(model, LoraSettings(rank=2, target_modules=["q_proj"]))
    peft_model.save_pretrained(tmp_path / "a")
    saved = json.loads((tmp_path / "a/adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == loading.EMBEDDED_BASE_NAME
    assert str(PROJECT_ROOT) not in (tmp_path / "a/README.md").read_text()
    # a path inside the checkout is recorded relative to it; one outside as given
    assert portable_path(PROJECT_ROOT / "data/raw/x.csv") == "data/raw/x.csv"
    assert portable_path(tmp_path / "x.csv") == str(tmp_path / "x.csv")


@pytest.mark.usefixtures("one_thread")
def test_load_start_policy_merges_the_sft_adapter(tmp_path):
    """RL's start (and KL reference) is the base with the `sft` adapter folded in."""
    tok = tiny_tokenizer()
    tiny_llama(tok, seed=0, init=0.3).save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    cfg = PolicyConfig(model=str(tmp_path / "base"))
    lora = LoraSettings(rank=4, alpha=8, target_modules=["q_proj", "v_proj"])
    sft = loading.apply_lora(tiny_llama(tok, seed=0, init=0.3), lora)
    torch.manual_seed(1)
    for name, p in sft.named_parameters():
        if "lora_B" in name:  # a trained adapter (LoRA starts with B = 0)
            p.data.normal_(0.0, 0.3)
    sft.save_pretrained(tmp_path / "run" / "policy" / "sft" / "adapter")

    enc = generation.encode_prompts(tok, ["w1 w2 w3", "w4"], return_tensors="pt", padding=True)
    pos = (enc["attention_mask"].cumsum(-1) - 1).clamp(min=0)

    def logits(m):
        with torch.no_grad():
            return m(**enc, position_ids=pos).logits

    start, start_tok = loading.load_start_policy(cfg, "sft", tmp_path / "run")
    base, _ = loading.load_start_policy(cfg, "base", tmp_path / "run")
    assert not hasattr(start, "peft_config") and start_tok.padding_side == "left"
    want = logits(sft.eval())
    got = logits(start)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert (want - logits(base)).abs().max() > 1e-2  # the adapter matters
    # a fresh RL LoRA on the start policy: adapters off is exactly the start policy
    rl = loading.apply_lora(start, LoraSettings(rank=2, alpha=4, target_modules=["q_proj"]))
    with rl.disable_adapter():
        torch.testing.assert_close(logits(rl), got, rtol=0, atol=1e-6)
    with pytest.raises(FileNotFoundError, match="SFT stage"):
        loading.load_start_policy(cfg, "sft", tmp_path / "elsewhere")


def test_autocast_sees_weight_updates_inside_one_context() -> None:
    """A training loop inside one autocast context (TRL's train()) must use the updated weights."""
    from rlxf_utils.models.generation import autocast

    lin = torch.nn.Linear(4, 1, bias=False)
    torch.nn.init.zeros_(lin.weight)
    x = torch.ones(1, 4)
    with autocast("bfloat16"):
        before = lin(x).float().item()
        with torch.no_grad():
            lin.weight.add_(1.0)
        after = lin(x).float().item()
    assert before == 0.0 and after == 4.0


def test_generation_cache_in_autocast_dtype_is_bit_identical():
    """Under bf16 autocast the policy's KV cache keeps bf16 keys and values (attention would cast
    them anyway): the same scores and tokens as transformers' fp32 cache, for left-padded prompts.
    Outside autocast the default cache is used."""
    from transformers.cache_utils import DynamicLayer

    tok = tiny_tokenizer()
    model = generation.cache_in_autocast_dtype(tiny_llama(tok, init=0.5).eval())
    enc = tok(["a b c d", "b"], return_tensors="pt", padding=True)
    kw = dict(do_sample=True, max_new_tokens=8, top_k=0, output_scores=True,
              return_dict_in_generate=True, pad_token_id=tok.pad_token_id)  # fmt: skip
    runs = {}
    for name, generate in (("default", lambda **k: type(model).generate(model, **k)),
                           ("cast", model.generate)):  # fmt: skip
        torch.manual_seed(0)
        with torch.inference_mode(), generation.autocast("bfloat16", "cpu"):
            runs[name] = generate(**enc, **kw)
    assert type(runs["cast"].past_key_values.layers[0]) is not DynamicLayer
    assert runs["cast"].past_key_values.layers[0].keys.dtype == torch.bfloat16
    assert runs["default"].past_key_values.layers[0].keys.dtype == torch.float32
    assert torch.equal(runs["cast"].sequences, runs["default"].sequences)
    for a, b in zip(runs["cast"].scores, runs["default"].scores, strict=True):
        assert torch.equal(a, b)
    with torch.inference_mode():
        out = model.generate(**enc, **kw)  # no autocast: transformers' own cache
    assert type(out.past_key_values.layers[0]) is DynamicLayer


def _lora_tiny(tok):
    """A tiny tied-embedding Llama (as SmolLM2) with a trained-looking LoRA adapter."""
    base = generation.cache_in_autocast_dtype(tiny_llama(tok, init=0.5, tie_word_embeddings=True))
    lora = LoraSettings(rank=4, alpha=8, target_modules=["q_proj", "v_proj"])
    model = loading.apply_lora(base, lora)
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # LoRA starts with B = 0: make the adapter matter
            p.data.normal_(0.0, 0.3)
    return base, model.eval()


def test_frozen_weights_cast_once_sample_the_same_tokens_and_are_restored():
    """Generation under bf16 autocast with the frozen base weights cast once (what `generate`
    does) samples the very tokens, with the very scores, of autocast casting them at every step;
    inside the context the frozen weights are bf16 and the trainable LoRA weights float32; on
    leaving every original parameter is back and the LM head is tied to the embeddings again;
    outside autocast nothing is cast."""
    tok = tiny_tokenizer()
    base, model = _lora_tiny(tok)
    params = dict(model.named_parameters())
    assert base.lm_head.weight is base.model.embed_tokens.weight
    enc = tok(["a b c d", "b"], return_tensors="pt", padding=True)
    kw = dict(do_sample=True, max_new_tokens=8, top_k=0, output_scores=True,
              return_dict_in_generate=True, pad_token_id=tok.pad_token_id)  # fmt: skip
    runs = {}
    for name, gen in (
        ("each step", lambda **k: type(base).generate(base, past_key_values=generation.autocast_kv_cache(base), **k)),
        ("once", model.generate),
    ):  # fmt: skip
        torch.manual_seed(0)
        with torch.inference_mode(), generation.autocast("bfloat16", "cpu"):
            runs[name] = gen(**enc, **kw)
    assert torch.equal(runs["once"].sequences, runs["each step"].sequences)
    for a, b in zip(runs["once"].scores, runs["each step"].scores, strict=True):
        assert torch.equal(a, b)

    q = base.model.layers[0].self_attn.q_proj
    with generation.autocast("bfloat16", "cpu"), generation.frozen_weights_in_autocast_dtype(model):
        assert q.base_layer.weight.dtype == torch.bfloat16
        assert base.lm_head.weight.dtype == torch.bfloat16
        assert base.model.embed_tokens.weight.dtype == torch.float32
        assert q.lora_A["default"].weight.dtype == torch.float32  # trainable: untouched
    now = dict(model.named_parameters())
    assert now.keys() == params.keys() and all(now[n] is p for n, p in params.items())
    assert base.lm_head.weight is base.model.embed_tokens.weight
    with generation.frozen_weights_in_autocast_dtype(model):  # no autocast
        assert q.base_layer.weight.dtype == torch.float32


def test_frozen_weights_cast_once_keep_mixed_adapter_batches_identical(monkeypatch):
    """An ILHF ensemble's batch, each prompt answered by its own adapter (peft's mixed batches),
    with every adapter frozen as evaluation loads them: the adapters' weights are cast once too,
    and the tokens and scores are those of autocast casting every weight at every step."""
    tok = tiny_tokenizer()
    _, model = _lora_tiny(tok)
    model.add_adapter("second", loading.lora_config(LoraSettings(rank=4, alpha=8, target_modules=["q_proj", "v_proj"])))  # fmt: skip
    torch.manual_seed(2)
    for name, p in model.named_parameters():
        if "lora_B.second" in name:
            p.data.normal_(0.0, 0.3)
    model.requires_grad_(False)
    enc = tok(["a b c d", "b", "c", "d a"], return_tensors="pt", padding=True)
    kw = dict(do_sample=True, max_new_tokens=8, top_k=0, output_scores=True,
              return_dict_in_generate=True, pad_token_id=tok.pad_token_id,
              adapter_names=["default", "second", "second", "default"])  # fmt: skip
    runs = {}
    for name in ("once", "each step"):
        if name == "each step":
            monkeypatch.setattr(generation, "frozen_weights_in_autocast_dtype", lambda m: contextlib.nullcontext())  # fmt: skip
        torch.manual_seed(0)
        with torch.inference_mode(), generation.autocast("bfloat16", "cpu"):
            runs[name] = model.generate(**enc, **kw)
    assert torch.equal(runs["once"].sequences, runs["each step"].sequences)
    for a, b in zip(runs["once"].scores, runs["each step"].scores, strict=True):
        assert torch.equal(a, b)


def test_sequence_logprobs_with_weights_cast_once_are_identical(monkeypatch):
    """`sequence_logprobs` under bf16 autocast gives the same numbers with the frozen weights cast
    once as with autocast casting them in every forward pass."""
    from rlxf_utils.models import logprobs

    tok = tiny_tokenizer()
    _, model = _lora_tiny(tok)
    pairs = (["a b c d", "b", "c d"], [[5, 6, 7], [8], [9, 10]])
    with generation.autocast("bfloat16", "cpu"):
        once, _ = logprobs.sequence_logprobs(model, tok, *pairs, batch_size=2, padding_side="left")
        monkeypatch.setattr(
            logprobs, "frozen_weights_in_autocast_dtype", lambda m: contextlib.nullcontext()
        )
        each, _ = logprobs.sequence_logprobs(model, tok, *pairs, batch_size=2, padding_side="left")
    fp32, _ = logprobs.sequence_logprobs(model, tok, *pairs, batch_size=2, padding_side="left")
    assert np.array_equal(once, each)
    assert not np.array_equal(once, fp32)  # autocast was on: bf16 numbers differ from fp32's


def test_sequence_logprobs_shared_prompts_under_lora_and_bf16_autocast():
    """The shared-prefill path on a peft LoRA policy, its adapter active and disabled (the start
    policy and the base in evaluation), in float32 and under bf16 autocast with the KV cache and
    frozen weights in bf16: the one-pass path's numbers up to rounding. float32: 2e-5 on sums of
    -20 to -82 (measured 6.7e-6). bf16: 0.15, about twice what the one-pass path itself moves
    between batch sizes and padding sides (measured: the shared path within 0.080 of the one-pass
    path, which spans 0.069 itself; 79 response tokens, sums to -82)."""
    from rlxf_utils.models import logprobs

    tok = tiny_tokenizer()
    _, model = _lora_tiny(tok)
    rng = np.random.default_rng(0)
    prompts, responses = [], []
    for n in (3, 1, 6, 9):  # 4 prompts x 4 responses of 0 to 11 tokens
        prompt = rng.integers(3, len(tok), size=n).tolist()
        for _ in range(4):
            prompts.append(prompt)
            responses.append(rng.integers(3, len(tok), size=int(rng.integers(0, 12))).tolist())
    cached = []
    model.register_forward_pre_hook(
        lambda m, a, kw: cached.append(kw.get("past_key_values") is not None), with_kwargs=True
    )
    fp32 = {}
    for dtype, tol in ((None, 2e-5), ("bfloat16", 0.15)):
        for adapter in ("active", "disabled"):
            off = model.disable_adapter() if adapter == "disabled" else contextlib.nullcontext()
            with generation.autocast(dtype, "cpu"), off:
                for batch in (3, 16):
                    one = [
                        logprobs.sequence_logprobs(model, tok, prompts, responses, batch,
                                                   padding_side=side, share_prompts=False)[0]
                        for side in ("left", "right")
                    ]  # fmt: skip
                    cached.clear()
                    shared, _ = logprobs.sequence_logprobs(model, tok, prompts, responses, batch)
                    assert cached and all(cached)  # the shared path ran
                    for ref in one:
                        np.testing.assert_allclose(shared, ref, rtol=0, atol=tol,
                                                   err_msg=f"{dtype} {adapter} {batch}")  # fmt: skip
            if dtype is None:
                fp32[adapter] = shared
            else:  # bf16 was on: other numbers than float32's
                assert not np.allclose(shared, fp32[adapter], atol=1e-3)
    assert not np.allclose(fp32["active"], fp32["disabled"], atol=1e-2)  # the adapter matters
