"""The evaluation section: gains over the start policy, the audit, best-of-N, history and the
reward model's uncertainty, in words."""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from rlxf_utils.algorithms import algorithm_label
from rlxf_utils.artifacts import RunDir
from rlxf_utils.evaluation.best_of_n import best_of_n_kl_bound
from rlxf_utils.report.gold import gold_auc, gold_auc_words, gold_cannot_judge
from rlxf_utils.report.wording import (
    EQUIVALENT,
    ci,
    interval,
    is_present,
    listing,
    margin_verdict,
    markdown_table,
    null_bound_clause,
    num,
    phrase,
    pval,
    say,
    sd_verdict,
    short_text,
)
from rlxf_utils.reward.uncertainty import FOLDER as HEADS_FOLDER
from rlxf_utils.reward.uncertainty import MARKER as HEADS_MARKER
from rlxf_utils.stats import bound_verdict, level


def gain_verb(low: float, high: float) -> str:
    """'raised' / 'lowered' when the family's simultaneous interval of the gain lies above / below
    zero (the study's one multiplicity rule, `stats.family_alpha`), else 'did not significantly
    change'."""
    return say("gain", low, high)


def null_clause(low: float, high: float, margin: float | None = None) -> str:
    """What a null leaves open, for the sentence of a gain: '' where the interval excludes zero;
    'a gain of at most +0.004' where it holds zero; 'equivalent within ±0.010: a gain of at most
    +0.004' where it also lies within ±`margin` (`stats.bound_verdict`)."""
    bound = null_bound_clause(low, high)
    if not bound:
        return ""
    if bound_verdict(low, high, margin) == EQUIVALENT:
        return f"{margin_verdict(low, high, margin)}: {bound}"
    return bound


def family_mde(paired: pd.DataFrame, measure: str) -> float:
    """The family's minimum detectable effect under one measure: the median over its comparisons
    of each one's MDE (`stats.power.mde` from its own standard error); NaN for runs from before."""
    if "mde" not in paired or "measure" not in paired:
        return math.nan
    vals = paired.loc[paired["measure"] == measure, "mde"].dropna()
    return float(vals.median()) if len(vals) else math.nan


def family_sentence(paired: pd.DataFrame, start: str, fam: str, power: float) -> str:
    """The vs-start family where its results are first given: its members and size, and its MDE
    under each judge."""
    rows = paired[paired["measure"] == "reward"] if "measure" in paired else paired
    members = listing([f"`{p}`" for p in rows["policy"]])
    mdes = [(family_mde(paired, m), who) for m, who in (("reward", "the reward model"),
                                                      ("audit_reward", "the audit"))]  # fmt: skip
    told = [f"{num(v, signed=True)} under {who}" for v, who in mdes if is_present(v)]
    mde_text = (
        f"; its minimum detectable effect, the true gain its {fam} intervals exclude zero for with "
        f"{power:.0%} probability, is {listing(told)} (the median over its comparisons, from each "
        "one's standard error): a smaller gain would usually go unseen, so a null here is a bound "
        "on the gain, not its absence"
        if told
        else ""
    )
    return (
        f"This family, each method against `{start}`, holds m = {len(rows)} comparisons under each "
        f"measure ({members}: the methods tuned or selected from `{start}`; the zero-shot model and "
        "the history references keep their own Ave(R) intervals and are no question asked of it)"
        + mde_text
    )


def design_sentence(design: pd.DataFrame, target: float | None) -> str:
    """What the variance components say of the evaluation's size (`eval_design`)."""
    if design.empty:
        return "This run did not estimate its variance components"
    parts = []
    for judge, g in design.groupby("judge", sort=False):
        d = g.set_index("design")
        own = d.loc["this run"]
        text = (
            f"under the {judge}, {int(own['prompts'])} prompts in {int(own['countries'])} countries "
            f"with {int(own['samples_per_prompt'])} samples each predict an MDE of "
            f"{num(own['mde'], signed=True)}"
        )
        reach = [n for n in d.index if n.startswith("cheapest reaching")]
        if reach:
            r = d.loc[reach[0]]
            text += (
                f"; the cheapest design reaching {num(target, signed=True)} takes {int(r['prompts'])} "
                f"prompts with {int(r['samples_per_prompt'])} samples each (about "
                f"{r['cost_s'] / 60:.0f} minutes of sampling against this run's "
                f"{own['cost_s'] / 60:.0f})"
            )
        elif target is not None and "every held-out context" in d.index:
            e = d.loc["every held-out context"]
            text += (
                f"; no design within the held-out contexts reaches {num(target, signed=True)}: all "
                f"{int(e['prompts'])} of them reach {num(e['mde'], signed=True)}"
            )
        parts.append(text)
    return "From the variance components (@tbl-variance), " + "; ".join(parts)


