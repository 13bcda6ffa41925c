"""The alignment-evaluation stage (notebook 04): every policy on the held-out contexts, measured.

Policies: `base` (the starting policy), each trained algorithm (`ppo`, `grpo`, `rloo`; its
LoRA adapter on the same base weights), `best_of_n` (N base samples per prompt, the reward model
keeps one), and three references drawn from history for the same contexts: real MET
descriptions (`history_met`), real Non-MET descriptions (`history_nonmet`) and the paper's
`random_policy` (real descriptions drawn at random, whatever their context).

One base model is loaded; adapters are switched on it, and the reference log-probabilities come
from the same weights with adapters disabled. Every generated policy uses the same prompts,
sampling settings and seed. Written to the run dir:

* `eval/samples.parquet` and `eval/samples.jsonl`: one row per response (context, text, reward,
  audit reward, log-probs under policy and reference, grounding);
* `eval/frontier.parquet`: reward, audit reward and KL of every PPO snapshot and final policy;
* `eval/historical_index/`: MiniLM embeddings of every labelled MONA description (cached);
* `eval/summary.json` and tables `eval_*`, figures `eval_*`.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from . import evaluation as ev
from .artifacts import ArtifactMissing, RunDir
from .models import build_prompts, display_country, generate, load_policy
from .reward import _device
from .rl import _CTX_KEYS, load_contexts

log = logging.getLogger(__name__)

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


def _logprobs(model: Any, tok: Any, df: pd.DataFrame, batch_size: int) -> np.ndarray:
    lp, _ = ev.sequence_logprobs(
        model, tok, df["prompt_ids"].tolist(), df["response_ids"].tolist(),
        batch_size=batch_size, padding_side="left",
    )  # fmt: skip
    return lp


class PolicySet:
    """The base policy with every trained adapter loaded beside it; one set of base weights."""

    def __init__(self, cfg: Any, run: RunDir, algos: Sequence[str]):
        # the accelerator when there is one (paper profile: a 7B policy in bf16 on a GPU)
        self.base, self.tok = load_policy(cfg.policy, device=_device(None))
        self.model: Any = self.base
        self.algos = list(algos)
        for algo in self.algos:
            path = run.require(f"policy/{algo}/adapter", stage=f"notebook 03 ({algo.upper()})")
            if not (path / "adapter_config.json").is_file():
                raise ArtifactMissing(f"{path}: no adapter_config.json; notebook 03 did not finish")
            from peft import PeftModel

            if self.model is self.base:
                self.model = PeftModel.from_pretrained(self.base, str(path), adapter_name=algo)
            else:
                self.model.load_adapter(str(path), adapter_name=algo)
        self.model.eval()

    @contextlib.contextmanager
    def use(self, name: str) -> Iterator[Any]:
        """Context manager yielding the model acting as policy `name` ('base': adapters off)."""
        if name == "base":
            if self.model is self.base:
                yield self.model
            else:
                with self.model.disable_adapter():
                    yield self.model
            return
        self.model.set_adapter(name)
        yield self.model

    def reference(self) -> Any:
        return self.use("base")

    def load_snapshot(self, algo: str, weights: Path) -> str:
        """Load a PPO snapshot's adapter weights as adapter 'snapshot' (same config as `algo`)."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        if "snapshot" not in self.model.peft_config:
            self.model.add_adapter("snapshot", self.model.peft_config[algo])
        set_peft_model_state_dict(self.model, load_file(str(weights)), adapter_name="snapshot")
        return "snapshot"


def sampling_kwargs(cfg: Any, progress: bool = True) -> dict[str, Any]:
    """The sampling settings every evaluated policy shares (those of RL, one seed)."""
    rl = cfg.rl
    return dict(max_new_tokens=rl.max_new_tokens, temperature=rl.temperature, top_p=rl.top_p,
                postprocess=rl.response_postprocess, seed=cfg.run.seed,
                batch_size=cfg.evaluation.batch_size, progress=progress)  # fmt: skip


def sample_tuned(pset: PolicySet, name: str, prompts: Sequence[str], k: int, gen_kw: Mapping[str, Any],
                 logprob_batch: int, desc: str) -> pd.DataFrame:  # fmt: skip
    """k responses per prompt from adapter `name`, with their log-probs under it and the reference."""
    with pset.use(name) as m:
        df = generate(m, pset.tok, prompts, k, desc=desc, **gen_kw)
        df["logp_policy"] = _logprobs(m, pset.tok, df, logprob_batch)
    with pset.reference() as ref:
        df["logp_ref"] = _logprobs(ref, pset.tok, df, logprob_batch)
    return df


