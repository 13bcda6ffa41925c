"""The RLGF section's words: does guidance beat PPO, and where (easy and hard prompts)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from rlxf_utils.algorithms import RLGF_ALGORITHMS, algorithm_label
from rlxf_utils.artifacts import RunDir
from rlxf_utils.evaluation.rlgf import HALVES, MEASURES, guidance_comparator, policy_label
from rlxf_utils.prompts import CONTEXT_FIELDS
from rlxf_utils.report.evaluation import eval_meta, table_note
from rlxf_utils.report.wording import (
    ci,
    is_present,
    listing,
    markdown_table,
    num,
    phrase,
    pval,
    say,
)
from rlxf_utils.stats import level

#: (question id, wording) of the two comparisons in `guidance_table`.
QUESTIONS = {
    "guidance_vs_ppo": "does guidance beat PPO?",
    "rl_vs_sft_met": "does RL beat supervised learning on what was met?",
}


#: What the guidance comparison holds equal, by the PPO arm it compares with.
GUIDANCE_TERM = {
    "ppo_mle": (
        "Both sides of this comparison add the same MLE term on historical MET descriptions "
        "(eta times their negative log-likelihood, the RLGF paper's objective for every "
        "algorithm), so the difference is guidance alone"
    ),
    "ppo": (
        "PPO here has no MLE term while the guided algorithms add eta times the negative "
        "log-likelihood of historical MET descriptions, so the difference mixes guidance with "
        "that supervised term (run ppo_mle to isolate guidance)"
    ),
}


def diff_ci(r: Any) -> str:
    """A comparison row's difference and interval (`diff`, `low`, `high`)."""
    return ci(r["diff"], r["low"], r["high"], signed=True)


def _comparison_sentence(g: pd.DataFrame, a: str, b: str, lvl: str, b_name: str) -> str:
    """'<a> <verb> <b> under the reward model and <verb> it under the audit model (...)', each
    verb read from its measure's interval, whose level (its family's, `ci_level`; else `lvl`)
    the sentence states."""
    rows = g[(g["policy"] == a) & (g["versus"] == b)].set_index("measure")
    have = [(m, who) for m, who in MEASURES.items() if m in rows.index]
    words = [phrase("beat", rows.loc[m, "verdict"]) for m, _ in have]
    if len(have) > 1 and len(set(words)) == 1:  # one verdict under both models
        verbs = [f"{words[0]} {b_name} under both the reward and the audit model"]
    else:
        verbs = [
            f"{w} {b_name if i == 0 else 'it'} under the {who}"
            for i, (w, (_, who)) in enumerate(zip(words, have, strict=True))
        ]
    cis = [f"{who} {diff_ci(rows.loc[m])}" for m, who in have]
    if "ci_level" in rows and rows["ci_level"].notna().any():  # the question's family level
        lvl = level(1 - float(rows["ci_level"].dropna().iloc[0]))
    return (f"{algorithm_label(a)} " + " and ".join(verbs)
            + f" (difference in Ave(R), {lvl} cluster-bootstrap CI over countries: " + "; ".join(cis) + ")")  # fmt: skip


def critics_sentence(guidance_log: pd.DataFrame) -> str:
    """What each guided algorithm's two critics explained on their own tokens (notebook 03's
    `rlgf_guidance`: mean explained variance over the scheme's steps, and the shared reward-model
    prior's alone), so a reader sees whether V_g and V_theta differ beyond the prior they share."""
    if guidance_log.empty or "critic" not in guidance_log:
        return "No guided algorithm ran, so there is no guide critic to compare"
    parts = []
    for algo, g in guidance_log.groupby("algorithm", sort=False):
        crit = [
            f"{r['critic']} explained {r['explained_variance']:.2f} of the returns' variance over "
            f"its {int(r['steps'])} steps (the shared prior alone {r['explained_variance_prior']:.2f})"
            for _, r in g.iterrows()
            if is_present(r["explained_variance"])
        ]
        if crit:
            parts.append(f"in {algo}, " + "; ".join(crit))
    if not parts:
        return "The guided algorithms logged no critic"
    return ("Each critic's explained variance on its own tokens, mean over the steps of its "
            "scheme: " + "; ".join(parts))  # fmt: skip


