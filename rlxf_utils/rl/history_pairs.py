"""Pairs of historical descriptions of one context, shared by the methods that learn from MONA's
history without a reward model (ILHF from history, `rl.ilhf`; DPO and KTO, `rl.offline`): the
pairs (`history_pairs`), their token ids within a length (`pair_targets`) and each pair's
context prompt (`context_prompts`, `context_prompt_ids`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from rlxf_utils.models.generation import build_prompts, encode_prompts
from rlxf_utils.prompts import CONTEXT_FIELDS
from rlxf_utils.rl.sft import target_ids


def history_pairs(
    rows: pd.DataFrame, max_pairs: int, per_context: int, seed: int, mixed_only: bool = False
) -> pd.DataFrame:
    """Pairs of historical descriptions of one context (`CONTEXT_FIELDS`), from `rows` (already limited
    to what the RL stage may see): `p_a` = 1 when only A was MET, 0 when only B was, 1/2 when
    both share an outcome. Pairs of identical descriptions (MONA repeats a condition across an
    arrangement's reviews) carry no preference between texts and are left out.

    At most `per_context` pairs per context, drawn uniformly among its distinct pairs (with
    `mixed_only`, among its pairs of one MET and one Non-MET description: DPO's), then at most
    `max_pairs` overall (uniformly), A/B order random; seeded.
    """
    missing = [c for c in (*CONTEXT_FIELDS, "row_id", "description", "y") if c not in rows.columns]
    if missing:
        raise KeyError(f"history_pairs: rows lack columns {missing}")
    rng = np.random.default_rng(seed)
    text = rows["description"].astype(str).map(lambda t: " ".join(t.split()))
    frame = rows.assign(_text=text).reset_index(drop=True)
    out: list[dict[str, Any]] = []
    for key, g in frame.groupby(list(CONTEXT_FIELDS), sort=True):
        g = g.drop_duplicates(subset=["_text", "y"])
        idx = g.index.to_numpy()
        if len(idx) < 2:
            continue
        cand = [(i, j) for ai, i in enumerate(idx) for j in idx[ai + 1 :]
                if frame.at[i, "_text"] != frame.at[j, "_text"]
                and not (mixed_only and frame.at[i, "y"] == frame.at[j, "y"])]  # fmt: skip
        if not cand:
            continue
        take = rng.choice(len(cand), size=min(per_context, len(cand)), replace=False)
        for t in sorted(take):
            i, j = cand[t]
            if rng.random() < 0.5:
                i, j = j, i
            ya, yb = int(frame.at[i, "y"]), int(frame.at[j, "y"])
            out.append({**dict(zip(CONTEXT_FIELDS, key, strict=True)),
                        "row_a": int(frame.at[i, "row_id"]), "row_b": int(frame.at[j, "row_id"]),
                        "text_a": frame.at[i, "_text"], "text_b": frame.at[j, "_text"],
                        "y_a": ya, "y_b": yb,
                        "p_a": 0.5 if ya == yb else float(ya > yb)})  # fmt: skip
    pairs = pd.DataFrame(
        out, columns=[*CONTEXT_FIELDS, "row_a", "row_b", "text_a", "text_b", "y_a", "y_b", "p_a"]
    )
    if len(pairs) > max_pairs:
        pairs = pairs.iloc[np.sort(rng.choice(len(pairs), size=max_pairs, replace=False))]
    return pairs.reset_index(drop=True)


def pair_targets(
    pairs: pd.DataFrame, tokenizer: Any, model: Any, max_tokens: int, n: int, seed: int
) -> tuple[pd.DataFrame, list[list[int]], list[list[int]]]:
    """`n` of the pairs whose two descriptions (tokens + end token, `sft.target_ids`) both fit in
    `max_tokens` (all of them when fewer fit; else drawn uniformly, seeded, in their order), with
    those token ids."""
    a_ids = target_ids(pairs["text_a"], tokenizer, model)
    b_ids = target_ids(pairs["text_b"], tokenizer, model)
    fits = np.flatnonzero([len(a) <= max_tokens and len(b) <= max_tokens
                           for a, b in zip(a_ids, b_ids, strict=True)])  # fmt: skip
    if len(fits) > n:  # not the first n: `history_pairs` orders its pairs by context
        fits = np.sort(np.random.default_rng(seed).choice(fits, size=n, replace=False))
    kept = pairs.iloc[fits].reset_index(drop=True)
    return kept, [a_ids[i] for i in fits], [b_ids[i] for i in fits]


def context_areas(contexts: pd.DataFrame) -> pd.Series:
    """Each context's economic area (`data/contexts.parquet`), indexed by `CONTEXT_FIELDS`."""
    return contexts.set_index(list(CONTEXT_FIELDS))["econ_area"]


def context_prompts(frame: pd.DataFrame, areas: pd.Series, tokenizer: Any, cfg: Any) -> list[str]:
    """The RL prompt of each row's context (`CONTEXT_FIELDS`, area from `areas`), formatted."""
    records = [{**{k: r[k] for k in CONTEXT_FIELDS}, "econ_area": areas.get(tuple(r[k] for k in CONTEXT_FIELDS), "")}
               for r in frame.to_dict("records")]  # fmt: skip
    return build_prompts(records, tokenizer, cfg.rl.prompt_template, cfg.policy)


def context_prompt_ids(
    frame: pd.DataFrame, areas: pd.Series, tokenizer: Any, cfg: Any
) -> list[list[int]]:
    """Token ids of `context_prompts` (`encode_prompts`)."""
    prompts = context_prompts(frame, areas, tokenizer, cfg)
    return [list(p) for p in encode_prompts(tokenizer, prompts)["input_ids"]] if prompts else []
