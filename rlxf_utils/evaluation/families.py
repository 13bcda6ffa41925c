"""The evaluation stage's families, in the order they run (`EVAL_FAMILIES`): each a small function
of the `Evaluation` so far that returns its tables, summary entries, figures, files and what later
families read (`Measured`); the measures themselves live in the family modules."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pandas as pd

from rlxf_utils.algorithms import algorithm_label
from rlxf_utils.data.contexts import load_contexts
from rlxf_utils.evaluation.best_of_n import (
    best_of_n_curve,
    best_of_n_frame,
    versus_best_of_n,
)
from rlxf_utils.evaluation.control import control_table, detected
from rlxf_utils.evaluation.curves import (
    FINISHED,
    budget_comparisons,
    budget_reach,
    method_curves,
    plot_budget_gains,
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
    attainable_gain,
    ceiling_table,
    history_contrast,
    history_references,
)
from rlxf_utils.evaluation.ilhf import comparator_pairs, ilhf_figures, ilhf_tables
from rlxf_utils.evaluation.inputs import Evaluation, Measured
from rlxf_utils.evaluation.offline import (
    methods_table,
    need_rl,
    offline_pairs,
    plot_methods,
    rl_vs_offline,
)
from rlxf_utils.evaluation.overopt import (
    REWARDS,
    overoptimisation_fits,
    overoptimisation_meta,
    overoptimisation_points,
    plot_overoptimisation,
)
from rlxf_utils.evaluation.questions import policy_kls, unmatched_pairs
from rlxf_utils.evaluation.rlgf import guidance_pairs, rlgf_figures, rlgf_tables
from rlxf_utils.evaluation.sampling import add_judge_logprobs
from rlxf_utils.evaluation.tables import (
    frontier_points,
    heldout_perplexity,
    summary_table,
    table3,
    trained_steps,
    vs_start_family,
)
from rlxf_utils.models.logprobs import sequence_logprobs
from rlxf_utils.prompts import CONTEXT_FIELDS
from rlxf_utils.stats import family_alpha

# -- the families, in the order they run (later ones read what earlier ones produced) ----------


def sample_policies(ev: Evaluation) -> Measured:
    """Samples of the compared policies: k responses per prompt from each (same prompts and
    settings), their log-probs under it, the start policy and the base; then their rewards."""
    inp, ec = ev.inp, ev.inp.ec
    frames = []
    for name in inp.pset.names:
        phase = f"samples {name}"
        with inp.timer(phase):
            df = inp.draw("samples", name, ec.samples_per_prompt, inp.sampling(name), phase)
            frames.append(df.assign(policy=name))
    with inp.timer("rewards"):
        gen = inp.score(pd.concat(frames, ignore_index=True))
    return Measured(products={"samples": gen})


def sample_best_of_n(ev: Evaluation) -> Measured:
    """Best-of-N: its candidates are a separate draw from the start policy (another seed), so it
    is never compared with the very samples it was selected from; the reward keeps one."""
    inp, ec = ev.inp, ev.inp.ec
    with inp.timer("best-of-N pool"):
        pool = inp.score(inp.draw_pool())
        best = best_of_n_frame(pool[pool["sample_id"] < ec.best_of_n], "reward", ("prompt_id",))
        best = best.assign(policy="best_of_n", sample_id=0)
        add_judge_logprobs(inp.pset, best, inp.start, ec.logprob_batch_size)
    best["logp_policy"] = np.nan  # best-of-N has no tractable density; its KL is bounded above
    samples = pd.concat([ev.samples, best], ignore_index=True)
    return Measured(products={"samples": samples, "pool": pool})


def sample_history(ev: Evaluation) -> Measured:
    """The references drawn from history for the same contexts (real MET and Non-MET
    descriptions, the random policy), their log-probs under the base and their rewards."""
    inp, ec = ev.inp, ev.inp.ec
    with inp.timer("history references"):
        hist = history_references(inp.labelled, inp.contexts, ec.samples_per_prompt, inp.seed,
                                  inp.holdout["reference"])  # fmt: skip
        with inp.pset.use("base") as m:
            lp, n_tok = sequence_logprobs(
                m, inp.pset.tok, [inp.prompts[i] for i in hist["prompt_id"]],
                hist["response"].tolist(), batch_size=ec.logprob_batch_size, append_eos=True,
                padding_side="left",
            )  # fmt: skip
        hist["logp_base"], hist["n_tokens"] = lp, n_tok
        hist["logp_policy"] = hist["logp_ref"] = np.nan
        # the cut rule of generated text (issue 78): a description would have finished under the
        # evaluation's cap iff its tokens and the end token fit in it (a sample's `finished`)
        hist["finished"] = np.asarray(n_tok) <= inp.cfg.eval_max_new_tokens
        inp.score(hist)
    return Measured(products={"samples": pd.concat([ev.samples, hist], ignore_index=True)})


def ground_samples(ev: Evaluation) -> Measured:
    """Grounding: every response's nearest MONA conditions no policy trained on (their MET rate,
    similarity, novelty, area); then each row's context, in the tables' policy order. Writes
    `eval/samples.*`, the responses shown and the reward distributions."""
    inp, samples = ev.inp, ev.samples.copy()
    with inp.timer("grounding"):
        encoder = minilm_encoder(str(inp.pset.base.device))  # grounding, and ILHF's similarity
        # no row any policy trained on (the policy pool) grounds a response
        rows, position = grounding_rows(inp.labelled, inp.holdout["policy"])
        index = HistoricalIndex.load_or_build(
            inp.run.path("eval/historical_index"), rows["description"].astype(str).tolist(),
            rows["y"].to_numpy(), rows["econ_area"].astype(str).tolist(), encoder,
        )  # fmt: skip
        samples[["grounded_met_rate", "max_sim", "novelty", "top_area"]] = ground_frame(
            index, samples.assign(hist_idx=index_positions(samples["hist_idx"], position)),
            inp.ec.grounding_k, rows["arrangement_id"].astype(str).tolist(),
        )  # fmt: skip
    for key in (*CONTEXT_FIELDS, "econ_area"):
        samples[key] = [inp.contexts[i][key] for i in samples["prompt_id"]]
    order = [*inp.pset.names, "best_of_n", *HISTORY_POLICIES]
    samples["policy"] = pd.Categorical(samples["policy"], categories=order, ordered=True)
    samples = samples.sort_values(["policy", "prompt_id", "sample_id"]).reset_index(drop=True)
    samples["policy"] = samples["policy"].astype(str)
    return Measured(products={"samples": samples, "order": order, "encoder": encoder})


def record_samples(ev: Evaluation) -> Measured:
    """The samples as written (`eval/samples.*`, token ids left out), the responses shown, the
    reward distributions and the summary's counts."""
    samples, ec = ev.samples, ev.inp.ec
    keep = samples[[c for c in samples.columns if c not in ("prompt_ids", "response_ids")]]
    shown = (
        samples[samples["sample_id"] == 0]
        .groupby("policy", sort=False)
        .head(ec.show_samples)[["policy", "country", "econ_descriptor", "response", "reward", "audit_reward"]]
    )  # fmt: skip
    entries = {
        "policies": [p for p in ev.order if p in set(samples["policy"])],
        "n_prompts": int(samples.loc[samples.policy == "base", "prompt_id"].nunique()),
        "samples_per_prompt": ec.samples_per_prompt,
        "reference_rows": int(samples["hist_idx"].notna().sum()),
    }
    return Measured(
        {"eval_samples_shown": shown},
        entries,
        {"eval_reward_distributions": plot_distributions(samples, ev.order)},
        {"eval/samples.parquet": keep, "eval/samples.jsonl": keep},
    )


