"""Sentences chosen from the risk results, shared by notebook 05 and the report.

Every verdict ("rose", "overstates", "favours", "rises with length", "a sign of reward hacking")
is read from an interval or a test at the level the stage stored (`alpha` in `risk/summary.json`,
which is `evaluation.alpha`): a direction is named only when the whole interval lies on one side,
otherwise the sentence says the difference is not distinguishable from zero. Intervals resample
whole prompts (responses) or arrangements (conditions). Python picks the rows, counts and verdict
codes; the words are the author's, in `reports/templates/risk.jinja`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from rlxf_utils.artifacts import RunDir
from rlxf_utils.markdown import markdown_table
from rlxf_utils.report.gold import gold_auc
from rlxf_utils.report.wording import ABOVE, BELOW, UNCLEAR, name_cells, num, pct, sentence, spaced
from rlxf_utils.report.wording import is_present as _ok
from rlxf_utils.risk.common import RiskError, missing_note
from rlxf_utils.stats import bound_verdict, level, sign_of


@dataclass
class Finding:
    """One section's interpretation: a lead sentence and item sentences (or a note why absent)."""

    lead: str
    items: list[str] = field(default_factory=list)
    note: str | None = None

    @classmethod
    def of(cls, macro: str, *args: Any) -> Finding:
        """The lead and items a macro of `risk.jinja` writes (its first paragraph and the rest)."""
        lead, *items = sentence("risk", macro, *args).split("\n\n")
        return cls(lead, items)

    def markdown(self) -> str:
        """For the notebook: the lead, then the items as a bullet list; a note as a warning."""
        if self.note:
            return f"> ⚠ {self.note}"
        return "\n\n".join(x for x in (self.lead, "\n".join(f"- {i}" for i in self.items)) if x)

    def paragraph(self) -> str:
        """For the report: one paragraph (lead and items as running sentences)."""
        if self.note:
            return sentence("risk", "not_measured", self.note)
        return " ".join(x for x in (self.lead, *self.items) if x)


def _ci(test: Mapping[str, Any] | None) -> dict[str, Any]:
    """A stored test's interval (and estimate), its missing parts None (NaN for the estimate)."""
    t = test or {}
    return {"low": t.get("low"), "high": t.get("high"), "estimate": t.get("estimate", float("nan"))}


def drift_text(
    d: Mapping[str, Any] | None, alpha: float = 0.05, note: str | None = None
) -> Finding:
    """Label shift, the later calibration and the accuracy path, each verdict from its interval."""
    if d is None or "n_test" not in d:
        return Finding("", note=note or sentence("risk", "no_temporal_predictions"))
    t = d.get("tests") or {}
    signs = [sign_of(r["low"], r["high"]) for r in t.get("vs_majority") or []]
    return Finding.of("drift", {
        **d, "alpha": alpha, "shift_ci": _ci(t.get("base_rate_shift")),
        "calibration_ci": _ci(t.get("calibration_in_the_large")),
        "trend_ci": _ci(t.get("accuracy_trend")),
        "shift": d["met_rate_test_years"] - d["met_rate_train_years"],
        "bias": d["mean_p_test"] - d["observed_met_test"],
        "vs_years": len(signs), "vs_up": signs.count(1), "vs_down": signs.count(-1),
    })  # fmt: skip


#: The groupings of `group_bias`, in the order the report names them.
_DIMS = ("region", "arrangement_type", "econ_area")


def group_text(
    g: Mapping[str, Any], min_group_size: int | None = None, alpha: float = 0.05
) -> Finding:
    """Spread of accuracy and the largest calibration gap per grouping, its sign from its interval."""
    groups = [
        {**s, "dim": dim, "counts": "n_groups_over" in s,
         "max_abs_gap_low": s.get("max_abs_gap_low"), "max_abs_gap_high": s.get("max_abs_gap_high"),
         "has_ci": _ok(s.get("max_abs_gap_low")) and _ok(s.get("max_abs_gap_high"))}
        for dim in _DIMS if (s := g.get(dim)) is not None
    ]  # fmt: skip
    return Finding.of("group_bias", g["overall"], groups, min_group_size, alpha)


