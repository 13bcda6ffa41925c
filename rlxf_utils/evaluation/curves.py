"""Every method against every other at the same KL: reward-KL curves from training snapshots and
comparisons at a grid of KL budgets stated in the params before any run (`evaluation.kl_budgets`).

A method's curve is its points (KL to the start policy, per-prompt mean reward): the start policy
itself at KL 0 (its own samples; best-of-N: its pool's n = 1), every frontier snapshot and the
final policy; best-of-N's points are its n of `evaluation.best_of_n_curve`, at the KL bound
log n - (n - 1) / n, which is at least its true KL (Beirami et al., 2024), so best-of-N's value at
a budget is that of a KL at most the budget: the comparison favours the other method.

Points whose KLs only noise separates are pooled first (`kl_groups`: each point of a curve is
distinguished in KL from the one before at 1.96 standard errors; a point within noise of the start
policy is left out). At a budget b, a method whose
largest point KL reaches b is read off its curve: each prompt's reward linear in KL between the
two points that bracket b (points sorted by KL). The KLs are
estimates; their error is carried by the delta method (as in `best_of_n.versus_best_of_n`): with
w = (b - K_j) / (K_j+1 - K_j) and s the curve's slope between the two points, the prompt's value
is

    (1 - w) r_j,p + w r_j+1,p + s [(w - 1)(k_j,p - K_j) - w (k_j+1,p - K_j+1)]

with k_j,p the prompt's mean KL at point j and K_j their mean over prompts (the added term has
mean zero: the estimate is the plain interpolation, its variance the KLs' too). A method that
never reaches b is listed as not reaching it, never extrapolated. Nor is a gap bridged: b is read
only where one of the two points around it lies within a factor `evaluation.kl_budget_span` of b
(the origin, at 0, never does; a method whose curve jumps from the start policy to 29 nats, as one
without snapshots would, is listed as passing b with no point near it): linear in KL
across a wider gap is an assumption about the curve, not a reading of it, and its interval
would carry only the endpoints' noise.

At each budget and under each judge, one family (`stats.family_alpha`): every pair of the
methods that reach it, the per-prompt difference of their values with the cluster t interval over
countries (`stats.paired_comparison`, `stats.cluster_t`) at 1 - alpha / m, m the pairs compared; and, in a family of its own,
each reaching method's gain over the start policy at that budget. No pair is left out for where
training happened to end, only for a method not reaching a budget (counted in `budget_reach`).

Beside the gains, the finished share (`FINISHED`: the share of answers that end before the token
cap) is read off the same curves at each budget, each method against the start policy in a family
of its own (no pairs): a cut answer scores 0 under `evaluation.cut_responses: failed`, so a gain
at a budget is read beside how many of the method's answers finish there.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from rlxf_utils.evaluation.best_of_n import best_of_n_kl_bound
from rlxf_utils.evaluation.overopt import REWARDS, best_of_n_expectations
from rlxf_utils.stats import bound_verdict, paired_comparison

#: The finished share: read off each curve beside the gains (against the start policy, no pairs).
FINISHED = "finished"
#: The columns of `budget_pairs`.
PAIR_COLUMNS = ["budget", "measure", "policy", "versus", "n", "n_clusters", "diff", "low", "high",
                "verdict", "p_family", "ci_level", "bound", "mde", "family_size"]  # fmt: skip
#: The columns of `budget_gains`.
GAIN_COLUMNS = ["budget", "measure", "method", "reaches", "near", "kl_below", "kl_above", "max_kl",
                "points", "gain", "low", "high", "verdict", "p_family", "ci_level", "bound", "mde",
                "family_size", "kl_is_bound"]  # fmt: skip


@dataclass
class Curve:
    """One method's points, sorted by KL, the origin (KL 0) first: `kl` (K_j, the mean over
    prompts of `kl_pp`), per-prompt mean KL `kl_pp` and per measure the per-prompt mean value
    `values[measure]` (prompts x points, the prompts every point answered), `origin` the per-prompt
    values of the start policy the gains are over, `kl_is_bound`: best-of-N's KLs are bounds."""

    method: str
    kl: np.ndarray
    kl_pp: pd.DataFrame
    values: dict[str, pd.DataFrame]
    kl_is_bound: bool = False

    @property
    def max_kl(self) -> float:
        return float(np.nanmax(self.kl)) if self.kl.size else math.nan

    def reaches(self, budget: float) -> bool:
        return bool(self.kl.size > 1 and self.max_kl >= budget)

    def bracket(self, budget: float) -> tuple[float, float]:
        """The KLs of the curve's points around `budget`: the last below it (0 for the origin)
        and the first at or beyond it (NaN where none is)."""
        above = self.kl[self.kl >= budget] if self.kl.size > 1 else self.kl[:0]
        below = self.kl[self.kl < budget]
        return (float(below.max()) if below.size else math.nan,
                float(above.min()) if above.size else math.nan)  # fmt: skip

    def near(self, budget: float, span: float | None) -> bool:
        """The curve reaches `budget` and one of the two points around it lies within a factor
        `span` of it (at most `span` times it above, at least 1 / `span` of it below; the origin,
        at 0, is never near); any reached budget with `span` None."""
        if not self.reaches(budget):
            return False
        if span is None:
            return True
        lo, hi = self.bracket(budget)
        return hi <= span * budget or (lo > 0 and lo * span >= budget)


