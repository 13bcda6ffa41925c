"""The risk stage (notebook 05): read the run dir, call each family's measures, write tables
`risk_*`, figures `risk_*` and `risk/summary.json`. Measures that depend on notebook 04
(`eval/samples.parquet`, `eval/frontier.parquet`) are reported as missing, with a flagged table,
when that notebook has not run. Every interval is at level 1 - `evaluation.alpha` with
`evaluation.n_boot` resamples; the level is stored in the summary as `alpha`.
"""

from __future__ import annotations

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

#: Every figure the stage can write (those whose input is missing are removed, not left stale).
RISK_FIGURES = frozenset(
    {
        "risk_drift",
        "risk_group_bias",
        "risk_country_swap",
        "risk_length_reward",
        "risk_checkpoint_gains",
        "risk_area_shares",
        "risk_label_variants",
    }
)


@dataclass
class RiskStage:
    """What notebook 05 computes: tables, headline numbers, notes on anything missing, figure paths."""

    tables: dict[str, pd.DataFrame]
    summary: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    figures: dict[str, Path] = field(default_factory=dict)


def _write_fig(run: Any, name: str, fig: Any, figures: dict[str, Path]) -> None:
    import matplotlib.pyplot as plt

    figures[name] = run.write_figure(name, fig)
    plt.close(fig)


def _json_records(df: pd.DataFrame) -> list[dict[str, Any]]:
    return df.to_dict("records")