def variance_md(components: pd.DataFrame) -> str:
    """The appendix table of variance components: per policy and judge, the three components
    (×10⁴), the predicted SE and the mean paired difference."""
    if components.empty:
        return table_note("No variance components were estimated")
    t = components.assign(
        **{
            "between countries ×10⁴": components["var_country"] * 1e4,
            "between prompts ×10⁴": components["var_prompt"] * 1e4,
            "within a prompt ×10⁴": components["var_sample"] * 1e4,
            "mean difference": [num(v, signed=True) for v in components["mean"]],
            "SE": components["se"].map(lambda v: num(v, 4)),
        }
    )
    cols = ["policy", "judge", "n_countries", "n_prompts", "samples_per_prompt",
            "between countries ×10⁴", "between prompts ×10⁴", "within a prompt ×10⁴",
            "mean difference", "SE"]  # fmt: skip
    return markdown_table(
        t[cols].rename(columns={"n_countries": "countries", "n_prompts": "prompts",
                                "samples_per_prompt": "k"}),
        floatfmt=".2f",
    )  # fmt: skip


def design_md(design: pd.DataFrame) -> str:
    """The appendix table of designs: prompts, samples per prompt, countries, predicted SE,
    degrees of freedom, MDE and sampling minutes, per judge."""
    if design.empty:
        return table_note("No design was computed")
    t = design.assign(
        se=design["se"].map(lambda v: num(v, 4)),
        df=design["df"].map(lambda v: f"{v:.1f}"),
        mde=design["mde"].map(lambda v: num(v, signed=True)),
        minutes=(design["cost_s"] / 60).map(lambda v: f"{v:.0f}"),
        reaches_target=design["reaches_target"].map(lambda v: "yes" if v else "no"),
    )
    return markdown_table(
        t[["judge", "design", "prompts", "samples_per_prompt", "countries", "se", "df", "mde",
           "minutes", "reaches_target"]].rename(
            columns={"samples_per_prompt": "k", "se": "SE", "mde": "MDE",
                     "minutes": "sampling (min)", "reaches_target": "reaches target"}
        )
    )  # fmt: skip


def family_level(paired: pd.DataFrame, measure: str = "reward") -> str:
    """The confidence level of one family's simultaneous intervals ('99.4%'), from
    `eval_paired`'s `ci_level` (the plain level of runs from before the rule)."""
    rows = paired[paired["measure"] == measure] if "measure" in paired else paired
    if "ci_level" not in rows or rows["ci_level"].dropna().empty:
        return level(0.05)
    return level(1 - float(rows["ci_level"].dropna().iloc[0]))


#: The study's multiplicity rule, as the report states it once.
MULTIPLICITY_RULE = (
    "Every family of comparisons (one question asked of several policies: each policy against the "
    "start policy under the reward model, under the audit model and in their gap; guidance against "
    "PPO; RL against sft_met; easy against hard prompts; the ILHF tests; each policy against "
    "best-of-N; each algorithm's mean gain over training seeds) is Bonferroni-adjusted: its m "
    "intervals are at level 1 − α/m, so they hold together with probability at least 1 − α, and "
    "a verdict word is given only where an interval "
    "excludes zero. The p-values beside them are dual to those intervals (m times the p-value of "
    "the interval's own test, below α exactly when the verdict is given); the t and Wilcoxon "
    "tests on per-country means are shown for reference only"
)


