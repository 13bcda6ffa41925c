"""The study's findings in a few sentences: the abstract and the key-findings section.

Each sentence is chosen from an interval the stages wrote, never from the sign of a point
estimate: the reward model's accuracy and AUC on held-out arrangements (`reward/metrics.json`),
each method's gains over the start policy under the reward model and the audit with the
family's simultaneous intervals, and its place against best-of-N at equal KL
(`tables/eval_methods.csv`), and the answer to "does learning from experience need RL?"
(`eval/summary.json`'s `need_rl`).
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from rlxf_utils.algorithms import algorithm_label
from rlxf_utils.artifacts import RunDir
from rlxf_utils.report.evaluation import family_level
from rlxf_utils.report.gold import gold_auc
from rlxf_utils.report.reward import reward_labels
from rlxf_utils.report.seeds import seed_finding
from rlxf_utils.report.wording import ci, is_present, listing, num, pct_ci, say
from rlxf_utils.reward.model import PAPER_ACCURACY
from rlxf_utils.stats import level

#: The findings, in the order the abstract and the key-findings list state them.
FINDINGS = ("reward", "rl", "best_of_n", "offline")


def reward_finding(meta: dict[str, Any]) -> str:
    """The reward model against the paper's 82% and on held-out arrangements."""
    m = pd.DataFrame(meta["metrics"])
    lvl = level(meta["alpha"])
    labels = reward_labels(meta)
    scorers = m[~m["model"].isin(["majority", "context_only", "text_only"])]
    # every interval below the claim
    below = bool((scorers["accuracy_high"] < PAPER_ACCURACY).all())
    # the best model; where some interval reaches the claim, the one reaching highest
    best = scorers.loc[scorers["accuracy" if below else "accuracy_high"].idxmax()]
    acc = pct_ci(best["accuracy"], best["accuracy_low"], best["accuracy_high"])
    which = f"{labels.get(best['model'], best['model'])}, {best['protocol']} split, {lvl} CI"
    if below:
        out = (
            f"No model of MONA's condition texts reproduces the paper's {PAPER_ACCURACY:.0%} "
            f"accuracy (best: {acc}, {which})"
        )
    else:
        out = f"The paper's {PAPER_ACCURACY:.0%} accuracy is within a model's interval ({acc}, {which})"
    main = m[(m["model"] == meta["reward_source"]) & (m["protocol"] == meta["reward_protocol"])]
    if len(main):
        r = main.iloc[0]
        lo, hi = r["roc_auc_low"], r["roc_auc_high"]
        chance = f"{say('position_from', lo - 0.5, hi - 0.5)} chance"  # AUC against 0.5
        out += (
            f"; on arrangements it never saw ({meta['reward_protocol']} split), the reward model "
            f"RL optimises has an AUC of {ci(r['roc_auc'], lo, hi)}, {chance}"
        )
    return out


def _gain(r: pd.Series, key: str) -> str:
    return ci(r[key], r[f"{key}_low"], r[f"{key}_high"], signed=True)


def _moved(rows: pd.DataFrame, key: str) -> tuple[list[str], list[str]]:
    up = [f"{r['method']} ({_gain(r, key)})" for _, r in rows.iterrows() if r[f"{key}_low"] > 0]
    down = [f"{r['method']} ({_gain(r, key)})" for _, r in rows.iterrows() if r[f"{key}_high"] < 0]
    return up, down


def _no_gain_beyond(rows: pd.DataFrame, key: str, some_moved: bool) -> str:
    """The nulls as a bound, the largest upper end among the intervals that hold zero:
    'gains of at most +0.032', or 'the other 2: gains of at most +0.011' beside methods that
    moved; '' when every interval excludes zero. The caller puts it in parentheses."""
    null = rows[(rows[f"{key}_low"] <= 0) & (rows[f"{key}_high"] >= 0)]
    if null.empty:
        return ""
    top = num(float(null[f"{key}_high"].max()), signed=True)
    if not some_moved:
        return f"gains of at most {top}"
    others = "the other one" if len(null) == 1 else f"the other {len(null)}"
    return f"{others}: gains of at most {top}"


def rl_finding(table: pd.DataFrame, start: str, ci_level: str, gold_at_chance: bool = False) -> str:
    """Which RL (and ILHF) policies, one training seed each, moved the reward they were trained
    on, and the audit; the others' nulls stated as the largest gain their intervals allow, or,
    under an audit whose own AUC on held-out rows does not exclude chance (`gold_at_chance`),
    as what such a judge cannot tell. A claim about an algorithm rather than its one policy is
    the seeds' (`report.seeds`)."""
    rows = table[table["group"].isin(["RL", "ILHF"])]
    if rows.empty:
        return "No RL algorithm was evaluated"
    up, down = _moved(rows, "gain")
    aup, adown = _moved(rows, "audit_gain")
    name = algorithm_label(start)
    n = len(rows)
    first = (
        f"Of {n} RL and ILHF policies (one training seed each) tuned from {name}, "
        + (
            f"{listing(up)} raised the reward model's score on held-out prompts"
            if up
            else "none raised the reward model's score on held-out prompts"
        )  # fmt: skip
        + (f" and {listing(down)} lowered it" if down else "")
    )
    if bound := _no_gain_beyond(rows, "gain", bool(up or down)):
        first += f" ({bound})"
    second = (
        "under an audit model that no method optimised, "
        + (f"{listing(aup)} raised it" if aup else "none raised it")
        + (f" and {listing(adown)} lowered it" if adown else "")
    )
    notes = [_no_gain_beyond(rows, "audit_gain", bool(aup or adown))]
    if gold_at_chance and not (aup or adown):  # a null from a judge at chance says nothing
        second = (
            "an audit model that no method optimised, at chance on held-out rows, can neither "
            "confirm nor refute a gain"
        )
        notes = []
    # the audit's bound and the level share one pair of parentheses: no ') (' in a row
    notes.append(f"{ci_level} simultaneous CIs")
    return f"{first}; {second} ({'; '.join(n for n in notes if n)})"


