"""Whether the gold judge can judge, and what any method could reach: the disjoint-rows audit
model's own discrimination on the held-out reference rows (`reward_reference_check`, notebook
02), which decides whether a null under the gold says "no gain" or only "the gold cannot tell",
and the attainable ceiling under each judge (`eval_ceiling`, notebook 04: the held-out contexts'
own MET descriptions over their Non-MET ones), against which every gain and bound is read."""

from __future__ import annotations

from typing import Any

from rlxf_utils.artifacts import RunDir
from rlxf_utils.report.wording import ci, is_present, listing
from rlxf_utils.stats import ci_sign, level

#: The reference check's row of the gold judge (the audit trained on disjoint rows).
GOLD_ROW = "audit"


def gold_auc(run: RunDir) -> dict[str, Any] | None:
    """The gold judge's AUC on the reference rows (evaluation countries' rows no model trained
    on) with its interval: `auc`, `low`, `high`, `rows`, `level`, and `can_judge` (the interval
    lies above 0.5); None for a run without the check."""
    if not run.exists("tables/reward_reference_check.csv"):
        return None
    t = run.read_table("reward_reference_check", "notebook 02_reward_model")
    rows = t[t["model"].astype(str).str.startswith(GOLD_ROW)]
    if rows.empty:
        return None
    r = rows.iloc[0]
    alpha = 0.05
    if run.exists("eval/summary.json"):
        alpha = run.read_json("eval/summary.json", "notebook 04_evaluation").get("alpha", alpha)
    return {"auc": float(r["auc"]), "low": float(r["auc_low"]), "high": float(r["auc_high"]),
            "rows": int(r["rows"]), "level": level(alpha),
            "can_judge": bool(is_present(r["auc_low"]) and r["auc_low"] > 0.5)}  # fmt: skip


def gold_auc_words(gold: dict[str, Any], whose: str = "its") -> str:
    """'its AUC on 120 held-out rows, 0.55 [0.47, 0.63] (95% CI), does not exclude chance'."""
    verb = "lies above chance" if gold["can_judge"] else "does not exclude chance"
    return (
        f"{whose} AUC on {gold['rows']} held-out rows, {ci(gold['auc'], gold['low'], gold['high'])} "
        f"({gold['level']} CI), {verb}"
    )


def gold_cannot_judge(gold: dict[str, Any] | None, low: Any, high: Any) -> bool:
    """A null under the gold (its interval holds zero) from a gold whose own AUC interval does
    not lie above 0.5: the gold can neither confirm nor refute a gain, and a report must not say
    the method 'did not move' it."""
    return gold is not None and not gold["can_judge"] and ci_sign(low, high) == 0


def ceiling_sentence(run: RunDir) -> str:
    """The attainable ceiling in words ('' for a run without `eval_ceiling`): under each judge,
    how much higher the held-out contexts' own MET descriptions score than their Non-MET ones."""
    if not run.exists("tables/eval_ceiling.csv"):
        return ""
    t = run.read_table("eval_ceiling", "notebook 04_evaluation")
    if t.empty:
        return ""
    parts = [
        f"{ci(r['diff'], r['ci_low'], r['ci_high'], signed=True)} under the {r['judge']}"
        for _, r in t.iterrows()
    ]
    r0 = t.iloc[0]
    return (
        "Against what any method could reach here: the held-out contexts' own historical MET "
        f"descriptions score {listing(parts)} above their Non-MET ones ({level(1 - float(r0['ci_level']))} "
        f"cluster t intervals over countries, on the {int(r0['n'])} prompts in "
        f"{int(r0['n_clusters'])} countries that have both), the gain a perfect imitator of what "
        "worked would get over one of what did not"
    )
