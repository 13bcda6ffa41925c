"""The alignment-evaluation stage (notebook 04): every policy on the held-out contexts, measured.

Policies: `base` (the zero-shot model), the supervised `sft` and `sft_met` (LoRA adapters on the
base), each RL algorithm (`ppo`, `grpo`, `rloo`: LoRA adapters on the start policy, i.e. the base
with `sft` merged in), `best_of_n` (N start-policy candidates per prompt, drawn independently of
the start policy's own samples, the reward model keeps one), and three references drawn from
history for the same contexts: real MET descriptions (`history_met`), real Non-MET descriptions
(`history_nonmet`) and the paper's `random_policy` (real descriptions drawn at random).

Two sets of weights are loaded (the base and the start policy); adapters are switched on them.
Every generated response is scored under three models: the policy itself (`logp_policy`), the
start policy RL was regularised towards (`logp_ref`: KL is measured the same way for every
policy, sequence-level on its own samples) and the zero-shot base (`logp_base`: the perplexity
of the outputs, one fixed judge for all). Every generated policy uses the same prompts, sampling
settings and seed. Gains and paired tests are against the start policy. Written to the run dir:

* `eval/samples.parquet` and `eval/samples.jsonl`: one row per response (context, text, reward,
  the reward heads' SD of P(MET) `reward_sd` (`reward_uncertainty`), audit reward, log-probs,
  whether it finished before the cap, grounding);
* `eval/frontier.parquet`: reward, audit reward and KL of every algorithm's snapshots and final
  policy, and the best-of-N curve (N = `best_of_n_curve`, KL at its upper bound);
* `eval/heldout_perplexity.parquet`: perplexity of held-out historical descriptions (MET and
  Non-MET) under every policy;
* `eval/historical_index/`: MiniLM embeddings of every labelled MONA description (cached);
* `eval/summary.json` and tables `eval_*`, figures `eval_*`; among them the RLGF paper's
  evaluation (`rlgf_eval`): tables `eval_rlgf`, `eval_prompt_difficulty`, `eval_easy_hard`,
  `eval_guidance` and figures `eval_reward_perplexity`, `eval_easy_hard`; and the ILHF paper's
  (`ilhf_eval`): tables `eval_inclusive`, `eval_inclusive_tests` and figure `eval_inclusive`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from . import evaluation as ev
from . import ilhf, ilhf_eval, reward_uncertainty, rlgf_eval
from .artifacts import ArtifactMissing, RunDir
from .config import algorithm_label
from .models import (
    autocast,
    build_prompts,
    display_country,
    generate,
    load_policy,
    load_start_policy,
    resolve_device,
)
from .prompts import response_contexts
from .rl import _CTX_KEYS, load_contexts
from .sft import SFT_POLICIES, heldout_rows

log = logging.getLogger(__name__)


class PhaseTimer:
    """Wall seconds per named phase of a long stage, logged as each ends (the stage's progress)
    and kept in `seconds` for its summary file."""

    def __init__(self, stage: str):
        self.stage, self.seconds = stage, {}
        self._t0 = time.perf_counter()

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        t0 = time.perf_counter()
        yield
        dt = time.perf_counter() - t0
        self.seconds[phase] = round(self.seconds.get(phase, 0.0) + dt, 1)
        log.info("%s: %s took %.0f s (%.0f s so far)", self.stage, phase, dt,
                 time.perf_counter() - self._t0)  # fmt: skip


HISTORY_POLICIES = ("history_met", "history_nonmet", "random_policy")


@dataclass
class EvalStage:
    """What notebook 04 computes (also written to the run dir)."""

    samples: pd.DataFrame
    summary: pd.DataFrame
    paired: pd.DataFrame
    frontier: pd.DataFrame
    table3: pd.DataFrame
    algos: list[str]
    tables: dict[str, pd.DataFrame]


# ---------------------------------------------------------------------------------------------
# Generation and log-probabilities
# ---------------------------------------------------------------------------------------------


def _policy_logprobs(pset: PolicySet, name: str, df: pd.DataFrame, batch_size: int) -> np.ndarray:
    lp, _ = pset.sequence_logprobs(name, df["prompt_ids"].tolist(), df["response_ids"].tolist(),
                                   batch_size, padding_side="left")  # fmt: skip
    return lp


def _logprobs(model: Any, tok: Any, df: pd.DataFrame, batch_size: int) -> np.ndarray:
    lp, _ = ev.sequence_logprobs(
        model, tok, df["prompt_ids"].tolist(), df["response_ids"].tolist(),
        batch_size=batch_size, padding_side="left",
    )  # fmt: skip
    return lp


class PolicySet:
    """Every evaluated policy on two sets of weights: the base (zero-shot, `sft`, `sft_met`
    adapters) and the start policy RL began from (the RL adapters; adapters off: the reference)."""

    def __init__(self, cfg: Any, run: RunDir, algos: Sequence[str]):
        from peft import PeftModel

        device = resolve_device(cfg.compute.device)  # the GPU when there is one (paper profile)
        self.autocast_dtype = cfg.policy.autocast
        self.start_name = cfg.rl.start_policy
        self.base, self.tok = load_policy(cfg.policy, device=device)
        self.algos = list(algos)
        self.sft_names = list(SFT_POLICIES) if cfg.sft.enabled else []

        def adapter(name: str, stage: str) -> Path:
            path = run.require(f"policy/{name}/adapter", stage=stage)
            if not (path / "adapter_config.json").is_file():
                raise ArtifactMissing(f"{path}: no adapter_config.json; {stage} did not finish")
            return path

        self.particles: dict[str, list[str]] = {}  # ILHF ensembles: their particles' adapters

        def attach(model: Any, names: Sequence[str], stage: str) -> Any:
            for name in names:
                if ilhf.is_ensemble(run.path(f"policy/{name}/adapter")):
                    model, self.particles[name] = ilhf.load_particles(
                        model, run.path(f"policy/{name}/adapter"), name
                    )
                    continue
                path = adapter(name, f"{stage} ({name})")
                if not isinstance(model, PeftModel):
                    model = PeftModel.from_pretrained(model, str(path), adapter_name=name)
                else:
                    model.load_adapter(str(path), adapter_name=name)
            return model

        on_base = self.sft_names + (self.algos if self.start_name == "base" else [])
        self.base_model: Any = attach(self.base, on_base, "notebook 03")
        self.home = {n: self.base_model for n in on_base}
        if self.start_name == "base":
            self.start_model = self.base_model
        else:
            start, _ = load_start_policy(cfg.policy, self.start_name, run.root, device=device)
            self.start_model = attach(start, self.algos, "notebook 03")
            self.home.update({n: self.start_model for n in self.algos})
        for m in {
            id(self.base_model): self.base_model,
            id(self.start_model): self.start_model,
        }.values():
            m.eval()

    @property
    def names(self) -> list[str]:
        """Generated policies in table order: base, the supervised policies, the RL algorithms."""
        return ["base", *self.sft_names, *self.algos]

    @contextlib.contextmanager
    def use(self, name: str) -> Iterator[Any]:
        """The model acting as policy `name` ('base': zero-shot; 'start': RL's reference), under
        the configured autocast."""
        with autocast(self.autocast_dtype, self.base.device):
            if name == "start" and self.start_name != "base":
                yield from self._disabled(self.start_model)
            elif name in ("base", "start"):
                yield from self._disabled(self.base_model)
            else:
                model = self.home[name]
                model.set_adapter(self.particles.get(name, [name])[0])
                yield model

    def generate(self, name: str, prompts: Sequence[str], k: int, desc: str,
                 gen_kw: Mapping[str, Any]) -> pd.DataFrame:  # fmt: skip
        """k responses per prompt from policy `name`; an ILHF ensemble answers each prompt with a
        particle drawn uniformly (Thompson sampling, seeded by the sampling seed)."""
        parts = self.particles.get(name)
        draw = (
            [parts[z] for z in ilhf.thompson_draw(len(prompts), len(parts), int(gen_kw["seed"]))]
            if parts
            else None
        )
        with self.use(name) as m:
            return generate(m, self.tok, prompts, k, desc=desc, adapter_names=draw, **gen_kw)

    def sequence_logprobs(self, name: str, prompts: Sequence[Any], responses: Sequence[Any],
                          batch_size: int, **kw: Any) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
        """`ev.sequence_logprobs` under policy `name`; an ensemble's density is its mixture's,
        log mean_m pi_m(y | x) over its particles."""
        parts = self.particles.get(name)
        if not parts:
            with self.use(name) as m:
                return ev.sequence_logprobs(
                    m, self.tok, prompts, responses, batch_size=batch_size, **kw
                )
        model, per, n = self.home[name], [], None
        with autocast(self.autocast_dtype, self.base.device):
            for part in parts:
                model.set_adapter(part)
                lp, n = ev.sequence_logprobs(
                    model, self.tok, prompts, responses, batch_size=batch_size, **kw
                )
                per.append(lp)
        return ilhf.mixture_logprobs(per), n

    @staticmethod
    def _disabled(model: Any) -> Iterator[Any]:
        if hasattr(model, "disable_adapter"):
            with model.disable_adapter():
                yield model
        else:
            yield model

    def reference(self) -> Any:
        """RL's KL reference: the start policy (adapters off on its weights)."""
        return self.use("start")

    def load_snapshot(self, algo: str, weights: Path) -> str:
        """Load a snapshot's adapter weights as adapter 'snapshot' beside `algo` (same config)."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        model = self.home[algo]
        if "snapshot" not in model.peft_config:
            model.add_adapter("snapshot", model.peft_config[algo])
        set_peft_model_state_dict(model, load_file(str(weights)), adapter_name="snapshot")
        self.home["snapshot"] = model
        return "snapshot"


def sampling_kwargs(cfg: Any, progress: bool = True) -> dict[str, Any]:
    """The sampling settings every evaluated policy shares (those of RL, one seed)."""
    rl = cfg.rl
    return dict(max_new_tokens=rl.max_new_tokens, temperature=rl.temperature, top_p=rl.top_p,
                postprocess=rl.response_postprocess, seed=cfg.run.seed,
                batch_size=cfg.evaluation.batch_size, progress=progress)  # fmt: skip


def sample_tuned(pset: PolicySet, name: str, prompts: Sequence[str], k: int, gen_kw: Mapping[str, Any],
                 logprob_batch: int, desc: str, judges: bool = True) -> pd.DataFrame:  # fmt: skip
    """k responses per prompt from policy `name`, with their log-probs under it, under the start
    policy (`logp_ref`) and under the zero-shot base (`logp_base`); `judges=False` skips the last two."""
    df = pset.generate(name, prompts, k, desc, gen_kw)
    df["logp_policy"] = _policy_logprobs(pset, name, df, logprob_batch)
    if judges:
        add_judge_logprobs(pset, df, name, logprob_batch)
    return df


def best_of_n_pool(pset: PolicySet, prompts: Sequence[str], n: int, gen_kw: Mapping[str, Any],
                   logprob_batch: int) -> pd.DataFrame:  # fmt: skip
    """n candidates per prompt from the start policy for best-of-N, drawn with another seed than
    the policies' own samples (`gen_kw['seed'] + 1`), so best-of-N is never the maximum of the very
    samples it is compared with."""
    kw = {**gen_kw, "seed": int(gen_kw["seed"]) + 1}
    return sample_tuned(pset, pset.start_name, prompts, n, kw, logprob_batch,
                        desc="best-of-N pool", judges=False)  # fmt: skip


def add_judge_logprobs(pset: PolicySet, df: pd.DataFrame, name: str, batch: int) -> pd.DataFrame:
    """Columns `logp_ref` (start policy) and `logp_base` (zero-shot base) for generated rows."""
    for col, judge in (("logp_ref", "start"), ("logp_base", "base")):
        if name == judge or (judge == "start" and name == pset.start_name == "base"):
            df[col] = df["logp_policy"]
            continue
        with pset.use(judge) as m:
            df[col] = _logprobs(m, pset.tok, df, batch)
    return df


def add_rewards(df: pd.DataFrame, contexts: Sequence[Mapping[str, Any]], reward_model: Any,
                audit_model: Any, batch: int,
                heads: reward_uncertainty.RewardHeads | None = None) -> pd.DataFrame:  # fmt: skip
    """Columns `reward` and `audit_reward`: each response scored in its prompt's context; and
    `reward_sd`, the reward heads' SD of P(MET) from the same pass (NaN without `heads`)."""
    if heads is None:
        df["reward"] = _score(df, contexts, reward_model, batch)
    reward_uncertainty.add_reward_sd(df, contexts, reward_model, heads, batch)
    df["audit_reward"] = _score(df, contexts, audit_model, batch)
    return df


# ---------------------------------------------------------------------------------------------
# History references
# ---------------------------------------------------------------------------------------------


def history_references(
    labelled: pd.DataFrame,
    contexts: Sequence[Mapping[str, Any]],
    k: int,
    seed: int,
    reference_ids: Collection[int] | None = None,
) -> pd.DataFrame:
    """Real descriptions for each held-out context: MET, Non-MET (same context) and random.

    Up to k per prompt and kind, drawn without replacement (seeded); a context without MET (or
    Non-MET) history has no row of that kind, so paired tests use only prompts both sides have.
    Only rows whose `row_id` is in `reference_ids` (data/holdout.json's `reference`: rows no
    reward or audit model trained on) are drawn, the random policy's too. `hist_idx` is the
    row's position in `labelled` (the grounding index order).
    """
    rng = np.random.default_rng(seed)
    lab = labelled.reset_index(drop=True)
    allowed = (
        np.ones(len(lab), bool)
        if reference_ids is None
        else lab["row_id"].isin(set(reference_ids)).to_numpy()
    )
    if not allowed.any():
        raise ValueError("no labelled row is a reference row; check data/holdout.json")
    key = lab[list(_CTX_KEYS)].astype(str).agg("\x1f".join, axis=1)
    groups = {
        k_: np.asarray(v)[allowed[np.asarray(v)]] for k_, v in lab.groupby(key).indices.items()
    }
    rows: list[dict[str, Any]] = []
    for pid, c in enumerate(contexts):
        idx = groups.get("\x1f".join(str(c[k_]) for k_ in _CTX_KEYS), np.array([], dtype=int))
        for policy, want in (("history_met", 1), ("history_nonmet", 0)):
            pool = idx[lab.loc[idx, "y"].to_numpy() == want] if idx.size else idx
            pick = rng.choice(pool, size=min(k, pool.size), replace=False) if pool.size else []
            rows += [
                {"policy": policy, "prompt_id": pid, "sample_id": j, "hist_idx": int(h)}
                for j, h in enumerate(pick)
            ]
        rand = rng.choice(np.flatnonzero(allowed), size=k, replace=False)
        rows += [
            {"policy": "random_policy", "prompt_id": pid, "sample_id": j, "hist_idx": int(h)}
            for j, h in enumerate(rand)
        ]
    out = pd.DataFrame(rows)
    out["response"] = lab.loc[out["hist_idx"], "description"].astype(str).to_numpy()
    return out


# ---------------------------------------------------------------------------------------------
# Summary tables
# ---------------------------------------------------------------------------------------------


def history_contrast(samples: pd.DataFrame, n_boot: int, alpha: float, seed: int) -> dict[str, Any]:
    """Real MET minus real Non-MET descriptions under the reward and the audit, per prompt, on the
    prompts that have both, with a cluster (country) bootstrap CI and tests over countries."""
    out: dict[str, Any] = {}
    h = samples[samples["policy"].isin(["history_met", "history_nonmet"])]
    if h.empty:
        return out
    for col in ("reward", "audit_reward"):
        wide = ev.per_prompt_means(h, col).dropna()
        if wide.shape[1] < 2 or wide.empty:
            continue
        cl = ev.prompt_clusters(h, cluster_col="country").loc[wide.index].to_numpy()
        res = ev.paired_comparison(wide["history_met"].to_numpy(), wide["history_nonmet"].to_numpy(),
                                   n_boot=n_boot, seed=seed, alpha=alpha, clusters=cl)  # fmt: skip
        out[col] = {k: res[k] for k in ("n", "n_clusters", "mean_a", "mean_b", "mean_diff", "ci_low",
                                        "ci_high", "p_wilcoxon")}  # fmt: skip
    return out


def kl_table(samples: pd.DataFrame, generated: Sequence[str], best_of_n: int) -> pd.DataFrame:
    """KL(policy || start policy) per policy, measured the same way for all: Monte-Carlo over the
    policy's own samples (sequence level); for best-of-N the upper bound log N - (N - 1) / N."""
    rows = []
    for pol in generated:
        g = samples[samples["policy"] == pol]
        est = ev.kl_estimate(g["logp_policy"], g["logp_ref"], g["n_tokens"])
        rows.append({"policy": pol, **{k: est[k] for k in ("kl", "kl_se", "kl_per_token")},
                     "kl_kind": "sampled"})  # fmt: skip
    rows.append({"policy": "best_of_n", "kl": ev.best_of_n_kl_bound(best_of_n), "kl_se": 0.0,
                 "kl_kind": "upper bound"})  # fmt: skip
    return pd.DataFrame(rows)


def summary_table(
    samples: pd.DataFrame,
    generated: Sequence[str],
    start: str,
    best_n: int,
    n_boot: int,
    alpha: float,
    seed: int,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(policy x measures with CIs, paired tests vs the start policy for reward and audit reward).

    Every CI and test treats the prompt's country as the unit (a cluster bootstrap): prompts of
    one country share it in both the prompt and the reward model's input, so they are not
    independent. `gap` is the gain under the reward minus the gain under the audit, per prompt.
    `reward_sd` is the mean SD of the reward heads' P(MET) (`reward_uncertainty`) with its CI and
    `sd_gain` its paired change against the start policy (NaN where no response has one).
    """
    kw = dict(n_boot=n_boot, alpha=alpha, seed=seed, cluster_col="country")
    samples = samples.assign(reward_minus_audit=samples["reward"] - samples["audit_reward"])
    rew = ev.summarise_policies(samples, "reward", **kw)
    aud = ev.summarise_policies(samples, "audit_reward", **kw)
    grd = ev.summarise_policies(
        samples.dropna(subset=["grounded_met_rate"]), "grounded_met_rate", **kw
    )
    with_sd = samples.dropna(subset=["reward_sd"]) if "reward_sd" in samples else samples.iloc[:0]
    sd_paired = (
        [ev.paired_table(with_sd, start, "reward_sd", **kw).assign(measure="reward_sd")]
        if start in set(with_sd["policy"])
        else []
    )
    paired = pd.concat(
        [
            ev.paired_table(samples, start, "reward", **kw).assign(measure="reward"),
            ev.paired_table(samples, start, "audit_reward", **kw).assign(measure="audit_reward"),
            ev.paired_table(samples, start, "reward_minus_audit", **kw).assign(measure="gap"),
            *sd_paired,
        ],
        ignore_index=True,
    )
    text = ev.text_table(samples)
    kl = kl_table(samples, generated, best_n)
    ppl = {
        pol: ev.perplexity(g["logp_base"], g["n_tokens"])
        for pol, g in samples.groupby("policy", sort=False)
    }
    out = rew[
        ["policy", "n_prompts", "n_clusters", "n_samples", "ave_r", "ci_low", "ci_high"]
    ].rename(columns={"ci_low": "ave_r_low", "ci_high": "ave_r_high"})
    out = out.merge(
        aud[["policy", "ave_r", "ci_low", "ci_high"]].rename(
            columns={"ave_r": "audit", "ci_low": "audit_low", "ci_high": "audit_high"}
        ),
        on="policy",
    )
    for measure, prefix in (("reward", "gain"), ("audit_reward", "audit_gain"), ("gap", "gap"),
                            ("reward_sd", "sd_gain")):  # fmt: skip
        p = paired[paired["measure"] == measure].set_index("policy")
        out[prefix] = out["policy"].map(p["mean_diff"])
        out[f"{prefix}_low"] = out["policy"].map(p["ci_low"])
        out[f"{prefix}_high"] = out["policy"].map(p["ci_high"])
        out[f"{prefix}_p_holm"] = out["policy"].map(p["p_wilcoxon_holm"])
    out = out.merge(kl[["policy", "kl", "kl_se", "kl_kind"]], on="policy", how="left")
    out["perplexity"] = out["policy"].map(ppl)
    fin = samples.dropna(subset=["finished"]).groupby("policy")["finished"].mean()
    out["finished"] = out["policy"].map(fin.astype(float))
    out = out.merge(text[["policy", "mean_words", "distinct_2", "rep_3"]], on="policy")
    out = out.merge(
        grd[["policy", "ave_r", "ci_low", "ci_high"]].rename(
            columns={"ave_r": "grounded_met", "ci_low": "grounded_low", "ci_high": "grounded_high"}
        ),
        on="policy",
        how="left",
    )
    out["max_sim"] = out["policy"].map(samples.groupby("policy")["max_sim"].mean())
    sd = ev.summarise_policies(with_sd, "reward_sd", **kw).set_index("policy") if len(with_sd) else None  # fmt: skip
    for col, src in (("reward_sd", "ave_r"), ("reward_sd_low", "ci_low"), ("reward_sd_high", "ci_high")):  # fmt: skip
        out[col] = out["policy"].map(sd[src]).astype(float) if sd is not None else math.nan
    return out, paired


def best_of_n_curve(pool: pd.DataFrame, ns: Sequence[int], n_boot: int, alpha: float,
                    seed: int, clusters: pd.Series | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:  # fmt: skip
    """Expected best-of-N reward per prompt for each N (order statistics over the pool), and the
    curve: Ave(R) with a bootstrap CI over prompts (or over `clusters`, a label per prompt_id)
    and KL at its upper bound log N - (N - 1) / N, per N."""
    per_prompt = pd.DataFrame(
        {n: pool.groupby("prompt_id")["reward"].apply(lambda v, n=n: ev.expected_max_of_n(v, n)) for n in ns}
    )  # fmt: skip
    rows = []
    for n in ns:
        ave, lo, hi = ev.bootstrap_ci(per_prompt[n], n_boot, alpha, seed,
                                      clusters=_clusters_of(per_prompt.index, clusters))  # fmt: skip
        rows.append({"algo": "best_of_n", "step": n, "reward": ave, "reward_low": lo, "reward_high": hi,
                     "audit_reward": np.nan, "kl": ev.best_of_n_kl_bound(n), "kl_se": 0.0,
                     "source": "best_of_n"})  # fmt: skip
    return per_prompt, pd.DataFrame(rows)


def _clusters_of(prompt_ids: pd.Index, clusters: pd.Series | None) -> np.ndarray | None:
    return None if clusters is None else clusters.loc[prompt_ids].to_numpy()


def versus_best_of_n(samples: pd.DataFrame, per_prompt_bon: pd.DataFrame, summary: pd.DataFrame,
                     algos: Sequence[str], n_boot: int, alpha: float, seed: int,
                     clusters: pd.Series | None = None) -> pd.DataFrame:  # fmt: skip
    """Each RL policy against the best-of-N curve at its own KL (the RLGF paper's Figure 2 test).

    The curve's reward at the policy's KL is interpolated linearly in KL between the two nearest
    N (per prompt); beyond the largest N the largest N is used and `beyond_curve` says so. The
    difference is averaged over prompts and bootstrapped over prompts (or `clusters` of them).
    """
    ns = sorted(per_prompt_bon.columns)
    kls = np.array([ev.best_of_n_kl_bound(n) for n in ns])
    rows = []
    for algo in algos:
        r = summary.set_index("policy").loc[algo]
        kl = float(max(r["kl"], 0.0))
        j = int(np.searchsorted(kls, kl))
        if j == 0:
            curve = per_prompt_bon[ns[0]]
        elif j >= len(ns):
            curve = per_prompt_bon[ns[-1]]
        else:
            w = (kl - kls[j - 1]) / (kls[j] - kls[j - 1])
            curve = (1 - w) * per_prompt_bon[ns[j - 1]] + w * per_prompt_bon[ns[j]]
        own = samples[samples["policy"] == algo].groupby("prompt_id")["reward"].mean()
        diff = (own - curve).dropna()
        d, lo, hi = ev.bootstrap_ci(diff, n_boot, alpha, seed,
                                    clusters=_clusters_of(diff.index, clusters))  # fmt: skip
        rows.append({"policy": algo, "kl": kl, "ave_r": float(own.mean()),
                     "best_of_n_at_kl": float(curve.loc[diff.index].mean()),
                     "best_of_n_kl": float(min(kl, kls[-1])), "diff": d,
                     "diff_low": lo, "diff_high": hi, "beyond_curve": bool(j >= len(ns)),
                     "verdict": "above" if lo > 0 else ("below" if hi < 0 else "not distinguishable")})  # fmt: skip
    return pd.DataFrame(rows)


# ---------------------------------------------------------------------------------------------
# Figures
# ---------------------------------------------------------------------------------------------


def _ci_err(df: pd.DataFrame, mid: str, low: str, high: str) -> np.ndarray:
    return np.vstack([df[mid] - df[low], df[high] - df[mid]]).clip(min=0)


def plot_distributions(samples: pd.DataFrame, order: Sequence[str]) -> Any:
    """Reward and audit reward per policy (box plots over responses)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for ax, col, title in (
        (axes[0], "reward", "Reward model"),
        (axes[1], "audit_reward", "Audit (TF-IDF LR, disjoint rows)"),
    ):
        data = [samples.loc[samples["policy"] == p, col].dropna().to_numpy() for p in order]
        ax.boxplot(data, showmeans=True)
        ax.set_xticks(range(1, len(order) + 1), order, rotation=30, ha="right")
        ax.set(title=title, ylabel="P(MET)" if col == "reward" else None)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def plot_gains(summary: pd.DataFrame, start: str = "base", alpha: float = 0.05) -> Any:
    """Gain over the start policy under the training reward and the audit reward, with CIs."""
    import matplotlib.pyplot as plt

    s = summary[summary["policy"] != start].reset_index(drop=True)
    x = np.arange(len(s))
    fig, ax = plt.subplots(figsize=(8, 3.6))
    ax.bar(
        x - 0.2,
        s["gain"],
        0.4,
        yerr=_ci_err(s, "gain", "gain_low", "gain_high"),
        label="reward model",
        capsize=3,
    )
    ax.bar(x + 0.2, s["audit_gain"], 0.4, yerr=_ci_err(s, "audit_gain", "audit_gain_low", "audit_gain_high"), label="audit model", capsize=3)  # fmt: skip
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xticks(x, s["policy"], rotation=20, ha="right")
    ax.set(
        ylabel=f"mean P(MET) minus {start}",
        title=f"Gain over the starting policy ({ev.level(alpha)} CI, countries resampled)",
    )
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def plot_reward_uncertainty(summary: pd.DataFrame, start: str = "base", alpha: float = 0.05) -> Any:
    """Ave(R) against the mean SD of the reward heads' P(MET) per policy, with CI bars on both.

    A policy to the right of its start moved into text the reward model is less sure about, so
    its Ave(R) rests on extrapolation; without heads (TF-IDF reward, `reward_heads: 0`) the
    figure says so.
    """
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.4))
    s = (
        summary.dropna(subset=["reward_sd"]).reset_index(drop=True)
        if "reward_sd" in summary
        else summary.iloc[:0]
    )
    if s.empty:
        ax.axis("off")
        ax.text(0.5, 0.5, "No reward uncertainty in this run: the reward source has no encoder\n"
                "features or evaluation.reward_heads is 0.", ha="center", va="center")  # fmt: skip
        return fig
    for r in s.itertuples():
        one = s[s["policy"] == r.policy]
        ax.errorbar(one["reward_sd"], one["ave_r"],
                    xerr=_ci_err(one, "reward_sd", "reward_sd_low", "reward_sd_high"),
                    yerr=_ci_err(one, "ave_r", "ave_r_low", "ave_r_high"),
                    fmt="s" if r.policy == start else "o", color="black" if r.policy == start else None,
                    capsize=3, label=algorithm_label(r.policy))  # fmt: skip
        ax.annotate(algorithm_label(r.policy), (r.reward_sd, r.ave_r), fontsize=7, xytext=(4, 4),
                    textcoords="offset points")  # fmt: skip
    ax.set(xlabel="mean SD of P(MET) across the reward heads (epistemic)",
           ylabel="Ave(R) on held-out prompts",
           title=f"Reward and the reward model's uncertainty ({ev.level(alpha)} CIs, countries resampled)")  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig


def plot_frontier(frontier: pd.DataFrame, start: str = "base", alpha: float = 0.05) -> Any:
    """Reward against KL to the start policy: each algorithm's snapshots and final policy, and the
    best-of-N curve from the start policy (RLGF paper, Figure 2).

    Each algorithm's line starts at the start policy (step 0); bars are CIs over countries, so a
    rise smaller than them is not evidence of alignment. Best-of-N sits at its KL upper bound.
    """
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.4))
    origin = frontier[(frontier["algo"] == start) & (frontier["step"] == 0)]
    ax.plot(origin["kl"], origin["reward"], "ks", label=f"start ({start})")
    bon = frontier[frontier["algo"] == "best_of_n"].sort_values("step")
    if not bon.empty:
        ax.errorbar(bon["kl"], bon["reward"], yerr=_ci_err(bon, "reward", "reward_low", "reward_high"),
                    fmt="--", color="gray", capsize=2, label="best-of-N (KL upper bound)")  # fmt: skip
        for r in bon.itertuples():
            ax.annotate(f"N={r.step}", (r.kl, r.reward), fontsize=7, color="gray", xytext=(3, -10),
                        textcoords="offset points")  # fmt: skip
    others = frontier[
        ~frontier["algo"].isin([start, "best_of_n"]) & (frontier["source"] != "reference")
    ]
    for algo, g in others.groupby("algo", sort=False):
        g = pd.concat([origin, g]).sort_values("step")
        err = _ci_err(
            g.fillna({"reward_low": g["reward"], "reward_high": g["reward"]}),
            "reward",
            "reward_low",
            "reward_high",
        )
        ax.errorbar(
            g["kl"], g["reward"], yerr=err, fmt="-o", capsize=3, label=algorithm_label(algo)
        )
        for r in g.itertuples():
            ax.annotate(
                str(r.step), (r.kl, r.reward), fontsize=7, xytext=(4, 4), textcoords="offset points"
            )
    xlabel = f"KL(policy || {start}), nats per response"
    kl = frontier["kl"].dropna()
    if len(kl) and kl.max() > 10 * max(bon["kl"].max() if not bon.empty else 1.0, 1.0):
        # policies that drifted far would squeeze best-of-N and the close ones into one corner
        ax.set_xscale("symlog", linthresh=1.0)
        xlabel += " (linear below 1, log above)"
    ax.set(xlabel=xlabel, ylabel="Ave(R) on held-out prompts")
    ax.set_title(f"Reward-KL frontier (labels: training step or N; bars: {ev.level(alpha)} CI)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_heldout_perplexity(ppl: pd.DataFrame) -> Any:
    """Perplexity of held-out historical MET and Non-MET descriptions under each policy (log scale)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.4))
    x = np.arange(len(ppl))
    ax.bar(x - 0.2, ppl["ppl_met"], 0.4, label="MET descriptions")
    ax.bar(x + 0.2, ppl["ppl_nonmet"], 0.4, label="Non-MET descriptions")
    ax.set_yscale("log")
    ax.set_xticks(x, ppl["policy"], rotation=20, ha="right")
    ax.set(ylabel="perplexity per token (log scale)",
           title="Held-out historical descriptions under each policy")  # fmt: skip
    ax.grid(axis="y", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def plot_grounding(summary: pd.DataFrame) -> Any:
    """Similarity-weighted MET rate of each policy's nearest historical conditions, and novelty."""
    import matplotlib.pyplot as plt

    s = summary.dropna(subset=["grounded_met"]).reset_index(drop=True)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    x = np.arange(len(s))
    axes[0].bar(
        x,
        s["grounded_met"],
        yerr=_ci_err(s, "grounded_met", "grounded_low", "grounded_high"),
        capsize=3,
    )
    axes[0].set(title="MET rate of nearest historical conditions", ylabel="weighted MET rate")
    axes[1].bar(x, s["max_sim"], color="tab:gray")
    axes[1].set(title="Similarity to the closest historical condition", ylabel="cosine (MiniLM)")
    for ax in axes:
        ax.set_xticks(x, s["policy"], rotation=30, ha="right")
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------------
# The stage
# ---------------------------------------------------------------------------------------------


def _score(
    samples: pd.DataFrame, contexts: Sequence[Mapping[str, Any]], model: Any, batch: int
) -> np.ndarray:
    ctx = response_contexts(samples["prompt_id"], contexts)
    return np.asarray(model.score(ctx, samples["response"].tolist(), batch_size=batch), dtype=float)


def _ground(
    index: ev.HistoricalIndex, df: pd.DataFrame, k: int, arrangements: Sequence[str] | None = None
) -> pd.DataFrame:
    """Grounding columns; a historical row's neighbours exclude itself and, given `arrangements`
    (one per index row), every row of its own arrangement."""
    cols = ["grounded_met_rate", "max_sim", "novelty", "top_area"]
    hist = (
        df["hist_idx"].fillna(-1).astype(int).to_numpy()
        if "hist_idx" in df
        else np.full(len(df), -1)
    )
    out = pd.DataFrame(index=df.index, columns=cols, dtype=object)
    gen = hist < 0
    if gen.any():
        g = index.ground(df.loc[gen, "response"].tolist(), k)
        out.loc[gen, cols] = g[cols].to_numpy()
    if (~gen).any():
        h = hist[~gen]
        qg = None if arrangements is None else [arrangements[i] for i in h]
        g = index.ground_embeddings(index.embeddings[h], k, exclude=h, groups=arrangements,
                                    query_groups=qg)  # fmt: skip
        out.loc[~gen, cols] = g[cols].to_numpy()
    for c in ("grounded_met_rate", "max_sim", "novelty"):
        out[c] = out[c].astype(float)
    return out


def frontier_points(
    pset: PolicySet,
    run: RunDir,
    prompts: Sequence[str],
    contexts: Sequence[Mapping[str, Any]],
    reward_model: Any,
    audit_model: Any,
    cfg: Any,
    progress: bool = True,
) -> pd.DataFrame:
    """Reward, audit reward and KL of every algorithm's snapshots (evenly thinned to the
    configured count); the final policies are measured with the full sample count elsewhere."""
    ec, rl = cfg.evaluation, cfg.rl
    rows = []
    for algo in pset.algos:
        snaps = [
            path
            for path in sorted(
                run.path(f"policy/{algo}/snapshots").glob("step_*/adapter_model.safetensors")
            )
            if int(path.parent.name.split("_")[1]) < rl.steps  # the final policy is measured apart
        ]
        if ec.frontier_max_checkpoints and len(snaps) > ec.frontier_max_checkpoints:
            keep = np.linspace(0, len(snaps) - 1, ec.frontier_max_checkpoints).round().astype(int)
            snaps = [snaps[i] for i in sorted(set(keep))]
        for path in snaps:
            step = int(path.parent.name.split("_")[1])
            name = pset.load_snapshot(algo, path)
            df = sample_tuned(pset, name, prompts, ec.frontier_samples_per_prompt, sampling_kwargs(cfg, progress),
                              ec.logprob_batch_size, desc=f"{algo} step {step}", judges=False)  # fmt: skip
            with pset.reference() as ref:
                df["logp_ref"] = _logprobs(ref, pset.tok, df, ec.logprob_batch_size)
            add_rewards(df, contexts, reward_model, audit_model, rl.reward_batch_size)
            per = df.groupby("prompt_id")["reward"].mean()
            ave, lo, hi = ev.bootstrap_ci(per, ec.n_boot, ec.alpha, cfg.run.seed,
                                          clusters=[contexts[i]["country"] for i in per.index])  # fmt: skip
            kl = ev.kl_estimate(df["logp_policy"], df["logp_ref"], df["n_tokens"])
            rows.append({"algo": algo, "step": step, "reward": ave, "reward_low": lo, "reward_high": hi,
                         "audit_reward": df["audit_reward"].mean(), "kl": kl["kl"], "kl_se": kl["kl_se"],
                         "source": "snapshot"})  # fmt: skip
    return pd.DataFrame(rows)


def table3(pset: PolicySet, contexts: Sequence[Mapping[str, Any]], labelled: pd.DataFrame,
           reward_model: Any, audit_model: Any, cfg: Any) -> pd.DataFrame:  # fmt: skip
    """The paper's Table 3: its completion prompts for held-out countries, pre- and post-RL."""
    ec, rl = cfg.evaluation, cfg.rl
    counts = pd.Series([c["country"] for c in contexts]).value_counts(sort=False)
    countries = (
        counts.rename_axis("country").reset_index(name="n")
        .sort_values(["n", "country"], ascending=[False, True])["country"].head(ec.table3_countries).tolist()
    )  # fmt: skip
    arrangement = labelled.groupby("country")["arrangement_type"].agg(
        lambda s: s.value_counts().index[0]
    )
    items = [(c, sc) for c in countries for sc in ec.table3_scenarios]
    prompts = [sc.prompt.format(country=display_country(c)) for c, sc in items]
    ctx = [
        {"country": c, "arrangement_type": arrangement[c], "econ_descriptor": sc.econ_descriptor}
        for c, sc in items
    ]
    rows = []
    for name in pset.names:
        df = pset.generate(name, prompts, 1, f"Table 3 {name}", sampling_kwargs(cfg, False))
        r = reward_model.score(ctx, df["response"].tolist(), batch_size=rl.reward_batch_size)
        a = audit_model.score(ctx, df["response"].tolist())
        for (c, sc), p, text, rr, aa in zip(items, prompts, df["response"], r, a, strict=True):
            rows.append({"country": c, "econ_descriptor": sc.econ_descriptor, "prompt": p, "policy": name,
                         "response": text, "reward": float(rr), "audit_reward": float(aa)})  # fmt: skip
    return pd.DataFrame(rows)


def heldout_perplexity(pset: PolicySet, rows: pd.DataFrame, template: str, cfg: Any,
                       batch: int) -> tuple[pd.DataFrame, pd.DataFrame]:  # fmt: skip
    """Perplexity of held-out historical descriptions (+ end token) after their context's RL
    prompt, under every generated policy: MET and Non-MET rows separately, and all together;
    and per row and policy (`row`, `country`, `y`, `nll` summed over its `n_tokens`), for
    per-country intervals (the population cross-entropy of the ILHF comparison).

    The rows are of held-out (eval) countries, which neither SFT nor RL saw; a policy that writes
    MONA conditions finds them far likelier than the zero-shot base does.
    """
    prompts = build_prompts(rows.to_dict("records"), pset.tok, template, cfg.policy)
    texts = [" ".join(str(t).split()) for t in rows["description"]]
    y = rows["y"].to_numpy()
    out, per_row = [], []
    for name in pset.names:
        lp, n = pset.sequence_logprobs(name, prompts, texts, batch, append_eos=True,
                                       padding_side="left")  # fmt: skip
        per_row.append(pd.DataFrame({"policy": name, "row": np.arange(len(rows)),
                                     "country": rows["country"].astype(str).to_numpy(), "y": y,
                                     "nll": -np.asarray(lp, float), "n_tokens": n}))  # fmt: skip
        rec = {"policy": name, "rows": len(rows)}
        for label, sel in (("met", y == 1), ("nonmet", y == 0), ("all", np.ones_like(y, bool))):
            rec[f"ppl_{label}"] = ev.perplexity(lp[sel], n[sel]) if sel.any() else math.nan
            rec[f"nll_{label}"] = float(-lp[sel].sum() / n[sel].sum()) if sel.any() else math.nan
        out.append(rec)
    return pd.DataFrame(out), pd.concat(per_row, ignore_index=True)


def run_evaluation_stage(cfg: Any, run: RunDir, progress: bool = True) -> EvalStage:
    """Generate, score, ground and compare every policy on the held-out contexts; write it all."""
    from .data import load_holdout, load_splits
    from .reward import load_reward

    ec, rl = cfg.evaluation, cfg.rl
    if ec.num_threads is not None:
        torch.set_num_threads(ec.num_threads)
    timer = PhaseTimer("evaluation")
    with timer("loading"):
        contexts = load_contexts(run.root, "eval", ec.max_prompts, cfg.run.seed)
        reward_model, audit_model = load_reward(
            run.require("reward_model", stage="notebook 02 (reward model)")
        )
        if audit_model is None:
            raise ArtifactMissing(f"{run.path('reward_model')}: no audit model; rerun notebook 02")
        heads = reward_uncertainty.fit_or_load(run, cfg, reward_model)  # None: no reward_sd
        labelled, _ = load_splits(run)
        labelled = labelled.reset_index(drop=True)
        algos = list(rl.algorithm)
        pset = PolicySet(cfg, run, algos)
    start = pset.start_name
    prompts = build_prompts(contexts, pset.tok, rl.prompt_template, cfg.policy)
    gen_kw = sampling_kwargs(cfg, progress)
    k = ec.samples_per_prompt
    frames = []
    for name in pset.names:
        with timer(f"samples {name}"):
            frames.append(sample_tuned(pset, name, prompts, k, gen_kw, ec.logprob_batch_size,
                                       desc=name).assign(policy=name))  # fmt: skip
    with timer("rewards"):
        gen = add_rewards(pd.concat(frames, ignore_index=True), contexts, reward_model,
                          audit_model, rl.reward_batch_size, heads)  # fmt: skip
    # Best-of-N candidates: a separate draw from the start policy (another seed), so best-of-N is
    # never compared with the very samples it was selected from.
    with timer("best-of-N pool"):
        n_pool = max(max(ec.best_of_n_curve), ec.best_of_n)
        pool = best_of_n_pool(pset, prompts, n_pool, gen_kw, ec.logprob_batch_size)
        add_rewards(pool, contexts, reward_model, audit_model, rl.reward_batch_size, heads)
        best = ev.best_of_n_frame(pool[pool["sample_id"] < ec.best_of_n], "reward", ("prompt_id",))
        best = best.assign(policy="best_of_n", sample_id=0)
        add_judge_logprobs(pset, best, start, ec.logprob_batch_size)
    best["logp_policy"] = np.nan  # best-of-N has no tractable density; its KL is bounded above
    gen = pd.concat([gen, best], ignore_index=True)

    with timer("history references"):
        holdout = load_holdout(run)
        hist = history_references(labelled, contexts, k, cfg.run.seed, holdout["reference"])
        with pset.use("base") as m:
            lp, n_tok = ev.sequence_logprobs(
                m, pset.tok, [prompts[i] for i in hist["prompt_id"]], hist["response"].tolist(),
                batch_size=ec.logprob_batch_size, append_eos=True, padding_side="left",
            )  # fmt: skip
        hist["logp_base"], hist["n_tokens"] = lp, n_tok
        hist["logp_policy"] = hist["logp_ref"] = np.nan
        add_rewards(hist, contexts, reward_model, audit_model, rl.reward_batch_size, heads)

    samples = pd.concat([gen, hist], ignore_index=True)
    with timer("grounding"):
        encoder = ev.minilm_encoder(str(pset.base.device))  # grounding, and ILHF's similarity
        index = ev.HistoricalIndex.load_or_build(
            run.path("eval/historical_index"), labelled["description"].astype(str).tolist(),
            labelled["y"].to_numpy(), labelled["econ_area"].astype(str).tolist(), encoder,
        )  # fmt: skip
        samples[["grounded_met_rate", "max_sim", "novelty", "top_area"]] = _ground(
            index, samples, ec.grounding_k, labelled["arrangement_id"].astype(str).tolist()
        )
    for key in (*_CTX_KEYS, "econ_area"):
        samples[key] = [contexts[i][key] for i in samples["prompt_id"]]
    order = [*pset.names, "best_of_n", *HISTORY_POLICIES]
    samples["policy"] = pd.Categorical(samples["policy"], categories=order, ordered=True)
    samples = samples.sort_values(["policy", "prompt_id", "sample_id"]).reset_index(drop=True)
    samples["policy"] = samples["policy"].astype(str)

    with timer("statistics"):
        summary, paired = summary_table(samples, pset.names, start, ec.best_of_n, ec.n_boot,
                                        ec.alpha, cfg.run.seed)  # fmt: skip
        country = pd.Series([c["country"] for c in contexts])  # the bootstrap's cluster, per prompt
        per_prompt_bon, curve = best_of_n_curve(pool, sorted(set(ec.best_of_n_curve)), ec.n_boot,
                                                ec.alpha, cfg.run.seed, country)  # fmt: skip
        vs_bon = versus_best_of_n(
            samples, per_prompt_bon, summary, algos, ec.n_boot, ec.alpha, cfg.run.seed, country
        )
    final = []
    for name in pset.names:
        r = summary[summary.policy == name].iloc[0]
        final.append({"algo": name, "step": rl.steps if name in algos else 0, "reward": r["ave_r"],
                      "reward_low": r["ave_r_low"], "reward_high": r["ave_r_high"], "audit_reward": r["audit"],
                      "kl": r["kl"], "kl_se": r["kl_se"],
                      "source": "final" if name in algos or name == start else "reference"})  # fmt: skip
    with timer("frontier snapshots"):
        snaps = (
            frontier_points(pset, run, prompts, contexts, reward_model, audit_model, cfg, progress)
            if ec.frontier
            else pd.DataFrame()
        )
    frontier = pd.concat([pd.DataFrame(final), snaps, curve], ignore_index=True)
    with timer("held-out perplexity"):
        held = heldout_rows(
            labelled, run.read_parquet("data/contexts.parquet"), ec.heldout_rows, cfg.run.seed
        )
        ppl, ppl_rows = heldout_perplexity(
            pset, held, rl.prompt_template, cfg, ec.logprob_batch_size
        )
    with timer("table 3"):
        t3 = table3(pset, contexts, labelled, reward_model, audit_model, cfg)
    with timer("RLGF and ILHF tables"):
        extra = {
            "eval_vs_best_of_n": vs_bon,
            "eval_heldout_perplexity": ppl,
            "eval_heldout_nll_rows": ppl_rows,
            "eval_best_of_n_curve": curve,
            # the RLGF paper's table, easy vs hard prompts and the guidance verdicts (rlgf_eval)
            **rlgf_eval.rlgf_tables(
                samples, summary, ppl, labelled, algos, start, ec.n_boot, ec.alpha, cfg.run.seed
            ),  # fmt: skip
            # the ILHF paper's questions: variety and closeness to the population, at what reward
            **ilhf_eval.ilhf_tables(
                samples, summary, ppl_rows, algos, start, ec.n_boot, ec.alpha, cfg.run.seed, encoder
            ),  # fmt: skip
        }
    with timer("writing"):
        stage = _write(run, samples, summary, paired, frontier, t3, algos, order, cfg, start,
                       extra, timer.seconds)  # fmt: skip
    return stage


def _write(run: RunDir, samples: pd.DataFrame, summary: pd.DataFrame, paired: pd.DataFrame,
           frontier: pd.DataFrame, t3: pd.DataFrame, algos: list[str], order: list[str], cfg: Any,
           start: str, extra: dict[str, pd.DataFrame],
           seconds: Mapping[str, float] | None = None) -> EvalStage:  # fmt: skip
    import matplotlib.pyplot as plt

    keep = [c for c in samples.columns if c not in ("prompt_ids", "response_ids")]
    run.write_parquet("eval/samples.parquet", samples[keep])
    run.write_jsonl("eval/samples.jsonl", samples[keep].to_dict("records"))
    run.write_parquet("eval/frontier.parquet", frontier)
    run.write_parquet("eval/heldout_perplexity.parquet", extra["eval_heldout_perplexity"])
    run.write_parquet("eval/heldout_nll_rows.parquet", extra.pop("eval_heldout_nll_rows"))
    shown = (
        samples[samples["sample_id"] == 0]
        .groupby("policy", sort=False)
        .head(cfg.evaluation.show_samples)[["policy", "country", "econ_descriptor", "response", "reward", "audit_reward"]]
    )  # fmt: skip
    hacking = summary.loc[
        summary["policy"].isin([*algos, "sft_met", "best_of_n"]),
        ["policy", "gain", "gain_low", "gain_high", "audit_gain", "audit_gain_low",
         "audit_gain_high", "gap", "gap_low", "gap_high", "gap_p_holm"],
    ].copy()  # fmt: skip
    tables = {
        "eval_summary": summary,
        "eval_paired": paired[
            [
                "measure",
                "policy",
                "vs",
                "n",
                "n_clusters",
                "mean_a",
                "mean_b",
                "mean_diff",
                "ci_low",
                "ci_high",
                "cohens_dz",
                "rank_biserial",
                "p_ttest",
                "p_ttest_holm",
                "p_wilcoxon",
                "p_wilcoxon_holm",
            ]
        ],  # fmt: skip
        "eval_hacking_gap": hacking,
        "eval_frontier": frontier,
        "eval_table3": t3,
        "eval_samples_shown": shown,
        **extra,
    }
    for name, df in tables.items():
        run.write_table(name, df)
    for name, fig in (
        ("eval_reward_distributions", plot_distributions(samples, order)),
        ("eval_gains", plot_gains(summary, start, cfg.evaluation.alpha)),
        ("eval_reward_uncertainty", plot_reward_uncertainty(summary, start, cfg.evaluation.alpha)),
        ("eval_frontier", plot_frontier(frontier, start, cfg.evaluation.alpha)),
        ("eval_heldout_perplexity", plot_heldout_perplexity(extra["eval_heldout_perplexity"])),
        ("eval_grounding", plot_grounding(summary)),
        *rlgf_eval.rlgf_figures(extra, start, cfg.evaluation.alpha).items(),
        *ilhf_eval.ilhf_figures(extra, start, cfg.evaluation.alpha).items(),
    ):
        run.write_figure(name, fig)
        plt.close(fig)
    rec = summary.set_index("policy")
    run.write_json(
        "eval/summary.json",
        {
            "algorithms": algos,
            "start_policy": start,
            "policies": [p for p in order if p in set(samples["policy"])],
            "best_of_n_curve": sorted(set(cfg.evaluation.best_of_n_curve)),
            "vs_best_of_n": extra["eval_vs_best_of_n"].to_dict("records"),
            "heldout_perplexity": extra["eval_heldout_perplexity"].to_dict("records"),
            "n_prompts": int(samples.loc[samples.policy == "base", "prompt_id"].nunique()),
            "samples_per_prompt": cfg.evaluation.samples_per_prompt,
            "best_of_n": cfg.evaluation.best_of_n,
            "alpha": cfg.evaluation.alpha,
            "cluster": "country",
            "history_contrast": history_contrast(
                samples, cfg.evaluation.n_boot, cfg.evaluation.alpha, cfg.run.seed
            ),
            "reference_rows": int(samples["hist_idx"].notna().sum()),
            "summary": rec.reset_index().to_dict("records"),
            "seconds": dict(seconds or {}),  # wall time per phase, up to this write
        },
    )
    return EvalStage(samples, summary, paired, frontier, t3, algos, tables)