def guidance_sentences(
    guidance: pd.DataFrame, algos: Sequence[str], alpha: float
) -> dict[str, str]:
    """The two verdicts as prose: `guidance` (guided algorithms vs PPO) and `rl_vs_sft_met`.

    The verb of each comparison is chosen from its interval (the vocabulary's 'beat', `wording.phrase`); a run
    without a guided algorithm, without PPO or without `sft_met` says so instead.
    """
    lvl = level(alpha)
    ran = [algorithm_label(a) for a in algos]
    guided = [a for a in algos if a in RLGF_ALGORITHMS]
    g = guidance if guidance is not None else pd.DataFrame(columns=["question"])
    if not guided:
        gs = (f"No guided algorithm ran: this run trained {listing(ran)}, none of them guided, so "
              "whether guidance beats PPO is not answered here")  # fmt: skip
    elif (ppo := guidance_comparator(algos)) is None:
        gs = (f"PPO did not run (this run trained {listing(ran)}), so the guided algorithms "
              "are not compared with it")  # fmt: skip
    else:
        gq = g[g["question"] == "guidance_vs_ppo"]
        name = algorithm_label(ppo)
        gs = "; ".join(
            _comparison_sentence(gq, a, ppo, lvl, name) for a in guided if a in set(gq["policy"])
        )
        gs = gs or f"The guided algorithms were not evaluated against {name}"
        gs = f"{gs}. {GUIDANCE_TERM[ppo]}" if gq.shape[0] else gs
    rq = g[g["question"] == "rl_vs_sft_met"]
    if rq.empty:
        rs = "The MET-only supervised policy (sft_met) was not evaluated, so RL is not compared with it"
    else:
        rs = "; ".join(
            _comparison_sentence(rq, a, "sft_met", lvl, "sft_met")
            for a in algos
            if a in set(rq["policy"])
        )
    return {"guidance": gs, "rl_vs_sft_met": rs}


def easy_hard_sentences(
    easy_hard: pd.DataFrame, start: str, alpha: float, preamble: bool = True
) -> str:
    """One clause per policy: where it stands against the start policy on easy and on hard prompts,
    and whether its gain differs between the halves, each word read from its interval. Without
    `preamble` the sentence leaves out how prompts were split (the report says it before)."""
    if easy_hard is None or easy_hard.empty:
        return "No prompt could be placed in an easy or a hard half"
    lvl = level(alpha)
    parts = []
    for pol, g in easy_hard.groupby("policy", sort=False):
        if pol == start:
            continue
        h = g.set_index("half")
        bits = []
        for half in HALVES:
            if half in h.index and pd.notna(h.loc[half, "gain"]):
                r = h.loc[half]
                it = policy_label(start) if not bits else "it"
                bits.append(f"{phrase('position_from', r['gain_verdict'])} {it} on {half} prompts "
                            f"({ci(r['gain'], r['gain_low'], r['gain_high'], signed=True)})")  # fmt: skip
        if not bits:
            continue
        clause = f"{policy_label(pol)} is " + " and ".join(bits)
        if "hard_minus_easy" in h.index and pd.notna(h.loc["hard_minus_easy", "gain"]):
            r = h.loc["hard_minus_easy"]
            clause += (f", its gain {say('hard_minus_easy', r['gain_low'], r['gain_high'])} "
                       f"(hard − easy {ci(r['gain'], r['gain_low'], r['gain_high'], signed=True)})")  # fmt: skip
        parts.append(clause)
    if not parts:
        return "No tuned policy was compared on easy and hard prompts"
    med = easy_hard["median_met_rate"].iloc[0]
    head = f"Gains over {policy_label(start)} with {lvl} cluster-bootstrap intervals: "
    if preamble:
        head = (f"Prompts split at the median historical MET rate of their context ((MET + 1) / "
                f"(conditions + 2): {med:.2f}); " + head[0].lower() + head[1:])  # fmt: skip
    return head + "; ".join(parts)