def history_sentence(hist: dict[str, float], contrast: dict[str, Any]) -> str:
    """Where the reward and audit models place real MET against real Non-MET descriptions of the
    same held-out contexts, read from the paired interval over prompts (`history_contrast`)."""
    if not ("history_met" in hist and "history_nonmet" in hist and contrast.get("reward")):
        return "The held-out contexts evaluated here do not hold both MET and Non-MET history"
    parts = []
    for col, who in (("reward", "the reward model"), ("audit_reward", "the audit model")):
        h = contrast.get(col)
        if not h:
            continue
        word = say("apart_from", h["ci_low"], h["ci_high"])
        parts.append(f"{who} places what was met {word} what was not "
                     f"(difference {ci(h['mean_diff'], h['ci_low'], h['ci_high'], signed=True)})")  # fmt: skip
    return (
        f"Real MET descriptions for the same contexts, from rows neither model trained on, score "
        f"{num(hist['history_met'])} and real Non-MET ones {num(hist['history_nonmet'])}; on the "
        f"{contrast['reward']['n']} prompts ({contrast['reward']['n_clusters']} countries) that have "
        "both, " + " and ".join(parts)
    )


def eval_section(run: RunDir, alpha: float = 0.05) -> tuple[dict[str, Any], dict[str, str]]:
    stage = "notebook 04_evaluation"
    meta = run.read_json("eval/summary.json", stage=stage)
    s = pd.DataFrame(meta["summary"]).set_index("policy")
    paired = run.read_table("eval_paired", stage)
    t3 = run.read_table("eval_table3", stage)
    algos = meta["algorithms"]
    start = meta.get("start_policy", "base")
    vs_bon = pd.DataFrame(meta.get("vs_best_of_n", []))
    alpha = meta.get("alpha", alpha)
    margin = meta.get("equivalence_margin")
    lvl = level(alpha)
    fam = family_level(paired)  # the vs-start families' simultaneous level
    components = (
        run.read_table("eval_variance_components", stage)
        if run.exists("tables/eval_variance_components.csv")
        else pd.DataFrame()
    )
    design = (
        run.read_table("eval_design", stage)
        if run.exists("tables/eval_design.csv")
        else pd.DataFrame()
    )
    ppl = pd.DataFrame(meta.get("heldout_perplexity", []))

    def gain_cell(r: pd.Series, col: str) -> str:
        if pd.isna(r.get(col)):
            return "·"
        low, high = r[col + "_low"], r[col + "_high"]
        return f"{ci(r[col], low, high, signed=True)} ({pval(r.get(col + '_p_family', math.nan), prose=True)})"

    rows, cost = [], []
    for pol, r in s.iterrows():
        rows.append({
            "policy": pol, "prompts": int(r["n_prompts"]),
            f"Ave(R) [{lvl} CI]": ci(r["ave_r"], r["ave_r_low"], r["ave_r_high"]),
            f"reward SD [{lvl} CI]": ci(r["reward_sd"], r["reward_sd_low"], r["reward_sd_high"]) if is_present(r.get("reward_sd")) else "·",
            f"gain vs {start} [{fam} CI] (family p)": gain_cell(r, "gain"),
            f"audit [{lvl} CI]": ci(r["audit"], r["audit_low"], r["audit_high"]),
            f"audit gain [{fam} CI] (family p)": gain_cell(r, "audit_gain"),
            f"reward − audit gap [{fam} CI]": "·" if pd.isna(r.get("gap")) else ci(r["gap"], r["gap_low"], r["gap_high"], signed=True),
        })  # fmt: skip
        cost.append({
            "policy": pol,
            "KL (nats)": "·" if pd.isna(r["kl"]) else (f"≤ {r['kl']:.2f}" if r["kl_kind"] == "upper bound" else f"{r['kl']:.2f}"),
            "perplexity": f"{r['perplexity']:.1f}",
            "finished": "·" if pd.isna(r.get("finished")) else f"{r['finished']:.0%}",
            "words": f"{r['mean_words']:.1f}",
            "distinct-2": num(r["distinct_2"]),
            "rep-3": num(r["rep_3"]),
            f"grounded MET [{lvl} CI]": ci(r["grounded_met"], r["grounded_low"], r["grounded_high"]),
            "max similarity": num(r["max_sim"]),
        })  # fmt: skip
    summary_md = markdown_table(pd.DataFrame(rows))
    cost_md = markdown_table(pd.DataFrame(cost))
    pt = paired.assign(
        **{
            f"difference [{fam} CI]": [ci(a, b, c, signed=True) for a, b, c in zip(paired.mean_diff, paired.ci_low, paired.ci_high, strict=True)],
            "family p": paired["p_family"].map(pval) if "p_family" in paired else "·",
            "verdict": [
                margin_verdict(lo, hi, margin)
                for lo, hi in zip(paired.ci_low, paired.ci_high, strict=True)
            ],
            "MDE": paired["mde"].map(lambda v: num(v)) if "mde" in paired else "·",
            "d_z": paired["cohens_dz"].map(lambda x: f"{x:.2f}"),
            "p (t, Holm)": paired["p_ttest_holm"].map(pval),
            "p (Wilcoxon, Holm)": paired["p_wilcoxon_holm"].map(pval),
        }
    )[["measure", "policy", "n", "n_clusters", f"difference [{fam} CI]", "family p", "verdict", "MDE", "d_z", "p (t, Holm)", "p (Wilcoxon, Holm)"]]  # fmt: skip
    t3_md = markdown_table(
        t3.assign(
            prompt=t3["prompt"].map(lambda x: short_text(x, 70)),
            response=t3["response"].map(short_text),
        )[["prompt", "policy", "response", "reward"]]
    )

    sentences, concl = [], []
    gold, gold_said = gold_auc(run), False  # a null from a gold at chance is no "did not move"
    for algo in algos:
        r = s.loc[algo]
        verb = gain_verb(r["gain_low"], r["gain_high"])
        a_verb = gain_verb(r["audit_gain_low"], r["audit_gain_high"])
        bound = null_clause(r["gain_low"], r["gain_high"], margin)
        a_bound = null_clause(r["audit_gain_low"], r["audit_gain_high"], margin)
        a_what, a_concl = f"{a_verb} the audit model's reward", f"{a_verb} the disjoint-rows audit reward"  # fmt: skip
        if gold_cannot_judge(gold, r["audit_gain_low"], r["audit_gain_high"]):
            a_what = a_concl = "left the audit model unable to confirm or refute a gain"
            if not gold_said:  # its discrimination, once
                a_bound = "; ".join(filter(None, [a_bound, gold_auc_words(gold, "the audit's")]))
                gold_said = True
        sentences.append(
            f"{algorithm_label(algo)} {verb} Ave(R) on the held-out prompts (from {num(s.loc[start, 'ave_r'])} for {start} to "
            f"{ci(r['ave_r'], r['ave_r_low'], r['ave_r_high'])}; paired gain "
            f"{ci(r['gain'], r['gain_low'], r['gain_high'], signed=True)} at the family's {fam}, "
            f"{pval(r.get('gain_p_family', math.nan), prose=True)}{'; ' + bound if bound else ''}) and {a_what} "
            f"({ci(r['audit_gain'], r['audit_gain_low'], r['audit_gain_high'], signed=True)}{'; ' + a_bound if a_bound else ''}), at a KL of "
            f"{r['kl']:.2f} nats to the starting policy"
        )
        gap_word = say("gap", r.get("gap_low", math.nan), r.get("gap_high", math.nan))
        concl.append(
            f"{algorithm_label(algo)} {verb} the reward it was trained on and {a_concl} "
            f"(its reward gain {gap_word} its audit gain)"
        )
    hist = {
        p: s.loc[p, "ave_r"]
        for p in ("history_met", "history_nonmet", "random_policy")
        if p in s.index
    }
    hist_sentence = history_sentence(hist, meta.get("history_contrast", {}))
    b = s.loc["best_of_n"]
    g = s.dropna(subset=["grounded_met"])
    bon_sentences = []
    curve_end = best_of_n_kl_bound(max(meta.get("best_of_n_curve") or [1]))

    def bon_kl(
        r: pd.Series,
    ) -> float:  # the curve's KL the policy was compared at (older runs lack it)
        return r["best_of_n_kl"] if pd.notna(r.get("best_of_n_kl")) else min(r["kl"], curve_end)

    for _, r in vs_bon.iterrows():
        where = phrase("curve", r["verdict"])
        bon_sentences.append(
            f"{algorithm_label(r['policy'])} ({num(r['ave_r'])} at {r['kl']:.2f} nats) {where} the best-of-N curve "
            f"({num(r['best_of_n_at_kl'])} at {bon_kl(r):.2f} nats"
            f"{': its KL is beyond the curve, compared with the largest N' if r['beyond_curve'] else ', the same KL'}; "
            f"difference {ci(r['diff'], r['diff_low'], r['diff_high'], signed=True)})"
        )  # fmt: skip
    ppl_md = "No held-out perplexity was measured."
    ppl_sentence = ""
    if not ppl.empty:
        ppl_md = markdown_table(
            ppl[["policy", "rows", "ppl_met", "ppl_nonmet", "ppl_all"]].rename(
                columns={"ppl_met": "MET", "ppl_nonmet": "Non-MET", "ppl_all": "all"}
            ),
            floatfmt=".1f",
        )
        pp = ppl.set_index("policy")
        ppl_sentence = "; ".join(
            f"{algorithm_label(p)} {pp.loc[p, 'ppl_all']:.1f}" for p in pp.index
        )
    fin = s["finished"].dropna() if "finished" in s else pd.Series(dtype=float)
    marker = f"{HEADS_FOLDER}/{HEADS_MARKER}"  # the reward heads' settings (reward_uncertainty)
    heads = run.read_json(marker) if run.exists(marker) else None
    variables = {
        "n_prompts": str(meta["n_prompts"]),
        "level": lvl,
        "k": str(meta["samples_per_prompt"]),
        "best_n": str(meta["best_of_n"]),
        "algo_sentences": "; ".join(sentences) if sentences else "No RL algorithm was evaluated",
        "conclusion": "; ".join(concl) if concl else "no tuned policy was evaluated",
        "history_sentence": hist_sentence,
        "random_policy": num(hist.get("random_policy", float("nan"))),
        "base_ave_r": num(s.loc["base", "ave_r"]),
        "start": start,
        "family_level": fam,
        "multiplicity_rule": MULTIPLICITY_RULE,
        "family_sentence": family_sentence(paired, start, fam, meta.get("power", 0.8)),
        "design_sentence": design_sentence(design, meta.get("target_mde")),
        "margin": num(margin if margin is not None else math.nan),
        "power": f"{meta.get('power', 0.8):.0%}",
        "families": families_sentence(run, paired, vs_bon, start),
        "start_ave_r": num(s.loc[start, "ave_r"]),
        "bon_sentences": "; ".join(bon_sentences)
        if bon_sentences
        else "No RL algorithm was compared with best-of-N",
        "bon_curve": ", ".join(str(n) for n in meta.get("best_of_n_curve", [])),
        "ppl_sentence": ppl_sentence,
        "finished_sentence": "; ".join(f"{algorithm_label(p)} {v:.0%}" for p, v in fin.items()),
        "best_ave_r": num(b["ave_r"]),
        "best_gain": f"{b['gain']:+.3f}",
        "best_audit_gain": f"{b['audit_gain']:+.3f}",
        "best_kl": f"{b['kl']:.2f}",
        "grounding_sentence": "; ".join(
            f"{algorithm_label(p)} {num(r['grounded_met'])}" for p, r in g.iterrows()
        ),
        "uncertainty_sentence": uncertainty_sentence(s, algos, start, lvl, heads),
    }
    return variables, {
        "eval_summary.md": summary_md,
        "eval_cost.md": cost_md,
        "eval_paired.md": markdown_table(pt),
        "eval_table3.md": t3_md,
        "eval_variance_components.md": variance_md(components),
        "eval_design.md": design_md(design),
        "eval_heldout_perplexity.md": ppl_md,
    }


