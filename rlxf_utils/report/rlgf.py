"""The RLGF section: does guidance beat PPO, and where (easy and hard prompts). The sentences are
macros of `reports/templates/rlgf.jinja`; this module reads notebook 03 and 04's tables into
their contexts (numbers, verdict codes, ids) and writes the tables."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from rlxf_utils.algorithms import RLGF_ALGORITHMS
from rlxf_utils.artifacts import RunDir
from rlxf_utils.evaluation.rlgf import (
    HALVES,
    MEASURES,
    easy_hard_gain_level,
    guidance_comparator,
    policy_label,
)
from rlxf_utils.markdown import is_present
from rlxf_utils.prompts import CONTEXT_FIELDS
from rlxf_utils.report.evaluation import eval_meta, table_note
from rlxf_utils.report.gold import gold_auc
from rlxf_utils.report.wording import display_name, num, sentence, table, value
from rlxf_utils.stats import bound_verdict, level


def comparisons(g: pd.DataFrame, policies: Sequence[str], versus: str,
                alpha: float, gold_at_chance: bool = False) -> list[dict[str, Any]]:  # fmt: skip
    """`comparison` contexts: each of `policies` that `g` (rows of `guidance_table`) compares
    with `versus`, its verdict code and difference under each measure, its family's alpha
    (`ci_level`; else `alpha`) and `gold_at_chance` (the audit's own AUC interval on held-out
    rows holds 0.5: its verdict is one it cannot interpret, `report.gold.gold_cannot_judge`)."""
    out = []
    for a in policies:
        if a not in set(g["policy"]):
            continue
        rows = g[(g["policy"] == a) & (g["versus"] == versus)].set_index("measure")
        family = alpha
        if "ci_level" in rows and rows["ci_level"].notna().any():  # the question's family level
            family = 1 - float(rows["ci_level"].dropna().iloc[0])
        measures = [
            {"measure": m, "verdict": rows.loc[m, "verdict"],
             **{k: value(rows.loc[m, k]) for k in ("diff", "low", "high")}}
            for m in MEASURES if m in rows.index
        ]  # fmt: skip
        out.append({"policy": a, "versus": versus, "alpha": family, "measures": measures,
                    "gold_at_chance": gold_at_chance})  # fmt: skip
    return out


def critics_context(guidance_log: pd.DataFrame) -> dict[str, Any]:
    """`critics_sentence`: what each guided algorithm's two critics explained on their own tokens
    (notebook 03's `rlgf_guidance`: mean explained variance over the scheme's steps, and the
    shared reward-model prior's alone), so a reader sees whether V_g and V_theta differ beyond
    the prior they share; None without a guided algorithm."""
    if guidance_log.empty or "critic" not in guidance_log:
        return {"algorithms": None}
    algorithms = []
    for algo, g in guidance_log.groupby("algorithm", sort=False):
        critics = [
            {"critic": r["critic"], "ev": value(r["explained_variance"]), "steps": int(r["steps"]),
             "prior": value(r["explained_variance_prior"])}
            for _, r in g.iterrows()
            if is_present(r["explained_variance"])
        ]  # fmt: skip
        if critics:
            algorithms.append({"algorithm": algo, "critics": critics})
    return {"algorithms": algorithms}


def guidance_context(guidance: pd.DataFrame | None, algos: Sequence[str],
                     alpha: float, gold_at_chance: bool = False) -> dict[str, dict[str, Any]]:  # fmt: skip
    """The contexts of the two verdicts, `guidance_sentence` (guided algorithms vs PPO) and
    `rl_vs_sft_met_sentence`: which comparisons notebook 04 made, each with its verdict codes."""
    guided = [a for a in algos if a in RLGF_ALGORITHMS]
    g = guidance if guidance is not None else pd.DataFrame(columns=["question"])
    ppo = guidance_comparator(algos) if guided else None
    gq = g[g["question"] == "guidance_vs_ppo"]
    rq = g[g["question"] == "rl_vs_sft_met"]
    return {
        "guidance": {
            "algorithms": list(algos), "guided": guided, "comparator": ppo,
            "evaluated": bool(gq.shape[0]),
            "comparisons": comparisons(gq, guided, ppo, alpha, gold_at_chance)
            if ppo and len(gq) else [],
        },
        "rl_vs_sft_met": {"evaluated": not rq.empty,
                          "comparisons": comparisons(rq, algos, "sft_met", alpha, gold_at_chance)
                          if len(rq) else []},
    }  # fmt: skip


def guidance_sentences(
    guidance: pd.DataFrame | None, algos: Sequence[str], alpha: float
) -> dict[str, str]:
    """The two verdicts as prose: `guidance` (guided algorithms vs PPO) and `rl_vs_sft_met`,
    macros of `reports/templates/rlgf.jinja`; each verb is read from its interval's verdict code
    (the vocabulary's 'beat'); a run without a guided algorithm, without PPO or without `sft_met`
    says so instead."""
    c = guidance_context(guidance, algos, alpha)
    return {
        "guidance": sentence("rlgf", "guidance_sentence", c["guidance"]),
        "rl_vs_sft_met": sentence("rlgf", "rl_vs_sft_met_sentence", c["rl_vs_sft_met"]),
    }


def easy_hard_context(easy_hard: pd.DataFrame | None, start: str, alpha: float,
                      preamble: bool = True) -> dict[str, Any]:  # fmt: skip
    """`easy_hard_sentence`: each tuned policy against the start policy on easy and on hard
    prompts, and whether its gain differs between the halves (verdict codes and intervals), at
    the gains' family level (`alpha`: 1 - `gain_ci_level`, the given `alpha` for a table without
    it). Without `preamble` the sentence leaves out how prompts were split (the report says it
    before)."""
    if easy_hard is None or easy_hard.empty:
        return {"placed": False}
    levels = easy_hard.get("gain_ci_level", pd.Series(dtype=float)).dropna()
    alpha = 1 - float(levels.iloc[0]) if len(levels) else alpha  # the gains' family's
    labels = dict(zip(easy_hard["policy"], easy_hard["label"], strict=True))
    policies = []
    for pol, g in easy_hard.groupby("policy", sort=False):
        if pol == start:
            continue
        h = g.set_index("half")
        halves = [
            {"half": half, "verdict": h.loc[half, "gain_verdict"],
             "gain": value(h.loc[half, "gain"]), "low": value(h.loc[half, "gain_low"]),
             "high": value(h.loc[half, "gain_high"])}
            for half in HALVES if half in h.index and pd.notna(h.loc[half, "gain"])
        ]  # fmt: skip
        if not halves:
            continue
        d = h.loc["hard_minus_easy"] if "hard_minus_easy" in h.index else None
        diff = None if d is None or pd.isna(d["gain"]) else {
            k: value(d[c]) for k, c in (("gain", "gain"), ("low", "gain_low"), ("high", "gain_high"))
        }  # fmt: skip
        policies.append({"label": labels[pol], "halves": halves, "diff": diff})
    return {"placed": True, "policies": policies, "start": labels.get(start, policy_label(start)),
            "alpha": alpha, "median": value(easy_hard["median_met_rate"].iloc[0]),
            "preamble": preamble}  # fmt: skip


def easy_hard_sentences(easy_hard: pd.DataFrame | None, start: str, alpha: float,
                        preamble: bool = True) -> str:  # fmt: skip
    """`easy_hard_sentence` of `reports/templates/rlgf.jinja` (`easy_hard_context`)."""
    return sentence(
        "rlgf", "easy_hard_sentence", easy_hard_context(easy_hard, start, alpha, preamble)
    )


def rlgf_markdown(tables: Mapping[str, pd.DataFrame], algos: Sequence[str], start: str,
                  alpha: float) -> str:  # fmt: skip
    """The section's verdicts as a markdown list (notebook 04)."""
    c = guidance_context(tables.get("eval_guidance"), algos, alpha)
    c["easy_hard"] = easy_hard_context(tables.get("eval_easy_hard"), start, alpha)
    return sentence("rlgf", "notebook_verdicts", c)


RLGF_TABLES = ("eval_rlgf", "eval_easy_hard", "eval_guidance")


#: The RLGF paper's headline: D²LOLS above each of its parts and above PPO.
CLAIM_VERSUS = ("ppo", "ppo_pp", "aggrevated", "lols")


def claims_context(run: RunDir, algos: Sequence[str]) -> dict[str, Any]:
    """The RLGF paper's claims read at common KL (`eval_kl_budget_pairs`, `evaluation.curves`):
    per comparator of D²LOLS that ran (`CLAIM_VERSUS`), per budget both curves reach, D²LOLS's
    difference under each judge (`est`, `low`, `high`, `verdict`, D²LOLS minus the comparator)
    and the budgets where they were not both compared (`missing`). `ran`: D²LOLS ran; `budgets`:
    none for a run from before the budgets."""
    out: dict[str, Any] = {"ran": "d2lols" in algos, "budgets": None, "versus": []}
    if not out["ran"] or not run.exists("tables/eval_kl_budget_pairs.csv"):
        return out
    pairs = run.read_table("eval_kl_budget_pairs", "notebook 04_evaluation")
    meta = run.read_json("eval/summary.json", "notebook 04_evaluation")
    out["budgets"] = [float(b) for b in meta.get("kl_budgets", sorted(pairs["budget"].unique()))]
    for other in (a for a in CLAIM_VERSUS if a in algos):
        rows, seen = [], set()
        for r in pairs.itertuples():
            if {r.policy, r.versus} != {"d2lols", other}:
                continue
            sign = 1.0 if r.policy == "d2lols" else -1.0
            lo, hi = sorted((sign * r.low, sign * r.high))
            rows.append({"budget": float(r.budget), "measure": r.measure, "est": sign * r.diff,
                         "low": lo, "high": hi, "verdict": bound_verdict(lo, hi)})  # fmt: skip
            seen.add(float(r.budget))
        out["versus"].append({"policy": other, "rows": rows,
                              "missing": [b for b in out["budgets"] if b not in seen]})  # fmt: skip
    return out


def rlgf_section(run: RunDir, params: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The RLGF section: the paper's table, easy vs hard prompts and the two verdicts (does
    guidance beat PPO, does RL beat `sft_met`), read from notebook 04's tables; every verb comes
    from an interval (`guidance_sentences`). A run without a guided algorithm says which
    algorithms ran; a run dir older than these tables says so instead of failing."""

    stage = "notebook 04_evaluation"
    algos, start, alpha = eval_meta(run, params, stage)
    lvl = level(alpha)
    guide = params.get("rlgf", {}).get("guide", "sft_met")
    guided = [a for a in algos if a in RLGF_ALGORITHMS]
    log = (run.read_table("rlgf_guidance", "notebook 03_ppo_finetuning")
           if run.exists("tables/rlgf_guidance.csv") else pd.DataFrame())  # fmt: skip
    variables: dict[str, Any] = {
        "level": lvl,
        "start": display_name(start),
        "ran_sentence": sentence("rlgf", "ran_sentence",
                                 {"algorithms": algos, "guided": guided, "guide": guide}),
        "critics_sentence": sentence("rlgf", "critics_sentence", critics_context(log)),
        "claims_sentence": sentence("rlgf", "claims_sentence", claims_context(run, algos)),
        "guide": display_name(guide),
        "easy_hard_level": lvl,  # the gains' family level, once the table is read (below)
    }  # fmt: skip
    missing = [t for t in RLGF_TABLES if not run.exists(f"tables/{t}.csv")]
    if missing:
        short = sentence("rlgf", "predates_sentence", {"stage": stage})
        variables.update(guidance_sentence=short, rl_vs_sft_met_sentence=short,
                         easy_hard_sentence=short, median="n/a",
                         context_key=sentence("rlgf", "context_key", {"fields": list(CONTEXT_FIELDS)}))  # fmt: skip
        text = table_note(sentence("rlgf", "predates_note", {"missing": missing, "stage": stage}))
        return variables, {
            "rlgf_table.md": text,
            "rlgf_guidance.md": text,
            "rlgf_easy_hard.md": text,
        }

    easy_hard = run.read_table("eval_easy_hard", stage)
    guidance = run.read_table("eval_guidance", stage)
    gold = gold_auc(run)  # an audit at chance: its verdicts are ones it cannot interpret
    verdicts = guidance_context(guidance, algos, alpha, gold is not None and not gold["can_judge"])
    diff = run.read_table("eval_prompt_difficulty", stage) if run.exists(
        "tables/eval_prompt_difficulty.csv") else pd.DataFrame()  # fmt: skip
    keys = str(diff["context_key"].iloc[0]).split(" × ") if len(diff) else CONTEXT_FIELDS
    variables.update(
        guidance_sentence=sentence("rlgf", "guidance_sentence", verdicts["guidance"]),
        rl_vs_sft_met_sentence=sentence("rlgf", "rl_vs_sft_met_sentence", verdicts["rl_vs_sft_met"]),
        easy_hard_sentence=easy_hard_sentences(easy_hard, start, alpha, preamble=False),
        context_key=sentence("rlgf", "context_key", {"fields": list(keys)}),
        median=num(easy_hard["median_met_rate"].iloc[0]) if len(easy_hard) else "n/a",
    )  # fmt: skip

    table_md = table("rlgf_table", run.read_table("eval_rlgf", stage), lvl=lvl)
    if easy_hard.empty:
        eh_md = table_note(sentence("rlgf", "no_split_note", {}))
    else:
        eh_lvl = easy_hard_gain_level(easy_hard, alpha)  # the gains' family
        eh_md = table("rlgf_easy_hard", easy_hard, lvl=lvl, eh_lvl=eh_lvl, start=start)
        variables["easy_hard_level"] = eh_lvl
    if guidance.empty:
        g_md = table_note(sentence("rlgf", "no_comparison_note", verdicts["guidance"]))
    else:
        g_md = table("rlgf_guidance", guidance, measures=MEASURES, alpha=alpha)
    return variables, {
        "rlgf_table.md": table_md,
        "rlgf_guidance.md": g_md,
        "rlgf_easy_hard.md": eh_md,
    }
