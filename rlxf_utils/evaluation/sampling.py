"""Sampling every policy on the held-out prompts and scoring what it wrote: responses, the reward
and audit models' scores, and the judge log-probabilities the KL needs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from rlxf_utils.models.logprobs import sequence_logprobs
from rlxf_utils.models.policies import PolicySet
from rlxf_utils.prompts import response_contexts
from rlxf_utils.reward.uncertainty import RewardHeads, add_reward_sd


def sample_tuned(pset: PolicySet, name: str, prompts: Sequence[str], k: int, gen_kw: Mapping[str, Any],
                 logprob_batch: int, desc: str, judges: bool = True) -> pd.DataFrame:  # fmt: skip
    """k responses per prompt from policy `name`, with their log-probs under it, under the start
    policy (`logp_ref`) and under the zero-shot base (`logp_base`); `judges=False` skips the last two."""
    df = pset.generate(name, prompts, k, desc, gen_kw)
    df["logp_policy"] = policy_frame_logprobs(pset, name, df, logprob_batch)
    if judges:
        add_judge_logprobs(pset, df, name, logprob_batch)
    return df


def add_judge_logprobs(pset: PolicySet, df: pd.DataFrame, name: str, batch: int) -> pd.DataFrame:
    """Columns `logp_ref` (start policy) and `logp_base` (zero-shot base) for generated rows."""
    for col, judge in (("logp_ref", "start"), ("logp_base", "base")):
        if name == judge or (judge == "start" and name == pset.start_name):  # the same model
            df[col] = df["logp_policy"]
            continue
        with pset.use(judge) as m:
            df[col] = frame_logprobs(m, pset.tok, df, batch)
    return df


def add_rewards(df: pd.DataFrame, contexts: Sequence[Mapping[str, Any]], reward_model: Any,
                audit_model: Any, batch: int,
                heads: RewardHeads | None = None) -> pd.DataFrame:  # fmt: skip
    """Columns `reward` and `audit_reward`: each response scored in its prompt's context; and
    `reward_sd`, the reward heads' SD of P(MET) from the same pass (NaN without `heads`)."""
    if heads is None:
        df["reward"] = _score(df, contexts, reward_model, batch)
    add_reward_sd(df, contexts, reward_model, heads, batch)
    df["audit_reward"] = _score(df, contexts, audit_model, batch)
    return df


def _score(
    samples: pd.DataFrame, contexts: Sequence[Mapping[str, Any]], model: Any, batch: int
) -> np.ndarray:
    ctx = response_contexts(samples["prompt_id"], contexts)
    return np.asarray(model.score(ctx, samples["response"].tolist(), batch_size=batch), dtype=float)


def policy_frame_logprobs(
    pset: PolicySet, name: str, df: pd.DataFrame, batch_size: int
) -> np.ndarray:
    lp, _ = pset.sequence_logprobs(name, df["prompt_ids"].tolist(), df["response_ids"].tolist(),
                                   batch_size, padding_side="left")  # fmt: skip
    return lp


def frame_logprobs(model: Any, tok: Any, df: pd.DataFrame, batch_size: int) -> np.ndarray:
    lp, _ = sequence_logprobs(
        model, tok, df["prompt_ids"].tolist(), df["response_ids"].tolist(),
        batch_size=batch_size, padding_side="left",
    )  # fmt: skip
    return lp
