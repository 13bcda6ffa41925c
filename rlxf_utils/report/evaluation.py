"""The evaluation section: gains over the start policy, the audit, best-of-N, history and the
reward model's uncertainty. The words are the author's, in `reports/templates/eval.jinja`; here,
the numbers, verdict codes and policy ids they need, and the section's tables."""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from rlxf_utils.artifacts import RunDir
from rlxf_utils.evaluation.best_of_n import best_of_n_kl_bound
from rlxf_utils.markdown import is_present, markdown_table
from rlxf_utils.report.gold import gold_auc, gold_cannot_judge
from rlxf_utils.report.wording import EQUIVALENT, display_name, num, sentence, table
from rlxf_utils.reward.uncertainty import FOLDER as HEADS_FOLDER
from rlxf_utils.reward.uncertainty import MARKER as HEADS_MARKER
from rlxf_utils.stats import bound_verdict, level

STAGE = "notebook 04_evaluation"

#: The tables whose questions are families of their own (notebook 04).
QUESTIONS = ("eval_guidance", "eval_rl_vs_offline")

#: The section's sentences (the report's variables) and the context each macro reads.
SENTENCES = {"algo_sentences": "algos", "conclusion": "algos", "history_sentence": "history",
             "family_sentence": "family", "design_sentence": "design", "families": "families",
             "bon_sentences": "bon", "ppl_sentence": "ppl", "finished_sentence": "finished",
             "grounding_sentence": "grounding", "uncertainty_sentence": "uncertainty",
             "cut_rule": "cut"}  # fmt: skip


def cut_rule(summary: dict[str, Any]) -> dict[str, Any] | None:
    """How the run scored a response still cut at the evaluation's token cap (`eval/summary.json`:
    `rule` 'failed' or 'as_written', the evaluation's `cap` and RL's `rl_cap`); None for runs
    from before evaluation had a cap and a rule of its own (they scored a cut response as
    written, at RL's cap)."""
    if summary.get("cut_responses") is None:
        return None
    return {"rule": summary["cut_responses"], "cap": summary.get("max_new_tokens"),
            "rl_cap": summary.get("rl_max_new_tokens")}  # fmt: skip


def gain(r: pd.Series, col: str, margin: float | None = None) -> dict[str, Any]:
    """A gain of row `r` (`col`, its family's interval and p-value) and whether its interval lies
    within ±`margin` (`stats.bound_verdict`)."""
    low, high = r.get(f"{col}_low", math.nan), r.get(f"{col}_high", math.nan)
    return {"est": r.get(col, math.nan), "low": low, "high": high,
            "p": r.get(f"{col}_p_family", math.nan),
            "equivalent": bound_verdict(low, high, margin) == EQUIVALENT}  # fmt: skip


def _interval(r: pd.Series, col: str) -> dict[str, Any]:
    return {k: r.get(col + end, math.nan) for k, end in (("est", ""), ("low", "_low"), ("high", "_high"))}  # fmt: skip


def algos_context(s: pd.DataFrame, algos: list[str], start: str, fam: str,
                  margin: float | None, gold: dict[str, Any] | None) -> dict[str, Any]:  # fmt: skip
    """Per RL policy, its gain and audit gain with their verdicts; under a gold at chance every
    audit claim, rise, fall or null, is one the gold cannot judge (`audit.cannot_judge`,
    `gold.gold_cannot_judge`), and the first such policy says the gold's AUC (`gold_words`),
    once."""
    out, said = [], False
    for algo in algos:
        r = s.loc[algo]
        a = {"policy": algo, "ave_r": r["ave_r"], "ave_r_low": r["ave_r_low"],
             "ave_r_high": r["ave_r_high"], "gain": gain(r, "gain", margin),
             "audit": gain(r, "audit_gain", margin), "kl": r["kl"],
             "gap_low": r.get("gap_low", math.nan), "gap_high": r.get("gap_high", math.nan),
             "perplexity": r.get("perplexity", math.nan)}  # fmt: skip
        at_chance = gold_cannot_judge(gold, a["audit"]["low"], a["audit"]["high"])
        a["audit"]["cannot_judge"], a["gold_words"] = at_chance, at_chance and not said
        said = said or at_chance
        out.append(a)
    return {"algos": out, "start": start, "start_ave_r": s.loc[start, "ave_r"], "level": fam,
            "margin": margin, "gold": gold}  # fmt: skip


