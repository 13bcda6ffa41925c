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
double-or-nothing bootstrap weights (w in {0, 2}) and a pull eta / N * ||phi - phi_0||^2 towards
its own initial weights (N: the pairs of an epoch, the MAP scaling of their eta for a mean loss).

Two ways to get pairs on MONA:

- `ilhf_history` (no reward model): pairs of historical descriptions of one context (country,
  arrangement type, descriptor) among the rows the RL stage may see (`sft.eligible_rows`), MET
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

from rlxf_utils.artifacts import atomic_path, to_jsonable
from rlxf_utils.config import ILHFConfig, RLConfig
from rlxf_utils.models import autocast, eos_ids, postprocess_response
from rlxf_utils.ppo import (
    LOG_COLUMNS,
    RewardFn,
    _atomic_dir,
    _rng_state,
    _seed_everything,
    _set_rng_state,
    prompt_schedule,
)
from rlxf_utils.sft import SFTExample, _collate, response_token_nll

__all__ = [
    "ENSEMBLE_FILE",
    "ILHFTrainer",
    "add_particles",
    "didactic",
    "double_or_nothing",
    "history_pairs",
    "ilhf_loss",
    "is_ensemble",
    "load_particles",
    "mixture_logprobs",
    "pair_probability",
    "run_ilhf",
    "thompson_draw",
]

log = logging.getLogger(__name__)

#: Marks a saved ensemble: `policy/<algo>/adapter/ensemble.json` lists the particles' folders.
ENSEMBLE_FILE = "ensemble.json"
_KEYS = ("country", "arrangement_type", "econ_descriptor")
#: ILHF's own columns in the training log, beside `ppo.LOG_COLUMNS`
ILHF_COLUMNS = (
    "ilhf_loss",
    "prior_loss",
    "pref_accuracy",
    "pairs",
    "mixed_pairs",
    "particle_spread",
)


# ---------------------------------------------------------------------------------------------
# The loss and the labels
# ---------------------------------------------------------------------------------------------
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


def thompson_draw(n_prompts: int, particles: int, seed: int) -> np.ndarray:
    """The particle answering each prompt: uniform on {0..particles-1}, seeded."""
    return np.random.default_rng(seed).integers(0, particles, size=n_prompts)


# ---------------------------------------------------------------------------------------------
# The didactic example (their Section 2.3): one-token responses
# ---------------------------------------------------------------------------------------------
def didactic(
    method: str,
    steps: int = 400,
    batch: int = 256,
    lr: float = 0.02,
    kl_coef: float = 1.0,
    pretrain: Sequence[float] = (0.77, 0.23),
    preference: Sequence[float] = (2 / 3, 1 / 3),
    seed: int = 0,
) -> pd.DataFrame:
    """Fine-tune a one-token policy (logits over two responses, starting at `pretrain`) on
    feedback from a population preferring response 0 with probability `preference[0]`.

    `method='ilhf'`: pairs sampled from the policy, a 0/1 label drawn from the population
    (P(a > b) = pref_a / (pref_a + pref_b)), the ILHF loss. `method='reinforce'`: REINFORCE with
    the population's logits log(preference) as the reward (what the paper grants it) and a
    per-sample KL penalty `kl_coef` * log(pi / pi_pretrain), mean baseline. Returns per step the
    policy's probability of each response.
    """
    if method not in ("ilhf", "reinforce"):
        raise ValueError(f"method={method!r}; expected 'ilhf' or 'reinforce'")
    gen = torch.Generator().manual_seed(seed)
    log_pre = torch.log(torch.tensor(pretrain, dtype=torch.float64))
    pref = torch.tensor(preference, dtype=torch.float64)
    theta = nn.Parameter(log_pre.clone())
    opt = torch.optim.Adam([theta], lr=lr)
    rows = []
    for step in range(steps + 1):
        logp = torch.log_softmax(theta, -1)
        probs = logp.detach().exp()
        rows.append({"method": method, "step": step, "p0": float(probs[0]),
                     "p1": float(probs[1])})  # fmt: skip
        if step == steps:
            break
        if method == "ilhf":
            a = torch.multinomial(probs, batch, replacement=True, generator=gen)
            b = torch.multinomial(probs, batch, replacement=True, generator=gen)
            p_a = pref[a] / (pref[a] + pref[b])
            label = (torch.rand(batch, generator=gen, dtype=torch.float64) < p_a).double()
            loss = ilhf_loss(logp[a], logp[b], label)
        else:
            y = torch.multinomial(probs, batch, replacement=True, generator=gen)
            reward = torch.log(pref)[y] - kl_coef * (logp[y].detach() - log_pre[y])
            loss = -((reward - reward.mean()) * logp[y]).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return pd.DataFrame(rows)


