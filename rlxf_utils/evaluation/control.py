"""The positive control's question: with labels drawn from a known P*(MET | text)
(`data.planted`), would the study's judges have seen a gain where there is one?

Every evaluated response of a control run carries its true P* (`planted`, under the same cut rule
as the judges). Per method of the vs-start family, its gain over the start policy under the truth
and under each judge, on the same prompts, each with the cluster t interval over countries
(`stats.paired_comparison`) at the family's simultaneous level (`stats.family_alpha`, the level
of every gain in the tables), and whether each judge's verdict (above, below, not distinguishable) is the truth's. `detected`: the
smallest true gain among the methods whose gain a judge's interval puts above zero.

A judge is a different model from P*, so it reads a gain on its own scale: a true gain of 0.1 in
P* may show as 0.02 under a judge that puts it above zero. What this run's null can be compared
with is therefore the judge's own estimate of the gains it detected (`registered`), and how much
of a true gain the judge registers (`judge_scale`), never the true gain itself.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from rlxf_utils.data.planted import FEATURES, planted_features
from rlxf_utils.markdown import is_present
from rlxf_utils.stats import bound_verdict, family_alpha, paired_comparison, per_prompt_means

#: The truth and the judges: column in the samples -> prefix of the table's columns.
MEASURES = {"planted": "true", "reward": "reward", "audit_reward": "audit"}

#: The columns of `control_table`.
CONTROL_COLUMNS = ["policy", "n", *[f"{k}{e}" for k in MEASURES.values()
                                    for e in ("_gain", "_low", "_high", "_verdict")],
                   "reward_matches", "audit_matches", "ci_level"]  # fmt: skip


def control_table(samples: pd.DataFrame, family: Sequence[str], start: str,
                  alpha: float) -> pd.DataFrame:  # fmt: skip
    """Per policy of `family` (the vs-start family, its size the level's m): its gain over
    `start` under P* and each judge with intervals and verdicts, and whether each judge's verdict
    matches the truth's. Empty (with its columns) where the samples carry no `planted`."""
    if "planted" not in samples or not len(family):
        return pd.DataFrame(columns=CONTROL_COLUMNS)
    a = family_alpha(alpha, len(family))
    country = samples.groupby("prompt_id")["country"].first() if "country" in samples else None
    wide = {m: per_prompt_means(samples, m) for m in MEASURES}
    rows = []
    for policy in family:
        rec: dict[str, Any] = {"policy": policy, "ci_level": 1 - a}
        for m, key in MEASURES.items():
            w = wide[m]
            if policy not in w or start not in w:
                rec.update({f"{key}_gain": math.nan, f"{key}_low": math.nan,
                            f"{key}_high": math.nan, f"{key}_verdict": None})  # fmt: skip
                continue
            res = paired_comparison(w[policy].to_numpy(float), w[start].to_numpy(float),
                                    alpha=alpha, family_size=len(family),
                                    clusters=None if country is None else country.loc[w.index].to_numpy())  # fmt: skip
            rec.update({f"{key}_gain": res["mean_diff"], f"{key}_low": res["ci_low"],
                        f"{key}_high": res["ci_high"], "n": res["n"],
                        f"{key}_verdict": bound_verdict(res["ci_low"], res["ci_high"])})  # fmt: skip
        for judge in ("reward", "audit"):
            truth, said = rec.get("true_verdict"), rec.get(f"{judge}_verdict")
            rec[f"{judge}_matches"] = bool(said == truth) if truth and said else None
        rows.append(rec)
    return pd.DataFrame(rows).reindex(columns=CONTROL_COLUMNS)


def detected(table: pd.DataFrame, judge: str) -> float | None:
    """The smallest true gain among the methods whose gain `judge` ('reward', 'audit') puts
    above zero, None where it puts none there."""
    return _smallest_above(table, judge, "true_gain")


def _above(table: pd.DataFrame, key: str) -> pd.DataFrame:
    return table[table[f"{key}_verdict"] == bound_verdict(1.0, 2.0)]


def _smallest_above(table: pd.DataFrame, judge: str, column: str) -> float | None:
    """The smallest `column` among the methods `judge` puts above zero, None where it puts none."""
    if table.empty:
        return None
    values = [v for v in _above(table, judge)[column] if is_present(v)]
    return float(min(values)) if values else None


def registered(table: pd.DataFrame, judge: str) -> float | None:
    """The smallest of `judge`'s own estimates among the methods it puts above zero: the size, on
    the judge's scale, of the smallest gain it detected; None where it puts none there."""
    return _smallest_above(table, judge, f"{judge}_gain")


def judge_scale(table: pd.DataFrame, judge: str) -> float | None:
    """How much of a true gain `judge` registers: the sum of its estimates over the sum of the
    true gains, over the methods whose true gain lies above zero; None where none does."""
    if table.empty:
        return None
    hit = _above(table, "true")
    pairs = [(t, j) for t, j in zip(hit["true_gain"], hit[f"{judge}_gain"], strict=True)
             if is_present(t) and is_present(j)]  # fmt: skip
    total = sum(t for t, _ in pairs)
    return float(sum(j for _, j in pairs) / total) if pairs and total > 0 else None


#: The columns of `control_features`.
FEATURE_COLUMNS = ["policy", "responses", "words", *FEATURES, "planted"]


def control_features(samples: pd.DataFrame, policies: Sequence[str]) -> pd.DataFrame:
    """Where each policy of `policies` (those in `samples`, in that order) stands on P*'s
    properties: its responses' mean length in words (`words`), the share of them with each of
    `data.planted.FEATURES`, and their mean P* (`planted`, under the cut rule): what a method
    changed in its answers to move the truth."""
    rows = []
    for policy in policies:
        s = samples[samples["policy"] == policy]
        if s.empty:
            continue
        f = planted_features(s["response"].tolist())  # words: the rule's own count, exp(log_words)
        rows.append({"policy": policy, "responses": len(s),
                     "words": float(np.rint(np.exp(f["log_words"])).mean()),
                     **{k: float(f[k].mean()) for k in FEATURES},
                     "planted": float(s["planted"].mean()) if "planted" in s else math.nan})  # fmt: skip
    return pd.DataFrame(rows, columns=FEATURE_COLUMNS)