def history_context(s: pd.DataFrame, contrast: dict[str, Any]) -> dict[str, Any] | None:
    """Real MET against real Non-MET descriptions of the same held-out contexts, per judge from
    the paired interval over prompts (`history_contrast`); None where they do not hold both."""
    if not ("history_met" in s.index and "history_nonmet" in s.index and contrast.get("reward")):
        return None
    judges = [{"judge": col, "diff": h["mean_diff"], "low": h["ci_low"], "high": h["ci_high"]}
              for col in ("reward", "audit_reward") if (h := contrast.get(col))]  # fmt: skip
    return {"met": s.loc["history_met", "ave_r"], "nonmet": s.loc["history_nonmet", "ave_r"],
            "n": contrast["reward"]["n"], "clusters": contrast["reward"]["n_clusters"],
            "judges": judges}  # fmt: skip


def family_mde(paired: pd.DataFrame, measure: str) -> float:
    """The family's minimum detectable effect under one measure: the median over its comparisons
    of each one's MDE (`stats.power.mde` from its own standard error); NaN for runs from before."""
    if "mde" not in paired or "measure" not in paired:
        return math.nan
    vals = paired.loc[paired["measure"] == measure, "mde"].dropna()
    return float(vals.median()) if len(vals) else math.nan


def _reward_rows(paired: pd.DataFrame) -> pd.DataFrame:
    return paired[paired["measure"] == "reward"] if "measure" in paired else paired


def family_context(paired: pd.DataFrame, start: str, fam: str, power: float) -> dict[str, Any]:
    """The vs-start family: its members, and its MDE under each judge that has one."""
    mdes = [{"judge": m, "mde": v} for m in ("reward", "audit_reward")
            if is_present(v := family_mde(paired, m))]  # fmt: skip
    return {"start": start, "policies": list(_reward_rows(paired)["policy"]), "level": fam,
            "power": power, "mdes": mdes}  # fmt: skip


def design_context(design: pd.DataFrame, target: float | None) -> dict[str, Any]:
    """Per judge, this run's design and the cheapest one reaching `target` (or, where none does,
    every held-out context and how many held-out countries would reach it), from `eval_design`."""
    judges = []
    for judge, g in design.groupby("judge", sort=False) if len(design) else ():
        d = g.set_index("design")
        own = d.loc["this run"]
        reach = [n for n in d.index if n.startswith("cheapest reaching")]
        j = {"judge": judge, "prompts": int(own["prompts"]), "countries": int(own["countries"]),
             "k": int(own["samples_per_prompt"]), "mde": own["mde"],
             "minutes": own["cost_s"] / 60, "reach": None, "every": None}  # fmt: skip
        if reach:
            r = d.loc[reach[0]]
            j["reach"] = {"prompts": int(r["prompts"]), "k": int(r["samples_per_prompt"]),
                          "minutes": r["cost_s"] / 60}  # fmt: skip
        elif target is not None and "every held-out context" in d.index:
            e = d.loc["every held-out context"]
            j["every"] = {
                "prompts": int(e["prompts"]),
                "countries": int(e["countries"]),
                "mde": e["mde"],
                "needed": None,
            }
            more = [n for n in d.index if n.startswith("countries needed")]
            if more:
                n = d.loc[more[0]]
                j["every"]["needed"] = {"countries": int(n["countries"]),
                                        "prompts": int(n["prompts"]), "minutes": n["cost_s"] / 60}  # fmt: skip
        judges.append(j)
    return {"judges": judges, "target": target}


def family_level(paired: pd.DataFrame, measure: str = "reward") -> str:
    """The confidence level of one family's simultaneous intervals ('99.4%'), from
    `eval_paired`'s `ci_level` (the plain level of runs from before the rule)."""
    rows = paired[paired["measure"] == measure] if "measure" in paired else paired
    if "ci_level" not in rows or rows["ci_level"].dropna().empty:
        return level(0.05)
    return level(1 - float(rows["ci_level"].dropna().iloc[0]))


