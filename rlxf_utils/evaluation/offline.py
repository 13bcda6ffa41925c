"""Does learning from experience need RL here? RL, ILHF, the offline methods (KTO, DPO,
rejection-sampling fine-tuning) and best-of-N side by side, and RL against the offline methods.

`methods_table` puts every method's gain over the start policy under the reward model and under
the disjoint-rows audit (the judge none of them was trained on) beside its KL, finished share and
place against best-of-N at equal KL: all read from notebook 04's summary, measured the same way
for every policy. `rl_vs_offline` compares each RL algorithm with each offline method on the same
prompts (one family per measure, `evaluation.questions`), and `need_rl` reads the answer from
those intervals: RL is needed where some RL algorithm beats every offline method; it is not
where some offline method beats every RL algorithm; otherwise the data do not tell.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from rlxf_utils.algorithms import ALGORITHMS, OFFLINE_ALGORITHMS, RL_ALGORITHMS, algorithm_label
from rlxf_utils.evaluation.questions import question_comparisons
from rlxf_utils.plots import ci_err
from rlxf_utils.stats import level

#: How the methods are grouped in the table and figure (registry family -> group)
GROUPS = {"ppo": "RL", "trl": "RL", "rlgf": "RL", "ilhf": "ILHF", "offline": "offline"}
#: The gains among finished responses only (`evaluation.tables.finished_only`), beside the
#: finished share: a description of the subset the policies select, with its Lee bounds
#: (`evaluation.tables.finished_bounds`), never a check of the full gain.
FINISHED_GAINS = tuple(f"{g}_finished{end}" for g in ("gain", "audit_gain")
                       for end in ("", "_low", "_high", "_lee_lower", "_lee_upper", "_lee_low",
                                   "_lee_high", "_lee_prompts"))  # fmt: skip
#: Groups in display order, with the references
GROUP_ORDER = ("RL", "ILHF", "offline", "supervised", "best-of-N", "attainable")
#: The attainable gain's row (`history.attainable_gain`: history MET minus the start policy).
ATTAINABLE = "attainable"


def method_group(policy: str) -> str:
    """RL, ILHF, offline, supervised (`sft_met`) or best-of-N."""
    if policy in ALGORITHMS:
        return GROUPS[ALGORITHMS[policy].family]
    return {"best_of_n": "best-of-N", "sft_met": "supervised"}.get(policy, "other")


def methods_table(
    summary: pd.DataFrame, vs_best_of_n: pd.DataFrame, algos: Sequence[str], best_of_n: int = 0,
    attainable: pd.DataFrame | None = None,
) -> pd.DataFrame:  # fmt: skip
    """One row per method (every algorithm, `sft_met`, best-of-N): its display name, group, gain
    over the start policy under the reward model and the audit with their intervals, KL to the
    start policy, finished share, both gains among finished responses only (`FINISHED_GAINS`;
    NaN for runs from before) and the verdict against best-of-N at equal KL. With `attainable`
    (`history.attainable_gain`: history MET minus the start policy per judge), a last row of
    group `ATTAINABLE` holds it in the gain columns, and every row its gains as shares of it
    (`share`, `audit_share`: the ratio of the two point estimates, NaN where the attainable
    gain's interval does not lie above zero, so that the ratio has a positive denominator)."""
    labels = {"sft_met": "SFT on MET only", "best_of_n": f"best-of-{best_of_n or 'N'}"}
    names = [*algos, *(p for p in ("sft_met", "best_of_n") if p in set(summary["policy"]))]
    rec = summary.set_index("policy")
    vs = vs_best_of_n.set_index("policy") if len(vs_best_of_n) else pd.DataFrame()
    rows = []
    for name in names:
        if name not in rec.index:
            continue
        r = rec.loc[name]
        v = vs.loc[name] if name in vs.index else None
        rows.append({"policy": name, "method": labels.get(name, algorithm_label(name)),
                     "group": method_group(name),
                     **{c: float(r[c]) for c in ("gain", "gain_low", "gain_high", "audit_gain",
                                                 "audit_gain_low", "audit_gain_high", "kl", "finished")},
                     **{c: float(r.get(c, np.nan)) for c in FINISHED_GAINS},
                     "kl_kind": r.get("kl_kind", ""),
                     "vs_best_of_n": v["verdict"] if v is not None else "",
                     "vs_best_of_n_diff": float(v["diff"]) if v is not None else np.nan})  # fmt: skip
    out = pd.DataFrame(rows)
    if out.empty:
        return out
    rank = {g: i for i, g in enumerate(GROUP_ORDER)}
    out = out.sort_values("group", key=lambda s: s.map(rank), kind="stable").reset_index(drop=True)
    return with_attainable(out, attainable)


def with_attainable(methods: pd.DataFrame, attainable: pd.DataFrame | None) -> pd.DataFrame:
    """`methods` with the attainable gain's row (method 'attainable (history MET − <start>)') and
    each row's gains as shares of it (`methods_table`); unchanged without an attainable gain."""
    if attainable is None or attainable.empty:
        return methods
    a = attainable.set_index("measure")
    start = str(a["vs"].iloc[0])
    row: dict[str, Any] = {"policy": ATTAINABLE, "group": ATTAINABLE,
                           "method": f"attainable (history MET − {algorithm_label(start)})"}  # fmt: skip
    for measure, key in (("reward", "gain"), ("audit_reward", "audit_gain")):
        have = measure in a.index
        for end, col in (("", "diff"), ("_low", "ci_low"), ("_high", "ci_high")):
            row[key + end] = float(a.loc[measure, col]) if have else np.nan
    out = pd.concat([methods, pd.DataFrame([row])], ignore_index=True)
    for key, share in (("gain", "share"), ("audit_gain", "audit_share")):
        ok = bool(row[f"{key}_low"] > 0)  # NaN compares False: no interval, no share
        out[share] = out[key] / row[key] if ok else np.nan
    return out


def offline_pairs(samples: pd.DataFrame, algos: Sequence[str]) -> list[tuple[str, str, str]]:
    """Each RL algorithm against each offline method that ran (question `rl_vs_offline`)."""
    present = set(samples["policy"])
    rl = [a for a in algos if a in RL_ALGORITHMS and a in present]
    off = [a for a in algos if a in OFFLINE_ALGORITHMS and a in present]
    return [("rl_vs_offline", a, b) for a in rl for b in off]


def rl_vs_offline(
    samples: pd.DataFrame, algos: Sequence[str], n_boot: int, alpha: float, seed: int,
    kl: Mapping[str, float] | None = None, kl_ratio: float | None = None,
) -> pd.DataFrame:  # fmt: skip
    """`offline_pairs` under the reward model and the audit, those at comparable KL (`kl`,
    `kl_ratio`: `questions.kl_matched`): one family per measure (`question_comparisons`)."""
    pairs = offline_pairs(samples, algos)
    return question_comparisons(samples, pairs, n_boot, alpha, seed, kl=kl, kl_ratio=kl_ratio)


def need_rl(comparisons: pd.DataFrame, measure: str, all_pairs: int | None = None,
            kl_ratio: float | None = None) -> dict[str, Any]:  # fmt: skip
    """The answer under `measure` read from the intervals of `rl_vs_offline`: 'rl' when some RL
    algorithm's interval is above zero against every offline method it was compared with
    (`winners`: those algorithms), 'offline' when some offline method's is against every RL
    algorithm it was compared with, else 'undecided' (`beaten`: the pairs whose interval
    excludes zero, either way). `opponents`: the other side's methods the winners met;
    `left_out`: how many of the `all_pairs` pairs that ran were not compared, their KLs further
    apart than `kl_ratio` (`questions.kl_matched`), so that "every" is never read as every
    method that ran when only some could be compared."""
    t = comparisons[comparisons["measure"] == measure]
    left = max(int(all_pairs) - len(t), 0) if all_pairs is not None else 0
    if t.empty:
        return {"measure": measure, "answer": "not compared", "winners": [], "beaten": [],
                "left_out": left, "kl_ratio": kl_ratio}  # fmt: skip
    n_off, n_rl = t["versus"].nunique(), t["policy"].nunique()
    above = t[t["low"] > 0].groupby("policy")["versus"].nunique()
    below = t[t["high"] < 0].groupby("versus")["policy"].nunique()
    rl_win = sorted(above[above == n_off].index)
    off_win = sorted(below[below == n_rl].index)
    beaten = [(r.policy, r.versus, "above" if r.low > 0 else "below")
              for r in t.itertuples() if r.low > 0 or r.high < 0]  # fmt: skip
    answer = "rl" if rl_win else ("offline" if off_win else "undecided")
    side = "versus" if rl_win else "policy"  # the winners' opponents
    opponents = sorted(t[side].unique()) if answer != "undecided" else []
    return {"measure": measure, "answer": answer, "winners": rl_win or off_win,
            "beaten": beaten, "ci_level": float(t["ci_level"].iloc[0]), "pairs": len(t),
            "opponents": opponents, "left_out": left, "kl_ratio": kl_ratio}  # fmt: skip


def plot_methods(table: pd.DataFrame, alpha: float = 0.05) -> Any:
    """Every method's gain over the start policy under the reward model and under the audit, with
    its interval, grouped (RL, ILHF, offline, supervised, best-of-N, attainable); `alpha` is the
    vs-start family's own (the title states 1 - alpha, the level the intervals were made at)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 0.45 * max(len(table), 4) + 1.4), sharey=True)
    y = np.arange(len(table))[::-1]
    colours = dict(zip(GROUP_ORDER, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))  # fmt: skip
    for ax, (col, title) in zip(axes, (("gain", "under the reward model"),
                                       ("audit_gain", "under the audit (never trained on)")),
                                strict=True):  # fmt: skip
        for group, g in table.groupby("group", sort=False):
            idx = g.index.to_numpy()
            ax.errorbar(g[col], y[idx], xerr=ci_err(g, col, f"{col}_low", f"{col}_high", True),
                        fmt="o", color=colours.get(group, "gray"), label=group, capsize=3)  # fmt: skip
        ax.axvline(0, color="black", lw=0.8)
        ax.set(title=f"Gain {title}", xlabel="gain over the start policy in P(MET)")
        ax.grid(alpha=0.3, axis="x")
    axes[0].set_yticks(y, table["method"])
    axes[0].legend(fontsize=8, loc="best")
    fig.suptitle(f"Every method from the same start policy (bars: {level(alpha)} simultaneous "
                 "cluster t intervals over countries, the family of each method against it)",
                 fontsize=10)  # fmt: skip
    fig.tight_layout()
    return fig