#: `eval_paired`'s columns, in order.
PAIRED_COLUMNS = [
    "measure", "policy", "vs", "n", "n_clusters", "mean_a", "mean_b", "mean_diff", "ci_low",
    "ci_high", "ci_level", "method", "se", "df", "p_value", "p_family", "mde", "bound", "verdict",
    "margin", "cohens_dz", "rank_biserial", "p_ttest", "p_ttest_holm", "p_wilcoxon",
    "p_wilcoxon_holm",
]  # fmt: skip
#: `eval_hacking_gap`'s columns: each gain under the reward and the audit, and their gap.
GAP_COLUMNS = [
    "policy", "gain", "gain_low", "gain_high", "audit_gain", "audit_gain_low", "audit_gain_high",
    "gap", "gap_low", "gap_high", "gap_p_family",
]  # fmt: skip


def compare_policies(ev: Evaluation) -> Measured:
    """Every policy's measures, and the paired tests of each against the start policy (the
    vs-start family, Holm-corrected; clusters: countries): `eval_summary`, `eval_paired`, the
    hacking gap, the gains, the reward's uncertainty and the grounding."""
    inp, ec, samples = ev.inp, ev.inp.ec, ev.samples
    start, alpha = inp.start, ec.alpha
    with inp.timer("statistics"):
        summary, paired = summary_table(samples, inp.pset.names, start, ec.best_of_n, ec.n_boot,
                                        alpha, inp.seed, ec.equivalence_margin, ec.power)  # fmt: skip
        family = vs_start_family(samples["policy"].unique(), start)  # its size sets the level
    hacking = summary.loc[
        summary["policy"].isin([*inp.algos, "sft_met", "best_of_n"]), GAP_COLUMNS
    ].copy()
    tables = {"eval_summary": summary, "eval_paired": paired[PAIRED_COLUMNS],
              "eval_hacking_gap": hacking}  # fmt: skip
    figures = {
        "eval_gains": plot_gains(summary, start, family_alpha(alpha, len(family))),
        "eval_reward_uncertainty": plot_reward_uncertainty(summary, start, alpha),
        "eval_grounding": plot_grounding(summary),
    }
    entries = {
        "families": {"vs_start": family},  # the report lists each family once, in its methods
        "interval": "cluster t (CR2, Bell-McCaffrey df) over countries",
        "cluster": "country",
        "summary": summary.set_index("policy").reset_index().to_dict("records"),
    }
    products = {"summary": summary, "paired": paired, "family": family}
    return Measured(tables, entries, figures, products=products)