def make_curve(method: str, points: Sequence[pd.DataFrame], measures: Sequence[str],
               kl_is_bound: bool = False) -> Curve:  # fmt: skip
    """A `Curve` from its points' samples, the origin first: each a frame with `prompt_id`, the
    measures and `kl` (a sample's log p_policy - log p_ref; 0 for the origin); a point's values
    per prompt are its samples' means. Prompts missing from any point are left out."""
    kl_cols, vals = [], {m: [] for m in measures}
    for frame in points:
        kl_cols.append(frame.groupby("prompt_id")["kl"].mean())
        for m in measures:  # as floats: the finished share's column holds booleans
            vals[m].append(frame[m].astype(float).groupby(frame["prompt_id"]).mean())
    kl_pp = pd.concat(kl_cols, axis=1, join="inner")
    kl_pp.columns = range(kl_pp.shape[1])
    keep = kl_pp.index
    for m in measures:
        frame = pd.concat(vals[m], axis=1, join="inner")
        frame.columns = range(frame.shape[1])
        keep = keep.intersection(frame.index)
        vals[m] = frame
    kl_pp = kl_pp.loc[keep].sort_index()
    kl = kl_pp.mean(axis=0).to_numpy(float) if len(keep) else np.full(kl_pp.shape[1], math.nan)
    order = np.argsort(kl, kind="stable")
    order = np.concatenate([[0], [j for j in order if j != 0]])  # the origin stays first
    vals = {m: v.loc[keep].sort_index() for m, v in vals.items()}
    groups = kl_groups(kl_pp, [int(j) for j in order])
    kl_pp = pd.concat([kl_pp[g].mean(axis=1) for g in groups], axis=1, ignore_index=True)
    out = {m: pd.concat([v[g].mean(axis=1) for g in groups], axis=1, ignore_index=True)
           for m, v in vals.items()}  # fmt: skip
    kl = kl_pp.mean(axis=0).to_numpy(float) if len(kl_pp) else np.full(len(groups), math.nan)
    return Curve(method, kl, kl_pp, out, kl_is_bound)


#: How many standard errors apart two points' KLs must be to stand as two points of a curve.
KL_APART = 1.96


def kl_groups(kl_pp: pd.DataFrame, order: Sequence[int]) -> list[list[int]]:
    """The points of a curve (columns of `kl_pp`, in KL order, the origin first) pooled so that
    each is distinguished in KL from the one before: a point whose KL lies within `KL_APART`
    standard errors of the previous kept point's (the SE of their per-prompt differences) joins
    that point (their per-prompt values averaged); one within noise of the start policy itself is
    left out (the origin, the start policy's own samples, stands for it). Interpolating between
    two points whose KLs only noise separates would divide by that noise; pooled, each step of
    the curve is one the KLs resolve."""
    kept: list[list[int]] = [[order[0]]]
    n = len(kl_pp)
    for j in order[1:]:
        d = kl_pp[j] - kl_pp[kept[-1]].mean(axis=1)
        se = float(d.std(ddof=1)) / math.sqrt(n) if n > 1 else math.nan
        if float(d.mean()) > KL_APART * se or (se == 0 and float(d.mean()) > 0):
            kept.append([j])
        elif len(kept) > 1:
            kept[-1].append(j)
    return kept


def value_at(
    curve: Curve, budget: float, measure: str, span: float | None = None
) -> pd.Series | None:
    """Each prompt's value of `measure` at KL `budget` along `curve`, the KLs' error carried by
    the delta method (module docstring); None where the curve does not reach `budget`, or (with
    `span`) reaches it with no point within `span` times it."""
    if not curve.near(budget, span):
        return None
    kl, v, kpp = curve.kl, curve.values[measure], curve.kl_pp
    # the first point at or beyond the budget, and the one before it (points sorted by KL)
    hi = int(np.argmax(kl >= budget))
    if hi == 0 or kl[hi] == budget:
        return v[hi].copy()
    lo = hi - 1
    dk = kl[hi] - kl[lo]
    w = (budget - kl[lo]) / dk
    slope = (v[hi].mean() - v[lo].mean()) / dk
    est = (1 - w) * v[lo] + w * v[hi]
    err = (w - 1) * (kpp[lo] - kl[lo]) - w * (kpp[hi] - kl[hi])
    return est + slope * err