def run_risk_stage(cfg: Any, run: Any, reward_model: Any | None = None) -> RiskStage:
    """Measure the five risks on a run dir and write `risk_*` tables, figures and `risk/summary.json`.

    `cfg` is a `StudyConfig`, `run` a `RunDir` holding notebooks 01-02's artifacts (04's are
    used when present). `reward_model` (anything with `score(contexts, texts, batch_size=)`)
    defaults to the one in `reward_model/`.
    """

    rc, rk = cfg.reward, cfg.risk
    seed = cfg.run.seed
    alpha, n_boot = cfg.evaluation.alpha, cfg.evaluation.n_boot
    cutoff = cfg.data.splits.temporal_cutoff_year
    p_col = prediction_column(rc.reward_source)
    tables: dict[str, pd.DataFrame] = {}
    notes: list[str] = []
    figures: dict[str, Path] = {}
    summary: dict[str, Any] = {
        "reward_source": rc.reward_source,
        "reward_protocol": rc.reward_protocol,
        "prediction_column": p_col,
        "min_group_size": rk.min_group_size,
        "alpha": alpha,
        "n_boot": n_boot,
    }
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

    # 1. drift ----------------------------------------------------------------------------
    base = base_rate_by_year(labelled, cutoff, alpha=alpha)
    tables["risk_met_rate_by_year"] = base
    compared = {c.name: c for c in rc.compare_encoders}
    trained_temporal = rc.reward_source not in compared or "temporal" in rc.encoder_protocols(
        compared[rc.reward_source]
    )
    temporal = read_pred("temporal") if trained_temporal else None
    if temporal is None:
        note = (
            missing_note("reward/predictions_temporal.parquet", "notebook 02 (temporal protocol)")
            + f" (reward.protocols = {list(rc.protocols)})"
            if trained_temporal
            else f"The RL reward {rc.reward_source!r} was not trained on the temporal protocol "
            f"(reward.compare_encoders[{rc.reward_source!r}].protocols = "
            f"{rc.encoder_protocols(compared[rc.reward_source])}), so its drift is not measured"
        )
        notes.append(note)
        tables["risk_drift_by_year"] = note_table(note)
        summary["drift"] = None
    else:
        drift = drift_by_year(temporal, p_col, n_bins=rc.ece_bins)
        tables["risk_drift_by_year"] = drift
        summary["drift"] = drift_summary(drift, base, cutoff)
        summary["drift"]["tests"] = drift_tests(
            labelled, temporal, p_col, cutoff, alpha, n_boot, seed
        )
        fig = plot_drift(drift, base, cutoff, rc.reward_source, alpha)
        _write_fig(run, "risk_drift", fig, figures)

    # 2. group bias -----------------------------------------------------------------------
    pred = read_pred(rc.reward_protocol)
    if pred is None:
        raise RiskError(
            f"{run.path(f'reward/predictions_{rc.reward_protocol}.parquet')}: missing; notebook 02 "
            "writes the reward protocol's test predictions (run it first)"
        )
    regions = load_regions(rk.regions_path)
    assign_regions(labelled["country"], regions, rk.regions_path)  # every country, not just test
    groups = group_bias_table(
        pred, p_col, regions, rk.min_group_size, rc.ece_bins, rk.regions_path, alpha, n_boot, seed
    )
    tables["risk_group_bias"] = groups
    overall = binary_metrics(pred["y"].astype(int), pred[p_col].astype(float), rc.ece_bins)
    summary["group_bias"] = group_bias_summary(groups, overall)
    _write_fig(run, "risk_group_bias", plot_group_bias(groups), figures)

    # 3/4 inputs from notebook 04 ---------------------------------------------------------
    samples = (
        run.read_parquet("eval/samples.parquet") if run.exists("eval/samples.parquet") else None
    )
    samples_note = missing_note("eval/samples.parquet")
    if samples is None:
        notes.append(samples_note)
    else:
        require_columns(
            samples,
            ["policy", "prompt_id", *CONTEXT_FIELDS, "response", "reward", "top_area"],
            str(run.path("eval/samples.parquet")),
        )
    gen = generated_policies(samples["policy"]) if samples is not None else []
    start = start_policy(run)
    summary["start_policy"] = start

    # 2b. country swap --------------------------------------------------------------------
    if reward_model is None:
        configure_threads(rc.num_threads)
        reward_model, _ = load_reward(run.require("reward_model", "notebook 02 (reward model)"))

    def score_fn(contexts: list[dict[str, Any]], texts: list[str]) -> np.ndarray:
        return np.asarray(reward_model.score(contexts, texts, batch_size=rc.score_batch_size))

    train_ids = set(splits[rc.reward_protocol]["train"])
    train_rows = labelled[labelled["row_id"].isin(train_ids)]
    panel = choose_swap_countries(train_rows["country"], rk.swap_countries, seed)
    rng = np.random.default_rng(seed + 5)
    hist = pred.iloc[
        np.sort(rng.choice(len(pred), size=min(rk.swap_texts, len(pred)), replace=False))
    ]
    swaps = [country_swap(score_fn, hist, hist["description"].tolist(), panel, "historical")]
    # generated responses to one prompt are not independent: they are resampled together
    if samples is not None and rk.swap_generated > 0:
        g = samples[samples["policy"].isin(gen)]
        if len(g):
            g = g.iloc[
                np.sort(rng.choice(len(g), size=min(rk.swap_generated, len(g)), replace=False))
            ]
            swaps.append(
                country_swap(
                    score_fn, g, g["response"].tolist(), panel, "generated", g["prompt_id"].tolist()
                )
            )
    swaps_df = pd.concat(swaps, ignore_index=True)
    met_rate = train_rows.groupby("country")["y"].mean().astype(float)
    swap_overall, swap_per_country = swap_summary(swaps_df, met_rate.to_dict(), alpha, n_boot, seed)
    tables["risk_country_swap"] = swap_overall
    tables["risk_country_swap_by_country"] = swap_per_country
    # one point per country: the countries are the units of this test
    rho_fav, p_fav, _, _ = corr(swap_per_country["hist_met_rate"], swap_per_country["mean_delta"])
    signs = [
        sign_of(lo, hi)
        for lo, hi in zip(swap_per_country["ci_low"], swap_per_country["ci_high"], strict=True)
    ]
    summary["country_swap"] = {
        "countries": panel,
        "by_source": _json_records(swap_overall),
        "most_favoured": str(swap_per_country["country"].iloc[0]),
        "most_favoured_delta": float(swap_per_country["mean_delta"].iloc[0]),
        "least_favoured": str(swap_per_country["country"].iloc[-1]),
        "least_favoured_delta": float(swap_per_country["mean_delta"].iloc[-1]),
        "spearman_delta_vs_hist_met_rate": rho_fav,
        "spearman_delta_vs_hist_met_rate_p": p_fav,
        "n_countries_up": signs.count(1),
        "n_countries_down": signs.count(-1),
        "generated_included": bool((swaps_df["source"] == "generated").any()),
    }
    _write_fig(run, "risk_country_swap", plot_swap(swap_per_country, alpha), figures)

    # 3. reward hacking -------------------------------------------------------------------
    if samples is None:
        for name in ("risk_length_reward", "risk_length_reward_bins", "risk_rising_ngrams"):
            tables[name] = note_table(samples_note)
        summary["length_reward"] = None
        summary["rising_ngrams"] = None
    else:
        gs = samples[samples["policy"].isin(gen)].copy()
        # length in words of the scored response (model-free, as evaluation's text measures);
        # n_tokens counts generated tokens, capped by max_new_tokens, so it often saturates
        length_col = "n_words"
        gs["n_words"] = gs["response"].map(lambda t: len(tokenize(t)))
        lr, binned = length_reward(
            gs, length_col, "reward", rk.length_bins, alpha=alpha, n_boot=n_boot, seed=seed
        )
        if "audit_reward" in gs:
            lr_a, _ = length_reward(gs, length_col, "audit_reward", rk.length_bins, n_boot=0)
            lr["audit_spearman"] = lr_a["spearman"].to_numpy()
        if "n_tokens" in gs:
            lr_t, _ = length_reward(gs, "n_tokens", "reward", rk.length_bins, n_boot=0)
            lr["tokens_spearman"] = lr_t["spearman"].to_numpy()
        tables["risk_length_reward"] = lr
        tables["risk_length_reward_bins"] = binned
        summary["length_reward"] = {"length_column": length_col, "by_policy": _json_records(lr)}
        _write_fig(run, "risk_length_reward", plot_length_reward(gs, binned, length_col), figures)
        tuned = tuned_policies(gen)
        if start in set(samples["policy"]) and tuned:
            ng = rising_ngrams(samples, start, tuned, 2, rk.top_ngrams)
            tables["risk_rising_ngrams"] = ng
            summary["rising_ngrams"] = {
                p: ng.loc[ng["policy"] == p, "ngram"].head(5).tolist() for p in tuned
            }
        else:
            note = f"no {start} and tuned policies in eval/samples.parquet (policies: {gen})"
            notes.append(note)
            tables["risk_rising_ngrams"] = note_table(note)
            summary["rising_ngrams"] = None

    if run.exists("eval/frontier.parquet"):
        frontier = run.read_parquet("eval/frontier.parquet")
        if "source" in frontier:  # the RL start and checkpoints only (not best-of-N or references)
            frontier = frontier[frontier["source"].isin(["final", "snapshot"])]
        gains = checkpoint_gains(frontier, base=start)
        if gains.empty:
            note = "eval/frontier.parquet holds no tuned checkpoint (only the base policy)"
            notes.append(note)
            tables["risk_checkpoint_gains"] = note_table(note)
            summary["checkpoint_gains"] = None
        else:
            tables["risk_checkpoint_gains"] = gains
            last = gains.groupby("algo", sort=False).tail(1)
            last = last[["algo", "step", "baseline", "reward_gain", "audit_gain", "gap"]]
            if samples is not None:  # the last checkpoint is the final policy notebook 04 sampled
                fg = final_gains(samples, start, list(last["algo"]), alpha, n_boot, seed)
                # where the samples give an interval, the estimate is theirs too (= frontier's
                # mean when every prompt has the same number of samples)
                last = last.merge(fg, on="algo", how="left", suffixes=("_frontier", ""))
                for c in ("reward_gain", "audit_gain", "gap"):
                    last[c] = last[c].fillna(last.pop(f"{c}_frontier"))
            summary["checkpoint_gains"] = _json_records(last)
            _write_fig(run, "risk_checkpoint_gains", plot_gains(gains), figures)
    else:
        note = missing_note("eval/frontier.parquet")
        notes.append(note)
        tables["risk_checkpoint_gains"] = note_table(note)
        summary["checkpoint_gains"] = None

    # 4. diversity collapse ---------------------------------------------------------------
    if samples is None:
        tables["risk_area_diversity"] = note_table(samples_note)
        tables["risk_area_shares"] = note_table(samples_note)
        tables["risk_diversity_changes"] = note_table(samples_note)
        summary["diversity"] = None
    else:
        hist_rows = samples[samples["policy"].astype(str).str.startswith(HISTORY_PREFIX)]
        if len(hist_rows):
            ref, ref_name = hist_rows["top_area"], "history (pooled)"
            ref_rows = pd.DataFrame({"prompt_id": hist_rows["prompt_id"], "area": ref})
        else:
            first = gen[0] if gen else samples["policy"].iloc[0]
            ref = samples.loc[samples["policy"] == first, "econ_area"].map(str)
            ref_name = "requested areas (prompts)"
            ref_rows = pd.DataFrame({"prompt_id": samples.loc[ref.index, "prompt_id"], "area": ref})
            notes.append(
                "no history policies in eval/samples.parquet: areas compared with the prompts' areas"
            )
        div, shares = area_table(samples, ref, ref_name)
        wp = within_prompt_diversity(samples)
        if len(hist_rows):
            wp = pd.concat([wp, within_prompt_diversity(hist_rows.assign(policy=ref_name))])
        div = div.merge(wp, on="policy", how="left")
        div.insert(1, "kind", [policy_kind(p, ref_name) for p in div["policy"]])
        changes = diversity_changes(
            samples, start, tuned_policies(gen), ref_rows, alpha, n_boot, seed
        )
        tables["risk_area_diversity"] = div
        tables["risk_area_shares"] = shares
        tables["risk_diversity_changes"] = changes
        summary["diversity"] = {
            "reference": ref_name,
            "by_policy": _json_records(div),
            "start": start,
            "changes": _json_records(changes),
        }
        _write_fig(run, "risk_area_shares", plot_areas(shares), figures)

    # 5. label mapping --------------------------------------------------------------------
    lab_table, lab_scores = label_sensitivity(
        labelled,
        splits[rc.reward_protocol],
        {v: rk.label_mappings[v] for v in rk.label_variants},
        rc,
        seed,
        not_assessed=cfg.data.labels.not_assessed,
        alpha=alpha,
        n_boot=n_boot,
    )
    tables["risk_label_variants"] = lab_table
    summary["label_variants"] = _json_records(lab_table)
    _write_fig(run, "risk_label_variants", plot_label_variants(lab_scores, lab_table), figures)

    summary["notes"] = notes
    summary["inputs"] = {
        rel: run.exists(rel)
        for rel in (
            "reward/predictions_temporal.parquet",
            "eval/samples.parquet",
            "eval/frontier.parquet",
        )
    }
    # a figure from an earlier run must not outlive its input
    for name in sorted(RISK_FIGURES - set(figures)):
        stale = run.root / "figures" / f"{name}.png"
        if stale.exists():
            stale.unlink()
    for name, df in tables.items():
        run.write_table(name, df)
    run.write_json("risk/summary.json", summary)
    return RiskStage(tables, summary, notes, figures)
