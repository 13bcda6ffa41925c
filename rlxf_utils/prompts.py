"""The one place where a (context, condition text) pair becomes model input.

`serialize_condition` is used identically to train the reward model and to score generated
text; it takes only the paper's four fields, so status, comments and test date can never leak
into the reward. `build_policy_prompt` fills the paper's RL prompt template.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pandas as pd

__all__ = [
    "CONTEXT_FIELDS",
    "FORBIDDEN_FIELDS",
    "PAPER_PROMPT_TEMPLATE",
    "build_policy_prompt",
    "check_no_forbidden",
    "response_contexts",
    "serialize_condition",
    "serialize_frame",
]

#: The context of a condition: what RL cannot change.
CONTEXT_FIELDS: tuple[str, str, str] = ("country", "arrangement_type", "econ_descriptor")


def response_contexts(prompt_ids: Any, contexts: Any) -> list[dict[str, Any]]:
    """The reward model's context (`CONTEXT_FIELDS`) of each response, from its prompt's index
    into `contexts`."""
    return [{k: contexts[i][k] for k in CONTEXT_FIELDS} for i in prompt_ids]


#: Columns written after (or stating) the outcome; they must never reach a model input.
FORBIDDEN_FIELDS: frozenset[str] = frozenset(
    {"comments", "status", "status_raw", "label", "y", "test_date", "test_year"}
)

PAPER_PROMPT_TEMPLATE = (
    "Given the economic indicators and historical performance of {country}, what would be an "
    "appropriate policy proposal under the {arrangement_type} for achieving {econ_area}? "
    "Describe the proposed condition."
)


def _clean(value: Any) -> str:
    if value is None or (isinstance(value, float) and pd.isna(value)):
        return ""
    return " ".join(str(value).split())


def serialize_condition(context: Mapping[str, Any], text: str) -> str:
    """Reward-model input for one condition: the three context fields, then the condition text.

    `context` must hold `country`, `arrangement_type` and `econ_descriptor`; any other key is
    ignored, so a whole MONA row may be passed without leaking its outcome fields.
    """
    missing = [f for f in CONTEXT_FIELDS if f not in context]
    if missing:
        raise KeyError(f"context lacks {missing}; expected keys {list(CONTEXT_FIELDS)}")
    return (
        f"Country: {_clean(context['country'])}. "
        f"Arrangement: {_clean(context['arrangement_type'])}. "
        f"Area: {_clean(context['econ_descriptor'])}. "
        f"Condition: {_clean(text)}"
    )


def serialize_frame(df: pd.DataFrame, text_column: str = "description") -> list[str]:
    """Serialise every row of a conditions table (context columns + `text_column`).

    `text_column` naming an outcome field (e.g. `comments`) is refused: it would feed the label
    to the model (`check_no_forbidden`).
    """
    cols = [*CONTEXT_FIELDS, text_column]
    check_no_forbidden(cols)
    missing = [c for c in cols if c not in df.columns]
    if missing:
        raise KeyError(f"table lacks columns {missing}; found {list(df.columns)}")
    return [
        serialize_condition(dict(zip(CONTEXT_FIELDS, rec[:3], strict=True)), rec[3])
        for rec in df[cols].itertuples(index=False, name=None)
    ]


def econ_area(descriptor: str) -> str:
    """The readable part of a MONA economic descriptor: '1.2. Revenue administration' -> 'revenue administration'."""
    text = _clean(descriptor)
    head, _, rest = text.partition(" ")
    if rest and head.rstrip(".").replace(".", "").isdigit():
        text = rest
    return text[:1].lower() + text[1:] if text else text


def build_policy_prompt(context: Mapping[str, Any], template: str = PAPER_PROMPT_TEMPLATE) -> str:
    """Fill the RL prompt template from a context; `{econ_area}` is the readable descriptor."""
    values = {
        "country": _clean(context["country"]).title(),
        "arrangement_type": _clean(context["arrangement_type"]),
        "econ_area": econ_area(context["econ_descriptor"]),
        "econ_descriptor": _clean(context["econ_descriptor"]),
    }
    try:
        return template.format(**values)
    except KeyError as exc:
        raise KeyError(
            f"prompt template uses unknown field {exc}; allowed: {sorted(values)}"
        ) from None


def build_policy_prompts(
    contexts: Iterable[Mapping[str, Any]], template: str = PAPER_PROMPT_TEMPLATE
) -> list[str]:
    return [build_policy_prompt(c, template) for c in contexts]


def check_no_forbidden(columns: Sequence[str]) -> None:
    """Raise if any model-input column is an outcome field (the Comments rule and its kin).

    Called wherever model inputs are assembled from table columns (`serialize_frame`,
    `reward.protocol.run_protocol`), case-insensitively.
    """
    bad = sorted({c.lower() for c in columns} & FORBIDDEN_FIELDS)
    if bad:
        raise ValueError(
            f"model-input columns {list(columns)} include outcome fields {bad}; outcome fields "
            "(prompts.FORBIDDEN_FIELDS) must never be model inputs"
        )
