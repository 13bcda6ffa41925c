"""How large the evaluation must be (notebook 04): the variance components of each policy's
paired gain over the start policy under each judge (`eval_variance_components`) and the design
(prompts, samples per prompt) they call for (`eval_design`), with the run's own design, the best
one at its sampling cost, the cheapest one that reaches `evaluation.target_mde`, and every
held-out context at the run's samples per prompt, and, where even that does not reach the
target, how many held-out countries would (`countries_needed`).

The cost of a design is the evaluation's own sampling time: the seconds it spent per response of
a compared policy (sampling, scoring, grounding; k per prompt and policy) and per prompt
(best-of-N's pool, the history references, the frontier snapshots and the over-optimisation
curve's draws: drawn once per prompt whatever k is), measured by the stage's phase timer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from rlxf_utils.stats import (
    COMPONENTS,
    bm_df,
    bm_df_moments,
    choose_design,
    component_table,
    design_grid,
    design_se,
    mde,
)

#: The two judges of every gain: column in the samples -> the name a table gives it.
JUDGES = {"reward": "reward model", "audit_reward": "audit"}

#: The stage's phases whose time grows with the responses per prompt, and with the prompts only.
PER_SAMPLE_PHASES = ("samples ", "rewards", "grounding")
PER_PROMPT_PHASES = ("best-of-N pool", "history references", "frontier snapshots",
                     "over-optimisation curve")  # fmt: skip


def variance_table(samples: pd.DataFrame, family: Sequence[str], start: str) -> pd.DataFrame:
    """`stats.component_table` for the vs-start family under both judges: one row per (policy,
    judge) with the between-country, between-prompt and within-prompt variance of the paired
    difference from `start` (paired by prompt and sample index) and its predicted SE."""
    return component_table(samples, family, start, JUDGES)


#: What the design is sized on, in words for the table (`sized_on`) and the report.
SIZED_ON = "each variance component's largest value over the family's methods"


def conservative_components(components: pd.DataFrame, judge: str) -> dict[str, float]:
    """Each component's largest value over the family's policies under `judge` (`SIZED_ON`;
    best-of-N, one sample per prompt, has no within-prompt component and is left out of that
    one's). A design sized on these reaches its MDE for every method of the family, the most
    variable included (each component of a policy is at most this, so is its predicted SE);
    sized on the median, it would for half of them."""
    rows = components[components["judge"] == judge]
    return {c: float(rows[c].max()) if rows[c].notna().any() else math.nan for c in COMPONENTS}


def sampling_costs(seconds: Mapping[str, float], prompts: int, k: int) -> tuple[float, float]:
    """(seconds per response per prompt, seconds per prompt) from the stage's phase times:
    the per-sample phases over prompts x k, the per-prompt phases over prompts."""
    per_sample = sum(v for name, v in seconds.items() if name.startswith(PER_SAMPLE_PHASES))
    per_prompt = sum(v for name, v in seconds.items() if name in PER_PROMPT_PHASES)
    return per_sample / max(prompts * k, 1), per_prompt / max(prompts, 1)


def design_table(
    components: pd.DataFrame,
    available: Mapping[Any, int],
    used: Mapping[Any, int],
    k: int,
    seconds: Mapping[str, float],
    family_size: int,
    alpha: float,
    power: float,
    target_mde: float | None,
    max_samples: int = 16,
) -> pd.DataFrame:
    """Per judge, sized on `conservative_components` (`sized_on`: each component's largest
    value over the family): the run's design (`used`: prompts per country; k samples per
    prompt), the design with the smallest MDE at the run's sampling cost, the cheapest one reaching
    `target_mde` (when any does) and every held-out context (`available`: contexts per
    country) at k: prompts, samples per prompt, countries, predicted SE, the t df and the MDE at
    `power` for a family of `family_size` at `alpha` (`stats.power`), cost in seconds, and
    whether it reaches the target."""
    prompts = int(sum(used.values()))
    c_sample, c_prompt = sampling_costs(seconds, prompts, k)
    total = int(sum(available.values()))
    steps = sorted({*range(8, total + 1, 8), total, prompts})
    rows = []
    for judge in JUDGES.values():
        comp = conservative_components(components, judge)
        if all(math.isnan(v) for v in comp.values()):
            continue
        grid = design_grid(comp, available, c_sample, c_prompt, family_size, alpha, power,
                           max_samples, steps)  # fmt: skip
        own = _row(comp, list(used.values()), k, c_sample, c_prompt, family_size, alpha, power)
        picks = [("this run", pd.Series(own))]
        if (
            grid["mde"].notna().any()
        ):  # none with a single country (the smoke profile's few prompts)
            picks.append(("best at this run's cost", choose_design(grid, budget=own["cost"])))
        if target_mde is not None and grid["mde"].notna().any():
            pick = choose_design(grid, target_mde=target_mde)
            if pick["reason"] == "target":
                picks.append((f"cheapest reaching MDE {target_mde:g}", pick))
        every = grid[
            (grid["prompts"] == total) & (grid["samples_per_prompt"] == min(k, max_samples))
        ]
        if len(every):
            picks.append(("every held-out context", every.iloc[0]))
            if target_mde is not None and not every.iloc[0]["mde"] <= target_mde:
                more = countries_needed(comp, available, min(k, max_samples), target_mde,
                                        c_sample, c_prompt, family_size, alpha, power)  # fmt: skip
                if more is not None:
                    picks.append((f"countries needed for MDE {target_mde:g}", pd.Series(more)))
        for name, r in picks:
            rows.append({"judge": judge, "design": name, "prompts": int(r["prompts"]),
                         "samples_per_prompt": int(r["samples_per_prompt"]),
                         "countries": int(r["countries"]), "se": float(r["se"]), "df": float(r["df"]),
                         "mde": float(r["mde"]), "cost_s": float(r["cost"]),
                         "reaches_target": bool(target_mde is not None and r["mde"] <= target_mde),
                         **{c: comp[c] for c in COMPONENTS}, "sized_on": SIZED_ON})  # fmt: skip
    return pd.DataFrame(rows)


def countries_needed(
    comp: Mapping[str, float], available: Mapping[Any, int], k: int, target_mde: float,
    c_sample: float, c_prompt: float, m: int, alpha: float, power: float,
    max_countries: int = 5000,
) -> dict[str, float] | None:  # fmt: skip
    """Where no design within the held-out contexts reaches `target_mde`: the fewest held-out
    countries that would, their contexts spread as the held-out countries' are (`available`: g
    countries take the g evenly spaced quantiles of those counts), all used at k samples, under
    the same variance components (the row of `_row` for that design); None where even
    `max_countries` would not. Uneven countries need more of them than even ones of the same
    mean (the cluster t's df and the weights), so the spread is kept, not averaged away. The
    between-country component divides by the countries alone, so past a point only more
    countries lower the MDE; this says how many, not whether the data has them."""
    counts = np.asarray([v for v in available.values() if v > 0], dtype=float)  # quantile sorts
    counts = counts if counts.size else np.ones(1)

    def row(g: int, df_of: Callable[[Any, float], float] = bm_df_moments) -> dict[str, float]:
        per = np.maximum(np.rint(np.quantile(counts, (np.arange(g) + 0.5) / g)), 1.0)
        return _row(comp, per.tolist(), k, c_sample, c_prompt, m, alpha, power, df_of)

    # the search runs on the O(G) df (thousands of countries), the row it reports on `bm_df`
    lo = hi = max(len(available), 2)  # the MDE falls as countries are added: double, then halve
    while not row(hi)["mde"] <= target_mde:
        if hi >= max_countries:
            return None
        lo, hi = hi, min(2 * hi, max_countries)
    while hi - lo > 1:  # hi reaches the target, lo (when below hi) does not
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if row(mid)["mde"] <= target_mde else (mid, hi)
    return row(hi, bm_df)


def _row(comp: Mapping[str, float], per_country: Sequence[int], k: int, c_sample: float,
         c_prompt: float, m: int, alpha: float, power: float,
         df_of: Callable[[Any, float], float] = bm_df) -> dict[str, float]:  # fmt: skip
    """The run's own design, with its actual prompts per country (`df_of`: `bm_df`, or its
    O(G) twin `bm_df_moments` where a search tries thousands of countries)."""
    p_g = np.asarray(per_country, dtype=float)
    se = design_se(comp, p_g, k)
    s2 = [0.0 if math.isnan(comp[c]) else comp[c] for c in COMPONENTS]
    between = s2[0] + s2[1] + s2[2] / k
    df = df_of(p_g, s2[0] / between if between > 0 else 0.0)
    p = float(p_g.sum())
    return {"prompts": p, "samples_per_prompt": k, "countries": int((p_g > 0).sum()), "se": se,
            "df": df, "mde": mde(se, m, alpha, power, df), "cost": p * (c_prompt + k * c_sample)}  # fmt: skip