def control_family(ev: Evaluation) -> Measured:
    """The positive control (a run whose labels were drawn from a planted P*, `data.planted`):
    each method's true gain beside both judges' estimates and verdicts (`eval_control`), and the
    smallest true gain each judge saw. Nothing in a run on MONA's own labels."""
    if ev.inp.cfg.data.planted is None:
        return Measured()
    table = control_table(ev.samples, ev.family, ev.inp.start, ev.inp.ec.alpha)
    entries = {"control": {"detected_reward": detected(table, "reward"),
                           "detected_audit": detected(table, "audit"),
                           "methods": len(table)}}  # fmt: skip
    return Measured({"eval_control": table}, entries)


def best_of_n_curve_family(ev: Evaluation) -> Measured:
    """The best-of-N curve (expected best-of-N reward for each N, KL at its bound) and each RL
    policy against it at its own KL."""
    inp, ec = ev.inp, ev.inp.ec
    with inp.timer("statistics"):
        per_prompt, curve = best_of_n_curve(ev.pool, inp.curve_ns, ec.n_boot, ec.alpha, inp.seed,
                                            inp.country)  # fmt: skip
        vs_bon = versus_best_of_n(ev.samples, per_prompt, ev.summary, inp.algos, ec.n_boot,
                                  ec.alpha, inp.seed, inp.country)  # fmt: skip
    tables = {"eval_vs_best_of_n": vs_bon, "eval_best_of_n_curve": curve}
    entries = {"best_of_n_curve": inp.curve_ns, "vs_best_of_n": vs_bon.to_dict("records"),
               "best_of_n": ec.best_of_n}  # fmt: skip
    return Measured(tables, entries)