def families_context(questions: dict[str, pd.DataFrame], paired: pd.DataFrame,
                     vs_bon: pd.DataFrame, start: str,
                     unmatched: pd.DataFrame | None = None,
                     kl_ratio: float | None = None) -> dict[str, Any]:  # fmt: skip
    """Every family of comparisons with its size: each method against the start policy, each RL
    policy against best-of-N, and each question of the RLGF and offline-methods tables
    (`questions`: `eval_guidance` and `eval_rl_vs_offline`, empty where the run lacks them); and
    the pairs those questions left out for their KLs (`unmatched`: `eval_kl_unmatched`, more
    than `kl_ratio` apart)."""
    tables = []
    for name, t in questions.items():
        if len(t):
            sizes = t.groupby(["question", "measure"], sort=False).size()
            qs = sorted({(q, int(n)) for (q, _), n in sizes.items()}, key=lambda x: (x[0], str(x[1])))  # fmt: skip
            tables.append({"table": name, "questions": qs})
    bon_alpha = 1 - float(vs_bon["ci_level"].iloc[0]) if "ci_level" in vs_bon else None
    return {"start": start,
            "vs_start": {"m": len(_reward_rows(paired)), "level": family_level(paired)}
            if len(paired) else None,
            "vs_best_of_n": {"m": len(vs_bon), "alpha": bon_alpha} if len(vs_bon) else None,
            "tables": tables, "kl_ratio": kl_ratio,
            "unmatched": [{k: r[k] for k in ("policy", "versus", "kl", "kl_versus")}
                          for _, r in (unmatched if unmatched is not None else pd.DataFrame()).iterrows()]}  # fmt: skip


def bon_context(vs_bon: pd.DataFrame, curve: list[int]) -> list[dict[str, Any]]:
    """Each policy against the best-of-N curve at its KL (the curve's KL it was compared at:
    older runs lack it, and read the smaller of its own KL and the curve's end)."""
    end = best_of_n_kl_bound(max(curve or [1]))

    def kl(r: pd.Series) -> float:
        return r["best_of_n_kl"] if pd.notna(r.get("best_of_n_kl")) else min(r["kl"], end)

    return [{"policy": r["policy"], "ave_r": r["ave_r"], "kl": r["kl"],
             "best_of_n": r["best_of_n_at_kl"], "best_of_n_kl": kl(r),
             "beyond": bool(r["beyond_curve"]), "verdict": r["verdict"], "diff": r["diff"],
             "low": r["diff_low"], "high": r["diff_high"]}
            for _, r in vs_bon.iterrows()]  # fmt: skip


def uncertainty_context(s: pd.DataFrame, algos: list[str], start: str, lvl: str,
                        heads: dict[str, Any] | None, fam: str | None = None) -> dict[str, Any]:  # fmt: skip
    """The reward heads' SD per RL policy and its paired change against the start policy; `s` is
    the eval summary indexed by policy, `heads` the marker of `reward_model/uncertainty/` (None
    when the run fitted none). Each mean SD's interval is a cluster bootstrap at `lvl`; the
    paired change's is the vs-start family's cluster t at `fam` (`tables.summary_table`'s
    `sd_gain`; `lvl` where not given)."""
    measured = "reward_sd" in s and start in s.index and is_present(s.loc[start, "reward_sd"])
    if not measured:
        return {"measured": False}
    return {"measured": True, "start": start, "level": lvl, "family_level": fam or lvl,
            "heads": {"n": heads["n_heads"], "rows": heads["settings"].get("n_rows", "n/a")}
            if heads else None,
            "sd": _interval(s.loc[start], "reward_sd"),
            "policies": [{"policy": a, "ave_r": s.loc[a, "ave_r"],
                          "sd": _interval(s.loc[a], "reward_sd"),
                          "change": _interval(s.loc[a], "sd_gain")}
                         for a in algos if a in s.index]}  # fmt: skip


def _scores(values: pd.Series) -> list[list[Any]]:
    return [[p, v] for p, v in values.items()]


