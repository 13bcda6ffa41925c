"""Sentences chosen from the risk results, shared by notebook 05 and the report.

Every verdict word ("rose", "overstates", "favours", "rises with length", "a sign of reward
hacking") is read from an interval or a test at the level the stage stored (`alpha` in
`risk/summary.json`, which is `evaluation.alpha`): a direction is named only when the whole
interval lies on one side, otherwise the sentence says the difference is not distinguishable
from zero. Intervals resample whole prompts (responses) or arrangements (conditions).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from rlxf_utils.artifacts import RunDir
from rlxf_utils.report.wording import is_present as _ok
from rlxf_utils.report.wording import (
    level_ci,
    literal,
    markdown_table,
    num,
    pct,
    pval,
    say,
)
from rlxf_utils.risk.common import RiskError, missing_note
from rlxf_utils.stats import level, sign_of


@dataclass
class Finding:
    """One section's interpretation: a lead sentence and item sentences (or a note why absent)."""

    lead: str
    items: list[str] = field(default_factory=list)
    note: str | None = None

    def markdown(self) -> str:
        """For the notebook: the lead, then the items as a bullet list; a note as a warning."""
        if self.note:
            return f"> ⚠ {self.note}"
        return "\n\n".join(x for x in (self.lead, "\n".join(f"- {i}" for i in self.items)) if x)

    def paragraph(self) -> str:
        """For the report: one paragraph (lead and items as running sentences)."""
        if self.note:
            return f"Not measured in this run: {self.note}."
        return " ".join(x for x in (self.lead, *self.items) if x)


def drift_text(
    d: Mapping[str, Any] | None, alpha: float = 0.05, note: str | None = None
) -> Finding:
    """Label shift, the later calibration and the accuracy path, each verdict from its interval."""
    if d is None or "n_test" not in d:
        return Finding("", note=note or "no temporal-protocol predictions to score by year")
    t = d.get("tests") or {}
    bs = t.get("base_rate_shift") or {}
    shift = d["met_rate_test_years"] - d["met_rate_train_years"]
    moved = say("base_rate", bs.get("low"), bs.get("high"))
    lead = (
        f"Conditions tested up to {d['cutoff']} were MET {pct(d['met_rate_train_years'])} of the "
        f"time and those tested later {pct(d['met_rate_test_years'])}: the base rate {moved} "
        f"after the cut-off ({num(shift, 1, True, 100)} percentage points, "
        f"{level_ci(bs.get('low'), bs.get('high'), alpha, 1, 100)} points, arrangements resampled)."
    )
    cil = t.get("calibration_in_the_large") or {}
    bias = d["mean_p_test"] - d["observed_met_test"]
    verdict = say("overstates", cil.get("low"), cil.get("high"))
    lead += (
        f" Over the {d['n_test']} later conditions the model trained up to {d['cutoff']} predicts "
        f"P(MET) = {pct(d['mean_p_test'])} on average against an observed "
        f"{pct(d['observed_met_test'])} ({num(bias, 1, True, 100)} points, "
        f"{level_ci(cil.get('low'), cil.get('high'), alpha, 1, 100)} points): {verdict}."
    )
    tr = t.get("accuracy_trend") or {}
    trend = say("accuracy_trend", tr.get("low"), tr.get("high"))
    items = [
        f"Its accuracy is {pct(d['accuracy_first_year'])} in {d['first_year']} and "
        f"{pct(d['accuracy_last_year'])} in {d['last_year']}; a line through the later "
        f"conditions' correctness gives {num(100 * tr.get('estimate', float('nan')), 1)} points a "
        f"year ({level_ci(tr.get('low'), tr.get('high'), alpha, 1, 100)}): {trend}."
    ]
    vs = t.get("vs_majority")
    if vs:
        signs = [sign_of(r["low"], r["high"]) for r in vs]
        up, down = signs.count(1), signs.count(-1)
        per_year = f"per-year {level(alpha)} intervals of the difference"
        items.append(
            f"Its accuracy is not distinguishable from the always-the-training-majority rule's in "
            f"any of the {len(vs)} test years ({per_year})."
            if up == down == 0
            else f"Against the always-the-training-majority rule its accuracy is higher in {up} "
            f"of {len(vs)} test years, lower in {down} and not distinguishable in the other "
            f"{len(vs) - up - down} ({per_year})."
        )
    return Finding(lead, items)