# ---------------------------------------------------------------------------------------------
# Pairs from history
# ---------------------------------------------------------------------------------------------
def history_pairs(rows: pd.DataFrame, max_pairs: int, per_context: int, seed: int) -> pd.DataFrame:
    """Pairs of historical descriptions of one context (`_KEYS`), from `rows` (already limited
    to what the RL stage may see): `p_a` = 1 when only A was MET, 0 when only B was, 1/2 when
    both share an outcome. Pairs of identical descriptions (MONA repeats a condition across an
    arrangement's reviews) carry no preference between texts and are left out.

    At most `per_context` pairs per context, drawn uniformly among its distinct pairs, then at
    most `max_pairs` overall (uniformly), A/B order random; seeded.
    """
    missing = [c for c in (*_KEYS, "row_id", "description", "y") if c not in rows.columns]
    if missing:
        raise KeyError(f"history_pairs: rows lack columns {missing}")
    rng = np.random.default_rng(seed)
    text = rows["description"].astype(str).map(lambda t: " ".join(t.split()))
    frame = rows.assign(_text=text).reset_index(drop=True)
    out: list[dict[str, Any]] = []
    for key, g in frame.groupby(list(_KEYS), sort=True):
        g = g.drop_duplicates(subset=["_text", "y"])
        idx = g.index.to_numpy()
        if len(idx) < 2:
            continue
        cand = [(i, j) for ai, i in enumerate(idx) for j in idx[ai + 1 :]
                if frame.at[i, "_text"] != frame.at[j, "_text"]]  # fmt: skip
        if not cand:
            continue
        take = rng.choice(len(cand), size=min(per_context, len(cand)), replace=False)
        for t in sorted(take):
            i, j = cand[t]
            if rng.random() < 0.5:
                i, j = j, i
            ya, yb = int(frame.at[i, "y"]), int(frame.at[j, "y"])
            out.append({**dict(zip(_KEYS, key, strict=True)),
                        "row_a": int(frame.at[i, "row_id"]), "row_b": int(frame.at[j, "row_id"]),
                        "text_a": frame.at[i, "_text"], "text_b": frame.at[j, "_text"],
                        "y_a": ya, "y_b": yb,
                        "p_a": 0.5 if ya == yb else float(ya > yb)})  # fmt: skip
    pairs = pd.DataFrame(
        out, columns=[*_KEYS, "row_a", "row_b", "text_a", "text_b", "y_a", "y_b", "p_a"]
    )
    if len(pairs) > max_pairs:
        pairs = pairs.iloc[np.sort(rng.choice(len(pairs), size=max_pairs, replace=False))]
    return pairs.reset_index(drop=True)


# ---------------------------------------------------------------------------------------------
# Particles
# ---------------------------------------------------------------------------------------------
def particle_names(n: int) -> list[str]:
    return [f"p{m}" for m in range(n)]


def add_particles(model: nn.Module, lora: Any, n: int, prior_scale: float, seed: int) -> Any:
    """`model` wrapped with `n` LoRA adapters p0..p{n-1}, each with a fresh A (PEFT's init, seeded
    per particle) and B ~ N(0, prior_scale^2): particle m starts at a perturbation of `model`."""
    from peft import get_peft_model

    from rlxf_utils.models import lora_config

    names = particle_names(n)
    peft_model = None
    for m, name in enumerate(names):
        torch.manual_seed(seed * 1000 + m)
        if peft_model is None:
            peft_model = get_peft_model(model, lora_config(lora), adapter_name=name)
        else:
            peft_model.add_adapter(name, lora_config(lora))
        gen = torch.Generator().manual_seed(seed * 1000 + m)
        with torch.no_grad():
            for pname, p in peft_model.named_parameters():
                if f"lora_B.{name}." in pname:
                    p.copy_(torch.randn(p.shape, generator=gen) * prior_scale)
    peft_model.set_adapter(names[0])
    return peft_model