def frontier_family(ev: Evaluation) -> Measured:
    """Reward against KL: every final policy at its own last step, every RL snapshot
    (`evaluation.frontier`) and the best-of-N curve."""
    inp, ec, rl = ev.inp, ev.inp.ec, ev.inp.cfg.rl
    # each final policy at its own last step: ILHF from history counts its steps in pairs
    trained = {a: trained_steps(inp.run, a, rl.steps) for a in inp.algos}
    final = []
    for name in inp.pset.names:
        r = ev.summary[ev.summary.policy == name].iloc[0]
        final.append({"algo": name, "step": trained.get(name, 0), "reward": r["ave_r"],
                      "reward_low": r["ave_r_low"], "reward_high": r["ave_r_high"], "audit_reward": r["audit"],
                      "kl": r["kl"], "kl_se": r["kl_se"],
                      "source": "final" if name in inp.algos or name == inp.start else "reference"})  # fmt: skip
    with inp.timer("frontier snapshots"):
        snaps, snap_samples = pd.DataFrame(), pd.DataFrame()
        if ec.frontier:
            snaps, snap_samples = frontier_points(inp.pset, inp.run, inp.prompts, inp.contexts,
                                                  inp.reward_model, inp.audit_model, inp.cfg,
                                                  inp.timer, inp.progress)  # fmt: skip
    curve = ev.tables["eval_best_of_n_curve"]
    frontier = pd.concat([pd.DataFrame(final), snaps, curve], ignore_index=True)
    return Measured(
        {"eval_frontier": frontier},
        figures={"eval_frontier": plot_frontier(frontier, inp.start, ec.alpha)},
        files={"eval/frontier.parquet": frontier},
        products={"trained": trained, "snap_samples": snap_samples, "frontier": frontier},
    )


def overoptimisation_family(ev: Evaluation) -> Measured:
    """Over-optimisation: the audit's gain against the reward's along every RL run and the
    best-of-N curve, at the vs-start family's level (a final policy's point is the tables')."""
    inp, ec = ev.inp, ev.inp.ec
    with inp.timer("over-optimisation curve"):
        over = overoptimisation_points(ev.samples, ev.snap_samples, ev.pool, ev.summary,
                                       inp.algos, inp.start, inp.curve_ns, ev.trained,
                                       inp.country, ec.n_boot, ev.alpha_family, inp.seed)  # fmt: skip
        fits = overoptimisation_fits(over)
        meta = overoptimisation_meta(over, ev.pool)
    figure = plot_overoptimisation(over, fits, inp.start, ev.alpha_family)
    return Measured(
        {"eval_overoptimisation": over, "eval_overoptimisation_fit": fits},
        {"overoptimisation": dict(meta or {})},
        {"eval_overoptimisation": figure},
    )


def kl_budget_family(ev: Evaluation) -> Measured:
    """Every method against every other at the same KL (`evaluation.curves`): each method's
    reward-KL curve (the start policy, its snapshots, its final policy; best-of-N's n), read at
    each of `evaluation.kl_budgets` it reaches; every pair of the methods reaching a budget one
    family per budget and judge, and each one's gain over the start policy there."""
    inp, ec = ev.inp, ev.inp.ec
    frames = [ev.samples, ev.snap_samples, *([ev.pool] if ev.pool is not None else [])]
    # the finished share beside the gains, where every point's samples record it
    beside = [FINISHED] if all(FINISHED in f for f in frames if len(f)) else []
    with inp.timer("KL budgets"):
        curves = method_curves(ev.samples, ev.snap_samples, ev.pool, inp.algos, inp.start,
                               inp.curve_ns, measures=(*REWARDS, *beside))  # fmt: skip
        pairs, gains = budget_comparisons(curves, ec.kl_budgets, inp.country, ec.alpha, ec.power,
                                          span=ec.kl_budget_span, beside=beside)  # fmt: skip
        reach = budget_reach(gains, pairs)
    labels = {m: algorithm_label(m) for m in curves}  # best-of-N has its label too
    figures = {"eval_kl_budgets": plot_budget_gains(gains, inp.start, labels)} if len(gains) else {}
    entries = {"kl_budgets": list(ec.kl_budgets), "kl_budget_span": ec.kl_budget_span,
               "kl_budget_reach": reach.to_dict("records"),
               "headline": ec.headline.model_dump()}  # fmt: skip
    return Measured(
        {"eval_kl_budget_pairs": pairs, "eval_kl_budget_gains": gains,
         "eval_kl_budget_reach": reach},
        entries,
        figures,
    )  # fmt: skip