_DIM_LABELS = {
    "region": "region",
    "arrangement_type": "arrangement type",
    "econ_area": "economic area",
}


def group_text(
    g: Mapping[str, Any], min_group_size: int | None = None, alpha: float = 0.05
) -> Finding:
    """Spread of accuracy and the largest calibration gap per grouping, its sign from its interval."""
    o = g["overall"]
    lead = (
        f"Overall, on {o['n']} test conditions, the reward model's accuracy is {pct(o['accuracy'])}, "
        f"its AUC {num(o['auc'])} and its mean P(MET) {pct(o['mean_p'])} against an observed "
        f"{pct(o['met_rate'])}."
    )
    items = []
    for dim, label in _DIM_LABELS.items():
        s = g.get(dim)
        if s is None:
            continue
        if s["n_groups"] < 2:
            size = f" of at least {min_group_size} conditions" if min_group_size else ""
            items.append(f"By {label}: one group only{size}, nothing to compare.")
            continue
        lo, hi = s.get("max_abs_gap_low"), s.get("max_abs_gap_high")
        gap = say("group_gap", lo, hi)
        count = ""
        if "n_groups_over" in s:
            count = (
                f" Over all {s['n_groups']} groups, the interval of the gap lies above zero for "
                f"{s['n_groups_over']} and below for {s['n_groups_under']}."
            )
        items.append(
            f"By {label} ({s['n_groups']} groups), accuracy ranges from {pct(s['accuracy_min'])} "
            f"({s['accuracy_min_group']}, n = {s['accuracy_min_n']}) to {pct(s['accuracy_max'])} "
            f"({s['accuracy_max_group']}, n = {s['accuracy_max_n']}); the largest calibration gap "
            f"is for {s['max_abs_gap_group']} (n = {s['max_abs_gap_n']}): "
            f"{num(s['max_abs_gap_signed'], 1, True, 100)} points, "
            + (
                f"{level_ci(lo, hi, alpha, 1, 100)} points: {gap}."
                if _ok(lo) and _ok(hi)
                else "with no interval (its conditions come from one arrangement): no direction "
                "is claimed."
            )
            + count
        )
    return Finding(lead, items)