def particle_parameters(model: nn.Module, name: str) -> list[nn.Parameter]:
    """The LoRA parameters of particle `name`."""
    return [p for pname, p in model.named_parameters() if f"lora_A.{name}." in pname
            or f"lora_B.{name}." in pname]  # fmt: skip


def is_ensemble(adapter_dir: str | Path) -> bool:
    """True for a saved ILHF ensemble (`adapter/ensemble.json`)."""
    return (Path(adapter_dir) / ENSEMBLE_FILE).is_file()


def load_particles(model: nn.Module, adapter_dir: str | Path, prefix: str) -> tuple[Any, list[str]]:
    """Load every particle of the ensemble at `adapter_dir` onto `model` (a plain model or a peft
    model) as adapters `<prefix>__p<m>`; returns (the peft model, the adapter names)."""
    from peft import PeftModel

    adapter_dir = Path(adapter_dir)
    marker = adapter_dir / ENSEMBLE_FILE
    try:
        info = json.loads(marker.read_text(encoding="utf-8"))
        parts = list(info["particles"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{marker}: not a readable ILHF ensemble marker ({exc})") from exc
    names = []
    for part in parts:
        path = adapter_dir / part
        if not (path / "adapter_config.json").is_file():
            raise FileNotFoundError(
                f"{path}: particle listed in {marker} has no adapter_config.json"
            )
        name = f"{prefix}__{part}"
        if isinstance(model, PeftModel):
            model.load_adapter(str(path), adapter_name=name)
        else:
            model = PeftModel.from_pretrained(model, str(path), adapter_name=name)
        names.append(name)
    return model, names


def mixture_logprobs(per_particle: Sequence[np.ndarray]) -> np.ndarray:
    """log mean_m pi_m(y|x) from each particle's log-likelihoods (the ensemble policy's density)."""
    stack = np.stack([np.asarray(x, dtype=float) for x in per_particle])
    top = stack.max(axis=0)
    return top + np.log(np.exp(stack - top).mean(axis=0))


# ---------------------------------------------------------------------------------------------
# The trainer
# ---------------------------------------------------------------------------------------------
class ILHFTrainer:
    """ILHF on an ensemble of LoRA particles (`add_particles`); writes to `output_dir`.

    `update(pairs)` trains every particle on a list of pairs (prompt ids, A ids, B ids, P(A)):
    `epochs` passes in minibatches of `batch_pairs`, with double-or-nothing weights per particle
    and pair, and the pull towards the particle's initial weights. `train_history` and
    `train_online` drive it; both checkpoint every `rl.checkpoint_every` steps and resume.
    """

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
    ):
        if not hasattr(model, "peft_config"):
            raise TypeError("model must carry the particles as peft adapters (ilhf.add_particles)")
        self.model, self.tokenizer, self.ilhf, self.rl = model, tokenizer, ilhf, rl
        self.output_dir, self.algo, self.seed = Path(output_dir), algo, seed
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
        self.optimizers = {n: torch.optim.AdamW(ps, lr=lr, eps=1e-5, weight_decay=0.0)
                           for n, ps in self.params.items()}  # fmt: skip
        self.pad = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        )
        self.stop_ids = sorted(eos_ids(model, tokenizer))
        self.step = 0
        self.history: list[dict[str, Any]] = []
        self.samples: list[dict[str, Any]] = []

    # -- log-likelihoods ---------------------------------------------------------------------
    def _batch(
        self, prompts: Sequence[list[int]], responses: Sequence[list[int]]
    ) -> dict[str, Any]:
        batch = _collate(
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
        """Train each particle on `pairs`; `n_data` scales the prior (pairs per epoch)."""
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
                     if ic.bootstrap else None)  # fmt: skip
                loss = ilhf_loss(lp_a.float(), lp_b.float(), p_a, w)
                prior = self._prior(name)
                total_loss = loss + ic.prior_reg / max(n_data, 1) * prior
                opt = self.optimizers[name]
                opt.zero_grad(set_to_none=True)
                total_loss.backward()
                torch.nn.utils.clip_grad_norm_(self.params[name], self.rl.max_grad_norm)
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

    # -- history -----------------------------------------------------------------------------
    def train_history(
        self, pairs: Sequence[tuple[list[int], list[int], list[int], float]], progress: bool = True
    ) -> pd.DataFrame:
        """ILHF on historical pairs: `history_epochs` passes in steps of `history_batch_pairs`."""
        from tqdm.auto import tqdm

        ic = self.ilhf
        if not pairs:
            raise ValueError("ilhf_history has no pairs: no context has two distinct descriptions")
        steps = max(1, math.ceil(len(pairs) * ic.history_epochs / ic.history_batch_pairs))
        rng = np.random.default_rng([self.seed, 7])
        order = np.concatenate([rng.permutation(len(pairs))
                                for _ in range(math.ceil(ic.history_epochs) + 1)])  # fmt: skip
        self.load_checkpoint()
        bar = tqdm(total=steps, initial=self.step, desc=self.algo, disable=not progress)
        while self.step < steps:
            t0 = time.perf_counter()
            chunk = order[
                self.step * ic.history_batch_pairs : (self.step + 1) * ic.history_batch_pairs
            ]
            stats = self.update([pairs[i] for i in chunk], 1.0, ic.history_batch_pairs, len(pairs),
                                draw_seed=self.seed * 100_003 + self.step)  # fmt: skip
            self.step += 1
            self._log(stats, time.perf_counter() - t0)
            bar.update(1)
            bar.set_postfix(loss=f"{stats['ilhf_loss']:.3f}")
            if self.step % self.rl.checkpoint_every == 0 and self.step < steps:
                self.save_checkpoint()
        bar.close()
        self.save_outputs()
        return self.log_frame()

    # -- online ------------------------------------------------------------------------------
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

    def train_online(
        self,
        prompts: Sequence[str],
        contexts: Sequence[Mapping[str, Any]],
        reward_fn: RewardFn,
        steps: int | None = None,
        progress: bool = True,
    ) -> pd.DataFrame:
        """ILHF on the policy's own pairs: PPO's prompt schedule, `rl.num_generations` responses
        per prompt from a particle drawn per prompt, paired (0,1), (2,3), ...; labels drawn from
        the reward model; `rl.update_epochs` passes in minibatches of `rl.minibatch_size / 2` pairs."""
        from tqdm.auto import tqdm

        from rlxf_utils.models import encode_prompts

        rl = self.rl
        n = steps or rl.steps
        schedule = prompt_schedule(len(prompts), n, rl.prompts_per_step, self.seed)
        self.load_checkpoint()
        bar = tqdm(total=n, initial=self.step, desc=self.algo, disable=not progress)
        while self.step < n:
            t0 = time.perf_counter()
            rng = np.random.default_rng([self.seed, 11, self.step])
            pidx = schedule[self.step]
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
            scores = np.asarray(reward_fn([contexts[i] for i in idx], cleaned), dtype=float)
            if scores.shape != (len(idx),) or not np.isfinite(scores).all():
                raise ValueError(
                    f"reward_fn returned {scores.shape} / non-finite scores for {len(idx)} responses"
                )
            prompt_ids = [
                enc["input_ids"][r][enc["attention_mask"][r].bool()].tolist()
                for r in range(len(idx))
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
            self._log({**stats, "reward_mean": float(scores.mean()), "reward_std": float(scores.std()),
                       "kl": kl, "response_len": float(np.mean([len(r) for r in resp_ids])),
                       "finished": float(np.mean(finished)), "gen_time_s": gen_time},
                      time.perf_counter() - t0, n_tokens=sum(len(r) for r in resp_ids))  # fmt: skip
            if self.step == 1 or self.step % rl.sample_every == 0:
                self.samples.append({"step": self.step, "particle": adapters[0], **{k: contexts[idx[0]].get(k) for k in _KEYS},
                                     "response": cleaned[0], "reward": float(scores[0])})  # fmt: skip
            bar.update(1)
            bar.set_postfix(reward=f"{scores.mean():.3f}")
            if self.step % rl.checkpoint_every == 0 and self.step < n:
                self.save_checkpoint()
        bar.close()
        self.save_outputs()
        return self.log_frame()

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

    # -- bookkeeping -------------------------------------------------------------------------
    def _log(self, stats: Mapping[str, Any], seconds: float, n_tokens: int | None = None) -> None:
        row = {c: math.nan for c in (*LOG_COLUMNS, *ILHF_COLUMNS)}
        row.update({"algo": self.algo, "step": self.step, "scheme": None})
        row.update({k: v for k, v in stats.items() if k in row})
        row["step_time_s"] = seconds
        if n_tokens is not None and seconds > 0:
            row["tokens_per_s"] = n_tokens / seconds
        self.history.append(row)
        reward = "" if math.isnan(row["reward_mean"]) else f" reward {row['reward_mean']:.4f}"
        log.info("%s step %d: ilhf loss %.4f%s %.1fs", self.algo, self.step,
                 row.get("ilhf_loss", math.nan), reward, seconds)  # fmt: skip

    def log_frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.history, columns=[*LOG_COLUMNS, *ILHF_COLUMNS])

    def _state(self) -> dict[str, Any]:
        from peft import get_peft_model_state_dict

        return {
            "step": self.step, "history": self.history, "samples": self.samples, "rng": _rng_state(),
            "particles": {n: {k: v.detach().cpu() for k, v in get_peft_model_state_dict(self.model, adapter_name=n).items()}
                          for n in self.names},
            "anchors": {n: [a.cpu() for a in v] for n, v in self.anchors.items()},
            "optimizers": {n: o.state_dict() for n, o in self.optimizers.items()},
        }  # fmt: skip

    def save_checkpoint(self) -> Path:
        """Every particle, its anchor and optimiser, RNG states, logs and step (the last two kept)."""
        root = self.output_dir / "checkpoints"
        target = root / f"step_{self.step:06d}"
        _atomic_dir(target, lambda d: torch.save(self._state(), d / "state.pt"))
        for old in sorted(root.glob("step_*"))[:-2]:
            import shutil

            shutil.rmtree(old, ignore_errors=True)
        return target

    def load_checkpoint(self) -> bool:
        """Restore the newest checkpoint under `output_dir/checkpoints`; False if none."""
        from peft import set_peft_model_state_dict

        found = sorted((self.output_dir / "checkpoints").glob("step_*"))
        if not found:
            return False
        state = torch.load(found[-1] / "state.pt", weights_only=False)
        for n in self.names:
            set_peft_model_state_dict(self.model, state["particles"][n], adapter_name=n)
            for a, saved in zip(self.anchors[n], state["anchors"][n], strict=True):
                a.copy_(saved.to(a.device))
            self.optimizers[n].load_state_dict(state["optimizers"][n])
        _set_rng_state(state["rng"])
        self.history, self.samples, self.step = state["history"], state["samples"], state["step"]
        log.info("resumed %s from %s (step %d)", self.algo, found[-1], self.step)
        return True

    def save_outputs(self) -> None:
        """Particles (`adapter/p<m>/` + `adapter/ensemble.json`), log and samples, atomically."""

        def write(d: Path) -> None:
            self.model.save_pretrained(d, selected_adapters=self.names)
            # peft writes the first adapter at the top level when it is named 'default'; ours are
            # named, so each lands in its own sub-folder d/<name>/
            for n in self.names:
                if not (d / n / "adapter_config.json").is_file():
                    raise RuntimeError(f"{d / n}: peft did not write particle {n}")
            (d / ENSEMBLE_FILE).write_text(json.dumps({"algo": self.algo, "particles": self.names,
                                                       "prior_scale": self.ilhf.prior_scale}, indent=2),
                                           encoding="utf-8")  # fmt: skip

        self.output_dir.mkdir(parents=True, exist_ok=True)
        _atomic_dir(self.output_dir / "adapter", write)
        with atomic_path(self.output_dir / "train_log.parquet") as tmp:
            self.log_frame().to_parquet(tmp, index=False)
        with atomic_path(self.output_dir / "samples.jsonl") as tmp:
            tmp.write_text("".join(json.dumps(to_jsonable(s), ensure_ascii=False) + "\n"
                                   for s in self.samples), encoding="utf-8")  # fmt: skip


