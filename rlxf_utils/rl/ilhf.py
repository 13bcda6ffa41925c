"""Inclusive learning from feedback (ILHF; Xu, Dong, Arumugam, Van Roy, 2023, "Shattering the
Agent-Environment Interface for Fine-Tuning Inclusive Language Models").

The language model is its own reward, R_phi(x, y) = log pi_phi(y | x) summed over the response's
tokens. For two responses A, B to one prompt and P = P(A preferred),

    Q_phi = softmax[log pi_phi(A|x), log pi_phi(B|x)],     L = E_x KL([P, 1-P] || Q_phi),

whose fixed point pi(A) / pi(B) = P / (1 - P) reproduces the population's preferences (inclusive)
where REINFORCE with a KL penalty collapses onto the majority response (`didactic` reproduces
their one-token example). It is DPO at beta = 1 without a reference term.

Ensemble (their Algorithm 2): M LoRA particles on the start policy, each initialised with its
B matrices ~ N(0, prior_scale^2) (a perturbation of the start policy's weights); a particle drawn
uniformly per prompt answers it (Thompson sampling); every particle trains on every episode with
double-or-nothing bootstrap weights (w in {0, 2}) and a pull towards its own initial weights: the
paper's eta ||phi - phi_0||^2 per minibatch (`ilhf.prior_scaling: paper`) or, by default, its MAP
reading eta / N ||phi - phi_0||^2 with N the pairs of one epoch's data in both variants (`map`).
One particle is plain ILHF: unperturbed, unweighted.

What the paper's setting does not carry over (the report's ILHF section says it): history mode's
labels are deterministic (P = 1 for MET over Non-MET), so its loss has no finite optimum (the margin
grows until the prior and the step count stop it); its P = 1/2 pairs of two different conditions
of one context push their summed log-likelihoods together, which favours neither content but
length; and nothing is sampled in history mode, so Thompson sampling has nothing to act on.

Two ways to get pairs on MONA:

- `ilhf_history` (no reward model): pairs of historical descriptions of one context (country,
  arrangement type, descriptor) among the rows the RL stage may see (`data.contexts.eligible_rows`), MET
  preferred over Non-MET, P = 1/2 for pairs with one outcome.
- `ilhf_online` (PPO's prompts, responses, updates and steps): the policy's own responses to one
  prompt paired, labelled by a Bernoulli draw on the reward model, P(A > B) = P_A / (P_A + P_B)
  = sigmoid(s_A - s_B) with s = log P(MET).

The evaluated policy is the ensemble: a particle drawn per prompt samples its responses, and its
log-likelihood is the mixture's, log mean_m pi_m(y | x) (`mixture_logprobs`). Particles are
saved as LoRA adapters `policy/<algo>/adapter/p<m>/` with `adapter/ensemble.json`.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import nn

from rlxf_utils.artifacts import RunDir, atomic_path
from rlxf_utils.config import ILHFConfig, RLConfig
from rlxf_utils.data.contexts import eligible_rows
from rlxf_utils.data.splits import load_holdout, load_splits
from rlxf_utils.models.ensemble import (
    ENSEMBLE_FILE,
    add_particles,
    mixture_logprobs,
    pack_particles,
    particle_names,
    particle_parameters,
    unpack_particles,
)
from rlxf_utils.models.generation import (
    autocast,
    encode_prompts,
    eos_ids,
    postprocess_response,
)
from rlxf_utils.prompts import CONTEXT_FIELDS
from rlxf_utils.rl.core import KL_ESTIMATORS, LOG_COLUMNS, RewardFn, prompt_schedule
from rlxf_utils.rl.experience import take_in_context_order
from rlxf_utils.rl.history_pairs import (
    context_areas,
    context_prompt_ids,
    history_pairs,
    pair_targets,
)
from rlxf_utils.rl.optim import adamw
from rlxf_utils.rl.sft import SFTExample, collate, response_token_nll
from rlxf_utils.rl.trainer import Trainer, TrainJob, write_settings
from rlxf_utils.runtime import seed_everything

log = logging.getLogger(__name__)


#: ILHF's own columns in the training log, beside `rl.core.LOG_COLUMNS`
ILHF_COLUMNS = (
    "ilhf_loss",
    "prior_loss",
    "pref_accuracy",
    "pairs",
    "mixed_pairs",
    "particle_spread",
)


def ilhf_loss(
    logp_a: torch.Tensor,
    logp_b: torch.Tensor,
    p_a: torch.Tensor,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean over pairs of KL([p_a, 1 - p_a] || softmax[logp_a, logp_b]) (0 log 0 = 0), each pair
    weighted by `weights` (the bootstrap's, mean 1) when given."""
    logq = torch.log_softmax(torch.stack([logp_a, logp_b], dim=-1), dim=-1)
    p = torch.stack([p_a, 1.0 - p_a], dim=-1).to(logq.dtype)
    kl = (torch.xlogy(p, p) - p * logq).sum(-1)
    if weights is not None:
        kl = kl * weights.to(kl.dtype)
    return kl.mean()