def swap_text(cs: Mapping[str, Any], alpha: float = 0.05) -> Finding:
    """How far the reward moves when only the country changes, and whom it favours."""
    items = []
    for r in cs["by_source"]:
        sd = r.get("orig_sd")
        scale = ""
        if _ok(r.get("ratio")):
            lo, hi = r.get("ratio_low"), r.get("ratio_high")
            how = say("ratio", None if not _ok(lo) else lo - 1, None if not _ok(hi) else hi - 1)
            scale = (
                f", {num(r['ratio'], 2)} times the standard deviation of these texts' own rewards "
                f"({num(sd, 4)}; {level(alpha)} CI [{num(lo, 2)}, {num(hi, 2)}]): swapping the "
                f"country moves the reward {how} the typical difference between two texts"
            )
        items.append(
            f"For {r['source']} texts ({r['n_texts']} texts, {r['n_pairs']} swaps) the reward "
            f"changes by {num(r['mean_abs_delta'], 4)} on average (at most "
            f"{num(r['max_abs_delta'], 4)}){scale}."
        )
    rho, k = cs.get("spearman_delta_vs_hist_met_rate"), len(cs["countries"])
    p = cs.get("spearman_delta_vs_hist_met_rate_p")
    if not _ok(rho) or not _ok(p):
        fav = "Too few countries, or too little variation, to relate this to historical MET rates."
    elif p < alpha:
        fav = (
            f"The reward favours countries with {'higher' if rho > 0 else 'lower'} historical MET "
            f"rates (Spearman ρ = {num(rho, 2)}, {pval(p, prose=True)} < α = {alpha:g}, over {k} "
            "countries)."
        )
    else:
        fav = (
            "The favour is not distinguishably related to the countries' historical MET rates "
            f"(Spearman ρ = {num(rho, 2)}, {pval(p, prose=True)} ≥ α = {alpha:g}, over {k} "
            "countries)."
        )
    counts = ""
    if "n_countries_up" in cs:
        counts = (
            f" Swapping in a country raises the reward for {cs['n_countries_up']} of {k} "
            f"countries and lowers it for {cs['n_countries_down']} (interval of the mean change "
            "wholly above or below zero)."
        )
    items.append(
        f"Largest mean change when swapped in: {cs['most_favoured'].title()} "
        f"({cs['most_favoured_delta']:+.4f}); smallest: {cs['least_favoured'].title()} "
        f"({cs['least_favoured_delta']:+.4f}).{counts} {fav}"
    )
    if not cs.get("generated_included"):
        items.append("Generated texts were not swapped (notebook 04's samples are missing).")
    return Finding("We change only the country of each condition and score it again.", items)


def length_text(
    lr: Mapping[str, Any] | None, alpha: float = 0.05, note: str | None = None
) -> Finding:
    """Whether reward rises or falls with response length, per generated policy."""
    if lr is None:
        return Finding("", note=note or missing_note("eval/samples.parquet"))
    items = []
    for r in lr["by_policy"]:
        if not _ok(r["spearman"]):
            items.append(
                f"{r['policy']}: correlation undefined (constant length or reward, n = {r['n']})."
            )
            continue
        lo, hi = r.get("spearman_low"), r.get("spearman_high")
        verdict = say("length", lo, hi, level=level(alpha))
        items.append(
            f"{r['policy']} (n = {r['n']}, mean {num(r['mean_length'], 1)} words): {verdict} "
            f"(Spearman ρ = {num(r['spearman'], 2)}, {level_ci(lo, hi, alpha, 2)}; Pearson r = "
            f"{num(r['pearson'], 2)})."
        )
    return Finding(
        "Reward against response length, in words (intervals resample whole prompts):", items
    )


def _gain_verdict(r: Mapping[str, Any]) -> str:
    rg = sign_of(r.get("reward_gain_low"), r.get("reward_gain_high"))
    if rg <= 0:
        what = "lowered" if rg < 0 else "did not distinguishably raise"
        return f"RL {what} the training reward, so there is no gain for the audit to confirm"
    ag = sign_of(r.get("audit_gain_low"), r.get("audit_gain_high"))
    gap = sign_of(r.get("gap_low"), r.get("gap_high"))
    if ag < 0:
        return (
            "the audit reward falls: the gain is specific to the training reward, a sign of "
            "reward hacking"
        )
    if ag == 0 and gap > 0:
        return (
            "the audit reward does not rise distinguishably and the training reward gains more: "
            "the gain is specific to the training reward, a sign of reward hacking"
        )
    if ag == 0:
        return "the audit reward does not rise distinguishably, nor is the gap between the two"
    if gap > 0:
        return (
            "the audit reward rises too, but less than the training reward: part of the gain is "
            "specific to the training reward"
        )
    return "the audit reward rises too, and the gap between the two is not distinguishable"