# ---------------------------------------------------------------------------------------------
# The stage
# ---------------------------------------------------------------------------------------------
def encoded_history_pairs(
    cfg: Any, run_dir: Any, tokenizer: Any, model: Any
) -> tuple[pd.DataFrame, list[tuple[list[int], list[int], list[int], float]]]:
    """`history_pairs` over the rows the RL stage may see, as token ids (prompt of the pair's
    context, each description + end token; pairs with a description over
    `ilhf.history_max_tokens` left out)."""
    from rlxf_utils.artifacts import RunDir
    from rlxf_utils.data import load_splits
    from rlxf_utils.models import build_prompts, encode_prompts
    from rlxf_utils.sft import eligible_rows, target_ids

    rd = RunDir(run_dir)
    ic = cfg.ilhf
    labelled, splits = load_splits(rd)
    ctx = rd.read_parquet("data/contexts.parquet", stage="notebook 01 (data exploration)")
    rows = eligible_rows(labelled, splits, ctx, cfg.reward.reward_protocol, "all")
    area = ctx.set_index(list(_KEYS))["econ_area"]
    pairs = history_pairs(
        rows, ic.history_max_pairs * 2, ic.history_pairs_per_context, cfg.run.seed
    )
    a_ids = target_ids(pairs["text_a"], tokenizer, model)
    b_ids = target_ids(pairs["text_b"], tokenizer, model)
    ok = np.array([len(a) <= ic.history_max_tokens and len(b) <= ic.history_max_tokens
                   for a, b in zip(a_ids, b_ids, strict=True)], dtype=bool)  # fmt: skip
    pairs = pairs[ok].head(ic.history_max_pairs).reset_index(drop=True)
    a_ids = [a for a, k in zip(a_ids, ok, strict=True) if k][: len(pairs)]
    b_ids = [b for b, k in zip(b_ids, ok, strict=True) if k][: len(pairs)]
    records = [{**{k: r[k] for k in _KEYS}, "econ_area": area.get(tuple(r[k] for k in _KEYS), "")}
               for r in pairs.to_dict("records")]  # fmt: skip
    prompts = build_prompts(records, tokenizer, cfg.rl.prompt_template, cfg.policy)
    p_ids = encode_prompts(tokenizer, prompts)["input_ids"] if prompts else []
    enc = [
        (list(p), a, b, float(q))
        for p, a, b, q in zip(p_ids, a_ids, b_ids, pairs["p_a"], strict=True)
    ]
    return pairs, enc


