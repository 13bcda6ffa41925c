"""The risk stage (notebook 05): read the run dir once (`load_inputs`), call each family of
`RISK_FAMILIES` in turn, write tables `risk_*`, figures `risk_*` and `risk/summary.json`.

A family is one entry of `risk/summary.json`: a small function of `RiskInputs` that returns its
tables, its summary entry and its figures (`Measured`), or, when an input it needs is absent, a
note saying which, a one-row note table in place of each of its tables and `None` as its entry.
Measures that depend on notebook 04 (`eval/samples.parquet`, `eval/frontier.parquet`) are
reported so when that notebook has not run. Every interval is at level 1 - `evaluation.alpha`
with `evaluation.n_boot` resamples; the level is stored in the summary as `alpha`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from rlxf_utils.data.splits import load_splits
from rlxf_utils.evaluation.measures import tokenize
from rlxf_utils.reward.bundle import load_reward
from rlxf_utils.reward.training import configure_threads
from rlxf_utils.risk.common import (
    HISTORY_PREFIX,
    RiskError,
    binary_metrics,
    generated_policies,
    missing_note,
    note_table,
    policy_kind,
    prediction_column,
    require_columns,
    start_policy,
    tuned_policies,
)
from rlxf_utils.stats import corr, sign_of

from ..prompts import CONTEXT_FIELDS
from .diversity import area_table, diversity_changes, plot_areas, within_prompt_diversity
from .drift import base_rate_by_year, drift_by_year, drift_summary, drift_tests, plot_drift
from .groups import (
    assign_regions,
    group_bias_summary,
    group_bias_table,
    load_regions,
    plot_group_bias,
)
from .hacking import (
    checkpoint_gains,
    final_gains,
    length_reward,
    plot_gains,
    plot_length_reward,
    rising_ngrams,
)
from .labels import label_sensitivity, plot_label_variants
from .swap import choose_swap_countries, country_swap, plot_swap, swap_summary

#: The note of every family that needs notebook 04's samples, when they are absent.
SAMPLES_NOTE = missing_note("eval/samples.parquet")
#: Inputs whose presence `risk/summary.json` records (`inputs`).
OPTIONAL_INPUTS = (
    "reward/predictions_temporal.parquet",
    "eval/samples.parquet",
    "eval/frontier.parquet",
)


@dataclass
class RiskInputs:
    """What the families measure: notebooks 01-02's artifacts (04's when present), the settings
    and the RL reward model."""

    #: the `StudyConfig`
    cfg: Any
    #: labelled conditions and the splits (notebook 01)
    labelled: pd.DataFrame
    splits: dict[str, dict[str, list[int]]]
    #: the reward protocol's test predictions (notebook 02)
    pred: pd.DataFrame
    #: the temporal protocol's; None when absent or the RL reward was not trained on it
    temporal: pd.DataFrame | None
    #: notebook 04's samples and frontier; None when it has not run
    samples: pd.DataFrame | None
    frontier: pd.DataFrame | None
    #: the policy RL started from (notebook 04's record; 'base' for older runs)
    start: str
    #: anything with `score(contexts, texts, batch_size=)` returning P(MET)
    reward_model: Any

    @property
    def p_col(self) -> str:
        return prediction_column(self.cfg.reward.reward_source)

    @property
    def alpha(self) -> float:
        return self.cfg.evaluation.alpha

    @property
    def n_boot(self) -> int:
        return self.cfg.evaluation.n_boot

    @property
    def seed(self) -> int:
        return self.cfg.run.seed

    @property
    def gen(self) -> list[str]:
        """The policies of the samples that generated their responses (none without samples)."""
        return generated_policies(self.samples["policy"]) if self.samples is not None else []

    def score(self, contexts: list[dict[str, Any]], texts: list[str]) -> np.ndarray:
        """The RL reward's P(MET) of each text under its context."""
        batch = self.cfg.reward.score_batch_size
        return np.asarray(self.reward_model.score(contexts, texts, batch_size=batch))