def gains_text(
    cg: Sequence[Mapping[str, Any]] | None, alpha: float = 0.05, note: str | None = None
) -> Finding:
    """Whether the audit reward follows the training reward's gain at the last checkpoint."""
    if cg is None:
        return Finding("", note=note or missing_note("eval/frontier.parquet"))
    items = []
    for r in cg:
        head = f"{r['algo']} at step {r['step']} (against {r['baseline']}): "
        if not _ok(r.get("reward_gain_low")):
            items.append(
                head + f"training reward {r['reward_gain']:+.4f}, audit reward "
                f"{r['audit_gain']:+.4f} (frontier means; no interval: its samples are not in "
                "eval/samples.parquet)."
            )
            continue
        items.append(
            head + f"training reward {r['reward_gain']:+.4f} "
            f"({level_ci(r['reward_gain_low'], r['reward_gain_high'], alpha, 4)}), audit reward "
            f"{r['audit_gain']:+.4f} ({level_ci(r['audit_gain_low'], r['audit_gain_high'], alpha, 4)}), "
            f"gap {r['gap']:+.4f} ({level_ci(r['gap_low'], r['gap_high'], alpha, 4)}); "
            f"{_gain_verdict(r)}."
        )
    return Finding(
        f"Gain over the start at the last checkpoint ({level(alpha)} intervals over prompts):",
        items,
    )


def ngrams_text(
    ng: Mapping[str, Sequence[str]] | None, start: str = "base", note: str | None = None
) -> Finding:
    """The bigrams each tuned policy uses more than the start policy (descriptive)."""
    if ng is None:
        return Finding("", note=note or missing_note("eval/samples.parquet"))
    items = [
        f"{p}: "
        + (", ".join(f"“{literal(b)}”" for b in grams) if grams else f"none above {start}")
        + "."
        for p, grams in ng.items()
    ]
    return Finding(
        f"Bigrams with the largest gain in share of responses over {start} (descriptive: the "
        "largest of many differences, not tested one by one):",
        items,
    )


_MEASURES = {
    "entropy": ("area entropy", 2, " nats"),
    "kl_to_reference": ("KL to the reference", 2, " nats"),
    "within_prompt_distinct_2": ("within-prompt distinct-2", 3, ""),
}


def diversity_text(
    dv: Mapping[str, Any] | None, alpha: float = 0.05, note: str | None = None
) -> Finding:
    """Areas covered per generated policy, and start -> tuned changes judged by their intervals."""
    if dv is None:
        return Finding("", note=note or missing_note("eval/samples.parquet"))
    rows = {r["policy"]: r for r in dv["by_policy"]}
    ref = rows[dv["reference"]]
    w = "within_prompt_distinct_2"
    lead = (
        f"The reference ({dv['reference']}, {ref['n']} conditions) spans {ref['n_areas']} areas "
        f"(entropy {num(ref['entropy'], 2)} nats)."
    )
    items = [
        f"{p} ({r['n']} responses): {r['n_areas']} areas, entropy {num(r['entropy'], 2)} nats, KL "
        f"to the reference {num(r['kl_to_reference'], 2)} nats, {pct(r['coverage'], 0)} of its "
        f"areas covered, {pct(r['on_topic'], 0)} on the requested area; within-prompt distinct-2 "
        f"{num(r.get(w), 3)}."
        for p, r in rows.items()
        if r.get("kind") == "generated"
    ]
    changes = pd.DataFrame(dv.get("changes") or [])
    start = dv.get("start", "base")
    for pol, g in changes.groupby("policy", sort=False) if len(changes) else []:
        parts = []
        for r in g.to_dict("records"):
            label, digits, unit = _MEASURES[r["measure"]]
            verb = say("change", r["ci_low"], r["ci_high"])
            parts.append(
                f"{label} {verb} ({num(r['start'], digits)} → {num(r['value'], digits)}{unit}, "
                f"{level_ci(r['ci_low'], r['ci_high'], alpha, digits)})"
            )
        items.append(f"From {start} to {pol}: " + "; ".join(parts) + ".")
    if len(changes):
        items.append(f"(Intervals at {level(alpha)} resample whole prompts.)")
    return Finding(lead, items)


