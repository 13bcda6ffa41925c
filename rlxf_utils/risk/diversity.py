"""Diversity collapse: the economic areas the responses fall into (entropy, KL to history,
coverage), the diversity among the samples of one prompt, and how the start -> tuned change of
each compares with its prompt-clustered interval.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import pandas as pd

from rlxf_utils.evaluation.measures import area_distribution, distinct_n, entropy, kl_divergence
from rlxf_utils.plots import WIDTH, setup_style
from rlxf_utils.risk.common import RiskError, require_columns
from rlxf_utils.stats import mean_ci, stat_ci


def per_prompt_distinct(
    samples: pd.DataFrame, n: int = 2, text_col: str = "response"
) -> pd.DataFrame:
    """Long table (policy, prompt_id, distinct): distinct-n of each prompt's samples (>= 2 of them)."""
    require_columns(samples, ["policy", "prompt_id", text_col], "samples table")
    rows = [
        {
            "policy": pol,
            "prompt_id": pid,
            "distinct": distinct_n(gp[text_col].astype(str).tolist(), n),
        }
        for (pol, pid), gp in samples.groupby(["policy", "prompt_id"], sort=True)
        if len(gp) >= 2
    ]
    out = pd.DataFrame(rows, columns=["policy", "prompt_id", "distinct"])
    return out[out["distinct"].notna()]


def within_prompt_diversity(
    samples: pd.DataFrame, n: int = 2, text_col: str = "response"
) -> pd.DataFrame:
    """Per policy: mean over prompts of distinct-n among that prompt's samples (prompts with >= 2 samples).

    Distinct-2 of the pooled samples of one prompt is 1 when no bigram repeats across (or within)
    them and falls as the samples of a prompt converge on one answer; averaging over prompts keeps
    between-prompt variety (different contexts) out of it.
    """
    require_columns(samples, ["policy", "prompt_id", text_col], "samples table")
    rows = []
    per = per_prompt_distinct(samples, n, text_col)
    for pol in dict.fromkeys(samples["policy"]):
        vals = per[per["policy"] == pol]["distinct"].tolist()
        rows.append(
            {
                "policy": pol,
                "n_prompts_multi": len(vals),
                f"within_prompt_distinct_{n}": float(np.mean(vals)) if vals else math.nan,
            }
        )
    return pd.DataFrame(rows)