def add_rewards(df: pd.DataFrame, contexts: Sequence[Mapping[str, Any]], reward_model: Any,
                audit_model: Any, batch: int) -> pd.DataFrame:  # fmt: skip
    """Columns `reward` and `audit_reward`: each response scored in its prompt's context."""
    df["reward"] = _score(df, contexts, reward_model, batch)
    df["audit_reward"] = _score(df, contexts, audit_model, batch)
    return df


# ---------------------------------------------------------------------------------------------
# History references
# ---------------------------------------------------------------------------------------------


def history_references(
    labelled: pd.DataFrame, contexts: Sequence[Mapping[str, Any]], k: int, seed: int
) -> pd.DataFrame:
    """Real descriptions for each held-out context: MET, Non-MET (same context) and random.

    Up to k per prompt and kind, drawn without replacement (seeded); a context without MET (or
    Non-MET) history has no row of that kind, so paired tests use only prompts both sides have.
    `hist_idx` is the row's position in `labelled` (the grounding index order).
    """
    rng = np.random.default_rng(seed)
    lab = labelled.reset_index(drop=True)
    key = lab[list(_CTX_KEYS)].astype(str).agg("\x1f".join, axis=1)
    groups = {k_: np.asarray(v) for k_, v in lab.groupby(key).indices.items()}
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
        rand = rng.choice(len(lab), size=k, replace=False)
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


def kl_table(samples: pd.DataFrame, algos: Sequence[str], best_of_n: int) -> pd.DataFrame:
    """KL(policy || reference) per policy: Monte-Carlo for tuned policies, exact 0 for base,
    and for best-of-N the analytic bound log N - (N - 1) / N (Stiennon et al. 2020)."""
    rows = [{"policy": "base", "kl": 0.0, "kl_se": 0.0, "kl_per_token": 0.0, "kl_kind": "exact"}]
    for algo in algos:
        g = samples[samples["policy"] == algo]
        est = ev.kl_estimate(g["logp_policy"], g["logp_ref"], g["n_tokens"])
        rows.append({"policy": algo, **{k: est[k] for k in ("kl", "kl_se", "kl_per_token")}})
        rows[-1]["kl_kind"] = "sampled"
    bound = math.log(best_of_n) - (best_of_n - 1) / best_of_n
    rows.append({"policy": "best_of_n", "kl": bound, "kl_se": 0.0, "kl_kind": "analytic bound"})
    return pd.DataFrame(rows)