def swap_favour(cs: Mapping[str, Any], alpha: float) -> str | None:
    """How the reward's favour relates to the countries' historical MET rates: None (too few
    countries or no variation), `UNCLEAR` (Spearman's test not significant at `alpha`), else
    `ABOVE` / `BELOW` (it favours countries with higher / lower rates)."""
    rho, p = cs.get("spearman_delta_vs_hist_met_rate"), cs.get("spearman_delta_vs_hist_met_rate_p")
    if not _ok(rho) or not _ok(p):
        return None
    return UNCLEAR if p >= alpha else ABOVE if rho > 0 else BELOW


def swap_ratio_verdict(r: Mapping[str, Any]) -> str | None:
    """How a source's swap moves the reward against the typical difference between two texts:
    the verdict of its ratio's interval against 1, None where it has no ratio."""
    if not _ok(r.get("ratio")):
        return None
    lo, hi = r.get("ratio_low"), r.get("ratio_high")
    return bound_verdict(lo - 1 if _ok(lo) else None, hi - 1 if _ok(hi) else None)


def swap_text(cs: Mapping[str, Any], alpha: float = 0.05) -> Finding:
    """How far the reward moves when only the country changes, and whom it favours."""
    by_source = [{**r, "ratio_verdict": swap_ratio_verdict(r)} for r in cs["by_source"]]
    return Finding.of("country_swap", {**cs, "by_source": by_source}, swap_favour(cs, alpha), alpha)


def length_text(
    lr: Mapping[str, Any] | None, alpha: float = 0.05, note: str | None = None
) -> Finding:
    """Whether reward rises or falls with response length, per generated policy."""
    if lr is None:
        return Finding("", note=note or note_text(missing_note("eval/samples.parquet")))
    rows = [{**r, "defined": _ok(r["spearman"])} for r in lr["by_policy"]]
    return Finding.of("length_reward", rows, alpha)


def gain_reading(r: Mapping[str, Any], gold_at_chance: bool = False) -> str:
    """What the audit reward says of a checkpoint's gain, from the intervals of the training
    reward's gain, the audit reward's gain and their gap: 'lowered' / 'not raised' (no training
    gain to confirm), 'audit falls', 'specific' (the audit does not rise and the training reward
    gains more), 'unclear', 'audit gains more' (the audit's gain exceeds the training reward's,
    whether or not the audit's own interval excludes zero), 'partly specific' (both rise, the
    training reward more), 'followed' (both rise, their gap not distinguishable); under an audit
    whose own AUC interval on held-out rows holds 0.5 (`gold_at_chance`), 'unjudged' whatever
    the audit's and the gap's intervals say (`report.gold.gold_cannot_judge`)."""
    rg = sign_of(r.get("reward_gain_low"), r.get("reward_gain_high"))
    if rg <= 0:
        return "lowered" if rg < 0 else "not raised"
    if gold_at_chance:
        return "unjudged"
    ag = sign_of(r.get("audit_gain_low"), r.get("audit_gain_high"))
    gap = sign_of(r.get("gap_low"), r.get("gap_high"))
    if ag < 0:
        return "audit falls"
    if gap < 0:
        return "audit gains more"
    if ag == 0:
        return "specific" if gap > 0 else "unclear"
    return "partly specific" if gap > 0 else "followed"


def gains_text(
    cg: Sequence[Mapping[str, Any]] | None, alpha: float = 0.05, note: str | None = None,
    gold_at_chance: bool = False,
) -> Finding:  # fmt: skip
    """Whether the audit reward follows the training reward's gain at the last checkpoint (read
    against the audit's own discrimination: `gain_reading`)."""
    if cg is None:
        return Finding("", note=note or note_text(missing_note("eval/frontier.parquet")))
    rows = [{**r, "has_ci": _ok(r.get("reward_gain_low")),
             "reading": gain_reading(r, gold_at_chance)} for r in cg]  # fmt: skip
    return Finding.of("checkpoint_gains", rows, alpha)