def heldout_perplexity_family(ev: Evaluation) -> Measured:
    """Does each policy still write conditions: the perplexity of held-out historical MET and
    Non-MET descriptions under it (`eval_heldout_perplexity`; per row: `eval/heldout_nll_rows`)."""
    inp, ec = ev.inp, ev.inp.ec
    with inp.timer("held-out perplexity"):
        ppl, ppl_rows = heldout_perplexity(inp.pset, inp.heldout(), inp.cfg.rl.prompt_template,
                                           inp.cfg, ec.logprob_batch_size, inp.run, inp.timer)  # fmt: skip
    return Measured(
        {"eval_heldout_perplexity": ppl},
        {"heldout_perplexity": ppl.to_dict("records")},
        {"eval_heldout_perplexity": plot_heldout_perplexity(ppl)},
        {"eval/heldout_perplexity.parquet": ppl, "eval/heldout_nll_rows.parquet": ppl_rows},
        {"ppl_rows": ppl_rows},
    )


def table3_family(ev: Evaluation) -> Measured:
    """The paper's Table 3: its completion prompts for held-out countries, pre- and post-RL."""
    inp = ev.inp
    with inp.timer("table 3"):
        t3 = table3(inp.pset, inp.contexts, inp.labelled, inp.reward_model, inp.audit_model,
                    inp.cfg, inp.run, inp.timer)  # fmt: skip
    return Measured({"eval_table3": t3})


def rlgf_family(ev: Evaluation) -> Measured:
    """The RLGF paper's evaluation: its table, easy vs hard prompts and the guidance verdicts."""
    inp, ec = ev.inp, ev.inp.ec
    with inp.timer("RLGF and ILHF tables"):
        tables = rlgf_tables(ev.samples, ev.summary, ev.tables["eval_heldout_perplexity"],
                             inp.labelled, inp.algos, inp.start, ec.n_boot, ec.alpha, inp.seed,
                             ec.kl_match_ratio)  # fmt: skip
    return Measured(tables, figures=rlgf_figures(tables, inp.start, ec.alpha))


def ilhf_family(ev: Evaluation) -> Measured:
    """The ILHF paper's questions: variety and closeness to the population, at what reward."""
    inp, ec = ev.inp, ev.inp.ec
    with inp.timer("RLGF and ILHF tables"):
        tables = ilhf_tables(ev.samples, ev.summary, ev.ppl_rows, inp.algos, inp.start,
                             ec.n_boot, ec.alpha, inp.seed, ev.encoder, ec.kl_match_ratio)  # fmt: skip
    return Measured(tables, figures=ilhf_figures(tables, inp.start, ec.alpha))


def ceiling_family(ev: Evaluation) -> Measured:
    """The attainable ceiling: the contexts' own MET over Non-MET descriptions, under each judge;
    and the attainable gain, their MET descriptions over the start policy on the same prompts, at
    the vs-start family's level (`eval_attainable`, beside the headline gains in `eval_methods`)."""
    ec = ev.inp.ec
    contrast = history_contrast(ev.samples, ec.n_boot, ec.alpha, ev.inp.seed)
    attainable = attainable_gain(ev.samples, ev.inp.start, ec.alpha, max(len(ev.family), 1))
    return Measured(
        {"eval_ceiling": ceiling_table(contrast, ec.alpha), "eval_attainable": attainable},
        {"history_contrast": contrast},
    )