def summary_table(
    samples: pd.DataFrame, algos: Sequence[str], best_n: int, n_boot: int, alpha: float, seed: int
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(policy x measures with CIs, paired tests vs base for the reward and the audit reward)."""
    kw = dict(n_boot=n_boot, alpha=alpha, seed=seed)
    rew = ev.summarise_policies(samples, "reward", **kw)
    aud = ev.summarise_policies(samples, "audit_reward", **kw)
    grd = ev.summarise_policies(
        samples.dropna(subset=["grounded_met_rate"]), "grounded_met_rate", **kw
    )
    paired = pd.concat(
        [
            ev.paired_table(samples, "base", "reward", **kw).assign(measure="reward"),
            ev.paired_table(samples, "base", "audit_reward", **kw).assign(measure="audit_reward"),
        ],
        ignore_index=True,
    )
    text = ev.text_table(samples)
    kl = kl_table(samples, algos, best_n)
    ppl = {
        pol: ev.perplexity(g["logp_ref"], g["n_tokens"])
        for pol, g in samples.groupby("policy", sort=False)
    }
    out = rew[["policy", "n_prompts", "n_samples", "ave_r", "ci_low", "ci_high"]].rename(
        columns={"ci_low": "ave_r_low", "ci_high": "ave_r_high"}
    )
    out = out.merge(
        aud[["policy", "ave_r", "ci_low", "ci_high"]].rename(
            columns={"ave_r": "audit", "ci_low": "audit_low", "ci_high": "audit_high"}
        ),
        on="policy",
    )
    for measure, prefix in (("reward", "gain"), ("audit_reward", "audit_gain")):
        p = paired[paired["measure"] == measure].set_index("policy")
        out[prefix] = out["policy"].map(p["mean_diff"])
        out[f"{prefix}_low"] = out["policy"].map(p["ci_low"])
        out[f"{prefix}_high"] = out["policy"].map(p["ci_high"])
        out[f"{prefix}_p_holm"] = out["policy"].map(p["p_wilcoxon_holm"])
    out = out.merge(kl[["policy", "kl", "kl_se", "kl_kind"]], on="policy", how="left")
    out["perplexity"] = out["policy"].map(ppl)
    out = out.merge(text[["policy", "mean_words", "distinct_2", "rep_3"]], on="policy")
    out = out.merge(
        grd[["policy", "ave_r", "ci_low", "ci_high"]].rename(
            columns={"ave_r": "grounded_met", "ci_low": "grounded_low", "ci_high": "grounded_high"}
        ),
        on="policy",
        how="left",
    )
    out["max_sim"] = out["policy"].map(samples.groupby("policy")["max_sim"].mean())
    return out, paired


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
        (axes[1], "audit_reward", "Audit (TF-IDF LR)"),
    ):
        data = [samples.loc[samples["policy"] == p, col].dropna().to_numpy() for p in order]
        ax.boxplot(data, showmeans=True)
        ax.set_xticks(range(1, len(order) + 1), order, rotation=30, ha="right")
        ax.set(title=title, ylabel="P(MET)" if col == "reward" else None)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def plot_gains(summary: pd.DataFrame) -> Any:
    """Gain over base under the training reward and under the audit reward, with 95% CIs."""
    import matplotlib.pyplot as plt

    s = summary[summary["policy"] != "base"].reset_index(drop=True)
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
        ylabel="mean P(MET) minus base", title="Gain over the starting policy (95% CI over prompts)"
    )
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def plot_frontier(frontier: pd.DataFrame) -> Any:
    """Reward against KL to the reference: PPO snapshots along training and final policies.

    Each algorithm's line starts at the base policy (step 0, KL 0); bars are 95% CIs over prompts,
    so a rise smaller than them is not evidence of alignment.
    """
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    base = frontier[frontier["algo"] == "base"]
    ax.plot(base["kl"], base["reward"], "ks", label="base")
    for algo, g in frontier[frontier["algo"] != "base"].groupby("algo", sort=False):
        g = pd.concat([base, g]).sort_values("step")
        err = _ci_err(
            g.fillna({"reward_low": g["reward"], "reward_high": g["reward"]}),
            "reward",
            "reward_low",
            "reward_high",
        )
        ax.errorbar(g["kl"], g["reward"], yerr=err, fmt="-o", capsize=3, label=algo.upper())
        for r in g.itertuples():
            ax.annotate(
                str(r.step), (r.kl, r.reward), fontsize=7, xytext=(4, 4), textcoords="offset points"
            )
    ax.set(xlabel="KL(policy || reference), nats per response", ylabel="Ave(R) on held-out prompts")
    ax.set_title("Reward-KL frontier (labels: training step; bars: 95% CI)")
    ax.grid(alpha=0.3)
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
    ctx = [{k: contexts[i][k] for k in _CTX_KEYS} for i in samples["prompt_id"]]
    return np.asarray(model.score(ctx, samples["response"].tolist(), batch_size=batch), dtype=float)


def _ground(index: ev.HistoricalIndex, df: pd.DataFrame, k: int) -> pd.DataFrame:
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
        g = index.ground_embeddings(index.embeddings[h], k, exclude=h)
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
    """Reward, audit reward and KL of every PPO snapshot (evenly thinned to the configured count)."""
    ec, rl = cfg.evaluation, cfg.rl
    snaps = sorted(run.path("policy/ppo/snapshots").glob("step_*/adapter_model.safetensors"))
    if ec.frontier_max_checkpoints and len(snaps) > ec.frontier_max_checkpoints:
        keep = np.linspace(0, len(snaps) - 1, ec.frontier_max_checkpoints).round().astype(int)
        snaps = [snaps[i] for i in sorted(set(keep))]
    rows = []
    for path in snaps:
        step = int(path.parent.name.split("_")[1])
        if step >= rl.steps:  # the final policy is measured with the full sample count already
            continue
        name = pset.load_snapshot("ppo", path)
        df = sample_tuned(pset, name, prompts, ec.frontier_samples_per_prompt, sampling_kwargs(cfg, progress),
                          ec.logprob_batch_size, desc=f"PPO step {step}")  # fmt: skip
        add_rewards(df, contexts, reward_model, audit_model, rl.reward_batch_size)
        ave, lo, hi = ev.bootstrap_ci(
            df.groupby("prompt_id")["reward"].mean(), ec.n_boot, ec.alpha, cfg.run.seed
        )
        kl = ev.kl_estimate(df["logp_policy"], df["logp_ref"], df["n_tokens"])
        rows.append({"algo": "ppo", "step": step, "reward": ave, "reward_low": lo, "reward_high": hi,
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
    for name in ["base", *pset.algos]:
        with pset.use(name) as m:
            df = generate(
                m, pset.tok, prompts, 1, desc=f"Table 3 {name}", **sampling_kwargs(cfg, False)
            )
        r = reward_model.score(ctx, df["response"].tolist(), batch_size=rl.reward_batch_size)
        a = audit_model.score(ctx, df["response"].tolist())
        for (c, sc), p, text, rr, aa in zip(items, prompts, df["response"], r, a, strict=True):
            rows.append({"country": c, "econ_descriptor": sc.econ_descriptor, "prompt": p, "policy": name,
                         "response": text, "reward": float(rr), "audit_reward": float(aa)})  # fmt: skip
    return pd.DataFrame(rows)


def run_evaluation_stage(cfg: Any, run: RunDir, progress: bool = True) -> EvalStage:
    """Generate, score, ground and compare every policy on the held-out contexts; write it all."""
    from .data import load_splits
    from .reward import load_reward

    ec, rl = cfg.evaluation, cfg.rl
    if ec.num_threads is not None:
        torch.set_num_threads(ec.num_threads)
    contexts = load_contexts(run.root, "eval", ec.max_prompts, cfg.run.seed)
    reward_model, audit_model = load_reward(
        run.require("reward_model", stage="notebook 02 (reward model)")
    )
    if audit_model is None:
        raise ArtifactMissing(f"{run.path('reward_model')}: no audit model; rerun notebook 02")
    labelled, _ = load_splits(run)
    labelled = labelled.reset_index(drop=True)
    algos = list(rl.algorithm)
    pset = PolicySet(cfg, run, algos)
    prompts = build_prompts(contexts, pset.tok, rl.prompt_template, cfg.policy)
    gen_kw = sampling_kwargs(cfg, progress)
    k = ec.samples_per_prompt
    # base: max(k, N) samples; the first k are `base`, the first N feed best-of-N
    with pset.use("base") as m:
        base = generate(m, pset.tok, prompts, max(k, ec.best_of_n), desc="base", **gen_kw)
        base["logp_ref"] = _logprobs(m, pset.tok, base, ec.logprob_batch_size)
    base["logp_policy"] = base["logp_ref"]
    frames = [base.assign(policy="base")]
    for algo in algos:
        df = sample_tuned(pset, algo, prompts, k, gen_kw, ec.logprob_batch_size, desc=algo)
        frames.append(df.assign(policy=algo))
    gen = add_rewards(pd.concat(frames, ignore_index=True), contexts, reward_model, audit_model,
                      rl.reward_batch_size)  # fmt: skip
    pool = gen[(gen["policy"] == "base") & (gen["sample_id"] < ec.best_of_n)]
    best = ev.best_of_n_frame(pool, "reward", ("prompt_id",)).assign(
        policy="best_of_n", sample_id=0
    )
    best["logp_policy"] = np.nan  # best-of-N has no tractable density; its KL is bounded below
    gen = pd.concat(
        [gen[(gen["policy"] != "base") | (gen["sample_id"] < k)], best], ignore_index=True
    )

    hist = history_references(labelled, contexts, k, cfg.run.seed)
    with pset.reference() as ref:
        lp, n_tok = ev.sequence_logprobs(
            ref, pset.tok, [prompts[i] for i in hist["prompt_id"]], hist["response"].tolist(),
            batch_size=ec.logprob_batch_size, append_eos=True, padding_side="left",
        )  # fmt: skip
    hist["logp_ref"], hist["n_tokens"], hist["logp_policy"] = lp, n_tok, np.nan
    add_rewards(hist, contexts, reward_model, audit_model, rl.reward_batch_size)

    samples = pd.concat([gen, hist], ignore_index=True)
    index = ev.HistoricalIndex.load_or_build(
        run.path("eval/historical_index"), labelled["description"].astype(str).tolist(),
        labelled["y"].to_numpy(), labelled["econ_area"].astype(str).tolist(), ev.minilm_encoder(str(pset.base.device)),
    )  # fmt: skip
    samples[["grounded_met_rate", "max_sim", "novelty", "top_area"]] = _ground(
        index, samples, ec.grounding_k
    )
    for key in (*_CTX_KEYS, "econ_area"):
        samples[key] = [contexts[i][key] for i in samples["prompt_id"]]
    order = ["base", *algos, "best_of_n", *HISTORY_POLICIES]
    samples["policy"] = pd.Categorical(samples["policy"], categories=order, ordered=True)
    samples = samples.sort_values(["policy", "prompt_id", "sample_id"]).reset_index(drop=True)
    samples["policy"] = samples["policy"].astype(str)

    summary, paired = summary_table(samples, algos, ec.best_of_n, ec.n_boot, ec.alpha, cfg.run.seed)
    final = []
    for algo in ["base", *algos]:
        r = summary[summary.policy == algo].iloc[0]
        final.append({"algo": algo, "step": 0 if algo == "base" else rl.steps, "reward": r["ave_r"],
                      "reward_low": r["ave_r_low"], "reward_high": r["ave_r_high"], "audit_reward": r["audit"],
                      "kl": r["kl"], "kl_se": r["kl_se"], "source": "final"})  # fmt: skip
    snaps = (
        frontier_points(pset, run, prompts, contexts, reward_model, audit_model, cfg, progress)
        if ec.frontier and "ppo" in algos
        else pd.DataFrame()
    )
    frontier = pd.concat([pd.DataFrame(final), snaps], ignore_index=True)
    t3 = table3(pset, contexts, labelled, reward_model, audit_model, cfg)
    stage = _write(run, samples, summary, paired, frontier, t3, algos, order, cfg)
    return stage


def _write(run: RunDir, samples: pd.DataFrame, summary: pd.DataFrame, paired: pd.DataFrame,
           frontier: pd.DataFrame, t3: pd.DataFrame, algos: list[str], order: list[str], cfg: Any) -> EvalStage:  # fmt: skip
    import matplotlib.pyplot as plt

    keep = [c for c in samples.columns if c not in ("prompt_ids", "response_ids")]
    run.write_parquet("eval/samples.parquet", samples[keep])
    run.write_jsonl("eval/samples.jsonl", samples[keep].to_dict("records"))
    run.write_parquet("eval/frontier.parquet", frontier)
    shown = (
        samples[samples["sample_id"] == 0]
        .groupby("policy", sort=False)
        .head(cfg.evaluation.show_samples)[["policy", "country", "econ_descriptor", "response", "reward", "audit_reward"]]
    )  # fmt: skip
    hacking = summary.loc[
        summary["policy"].isin(algos + ["best_of_n"]), ["policy", "gain", "audit_gain"]
    ].copy()
    hacking["gap"] = hacking["gain"] - hacking["audit_gain"]
    tables = {
        "eval_summary": summary,
        "eval_paired": paired[
            [
                "measure",
                "policy",
                "vs",
                "n",
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
    }
    for name, df in tables.items():
        run.write_table(name, df)
    for name, fig in (
        ("eval_reward_distributions", plot_distributions(samples, order)),
        ("eval_gains", plot_gains(summary)),
        ("eval_frontier", plot_frontier(frontier)),
        ("eval_grounding", plot_grounding(summary)),
    ):
        run.write_figure(name, fig)
        plt.close(fig)
    rec = summary.set_index("policy")
    run.write_json(
        "eval/summary.json",
        {
            "algorithms": algos,
            "n_prompts": int(samples.loc[samples.policy == "base", "prompt_id"].nunique()),
            "samples_per_prompt": cfg.evaluation.samples_per_prompt,
            "best_of_n": cfg.evaluation.best_of_n,
            "summary": rec.reset_index().to_dict("records"),
        },
    )
    return EvalStage(samples, summary, paired, frontier, t3, algos, tables)
