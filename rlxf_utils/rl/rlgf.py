"""RL with guided feedback (RLGF; Chang et al., 2023, "Learning to Generate Better Than Your LLM").

PPO++, AggreVaTeD, LOLS and D²LOLS on our PPO (`rlxf_utils.rl.ppo`): the learner interacts with a
guide policy pi_g. Each response is split at a switch point h; one policy writes the prefix
(roll-in), the other completes it (roll-out), continuing the prefix token for token
(`rl.ppo.ForcedPrefix`). The per-token KL penalty to the reference, GAE, the clipped losses, the KL
controller, checkpoints and resume are PPO's; what changes per scheme is three things, as in the
authors' TRIL (`rollin_policy`, `rollout_policy`, `value_fn`) plus which tokens the policy
gradient acts on:

    scheme       roll-in  roll-out  critic                  policy gradient on   critic fitted on
    PPO++        guide    policy    policy's V (value_head)  t >= h (policy's)    t >= h
    AggreVaTeD   policy   guide     V_g (guide_value_head)   t <  h (policy's)    t >= h (guide's)

    h per sample: with probability beta, h ~ Uniform{1..L-1} on the roll-in response of length L
    (before its end token; h = 0 when L < 2); else h = 0.
    PPO++ with h = 0 is PPO; AggreVaTeD with h = 0 is a pure guide trajectory (trains V_g only).

    LOLS     per iteration: PPO++ with probability tau, else AggreVaTeD (each with its own critic)
    D²LOLS   AggreVaTeD for the first `switch_fraction` of the steps, then PPO++

The paper's objective adds eta * E_D[log pi(y_ref | x)] on reference texts to every algorithm, PPO
too (its section 6): here one historical MET description of the minibatch's contexts (rows the RL
stage may see: `data.contexts.eligible_rows`), in `PPOTrainer` for every algorithm the registry
marks `mle` (the RLGF algorithms and `ppo_mle`, PPO with the same term).

Draws (the switch points, LOLS's scheme, the reference picked) come from generators seeded by
(seed, step), so a resumed run draws exactly what an uninterrupted one would. Roll-ins are
generated only for the samples drawn to switch (none when beta = 0: PPO++ is then PPO with the
same MLE term, the registry's `ppo_mle`, exactly: tests/test_rlgf.py at the shipped settings).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import nn

from rlxf_utils.config import RLConfig, RLGFConfig
from rlxf_utils.models.loading import apply_lora
from rlxf_utils.models.policies import load_named_policy
from rlxf_utils.rl.core import RewardFn
from rlxf_utils.rl.ppo import PPOTrainer, ppo_loss_settings
from rlxf_utils.rl.rollout import Rollout
from rlxf_utils.rl.sft import met_references
from rlxf_utils.rl.trainer import TrainJob, write_settings
from rlxf_utils.runtime import seed_everything

PPO_PP, AGGREVATED = "ppo_pp", "aggrevated"


def scheme_at(algo: str, step: int, steps: int, rlgf: RLGFConfig, seed: int) -> str:
    """The scheme ('ppo_pp' or 'aggrevated') algorithm `algo` uses at 0-based `step` of `steps`."""
    if algo in (PPO_PP, AGGREVATED):
        return algo
    if algo == "lols":  # a coin per iteration, reproducible from (seed, step)
        coin = np.random.default_rng([seed, step, 1]).random()
        return PPO_PP if coin < rlgf.tau else AGGREVATED
    if algo == "d2lols":
        return AGGREVATED if step < round(rlgf.switch_fraction * steps) else PPO_PP
    raise ValueError(f"rl.algorithm entry {algo!r} is not an RLGF algorithm")


def beta_for(algo: str, scheme: str, rlgf: RLGFConfig) -> float:
    """Probability that a sample switches policies (LOLS has one beta for both schemes)."""
    if algo == "lols":
        return rlgf.beta_lols
    return rlgf.beta_ppo_pp if scheme == PPO_PP else rlgf.beta_aggrevated


def switch_points(
    lengths: Sequence[int] | np.ndarray,
    flagged: Sequence[bool] | np.ndarray,
    rng: np.random.Generator,
) -> np.ndarray:
    """h per sample: Uniform{1..L-1} where flagged and L >= 2, else 0 (the paper's roll-in draw)."""
    out = np.zeros(len(lengths), dtype=np.int64)
    for i, (n, f) in enumerate(zip(lengths, flagged, strict=True)):
        if f and n >= 2:
            out[i] = rng.integers(1, n)  # 1..n-1
    return out


def ownership_masks(h: torch.Tensor, width: int, scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(learner mask, critic mask), each (B, width): which tokens get the policy gradient and
    which the scheme's critic regresses on. PPO++: both t >= h. AggreVaTeD: t < h and t >= h."""
    t = torch.arange(width, device=h.device).unsqueeze(0)
    after = (t >= h.unsqueeze(1)).long()
    if scheme == PPO_PP:
        return after, after
    if scheme == AGGREVATED:
        return 1 - after, after
    raise ValueError(f"scheme {scheme!r}: expected {PPO_PP!r} or {AGGREVATED!r}")


class GuidedPPOTrainer(PPOTrainer):
    """PPO with a guide: overrides only the rollout (roll-in, roll-out, masks, critic);
    everything else, the MLE term (`rlgf.mle_coef`) included, is `PPOTrainer`'s.

    `guide` is a frozen causal LM on the same tokenizer (here `sft_met`, merged); `references[i]`
    holds token ids (ending in the end token) of historical MET descriptions of `contexts[i]`
    (may be empty). Writes `guide_value_head.safetensors` beside PPO's outputs.
    """

    extra_heads = ("guide_value_head",)

    def __init__(
        self,
        algo: str,
        model: nn.Module,
        guide: nn.Module,
        tokenizer: Any,
        prompts: Sequence[str],
        contexts: Sequence[Mapping[str, Any]],
        reward_fn: RewardFn,
        cfg: RLConfig,
        rlgf: RLGFConfig,
        output_dir: Any,
        references: Sequence[Sequence[Sequence[int]]] | None = None,
        **kw: Any,
    ):
        scheme_at(algo, 0, 1, rlgf, 0)  # validates the id
        self.algo, self.rlgf = algo, rlgf
        super().__init__(model, tokenizer, prompts, contexts, reward_fn, cfg, output_dir,
                         references=references, mle_coef=rlgf.mle_coef, **kw)  # fmt: skip
        self.guide = guide.to(self.device).eval()
        for p in self.guide.parameters():
            p.requires_grad_(False)

    def scheme(self, step: int | None = None) -> str:
        step = self.step if step is None else step
        return scheme_at(self.algo, step, self.total_steps, self.rlgf, self.seed)

    # -- rollout: roll-in by one policy, roll-out by the other -----------------------------------
    @torch.no_grad()
    def rollout(self, idx: Sequence[int]) -> Rollout:
        cfg, rg = self.cfg, self.rlgf
        scheme = self.scheme()
        beta = beta_for(self.algo, scheme, rg)
        # which responses are guided: one draw per (seed, step), and per process when several
        # share the batch (each process's own responses)
        rng = np.random.default_rng(
            [self.seed, self.step, 0, *([self.rank] if self.world > 1 else [])]
        )
        flagged = rng.random(len(idx)) < beta
        policy = self.unwrapped.policy
        policy.eval()
        enc = self.encode(idx)
        settings = {  # each policy samples with its own settings
            "policy": (policy, cfg.temperature, cfg.top_p),
            "guide": (self.guide, rg.guide_temperature, rg.guide_top_p),
        }
        rollin, rollout = ("guide", "policy") if scheme == PPO_PP else ("policy", "guide")
        t0 = time.perf_counter()
        h = np.zeros(len(idx), dtype=np.int64)
        prefix = None
        sub = np.flatnonzero(flagged)
        if sub.size:  # roll-ins only for the samples drawn to switch
            sub_t = torch.as_tensor(sub, device=self.device)
            sub_enc = self._subset(enc, sub_t)
            ids, ids_mask = self.sample(
                settings[rollin][0], sub_enc, *settings[rollin][1:], rows=sub.tolist(), stream=1
            )
            # L = tokens before the end token (the whole response when it hit the cap)
            is_end = (
                torch.isin(ids, torch.tensor(self.stop_ids, device=ids.device)) & ids_mask.bool()
            )
            lengths = (ids_mask.sum(1) - is_end.long().sum(1)).cpu().numpy()
            h[sub] = switch_points(lengths, np.ones(sub.size, bool), rng)
            pref = torch.full(
                (len(idx), ids.shape[1]), self.tokenizer.pad_token_id, dtype=torch.long,
                device=self.device,
            )  # fmt: skip
            pref[sub_t] = ids
            prefix = (pref, torch.as_tensor(h, device=self.device))
        response, response_mask = self.sample(
            settings[rollout][0], enc, *settings[rollout][1:], prefix=prefix
        )
        gen_time = time.perf_counter() - t0
        learner, critic_mask = ownership_masks(
            torch.as_tensor(h, device=self.device), response.shape[1], scheme
        )
        return self.finish_rollout(
            idx, enc, response, response_mask, gen_time,
            learner_mask=learner, value_mask=critic_mask,
            critic="value_head" if scheme == PPO_PP else "guide_value_head", scheme=scheme,
        )  # fmt: skip

    @staticmethod
    def _subset(enc: Mapping[str, torch.Tensor], rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """Rows of a left-padded batch, with the padding columns all of them share removed."""
        ids, attn = enc["input_ids"][rows], enc["attention_mask"][rows]
        keep = int(attn.sum(1).max())
        return {"input_ids": ids[:, -keep:], "attention_mask": attn[:, -keep:]}


def run_rlgf(job: TrainJob) -> pd.DataFrame:
    """One RLGF algorithm with LoRA on the start policy and the guide `rlgf.guide`; resumes."""
    cfg, run_dir = job.require_study()
    algo, rg = job.algo, cfg.rlgf
    guide, _ = load_named_policy(cfg, run_dir, rg.guide)
    if hasattr(guide, "merge_and_unload"):
        guide = guide.merge_and_unload()  # a plain model: faster sampling, no adapter toggling
    references = met_references(cfg, run_dir, job.contexts, job.tokenizer, job.model)
    seed_everything(job.seed)  # LoRA's random init: the same whatever ran before
    model = apply_lora(job.model, job.policy.lora)
    trainer = GuidedPPOTrainer(
        algo, model, guide, job.tokenizer, job.prompts, job.contexts, job.reward_fn, job.rl, rg,
        job.output_dir, references=references, seed=job.seed, autocast_dtype=job.policy.autocast,
        sampler=job.policy.sampler,
    )  # fmt: skip
    n = job.n_steps
    schemes = [scheme_at(algo, s, n, rg, job.seed) for s in range(n)]
    write_settings(job.output_dir, algo, job.rl, {
        **ppo_loss_settings(job.rl, "GAE with the scheme's critic (PPO++: the policy's; "
                            "AggreVaTeD: the guide's), whitened over the learner's tokens"),
        "guide": rg.guide, "guide_top_p": rg.guide_top_p,
        "beta_switch": {s: beta_for(algo, s, rg) for s in sorted(set(schemes))},
        # Algorithm 2's beta (the guide's state-distribution weight): the same algorithm
        "beta_paper_aggrevated": 1.0 - beta_for(algo, AGGREVATED, rg) if AGGREVATED in schemes else None,
        "tau": rg.tau if algo == "lols" else None,
        "switch_fraction": rg.switch_fraction if algo == "d2lols" else None,
        "steps_ppo_pp": schemes.count(PPO_PP), "steps_aggrevated": schemes.count(AGGREVATED),
        "mle_coef": rg.mle_coef,
        "contexts_with_met_references": sum(bool(r) for r in references),
    })  # fmt: skip
    return trainer.train(steps=job.steps, progress=job.progress)
