"""Whether the gold judge can judge, and what any method could reach: the disjoint-rows audit
model's own discrimination on the held-out reference rows (`reward_reference_check`, notebook
02), which decides whether any claim under the gold, a rise, a fall or a null, is a verdict or
only "the gold cannot tell",
and the attainable ceiling under each judge (`eval_ceiling`, notebook 04: the held-out contexts'
own MET descriptions over their Non-MET ones), against which every gain and bound is read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlxf_utils.artifacts import RunDir
from rlxf_utils.evaluation.control import detected
from rlxf_utils.markdown import is_present
from rlxf_utils.stats import level

#: The reference check's row of the gold judge (the audit trained on disjoint rows).
GOLD_ROW = "audit"


def gold_auc(run: RunDir) -> dict[str, Any] | None:
    """The gold judge's AUC on the reference rows (evaluation countries' rows no model trained
    on) with its interval: `auc`, `low`, `high`, `rows`, `level`, `above_chance` (the interval
    lies above 0.5), `control` (`control_audit`: the audit on generated text in the positive
    control beside the run, or None) and `can_judge`: above chance, or shown by the control to
    see a true gain on generated text with every verdict the truth's; None for a run without the
    check."""
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
    above = bool(is_present(r["auc_low"]) and r["auc_low"] > 0.5)
    control = control_audit(run)
    return {"auc": float(r["auc"]), "low": float(r["auc_low"]), "high": float(r["auc_high"]),
            "rows": int(r["rows"]), "level": level(alpha), "above_chance": above,
            "control": control,
            "can_judge": above or bool(control and control["sees"])}  # fmt: skip


#: The positive control's run folder beside a run (`params/control.yaml`'s `run.name`).
CONTROL_RUN = "control"


def control_run(run: RunDir) -> RunDir | None:
    """The finished positive control beside `run` (`CONTROL_RUN`, its `eval_control` written),
    None where there is none or `run` is itself the control."""
    path = Path(run.root).parent / CONTROL_RUN
    if Path(run.root).resolve() == path.resolve():
        return None
    ctl = RunDir(path)
    return ctl if ctl.exists("tables/eval_control.csv") else None


def control_audit(run: RunDir) -> dict[str, Any] | None:
    """What the positive control beside `run` (`control_run`, its `eval_control` table) shows of
    the audit on generated text: `methods` compared with the truth P*, `matched` (how many of its
    verdicts are the truth's), `detected` (the smallest true gain it put above zero, or None:
    `evaluation.control.detected`) and `sees` (it put some true gain above zero and matched the
    truth every time: then its verdicts on this run are read as a judge's, whatever its AUC on
    human rows). None without a control."""
    ctl = control_run(run)
    if ctl is None:
        return None
    t = ctl.read_table("eval_control", "notebook 04_evaluation")
    if t.empty:
        return None
    matched = int(t["audit_matches"].astype(str).str.lower().eq("true").sum())
    found = detected(t, "audit")
    return {"methods": len(t), "matched": matched, "detected": found,
            "sees": found is not None and matched == len(t)}  # fmt: skip


def gold_cannot_judge(gold: dict[str, Any] | None, low: Any, high: Any) -> bool:
    """Any claim under the gold, a rise, a fall or a null (its interval [`low`, `high`] above,
    below or around zero), from a gold whose own AUC interval does not lie above 0.5: a judge
    that cannot be shown to tell MET from Non-MET can neither confirm nor refute a gain, so a
    report must not say the method raised, lowered or 'did not move' it, only that it moved a
    judge that cannot tell (`audit_unjudged` and `gold_unjudged` in the vocabulary; the rule is
    `gold_rule` in reports/templates/eval.jinja, stated once in the methods). An interval-less
    comparison (fewer than two clusters) makes no claim to qualify."""
    return gold is not None and not gold["can_judge"] and is_present(low) and is_present(high)


def ceiling(run: RunDir) -> dict[str, Any] | None:
    """The attainable ceiling (None for a run without `eval_ceiling`): under each judge, how much
    higher the held-out contexts' own MET descriptions score than their Non-MET ones, the context
    of `ceiling_sentence` in `reports/templates/gold.jinja`."""
    if not run.exists("tables/eval_ceiling.csv"):
        return None
    t = run.read_table("eval_ceiling", "notebook 04_evaluation")
    if t.empty:
        return None
    rows = [{"judge": r["judge"], "diff": r["diff"], "low": r["ci_low"], "high": r["ci_high"]}
            for _, r in t.iterrows()]  # fmt: skip
    r0 = t.iloc[0]
    return {"rows": rows, "alpha": 1 - float(r0["ci_level"]), "n": int(r0["n"]),
            "clusters": int(r0["n_clusters"])}  # fmt: skip