def ngrams_text(
    ng: Mapping[str, Sequence[str]] | None, start: str = "base", note: str | None = None
) -> Finding:
    """The bigrams each tuned policy uses more than the start policy (descriptive)."""
    if ng is None:
        return Finding("", note=note or note_text(missing_note("eval/samples.parquet")))
    return Finding.of("rising_ngrams", ng, start)


def diversity_text(
    dv: Mapping[str, Any] | None, alpha: float = 0.05, note: str | None = None
) -> Finding:
    """Areas covered per generated policy, and start -> tuned changes judged by their intervals."""
    if dv is None:
        return Finding("", note=note or note_text(missing_note("eval/samples.parquet")))
    rows = {r["policy"]: r for r in dv["by_policy"]}
    changes: dict[str, list[Mapping[str, Any]]] = {}
    for r in dv.get("changes") or []:
        changes.setdefault(r["policy"], []).append(r)
    return Finding.of(
        "diversity", dv, rows[dv["reference"]],
        [r for r in rows.values() if r.get("kind") == "generated"],
        [{"policy": p, "rows": g} for p, g in changes.items()], dv.get("start", "base"), alpha,
    )  # fmt: skip


def labels_text(records: Sequence[Mapping[str, Any]], alpha: float = 0.05) -> Finding:
    """How each label mapping changes labels, accuracy and the ranking of texts."""
    ref_name = records[0]["reference"]
    ref = next(r for r in records if r["variant"] == ref_name)

    def dropped(x: Any) -> Any:
        return x if _ok(x) and str(x).strip("- ") else None

    variants = [
        {**r, "dropped": dropped(r["excluded_statuses"])}
        for r in records
        if r["variant"] != ref_name
    ]
    return Finding.of("label_variants", variants, ref, alpha)


def stored_alpha(summary: Mapping[str, Any], alpha: float | None = None) -> float:
    """The level the stage computed its intervals at; a different `alpha` is an error."""
    stored = float(summary.get("alpha", 0.05))
    if alpha is not None and abs(alpha - stored) > 1e-12:
        raise RiskError(
            f"risk/summary.json holds intervals at alpha = {stored}, not {alpha}; rerun notebook "
            "05 with the same evaluation.alpha"
        )
    return stored


def _note(n: Any) -> dict[str, Any]:
    """A stored note as its fields; a run from before stored the sentence itself."""
    return dict(n) if isinstance(n, Mapping) else {"note": str(n), "artifact": str(n)}


def note_text(n: Any) -> str:
    """A note of the risk stage (`risk.common.missing_note` and the like: an input it lacked) in
    words, from `reports/templates/risk.jinja`."""
    return sentence("risk", "note", _note(n))


def interpret(
    summary: Mapping[str, Any], alpha: float | None = None, gold_at_chance: bool = False
) -> dict[str, Finding]:
    """Every section's `Finding` from `risk/summary.json` (or `RiskStage.summary`); with
    `gold_at_chance` (the audit's AUC interval on held-out rows holds 0.5) no checkpoint's audit
    reading is given as a verdict (`gain_reading`)."""
    a = stored_alpha(summary, alpha)
    notes = list(summary.get("notes", []))

    def note_for(artifact: str) -> str | None:
        return next(
            (note_text(n) for n in notes if artifact in str(_note(n).get("artifact"))), None
        )

    start = summary.get("start_policy", "base")
    return {
        "drift": drift_text(summary.get("drift"), a, note_for("predictions_temporal")),
        "group_bias": group_text(summary["group_bias"], summary.get("min_group_size"), a),
        "country_swap": swap_text(summary["country_swap"], a),
        "length_reward": length_text(summary.get("length_reward"), a, note_for("samples")),
        "checkpoint_gains": gains_text(
            summary.get("checkpoint_gains"), a, note_for("frontier"), gold_at_chance
        ),
        "rising_ngrams": ngrams_text(summary.get("rising_ngrams"), start, note_for("samples")),
        "diversity": diversity_text(summary.get("diversity"), a, note_for("samples")),
        "label_variants": labels_text(summary["label_variants"], a),
    }