def pair_probability(reward_a: Any, reward_b: Any) -> np.ndarray:
    """P(A preferred) from reward-model scores P(MET): P_A / (P_A + P_B) = sigmoid(s_A - s_B)
    with s = log P(MET) (Bradley-Terry on the log-scores); 1/2 when both are 0."""
    a, b = np.asarray(reward_a, dtype=float), np.asarray(reward_b, dtype=float)
    total = a + b
    return np.where(total > 0, a / np.where(total > 0, total, 1.0), 0.5)


def double_or_nothing(n: int, rng: np.random.Generator) -> np.ndarray:
    """Bootstrap weights: 0 or 2 with probability 1/2 each (mean 1)."""
    return 2.0 * rng.integers(0, 2, size=n)


def prior_coefficient(ic: ILHFConfig, n_data: int) -> float:
    """The weight of ||phi - phi_0||^2 in each minibatch's mean loss: eta (Algorithm 2, line 13;
    `prior_scaling: paper`) or eta / N with N the pairs of one epoch (`map`)."""
    return ic.prior_reg if ic.prior_scaling == "paper" else ic.prior_reg / max(n_data, 1)


class ILHFTrainer(Trainer):
    """ILHF on an ensemble of LoRA particles (`add_particles`); writes to `output_dir`.

    `update(pairs)` trains every particle on a list of pairs (prompt ids, A ids, B ids, P(A)):
    `epochs` passes in minibatches of `batch_pairs`, with double-or-nothing weights per particle
    and pair, and the pull towards the particle's initial weights. Where the pairs come from is the
    subclass's `train_step`: `ILHFHistoryTrainer` (historical pairs) and `ILHFOnlineTrainer` (the
    policy's own pairs, labelled by the reward model). The loop, checkpoints, resume and frontier
    snapshots are the base `Trainer`'s: a checkpoint's `adapter_model.safetensors` packs every
    particle (`ensemble.pack_particles`), so a snapshot is the whole ensemble at that step, which
    evaluation samples as it samples the final one (`PolicySet.load_snapshot`).
    """

    log_columns = (*LOG_COLUMNS, *ILHF_COLUMNS)

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        ilhf: ILHFConfig,
        rl: RLConfig,
        output_dir: str | Path,
        algo: str,
        seed: int = 0,
        autocast_dtype: str | None = None,
        steps: int | None = None,
    ):
        if not hasattr(model, "peft_config"):
            raise TypeError("model must carry the particles as peft adapters (ilhf.add_particles)")
        super().__init__(output_dir, rl.checkpoint_every, steps or rl.steps)
        self.model, self.tokenizer, self.ilhf, self.rl = model, tokenizer, ilhf, rl
        self.algo, self.seed = algo, seed
        self.autocast_dtype = autocast_dtype
        self.names = [n for n in particle_names(ilhf.particles) if n in model.peft_config]
        if len(self.names) != ilhf.particles:
            raise ValueError(
                f"model has adapters {list(model.peft_config)}; expected {particle_names(ilhf.particles)}"
            )
        self.device = next(model.parameters()).device
        lr = ilhf.learning_rate or rl.learning_rate
        self.params = {n: particle_parameters(model, n) for n in self.names}
        self.anchors = {n: [p.detach().clone() for p in ps] for n, ps in self.params.items()}
        self.optimizers = {n: adamw(ps, rl.optimizer, lr) for n, ps in self.params.items()}
        self.pad = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        )
        self.stop_ids = sorted(eos_ids(model, tokenizer))

    # -- log-likelihoods ---------------------------------------------------------------------
    def _batch(
        self, prompts: Sequence[list[int]], responses: Sequence[list[int]]
    ) -> dict[str, Any]:
        batch = collate(
            [SFTExample(list(p), list(r)) for p, r in zip(prompts, responses, strict=True)],
            self.pad,
        )
        return {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in batch.items()}

    def sequence_logprobs(
        self, prompts: Sequence[list[int]], responses: Sequence[list[int]]
    ) -> torch.Tensor:
        """Summed log pi(response | prompt) under the active adapter (graph kept for backward)."""
        with autocast(self.autocast_dtype, self.device):
            nll, _ = response_token_nll(self.model, self._batch(prompts, responses))
        return -nll.sum(-1)

    def _prior(self, name: str) -> torch.Tensor:
        return sum(
            ((p - a) ** 2).sum() for p, a in zip(self.params[name], self.anchors[name], strict=True)
        )

    # -- the update -------------------------------------------------------------------------
    def update(
        self,
        pairs: Sequence[tuple[list[int], list[int], list[int], float]],
        epochs: float,
        batch_pairs: int,
        n_data: int,
        draw_seed: int,
    ) -> dict[str, float]:
        """Train each particle on `pairs`; `n_data` (the pairs of an epoch) scales the prior under
        `ilhf.prior_scaling: map`. One particle is plain ILHF: no bootstrap weights."""
        ic = self.ilhf
        total = max(1, math.ceil(len(pairs) * epochs / batch_pairs))
        losses, priors, acc, logits = [], [], [], {}
        self.model.train()
        for m, name in enumerate(self.names):
            self.model.set_adapter(name)
            rng = np.random.default_rng([draw_seed, m])
            order: list[int] = []
            for _ in range(total):
                if len(order) < batch_pairs:
                    order += rng.permutation(len(pairs)).tolist()
                mb = [pairs[i] for i in order[:batch_pairs]]
                order = order[batch_pairs:]
                prompts = [p for p, *_ in mb] * 2
                responses = [a for _, a, _, _ in mb] + [b for _, _, b, _ in mb]
                lp = self.sequence_logprobs(prompts, responses)
                lp_a, lp_b = lp[: len(mb)], lp[len(mb) :]
                p_a = torch.tensor([q for *_, q in mb], device=lp.device)
                w = (torch.as_tensor(double_or_nothing(len(mb), rng), device=lp.device)
                     if ic.bootstrap and len(self.names) > 1 else None)  # fmt: skip
                loss = ilhf_loss(lp_a.float(), lp_b.float(), p_a, w)
                prior = self._prior(name)
                total_loss = loss + prior_coefficient(ic, n_data) * prior
                opt = self.optimizers[name]
                opt.zero_grad(set_to_none=True)
                total_loss.backward()
                torch.nn.utils.clip_grad_norm_(self.params[name], self.rl.optimizer.max_grad_norm)
                opt.step()
                losses.append(loss.item())
                priors.append(prior.item())
                decided = p_a != 0.5
                if decided.any():
                    right = ((lp_a > lp_b) == (p_a > 0.5))[decided]
                    acc.extend(right.float().tolist())
                logits[name] = (lp_a - lp_b).detach().float().cpu().numpy()
        self.model.eval()
        spread = (
            float(np.std(np.stack(list(logits.values())), axis=0).mean())
            if len(logits) > 1
            else 0.0
        )
        return {"ilhf_loss": float(np.mean(losses)), "prior_loss": float(np.mean(priors)),
                "pref_accuracy": float(np.mean(acc)) if acc else math.nan,
                "pairs": len(pairs), "mixed_pairs": int(sum(q != 0.5 for *_, q in pairs)),
                "particle_spread": spread}  # fmt: skip

    # -- bookkeeping -------------------------------------------------------------------------
    def _log(
        self, stats: Mapping[str, Any], seconds: float, n_tokens: int | None = None
    ) -> dict[str, Any]:
        row = {c: math.nan for c in self.log_columns}
        row.update({"algo": self.algo, "step": self.step, "scheme": None,
                    "kl_estimator": KL_ESTIMATORS.get(self.algo)})  # fmt: skip
        row.update({k: v for k, v in stats.items() if k in row})
        row["step_time_s"] = seconds
        if n_tokens is not None and seconds > 0:
            row["tokens_per_s"] = n_tokens / seconds
        self.history.append(row)
        return row

    def describe(self, row: Mapping[str, Any]) -> tuple[str, dict[str, str]]:
        reward = "" if math.isnan(row["reward_mean"]) else f" reward {row['reward_mean']:.4f}"
        line = (f"{self.algo} step {self.step}: ilhf loss {row.get('ilhf_loss', math.nan):.4f}"
                f"{reward} {row['step_time_s']:.1f}s")  # fmt: skip
        return line, {}

    def checkpoint_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        """Every particle's LoRA weights, packed in one `adapter_model` (the frontier snapshot)."""
        return {"adapter_model": pack_particles(self.model, self.names)}

    def checkpoint_state(self) -> dict[str, Any]:
        """Every particle's anchor and optimiser."""
        return {
            "anchors": {n: [a.cpu() for a in v] for n, v in self.anchors.items()},
            "optimizers": {n: o.state_dict() for n, o in self.optimizers.items()},
        }

    def restore(self, path: Path, state: Mapping[str, Any]) -> None:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        # checkpoints written before the particles moved to adapter_model kept them in state.pt
        particles = state.get("particles") or unpack_particles(
            load_file(str(path / "adapter_model.safetensors")), path / "adapter_model.safetensors"
        )
        for n in self.names:
            set_peft_model_state_dict(self.model, particles[n], adapter_name=n)
            for a, saved in zip(self.anchors[n], state["anchors"][n], strict=True):
                a.copy_(saved.to(a.device))
            self.optimizers[n].load_state_dict(state["optimizers"][n])

    def save_model(self, folder: Path) -> None:
        """The particles (`p<m>/`, one LoRA adapter each) and `ensemble.json`."""
        self.model.save_pretrained(folder, selected_adapters=self.names)
        # peft writes the first adapter at the top level when it is named 'default'; ours are
        # named, so each lands in its own sub-folder folder/<name>/
        for n in self.names:
            if not (folder / n / "adapter_config.json").is_file():
                raise RuntimeError(f"{folder / n}: peft did not write particle {n}")
        (folder / ENSEMBLE_FILE).write_text(json.dumps({"algo": self.algo, "particles": self.names,
                                                        "prior_scale": self.ilhf.prior_scale}, indent=2),
                                            encoding="utf-8")  # fmt: skip