def run_ilhf(
    algo: str,
    cfg: Any,
    run_dir: Any,
    start_model: nn.Module,
    tokenizer: Any,
    prompts: Sequence[str],
    contexts: Sequence[Mapping[str, Any]],
    reward_fn: RewardFn | None,
    output_dir: Any,
    seed: int = 0,
    progress: bool = True,
    steps: int | None = None,
) -> pd.DataFrame:
    """One ILHF algorithm (an ensemble of particles on the start policy); resumes."""
    from rlxf_utils.rl import write_settings

    ic, out = cfg.ilhf, Path(output_dir)
    _seed_everything(seed)
    model = add_particles(start_model, cfg.policy.lora, ic.particles, ic.prior_scale, seed)
    trainer = ILHFTrainer(model, tokenizer, ic, cfg.rl, out, algo, seed, cfg.policy.autocast)
    common = {"particles": ic.particles, "prior_scale": ic.prior_scale, "prior_reg": ic.prior_reg,
              "bootstrap": ic.bootstrap, "learning_rate": ic.learning_rate or cfg.rl.learning_rate,
              "kl_penalty": "none (the ensemble's pull towards its initial weights)",
              "advantage": "none: the policy's log-likelihoods are the reward (ILHF loss)"}  # fmt: skip
    if algo == "ilhf_history":
        frame, pairs = encoded_history_pairs(cfg, run_dir, tokenizer, start_model)
        out.mkdir(parents=True, exist_ok=True)
        frame.to_parquet(out / "pairs.parquet", index=False)
        n_steps = max(1, math.ceil(len(pairs) * ic.history_epochs / ic.history_batch_pairs))
        write_settings(out, algo, cfg.rl, {
            **common, "steps": n_steps, "prompts_per_step": None, "responses_per_prompt": None,
            "responses_per_step": 2 * ic.history_batch_pairs, "optimizer_steps_per_batch": 1,
            "update_epochs": ic.history_epochs, "minibatch_size": 2 * ic.history_batch_pairs,
            "max_new_tokens": None, "temperature": None, "kl_coef_initial": None,
            "pairs": len(pairs), "mixed_outcome_pairs": int((frame["p_a"] != 0.5).sum()),
            "contexts": int(frame[list(_KEYS)].drop_duplicates().shape[0]),
            "labels": "historical outcome: MET preferred (P = 1), same outcome P = 1/2",
        })  # fmt: skip
        return trainer.train_history(pairs, progress=progress)
    if algo == "ilhf_online":
        if reward_fn is None:
            raise ValueError("ilhf_online needs the reward model's reward_fn (its labels)")
        write_settings(out, algo, cfg.rl, {
            **common, "kl_coef_initial": None,
            "labels": "Bernoulli(P_A / (P_A + P_B)) on the reward model's P(MET)",
        })  # fmt: skip
        return trainer.train_online(prompts, contexts, reward_fn, steps=steps, progress=progress)
    raise ValueError(f"unknown ILHF algorithm {algo!r}; expected 'ilhf_history' or 'ilhf_online'")