def families_sentence(run: RunDir, paired: pd.DataFrame, vs_bon: pd.DataFrame, start: str) -> str:
    """Every family of comparisons with its members and size, once: each method against the
    start policy (per measure), each RL policy against best-of-N, and each question of the
    RLGF and offline-methods tables (per measure)."""
    stage = "notebook 04_evaluation"
    items = []
    if len(paired):
        rows = paired[paired["measure"] == "reward"] if "measure" in paired else paired
        items.append(
            f"each method against `{start}` (m = {len(rows)} under the reward model, the audit, "
            f"their gap and the reward heads' SD each, at {family_level(paired)})"
        )
    if len(vs_bon):
        items.append(
            f"each trained algorithm against best-of-N at its KL (m = {len(vs_bon)}, at "
            f"{level(1 - float(vs_bon['ci_level'].iloc[0])) if 'ci_level' in vs_bon else 'n/a'})"
        )
    for name, what in (("eval_guidance", "the RLGF questions"),
                       ("eval_rl_vs_offline", "RL against the offline methods")):  # fmt: skip
        if not run.exists(f"tables/{name}.csv"):
            continue
        t = run.read_table(name, stage)
        if t.empty:
            continue
        sizes = t.groupby(["question", "measure"], sort=False).size()
        qs = listing(sorted({f"{q} (m = {n})" for (q, _), n in sizes.items()}))
        items.append(f"{what}, one family per question and measure: {qs}")
    items.append("the ILHF tests, easy against hard prompts and the seeds' pooled gains are "
                 "families of their own, sized in their tables")  # fmt: skip
    return "The families: " + "; ".join(items)