@dataclass
class Measured:
    """What one family measured: its summary entry (None when an input is missing), its tables,
    its figures (matplotlib figures, written by the stage) and notes for the reader."""

    summary: Any = None
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)
    figures: dict[str, Any] = field(default_factory=dict)
    notes: list[dict[str, Any]] = field(default_factory=list)


def missing(note: dict[str, Any], *tables: str) -> Measured:
    """A family whose input is absent: `note`, a note table for each of `tables`, no entry."""
    return Measured(None, {name: note_table(note) for name in tables}, notes=[note])


def trained_temporal(rc: Any) -> bool:
    """Whether the RL reward (`reward.reward_source`) is trained on the temporal protocol."""
    compared = {c.name: c for c in rc.compare_encoders}
    src = rc.reward_source
    return src not in compared or "temporal" in rc.encoder_protocols(compared[src])


def load_inputs(cfg: Any, run: Any, reward_model: Any | None = None) -> RiskInputs:
    """Read the run dir once; RiskError naming the file when a needed input is absent or lacks
    the reward's column. `reward_model` defaults to the one in `reward_model/`."""
    rc = cfg.reward
    p_col = prediction_column(rc.reward_source)
    labelled, splits = load_splits(run)

    def read_pred(protocol: str) -> pd.DataFrame | None:
        rel = f"reward/predictions_{protocol}.parquet"
        if not run.exists(rel):
            return None
        pred = run.read_parquet(rel)
        if p_col not in pred.columns:
            raise RiskError(
                f"{run.path(rel)}: no column '{p_col}' (reward_source {rc.reward_source!r}); "
                f"found {list(pred.columns)}"
            )
        return pred

    temporal = read_pred("temporal") if trained_temporal(rc) else None
    pred = read_pred(rc.reward_protocol)
    if pred is None:
        raise RiskError(
            f"{run.path(f'reward/predictions_{rc.reward_protocol}.parquet')}: missing; notebook 02 "
            "writes the reward protocol's test predictions (run it first)"
        )
    samples, frontier = (
        run.read_parquet(rel) if run.exists(rel) else None
        for rel in ("eval/samples.parquet", "eval/frontier.parquet")
    )
    if samples is not None:
        require_columns(
            samples,
            ["policy", "prompt_id", *CONTEXT_FIELDS, "response", "reward", "top_area"],
            str(run.path("eval/samples.parquet")),
        )
    if reward_model is None:
        configure_threads(rc.num_threads)
        reward_model, _ = load_reward(run.require("reward_model", "notebook 02 (reward model)"))
    start = start_policy(run)
    return RiskInputs(cfg, labelled, splits, pred, temporal, samples, frontier, start, reward_model)


# -- the families, in the order of risk/summary.json -------------------------------------------


def measure_drift(inp: RiskInputs) -> Measured:
    """Backward-looking bias: the temporal protocol's reward year by year, beside every year's
    MET rate (written whether or not the reward was measured)."""
    rc, cutoff = inp.cfg.reward, inp.cfg.data.splits.temporal_cutoff_year
    base = base_rate_by_year(inp.labelled, cutoff, alpha=inp.alpha)
    if inp.temporal is None:
        note = _temporal_note(rc)
        tables = {"risk_met_rate_by_year": base, "risk_drift_by_year": note_table(note)}
        return Measured(None, tables, notes=[note])
    drift = drift_by_year(inp.temporal, inp.p_col, n_bins=rc.ece_bins)
    summary = drift_summary(drift, base, cutoff)
    summary["tests"] = drift_tests(
        inp.labelled, inp.temporal, inp.p_col, cutoff, inp.alpha, inp.n_boot, inp.seed
    )
    fig = plot_drift(drift, base, cutoff, rc.reward_source, inp.alpha)
    tables = {"risk_met_rate_by_year": base, "risk_drift_by_year": drift}
    return Measured(summary, tables, {"risk_drift": fig})


