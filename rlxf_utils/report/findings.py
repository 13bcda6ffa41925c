"""The study's findings in a few sentences: the abstract and the key-findings section.

Each sentence is chosen from an interval the stages wrote, never from the sign of a point
estimate: the reward model's accuracy and AUC on held-out arrangements (`reward/metrics.json`),
each method's gains over the start policy under the reward model and the audit with the
family's simultaneous intervals, and its place against best-of-N at equal KL
(`tables/eval_methods.csv`), and the answer to "does learning from experience need RL?"
(`eval/summary.json`'s `need_rl`). The words are the author's, in
`reports/templates/findings.jinja` (a macro per finding); here, the numbers and verdicts.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from rlxf_utils.artifacts import RunDir
from rlxf_utils.markdown import is_present
from rlxf_utils.report.evaluation import cut_rule, family_level
from rlxf_utils.report.gold import gold_auc
from rlxf_utils.report.offline import compared_context
from rlxf_utils.report.reward import reward_labels
from rlxf_utils.report.seeds import seed_finding
from rlxf_utils.report.wording import sentence
from rlxf_utils.reward.model import PAPER_ACCURACY

#: The findings, in the order the abstract and the key-findings list state them.
FINDINGS = ("reward", "rl", "best_of_n", "offline")


def reward_finding(meta: dict[str, Any]) -> dict[str, Any]:
    """The reward model against the paper's 82% and on held-out arrangements: whether every
    model's accuracy interval lies `below` the claim, the `best` model (where some interval
    reaches the claim, the one reaching highest) and the `main` one, RL's, on unseen
    arrangements (None where the metrics lack it)."""
    m = pd.DataFrame(meta["metrics"])
    labels = reward_labels(meta)
    scorers = m[~m["model"].isin(["majority", "context_only", "text_only"])]
    below = bool((scorers["accuracy_high"] < PAPER_ACCURACY).all())
    best = scorers.loc[scorers["accuracy" if below else "accuracy_high"].idxmax()]
    main = m[(m["model"] == meta["reward_source"]) & (m["protocol"] == meta["reward_protocol"])]
    r = main.iloc[0] if len(main) else None
    return {
        "paper": PAPER_ACCURACY, "below": below, "alpha": meta["alpha"],
        "best": {"accuracy": best["accuracy"], "low": best["accuracy_low"],
                 "high": best["accuracy_high"], "protocol": best["protocol"],
                 "label": labels.get(best["model"], best["model"])},
        "main": None if r is None else {"auc": r["roc_auc"], "low": r["roc_auc_low"],
                                        "high": r["roc_auc_high"],
                                        "protocol": meta["reward_protocol"]},
    }  # fmt: skip


def _finished_check(r: pd.Series, key: str) -> dict[str, Any] | None:
    """The gain `key` of a method among finished responses only, a subset the policies select:
    its estimate and interval (`est`, `low`, `high`) and its Lee bounds within countries (`lee`:
    `lower`, `upper`, the interval covering them `low`, `high`, and `prompts`; None for runs from
    before them). None where the subset's gain has no interval (runs from before; too few
    finished responses)."""
    low, high = r.get(f"{key}_finished_low"), r.get(f"{key}_finished_high")
    if not (is_present(low) and is_present(high)):
        return None
    pre = f"{key}_finished_lee_"
    lee = {k: r.get(pre + k) for k in ("lower", "upper", "low", "high", "prompts")}
    have = is_present(lee["lower"]) and is_present(lee["upper"])
    return {"est": r[f"{key}_finished"], "low": low, "high": high, "lee": lee if have else None}


def _moved(rows: pd.DataFrame, key: str) -> dict[str, Any]:
    """The methods whose interval lies above (`up`) and below (`down`) zero, and the nulls: how
    many (`nulls`) and the largest gain they allow (`top`, the largest upper end). Each method
    that moved carries its `finished` share and its gain among finished responses only
    (`check`), the reading of a gain made by a policy whose responses the token cap cuts."""

    def listed(mask: pd.Series) -> list[dict[str, Any]]:
        return [{"method": r["method"], "est": r[key], "low": r[f"{key}_low"],
                 "high": r[f"{key}_high"], "finished": r.get("finished"),
                 "check": _finished_check(r, key)} for _, r in rows[mask].iterrows()]  # fmt: skip

    low, high = rows[f"{key}_low"], rows[f"{key}_high"]
    null = rows[(low <= 0) & (high >= 0)]
    return {"up": listed(low > 0), "down": listed(high < 0), "nulls": len(null),
            "top": float(null[f"{key}_high"].max()) if len(null) else None}  # fmt: skip


def rl_finding(
    table: pd.DataFrame, start: str, ci_level: str, gold_at_chance: bool = False,
    start_finished: float | None = None, cut: dict[str, Any] | None = None,
) -> dict[str, Any] | None:  # fmt: skip
    """Which RL (and ILHF) policies, one training seed each, moved the reward they were trained
    on, and the audit (`_moved`, per judge); under an audit whose own AUC on held-out rows does
    not exclude chance (`gold_at_chance`) a null is what such a judge cannot tell;
    `start_finished` is the start policy's finished share, beside the movers' own, and `cut` the
    rule cut responses were scored by (`cut_rule`; None: as written, a run from before). None without
    RL policies. A claim about an algorithm rather than its one policy is the seeds'."""
    rows = table[table["group"].isin(["RL", "ILHF"])]
    if rows.empty:
        return None
    return {"n": len(rows), "start": start, "level": ci_level, "gold_at_chance": gold_at_chance,
            "start_finished": start_finished, "cut": cut,
            "groups": [g for g in ("RL", "ILHF") if (rows["group"] == g).any()],
            "reward": _moved(rows, "gain"), "audit": _moved(rows, "audit_gain")}  # fmt: skip