def uncertainty_sentence(
    s: pd.DataFrame, algos: list[str], start: str, lvl: str, heads: dict[str, Any] | None
) -> str:
    """The reward heads' verdict per RL policy (`sd_verdict`: from the CI of `sd_gain`), with the
    mean SD of P(MET) and its change; `s` is the eval summary indexed by policy, `heads` the
    marker of `reward_model/uncertainty/` (None when the run fitted none)."""
    measured = (
        "reward_sd" in s.columns and start in s.index and is_present(s.loc[start, "reward_sd"])
    )
    if not measured:
        return (
            "This run measured no reward uncertainty: its reward source has no encoder features "
            "or evaluation.reward_heads is 0"
        )
    rows = heads["settings"].get("n_rows", "n/a") if heads else "n/a"
    intro = f"This run fitted {heads['n_heads']} heads on {rows} training rows. " if heads else ""
    parts = []
    for algo in algos:
        if algo not in s.index:
            continue
        r = s.loc[algo]
        low, high = r.get("sd_gain_low", math.nan), r.get("sd_gain_high", math.nan)
        parts.append(
            f"{algorithm_label(algo)} {sd_verdict(low, high)} (mean SD "
            f"{ci(r['reward_sd'], r['reward_sd_low'], r['reward_sd_high'])}; paired change "
            f"{ci(r.get('sd_gain', math.nan), low, high, signed=True)})"
        )
    start_sd = ci(
        s.loc[start, "reward_sd"], s.loc[start, "reward_sd_low"], s.loc[start, "reward_sd_high"]
    )
    body = "; ".join(parts) if parts else "no RL policy was evaluated"
    return (
        f"{intro}Against the start policy {start} (mean SD {start_sd}), with {lvl} "
        f"cluster-bootstrap intervals of the paired change: {body}"
    )