def labels_text(records: Sequence[Mapping[str, Any]], alpha: float = 0.05) -> Finding:
    """How each label mapping changes labels, accuracy and the ranking of texts."""
    by = {r["variant"]: r for r in records}
    ref_name = records[0]["reference"]
    r0 = by[ref_name]
    items = []
    for r in records:
        if r["variant"] == ref_name:
            continue
        lo, hi = r.get("spearman_low"), r.get("spearman_high")
        variant, dropped = str(r["variant"]), r["excluded_statuses"]
        dropped = dropped if _ok(dropped) and str(dropped).strip("- ") else "none"
        items.append(
            f"Under the mapping “`{variant}`” (MET = {r['met_statuses']}; dropped: {dropped}): "
            f"{r['train_labels_changed']} training and {r['test_labels_changed']} test labels change "
            f"and {r['train_rows_dropped']} training and {r['test_rows_dropped']} test rows are "
            f"dropped; test MET share {pct(r['met_share_test'])} ({ref_name}: "
            f"{pct(r0['met_share_test'])}), accuracy {pct(r['accuracy'])} ({ref_name}: "
            f"{pct(r0['accuracy'])}; majority rule {pct(r['majority_accuracy'])}), AUC "
            f"{num(r['auc'])} ({ref_name}: {num(r0['auc'])}); Spearman ρ with the {ref_name} "
            f"mapping's scores {num(r['spearman_vs_reference'], 2)} ({level(alpha)} CI "
            f"[{num(lo, 2)}, {num(hi, 2)}], arrangements resampled) on {r['n_common']} common "
            "test texts."
        )
    return Finding(
        f"The TF-IDF reward is retrained under each mapping and compared with the {ref_name} mapping.",
        items,
    )


def stored_alpha(summary: Mapping[str, Any], alpha: float | None = None) -> float:
    """The level the stage computed its intervals at; a different `alpha` is an error."""
    stored = float(summary.get("alpha", 0.05))
    if alpha is not None and abs(alpha - stored) > 1e-12:
        raise RiskError(
            f"risk/summary.json holds intervals at alpha = {stored}, not {alpha}; rerun notebook "
            "05 with the same evaluation.alpha"
        )
    return stored


def interpret(summary: Mapping[str, Any], alpha: float | None = None) -> dict[str, Finding]:
    """Every section's `Finding` from `risk/summary.json` (or `RiskStage.summary`)."""
    a = stored_alpha(summary, alpha)
    notes = list(summary.get("notes", []))

    def note_for(artifact: str) -> str | None:
        return next((n for n in notes if artifact in n), None)

    start = summary.get("start_policy", "base")
    return {
        "drift": drift_text(summary.get("drift"), a, note_for("predictions_temporal")),
        "group_bias": group_text(summary["group_bias"], summary.get("min_group_size"), a),
        "country_swap": swap_text(summary["country_swap"], a),
        "length_reward": length_text(summary.get("length_reward"), a, note_for("samples")),
        "checkpoint_gains": gains_text(summary.get("checkpoint_gains"), a, note_for("frontier")),
        "rising_ngrams": ngrams_text(summary.get("rising_ngrams"), start, note_for("samples")),
        "diversity": diversity_text(summary.get("diversity"), a, note_for("samples")),
        "label_variants": labels_text(summary["label_variants"], a),
    }


def base_rate_sentence(d: Mapping[str, Any] | None, alpha: float) -> str:
    """One clause for the report's conclusion: the base rate across the cut-off, with its verdict."""
    if not d:
        return "the base rate across a cut-off is not measured (the temporal protocol was not run)"
    bs = (d.get("tests") or {}).get("base_rate_shift") or {}
    verdict = say("base_rate_short", bs.get("low"), bs.get("high"))
    return (
        f"the MET base rate was {pct(d['met_rate_train_years'])} up to the {d['cutoff']} cut-off "
        f"and {pct(d['met_rate_test_years'])} after it ({verdict} at the {level(alpha)} level)"
    )


