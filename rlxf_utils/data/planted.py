"""A planted outcome for the positive control: a stated function of a condition's text,
P*(MET | text), from which every pool's labels are drawn, so that the pipeline's judges can be
checked against a known truth on generated text (Gao, Schulman and Hilton, 2022, label their data
with a gold model the same way).

The rule is logistic in four properties a policy can change by writing differently, each a
plain test of the text (`FEATURES`):

    z = w_q quantified + w_d deadline + w_i institution + w_l (log words - centre) / scale
    P*(MET | text) = sigmoid(intercept + strength x z)

`quantified`: a digit or 'percent'; `deadline`: a month, 'end-', 'by end', a quarter or a year;
`institution`: a named body (ministry, central bank, parliament, authority, ...); the length in
words on a log scale. Every number of the rule is in the params (`data.planted`), fixed before
the control is first run: the weights equal (three properties for, length against), the centre
and scale the mean and SD of log words over MONA's labelled rows, the intercept so that the mean
P* is MONA's MET share (0.63) and the strength so that the rule's own expected AUC over those
rows is 0.75 (`expected_auc`; how they were found: `docs/methods.md`). A row's label is drawn by
comparing P* with a uniform number fixed by the seed and the row's id (`planted_labels`), so a
row keeps its label whatever subset of rows a profile reads.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

#: The rule's binary properties: name -> the pattern whose presence in the text sets it.
FEATURES: dict[str, re.Pattern[str]] = {
    "quantified": re.compile(r"\d|percent", re.IGNORECASE),
    "deadline": re.compile(
        r"\b(?:january|february|march|april|may|june|july|august|september|october|november|"
        r"december|end-|by end|quarter|q[1-4]|20\d\d|19\d\d)\b",
        re.IGNORECASE,
    ),
    "institution": re.compile(
        r"\b(?:ministry|ministries|central bank|bank of|parliament|cabinet|council|authority|"
        r"authorities|agency|treasury|commission|court|office|directorate|department)\b",
        re.IGNORECASE,
    ),
}
#: The length property's name (log words, centred and scaled by the params).
LENGTH = "length"


def planted_features(texts: Sequence[str]) -> pd.DataFrame:
    """Per text, the rule's properties: each of `FEATURES` (0 or 1) and `log_words` (the log of
    its whitespace-separated words, at least one)."""
    texts = [str(t) for t in texts]
    out = {name: [float(bool(p.search(t))) for t in texts] for name, p in FEATURES.items()}
    out["log_words"] = [math.log(max(len(t.split()), 1)) for t in texts]
    return pd.DataFrame(out)


def planted_score(texts: Sequence[str], rule: Any) -> np.ndarray:
    """z of the module docstring for each text under `rule` (`config.data.PlantedOutcome`)."""
    f = planted_features(texts)
    w: Mapping[str, float] = rule.weights
    z = sum(w[name] * f[name].to_numpy() for name in FEATURES)
    length = (f["log_words"].to_numpy() - rule.length_centre) / rule.length_scale
    return np.asarray(z + w[LENGTH] * length, dtype=float)


def planted_probability(texts: Sequence[str], rule: Any) -> np.ndarray:
    """P*(MET | text) for each text under `rule`."""
    z = rule.intercept + rule.strength * planted_score(texts, rule)
    return 1.0 / (1.0 + np.exp(-z))


def row_uniforms(row_ids: Sequence[Any], seed: int) -> np.ndarray:
    """A uniform number in [0, 1) per row, fixed by `seed` and the row's id alone (sha256), so a
    row's planted label does not depend on which other rows a profile reads."""
    out = []
    for r in row_ids:
        h = hashlib.sha256(f"{seed}:{r}".encode()).digest()
        out.append(int.from_bytes(h[:8], "big") / 2.0**64)
    return np.asarray(out, dtype=float)


def planted_labels(p: Any, row_ids: Sequence[Any], seed: int) -> np.ndarray:
    """Labels drawn from P* (`p`, per row: `planted_probability`): 1 where the row's uniform
    number (`row_uniforms`) is below its P*."""
    return (row_uniforms(row_ids, seed) < np.asarray(p, dtype=float)).astype(int)


def expected_auc(p: Any, score: Any) -> float:
    """The AUC a score would have, in expectation over labels drawn as Bernoulli(p): the share of
    (MET, Non-MET) pairs it orders right, ties counting half, each pair weighted by the chance
    that its first is MET and its second is not (a row is never paired with itself)."""
    p, s = np.asarray(p, dtype=float), np.asarray(score, dtype=float)
    if p.shape != s.shape or p.ndim != 1:
        raise ValueError(f"aligned 1-d arrays expected; got {p.shape} and {s.shape}")
    q = 1.0 - p
    frame = pd.DataFrame({"s": s, "p": p, "q": q, "pq": p * q})
    g = frame.groupby("s", sort=True)[["p", "q", "pq"]].sum()
    below = g["q"].cumsum() - g["q"]  # Non-MET mass strictly below each score
    right = float((g["p"] * below).sum()) + 0.5 * float((g["p"] * g["q"] - g["pq"]).sum())
    pairs = float(p.sum() * q.sum() - (p * q).sum())
    return right / pairs if pairs > 0 else math.nan


def plant(conditions: pd.DataFrame, rule: Any) -> pd.DataFrame:
    """`conditions` with every assessed row's label drawn from P* (`y`, `label`); the real ones
    kept as `y_observed` and `label_observed`, P* as `planted_p`. Excluded rows stay excluded."""
    out = conditions.copy()
    out["y_observed"], out["label_observed"] = out["y"], out["label"]
    p = planted_probability(out["description"].astype(str).tolist(), rule)
    y = planted_labels(p, out["row_id"].tolist(), rule.seed)
    assessed = out["label"].ne("excluded").to_numpy()
    out["planted_p"] = p
    out["y"] = pd.array(np.where(assessed, y, pd.NA), dtype="Int8")
    out["label"] = np.where(assessed, np.where(y == 1, "MET", "Non-MET"), out["label"])
    return out


def planted_summary(
    labelled: pd.DataFrame, held_out_rows: Sequence[Any], rule: Any
) -> dict[str, Any]:
    """What the control's labels are: the rule (its numbers), the mean P*, the planted MET share,
    how often a planted label agrees with the real one, and the rule's expected AUC (on every
    labelled row and on `held_out_rows`, the rows of arrangements no model trains on)."""
    held = labelled["row_id"].isin(set(held_out_rows)).to_numpy()
    texts = labelled["description"].astype(str).tolist()
    score, p = planted_score(texts, rule), labelled["planted_p"].to_numpy(float)
    feats = planted_features(texts)
    return {
        "rule": rule.model_dump(),
        "rows": len(labelled),
        "mean_p": float(labelled["planted_p"].mean()),
        "met_share": float(labelled["y"].astype(float).mean()),
        "agrees_with_observed": float(
            (labelled["y"].astype(int) == labelled["y_observed"].astype(int)).mean()
        ),
        "expected_auc": expected_auc(p, score),
        "held_out_rows": int(held.sum()),
        "held_out_expected_auc": expected_auc(p[held], score[held]) if held.any() else math.nan,
        "feature_shares": {k: float(v) for k, v in feats[list(FEATURES)].mean().items()},
    }
