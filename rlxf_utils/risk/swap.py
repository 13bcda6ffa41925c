"""Country swap: how much the reward of one condition text moves when only the country changes,
which countries it favours (with intervals) and whether that follows their historical MET rates.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from rlxf_utils.plots import PALETTE, WIDTH, setup_style
from rlxf_utils.risk.common import RiskError, require_columns
from rlxf_utils.stats import level, mean_ci, stat_ci

from ..prompts import CONTEXT_FIELDS


def choose_swap_countries(countries: Iterable[str], k: int, seed: int) -> list[str]:
    """`k` distinct countries drawn (seeded) from the sorted unique `countries`, in sorted order."""
    pool = sorted({str(c) for c in countries})
    if len(pool) < 2:
        raise RiskError(f"the country-swap test needs at least 2 countries; got {pool}")
    k = min(k, len(pool))
    rng = np.random.default_rng(seed)
    return sorted(rng.choice(np.array(pool, dtype=object), size=k, replace=False).tolist())


ScoreFn = Callable[[list[dict[str, Any]], list[str]], np.ndarray]


def country_swap(
    score_fn: ScoreFn,
    contexts: pd.DataFrame,
    texts: Sequence[str],
    swap_countries: Sequence[str],
    source: str = "historical",
    clusters: Sequence[Any] | None = None,
) -> pd.DataFrame:
    """Reward of each text under its own context and with only the country replaced.

    One row per (item, swapped-in country other than its own): `p_orig`, `p_swap` and
    `delta = p_swap - p_orig`. A reward that ignores the country gives delta 0 everywhere; one
    that reads only the country gives `score(country) - score(own country)`. All pairs are
    scored in one call of `score_fn(contexts, texts)`. `cluster` (`source:label`) groups rows
    that are not independent: one label per text in `clusters` (e.g. the prompt a generated
    response answers), else the text itself.
    """
    require_columns(contexts, CONTEXT_FIELDS, "swap contexts")
    texts = [str(t) for t in texts]
    if len(contexts) != len(texts):
        raise RiskError(f"{len(contexts)} contexts but {len(texts)} texts in the country swap")
    labels = list(range(len(texts))) if clusters is None else list(clusters)
    if len(labels) != len(texts):
        raise RiskError(f"{len(labels)} cluster labels but {len(texts)} texts in the country swap")
    base = contexts[list(CONTEXT_FIELDS)].astype(str).to_dict("records")
    pair_ctx: list[dict[str, Any]] = []
    pair_txt: list[str] = []
    meta: list[tuple[int, str]] = []
    for i, (ctx, t) in enumerate(zip(base, texts, strict=True)):
        pair_ctx.append(ctx)
        pair_txt.append(t)
        meta.append((i, ""))
        for c in swap_countries:
            if c == ctx["country"]:
                continue
            pair_ctx.append({**ctx, "country": c})
            pair_txt.append(t)
            meta.append((i, c))
    scores = np.asarray(score_fn(pair_ctx, pair_txt), dtype=float) if pair_ctx else np.array([])
    if scores.shape != (len(pair_ctx),):
        raise RiskError(f"score_fn returned shape {scores.shape}; expected ({len(pair_ctx)},)")
    orig = {i: s for (i, c), s in zip(meta, scores, strict=True) if c == ""}
    rows = [
        {
            "source": source,
            "item": i,
            "country": base[i]["country"],
            "arrangement_type": base[i]["arrangement_type"],
            "econ_descriptor": base[i]["econ_descriptor"],
            "swap_country": c,
            "p_orig": orig[i],
            "p_swap": float(s),
            "delta": float(s) - orig[i],
            "cluster": f"{source}:{labels[i]}",
        }
        for (i, c), s in zip(meta, scores, strict=True)
        if c != ""
    ]
    cols = [
        "source",
        "item",
        "country",
        "arrangement_type",
        "econ_descriptor",
        "swap_country",
        "p_orig",
        "p_swap",
        "delta",
        "cluster",
    ]
    return pd.DataFrame(rows, columns=cols)


def _ratio_ci(g: pd.DataFrame, alpha: float, n_boot: int, seed: int) -> tuple[float, float, float]:
    """mean |delta| / sd of the texts' original rewards, with its cluster-bootstrap interval."""
    absd = g["delta"].abs().to_numpy(dtype=float)
    orig = g["p_orig"].to_numpy(dtype=float)
    first = ~g.duplicated("item").to_numpy()

    def ratio(idx: np.ndarray) -> float:
        o = orig[idx][first[idx]]
        sd = float(o.std(ddof=1)) if o.size > 1 else math.nan
        return float(absd[idx].mean() / sd) if sd > 0 else math.nan

    return stat_ci(ratio, g["cluster"].to_numpy(), alpha, n_boot, seed)