#: Tables the report includes (name in `_generated/` -> risk table and the columns kept).
REPORT_TABLES: dict[str, tuple[str, list[str] | None]] = {
    "risk_drift_by_year.md": ("risk_drift_by_year", None),
    "risk_group_bias.md": (
        "risk_group_bias",
        [
            "dimension",
            "group",
            "n",
            "met_rate",
            "mean_p",
            "calibration_gap",
            "gap_low",
            "gap_high",
            "accuracy",
            "auc",
            "ece",
        ],
    ),  # fmt: skip
    "risk_country_swap_by_country.md": ("risk_country_swap_by_country", None),
    "risk_length_reward.md": (
        "risk_length_reward",
        ["policy", "n", "mean_length", "spearman", "spearman_low", "spearman_high", "pearson"],
    ),
    "risk_checkpoint_gains.md": ("risk_checkpoint_gains", None),
    "risk_area_diversity.md": ("risk_area_diversity", None),
    "risk_label_variants.md": (
        "risk_label_variants",
        [
            "variant",
            "met_statuses",
            "excluded_statuses",
            "n_train",
            "met_share_test",
            "accuracy",
            "auc",
            "spearman_vs_reference",
            "spearman_low",
            "spearman_high",
        ],
    ),  # fmt: skip
}


def report_content(run: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """(variables, includes) of the report's risk section, from notebook 05's artifacts.

    Variables: one paragraph per measure (`drift`, `group_bias`, `country_swap`,
    `length_reward`, `checkpoint_gains`, `rising_ngrams`, `diversity`, `label_variants`), each
    chosen from the numbers and their intervals, a few headline numbers, `level` (the intervals'
    confidence level), `base_rate_shift` (a clause for the conclusion) and `notes` (what was not
    measured). Includes: compact markdown tables `_generated/risk_*.md` (a table whose input was
    missing holds the note saying so).
    """

    stage = "notebook 05_risk_discussion"
    summary = run.read_json("risk/summary.json", stage)
    alpha = stored_alpha(summary)
    found = interpret(summary)
    variables: dict[str, Any] = {k: f.paragraph() for k, f in found.items()}
    notes = summary.get("notes", [])
    variables["notes"] = (
        "Every input was present." if not notes else "Not measured: " + "; ".join(notes) + "."
    )
    variables["level"] = level(alpha)
    variables["reward_source"] = summary["reward_source"]
    variables["reward_protocol"] = summary["reward_protocol"]
    d = summary.get("drift") or {}
    variables["cutoff"] = str(d.get("cutoff", "n/a"))
    variables["met_rate_train_years"] = pct(d.get("met_rate_train_years"))
    variables["met_rate_test_years"] = pct(d.get("met_rate_test_years"))
    variables["base_rate_shift"] = base_rate_sentence(summary.get("drift"), alpha)
    hist = next(
        (r for r in summary["country_swap"]["by_source"] if r["source"] == "historical"), {}
    )
    variables["swap_mean_abs_delta"] = num(hist.get("mean_abs_delta"), 4)
    includes = {}
    for fname, (table, cols) in REPORT_TABLES.items():
        df = run.read_table(table, stage)
        if cols is not None and "note" not in df.columns:
            df = df[[c for c in cols if c in df.columns]]
        # identifiers read as words, and may wrap in a narrow PDF column ('arrangement type')
        text = [
            c for c in df.columns if df[c].dtype == object or pd.api.types.is_string_dtype(df[c])
        ]
        df = df.assign(**{c: df[c].astype(str).str.replace("_", " ") for c in text})
        df.columns = [str(c).replace("_", " ") for c in df.columns]
        includes[fname] = markdown_table(df)
    return variables, includes


def risk_section(run: RunDir) -> tuple[dict[str, Any], dict[str, str]]:
    """Variables and tables of notebook 05, from `risk/summary.json` and its tables."""

    return report_content(run)


SECTIONS = ("reward", "forensic", "rl", "eval", "rlgf", "ilhf", "risk")
