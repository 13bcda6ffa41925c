"""Sampling every policy on the held-out prompts and scoring what it wrote: responses, the reward
and audit models' scores, and the judge log-probabilities the KL needs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from rlxf_utils.models.generation import LOGP_DRAWN
from rlxf_utils.models.logprobs import sequence_logprobs
from rlxf_utils.models.policies import PolicySet
from rlxf_utils.prompts import response_contexts
from rlxf_utils.reward.model import serialize_inputs
from rlxf_utils.reward.uncertainty import RewardHeads, add_reward_sd


def sample_tuned(pset: PolicySet, name: str, prompts: Sequence[str], k: int, gen_kw: Mapping[str, Any],
                 logprob_batch: int, desc: str, judges: bool = True) -> pd.DataFrame:  # fmt: skip
    """k responses per prompt from policy `name`, with their log-probs under it, under the start
    policy (`logp_ref`) and under the zero-shot base (`logp_base`); `judges=False` skips the last two.

    The policy's own log-probs come from the sampling pass where it computed them (`generate`'s
    `logp_drawn`: draws from the model's own softmax), else from a pass of their own: an ILHF
    ensemble's density is its mixture's, not the particle's that answered."""
    df = pset.generate(name, prompts, k, desc, gen_kw)
    drawn = df.pop(LOGP_DRAWN) if LOGP_DRAWN in df else None
    if drawn is not None and name not in pset.particles:
        df["logp_policy"] = drawn.to_numpy(dtype=np.float64)
    else:
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


#: `evaluation.cut_responses`: how a response still cut at the evaluation cap is scored.
CUT_RULES = ("as_written", "failed")
#: The judges' columns the cut rule sets (each keeps its as-written score in `<col>_as_written`).
JUDGED = ("reward", "audit_reward", "planted")  # planted: the control's P*, where a run has one


def add_rewards(df: pd.DataFrame, contexts: Sequence[Mapping[str, Any]], reward_model: Any,
                audit_model: Any, batch: int, heads: RewardHeads | None = None,
                cut_responses: str = "as_written") -> pd.DataFrame:  # fmt: skip
    """Columns `reward` and `audit_reward`: each response scored in its prompt's context, then
    the cut rule (`apply_cut_rule`, `evaluation.cut_responses`); `reward_sd`, the reward heads'
    SD of P(MET) from the same pass (NaN without `heads`; of the text as written, whatever the
    rule); and `reward_truncated`, whether the reward model's input (context and text) was
    longer than its `max_length`, so that it scored the text's beginning only."""
    if heads is None:
        df["reward"] = _score(df, contexts, reward_model, batch)
    add_reward_sd(df, contexts, reward_model, heads, batch)
    df["audit_reward"] = _score(df, contexts, audit_model, batch)
    df["reward_truncated"] = reward_input_truncated(df, contexts, reward_model)
    return apply_cut_rule(df, cut_responses)


def apply_cut_rule(df: pd.DataFrame, rule: str) -> pd.DataFrame:
    """The rule for responses cut at the token cap, fixed before any result is read, applied in
    place to both judges: `reward_as_written` and `audit_reward_as_written` keep the scores of
    the text as it stands; under 'failed' a response whose `finished` is False (it reached the
    cap without an end token) scores P(MET) = 0 under the reward model and the audit, whatever
    its policy, so a cut can never make a gain. Under 'as_written' the scores are the text's.
    Rows without a `finished` value keep their scores (history's real descriptions have one:
    whether the description and its end token fit in the cap, `families.sample_history`)."""
    if rule not in CUT_RULES:
        raise ValueError(f"evaluation.cut_responses={rule!r}; expected one of {list(CUT_RULES)}")
    cut = df["finished"].eq(False).to_numpy() if "finished" in df else np.zeros(len(df), dtype=bool)
    for col in JUDGED:
        if col not in df:
            continue
        df[f"{col}_as_written"] = df[col].astype(float)
        if rule == "failed":
            df[col] = np.where(cut, 0.0, df[f"{col}_as_written"])
    return df


def reward_input_truncated(samples: pd.DataFrame, contexts: Sequence[Mapping[str, Any]],
                           model: Any) -> np.ndarray:  # fmt: skip
    """Per response, whether its serialised reward input is longer than the reward model's
    `max_length` (word pieces: the encoder then scored only its beginning); False for a model
    without a tokenizer and a length (the TF-IDF audit reads every word)."""
    tok, limit = getattr(model, "tokenizer", None), getattr(model, "max_length", None)
    if tok is None or limit is None or samples.empty:
        return np.zeros(len(samples), dtype=bool)
    ctx = response_contexts(samples["prompt_id"], contexts)
    texts = serialize_inputs(ctx, samples["response"].tolist())
    lengths = [len(ids) for ids in tok(texts, truncation=False)["input_ids"]]
    return np.asarray(lengths) > int(limit)


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