def method_curves(samples: pd.DataFrame, snapshots: pd.DataFrame, pool: pd.DataFrame | None,
                  algos: Sequence[str], start: str, ns: Sequence[int],
                  measures: Sequence[str] = tuple(REWARDS)) -> dict[str, Curve]:  # fmt: skip
    """Every trained method's curve (the start policy's samples at KL 0, its snapshots from
    `snapshots`: `algo`, `step`, `prompt_id`, measures, `logp_policy`, `logp_ref`; its final
    samples from `samples`) and best-of-N's from `pool` (its n of `ns`, n = 1 the origin). A
    method without log-probabilities for a point (no KL) leaves that point out."""
    own = samples[samples["policy"] == start].assign(kl=0.0)
    curves: dict[str, Curve] = {}
    for algo in algos:
        points = [own]
        snaps = snapshots[snapshots["algo"] == algo] if len(snapshots) else snapshots
        for _, g in snaps.groupby("step", sort=True) if len(snaps) else []:
            points.append(g.assign(kl=g["logp_policy"] - g["logp_ref"]))
        fin = samples[samples["policy"] == algo]
        points.append(fin.assign(kl=fin["logp_policy"] - fin["logp_ref"]))
        points = [p for p in points if len(p) and p["kl"].notna().all()]
        if len(points) > 1:
            curves[algo] = make_curve(algo, points, measures)
    if pool is not None and len(pool) and len(ns) > 1:
        exp = best_of_n_expectations(pool, sorted({1, *ns}), measures)
        points = []
        for n in sorted({1, *ns}):
            frame = pd.DataFrame({m: exp[m][n] for m in measures})
            points.append(frame.rename_axis("prompt_id").reset_index()
                          .assign(kl=best_of_n_kl_bound(n)))  # fmt: skip
        curves["best_of_n"] = make_curve("best_of_n", points, measures, kl_is_bound=True)
    return curves


def _compared(a: pd.Series, b: pd.Series, clusters: pd.Series, alpha: float, m: int,
              power: float) -> dict[str, Any]:  # fmt: skip
    """a minus b on the prompts both hold (`stats.paired_comparison`: the cluster t interval over
    `clusters` in a family of `m`) as the tables carry it: `diff` and its interval, verdict,
    family p-value and level, bound and MDE."""
    pair = pd.concat([a, b], axis=1, join="inner")
    res = paired_comparison(pair.iloc[:, 0].to_numpy(float), pair.iloc[:, 1].to_numpy(float),
                            alpha=alpha, clusters=clusters.loc[pair.index].to_numpy(),
                            family_size=m, power=power)  # fmt: skip
    return {"n": res["n"], "n_clusters": res["n_clusters"], "diff": res["mean_diff"],
            "low": res["ci_low"], "high": res["ci_high"],
            "verdict": bound_verdict(res["ci_low"], res["ci_high"]), "p_family": res["p_family"],
            "ci_level": res["ci_level"], "bound": res["bound"], "mde": res["mde"],
            "family_size": m}  # fmt: skip


def budget_comparisons(curves: Mapping[str, Curve], budgets: Sequence[float],
                       clusters: pd.Series, alpha: float, power: float = 0.8,
                       measures: Sequence[str] = tuple(REWARDS),
                       span: float | None = None,
                       beside: Sequence[str] = ()) -> tuple[pd.DataFrame, pd.DataFrame]:  # fmt: skip
    """(`budget_pairs`, `budget_gains`): at each budget and measure, every pair of the methods
    read there (a family of their count) and each one's gain over the start policy there (a
    family of the methods read; a row without a gain for the others: `reaches` False, or
    `near` False where the curve passes the budget with no point within a factor `span` of it).
    `beside` (the finished share): measures read as gains over the start policy only, no pairs.
    `kl_below`, `kl_above`: the KLs of the curve's points around the budget (`Curve.bracket`).
    `clusters`: each prompt_id's country."""
    pairs, gains = [], []
    for b, measure in itertools.product(budgets, [*measures, *beside]):
        at = {name: value_at(c, b, measure, span) for name, c in curves.items()}
        reach = [name for name, v in at.items() if v is not None]
        m_gain = max(len(reach), 1)
        for name, c in curves.items():
            row = {"budget": float(b), "measure": measure, "method": name,
                   "reaches": c.reaches(b), "near": at[name] is not None,
                   **dict(zip(("kl_below", "kl_above"), c.bracket(b), strict=True)),
                   "max_kl": c.max_kl, "points": int(c.kl.size), "kl_is_bound": c.kl_is_bound}  # fmt: skip
            if at[name] is None:
                gains.append(row)
                continue
            res = _compared(at[name], c.values[measure][0], clusters, alpha, m_gain, power)
            gains.append({**row, **res, "gain": res.pop("diff")})
        combos = [] if measure in beside else list(itertools.combinations(reach, 2))
        for a, v in combos:
            res = _compared(at[a], at[v], clusters, alpha, len(combos), power)
            pairs.append({"budget": float(b), "measure": measure, "policy": a, "versus": v, **res})
    return (pd.DataFrame(pairs, columns=PAIR_COLUMNS),
            pd.DataFrame(gains).reindex(columns=GAIN_COLUMNS))  # fmt: skip


