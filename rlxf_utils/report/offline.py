"""Does learning from experience need RL here? The offline methods (KTO, DPO, rejection-sampling
fine-tuning) beside RL, ILHF and best-of-N, in words (notebook 04's `eval_methods`,
`eval_rl_vs_offline` and `need_rl`); every verdict read from an interval."""

from __future__ import annotations

from typing import Any

import pandas as pd

from rlxf_utils.algorithms import algorithm_label
from rlxf_utils.artifacts import RunDir
from rlxf_utils.report.evaluation import gain_verb, table_note
from rlxf_utils.report.wording import ci, is_present, listing, markdown_table
from rlxf_utils.stats import level

_MEASURES = {"audit_reward": "the disjoint-rows audit (a judge none of them was trained on)",
             "reward": "the reward model RL was trained on"}  # fmt: skip


def _names(ids: list[str]) -> str:
    return listing([algorithm_label(a) for a in ids])


def answer_sentence(answer: dict[str, Any]) -> str:
    """One measure's answer to "does learning from experience need RL here?", from `need_rl`."""
    where = _MEASURES.get(answer.get("measure", ""), answer.get("measure", ""))
    kind = answer.get("answer")
    if kind == "not compared":
        return f"Under {where}, no RL algorithm and offline method were both evaluated"
    lvl = level(1 - answer["ci_level"]) if is_present(answer.get("ci_level")) else ""
    unit = f"(each RL algorithm against each offline method, {answer['pairs']} paired comparisons, {lvl} simultaneous intervals)"  # fmt: skip
    if kind == "rl":
        return (f"Under {where}, RL did something the offline methods did not: "
                f"{_names(answer['winners'])} beat every offline method {unit}")  # fmt: skip
    if kind == "offline":
        return (f"Under {where}, learning from experience did not need RL: "
                f"{_names(answer['winners'])} beat every RL algorithm {unit}")  # fmt: skip
    decided = [f"{algorithm_label(a)} {'above' if d == 'above' else 'below'} {algorithm_label(b)}"
               for a, b, d in answer.get("beaten", [])]  # fmt: skip
    tail = (f"; the pairs that differ: {listing(decided)}" if decided
            else "; no pair differs")  # fmt: skip
    return (f"Under {where}, the data cannot say whether RL is needed: no RL algorithm beat every "
            f"offline method and no offline method beat every RL algorithm {unit}{tail}")  # fmt: skip


def method_clauses(table: pd.DataFrame, start: str, group: str) -> str:
    """Each method of `group`: its gains over the start policy under both rewards, its KL and
    its place against best-of-N at equal KL."""
    out = []
    for _, r in table[table["group"] == group].iterrows():
        verdict = r["vs_best_of_n"] if isinstance(r["vs_best_of_n"], str) else ""
        vs = f"; against best-of-N at equal KL: {verdict}" if verdict else ""
        out.append(
            f"{r['method']} {gain_verb(r['gain_low'], r['gain_high'])} the reward "
            f"({ci(r['gain'], r['gain_low'], r['gain_high'], signed=True)}) and "
            f"{gain_verb(r['audit_gain_low'], r['audit_gain_high'])} the audit "
            f"({ci(r['audit_gain'], r['audit_gain_low'], r['audit_gain_high'], signed=True)}) "
            f"at KL {r['kl']:.2f} nats{vs}"
        )
    return "; ".join(out) if out else f"no {group} method ran"


def offline_section(run: RunDir) -> tuple[dict[str, Any], dict[str, str]]:
    """Variables (`answer`, `answer_reward`, `offline`, `references`, `present`) and the table
    of every method side by side (`eval_methods.md`)."""
    stage = "notebook 04_evaluation"
    meta = run.read_json("eval/summary.json", stage=stage)
    start = meta.get("start_policy", "sft")
    if not run.exists("tables/eval_methods.csv"):
        note = f"This run directory predates the offline methods' comparison; rerun {stage}"
        return ({"answer": note, "answer_reward": note, "offline": note, "references": note,
                 "present": False}, {"eval_methods.md": table_note(note)})  # fmt: skip
    table = run.read_table("eval_methods", stage)
    need = meta.get("need_rl", {})
    present = bool((table["group"] == "offline").any()) if len(table) else False
    shown = table.assign(
        reward_gain=[ci(r["gain"], r["gain_low"], r["gain_high"], signed=True) for _, r in table.iterrows()],
        audit_gain=[ci(r["audit_gain"], r["audit_gain_low"], r["audit_gain_high"], signed=True)
                    for _, r in table.iterrows()],
        kl=[f"{k:.2f}" + (" (bound)" if kind == "upper bound" else "")
            for k, kind in zip(table["kl"], table["kl_kind"].fillna(""), strict=True)],
        finished=[f"{f:.0%}" if is_present(f) else "·" for f in table["finished"]],
    )[["method", "group", "reward_gain", "audit_gain", "kl", "finished", "vs_best_of_n"]]  # fmt: skip
    shown.columns = ["method", "kind", f"gain over {start}: reward model", f"gain over {start}: audit",
                     f"KL to {start} (nats)", "finished", "vs best-of-N at equal KL"]  # fmt: skip
    variables = {
        "answer": answer_sentence(need["audit_reward"]) if "audit_reward" in need else "",
        "answer_reward": answer_sentence(need["reward"]) if "reward" in need else "",
        "offline": method_clauses(table, start, "offline"),
        "references": method_clauses(table, start, "best-of-N"),
        "present": present,
    }
    return variables, {"eval_methods.md": markdown_table(shown.fillna(""))}