def eval_section(run: RunDir, alpha: float = 0.05) -> tuple[dict[str, Any], dict[str, str]]:
    """The section's variables (its sentences, `SENTENCES`, and numbers) and tables."""
    meta = run.read_json("eval/summary.json", stage=STAGE)
    s = pd.DataFrame(meta["summary"]).set_index("policy")
    paired = run.read_table("eval_paired", STAGE)
    start = meta.get("start_policy", "base")
    vs_bon = pd.DataFrame(meta.get("vs_best_of_n", []))
    lvl, fam = level(meta.get("alpha", alpha)), family_level(paired)
    design = _optional(run, "eval_design")
    marker = f"{HEADS_FOLDER}/{HEADS_MARKER}"  # the reward heads' settings (reward_uncertainty)
    ppl = pd.DataFrame(meta.get("heldout_perplexity", []))
    fin = s["finished"].dropna() if "finished" in s else pd.Series(dtype=float)
    gold = gold_auc(run)
    context = {
        "algos": algos_context(s, meta["algorithms"], start, fam, meta.get("equivalence_margin"),
                               gold),
        "history": history_context(s, meta.get("history_contrast", {})),
        "family": family_context(paired, start, fam, meta.get("power", 0.8)),
        "design": design_context(design, meta.get("target_mde")),
        "families": families_context({t: _optional(run, t) for t in QUESTIONS}, paired, vs_bon, start,
                                     _optional(run, "eval_kl_unmatched"),
                                     meta.get("kl_match_ratio")),
        "bon": bon_context(vs_bon, meta.get("best_of_n_curve")),
        "ppl": _scores(ppl.set_index("policy")["ppl_all"]) if len(ppl) else [],
        "finished": _scores(fin),
        "cut": cut_rule(meta),
        "grounding": _scores(s["grounded_met"].dropna()),
        "uncertainty": uncertainty_context(s, meta["algorithms"], start, lvl,
                                           run.read_json(marker) if run.exists(marker) else None,
                                           fam),
    }  # fmt: skip
    variables = {k: sentence("eval", k, context[c]) for k, c in SENTENCES.items()}
    return {
        **variables,
        **eval_numbers(meta, s, lvl, fam),
        "multiplicity_rule": sentence("eval", "multiplicity_rule"),
        "gold_rule": sentence("eval", "gold_rule", gold),
    }, {
        "eval_summary.md": summary_md(s, start, lvl, fam),
        "eval_cost.md": cost_md(s, lvl),
        "eval_paired.md": paired_md(paired, fam, meta.get("equivalence_margin")),
        "eval_table3.md": table3_md(run.read_table("eval_table3", STAGE)),
        "eval_variance_components.md": variance_md(_optional(run, "eval_variance_components")),
        "eval_design.md": design_md(design),
        "eval_heldout_perplexity.md": perplexity_md(ppl),
    }


def eval_numbers(meta: dict[str, Any], s: pd.DataFrame, lvl: str, fam: str) -> dict[str, str]:
    """The numbers the section's text quotes (the report's variables beside the sentences)."""
    b, margin = s.loc["best_of_n"], meta.get("equivalence_margin")
    return {
        "n_prompts": str(meta["n_prompts"]), "level": lvl,
        "k": str(meta["samples_per_prompt"]), "best_n": str(meta["best_of_n"]),
        "random_policy": num(s["ave_r"].get("random_policy", math.nan)),
        "base_ave_r": num(s.loc["base", "ave_r"]), "start": display_name(meta.get("start_policy", "base")),
        "family_level": fam, "margin": num(margin if margin is not None else math.nan),
        "power": f"{meta.get('power', 0.8):.0%}",
        "start_ave_r": num(s.loc[meta.get("start_policy", "base"), "ave_r"]),
        "bon_curve": ", ".join(str(n) for n in meta.get("best_of_n_curve", [])),
        "best_ave_r": num(b["ave_r"]), "best_gain": num(b["gain"], signed=True),
        "best_audit_gain": num(b["audit_gain"], signed=True), "best_kl": f"{b['kl']:.2f}",
    }  # fmt: skip


def _optional(run: RunDir, name: str) -> pd.DataFrame:
    """A table of notebook 04 that runs from before it lack: empty there."""
    return run.read_table(name, STAGE) if run.exists(f"tables/{name}.csv") else pd.DataFrame()


# -- the tables (their columns: reports/templates/tables.yaml) ----------------------------------
def summary_md(s: pd.DataFrame, start: str, lvl: str, fam: str) -> str:
    """Per policy: Ave(R), the reward heads' SD, the gain over the start policy, the audit and its
    gain, and the reward − audit gap, each with its interval."""
    return table("eval_summary", s.reset_index(), lvl=lvl, fam=fam, start=start)


def cost_md(s: pd.DataFrame, lvl: str) -> str:
    """Per policy: what its reward cost (KL, perplexity, length, variety) and its grounding."""
    return table("eval_cost", s.reset_index(), lvl=lvl)