# ---------------------------------------------------------------------------------------------
# Notebook 03: the didactic example and the training table
# ---------------------------------------------------------------------------------------------
def didactic_figure(
    kl_coefs: Sequence[float] = (0.1, 1.0), seed: int = 0
) -> tuple[Any, pd.DataFrame]:
    """The paper's Figure 1 on our code: P(less-preferred response) over fine-tuning for ILHF and
    REINFORCE with a KL penalty, against the population's 1/3 and pretraining's 0.23. Returns
    (figure, the end point of each run)."""
    import matplotlib.pyplot as plt

    runs = {"ILHF": didactic("ilhf", seed=seed)}
    for beta in kl_coefs:
        runs[f"REINFORCE + KL (beta {beta:g})"] = didactic("reinforce", kl_coef=beta, seed=seed)
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for label, frame in runs.items():
        ax.plot(frame["step"], frame["p1"], label=label)
    ax.axhline(1 / 3, color="black", ls="--", lw=0.9, label="population: 1/3")
    ax.axhline(0.23, color="grey", ls=":", lw=0.9, label="pretraining: 0.23")
    ax.set(xlabel="fine-tuning step", ylabel="P(less-preferred response)",
           title="One-token didactic example (Xu et al., 2023, §2.3)")  # fmt: skip
    ax.legend(fontsize=8, loc="center right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    ends = pd.DataFrame([{"method": k, "p_less_preferred": float(v["p1"].tail(50).mean())}
                         for k, v in runs.items()])  # fmt: skip
    return fig, ends