def _temporal_note(rc: Any) -> dict[str, Any]:
    if trained_temporal(rc):
        return missing_note("reward/predictions_temporal.parquet", "notebook 02 (temporal protocol)",
                            protocols=list(rc.protocols))  # fmt: skip
    protocols = rc.encoder_protocols({c.name: c for c in rc.compare_encoders}[rc.reward_source])
    return {"note": "not_temporal", "reward": rc.reward_source, "protocols": list(protocols)}


def measure_group_bias(inp: RiskInputs) -> Measured:
    """Group bias: the reward's accuracy and calibration by region, arrangement type and area
    on the reward protocol's test set, beside the overall ones."""
    rc, rk = inp.cfg.reward, inp.cfg.risk
    regions = load_regions(rk.regions_path)
    assign_regions(inp.labelled["country"], regions, rk.regions_path)  # every country, not test's
    groups = group_bias_table(
        inp.pred,
        inp.p_col,
        regions,
        rk.min_group_size,
        rc.ece_bins,
        rk.regions_path,
        inp.alpha,
        inp.n_boot,
        inp.seed,
    )
    y, p = inp.pred["y"].astype(int), inp.pred[inp.p_col].astype(float)
    summary = group_bias_summary(groups, binary_metrics(y, p, rc.ece_bins))
    return Measured(
        summary, {"risk_group_bias": groups}, {"risk_group_bias": plot_group_bias(groups)}
    )


def record_start_policy(inp: RiskInputs) -> Measured:
    """The policy the tuned ones are compared with (an entry, not a measure)."""
    return Measured(inp.start)


def measure_country_swap(inp: RiskInputs) -> Measured:
    """Country swap: how the reward of a text moves when only its country changes, for a seeded
    draw of historical test conditions and, with notebook 04's samples, generated responses."""
    rc, rk, seed = inp.cfg.reward, inp.cfg.risk, inp.seed
    train_rows = inp.labelled[
        inp.labelled["row_id"].isin(set(inp.splits[rc.reward_protocol]["train"]))
    ]
    panel = choose_swap_countries(train_rows["country"], rk.swap_countries, seed)
    rng = np.random.default_rng(seed + 5)
    hist = inp.pred.iloc[_draw(rng, len(inp.pred), rk.swap_texts)]
    swaps = [country_swap(inp.score, hist, hist["description"].tolist(), panel, "historical")]
    # generated responses to one prompt are not independent: they are resampled together
    if inp.samples is not None and rk.swap_generated > 0:
        g = inp.samples[inp.samples["policy"].isin(inp.gen)]
        if len(g):
            g = g.iloc[_draw(rng, len(g), rk.swap_generated)]
            texts, prompts = g["response"].tolist(), g["prompt_id"].tolist()
            swaps.append(country_swap(inp.score, g, texts, panel, "generated", prompts))
    swaps_df = pd.concat(swaps, ignore_index=True)
    met_rate = train_rows.groupby("country")["y"].mean().astype(float).to_dict()
    overall, per_country = swap_summary(swaps_df, met_rate, inp.alpha, inp.n_boot, seed)
    summary = _swap_entry(panel, swaps_df, overall, per_country)
    tables = {"risk_country_swap": overall, "risk_country_swap_by_country": per_country}
    return Measured(summary, tables, {"risk_country_swap": plot_swap(per_country, inp.alpha)})


