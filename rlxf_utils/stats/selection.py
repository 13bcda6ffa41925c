"""Bounds for a comparison on a subset the compared policies themselves select: Lee's (2009)
trimming bounds, trimmed within countries and corrected for the few responses they rest on.

Which responses finish before the token cap is an outcome of the policy: a policy that finishes
fewer responses than the start policy keeps, among its finished ones, a different kind of answer
(the short ones), so the gain among finished responses compares two differently selected sets
and identifies no effect. Lee's bounds ask what the gain can be among the answers that would
have finished under either policy (the always-finishing ones). On a prompt where the policies
finish shares q_a and q_b of their responses, those are a share m = min(q_a, q_b) of the prompt's
responses (every response of the lower side and part of the higher side's, assuming each prompt
moves its responses' finishing one way only); trimming the higher side's finished responses to
that share from the top gives the lowest mean the always-finishing set can have, from the bottom
the highest. Lee, D. S. (2009), "Training, wages, and sample selection: estimating sharp bounds
on treatment effects", Review of Economic Studies 76(3), 1071-1102.

Why not within prompts: with the default's 4 responses per prompt, a trimmed mean of 2 of 4
responses sits on the sample's extremes, which lie inside the population's, so the bounds came
out a quarter too narrow (simulated, 48 prompts in 17 countries, finished shares 1.0 against
0.5, no effect: +-0.187 against the true +-0.25) and their interval covered the true bounds half
the time at a nominal 95%; prompts where a policy finished nothing had no bound and were
dropped, a further selection. So the trimming works on cells of several prompts, and what bias
is left is estimated and removed:

- Cells: the prompts of one country (`cluster_col`; without it every prompt is a cell of its
  own and its own cluster, the trimming within prompts with the jackknife on 4 responses: in the
  same simulations that interval covered 83-91% of the time, so the study passes countries). A
  cell pools each policy's finished responses over its prompts, each response weighing
  1 / (the responses its policy wrote on that prompt), so every prompt carries the same mass and
  a policy's finished mass there is the sum of its finished shares. The cell's always-finishing
  mass is M = sum over its prompts of min(q_a, q_b); each side's pool is trimmed to mass M
  (fractionally at the boundary response), its lowest and its highest part: the lower bound of
  the gain is the policy's lowest-M mean minus the start policy's highest-M mean, the upper
  bound the other way round. Where one policy finished more on every prompt of the cell, the
  other side's pool has mass M and nothing of it is trimmed: Lee's bounds on the cell. Where the
  side that finished more changes between prompts, trimming both sides is a relaxation of the
  per-prompt trimming (any per-prompt choice is one of the pooled ones), so the bounds are wider
  and still hold. Pooling is what a coarser covariate cell costs (Lee 2009, section on
  covariates): between-prompt spread enters the pool and widens the bounds beyond the sharp
  per-prompt ones (simulated with prompt means spread from 0.2 to 0.8: about a fifth wider).
  A prompt where a policy finished nothing adds nothing to M but its other side's finished
  responses enter the pool (to be trimmed), so it is not dropped.
- Bias: the stratified delete-one jackknife (every prompt x policy a stratum of n_h responses):
  bias = sum over strata of (n_h - 1) x (mean bound with one of its responses left out - bound);
  the corrected bound is the bound minus its bias, never moved past the cell's untrimmed gain
  (the difference of its pools' means, which the population bounds always hold), so lower <=
  untrimmed <= upper holds in every cell. A cell where leaving one response out leaves no
  always-finishing mass (one finished response of the lower side) keeps its uncorrected bounds.
  The jackknife needs replication within a prompt: with 1 response per prompt it corrects
  nothing, with 2 only part (simulated at shares 1.0 against 0.5: coverage 88%).
- The study's bounds: the cells' bounds weighted by their M: the mean gain among all the
  always-finishing responses of the prompts (every prompt's responses weighing the same), Lee's
  own estimand (where the shares differ between prompts it weighs a prompt by its
  always-finishing share, not equally as the finished-only gain does). A cell with M = 0 has no
  always-finishing response and weight 0, so leaving it out selects nothing.

The interval around the bounds: the lower end of the lower bound's cluster t interval and the
upper end of the upper bound's (`intervals.cluster_t` over the cells' countries, at 1 - alpha
each, on the ratio estimator's linearised values: every prompt of cell c carries
bound + (M_c / n_c) x (bound_c - bound) / (mean M per prompt), n_c its prompts): it covers the
whole identified set at 1 - alpha nominally (each end misses with probability at most alpha / 2).
`tests/test_selection.py` simulates that coverage at the default's design (4 responses per
prompt, 48 prompts in 17 countries of 1 to 8): 97% at shares 1.0 against 0.5, 99% at 0.98
against 0.9, for a nominal 95%; with other value distributions (beta, skewed or U-shaped) 93-96%,
with prompts that differ in which policy finishes more, or in their means, 100% (wider bounds).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from .intervals import check_alpha, cluster_t

#: Rows of the jackknife's deletions evaluated at once (memory: this x a cell's responses).
_CHUNK = 256


def _trimmed(y: np.ndarray, w: np.ndarray, mass: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(lowest, highest) weighted means of mass `mass` of the values `y` (sorted ascending) under
    each row of weights `w` (rows x values), the boundary value taken fractionally."""
    out = []
    for yy, ww in ((y, w), (y[::-1], w[:, ::-1])):
        cum = np.cumsum(ww, axis=1)
        take = np.clip(mass[:, None] - (cum - ww), 0.0, ww)
        with np.errstate(invalid="ignore", divide="ignore"):
            out.append(np.where(mass > 0, take @ yy / mass, math.nan))
    return out[0], out[1]