def rlgf_markdown(tables: Mapping[str, pd.DataFrame], algos: Sequence[str], start: str,
                  alpha: float) -> str:  # fmt: skip
    """The section's verdicts as a markdown list (notebook 04)."""
    v = guidance_sentences(tables.get("eval_guidance"), algos, alpha)
    eh = easy_hard_sentences(tables.get("eval_easy_hard"), start, alpha)
    return "\n".join([
        f"- **Does guidance beat PPO?** {v['guidance']}.",
        f"- **Does RL beat supervised learning on what was met?** {v['rl_vs_sft_met']}.",
        f"- **Easy and hard prompts.** {eh}.",
    ])  # fmt: skip


RLGF_TABLES = ("eval_rlgf", "eval_easy_hard", "eval_guidance")


def rlgf_section(run: RunDir, params: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The RLGF section: the paper's table, easy vs hard prompts and the two verdicts (does
    guidance beat PPO, does RL beat `sft_met`), read from notebook 04's tables; every verb comes
    from an interval (`guidance_sentences`). A run without a guided algorithm says which
    algorithms ran; a run dir older than these tables says so instead of failing."""

    stage = "notebook 04_evaluation"
    algos, start, alpha = eval_meta(run, params, stage)
    lvl = level(alpha)
    ran = [algorithm_label(a) for a in algos]
    guided = [algorithm_label(a) for a in algos if a in RLGF_ALGORITHMS]
    if guided:
        ran_sentence = (
            f"This run trained {listing(ran)}; the guided {'ones are' if len(guided) > 1 else 'one is'} "
            f"{listing(guided)}, with `{params.get('rlgf', {}).get('guide', 'sft_met')}` as the guide"
        )
    else:
        ran_sentence = f"This run trained {listing(ran)}; none of them is guided"
    variables: dict[str, Any] = {
        "level": lvl,
        "start": start,
        "ran_sentence": ran_sentence,
        "critics_sentence": critics_sentence(
            run.read_table("rlgf_guidance", "notebook 03_ppo_finetuning")
            if run.exists("tables/rlgf_guidance.csv")
            else pd.DataFrame()
        ),
        "guide": params.get("rlgf", {}).get("guide", "sft_met"),
    }
    words = {"arrangement_type": "arrangement type", "econ_descriptor": "economic descriptor"}

    def key_words(keys: Any) -> str:
        return " × ".join(words.get(k, k) for k in keys)

    key = key_words(CONTEXT_FIELDS)
    missing = [t for t in RLGF_TABLES if not run.exists(f"tables/{t}.csv")]
    if missing:
        note = (
            f"This run directory predates the RLGF evaluation (no {', '.join(f'tables/{t}.csv' for t in missing)}); "
            f"rerun {stage} to produce it"
        )
        short = f"Not in this run directory, which predates the RLGF evaluation (rerun {stage})"
        variables.update(guidance_sentence=short, rl_vs_sft_met_sentence=short,
                         easy_hard_sentence=short, context_key=key, median="n/a")  # fmt: skip
        text = table_note(note)
        return variables, {
            "rlgf_table.md": text,
            "rlgf_guidance.md": text,
            "rlgf_easy_hard.md": text,
        }

    table = run.read_table("eval_rlgf", stage)
    easy_hard = run.read_table("eval_easy_hard", stage)
    guidance = run.read_table("eval_guidance", stage)
    verdicts = guidance_sentences(guidance, algos, alpha)
    variables.update(
        guidance_sentence=verdicts["guidance"],
        rl_vs_sft_met_sentence=verdicts["rl_vs_sft_met"],
        easy_hard_sentence=easy_hard_sentences(easy_hard, start, alpha, preamble=False),
    )
    diff = run.read_table("eval_prompt_difficulty", stage) if run.exists(
        "tables/eval_prompt_difficulty.csv") else pd.DataFrame()  # fmt: skip
    variables["context_key"] = (
        key_words(str(diff["context_key"].iloc[0]).split(" × ")) if len(diff) else key
    )
    variables["median"] = num(easy_hard["median_met_rate"].iloc[0]) if len(easy_hard) else "n/a"

    def kl_cell(r: pd.Series) -> str:
        if not is_present(r["kl"]):
            return "·"
        return f"≤ {r['kl']:.2f}" if r["kl_kind"] == "upper bound" else f"{r['kl']:.2f}"

    rows = [
        {"policy": r["label"], f"Ave(R) [{lvl} CI]": ci(r["ave_r"], r["ave_r_low"], r["ave_r_high"]),
         f"audit [{lvl} CI]": ci(r["audit"], r["audit_low"], r["audit_high"]), "KL (nats)": kl_cell(r),
         "output perplexity": f"{r['output_ppl']:.1f}" if is_present(r["output_ppl"]) else "·",
         "MET perplexity": f"{r['met_ppl']:.1f}" if is_present(r["met_ppl"]) else "·",
         "distinct-2": num(r["distinct_2"]),
         "finished": f"{r['finished']:.0%}" if is_present(r["finished"]) else "·"}
        for _, r in table.iterrows()
    ]  # fmt: skip
    table_md = markdown_table(pd.DataFrame(rows))
    if easy_hard.empty:
        eh_md = table_note(
            "Every held-out prompt's context has the same historical MET rate: no split"
        )
    else:
        levels = easy_hard.get("gain_ci_level", pd.Series(dtype=float)).dropna()
        eh_lvl = level(1 - float(levels.iloc[0])) if len(levels) else lvl  # the gains' family
        eh = easy_hard.assign(
            half=easy_hard["half"].replace({"hard_minus_easy": "hard − easy"}),
            **{
                f"Ave(R) [{lvl} CI]": [ci(a, b, c) for a, b, c in zip(easy_hard.ave_r, easy_hard.ave_r_low, easy_hard.ave_r_high, strict=True)],
                f"gain over {start} [{eh_lvl} CI]": [ci(a, b, c) if is_present(a) else "·" for a, b, c in zip(easy_hard.gain, easy_hard.gain_low, easy_hard.gain_high, strict=True)],
                "verdict": easy_hard["gain_verdict"].fillna("").map(lambda v: phrase("direction", v) if v else ""),
            },
        )  # fmt: skip
        eh_md = markdown_table(
            eh[["label", "half", "n_prompts", "n_countries", f"Ave(R) [{lvl} CI]",
                f"gain over {start} [{eh_lvl} CI]", "verdict"]].rename(
                columns={"label": "policy", "n_prompts": "prompts", "n_countries": "countries"})
        )  # fmt: skip
    if guidance.empty:
        g_md = table_note(f"No comparison was made: {verdicts['guidance']}")
    else:
        g = guidance.assign(
            question=guidance["question"].map(QUESTIONS),
            measure=guidance["measure"].map(MEASURES),
            policy=guidance["policy"].map(algorithm_label),
            versus=guidance["versus"].map(algorithm_label),
            **{"difference [family CI]": [ci(a, b, c) for a, b, c in zip(guidance["diff"], guidance["low"], guidance["high"], strict=True)],
               "level": guidance.get("ci_level", pd.Series(1 - alpha, index=guidance.index)).map(lambda v: level(1 - v)),
               "family p": guidance["p_family"].map(pval) if "p_family" in guidance else "·",
               "verdict": guidance["verdict"].map(lambda v: phrase("direction", v))},
        )  # fmt: skip
        g_md = markdown_table(
            g[["question", "measure", "policy", "versus", "n", "n_clusters",
               "difference [family CI]", "level", "verdict", "family p"]].rename(
                columns={"n": "prompts", "n_clusters": "countries"})
        )  # fmt: skip
    return variables, {
        "rlgf_table.md": table_md,
        "rlgf_guidance.md": g_md,
        "rlgf_easy_hard.md": eh_md,
    }