def table_note(text: str) -> str:
    """A one-cell table standing in for one the run lacks (captions and cross-references hold)."""
    return markdown_table(pd.DataFrame({"note": [text]}))


def eval_meta(run: RunDir, params: dict[str, Any], stage: str) -> tuple[list[str], str, float]:
    """(RL algorithms, start policy, alpha) of notebook 04's summary, falling back to the run's
    parameters for a summary that predates those fields."""
    meta = run.read_json("eval/summary.json", stage=stage)
    algos = list(meta.get("algorithms", params.get("rl", {}).get("algorithm", [])))
    alpha = meta.get("alpha", params.get("evaluation", {}).get("alpha", 0.05))
    return algos, meta.get("start_policy", "base"), alpha


# -- notebook 04's narrative --------------------------------------------------------------------
HISTORY_WORDS = {
    "history_met": "real MET descriptions",
    "history_nonmet": "real Non-MET descriptions",
    "random_policy": "randomly drawn real descriptions",
}


def policy_lines(
    summary: pd.DataFrame, algos: list[str], start: str, meta: dict[str, Any], ec: Any
) -> str:
    """Per RL policy: Ave(R), its gain over the start policy (its family's simultaneous interval),
    the audit's verdict, KL and perplexity; then best-of-N and the history references."""
    lines = []
    s = summary.loc[start]
    for algo in algos:
        r = summary.loc[algo]
        word = say("versus_start", r.gain_low, r.gain_high)
        verdict = f"{word} the start policy (family p = {r.gain_p_family:.3g})"
        audit = say("audit_move", r.audit_gain_low, r.audit_gain_high)
        lines.append(
            f"- **{algorithm_label(algo)}**: Ave(R) {ci(r.ave_r, r.ave_r_low, r.ave_r_high)} "
            f"vs {start} {s['ave_r']:.3f}; a gain of {ci(r.gain, r.gain_low, r.gain_high, signed=True)}, "
            f"{verdict}. Under the audit model the reward {audit} ({r.audit_gain:+.3f} "
            f"{interval(r.audit_gain_low, r.audit_gain_high)}). KL to the starting policy {r.kl:.2f} "
            f"nats; perplexity {r.perplexity:.1f} ({start} {s['perplexity']:.1f})."
        )
    b = summary.loc["best_of_n"]
    lines.append(
        f"- **Best-of-{ec.best_of_n}**: Ave(R) {b.ave_r:.3f} (gain {b.gain:+.3f}, optimistic: the same "
        f"model selects and scores), audit gain {b.audit_gain:+.3f}, at a KL of at most {b.kl:.2f} nats "
        "(candidates drawn independently of the start policy's own samples)."
    )
    parts = [
        f"{text} score {summary.loc[p, 'ave_r']:.3f} ({int(summary.loc[p, 'n_prompts'])} prompts)"
        if p in summary.index
        else f"no held-out context has {text}"
        for p, text in HISTORY_WORDS.items()
    ]
    hc = meta["history_contrast"].get("reward")
    if hc:
        word = say("position_from", hc["ci_low"], hc["ci_high"])
        parts.append(
            f"on the {hc['n']} prompts ({hc['n_clusters']} countries) with both, the reward model "
            f"places what was met **{word}** what was not (difference {hc['mean_diff']:+.3f} "
            f"{interval(hc['ci_low'], hc['ci_high'])})"
        )
    lines.append(
        "- **History** (rows no reward or audit model trained on): " + "; ".join(parts) + "."
    )
    return "\n".join(lines)