def best_of_n_finding(table: pd.DataFrame, start: str) -> str:
    """Every method against best-of-N sampling from the start policy at the same KL."""
    rows = table[table["group"].isin(["RL", "ILHF", "offline"])]
    rows = rows[rows["vs_best_of_n"].apply(lambda v: isinstance(v, str) and v != "")]
    if rows.empty:
        return "No method was compared with best-of-N"
    verdict = rows["vs_best_of_n"].str.split().str[0]
    above = rows.loc[verdict == "above", "method"].tolist()
    below = rows.loc[verdict == "below", "method"].tolist()
    bon = table[table["group"] == "best-of-N"]
    lead = ""
    if len(bon):
        b = bon.iloc[0]
        lead = (
            f"{b['method'][0].upper()}{b['method'][1:]} sampling from {algorithm_label(start)}, "
            f"with no training, gains {_gain(b, 'gain')} under the reward model and "
            f"{_gain(b, 'audit_gain')} under the audit at a KL of at most {b['kl']:.2f} nats; "
        )
    n = len(rows)
    if below and not above:
        tail = f"at equal KL, {len(below)} of the {n} trained methods lie below it and none above"
    elif above:
        tail = (
            f"at equal KL, {listing(above)} lie{'s' if len(above) == 1 else ''} above it"
            f" and {len(below)} of the {n} trained methods below"
        )
    else:
        tail = f"at equal KL, none of the {n} trained methods is distinguishable from it"
    out = lead + tail
    return out[0].upper() + out[1:]


def offline_finding(need: dict[str, Any]) -> str:
    """The answer to 'does learning from experience need RL here?' under the audit."""
    a = need.get("audit_reward") or need.get("reward")
    if not a or a.get("answer") == "not compared":
        return "The offline methods (KTO, DPO, rejection-sampling fine-tuning) did not run"
    where = "under the audit" if "audit_reward" in need else "under the reward model"
    lvl = level(1 - a["ci_level"]) if is_present(a.get("ci_level")) else ""
    unit = f"({a['pairs']} paired comparisons, {lvl} simultaneous CIs)"
    names = listing([algorithm_label(w) for w in a.get("winners", [])])
    if a["answer"] == "rl":
        return f"Learning from MONA's outcomes needed RL {where}: {names} beat every offline method {unit}"
    if a["answer"] == "offline":
        return (
            f"Learning from MONA's outcomes did not need RL {where}: {names} beat every RL "
            f"algorithm {unit}"
        )
    return (
        f"Whether learning from MONA's outcomes needs RL, the data cannot say: {where}, no RL "
        f"algorithm beat every offline method (KTO, DPO, rejection-sampling fine-tuning) and "
        f"none of these beat every RL algorithm {unit}"
    )


def findings_section(run: RunDir) -> tuple[dict[str, Any], dict[str, str]]:
    """Variables `reward`, `rl`, `best_of_n`, `offline` (one finding each; `seeds` too where the
    run has further training seeds) and `abstract` (them as running text); `findings.md`, the
    key-findings list."""
    meta = run.read_json("reward/metrics.json", stage="notebook 02_reward_model")
    stage = "notebook 04_evaluation"
    summary = run.read_json("eval/summary.json", stage=stage)
    start = summary.get("start_policy", "sft")
    found = {"reward": reward_finding(meta)}
    if run.exists("tables/eval_methods.csv"):
        table = run.read_table("eval_methods", stage)
        fam = family_level(run.read_table("eval_paired", stage))
        gold = gold_auc(run)
        found["rl"] = rl_finding(table, start, fam, gold is not None and not gold["can_judge"])
        found["best_of_n"] = best_of_n_finding(table, start)
    else:
        note = f"This run directory predates the methods' comparison; rerun {stage}"
        found["rl"] = found["best_of_n"] = note
    found["offline"] = offline_finding(summary.get("need_rl", {}))
    keys = list(FINDINGS)
    seeds = seed_finding(run)
    if seeds is not None:  # a run with further training seeds
        keys.append("seeds")
    found["seeds"] = seeds or (
        "This run trained each algorithm with one seed, so the question is open here "
        "(`rlxf seeds` trains and evaluates more)"
    )
    found["abstract"] = " ".join(f"{found[k]}." for k in keys)
    listed = "\n".join(f"{i}. {found[k]}." for i, k in enumerate(keys, 1))
    return found, {"findings.md": listed + "\n"}
