"""PPO for causal language models, classic RLHF form (Ziegler et al. 2019; Stiennon et al. 2020).

One readable file in the CleanRL spirit: every implementation detail is named and commented once.

    prompts   a schedule shared with GRPO/RLOO (`prompt_schedule`): the same prompts at every step
    rollout   sample `num_generations` responses per prompt (temperature, top-p, max new tokens; left
              padding, KV cache; the same end tokens as evaluation, `models.generation.eos_ids`)
    score     reward model on (context, post-processed response) -> one scalar per response
    forward   one no-grad pass of the policy gives log-probs, entropy and values (value head on the
              policy's last hidden states); one pass with the LoRA adapters disabled gives the
              reference log-probs (the frozen starting policy, no second copy of the weights)
    reward    per-token  r_t = -beta * (log pi(a_t) - log pi_ref(a_t)),  plus the score on the last token
    critic    V(s_t) = the frozen reward model's score of the prefix y_<t in its context
              (`critic_init: reward`; a fixed prior, never trained) + a zero-initialised linear
              head on the policy's last hidden states (detached: the critic does not move the
              policy). Not Stiennon et al.'s critic, a trained copy of the reward model: the prior
              here cannot be unlearned, and RLGF's two critics share it and differ by their heads
              only. `critic_init: mean`: the head alone, its bias at the first batch's mean score;
              optional critic-only warm-up steps
    GAE       advantages and returns (gamma, lambda), advantages whitened over the batch
    update    several epochs of shuffled minibatches: clipped surrogate + clipped value loss,
              gradient clipping, early stop when the approximate KL to the rollout policy is too big
    beta      adaptive KL controller (`core.AdaptiveKLController`: log space, on a smoothed KL, at
              most rl.kl_step_ratio a step) or a fixed coefficient

Device placement goes through `accelerate`, so the same code runs on CPU, one GPU or several GPUs
(`accelerate launch`). Checkpoints hold everything needed for an exact resume on CPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import nn

from rlxf_utils.artifacts import atomic_path
from rlxf_utils.config import CRITIC_INIT, RLConfig
from rlxf_utils.models.generation import (
    autocast,
    encode_prompts,
    eos_ids,
    postprocess_response,
)
from rlxf_utils.models.loading import apply_lora
from rlxf_utils.prompts import CONTEXT_FIELDS
from rlxf_utils.rl.accelerated import AcceleratedTrainer
from rlxf_utils.rl.core import (
    KL_ESTIMATORS,
    PolicyWithValue,
    RewardFn,
    adapter_state,
    compute_gae,
    cpu_state,
    entropy_from_logits,
    explained_variance,
    k3_tokens,
    kl_controller,
    logprobs_from_logits,
    masked_mean,
    policy_loss,
    prompt_schedule,
    value_loss,
    whiten,
)
from rlxf_utils.rl.mle import context_prompt, mle_loss, mle_settings
from rlxf_utils.rl.optim import adamw
from rlxf_utils.rl.rollout import Prepared, Rollout, sample_rollout
from rlxf_utils.rl.trainer import TrainJob, write_settings
from rlxf_utils.runtime import seed_everything

log = logging.getLogger(__name__)


class PPOTrainer(AcceleratedTrainer):
    """PPO fine-tuning of a LoRA-wrapped causal LM against `reward_fn`; writes to `output_dir`.

    `prompts[i]` is the formatted policy input for `contexts[i]`. Layout of `output_dir`:
    `adapter/` (final LoRA, safetensors), `value_head.safetensors`, `train_log.parquet`,
    `samples.jsonl`, `checkpoints/step_XXXXXX/` (the last two kept) and
    `snapshots/step_XXXXXX/adapter_model.safetensors` (every checkpoint's adapter, for the frontier).
    """

    #: critics besides the policy's own `value_head` (subclasses: rlgf.GuidedPPOTrainer)
    extra_heads: tuple[str, ...] = ()
    algo: str = "ppo"

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        prompts: Sequence[str],
        contexts: Sequence[Mapping[str, Any]],
        reward_fn: RewardFn,
        cfg: RLConfig,
        output_dir: str | Path,
        seed: int = 0,
        accelerator: Any = None,
        n_samples: int = 4,
        generation_kwargs: Mapping[str, Any] | None = None,
        autocast_dtype: str | None = None,
        references: Sequence[Sequence[Sequence[int]]] | None = None,
        mle_coef: float = 0.0,
        sampler: str = "compact",
    ):
        if len(prompts) != len(contexts) or not prompts:
            raise ValueError(
                f"need one prompt per context, got {len(prompts)} prompts, {len(contexts)} contexts"
            )
        if not hasattr(model, "disable_adapter"):
            raise TypeError(
                "model must be a peft model (models.apply_lora): the reference is the base"
            )
        super().__init__(output_dir, cfg.checkpoint_every, cfg.steps, accelerator)
        self.cfg, self.tokenizer, self.reward_fn = cfg, tokenizer, reward_fn
        self.prompts, self.contexts = list(prompts), [dict(c) for c in contexts]
        self.seed, self.n_samples = seed, n_samples
        self.generation_kwargs = dict(generation_kwargs or {})  # extra generate() args (benchmarks)
        self.autocast_dtype = autocast_dtype  # 'bfloat16': matmuls in bf16 (rollout and update)
        self.sampler = sampler  # `policy.sampler`: 'compact' or 'transformers' (see `sample`)
        # the RLGF paper's MLE term: eta x NLL of a historical MET description per context
        self.mle_coef = float(mle_coef)
        self.references = [list(map(list, r)) for r in (references or [[] for _ in prompts])]
        if len(self.references) != len(self.prompts):
            raise ValueError(
                f"references: {len(self.references)} lists for {len(self.prompts)} prompts"
            )
        self._prompt_ids: dict[int, list[int]] = {}
        if cfg.batch_size % self.world or cfg.minibatch_size % self.world:
            raise ValueError(
                f"rl.batch_size ({cfg.batch_size}) and rl.minibatch_size ({cfg.minibatch_size}) "
                f"must be divisible by the number of processes ({self.world})"
            )
        rank_seed = seed + self.rank  # each process draws its own samples
        seed_everything(rank_seed)
        self.stop_ids = sorted(eos_ids(model, tokenizer))  # the end tokens evaluation uses
        if cfg.gradient_checkpointing:  # recompute activations in the update: memory for time
            model.activation_checkpointing_enable(  # transformers 5's name for it
                activation_checkpointing_kwargs={"use_reentrant": False}
            )
        self.gen = PolicyWithValue(model, self.extra_heads)
        policy_params = [p for p in self.gen.policy.parameters() if p.requires_grad]
        self._policy_params = policy_params
        self._value_params = [
            p for name in self.gen.head_names for p in getattr(self.gen, name).parameters()
        ]
        self.optimizer = adamw(  # the study's one optimiser (`rl.optimizer`), TRL's too
            [
                {"params": policy_params, "lr": cfg.learning_rate},
                {"params": self._value_params, "lr": cfg.value_learning_rate or cfg.learning_rate},
            ],
            cfg.optimizer,
            cfg.learning_rate,
        )
        self.module, self.optimizer = self.accelerator.prepare(self.gen, self.optimizer)
        self.kl_ctl = kl_controller(cfg)
        self.value_initialised: set[str] = set()  # critics whose bias is set (first batch's mean)
        self.schedule: list[list[int]] | None = None  # set by train(): prompts per step

    # -- helpers -------------------------------------------------------------------------------
    @property
    def unwrapped(self) -> PolicyWithValue:
        return self.accelerator.unwrap_model(self.module)

    def _autocast(self) -> Any:
        return autocast(self.autocast_dtype, self.device)

    def _next_batch(self) -> list[int]:
        """Prompt indices for this step (`prompt_schedule`), each repeated `num_generations` times;
        with several processes, this process's contiguous share of that global batch."""
        cfg = self.cfg
        if self.schedule is None or self.step >= len(self.schedule):
            self.schedule = prompt_schedule(
                len(self.prompts), max(cfg.steps, self.step + 1), cfg.prompts_per_step, self.seed
            )
        idx = [i for i in self.schedule[self.step] for _ in range(cfg.num_generations)]
        share = len(idx) // self.world
        return idx[self.rank * share : (self.rank + 1) * share]

    # -- phase 1: rollout ----------------------------------------------------------------------
    @torch.no_grad()
    def sample(
        self,
        model: nn.Module,
        enc: Mapping[str, torch.Tensor],
        temperature: float,
        top_p: float,
        prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
        rows: Sequence[int] | None = None,
        stream: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample a response per prompt of `enc` from `model`; returns (response ids padded after
        the first end token, response mask up to and including it).

        `prefix` = (ids (B, H), lengths (B,)): the first `lengths[i]` tokens of response i are
        forced to `ids[i]` (RLGF's roll-in, continued exactly by the roll-out policy).

        With `sampler: compact` (and no `generation_kwargs`), `models.decode.sample_compact`
        samples from the LoRA merged into a copy of the weights, dropping finished rows; row i
        draws from the stream of (seed, process, step, `stream`; `rows[i]`, default i), so a
        resumed run samples what the uninterrupted one did. The update's old log-probs are
        recomputed by `prepare` on the unmerged policy: the ratio is to the policy that sampled,
        up to rounding. Otherwise transformers' `generate` (benchmarks pass its arguments).
        """
        seed = np.random.SeedSequence([self.seed, self.rank, self.step, stream])
        return sample_rollout(
            model, enc, compact=self.sampler == "compact" and not self.generation_kwargs,
            max_new_tokens=self.cfg.max_new_tokens, temperature=temperature, top_p=top_p,
            stop_ids=self.stop_ids, pad_id=self.tokenizer.pad_token_id,
            seed=int(seed.generate_state(1)[0]), rows=rows, prefix=prefix,
            autocast=self._autocast, generation_kwargs=self.generation_kwargs,
        )  # fmt: skip

    def encode(self, idx: Sequence[int]) -> dict[str, torch.Tensor]:
        """Left-padded prompt ids of contexts `idx` on the trainer's device."""
        enc = encode_prompts(
            self.tokenizer, [self.prompts[i] for i in idx], return_tensors="pt", padding=True
        )
        return {k: v.to(self.device) for k, v in enc.items()}

    def _reward(self, idx: Sequence[int], texts: list[str], what: str) -> np.ndarray:
        """`reward_fn` on (contexts[idx[k]], texts[k]), checked: one finite float per text."""
        scores = np.asarray(
            self.reward_fn([self.contexts[i] for i in idx], texts), dtype=np.float32
        )
        if scores.shape != (len(texts),) or not np.isfinite(scores).all():
            raise ValueError(
                f"reward_fn returned shape {scores.shape} / non-finite values for {what}; "
                f"expected {len(texts)} finite floats"
            )
        return scores

    def score(self, idx: Sequence[int], response: torch.Tensor) -> tuple[list[str], torch.Tensor]:
        """Post-processed texts of `response` and their reward-model scores."""
        texts = self.tokenizer.batch_decode(response, skip_special_tokens=True)
        cleaned = [postprocess_response(t, self.cfg.response_postprocess) for t in texts]
        scores = self._reward(idx, cleaned, "the responses")
        return cleaned, torch.as_tensor(scores, device=self.device)

    @torch.no_grad()
    def rollout(self, idx: Sequence[int]) -> Rollout:
        """Sample one response per entry of `idx` and score it with the reward function."""
        enc = self.encode(idx)
        policy = self.unwrapped.policy
        policy.eval()  # no dropout while sampling and scoring
        t0 = time.perf_counter()
        response, response_mask = self.sample(policy, enc, self.cfg.temperature, self.cfg.top_p)
        gen_time = time.perf_counter() - t0
        return self.finish_rollout(idx, enc, response, response_mask, gen_time)

    def finish_rollout(
        self,
        idx: Sequence[int],
        enc: Mapping[str, torch.Tensor],
        response: torch.Tensor,
        response_mask: torch.Tensor,
        gen_time: float,
        **guided: Any,
    ) -> Rollout:
        """Score the responses and pack prompt + response into a `Rollout` (`guided`: RLGF's
        masks, critic and scheme)."""
        texts, scores = self.score(idx, response)
        prior = (
            self.prefix_scores(idx, response, response_mask)
            if self.cfg.critic_init == "reward"
            else None
        )
        return Rollout(
            context_idx=list(idx),
            input_ids=torch.cat([enc["input_ids"], response], 1),
            attention_mask=torch.cat([enc["attention_mask"], response_mask], 1),
            response_ids=response,
            response_mask=response_mask,
            texts=texts,
            scores=scores,
            gen_time=gen_time,
            value_prior=prior,
            **guided,
        )

    def prefix_scores(
        self, idx: Sequence[int], response: torch.Tensor, response_mask: torch.Tensor
    ) -> torch.Tensor:
        """The reward model's score of every prefix y_<t of every response in its context (B, R),
        0 past the response: the critic's prior. Each distinct (context, prefix) text is scored
        once, in one call of `reward_fn`."""
        B, R = response.shape
        lengths = response_mask.sum(1).tolist()
        ids = response.tolist()
        owners = [(i, t) for i in range(B) for t in range(int(lengths[i]))]
        decoded = self.tokenizer.batch_decode(
            [ids[i][:t] for i, t in owners], skip_special_tokens=True
        )
        unique: dict[tuple[int, str], int] = {}
        where = []
        for (i, _t), text in zip(owners, decoded, strict=True):
            key = (idx[i], postprocess_response(text, self.cfg.response_postprocess))
            where.append(unique.setdefault(key, len(unique)))
        scores = self._reward(
            [c for c, _ in unique], [t for _, t in unique], "the critic's prefixes"
        )
        prior = torch.zeros(B, R)
        if owners:
            rows, cols = zip(*owners, strict=True)
            prior[list(rows), list(cols)] = torch.as_tensor(scores[where])
        return prior.to(self.device)

    # -- phase 2: advantages ------------------------------------------------------------------
    @torch.no_grad()
    def prepare(self, ro: Rollout) -> Prepared:
        """Old log-probs, values and entropy from one no-grad policy pass, the reference's
        log-probs with adapters off, per-token rewards and GAE with the rollout's critic."""
        cfg = self.cfg
        mask = ro.response_mask.float()
        pg_mask = mask if ro.learner_mask is None else mask * ro.learner_mask.float()
        vf_mask = mask if ro.value_mask is None else mask * ro.value_mask.float()
        R = ro.response_ids.shape[1]
        T = cfg.temperature  # log-probs of the sampling distribution: logits / temperature

        # Critic on the reward's scale from the first step: the reward model's score of each
        # prefix (its prior), or, without one, a bias at the first batch's mean score.
        prior = torch.zeros_like(mask) if ro.value_prior is None else ro.value_prior * mask
        if ro.critic not in self.value_initialised:
            if ro.value_prior is None:
                head = getattr(self.unwrapped, ro.critic)
                head.summary.bias.fill_(self._global_mean(ro.scores))
            self.value_initialised.add(ro.critic)

        with self._autocast():
            logits, old_values = self.unwrapped(
                ro.input_ids, ro.attention_mask, R, critic=ro.critic
            )
            old_values = old_values.float() + prior
            old_logprobs = logprobs_from_logits(logits / T, ro.response_ids)
            entropy = masked_mean(entropy_from_logits(logits / T), mask)
            del logits
            with self.unwrapped.policy.disable_adapter():
                ref_logits, _ = self.unwrapped(
                    ro.input_ids, ro.attention_mask, R, with_values=False
                )
            ref_logprobs = logprobs_from_logits(ref_logits / T, ro.response_ids)
            del ref_logits

        # Per-token reward: KL penalty on every token, the reward-model score on the last one.
        kl_tokens = (old_logprobs - ref_logprobs) * mask
        rewards = -self.kl_ctl.value * kl_tokens
        last = (mask.sum(1).long() - 1).clamp(min=0)
        rewards[torch.arange(len(last)), last] += ro.scores
        advantages, returns = compute_gae(rewards, old_values * mask, mask, cfg.gamma, cfg.lam)
        # over the tokens the gradient acts on, in every process's share of the batch
        if cfg.whiten_advantages and self._sum(pg_mask.sum()) > 1:
            advantages = whiten(advantages, pg_mask, reduce=self._sum)
        return Prepared(
            mask=mask, pg_mask=pg_mask, vf_mask=vf_mask, old_logprobs=old_logprobs,
            old_values=old_values, advantages=advantages * pg_mask, returns=returns,
            kl_tokens=kl_tokens, entropy=entropy, value_prior=prior,
        )  # fmt: skip

    # -- the paper's MLE term on historical MET descriptions (`rl.mle`) ------------------------
    def extra_loss(self, ro: Rollout, mb: torch.Tensor) -> torch.Tensor | None:
        """A loss added to each minibatch's: the MLE term (`rl.mle.mle_loss`; None without it)."""
        return mle_loss(self, ro, mb)

    def _prompt(self, c: int) -> list[int]:
        return context_prompt(self, c)

    # -- phase 3: the update --------------------------------------------------------------------
    def update(self, ro: Rollout, pp: Prepared) -> dict[str, list[float]]:
        """Several epochs of shuffled minibatches: clipped surrogate on `pg_mask`, value loss on
        `vf_mask` (critic only while warming up), early stop on the approximate KL."""
        cfg = self.cfg
        R = ro.response_ids.shape[1]
        T = cfg.temperature
        warmup = self.step < cfg.value_warmup_steps
        self.module.train()
        B = ro.input_ids.shape[0]  # this process's share of the batch
        size = cfg.minibatch_size // self.world  # its share of each minibatch
        stats: dict[str, list[float]] = {k: [] for k in ("pg", "vf", "clip", "akl", "vclip")}
        stop = False
        for _epoch in range(cfg.update_epochs):
            perm = torch.randperm(B)
            for start in range(0, B, size):
                mb = perm[start : start + size].to(self.device)
                self.optimizer.zero_grad(set_to_none=True)
                # A loss of its own (RLGF's MLE term) runs its forward and backward first: under
                # DDP each backward averages over processes, and two forwards of the wrapped
                # module before one backward are not allowed. Gradients add up in .grad.
                extra = None if warmup else self.extra_loss(ro, mb)
                if extra is not None:
                    self.accelerator.backward(extra)
                with self._autocast():
                    new_logits, new_values = self.module(
                        ro.input_ids[mb], ro.attention_mask[mb], R, critic=ro.critic
                    )
                new_logprobs = logprobs_from_logits(new_logits / T, ro.response_ids[mb])
                new_values = new_values.float() + pp.value_prior[mb]
                pg, clip_frac, approx_kl = policy_loss(
                    new_logprobs, pp.old_logprobs[mb], pp.advantages[mb], pp.pg_mask[mb],
                    cfg.clip_range,
                )  # fmt: skip
                vf, vclip = value_loss(
                    new_values, pp.old_values[mb], pp.returns[mb], pp.vf_mask[mb],
                    cfg.clip_range_value,
                )  # fmt: skip
                loss = cfg.vf_coef * vf if warmup else pg + cfg.vf_coef * vf
                self.accelerator.backward(loss)
                # clipped apart: the critic's gradient never shrinks the policy's step
                self.accelerator.clip_grad_norm_(self._policy_params, cfg.optimizer.max_grad_norm)
                self.accelerator.clip_grad_norm_(self._value_params, cfg.optimizer.max_grad_norm)
                self.optimizer.step()
                for k, v in zip(  # detached scalars for the log
                    ("pg", "vf", "clip", "akl", "vclip"),
                    (pg, vf, clip_frac, approx_kl, vclip),
                    strict=True,
                ):
                    stats[k].append(v.item())
                # Early stop: the policy moved too far from the one that sampled the batch
                # (the mean over processes: every process stops after the same minibatch)
                if (
                    not warmup
                    and cfg.approx_kl_stop is not None
                    and self._global_mean(approx_kl) > cfg.approx_kl_stop
                ):
                    stop = True
                    break
            if stop:
                break
        self.module.eval()
        return stats

    def train_step(self) -> dict[str, Any]:
        """Rollout, score, compute advantages and run the PPO epochs; returns the step's log row."""
        t_start = time.perf_counter()
        ro = self.rollout(self._next_batch())
        pp = self.prepare(ro)
        stats = self.update(ro, pp)

        # KL to the reference on the learner's own tokens (k1: summed log-ratio; every token in
        # PPO, RLGF's guide-written ones left out), averaged over the global batch's responses;
        # it drives the controller (the same value on every process, so beta stays in step).
        B = ro.input_ids.shape[0] * self.world
        mask = pp.mask
        kl_seq = self._global_mean((pp.kl_tokens * pp.pg_mask).sum(1))
        kl_k3 = self._global_mean((k3_tokens(pp.kl_tokens) * pp.pg_mask).sum(1))
        kl_all = self._global_mean(pp.kl_tokens.sum(1))
        self.kl_ctl.update(kl_seq, B)
        n_tokens = float(self._sum(mask.sum()))
        step_time = time.perf_counter() - t_start
        scores = ro.scores.float()
        every = self.accelerator.gather(scores) if self.world > 1 else scores
        # responses the learner wrote every token of (all of them in PPO)
        own = ((pp.pg_mask == mask).all(1)).float()
        own_all = self.accelerator.gather(own) if self.world > 1 else own
        row = {
            "algo": self.algo,
            "step": self.step + 1,
            "reward_mean": float(every.mean()),
            "reward_learner": float((every * own_all).sum() / own_all.sum())
            if own_all.sum() > 0
            else float("nan"),
            "reward_std": float(every.std()) if B > 1 else 0.0,
            "kl": kl_seq,
            "kl_k3": kl_k3,
            "kl_all_tokens": kl_all,
            "kl_estimator": KL_ESTIMATORS["ppo"],
            "kl_per_token": float(self._sum(pp.kl_tokens.sum())) / max(n_tokens, 1.0),
            "kl_coef": self.kl_ctl.value,
            "entropy": self._global_mean(pp.entropy),
            "value_mean": float(masked_mean(pp.old_values, pp.vf_mask, reduce=self._sum)),
            "clip_frac": float(np.mean(stats["clip"])),
            "approx_kl": float(np.mean(stats["akl"])),
            "policy_loss": float(np.mean(stats["pg"])),
            "value_loss": float(np.mean(stats["vf"])),
            "explained_variance": explained_variance(
                pp.old_values, pp.returns, pp.vf_mask, reduce=self._sum
            ),
            # the prior alone (NaN without one): what the learned head adds is the difference
            "explained_variance_prior": explained_variance(
                pp.value_prior, pp.returns, pp.vf_mask, reduce=self._sum
            )
            if ro.value_prior is not None
            else float("nan"),
            "response_length": n_tokens / B,
            "scheme": ro.scheme,
            "learner_share": float(self._sum(pp.pg_mask.sum())) / max(n_tokens, 1.0),
            "tokens_per_s": n_tokens / max(ro.gen_time, 1e-9),
            "gen_time_s": ro.gen_time,
            "step_time_s": step_time,
            "processes": self.world,
            "rank_weight_spread": self._rank_weight_spread(),
        }
        self.step += 1
        self.history.append(row)
        if self.step == 1 or self.step % self.cfg.sample_every == 0:
            for i, text, s in list(zip(ro.context_idx, ro.texts, scores.tolist(), strict=True))[
                : self.n_samples
            ]:
                self.samples.append(
                    {
                        "step": self.step,
                        **{k: self.contexts[i].get(k) for k in CONTEXT_FIELDS},
                        "response": text,
                        "reward": s,
                    }
                )
        return row

    # -- what the base Trainer saves and restores ----------------------------------------------
    def describe(self, row: Mapping[str, Any]) -> tuple[str, dict[str, str]]:
        line = (
            f"{self.algo} step {self.step}: reward {row['reward_mean']:.4f} kl {row['kl']:.3f} "
            f"beta {row['kl_coef']:.4f} entropy {row['entropy']:.3f} {row['step_time_s']:.1f}s"
        )
        return line, {"reward": f"{row['reward_mean']:.3f}", "kl": f"{row['kl']:.2f}"}

    def save_model(self, folder: Path) -> None:
        self.unwrapped.policy.save_pretrained(folder)

    def save_extra_outputs(self) -> None:
        """The value heads (`value_head.safetensors`, and RLGF's guide critic)."""
        from safetensors.torch import save_file

        for name in self.unwrapped.head_names:
            with atomic_path(self.output_dir / f"{name}.safetensors") as tmp:
                save_file(cpu_state(getattr(self.unwrapped, name)), str(tmp))

    def checkpoint_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        heads = {n: cpu_state(getattr(self.unwrapped, n)) for n in self.unwrapped.head_names}
        return {"adapter_model": adapter_state(self.unwrapped.policy), **heads}

    def checkpoint_state(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer.state_dict(),
            "kl_ctl": self.kl_ctl.state_dict(),
            "value_initialised": sorted(self.value_initialised),
        }

    def restore(self, path: Path, state: Mapping[str, Any]) -> None:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        set_peft_model_state_dict(
            self.unwrapped.policy, load_file(str(path / "adapter_model.safetensors"))
        )
        for name in self.unwrapped.head_names:
            getattr(self.unwrapped, name).load_state_dict(
                load_file(str(path / f"{name}.safetensors"))
            )
        self.optimizer.load_state_dict(state["optimizer"])
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        init = state.get("value_initialised", True)
        self.value_initialised = (
            set(init) if isinstance(init, (list, tuple, set)) else {"value_head"} if init else set()
        )


def ppo_loss_settings(rl: RLConfig, advantage: str) -> dict[str, Any]:
    """The loss settings PPO and the RLGF algorithms built on it share, for `settings.json`."""
    return {
        "kl_penalty": "per-token log-ratio to the reference in the reward (beta adaptive)"
        if rl.adaptive_kl else "per-token log-ratio to the reference in the reward (fixed beta)",
        "advantage": advantage,
        "clip_range": rl.clip_range, "clip_range_value": rl.clip_range_value,
        "vf_coef": rl.vf_coef, "approx_kl_stop": rl.approx_kl_stop,
        "critic_init": CRITIC_INIT[rl.critic_init],
    }  # fmt: skip


def run_ppo(job: TrainJob) -> pd.DataFrame:
    """PPO with LoRA on the start policy (`ppo_mle`: with the MLE term); resumes from
    `output_dir/checkpoints`."""
    mle = mle_settings(job, job.model)
    model = apply_lora(job.model, job.policy.lora)
    trainer = PPOTrainer(
        model, job.tokenizer, job.prompts, job.contexts, job.reward_fn, job.rl, job.output_dir,
        seed=job.seed, generation_kwargs=job.generation_kwargs, autocast_dtype=job.policy.autocast,
        sampler=job.policy.sampler, **mle,
    )  # fmt: skip
    trainer.algo = job.algo  # its log rows and messages name it (ppo or ppo_mle)
    refs = mle["references"]
    write_settings(job.output_dir, job.algo, job.rl, {
        **ppo_loss_settings(job.rl, "GAE over tokens with a learned critic, whitened over the batch"),
        "mle_coef": mle["mle_coef"],
        "contexts_with_met_references": None if refs is None else sum(bool(r) for r in refs),
    })  # fmt: skip
    return trainer.train(steps=job.steps, progress=job.progress)