def base_rate_sentence(d: Mapping[str, Any] | None, alpha: float) -> str:
    """One clause for the report's conclusion: the base rate across the cut-off, with its verdict."""
    shift = _ci(((d or {}).get("tests") or {}).get("base_rate_shift"))
    return sentence("risk", "base_rate_shift", d and {**d, "shift_ci": shift}, alpha)


#: Tables the report includes (name in `_generated/` -> risk table and the columns kept).
REPORT_TABLES: dict[str, tuple[str, list[str] | None]] = {
    "risk_drift_by_year.md": ("risk_drift_by_year", None),
    "risk_group_bias.md": ("risk_group_bias", [
        "dimension", "group", "n", "met_rate", "mean_p", "calibration_gap", "gap_low", "gap_high",
        "accuracy", "auc", "ece"]),
    "risk_country_swap_by_country.md": ("risk_country_swap_by_country", None),
    "risk_length_reward.md": ("risk_length_reward", [
        "policy", "n", "mean_length", "spearman", "spearman_low", "spearman_high", "pearson"]),
    "risk_checkpoint_gains.md": ("risk_checkpoint_gains", None),
    "risk_area_diversity.md": ("risk_area_diversity", None),
    "risk_label_variants.md": ("risk_label_variants", [
        "variant", "met_statuses", "excluded_statuses", "n_train", "met_share_test", "accuracy",
        "auc", "spearman_vs_reference", "spearman_low", "spearman_high"]),
}  # fmt: skip


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
    gold = gold_auc(run)  # an audit at chance: its readings are ones it cannot interpret
    chance = gold is not None and not gold["can_judge"]
    variables: dict[str, Any] = {
        k: f.paragraph() for k, f in interpret(summary, None, chance).items()
    }
    d = summary.get("drift") or {}
    hist = next(
        (r for r in summary["country_swap"]["by_source"] if r["source"] == "historical"), {}
    )
    variables |= {
        "notes": sentence("risk", "notes", [note_text(n) for n in summary.get("notes", [])]),
        "level": level(alpha),
        "reward_source": summary["reward_source"],
        "reward_protocol": summary["reward_protocol"],
        "cutoff": str(d.get("cutoff", "n/a")),
        "met_rate_train_years": pct(d.get("met_rate_train_years")),
        "met_rate_test_years": pct(d.get("met_rate_test_years")),
        "base_rate_shift": base_rate_sentence(summary.get("drift"), alpha),
        "swap_mean_abs_delta": num(hist.get("mean_abs_delta"), 4),
    }
    includes = {}
    for fname, (table, cols) in REPORT_TABLES.items():
        df = run.read_table(table, stage)
        if "note" in df.columns:  # its input was missing: the note, in words
            df = pd.DataFrame({"note": [note_text(df.iloc[0].dropna().to_dict())]})
        elif cols is not None:
            df = df[[c for c in cols if c in df.columns]]
        # display names, then identifiers as words that may wrap in a narrow PDF column
        df = name_cells(df)
        text = [
            c for c in df.columns if df[c].dtype == object or pd.api.types.is_string_dtype(df[c])
        ]
        df = df.assign(**{c: df[c].astype(str).str.replace("_", " ") for c in text})
        df.columns = [spaced(c) for c in df.columns]
        includes[fname] = markdown_table(df)
    return variables, includes


def risk_section(run: RunDir) -> tuple[dict[str, Any], dict[str, str]]:
    """Variables and tables of notebook 05, from `risk/summary.json` and its tables."""
    return report_content(run)