def swap_summary(
    swaps: pd.DataFrame,
    country_met_rate: Mapping[str, float] | None = None,
    alpha: float = 0.05,
    n_boot: int = 2000,
    seed: int = 0,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(per source: mean |delta|, max |delta|, spread of the original rewards; per swapped-in country).

    Per country: mean deviation from the original reward when that country is swapped in (> 0:
    the reward favours it) with its interval (`ci_low`, `ci_high`), mean |delta| and n; with
    `country_met_rate`, the country's historical MET rate beside it. Per source: `orig_sd` is
    the standard deviation of the original rewards across texts, the scale a country effect
    should be judged against, and `ratio` = mean |delta| / orig_sd with its interval. Intervals
    are percentile bootstraps at level 1 - alpha that resample whole clusters (`cluster`).
    """
    if "cluster" not in swaps:
        swaps = swaps.assign(cluster=swaps["source"].astype(str) + ":" + swaps["item"].astype(str))
    rows = []
    for k, (src, g) in enumerate(swaps.groupby("source", sort=False)):
        orig = g.drop_duplicates("item")["p_orig"]
        ratio, r_low, r_high = _ratio_ci(g, alpha, n_boot, seed + k)
        rows.append(
            {
                "source": src,
                "n_texts": int(g["item"].nunique()),
                "n_pairs": len(g),
                "mean_abs_delta": float(g["delta"].abs().mean()),
                "max_abs_delta": float(g["delta"].abs().max()),
                "mean_delta": float(g["delta"].mean()),
                "orig_sd": float(orig.std(ddof=1)) if len(orig) > 1 else math.nan,
                "ratio": ratio,
                "ratio_low": r_low,
                "ratio_high": r_high,
            }
        )
    overall = pd.DataFrame(rows)
    per = (
        swaps.groupby("swap_country", sort=True)["delta"]
        .agg(n="size", mean_delta="mean", mean_abs_delta=lambda d: d.abs().mean())
        .reset_index()
        .rename(columns={"swap_country": "country"})
    )
    cis = [
        mean_ci(g["delta"], g["cluster"], alpha, n_boot, seed + 100 + k)[1:]
        for k, (_, g) in enumerate(swaps.groupby("swap_country", sort=True))
    ]
    per.insert(3, "ci_low", [c[0] for c in cis])
    per.insert(4, "ci_high", [c[1] for c in cis])
    if country_met_rate is not None:
        per["hist_met_rate"] = per["country"].map(dict(country_met_rate)).astype(float)
    return overall, per.sort_values("mean_delta", ascending=False).reset_index(drop=True)


def plot_swap(per_country: pd.DataFrame, alpha: float = 0.05) -> Any:
    """Bar per swapped-in country: mean change of the reward when only the country is replaced."""
    import matplotlib.pyplot as plt

    setup_style()
    g = per_country.sort_values("mean_delta")
    fig, ax = plt.subplots(figsize=(WIDTH, 0.28 * len(g) + 1.0))
    colors = [PALETTE["MET"] if v >= 0 else PALETTE["Non-MET"] for v in g["mean_delta"]]
    has_rate = "hist_met_rate" in g
    labels = [
        f"{r.country.title()} ({r.hist_met_rate:.2f})"
        if has_rate and not pd.isna(r.hist_met_rate)
        else r.country.title()
        for r in g.itertuples()
    ]
    err = None
    if "ci_low" in g:
        err = np.vstack([g["mean_delta"] - g["ci_low"], g["ci_high"] - g["mean_delta"]])
    ax.barh(np.arange(len(g)), g["mean_delta"], color=colors, xerr=err, ecolor="grey")
    ax.set_yticks(np.arange(len(g)), labels, fontsize=7.5)
    ax.axvline(0, color="black", lw=0.8)
    ax.set_xlabel("mean change of the reward, P(MET), when this country is swapped in")
    title = "Country swap: same condition text, only the country changed"
    if "ci_low" in g:
        title += f"; whiskers: {level(alpha)} intervals"
    if has_rate:
        title += "\n(in brackets: the country's MET rate in the reward's training data)"
    ax.set_title(title)
    ax.grid(axis="y", visible=False)
    fig.tight_layout()
    return fig
