"""Could the study see a gain? The positive control's answer in words (`docs/methods.md`, "The
positive control"): the control run beside this one (`runs/control`, `params/control.yaml`),
its planted rule, each control method's true gain beside both judges' estimates and verdicts
(`tables/eval_control.csv`), the smallest true gain the audit saw on generated text, and this
run's null read against it. The words are the author's, in `reports/templates/control.jinja`."""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from rlxf_utils.artifacts import RunDir
from rlxf_utils.evaluation.control import control_features, detected, judge_scale, registered
from rlxf_utils.markdown import is_present
from rlxf_utils.report.evaluation import table_note
from rlxf_utils.report.gold import control_run, gold_auc
from rlxf_utils.report.wording import sentence, table

STAGE = "notebook 04_evaluation"


def _finite(x: Any) -> float | None:
    return float(x) if is_present(x) and math.isfinite(float(x)) else None


def main_audit_bound(run: RunDir) -> dict[str, Any] | None:
    """This run's largest audit gain any trained method's interval allows (the upper ends in
    `eval_methods`, the trained methods), with its level; None without the table."""
    if not run.exists("tables/eval_methods.csv"):
        return None
    m = run.read_table("eval_methods", STAGE)
    trained = m[m["group"].isin(["RL", "ILHF", "offline"])] if "group" in m else m
    highs = [
        h for h in trained.get("audit_gain_high", pd.Series(dtype=float)) if _finite(h) is not None
    ]
    lows = [
        lo
        for lo in trained.get("audit_gain_low", pd.Series(dtype=float))
        if _finite(lo) is not None
    ]
    if not highs:
        return None
    return {"bound": float(max(highs)), "methods": len(highs),
            "any_above": any(lo > 0 for lo in lows)}  # fmt: skip


def control_context(run: RunDir, ctl: RunDir, t: pd.DataFrame) -> dict[str, Any]:
    """What `control.jinja` reads of the control run `ctl` beside `run` and its table `t`."""
    planted = (
        ctl.read_json("data/planted.json", "notebook 01_data")
        if ctl.exists("data/planted.json")
        else {}
    )
    rows = [{"policy": r["policy"], "n": r["n"], "level": r["ci_level"],
             **{k: {"est": r[f"{k}_gain"], "low": r[f"{k}_low"], "high": r[f"{k}_high"],
                    "verdict": r[f"{k}_verdict"]} for k in ("true", "reward", "audit")},
             "reward_matches": r["reward_matches"], "audit_matches": r["audit_matches"]}
            for r in t.to_dict("records")]  # fmt: skip
    audit_auc = {name: ({k: g[k] for k in ("auc", "low", "high", "level")} if g else None)
                 for name, g in (("control", gold_auc(ctl)), ("main", gold_auc(run)))}  # fmt: skip
    return {"rows": rows, "auc": _finite(planted.get("held_out_expected_auc")),
            "auc_all": _finite(planted.get("expected_auc")),
            "held_out": planted.get("held_out_rows"), "agrees": _finite(planted.get("agrees_with_observed")),
            "detected_audit": detected(t, "audit"), "detected_reward": detected(t, "reward"),
            "seen_audit": registered(t, "audit"), "scale_audit": judge_scale(t, "audit"),
            "audit_auc": audit_auc,
            "largest_true": max((r["true"]["est"] for r in rows if _finite(r["true"]["est"]) is not None),
                                default=None),
            "true_above": sorted(float(r["true"]["est"]) for r in rows if r["true"]["verdict"] == "above"),
            "main": main_audit_bound(run), "commit": ctl.read_json("manifest.json").get("git", {}).get("commit", "")[:7]
            if ctl.exists("manifest.json") else ""}  # fmt: skip


def control_section(run: RunDir) -> tuple[dict[str, Any], dict[str, str]]:
    """The variable `sentence` and the tables `eval_control.md` and `eval_control_features.md`
    (a note in each without a control run)."""
    ctl = control_run(run)
    if ctl is None:
        text = sentence("control", "control_sentence", None)
        note = table_note("no control run beside this run")
        return {"sentence": text}, {"eval_control.md": note, "eval_control_features.md": note}
    t = ctl.read_table("eval_control", STAGE)
    text = sentence("control", "control_sentence", control_context(run, ctl, t))
    return {"sentence": text}, {"eval_control.md": table("eval_control", t),
                                "eval_control_features.md": table("eval_control_features",
                                                                  features(ctl, t))}  # fmt: skip


def features(ctl: RunDir, t: pd.DataFrame) -> pd.DataFrame:
    """`evaluation.control.control_features` of the control's recorded samples: its start policy
    and each method of `t`."""
    start = ctl.read_json("eval/summary.json", STAGE).get("start_policy", "sft")
    samples = ctl.read_parquet("eval/samples.parquet")
    return control_features(samples, [start, *t["policy"]])
