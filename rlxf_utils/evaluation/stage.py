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
settings and seed (`run.seed`; the RL algorithms' policies their training seed, the same unless
`rl.seed` is set, as in `rlxf seeds`' further seeds, which so draw their own samples against the
shared start-policy ones). Gains and paired tests are against the start policy. Written to the
run dir:

* `eval/samples.parquet` and `eval/samples.jsonl`: one row per response (context, text, reward,
  the reward heads' SD of P(MET) `reward_sd` (`reward.uncertainty`), audit reward, log-probs,
  whether it finished before the cap, grounding);
* `eval/frontier.parquet`: reward, audit reward and KL of every algorithm's snapshots and final
  policy, and the best-of-N curve (N = `best_of_n_curve`, KL at its upper bound);
* `eval/heldout_perplexity.parquet`: perplexity of held-out historical descriptions (MET and
  Non-MET) under every policy;
* `eval/historical_index/`: MiniLM embeddings of every labelled MONA description no policy trained
  on (the policy pool left out; cached);
* `eval/summary.json` and tables `eval_*`, figures `eval_*`; among them the RLGF paper's
  evaluation (`evaluation.rlgf`): tables `eval_rlgf`, `eval_prompt_difficulty`, `eval_easy_hard`,
  `eval_guidance` and figures `eval_reward_perplexity`, `eval_easy_hard`; and the ILHF paper's
  (`evaluation.ilhf`): tables `eval_inclusive`, `eval_inclusive_tests` and figure `eval_inclusive`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch

from rlxf_utils.artifacts import ArtifactMissing, RunDir
from rlxf_utils.data.contexts import heldout_rows, load_contexts
from rlxf_utils.data.splits import load_holdout, load_splits
from rlxf_utils.evaluation.best_of_n import (
    best_of_n_curve,
    best_of_n_frame,
    best_of_n_pool,
    versus_best_of_n,
)
from rlxf_utils.evaluation.design import design_table, variance_table
from rlxf_utils.evaluation.figures import (
    plot_distributions,
    plot_frontier,
    plot_gains,
    plot_grounding,
    plot_heldout_perplexity,
    plot_reward_uncertainty,
)
from rlxf_utils.evaluation.grounding import (
    HistoricalIndex,
    ground_frame,
    grounding_rows,
    index_positions,
    minilm_encoder,
)
from rlxf_utils.evaluation.history import (
    HISTORY_POLICIES,
    ceiling_table,
    history_contrast,
    history_references,
)
from rlxf_utils.evaluation.ilhf import ilhf_figures, ilhf_tables
from rlxf_utils.evaluation.offline import methods_table, need_rl, plot_methods, rl_vs_offline
from rlxf_utils.evaluation.overopt import (
    overoptimisation_fits,
    overoptimisation_meta,
    overoptimisation_points,
    plot_overoptimisation,
)
from rlxf_utils.evaluation.rlgf import rlgf_figures, rlgf_tables
from rlxf_utils.evaluation.sampling import add_judge_logprobs, add_rewards, sample_tuned
from rlxf_utils.evaluation.tables import (
    frontier_points,
    heldout_perplexity,
    summary_table,
    table3,
    trained_steps,
    vs_start_family,
)
from rlxf_utils.models.generation import build_prompts, sampling_kwargs
from rlxf_utils.models.logprobs import sequence_logprobs
from rlxf_utils.models.policies import PolicySet
from rlxf_utils.prompts import CONTEXT_FIELDS
from rlxf_utils.reward.bundle import load_reward
from rlxf_utils.reward.uncertainty import fit_or_load
from rlxf_utils.runtime import warm_up_kernels
from rlxf_utils.stats import family_alpha

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