def budget_reach(gains: pd.DataFrame, pairs: pd.DataFrame) -> pd.DataFrame:
    """Per budget (under the first measure: reaching is the KL's, not the judge's): how many
    methods are read there (`reaching`), those whose curves do not reach it, those that pass it
    with no point near it (`no_point_near`; `budget_comparisons`' `span`), the pairs compared and
    how many an interval distinguishes under each judge."""
    rows = []
    if gains.empty:
        return pd.DataFrame(rows)
    first = gains["measure"].iloc[0]
    for b, g in gains[gains["measure"] == first].groupby("budget", sort=True):
        reaches = g["reaches"].astype(bool)
        read = g["near"].astype(bool) if "near" in g else reaches
        rec = {
            "budget": float(b),
            "reaching": int(read.sum()),
            "not_reaching": ", ".join(g.loc[~reaches, "method"]) or "none",
            "no_point_near": ", ".join(g.loc[reaches & ~read, "method"]) or "none",
        }
        for measure in [m for m in dict.fromkeys(gains["measure"]) if m != FINISHED]:
            p = pairs[(pairs["budget"] == b) & (pairs["measure"] == measure)]
            rec[f"pairs_{measure}"] = len(p)
            rec[f"told_apart_{measure}"] = int((p["low"] > 0).sum() + (p["high"] < 0).sum())
        rows.append(rec)
    return pd.DataFrame(rows)


def plot_budget_gains(gains: pd.DataFrame, start: str, labels: Mapping[str, str]) -> Any:
    """Each method's gain over `start` at every budget it reaches (rows: the judges, then the
    finished share where it was read, each row its own scale; columns: the budgets), bars its
    family's simultaneous cluster t interval over countries."""
    import matplotlib.pyplot as plt

    budgets = sorted(gains["budget"].unique())
    measures = list(dict.fromkeys(gains["measure"]))
    methods = list(dict.fromkeys(gains["method"]))
    fig, axes = plt.subplots(len(measures), len(budgets), sharex="row", sharey="row",
                             figsize=(2.6 * len(budgets) + 1.5, 0.28 * len(methods) * len(measures) + 1.2),
                             squeeze=False)  # fmt: skip
    y = np.arange(len(methods))
    for i, measure in enumerate(measures):
        for k, b in enumerate(budgets):
            ax = axes[i][k]
            g = gains[(gains["measure"] == measure) & (gains["budget"] == b)].set_index("method")
            g = g.reindex(methods)
            ok = g["near"].fillna(False).astype(bool).to_numpy()
            passed = g["reaches"].fillna(False).astype(bool).to_numpy()
            est = g["gain"].to_numpy(float)
            err = np.vstack([est - g["low"].to_numpy(float), g["high"].to_numpy(float) - est])
            ax.axvline(0, color="black", lw=0.8)
            ax.errorbar(est[ok], y[ok], xerr=np.abs(err[:, ok]), fmt="o", ms=3, capsize=2)
            for j in np.flatnonzero(~ok):
                ax.text(0, y[j], "no point near" if passed[j] else "not reached", fontsize=6,
                        color="gray", ha="center", va="center")  # fmt: skip
            ax.set_yticks(y, [labels.get(m, m) for m in methods], fontsize=7)
            ax.grid(axis="x", alpha=0.3)
            if i == 0:
                ax.set_title(f"KL = {b:g} nats", fontsize=9)
            if k == 0:
                ax.set_ylabel(REWARDS.get(measure, "finished share"), fontsize=8)
            if i == len(measures) - 1 or measures[i + 1] == FINISHED:
                ax.set_xlabel(f"gain over {start}" if measure != FINISHED
                              else f"finished share minus {start}'s", fontsize=8)  # fmt: skip
        axes[i][0].invert_yaxis()  # the row shares its y axis: the first method on top
    fig.suptitle("Every method at the same KL, read off its reward-KL curve (bars: each budget's "
                 "simultaneous cluster t interval over countries)", fontsize=9)  # fmt: skip
    fig.tight_layout()
    return fig