class ILHFHistoryTrainer(ILHFTrainer):
    """ILHF on historical pairs: `history_epochs` passes in steps of `history_batch_pairs` pairs."""

    def __init__(self, *args: Any, pairs: Sequence[tuple[list[int], list[int], list[int], float]],
                 **kwargs: Any):  # fmt: skip
        if not pairs:
            raise ValueError("ilhf_history has no pairs: no context has two distinct descriptions")
        super().__init__(*args, **kwargs)
        ic = self.ilhf
        self.pairs = list(pairs)
        self.total_steps = max(
            1, math.ceil(len(pairs) * ic.history_epochs / ic.history_batch_pairs)
        )
        rng = np.random.default_rng([self.seed, 7])
        self.order = np.concatenate([rng.permutation(len(pairs))
                                     for _ in range(math.ceil(ic.history_epochs) + 1)])  # fmt: skip

    def train_step(self) -> dict[str, Any]:
        ic, t0 = self.ilhf, time.perf_counter()
        chunk = self.order[
            self.step * ic.history_batch_pairs : (self.step + 1) * ic.history_batch_pairs
        ]
        stats = self.update([self.pairs[i] for i in chunk], 1.0, ic.history_batch_pairs, len(self.pairs),
                            draw_seed=self.seed * 100_003 + self.step)  # fmt: skip
        self.step += 1
        return self._log(stats, time.perf_counter() - t0)

    def describe(self, row: Mapping[str, Any]) -> tuple[str, dict[str, str]]:
        return super().describe(row)[0], {"loss": f"{row['ilhf_loss']:.3f}"}


