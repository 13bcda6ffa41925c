"""Policy loading: GGUF -> safetensors cache (atomic, identical logits), prompts, LoRA, errors."""

from __future__ import annotations

import pytest
import torch
from test_ppo import tiny_tokenizer

from rlxf_utils import models
from rlxf_utils.config import LoraSettings, PolicyConfig


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
        models.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: _tiny_model()
    )
    monkeypatch.setattr(models.AutoTokenizer, "from_pretrained", lambda *a, **k: tiny_tokenizer())
    target = tmp_path / "cache" / "m"
    models._convert_gguf(tmp_path, "x.gguf", target)
    assert (target / "model.safetensors").is_file()
    assert "quantization_config" not in (target / "config.json").read_text()

    # A crash while writing leaves neither a target nor a temporary folder behind.
    tok = tiny_tokenizer()

    def boom(*a, **k):
        raise RuntimeError("disk full")

    tok.save_pretrained = boom
    monkeypatch.setattr(models.AutoTokenizer, "from_pretrained", lambda *a, **k: tok)
    with pytest.raises(RuntimeError, match="disk full"):
        models._convert_gguf(tmp_path, "x.gguf", tmp_path / "cache" / "broken")
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["m"]


def test_cache_root_env(monkeypatch, tmp_path):
    monkeypatch.setenv("RLXF_CACHE", str(tmp_path))
    assert models.cache_root() == tmp_path
    monkeypatch.delenv("RLXF_CACHE")
    assert models.cache_root().parts[-2:] == (".cache", "models")


def test_resolve_policy_source_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        models.resolve_policy_source(str(tmp_path / "empty"))
    assert (
        models.resolve_policy_source("meta-llama/Llama-2-7b-chat-hf")
        == "meta-llama/Llama-2-7b-chat-hf"
    )


def test_format_prompt_plain_and_chat():
    tok = tiny_tokenizer()
    assert models.format_prompt(tok, "w1 w2") == "w1 w2"
    tok.chat_template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    )
    assert models.format_prompt(tok, "hi") == "<user>hi<assistant>"
    assert models.format_prompt(tok, "hi", system_prompt="S") == "<system>S<user>hi<assistant>"
    assert models.format_prompt(tok, "hi", use_chat_template=False) == "hi"


def test_apply_lora_checks_target_modules():
    with pytest.raises(ValueError, match="target_modules"):
        models.apply_lora(_tiny_model(), LoraSettings(target_modules=["nope_proj"]))
    peft_model = models.apply_lora(_tiny_model(), LoraSettings(rank=2, target_modules=["q_proj"]))
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)


@pytest.mark.slow
def test_embedded_cache_gives_identical_logits():
    """The cached safetensors copy of the embedded GGUF policy reproduces its logits exactly."""
    from transformers import AutoModelForCausalLM

    src = models.embedded_gguf_dir()
    ref = AutoModelForCausalLM.from_pretrained(
        src, gguf_file=models.EMBEDDED_GGUF_FILE, dtype=torch.float32
    )
    cached, tok = models.load_policy(PolicyConfig())
    ids = tok(["The IMF programme requires"], return_tensors="pt")
    with torch.no_grad():
        a = ref(**ids).logits
        b = cached(**ids).logits
    assert torch.equal(a, b)
    assert tok.padding_side == "left" and tok.chat_template