def area_table(
    samples: pd.DataFrame,
    reference: pd.Series | Sequence[str],
    reference_name: str = "history",
    area_col: str = "top_area",
    requested_col: str | None = "econ_area",
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(per-policy diversity of economic areas, area shares per policy) against a reference.

    Per policy: n, areas used, entropy of its area shares (nats), KL(policy || reference) in
    nats (`evaluation.measures.kl_divergence` on add-half smoothed counts: half a response added to every
    area of both sides, so an area the reference never shows costs a finite amount that shrinks
    as the samples grow, instead of one set by an arbitrary epsilon), coverage (share of the
    reference's areas the policy produces at all) and, with `requested_col`, `on_topic` (share
    of responses whose assigned area is the one the prompt asked for). The reference itself is
    the first row. Entropy grows with the number of responses, so compare policies with equal n.
    """
    require_columns(samples, ["policy", area_col], "samples table")
    ref = pd.Series(list(reference), dtype=object).astype(str)
    if ref.empty:
        raise RiskError(f"the {reference_name} reference has no areas")
    cats = sorted(set(ref) | set(samples[area_col].astype(str)))
    q = area_distribution(ref, cats)
    q_smooth = _add_half(ref, cats)
    ref_areas = set(ref)
    rows = [
        {
            "policy": reference_name,
            "n": len(ref),
            "n_areas": len(ref_areas),
            "entropy": entropy(q),
            "kl_to_reference": 0.0,
            "coverage": 1.0,
            "on_topic": math.nan,
        }
    ]
    shares = {reference_name: q}
    for pol, g in samples.groupby("policy", sort=False):
        a = g[area_col].astype(str)
        p = area_distribution(a, cats)
        shares[str(pol)] = p
        rows.append(
            {
                "policy": str(pol),
                "n": len(a),
                "n_areas": int(a.nunique()),
                "entropy": entropy(p),
                "kl_to_reference": kl_divergence(_add_half(a, cats), q_smooth, eps=0.0),
                "coverage": len(set(a) & ref_areas) / len(ref_areas),
                "on_topic": float((a == g[requested_col].astype(str)).mean())
                if requested_col and requested_col in g
                else math.nan,
            }
        )
    return pd.DataFrame(rows), pd.DataFrame(shares).rename_axis("area").reset_index()


def _add_half(labels: Iterable[str], categories: Sequence[str]) -> pd.Series:
    """Shares over `categories` after adding half a count to each (Jeffreys smoothing)."""
    counts = pd.Series(Counter(str(x) for x in labels), dtype=float).reindex(
        list(categories), fill_value=0.0
    )
    return (counts + 0.5) / (counts.sum() + 0.5 * len(categories))


class _AreaRows:
    """Area codes of rows from three sources (`who`: 0 start, 1 policy, 2 reference)."""

    def __init__(self, codes: np.ndarray, who: np.ndarray, k: int) -> None:
        self.codes, self.who, self.k = codes, who, k

    def counts(self, idx: np.ndarray, w: int) -> np.ndarray:
        return np.bincount(self.codes[idx][self.who[idx] == w], minlength=self.k).astype(float)

    def entropy(self, idx: np.ndarray, w: int) -> float:
        c = self.counts(idx, w)
        return entropy(c) if c.sum() > 0 else math.nan

    def kl(self, idx: np.ndarray, w: int) -> float:
        """KL(source w || reference) on add-half smoothed counts, as `area_table`."""
        c, q = self.counts(idx, w), self.counts(idx, 2)
        if c.sum() == 0 or q.sum() == 0:
            return math.nan
        return kl_divergence(c + 0.5, q + 0.5, eps=0.0)


def diversity_changes(
    samples: pd.DataFrame,
    start: str,
    policies: Sequence[str],
    reference: pd.DataFrame,
    alpha: float = 0.05,
    n_boot: int = 2000,
    seed: int = 0,
    area_col: str = "top_area",
) -> pd.DataFrame:
    """Change from `start` to each policy of area entropy, KL to the reference and within-prompt
    distinct-2, each with a percentile-bootstrap interval at level 1 - alpha over prompts.

    `reference` has columns `prompt_id` and `area` (e.g. notebook 04's history rows): it is
    resampled with the same prompts. Entropy and KL are recomputed on every resample from the
    rows of the drawn prompts (add-half smoothing as in `area_table`, over the same areas), so
    the samples of one prompt move together. Distinct-2 is paired by prompt.
    """
    require_columns(samples, ["policy", "prompt_id", area_col], "samples table")
    require_columns(reference, ["prompt_id", "area"], "area reference")
    cats = sorted(set(reference["area"].astype(str)) | set(samples[area_col].astype(str)))
    index = {a: i for i, a in enumerate(cats)}
    k = len(cats)
    per = per_prompt_distinct(samples).pivot(index="prompt_id", columns="policy", values="distinct")
    cols = ["policy", "measure", "start", "value", "change", "ci_low", "ci_high"]
    if start not in set(samples["policy"]):
        return pd.DataFrame(columns=cols)
    rows = []
    for j, pol in enumerate(policies):
        if pol == start or pol not in set(samples["policy"]):
            continue
        two = samples[samples["policy"].isin([start, pol])]
        frame = pd.concat(
            [
                pd.DataFrame(
                    {"who": np.where(two["policy"] == pol, 1, 0), "area": two[area_col].astype(str),
                     "prompt_id": two["prompt_id"].to_numpy()}
                ),
                pd.DataFrame(
                    {"who": 2, "area": reference["area"].astype(str).to_numpy(),
                     "prompt_id": reference["prompt_id"].to_numpy()}
                ),
            ],
            ignore_index=True,
        )  # fmt: skip
        areas = _AreaRows(frame["area"].map(index).to_numpy(), frame["who"].to_numpy(), k)
        cl = frame["prompt_id"].to_numpy()
        full = np.arange(len(frame))
        for m, (name, f) in enumerate((("entropy", areas.entropy), ("kl_to_reference", areas.kl))):
            est, low, high = stat_ci(
                lambda i, f=f: f(i, 1) - f(i, 0), cl, alpha, n_boot, seed + 10 * j + m
            )
            rows.append([pol, name, f(full, 0), f(full, 1), est, low, high])
        if start in per and pol in per:
            d = (per[pol] - per[start]).dropna()
            est, low, high = mean_ci(d.to_numpy(), None, alpha, n_boot, seed + 10 * j + 2)
            a, b = per.loc[d.index, start].mean(), per.loc[d.index, pol].mean()
            rows.append([pol, "within_prompt_distinct_2", float(a), float(b), est, low, high])
    return pd.DataFrame(rows, columns=cols)


def plot_areas(shares: pd.DataFrame, top: int = 8) -> Any:
    """Stacked bars: share of each economic area per policy (the `top` areas overall, rest 'other')."""
    import matplotlib.pyplot as plt

    setup_style()
    s = shares.set_index("area")
    order = s.mean(axis=1).sort_values(ascending=False).index
    keep = list(order[:top])
    plot = s.loc[keep].copy()
    rest = s.drop(index=keep).sum(axis=0)
    if len(s) > top:
        plot.loc["other areas"] = rest
    fig, ax = plt.subplots(figsize=(WIDTH, 0.32 * s.shape[1] + 1.6))
    left = np.zeros(s.shape[1])
    cmap = plt.get_cmap("tab10")
    for i, (area, row) in enumerate(plot.iterrows()):
        label = area if len(area) <= 40 else area[:37] + "..."
        ax.barh(np.arange(s.shape[1]), row.to_numpy(), left=left, color=cmap(i % 10), label=label)
        left += row.to_numpy()
    ax.set_yticks(np.arange(s.shape[1]), list(s.columns))
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.set_xlabel("share of responses (area of the nearest historical conditions)")
    ax.set_title("Economic areas of the responses")
    ax.legend(fontsize=6.5, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncols=2)
    ax.grid(axis="y", visible=False)
    fig.tight_layout()
    return fig