class ILHFOnlineTrainer(ILHFTrainer):
    """ILHF on the policy's own pairs: PPO's prompt schedule, `rl.num_generations` responses per
    prompt from a particle drawn per prompt, paired (0,1), (2,3), ...; labels drawn from the
    reward model; `rl.update_epochs` passes in minibatches of `rl.minibatch_size / 2` pairs."""

    def __init__(self, *args: Any, prompts: Sequence[str], contexts: Sequence[Mapping[str, Any]],
                 reward_fn: RewardFn, **kwargs: Any):  # fmt: skip
        super().__init__(*args, **kwargs)
        self.prompts, self.contexts, self.reward_fn = list(prompts), list(contexts), reward_fn
        rl = self.rl
        self.schedule = prompt_schedule(
            len(prompts), self.total_steps, rl.prompts_per_step, self.seed
        )

    @torch.no_grad()
    def _rollout(
        self, enc: Mapping[str, torch.Tensor], adapters: list[str]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.model.eval()  # peft's mixed-adapter batches are inference-only
        with autocast(self.autocast_dtype, self.device):
            out = self.model.generate(
                input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], do_sample=True,
                temperature=self.rl.temperature, top_p=self.rl.top_p, top_k=0,
                max_new_tokens=self.rl.max_new_tokens, pad_token_id=self.tokenizer.pad_token_id,
                eos_token_id=self.stop_ids, adapter_names=adapters,
            )  # fmt: skip
        response = out[:, enc["input_ids"].shape[1] :]
        is_eos = torch.isin(response, torch.tensor(self.stop_ids, device=response.device))
        keep = ~((is_eos.cumsum(-1) - is_eos.long()) > 0)
        return response, keep

    def train_step(self) -> dict[str, Any]:
        rl, prompts, contexts = self.rl, self.prompts, self.contexts
        t0 = time.perf_counter()
        rng = np.random.default_rng([self.seed, 11, self.step])
        pidx = self.schedule[self.step]
        z = rng.integers(0, len(self.names), size=len(pidx))  # Thompson: a particle per prompt
        idx = [i for i in pidx for _ in range(rl.num_generations)]
        adapters = [self.names[zi] for zi in z for _ in range(rl.num_generations)]
        enc = encode_prompts(
            self.tokenizer, [prompts[i] for i in idx], return_tensors="pt", padding=True
        )
        enc = {k: v.to(self.device) for k, v in enc.items()}
        torch.manual_seed(self.seed * 7919 + self.step)
        t_gen = time.perf_counter()
        response, keep = self._rollout(enc, adapters)
        gen_time = time.perf_counter() - t_gen
        resp_ids = [r[k].tolist() for r, k in zip(response, keep, strict=True)]
        texts = self.tokenizer.batch_decode(
            [r or [self.pad] for r in resp_ids], skip_special_tokens=True
        )
        cleaned = [postprocess_response(t, rl.response_postprocess) for t in texts]
        scores = np.asarray(self.reward_fn([contexts[i] for i in idx], cleaned), dtype=float)
        if scores.shape != (len(idx),) or not np.isfinite(scores).all():
            raise ValueError(
                f"reward_fn returned {scores.shape} / non-finite scores for {len(idx)} responses"
            )
        prompt_ids = [
            enc["input_ids"][r][enc["attention_mask"][r].bool()].tolist() for r in range(len(idx))
        ]
        kl = self._kl(prompt_ids, resp_ids, adapters)
        pairs = []
        for a in range(0, len(idx), 2):
            p = float(pair_probability(scores[a], scores[a + 1]))
            label = float(rng.random() < p)  # the preference is a draw, as a labeller's
            if resp_ids[a] and resp_ids[a + 1]:
                pairs.append((prompt_ids[a], resp_ids[a], resp_ids[a + 1], label))
        stats = self.update(pairs, rl.update_epochs, max(1, rl.minibatch_size // 2), len(pairs),
                            draw_seed=self.seed * 100_003 + self.step) if pairs else {}  # fmt: skip
        self.step += 1
        finished = [bool(r) and r[-1] in self.stop_ids for r in resp_ids]
        row = self._log({**stats, "reward_mean": float(scores.mean()), "reward_std": float(scores.std()),
                         "kl": kl, "kl_all_tokens": kl, "reward_learner": float(scores.mean()), "response_len": float(np.mean([len(r) for r in resp_ids])),
                         "finished": float(np.mean(finished)), "gen_time_s": gen_time},
                        time.perf_counter() - t0, n_tokens=sum(len(r) for r in resp_ids))  # fmt: skip
        if self.step == 1 or self.step % rl.sample_every == 0:
            self.samples.append({"step": self.step, "particle": adapters[0], **{k: contexts[idx[0]].get(k) for k in CONTEXT_FIELDS},
                                 "response": cleaned[0], "reward": float(scores[0])})  # fmt: skip
        return row

    def describe(self, row: Mapping[str, Any]) -> tuple[str, dict[str, str]]:
        return super().describe(row)[0], {"reward": f"{row['reward_mean']:.3f}"}

    @torch.no_grad()
    def _kl(
        self, prompts: list[list[int]], responses: list[list[int]], adapters: list[str]
    ) -> float:
        """Monte-Carlo KL(ensemble || start policy) per response: log of the mixture density
        minus the reference's (adapters off), on the step's own samples."""
        keep = [i for i, r in enumerate(responses) if r]
        if not keep:
            return math.nan
        ps, rs = [prompts[i] for i in keep], [responses[i] for i in keep]
        per = []
        for name in self.names:
            self.model.set_adapter(name)
            per.append(self.sequence_logprobs(ps, rs).float().cpu().numpy())
        with self.model.disable_adapter():
            ref = self.sequence_logprobs(ps, rs).float().cpu().numpy()
        return float(np.mean(mixture_logprobs(per) - ref))


# ---------------------------------------------------------------------------------------------
# The stage
# ---------------------------------------------------------------------------------------------
def encoded_history_pairs(
    cfg: Any, run_dir: Any, tokenizer: Any, model: Any, job: Any
) -> tuple[pd.DataFrame, list[tuple[list[int], list[int], list[int], float]]]:
    """`history_pairs` over the policy pool's rows (those fitting `ilhf.history_max_tokens`),
    `ilhf.history_max_pairs` of them taken in RL's context order, half of rl.num_generations a
    visit (`experience.take_in_context_order`), as token ids (the pair's context's prompt, each
    description + end token)."""
    rd, ic = RunDir(run_dir), cfg.ilhf
    labelled, _ = load_splits(rd)
    ctx = rd.read_parquet("data/contexts.parquet", stage="notebook 01 (data exploration)")
    rows = eligible_rows(labelled, load_holdout(rd), "all")
    area = context_areas(ctx)
    # pairs drawn with the training seed, as DPO's: the across-seed spread carries their draw
    pairs = history_pairs(rows, len(rows) ** 2, ic.history_pairs_per_context, job.seed)
    pairs, a_ids, b_ids = pair_targets(pairs, tokenizer, model, ic.history_max_tokens, len(pairs), job.seed)  # fmt: skip
    take = take_in_context_order(pairs, job.contexts, job.seed, max(1, job.rl.num_generations // 2), ic.history_max_pairs)  # fmt: skip
    pairs, a_ids, b_ids = pairs.iloc[take].reset_index(drop=True), [a_ids[i] for i in take], [b_ids[i] for i in take]  # fmt: skip
    p_ids = context_prompt_ids(pairs, area, tokenizer, cfg)
    enc = [
        (list(p), a, b, float(q))
        for p, a, b, q in zip(p_ids, a_ids, b_ids, pairs["p_a"], strict=True)
    ]
    return pairs, enc


def run_ilhf(job: TrainJob) -> pd.DataFrame:
    """One ILHF algorithm (an ensemble of particles on the start policy); resumes."""
    cfg, run_dir = job.require_study()
    algo, ic, out = job.algo, cfg.ilhf, job.output_dir
    if algo not in ("ilhf_history", "ilhf_online"):
        raise ValueError(
            f"unknown ILHF algorithm {algo!r}; expected 'ilhf_history' or 'ilhf_online'"
        )
    seed_everything(job.seed)
    # one particle is plain ILHF: it starts at the start policy (no perturbation, no bootstrap)
    scale = ic.prior_scale if ic.particles > 1 else 0.0
    model = add_particles(job.model, job.policy.lora, ic.particles, scale, job.seed)
    args = (model, job.tokenizer, ic, job.rl, out, algo, job.seed, job.policy.autocast)
    common = {"particles": ic.particles, "prior_scale": scale, "prior_reg": ic.prior_reg,
              "prior_scaling": ic.prior_scaling,
              "bootstrap": ic.bootstrap and ic.particles > 1,
              "learning_rate": ic.learning_rate or job.rl.learning_rate,
              "kl_penalty": "none (the ensemble's pull towards its initial weights)",
              "advantage": "none: the policy's log-likelihoods are the reward (ILHF loss)"}  # fmt: skip
    if algo == "ilhf_history":
        frame, pairs = encoded_history_pairs(cfg, run_dir, job.tokenizer, job.model, job)
        out.mkdir(parents=True, exist_ok=True)
        with atomic_path(out / "pairs.parquet") as tmp:
            frame.to_parquet(tmp, index=False)
        trainer: ILHFTrainer = ILHFHistoryTrainer(*args, pairs=pairs)
        write_settings(out, algo, job.rl, {
            **common, "steps": trainer.total_steps, "prompts_per_step": None,
            "responses_per_prompt": None, "responses_per_step": 2 * ic.history_batch_pairs,
            "optimizer_steps_per_batch": 1, "update_epochs": ic.history_epochs,
            "minibatch_size": 2 * ic.history_batch_pairs, "max_new_tokens": None,
            "temperature": None, "kl_coef_initial": None,
            "pairs": len(pairs), "mixed_outcome_pairs": int((frame["p_a"] != 0.5).sum()),
            "contexts": int(frame[list(CONTEXT_FIELDS)].drop_duplicates().shape[0]),
            "labels": "historical outcome: MET preferred (P = 1), same outcome P = 1/2",
        })  # fmt: skip
        return trainer.train(progress=job.progress)
    if job.reward_fn is None:
        raise ValueError("ilhf_online needs the reward model's reward_fn (its labels)")
    trainer = ILHFOnlineTrainer(*args, steps=job.steps, prompts=job.prompts,
                                contexts=job.contexts, reward_fn=job.reward_fn)  # fmt: skip
    write_settings(out, algo, job.rl, {
        **common, "kl_coef_initial": None,
        "labels": "a Bernoulli draw with p = P_A / (P_A + P_B) from the reward model's P(MET)",
    })  # fmt: skip
    return trainer.train(progress=job.progress)