def _cell_rows(keep: np.ndarray, side: np.ndarray, onehot: np.ndarray, fin: np.ndarray,
               order: dict[bool, np.ndarray], y: np.ndarray, pidx: np.ndarray) -> dict[str, np.ndarray]:  # fmt: skip
    """The cell's plug-in bounds for each row of `keep` (rows x responses: which responses are
    in): `lower`, `upper`, `naive`, `mass` (M) and the sides' finished masses `fin_a`, `fin_b`."""
    k = keep.astype(float)
    n_a, n_b = (k * side) @ onehot, (k * ~side) @ onehot
    f_a, f_b = (k * (side & fin)) @ onehot, (k * (~side & fin)) @ onehot
    both = (n_a > 0) & (n_b > 0)
    with np.errstate(invalid="ignore", divide="ignore"):
        w_a, w_b = np.where(both, 1.0 / n_a, 0.0), np.where(both, 1.0 / n_b, 0.0)
    mass = np.minimum(f_a * w_a, f_b * w_b).sum(axis=1)
    ends, means, fmass = {}, {}, {}
    for s, wp in ((True, w_a), (False, w_b)):
        r = order[s]
        w = k[:, r] * wp[:, pidx[r]]
        ends[s] = _trimmed(y[r], w, mass)
        fmass[s] = w.sum(axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            means[s] = w @ y[r] / fmass[s]
    return {"lower": ends[True][0] - ends[False][1], "upper": ends[True][1] - ends[False][0],
            "naive": means[True] - means[False], "mass": mass, "fin_a": fmass[True],
            "fin_b": fmass[False]}  # fmt: skip


def lee_cell_bounds(
    is_policy: Any, prompt: Any, finished: Any, values: Any, *, bias_correction: bool = True
) -> dict[str, Any] | None:
    """Lee's bounds on one cell (module docstring) on the policy's gain over the other in
    `values` among the responses that would finish under either: one entry per response of the
    two policies, `is_policy` True for the policy's, `prompt` its prompt's label, `finished`
    whether it finished (`values` is read only where it did).

    Returns `lower`, `upper` (jackknife-corrected unless `bias_correction` is False), `lower_raw`,
    `upper_raw` (the plug-in bounds), `naive` (the pools' untrimmed difference), `mass` (M, in
    prompts), `fin_a`, `fin_b` (the pools' masses) and `prompts` (those where both policies
    wrote a response). None where M = 0 (no always-finishing response: no bounds)."""
    side = np.asarray(is_policy, dtype=bool)
    fin = np.asarray(finished, dtype=bool)
    y = np.asarray(values, dtype=float)
    labels, pidx = np.unique(np.asarray(prompt), return_inverse=True)
    if not side.shape == fin.shape == y.shape == pidx.shape:
        raise ValueError("is_policy, prompt, finished and values need one entry per response")
    if np.isnan(y[fin]).any():
        raise ValueError("a finished response lacks its value")
    r = side.size
    onehot = np.zeros((r, labels.size))
    onehot[np.arange(r), pidx] = 1.0
    order = {}
    for s in (True, False):
        i = np.flatnonzero((side == s) & fin)
        order[s] = i[np.argsort(y[i], kind="stable")]
    base = {k: float(v[0]) for k, v in
            _cell_rows(np.ones((1, r), bool), side, onehot, fin, order, y, pidx).items()}  # fmt: skip
    if not base["mass"] > 0:
        return None
    n_in = onehot.T @ side, onehot.T @ ~side
    out = {"lower": base["lower"], "upper": base["upper"], "lower_raw": base["lower"],
           "upper_raw": base["upper"], "naive": base["naive"], "mass": base["mass"],
           "fin_a": base["fin_a"], "fin_b": base["fin_b"],
           "prompts": int(np.sum((n_in[0] > 0) & (n_in[1] > 0)))}  # fmt: skip
    stratum = pidx * 2 + side
    size = np.bincount(stratum, minlength=2 * labels.size)[stratum]
    drop = np.flatnonzero(size > 1)  # a stratum of one response carries no jackknife weight
    if not bias_correction or drop.size == 0:
        return out
    low, up = np.empty(drop.size), np.empty(drop.size)
    for start in range(0, drop.size, _CHUNK):
        d = drop[start : start + _CHUNK]
        keep = np.ones((d.size, r), bool)
        keep[np.arange(d.size), d] = False
        rows = _cell_rows(keep, side, onehot, fin, order, y, pidx)
        low[start : start + d.size], up[start : start + d.size] = rows["lower"], rows["upper"]
    if not (np.isfinite(low).all() and np.isfinite(up).all()):
        return out  # leaving one response out can leave no always-finishing mass: no correction
    _, inv = np.unique(stratum[drop], return_inverse=True)
    n_h = np.bincount(inv) + 0.0
    bias = [float(np.sum((n_h - 1) * (np.bincount(inv, weights=v) / n_h - b)))
            for v, b in ((low, base["lower"]), (up, base["upper"]))]  # fmt: skip
    out["lower"] = min(base["lower"] - bias[0], base["naive"])
    out["upper"] = max(base["upper"] - bias[1], base["naive"])
    return out


def lee_bounds(
    df: pd.DataFrame,
    policy: str,
    base: str,
    value_col: str,
    *,
    policy_col: str = "policy",
    prompt_col: str = "prompt_id",
    finished_col: str = "finished",
    cluster_col: str | None = None,
    alpha: float = 0.05,
    bias_correction: bool = True,
) -> dict[str, Any]:
    """Lee's trimming bounds on `policy`'s gain over `base` in `value_col` among responses that
    finish (`finished_col` True) under either, trimmed within cells of `cluster_col` (the
    country; every prompt its own cell without one) and jackknife-corrected unless
    `bias_correction` is False (module docstring).

    Returns `lower` and `upper` (the bounds: the cells' bounds weighted by their always-finishing
    mass), `low` and `high` (the interval that covers the bounds at 1 - alpha: the lower bound's
    lower end and the upper bound's upper end, cluster t over the cells), `naive` (the cells'
    untrimmed gain among finished responses, weighted alike, for reference), `prompts` (those
    that entered the bounds: every prompt where both policies wrote a response, in a cell with
    an always-finishing response, including prompts where one of them finished nothing),
    `n_clusters` (the cells), `finished` and `base_finished` (each policy's finished share over
    all its responses) and `trimmed` (the share of those prompts' finished mass, every prompt's
    responses weighing the same, that trimming left out). NaN bounds where no cell has an
    always-finishing response.
    """
    check_alpha(alpha)
    for col in (policy_col, prompt_col, finished_col, value_col):
        if col not in df.columns:
            raise KeyError(f"samples lack column {col!r}; found {list(df.columns)}")
    out: dict[str, Any] = {"lower": math.nan, "upper": math.nan, "low": math.nan,
                           "high": math.nan, "naive": math.nan, "prompts": 0, "n_clusters": 0,
                           "finished": math.nan, "base_finished": math.nan, "trimmed": math.nan}  # fmt: skip
    for name, key in ((policy, "finished"), (base, "base_finished")):
        g = df[df[policy_col] == name]
        if len(g):
            out[key] = float(g[finished_col].eq(True).mean())
    d = df[df[policy_col].isin([policy, base])]
    d = d[~(d[finished_col].eq(True) & d[value_col].isna())]  # finished, unscored: not written
    if d.empty:
        return out
    prompt = d[prompt_col].to_numpy()
    cell = prompt if cluster_col is None else d.groupby(prompt_col)[cluster_col].transform("first").to_numpy()  # fmt: skip
    side = (d[policy_col] == policy).to_numpy()
    fin = d[finished_col].eq(True).to_numpy()
    y = d[value_col].to_numpy(dtype=float)
    labels, inv = np.unique(cell, return_inverse=True)
    cells = []
    for c in range(labels.size):
        r = inv == c
        res = lee_cell_bounds(side[r], prompt[r], fin[r], y[r], bias_correction=bias_correction)
        if res is not None:
            cells.append((labels[c], res))
    if not cells:
        return out
    m = np.array([res["mass"] for _, res in cells])
    n = np.array([res["prompts"] for _, res in cells])
    groups = np.repeat(np.array([c for c, _ in cells]), n)
    per_prompt = m.sum() / n.sum()
    for key, end in (("lower", "low"), ("upper", "high"), ("naive", None)):
        b = np.array([res[key] for _, res in cells])
        est = float(np.sum(m * b) / m.sum())
        out[key] = est
        if end is not None:  # the ratio estimator's linearised values, one per prompt
            z = np.repeat(est + (m / n) * (b - est) / per_prompt, n)
            ct = cluster_t(z, groups, alpha)
            out[end], out["n_clusters"] = ct[end], ct["n_clusters"]
    fmass = sum(res["fin_a"] + res["fin_b"] for _, res in cells)
    out.update(prompts=int(n.sum()), trimmed=float((fmass - 2 * m.sum()) / fmass))
    return out