def _draw(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """min(k, n) distinct positions of n, in order."""
    return np.sort(rng.choice(n, size=min(k, n), replace=False))


def _swap_entry(
    panel: list[str], swaps: pd.DataFrame, overall: pd.DataFrame, per: pd.DataFrame
) -> dict[str, Any]:
    # one point per country: the countries are the units of this test
    rho, p = corr(per["hist_met_rate"], per["mean_delta"])[:2]
    signs = [sign_of(lo, hi) for lo, hi in zip(per["ci_low"], per["ci_high"], strict=True)]
    return {
        "countries": panel,
        "by_source": overall.to_dict("records"),
        "most_favoured": str(per["country"].iloc[0]),
        "most_favoured_delta": float(per["mean_delta"].iloc[0]),
        "least_favoured": str(per["country"].iloc[-1]),
        "least_favoured_delta": float(per["mean_delta"].iloc[-1]),
        "spearman_delta_vs_hist_met_rate": rho,
        "spearman_delta_vs_hist_met_rate_p": p,
        "n_countries_up": signs.count(1),
        "n_countries_down": signs.count(-1),
        "generated_included": bool((swaps["source"] == "generated").any()),
    }


def measure_length_reward(inp: RiskInputs) -> Measured:
    """Reward hacking by length: the reward of generated responses against their length in
    words (model-free, as evaluation's text measures; `n_tokens` is capped by max_new_tokens, so
    it often saturates: its correlation and the audit reward's ride along without intervals)."""
    if inp.samples is None:
        return missing(SAMPLES_NOTE, "risk_length_reward", "risk_length_reward_bins")
    bins, length_col = inp.cfg.risk.length_bins, "n_words"
    gs = inp.samples[inp.samples["policy"].isin(inp.gen)].copy()
    for col in ("reward", "audit_reward"):  # the judges' own reading of length: scores as written
        if f"{col}_as_written" in gs:  # (the cut rule's zeros would read as a dislike of length)
            gs[col] = gs[f"{col}_as_written"]
    gs[length_col] = gs["response"].map(lambda t: len(tokenize(t)))
    lr, binned = length_reward(
        gs, length_col, "reward", bins, alpha=inp.alpha, n_boot=inp.n_boot, seed=inp.seed
    )
    for extra, length, reward in (
        ("audit_spearman", length_col, "audit_reward"),
        ("tokens_spearman", "n_tokens", "reward"),
    ):
        if length in gs and reward in gs:
            lr[extra] = length_reward(gs, length, reward, bins, n_boot=0)[0]["spearman"].to_numpy()
    summary = {"length_column": length_col, "by_policy": lr.to_dict("records")}
    tables = {"risk_length_reward": lr, "risk_length_reward_bins": binned}
    return Measured(
        summary, tables, {"risk_length_reward": plot_length_reward(gs, binned, length_col)}
    )


def measure_rising_ngrams(inp: RiskInputs) -> Measured:
    """Reward hacking by phrasing: the bigrams each tuned policy uses more than the start policy
    (the summary keeps each one's top five)."""
    if inp.samples is None:
        return missing(SAMPLES_NOTE, "risk_rising_ngrams")
    tuned = tuned_policies(inp.gen)
    if inp.start not in set(inp.samples["policy"]) or not tuned:
        note = {"note": "no_tuned", "start": inp.start, "policies": list(inp.gen)}
        return missing(note, "risk_rising_ngrams")
    ng = rising_ngrams(inp.samples, inp.start, tuned, 2, inp.cfg.risk.top_ngrams)
    summary = {p: ng.loc[ng["policy"] == p, "ngram"].head(5).tolist() for p in tuned}
    return Measured(summary, {"risk_rising_ngrams": ng})


def measure_checkpoint_gains(inp: RiskInputs) -> Measured:
    """Reward hacking over training: each checkpoint's gain in training reward against its gain in
    audit reward; the summary keeps each algorithm's last, with intervals from the samples."""
    if inp.frontier is None:
        return missing(missing_note("eval/frontier.parquet"), "risk_checkpoint_gains")
    frontier = inp.frontier
    if "source" in frontier:  # the RL start and checkpoints only (not best-of-N or references)
        frontier = frontier[frontier["source"].isin(["final", "snapshot"])]
    gains = checkpoint_gains(frontier, base=inp.start)
    if gains.empty:
        return missing({"note": "no_checkpoint"}, "risk_checkpoint_gains")
    last = gains.groupby("algo", sort=False).tail(1)
    last = last[["algo", "step", "baseline", "reward_gain", "audit_gain", "gap"]]
    if inp.samples is not None:  # the last checkpoint is the final policy notebook 04 sampled
        fg = final_gains(
            inp.samples, inp.start, list(last["algo"]), inp.alpha, inp.n_boot, inp.seed
        )
        # where the samples give an interval, the estimate is theirs too (= frontier's mean when
        # every prompt has the same number of samples)
        last = last.merge(fg, on="algo", how="left", suffixes=("_frontier", ""))
        for c in ("reward_gain", "audit_gain", "gap"):
            last[c] = last[c].fillna(last.pop(f"{c}_frontier"))
    tables, figures = {"risk_checkpoint_gains": gains}, {"risk_checkpoint_gains": plot_gains(gains)}
    return Measured(last.to_dict("records"), tables, figures)


def measure_diversity(inp: RiskInputs) -> Measured:
    """Diversity collapse: the economic areas of each policy's responses against a reference
    (history's, pooled; else the areas the prompts asked for), within-prompt diversity, and the
    change of each measure from the start policy to every tuned one."""
    names = ("risk_area_diversity", "risk_area_shares", "risk_diversity_changes")
    if inp.samples is None:
        return missing(SAMPLES_NOTE, *names)
    samples = inp.samples
    hist_rows = samples[samples["policy"].astype(str).str.startswith(HISTORY_PREFIX)]
    ref_rows, ref_name, notes = area_reference(samples, hist_rows, inp.gen)
    div, shares = area_table(samples, ref_rows["area"], ref_name)
    wp = within_prompt_diversity(samples)
    if len(hist_rows):
        wp = pd.concat([wp, within_prompt_diversity(hist_rows.assign(policy=ref_name))])
    div = div.merge(wp, on="policy", how="left")
    div.insert(1, "kind", [policy_kind(p, ref_name) for p in div["policy"]])
    tuned = tuned_policies(inp.gen)
    changes = diversity_changes(
        samples, inp.start, tuned, ref_rows, inp.alpha, inp.n_boot, inp.seed
    )
    summary = {
        "reference": ref_name,
        "by_policy": div.to_dict("records"),
        "start": inp.start,
        "changes": changes.to_dict("records"),
    }
    tables = dict(zip(names, (div, shares, changes), strict=True))
    return Measured(summary, tables, {"risk_area_shares": plot_areas(shares)}, notes)


def area_reference(
    samples: pd.DataFrame, hist_rows: pd.DataFrame, gen: list[str]
) -> tuple[pd.DataFrame, str, list[dict[str, Any]]]:
    """The areas diversity is measured against (`prompt_id`, `area` per row), their name, and a
    note when they are not history's: the areas the prompts of the first generated policy asked for."""
    if len(hist_rows):
        ref = hist_rows["top_area"]
        return (
            pd.DataFrame({"prompt_id": hist_rows["prompt_id"], "area": ref}),
            "history (pooled)",
            [],
        )
    first = gen[0] if gen else samples["policy"].iloc[0]
    ref = samples.loc[samples["policy"] == first, "econ_area"].map(str)
    rows = pd.DataFrame({"prompt_id": samples.loc[ref.index, "prompt_id"], "area": ref})
    return rows, "requested areas (prompts)", [{"note": "no_history"}]


def measure_label_variants(inp: RiskInputs) -> Measured:
    """Label-mapping sensitivity: the TF-IDF reward retrained under each `risk.label_variants`
    mapping, and how its ranking of the test texts moves from the paper mapping's."""
    rc, rk = inp.cfg.reward, inp.cfg.risk
    table, scores = label_sensitivity(
        inp.labelled,
        inp.splits[rc.reward_protocol],
        {v: rk.label_mappings[v] for v in rk.label_variants},
        rc,
        inp.seed,
        not_assessed=inp.cfg.data.labels.not_assessed,
        alpha=inp.alpha,
        n_boot=inp.n_boot,
    )
    figures = {"risk_label_variants": plot_label_variants(scores, table)}
    return Measured(table.to_dict("records"), {"risk_label_variants": table}, figures)


@dataclass(frozen=True)
class RiskFamily:
    """One registered family: its entry of `risk/summary.json` and the function measuring it."""

    #: key in `risk/summary.json`
    key: str
    measure: Callable[[RiskInputs], Measured]
    #: the tables it writes (a one-row note table each when its input is missing)
    tables: tuple[str, ...] = ()
    #: the figures it writes when measured
    figures: tuple[str, ...] = ()


#: Every family, in the order of `risk/summary.json`; adding a measure is one entry here and one
#: function above (the measures themselves live in the family modules).
RISK_FAMILIES: dict[str, RiskFamily] = {
    f.key: f
    for f in (
        RiskFamily(
            "drift", measure_drift, ("risk_met_rate_by_year", "risk_drift_by_year"), ("risk_drift",)
        ),
        RiskFamily("group_bias", measure_group_bias, ("risk_group_bias",), ("risk_group_bias",)),
        RiskFamily("start_policy", record_start_policy),
        RiskFamily(
            "country_swap",
            measure_country_swap,
            ("risk_country_swap", "risk_country_swap_by_country"),
            ("risk_country_swap",),
        ),
        RiskFamily(
            "length_reward",
            measure_length_reward,
            ("risk_length_reward", "risk_length_reward_bins"),
            ("risk_length_reward",),
        ),
        RiskFamily("rising_ngrams", measure_rising_ngrams, ("risk_rising_ngrams",)),
        RiskFamily(
            "checkpoint_gains",
            measure_checkpoint_gains,
            ("risk_checkpoint_gains",),
            ("risk_checkpoint_gains",),
        ),
        RiskFamily(
            "diversity",
            measure_diversity,
            ("risk_area_diversity", "risk_area_shares", "risk_diversity_changes"),
            ("risk_area_shares",),
        ),
        RiskFamily(
            "label_variants",
            measure_label_variants,
            ("risk_label_variants",),
            ("risk_label_variants",),
        ),
    )
}

#: Every figure the stage can write (those whose input is missing are removed, not left stale).
RISK_FIGURES = frozenset(name for f in RISK_FAMILIES.values() for name in f.figures)


@dataclass
class RiskStage:
    """What notebook 05 computes: tables, headline numbers, notes on anything missing, figure paths."""

    tables: dict[str, pd.DataFrame]
    summary: dict[str, Any]
    notes: list[dict[str, Any]] = field(default_factory=list)
    figures: dict[str, Path] = field(default_factory=dict)


def _write_fig(run: Any, name: str, fig: Any) -> Path:
    import matplotlib.pyplot as plt

    path = run.write_figure(name, fig)
    plt.close(fig)
    return path


def run_risk_stage(cfg: Any, run: Any, reward_model: Any | None = None) -> RiskStage:
    """Measure the five risks on a run dir and write `risk_*` tables, figures and `risk/summary.json`.

    `cfg` is a `StudyConfig`, `run` a `RunDir` holding notebooks 01-02's artifacts (04's are
    used when present). `reward_model` (anything with `score(contexts, texts, batch_size=)`)
    defaults to the one in `reward_model/`.
    """
    rc = cfg.reward
    inp = load_inputs(cfg, run, reward_model)
    summary: dict[str, Any] = {
        "reward_source": rc.reward_source,
        "reward_protocol": rc.reward_protocol,
        "prediction_column": inp.p_col,
        "min_group_size": cfg.risk.min_group_size,
        "alpha": inp.alpha,
        "n_boot": inp.n_boot,
    }
    tables: dict[str, pd.DataFrame] = {}
    notes: list[dict[str, Any]] = []
    figures: dict[str, Path] = {}
    for family in RISK_FAMILIES.values():
        measured = family.measure(inp)
        summary[family.key] = measured.summary
        tables |= measured.tables
        # an input several families need (notebook 04's samples) is noted once
        notes += [n for n in measured.notes if n not in notes]
        for name, fig in measured.figures.items():
            figures[name] = _write_fig(run, name, fig)
    summary["notes"] = notes
    summary["inputs"] = {rel: run.exists(rel) for rel in OPTIONAL_INPUTS}
    # a figure from an earlier run must not outlive its input
    for name in sorted(RISK_FIGURES - set(figures)):
        stale = run.root / "figures" / f"{name}.png"
        if stale.exists():
            stale.unlink()
    for name, df in tables.items():
        run.write_table(name, df)
    run.write_json("risk/summary.json", summary)
    return RiskStage(tables, summary, notes, figures)