def run_evaluation_stage(cfg: Any, run: RunDir, progress: bool = True) -> EvalStage:
    """Generate, score, ground and compare every policy on the held-out contexts; write it all."""

    ec, rl = cfg.evaluation, cfg.rl
    if ec.num_threads is not None:
        torch.set_num_threads(ec.num_threads)
    warm_up_kernels()
    timer = PhaseTimer("evaluation")
    with timer("loading"):
        contexts = load_contexts(run.root, "eval", ec.max_prompts, cfg.run.seed)
        reward_model, audit_model = load_reward(
            run.require("reward_model", stage="notebook 02 (reward model)")
        )
        if audit_model is None:
            raise ArtifactMissing(f"{run.path('reward_model')}: no audit model; rerun notebook 02")
        heads = fit_or_load(run, cfg, reward_model)  # None: no reward_sd
        labelled, _ = load_splits(run)
        labelled = labelled.reset_index(drop=True)
        algos = list(rl.algorithm)
        pset = PolicySet(cfg, run, algos)
    start = pset.start_name
    prompts = build_prompts(contexts, pset.tok, rl.prompt_template, cfg.policy)
    gen_kw = sampling_kwargs(cfg, progress)
    trained_kw = sampling_kwargs(cfg, progress, trained=True)  # RL's policies: their own seed
    k = ec.samples_per_prompt
    frames = []
    for name in pset.names:
        with timer(f"samples {name}"):
            kw = trained_kw if name in algos else gen_kw
            frames.append(sample_tuned(pset, name, prompts, k, kw, ec.logprob_batch_size,
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
        best = best_of_n_frame(pool[pool["sample_id"] < ec.best_of_n], "reward", ("prompt_id",))
        best = best.assign(policy="best_of_n", sample_id=0)
        add_judge_logprobs(pset, best, start, ec.logprob_batch_size)
    best["logp_policy"] = np.nan  # best-of-N has no tractable density; its KL is bounded above
    gen = pd.concat([gen, best], ignore_index=True)

    with timer("history references"):
        holdout = load_holdout(run)
        hist = history_references(labelled, contexts, k, cfg.run.seed, holdout["reference"])
        with pset.use("base") as m:
            lp, n_tok = sequence_logprobs(
                m, pset.tok, [prompts[i] for i in hist["prompt_id"]], hist["response"].tolist(),
                batch_size=ec.logprob_batch_size, append_eos=True, padding_side="left",
            )  # fmt: skip
        hist["logp_base"], hist["n_tokens"] = lp, n_tok
        hist["logp_policy"] = hist["logp_ref"] = np.nan
        add_rewards(hist, contexts, reward_model, audit_model, rl.reward_batch_size, heads)

    samples = pd.concat([gen, hist], ignore_index=True)
    with timer("grounding"):
        encoder = minilm_encoder(str(pset.base.device))  # grounding, and ILHF's similarity
        # no row any policy trained on (the policy pool) grounds a response
        rows, position = grounding_rows(labelled, holdout["policy"])
        index = HistoricalIndex.load_or_build(
            run.path("eval/historical_index"), rows["description"].astype(str).tolist(),
            rows["y"].to_numpy(), rows["econ_area"].astype(str).tolist(), encoder,
        )  # fmt: skip
        samples[["grounded_met_rate", "max_sim", "novelty", "top_area"]] = ground_frame(
            index, samples.assign(hist_idx=index_positions(samples["hist_idx"], position)),
            ec.grounding_k, rows["arrangement_id"].astype(str).tolist(),
        )  # fmt: skip
    for key in (*CONTEXT_FIELDS, "econ_area"):
        samples[key] = [contexts[i][key] for i in samples["prompt_id"]]
    order = [*pset.names, "best_of_n", *HISTORY_POLICIES]
    samples["policy"] = pd.Categorical(samples["policy"], categories=order, ordered=True)
    samples = samples.sort_values(["policy", "prompt_id", "sample_id"]).reset_index(drop=True)
    samples["policy"] = samples["policy"].astype(str)

    with timer("statistics"):
        summary, paired = summary_table(samples, pset.names, start, ec.best_of_n, ec.n_boot,
                                        ec.alpha, cfg.run.seed, ec.equivalence_margin, ec.power)  # fmt: skip
        family = vs_start_family(samples["policy"].unique(), start)  # its size sets the level
        country = pd.Series([c["country"] for c in contexts])  # the bootstrap's cluster, per prompt
        per_prompt_bon, curve = best_of_n_curve(pool, sorted(set(ec.best_of_n_curve)), ec.n_boot,
                                                ec.alpha, cfg.run.seed, country)  # fmt: skip
        vs_bon = versus_best_of_n(
            samples, per_prompt_bon, summary, algos, ec.n_boot, ec.alpha, cfg.run.seed, country
        )
    # each final policy at its own last step: ILHF from history counts its steps in pairs
    trained = {a: trained_steps(run, a, rl.steps) for a in algos}
    final = []
    for name in pset.names:
        r = summary[summary.policy == name].iloc[0]
        final.append({"algo": name, "step": trained.get(name, 0), "reward": r["ave_r"],
                      "reward_low": r["ave_r_low"], "reward_high": r["ave_r_high"], "audit_reward": r["audit"],
                      "kl": r["kl"], "kl_se": r["kl_se"],
                      "source": "final" if name in algos or name == start else "reference"})  # fmt: skip
    with timer("frontier snapshots"):
        snaps, snap_samples = (
            frontier_points(pset, run, prompts, contexts, reward_model, audit_model, cfg, progress)
            if ec.frontier
            else (pd.DataFrame(), pd.DataFrame())
        )
    frontier = pd.concat([pd.DataFrame(final), snaps, curve], ignore_index=True)
    with timer("over-optimisation curve"):
        # at the vs-start family's level: a final policy's point is the number of the tables
        over = overoptimisation_points(samples, snap_samples, pool, summary, algos, start,
                                       sorted(set(ec.best_of_n_curve)), trained, country,
                                       ec.n_boot, family_alpha(ec.alpha, len(family)), cfg.run.seed)  # fmt: skip
        over_fits = overoptimisation_fits(over)
        over_meta = overoptimisation_meta(over, pool)
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
            "eval_overoptimisation": over,
            "eval_overoptimisation_fit": over_fits,
            # the RLGF paper's table, easy vs hard prompts and the guidance verdicts (rlgf_eval)
            **rlgf_tables(
                samples, summary, ppl, labelled, algos, start, ec.n_boot, ec.alpha, cfg.run.seed
            ),  # fmt: skip
            # the ILHF paper's questions: variety and closeness to the population, at what reward
            **ilhf_tables(
                samples, summary, ppl_rows, algos, start, ec.n_boot, ec.alpha, cfg.run.seed, encoder
            ),  # fmt: skip
        }
    # the attainable ceiling: the contexts' own MET over Non-MET descriptions, under each judge
    extra["eval_ceiling"] = ceiling_table(
        history_contrast(samples, ec.n_boot, ec.alpha, cfg.run.seed), ec.alpha
    )
    with timer("offline methods against RL"):
        extra["eval_methods"] = methods_table(summary, vs_bon, algos, ec.best_of_n)
        extra["eval_rl_vs_offline"] = rl_vs_offline(samples, algos, ec.n_boot, ec.alpha, cfg.run.seed)  # fmt: skip
    with timer("variance components and design"):
        components = variance_table(samples, family, start)
        available = load_contexts(run.root, "eval", None, cfg.run.seed)
        extra["eval_variance_components"] = components
        extra["eval_design"] = design_table(
            components, pd.Series([c["country"] for c in available]).value_counts().to_dict(),
            country.value_counts().to_dict(), k, timer.seconds, len(family), ec.alpha, ec.power,
            ec.target_mde,
        )  # fmt: skip
    with timer("writing"):
        stage = _write(run, samples, summary, paired, frontier, t3, algos, order, cfg, start,
                       extra, timer.seconds, over_meta)  # fmt: skip
    return stage


def _write(run: RunDir, samples: pd.DataFrame, summary: pd.DataFrame, paired: pd.DataFrame,
           frontier: pd.DataFrame, t3: pd.DataFrame, algos: list[str], order: list[str], cfg: Any,
           start: str, extra: dict[str, pd.DataFrame],
           seconds: Mapping[str, float] | None = None,
           overoptimisation: Mapping[str, Any] | None = None) -> EvalStage:  # fmt: skip
    import matplotlib.pyplot as plt

    keep = [c for c in samples.columns if c not in ("prompt_ids", "response_ids")]
    run.write_parquet("eval/samples.parquet", samples[keep])
    run.write_jsonl("eval/samples.jsonl", samples[keep].to_dict("records"))
    run.write_parquet("eval/frontier.parquet", frontier)
    run.write_parquet("eval/heldout_perplexity.parquet", extra["eval_heldout_perplexity"])
    run.write_parquet("eval/variance_components.parquet", extra["eval_variance_components"])
    run.write_parquet("eval/heldout_nll_rows.parquet", extra.pop("eval_heldout_nll_rows"))
    shown = (
        samples[samples["sample_id"] == 0]
        .groupby("policy", sort=False)
        .head(cfg.evaluation.show_samples)[["policy", "country", "econ_descriptor", "response", "reward", "audit_reward"]]
    )  # fmt: skip
    hacking = summary.loc[
        summary["policy"].isin([*algos, "sft_met", "best_of_n"]),
        ["policy", "gain", "gain_low", "gain_high", "audit_gain", "audit_gain_low",
         "audit_gain_high", "gap", "gap_low", "gap_high", "gap_p_family"],
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
                "ci_level",
                "method",
                "se",
                "df",
                "p_value",
                "p_family",
                "mde",
                "bound",
                "verdict",
                "margin",
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
    # the gains' bars at their family's simultaneous level, as in the tables
    a_family = family_alpha(cfg.evaluation.alpha, len(vs_start_family(samples["policy"].unique(), start)))  # fmt: skip
    for name, fig in (
        ("eval_reward_distributions", plot_distributions(samples, order)),
        ("eval_gains", plot_gains(summary, start, a_family)),
        ("eval_reward_uncertainty", plot_reward_uncertainty(summary, start, cfg.evaluation.alpha)),
        ("eval_frontier", plot_frontier(frontier, start, cfg.evaluation.alpha)),
        (
            "eval_overoptimisation",
            plot_overoptimisation(
                extra["eval_overoptimisation"],
                extra["eval_overoptimisation_fit"],
                start,
                a_family,
            ),
        ),  # fmt: skip
        ("eval_heldout_perplexity", plot_heldout_perplexity(extra["eval_heldout_perplexity"])),
        ("eval_grounding", plot_grounding(summary)),
        *rlgf_figures(extra, start, cfg.evaluation.alpha).items(),
        *ilhf_figures(extra, start, cfg.evaluation.alpha).items(),
        *(
            [("eval_methods", plot_methods(extra["eval_methods"], cfg.evaluation.alpha))]
            if len(extra["eval_methods"])
            else []
        ),
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
            "overoptimisation": dict(overoptimisation or {}),
            # does learning from experience need RL here? (`evaluation.offline.need_rl`)
            "need_rl": {
                m: need_rl(extra["eval_rl_vs_offline"], m) for m in ("audit_reward", "reward")
            },
            "heldout_perplexity": extra["eval_heldout_perplexity"].to_dict("records"),
            "n_prompts": int(samples.loc[samples.policy == "base", "prompt_id"].nunique()),
            "samples_per_prompt": cfg.evaluation.samples_per_prompt,
            "best_of_n": cfg.evaluation.best_of_n,
            "alpha": cfg.evaluation.alpha,
            "power": cfg.evaluation.power,
            "equivalence_margin": cfg.evaluation.equivalence_margin,
            "target_mde": cfg.evaluation.target_mde,
            # each family's members and size (the report lists them once, in its methods)
            "families": {"vs_start": vs_start_family(samples["policy"].unique(), start)},
            "interval": "cluster t (CR2, Bell-McCaffrey df) over countries",
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