def paired_md(paired: pd.DataFrame, fam: str, margin: float | None) -> str:
    """Each comparison of the vs-start families with its verdict and reference tests."""
    return table("eval_paired", paired, fam=fam, margin=margin)


def table3_md(t3: pd.DataFrame) -> str:
    """Example responses with their rewards."""
    return table("eval_table3", t3)


def perplexity_md(ppl: pd.DataFrame) -> str:
    """Held-out perplexity per policy, of MET, Non-MET and all descriptions."""
    if ppl.empty:
        return sentence("eval", "no_perplexity")
    return table("eval_heldout_perplexity", ppl, floatfmt=".1f")


def variance_md(components: pd.DataFrame) -> str:
    """The appendix table of variance components: per policy and judge, the three components
    (×10⁴), the predicted SE and the mean paired difference."""
    if components.empty:
        return table_note(sentence("eval", "no_components"))
    return table("eval_variance_components", components, floatfmt=".2f")


def design_md(design: pd.DataFrame) -> str:
    """The appendix table of designs: prompts, samples per prompt, countries, predicted SE,
    degrees of freedom, MDE and sampling minutes, per judge."""
    if design.empty:
        return table_note(sentence("eval", "no_design"))
    return table("eval_design", design)


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


# -- notebook 04's lists, one item a macro --------------------------------------------------------
HISTORY = ("history_met", "history_nonmet", "random_policy")


def policy_lines(
    summary: pd.DataFrame, algos: list[str], start: str, meta: dict[str, Any], ec: Any
) -> str:
    """Per RL policy: Ave(R), its gain over the start policy (its family's simultaneous interval),
    the audit's verdict, KL and perplexity; then best-of-N and the history references."""
    c = {**algos_context(summary, algos, start, "", None, None),
         "start_ppl": summary.loc[start, "perplexity"]}  # fmt: skip
    lines = [sentence("eval", "policy_item", a, c) for a in c["algos"]]
    b = summary.loc["best_of_n"]
    lines.append(
        sentence(
            "eval",
            "best_of_n_item",
            {"n": ec.best_of_n, **b[["ave_r", "gain", "audit_gain", "kl"]].to_dict()},
        )
    )
    refs = [{"policy": p, "ave_r": summary.loc[p, "ave_r"] if p in summary.index else None,
             "prompts": int(summary.loc[p, "n_prompts"]) if p in summary.index else None}
            for p in HISTORY]  # fmt: skip
    hc = meta["history_contrast"].get("reward")
    contrast = hc and {"n": hc["n"], "clusters": hc["n_clusters"], "diff": hc["mean_diff"],
                       "low": hc["ci_low"], "high": hc["ci_high"]}  # fmt: skip
    lines.append(sentence("eval", "history_item", {"refs": refs, "contrast": contrast or None}))
    return "\n".join(lines)


def gap_lines(gap: pd.DataFrame) -> str:
    """Per policy: the reward model's gain against the audit's, and whether the gap is real."""
    return "\n".join(
        sentence("eval", "gap_item", {"policy": p, "gain": r.gain, "audit_gain": r.audit_gain,
                                      "gap": r.gap, "low": r.gap_low, "high": r.gap_high})
        for p, r in gap.iterrows()
    )  # fmt: skip


def uncertainty_lines(unc: pd.DataFrame, algos: list[str], start: str) -> str:
    """Per RL policy: whether the reward heads disagree more on its responses than on the start's."""
    c = uncertainty_context(unc, algos, start, "", None)
    if not c["measured"]:
        return sentence("eval", "no_uncertainty_item")
    return "\n".join(sentence("eval", "uncertainty_item", a, c) for a in c["policies"])


def versus_best_of_n_lines(vs: pd.DataFrame) -> str:
    """Each RL policy against best-of-N at its own KL."""
    return "\n".join(sentence("eval", "versus_best_of_n_item", b) for b in bon_context(vs, []))


def grounding_lines(summary: pd.DataFrame) -> str:
    """Per policy: the MET rate of the nearest historical conditions and the closest similarity."""
    return "\n".join(
        sentence("eval", "grounding_item", {"policy": p, "met": r.grounded_met, "low": r.grounded_low,
                                            "high": r.grounded_high, "max_sim": r.max_sim})
        for p, r in summary.dropna(subset=["grounded_met"]).iterrows()
    )  # fmt: skip