def best_of_n_finding(table: pd.DataFrame, start: str) -> dict[str, Any] | None:
    """Every method against best-of-N sampling from the start policy at the same KL: the methods
    `above` it, the count `below`, of `n` compared, and best-of-N's own row (`bon`); None where
    no method was compared."""
    rows = table[table["group"].isin(["RL", "ILHF", "offline"])]
    rows = rows[rows["vs_best_of_n"].apply(lambda v: isinstance(v, str) and v != "")]
    if rows.empty:
        return None
    verdict = rows["vs_best_of_n"].str.split().str[0]
    bon = table[table["group"] == "best-of-N"]
    return {"start": start, "n": len(rows), "above": rows.loc[verdict == "above", "method"].tolist(),
            "below": int((verdict == "below").sum()),
            "bon": bon.iloc[0].to_dict() if len(bon) else None}  # fmt: skip


def offline_finding(need: dict[str, Any]) -> dict[str, Any]:
    """The answer to 'does learning from experience need RL here?', under the audit where it was
    asked there (`answer` None: the offline methods did not run)."""
    a = need.get("audit_reward") or need.get("reward")
    if not a or a.get("answer") == "not compared":
        return {"answer": None, "audit": False}
    return {"answer": a["answer"], "audit": "audit_reward" in need, "pairs": a.get("pairs"),
            "alpha": 1 - a["ci_level"] if is_present(a.get("ci_level")) else None,
            "winners": list(a.get("winners", [])), **compared_context(a)}  # fmt: skip


def findings_section(run: RunDir) -> tuple[dict[str, Any], dict[str, str]]:
    """Variables `reward`, `rl`, `best_of_n`, `offline` (one finding each; `seeds` too where the
    run has further training seeds), `abstract` (them as running text) and `headline` (the
    comparison the params named before the run, the rest secondary); `findings.md`, the
    key-findings list."""
    meta = run.read_json("reward/metrics.json", stage="notebook 02_reward_model")
    stage = "notebook 04_evaluation"
    summary = run.read_json("eval/summary.json", stage=stage)
    start = summary.get("start_policy", "sft")
    seeds = seed_finding(run)
    facts = {"reward": reward_finding(meta), "offline": offline_finding(summary.get("need_rl", {})),
             "seeds": seeds}  # fmt: skip
    if run.exists("tables/eval_methods.csv"):
        table = run.read_table("eval_methods", stage)
        fam = family_level(run.read_table("eval_paired", stage))
        gold = gold_auc(run)
        own = {r["policy"]: r for r in summary.get("summary", [])}.get(start, {})
        facts["rl"] = rl_finding(table, start, fam, gold is not None and not gold["can_judge"],
                                 own.get("finished"), cut_rule(summary))  # fmt: skip
        facts["best_of_n"] = best_of_n_finding(table, start)
    found = {k: sentence("findings", f"{k}_finding", v) for k, v in facts.items()}
    # the headline, as the params stated it before the run (none: a run from before it was)
    headline = summary.get("headline")
    found["headline"] = sentence(
        "findings",
        "headline",
        {"stated": headline, "cut": cut_rule(summary), "budgets": summary.get("kl_budgets")},
    )
    if "rl" not in facts:
        found["rl"] = found["best_of_n"] = sentence("findings", "predates", stage)
    keys = [*FINDINGS, "seeds"] if seeds is not None else list(FINDINGS)
    found["abstract"] = " ".join(f"{found[k]}." for k in keys)
    listed = "\n".join(f"{i}. {found[k]}." for i, k in enumerate(keys, 1))
    return found, {"findings.md": listed + "\n"}
