"""Does learning from experience need RL here? The offline methods (KTO, DPO, rejection-sampling
fine-tuning) beside RL, ILHF and best-of-N (notebook 04's `eval_methods`, `eval_rl_vs_offline`
and `need_rl`); every verdict read from an interval. The sentences are macros of
`reports/templates/offline.jinja`; this module reads the tables into their contexts (numbers,
verdict codes, ids) and writes the table of every method side by side."""

from __future__ import annotations

from typing import Any

import pandas as pd

from rlxf_utils.artifacts import RunDir
from rlxf_utils.markdown import is_present
from rlxf_utils.report.evaluation import table_note
from rlxf_utils.report.gold import gold_auc
from rlxf_utils.report.wording import sentence, table, value

#: The numbers of an `eval_methods` row that a method's clause reads.
_GAINS = ("gain", "gain_low", "gain_high", "audit_gain", "audit_gain_low", "audit_gain_high", "kl")


def answer_context(answer: dict[str, Any], gold_at_chance: bool = False) -> dict[str, Any]:
    """`answer_sentence`: one measure's answer of `need_rl` (its code, winners, pairs and the
    family's alpha), and whether the audit is at chance (`report.gold.gold_cannot_judge`)."""
    lvl = answer.get("ci_level")
    return {"measure": answer.get("measure", ""), "answer": answer.get("answer"),
            "gold_at_chance": gold_at_chance,
            "winners": list(answer.get("winners", [])), "pairs": answer.get("pairs"),
            "alpha": 1 - lvl if is_present(lvl) else None,
            "beaten": [list(b) for b in answer.get("beaten", [])],
            **compared_context(answer)}  # fmt: skip


def compared_context(answer: dict[str, Any]) -> dict[str, Any]:
    """Of `need_rl`'s answer: the methods the winners were compared with (`opponents`), and how
    many pairs that ran were left out for KLs further apart than `kl_ratio` (`left_out`); a
    run before these were recorded reads as every pair compared."""
    ratio = answer.get("kl_ratio")
    return {"opponents": list(answer.get("opponents", [])),
            "left_out": int(answer.get("left_out") or 0),
            "kl_ratio": float(ratio) if is_present(ratio) else None}  # fmt: skip


def answer_sentence(answer: dict[str, Any], gold_at_chance: bool = False) -> str:
    """One measure's answer to "does learning from experience need RL here?", from `need_rl`."""
    return sentence("offline", "answer_sentence", answer_context(answer, gold_at_chance))


def methods_context(table: pd.DataFrame, group: str, gold_at_chance: bool = False) -> dict[str, Any]:  # fmt: skip
    """`method_clauses`: each method of `group` (its gains over the start policy under both
    rewards, its KL, its verdict against best-of-N at equal KL); `gold_at_chance`: every claim
    under the audit is one it cannot interpret (`report.gold.gold_cannot_judge`)."""
    rows = table[table["group"] == group]
    return {"group": group, "gold_at_chance": gold_at_chance, "methods": [
        {"method": r["method"], **{k: value(r[k]) for k in _GAINS},
         "vs_best_of_n": r["vs_best_of_n"] if isinstance(r["vs_best_of_n"], str) and r["vs_best_of_n"] else None}
        for _, r in rows.iterrows()
    ]}  # fmt: skip


def offline_section(run: RunDir) -> tuple[dict[str, Any], dict[str, str]]:
    """Variables (`answer`, `answer_reward`, `offline`, `references`, `present`) and the table
    of every method side by side (`eval_methods.md`)."""
    stage = "notebook 04_evaluation"
    meta = run.read_json("eval/summary.json", stage=stage)
    start = meta.get("start_policy", "sft")
    if not run.exists("tables/eval_methods.csv"):
        note = sentence("offline", "predates_note", {"stage": stage})
        return ({"answer": note, "answer_reward": note, "offline": note, "references": note,
                 "present": False}, {"eval_methods.md": table_note(note)})  # fmt: skip
    methods = run.read_table("eval_methods", stage)
    need = meta.get("need_rl", {})
    present = bool((methods["group"] == "offline").any()) if len(methods) else False
    gold = gold_auc(run)
    chance = gold is not None and not gold["can_judge"]
    variables = {
        "answer": answer_sentence(need["audit_reward"], chance) if "audit_reward" in need else "",
        "answer_reward": answer_sentence(need["reward"]) if "reward" in need else "",
        "offline": sentence(
            "offline", "method_clauses", methods_context(methods, "offline", chance)
        ),
        "references": sentence(
            "offline", "method_clauses", methods_context(methods, "best-of-N", chance)
        ),
        "present": present,
    }
    return variables, {"eval_methods.md": table("eval_methods", methods, start=start)}