def offline_family(ev: Evaluation) -> Measured:
    """Learning from experience without RL (`sft_met`, best-of-N) against RL: does it need RL?"""
    inp, ec = ev.inp, ev.inp.ec
    with inp.timer("offline methods against RL"):
        methods = methods_table(ev.summary, ev.tables["eval_vs_best_of_n"], inp.algos,
                                ec.best_of_n, ev.tables.get("eval_attainable"))  # fmt: skip
        vs_offline = rl_vs_offline(ev.samples, inp.algos, ec.n_boot, ec.alpha, inp.seed,
                                   policy_kls(ev.summary), ec.kl_match_ratio)  # fmt: skip
    # does learning from experience need RL here? (`evaluation.offline.need_rl`)
    ran = len(offline_pairs(ev.samples, inp.algos))  # before the pairs far apart in KL left
    entries = {"need_rl": {m: need_rl(vs_offline, m, ran, ec.kl_match_ratio)
                           for m in ("audit_reward", "reward")}}  # fmt: skip
    figures = {"eval_methods": plot_methods(methods, ev.alpha_family)} if len(methods) else {}
    return Measured({"eval_methods": methods, "eval_rl_vs_offline": vs_offline}, entries, figures)


def kl_match_family(ev: Evaluation) -> Measured:
    """The pairs of the question tables (`eval_guidance`, `eval_rl_vs_offline`) and of the ILHF
    tests against a comparator (`eval_inclusive_tests`) left out for KLs
    further apart than `evaluation.kl_match_ratio` (`questions.unmatched_pairs`): listed, with
    both KLs, so that the report says which methods were not set side by side and why."""
    inp, ec = ev.inp, ev.inp.ec
    pairs = (guidance_pairs(ev.samples, inp.algos) + offline_pairs(ev.samples, inp.algos)
             + comparator_pairs(ev.samples, inp.algos))  # fmt: skip
    table = unmatched_pairs(pairs, policy_kls(ev.summary), ec.kl_match_ratio)
    return Measured({"eval_kl_unmatched": table}, {"kl_match_ratio": ec.kl_match_ratio})


def design_family(ev: Evaluation) -> Measured:
    """How large the evaluation must be: the variance components of each gain and the design
    they call for, costed with this run's own phase times so far."""
    inp, ec = ev.inp, ev.inp.ec
    with inp.timer("variance components and design"):
        components = variance_table(ev.samples, ev.family, inp.start)
        available = load_contexts(inp.run.root, "eval", None, inp.seed)
        design = design_table(
            components, pd.Series([c["country"] for c in available]).value_counts().to_dict(),
            inp.country.value_counts().to_dict(), ec.samples_per_prompt, inp.timer.seconds,
            len(ev.family), ec.alpha, ec.power, ec.target_mde,
        )  # fmt: skip
    return Measured(
        {"eval_variance_components": components, "eval_design": design},
        files={"eval/variance_components.parquet": components},
    )


#: Every family, in the order it runs: later ones read earlier ones' products and tables (the
#: samples first, then the statistics on them). Adding a measure is one entry here and one
#: function above (the measures themselves live in the family modules).
EVAL_FAMILIES: dict[str, Callable[[Evaluation], Measured]] = {
    "samples": sample_policies,
    "best_of_n": sample_best_of_n,
    "history": sample_history,
    "grounding": ground_samples,
    "record_samples": record_samples,
    "paired": compare_policies,
    "control": control_family,
    "best_of_n_curve": best_of_n_curve_family,
    "frontier": frontier_family,
    "overoptimisation": overoptimisation_family,
    "kl_budgets": kl_budget_family,
    "heldout_perplexity": heldout_perplexity_family,
    "table3": table3_family,
    "rlgf": rlgf_family,
    "ilhf": ilhf_family,
    "ceiling": ceiling_family,
    "offline": offline_family,
    "kl_match": kl_match_family,
    "design": design_family,
}