def gap_lines(gap: pd.DataFrame) -> str:
    """Per policy: the reward model's gain against the audit's, and whether the gap is real."""
    return "\n".join(
        f"- **{p}**: reward-model gain {r.gain:+.3f}, audit gain {r.audit_gain:+.3f}, gap {r.gap:+.3f} "
        f"{interval(r.gap_low, r.gap_high)}: the reward model's gain is **"
        f"{say('gap', r.gap_low, r.gap_high)}"
        "** the audit's."
        for p, r in gap.iterrows()
    )


def uncertainty_lines(unc: pd.DataFrame, algos: list[str], start: str) -> str:
    """Per RL policy: whether the reward heads disagree more on its responses than on the start's."""
    if not unc["reward_sd"].notna().any():
        return (
            "No reward uncertainty in this run: the reward source has no encoder features or "
            "`evaluation.reward_heads` is 0."
        )
    return "\n".join(
        f"- **{algorithm_label(a)}** {sd_verdict(r.sd_gain_low, r.sd_gain_high)}: mean SD "
        f"{r.reward_sd:.4f} against {unc.loc[start, 'reward_sd']:.4f} for {start}, paired change "
        f"{ci(r.sd_gain, r.sd_gain_low, r.sd_gain_high, signed=True, digits=4)} (Ave(R) {r.ave_r:.3f})"
        for a, r in unc.loc[algos].iterrows()
    )


def versus_best_of_n_lines(vs: pd.DataFrame) -> str:
    """Each RL policy against best-of-N at its own KL."""
    return "\n".join(
        f"- **{algorithm_label(r.policy)}** at {r.kl:.2f} nats: Ave(R) {r.ave_r:.3f} against "
        f"best-of-N's {r.best_of_n_at_kl:.3f} at {r.best_of_n_kl:.2f} nats"
        f"{' (its KL is beyond the curve: the largest N)' if r.beyond_curve else ''}: difference "
        f"{ci(r.diff, r.diff_low, r.diff_high, signed=True)}, **{r.verdict}**."
        for r in vs.itertuples()
    )


def grounding_lines(summary: pd.DataFrame) -> str:
    """Per policy: the MET rate of the nearest historical conditions and the closest similarity."""
    g = summary.dropna(subset=["grounded_met"])
    return "\n".join(
        f"- **{p}**: neighbours' MET rate {r.grounded_met:.3f} [{r.grounded_low:.3f}, "
        f"{r.grounded_high:.3f}], closest similarity {r.max_sim:.3f}."
        for p, r in g.iterrows()
    )