def training_table(logs: pd.DataFrame) -> pd.DataFrame:
    """Per ILHF algorithm: steps, pairs per step (and the share with different outcomes), the ILHF
    loss at the start and end, the particles' preference accuracy on pairs with a winner, the
    spread of the particles' log-likelihood margins (their disagreement), and the step time."""
    from rlxf_utils.config import ILHF_ALGORITHMS, algorithm_label

    rows = []
    for algo, g in logs[logs["algo"].isin(ILHF_ALGORITHMS)].groupby("algo", sort=False):
        third = max(1, len(g) // 3)
        rows.append({"algorithm": algorithm_label(str(algo)), "steps": len(g),
                     "pairs_per_step": g["pairs"].mean(),
                     "mixed_outcome_share": float(g["mixed_pairs"].sum() / max(g["pairs"].sum(), 1)),
                     "loss_first": g["ilhf_loss"].head(third).mean(),
                     "loss_last": g["ilhf_loss"].tail(third).mean(),
                     "pref_accuracy_last": g["pref_accuracy"].tail(third).mean(),
                     "particle_spread_last": g["particle_spread"].tail(third).mean(),
                     "reward_last": g["reward_mean"].tail(third).mean(),
                     "kl_last": g["kl"].tail(third).mean(),
                     "step_time_s": g["step_time_s"].median()})  # fmt: skip
    return pd.DataFrame(rows)
