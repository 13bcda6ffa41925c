"""One optimiser (`rl.optimizer`): the optimiser each training path builds from one parameters
object, read back from what it built, is the same (PPO, ILHF and SFT (`sft`, `sft_met`): our
AdamW; GRPO, RLOO, KTO, DPO and RFT: TRL's TrainingArguments, turned into an optimiser by
transformers' Trainer)."""

from __future__ import annotations

import pytest
import torch
import trl
from test_ilhf import ensemble
from test_ppo import small_cfg, tiny_policy, tiny_tokenizer, toy_contexts, toy_reward
from tiny import tiny_llama
from transformers import Trainer

from rlxf_utils.config import (
    ILHFConfig,
    LoraSettings,
    OfflineConfig,
    OptimizerConfig,
    PolicyConfig,
    SFTConfig,
)
from rlxf_utils.rl import offline
from rlxf_utils.rl.ilhf import ILHFTrainer
from rlxf_utils.rl.ppo import PPOTrainer
from rlxf_utils.rl.sft import SFTExample, train_sft
from rlxf_utils.rl.trainer import TrainJob
from rlxf_utils.rl.trl_runs import run_trl

pytestmark = pytest.mark.usefixtures("one_thread")
# none of these is a default of torch's AdamW or of TRL's TrainingArguments
OPT = OptimizerConfig(eps=3e-7, weight_decay=0.05, beta1=0.8, beta2=0.95, max_grad_norm=0.7)
LR = 2e-3


class _Built(Exception):
    """Raised by a spy Trainer: the arguments are built, nothing needs to train."""


def _settings(opt: torch.optim.Optimizer) -> dict:
    """What an optimiser does with a gradient: its class and each group's settings."""
    opt = getattr(opt, "optimizer", opt)  # accelerate's wrapper
    groups = [{k: g[k] for k in ("betas", "eps", "weight_decay")} for g in opt.param_groups]
    assert all(g == groups[0] for g in groups), groups
    return {"class": type(opt), "lr": opt.param_groups[0]["lr"], **groups[0]}


def _trl_settings(args) -> dict:
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    assert args.lr_scheduler_type == "constant" and args.warmup_steps == 0
    return {"class": cls, "lr": kwargs["lr"], "betas": tuple(kwargs["betas"]), "eps": kwargs["eps"],
            "weight_decay": args.weight_decay, "max_grad_norm": args.max_grad_norm}  # fmt: skip


def _trl_args(monkeypatch, tmp_path, algo: str):
    """The TrainingArguments the study's TRL path for `algo` builds (a spy Trainer catches them)."""
    seen = {}

    class Spy:
        def __init__(self, *a, **kw):
            seen["args"] = kw["args"]
            raise _Built

    name = {"grpo": "GRPOTrainer", "rloo": "RLOOTrainer", "kto": "KTOTrainer",
            "dpo": "DPOTrainer", "rft": "SFTTrainer"}[algo]  # fmt: skip
    monkeypatch.setattr(trl, name, Spy)
    tok = tiny_tokenizer()
    prompts, contexts = toy_contexts(8)
    rl = small_cfg(steps=1, batch_size=4, num_generations=2, minibatch_size=4,
                   learning_rate=LR, optimizer=OPT)  # fmt: skip
    job = TrainJob(algo, tiny_llama(tok, 0), tok, prompts, contexts, toy_reward, rl,
                   PolicyConfig(lora=LoraSettings(rank=4, alpha=8, target_modules=["q_proj"])),
                   tmp_path / algo, progress=False)  # fmt: skip
    with pytest.raises(_Built):
        if algo in ("grpo", "rloo"):
            run_trl(job)
        else:
            rows = {
                "kto": [{"prompt": p, "completion": "w20", "label": i % 2 == 0} for i, p in enumerate(prompts)],
                "dpo": [{"prompt": p, "chosen": "w20", "rejected": "w30"} for p in prompts],
                "rft": [{"prompt": p, "completion": "w20"} for p in prompts],
            }[algo]  # fmt: skip
            offline.train_offline(job, OfflineConfig(), rows)
    return seen["args"]


def test_every_path_builds_the_one_optimiser(monkeypatch, tmp_path):
    want = {"class": torch.optim.AdamW, "lr": LR, "betas": (0.8, 0.95), "eps": 3e-7,
            "weight_decay": 0.05}  # fmt: skip
    model, tok = tiny_policy()
    prompts, contexts = toy_contexts(8)
    cfg = small_cfg(learning_rate=LR, optimizer=OPT)
    ppo = PPOTrainer(model, tok, prompts, contexts, toy_reward, cfg, tmp_path / "ppo")
    assert _settings(ppo.optimizer) == want
    model, tok = ensemble(particles=2)
    ilhf = ILHFTrainer(model, tok, ILHFConfig(particles=2), cfg, tmp_path / "ilhf", "ilhf_history")
    assert all(_settings(o) == want for o in ilhf.optimizers.values())
    for algo in ("grpo", "rloo", "kto", "dpo", "rft"):
        got = _trl_settings(_trl_args(monkeypatch, tmp_path, algo))
        assert got == {**want, "max_grad_norm": 0.7}, algo


def test_sft_steps_the_one_optimiser(monkeypatch):
    """SFT (`sft` and `sft_met` both train through `train_sft`) steps the AdamW every other path
    builds: `rl.optimizer`'s eps, betas, weight decay and clipping, at a constant learning rate
    (the old loop had its own AdamW: eps 1e-8, no betas from the parameters, warm-up and decay)."""
    built, clip_norms = [], []

    class SpyAdamW(torch.optim.AdamW):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            built.append(self)

    clip = torch.nn.utils.clip_grad_norm_

    def spy_clip(params, max_norm, *a, **kw):
        clip_norms.append(max_norm)
        return clip(params, max_norm, *a, **kw)

    monkeypatch.setattr(torch.optim, "AdamW", SpyAdamW)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", spy_clip)
    model, tok = tiny_policy()
    w = tok.convert_tokens_to_ids
    examples = [SFTExample(w(["w11", "w12"]), [*w(["w20", "w21"]), tok.eos_token_id]),
                SFTExample(w(["w13", "w14", "w15"]), [w("w24"), tok.eos_token_id])] * 5  # fmt: skip
    sft = SFTConfig(batch_size=2, epochs=2, learning_rate=LR)  # 10 steps
    frame = train_sft(model, tok, examples, sft, OPT, seed=0, progress=False)
    assert len(built) == 1 and len(frame) == 10
    assert _settings(built[0]) == {"class": SpyAdamW, "lr": LR, "betas": (0.8, 0.95),
                                   "eps": 3e-7, "weight_decay": 0.05}  # fmt: skip
    assert clip_norms == [0.7] * 10
    assert (frame["lr"] == LR).all(), frame["lr"].tolist()  # constant: no warm-up, no decay


def test_the_approximate_kl_stop_is_for_every_rl_algorithm_or_none():
    assert small_cfg(algorithm=["ppo", "d2lols"], approx_kl_stop=0.1).approx_kl_stop == 0.1
    with pytest.raises(ValueError, match="approx_kl_stop .* GRPO"):
        small_cfg(algorithm=["ppo", "grpo"], approx_kl_stop=0.1)
