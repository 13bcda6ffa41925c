"""Bounds for a comparison on a subset the compared policies themselves select: Lee's (2009)
trimming bounds, within prompts.

Which responses finish before the token cap is an outcome of the policy: a policy that finishes
fewer responses than the start policy keeps, among its finished ones, a different kind of answer
(the short ones), so the gain among finished responses compares two differently selected sets
and identifies no effect. Lee's bounds ask what the gain can be among the answers that would
have finished under either policy. Within a prompt, the policy with the higher finished share q_hi
holds, besides those, q_hi - q_lo responses that finish only under it; trimming its finished
responses down to the lower share (a fraction q_lo / q_hi of them kept) from the top gives the
lowest mean that set can have, from the bottom the highest. The gain's bounds are the prompt's
other policy's finished mean against those two; the study's bounds are their means over the
prompts where both policies finished at least one response (each prompt weighs the same, as in
every paired gain of the study). Lee, D. S. (2009), "Training, wages, and sample selection:
estimating sharp bounds on treatment effects", Review of Economic Studies 76(3), 1071-1102.

The interval around the bounds: the lower end of the lower bound's cluster t interval and the
upper end of the upper bound's (`intervals.cluster_t`, at 1 - alpha each): it covers the whole
identified set, hence the true gain on that set, at 1 - alpha at least (each end misses with
probability at most alpha / 2).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from .intervals import check_alpha, cluster_t


def lee_prompt_bounds(a: Any, n_a: int, b: Any, n_b: int) -> tuple[float, float, int] | None:
    """(lower, upper, trimmed) bounds on mean(a) - mean(b) among responses that would finish
    under either policy, on one prompt: `a`, `b` the finished responses' values, `n_a`, `n_b`
    the responses each policy wrote there (finished or cut). The side with the higher finished
    share keeps round(count x q_lo / q_hi) (at least one) of its finished responses: its lowest
    for the lower bound of the gain when it is `a` (its highest when it is `b`), and the other way
    round for the upper bound; `trimmed` counts the responses left out. None where either policy
    finished none (no bound on that prompt)."""
    a = np.sort(np.asarray(a, dtype=float))
    b = np.sort(np.asarray(b, dtype=float))
    if a.size == 0 or b.size == 0:
        return None
    if n_a < a.size or n_b < b.size:
        raise ValueError(
            f"more finished responses than responses: {a.size} of {n_a}, {b.size} of {n_b}"
        )
    q_a, q_b = a.size / n_a, b.size / n_b
    if q_a >= q_b:
        keep = max(1, round(a.size * q_b / q_a))
        return float(a[:keep].mean() - b.mean()), float(a[-keep:].mean() - b.mean()), a.size - keep
    keep = max(1, round(b.size * q_a / q_b))
    return float(a.mean() - b[-keep:].mean()), float(a.mean() - b[:keep].mean()), b.size - keep


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
) -> dict[str, Any]:
    """Lee's trimming bounds, within prompts, on `policy`'s gain over `base` in `value_col` among
    responses that finish (`finished_col` True) under either (module docstring).

    Returns `lower` and `upper` (the bounds: means over the prompts where both finished a
    response), `low` and `high` (the interval that covers the bounds at 1 - alpha: the lower
    bound's lower end and the upper bound's upper end, cluster t over `cluster_col`, every prompt
    its own cluster without one), `naive` (the untrimmed gain among finished responses on the
    same prompts, for reference), `prompts` (how many), `n_clusters`, `finished` and
    `base_finished` (each policy's finished share over all its responses) and `trimmed` (the
    share of the two policies' finished responses on those prompts that trimming left out).
    NaN bounds where no prompt has a finished response of both.
    """
    check_alpha(alpha)
    for col in (policy_col, prompt_col, finished_col, value_col):
        if col not in df.columns:
            raise KeyError(f"samples lack column {col!r}; found {list(df.columns)}")
    out: dict[str, Any] = {"lower": math.nan, "upper": math.nan, "low": math.nan,
                           "high": math.nan, "naive": math.nan, "prompts": 0, "n_clusters": 0,
                           "finished": math.nan, "base_finished": math.nan, "trimmed": math.nan}  # fmt: skip
    sides = {}
    for name, key in ((policy, "finished"), (base, "base_finished")):
        g = df[df[policy_col] == name]
        done = g[finished_col].eq(True)
        sides[name] = (g, done)
        if len(g):
            out[key] = float(done.mean())
    (ga, da), (gb, db) = sides[policy], sides[base]
    fin_a = ga[da].groupby(prompt_col)[value_col].apply(list)
    fin_b = gb[db].groupby(prompt_col)[value_col].apply(list)
    n_a, n_b = ga.groupby(prompt_col).size(), gb.groupby(prompt_col).size()
    rows, trimmed, kept_from = [], 0, 0
    for p in sorted(set(fin_a.index) & set(fin_b.index)):
        res = lee_prompt_bounds(fin_a[p], int(n_a[p]), fin_b[p], int(n_b[p]))
        if res is None:
            continue
        rows.append((p, res[0], res[1], float(np.mean(fin_a[p]) - np.mean(fin_b[p]))))
        trimmed += res[2]
        kept_from += len(fin_a[p]) + len(fin_b[p])
    if not rows:
        return out
    prompts = [r[0] for r in rows]
    lower, upper, naive = (np.array([r[i] for r in rows]) for i in (1, 2, 3))
    clusters = None
    if cluster_col is not None:
        per = df[df[policy_col].isin([policy, base])].groupby(prompt_col)[cluster_col].first()
        clusters = per.loc[prompts].to_numpy()
    lo, hi = cluster_t(lower, clusters, alpha), cluster_t(upper, clusters, alpha)
    out.update(lower=float(lower.mean()), upper=float(upper.mean()), low=lo["low"],
               high=hi["high"], naive=float(naive.mean()), prompts=len(rows),
               n_clusters=lo["n_clusters"], trimmed=trimmed / kept_from)  # fmt: skip
    return out
