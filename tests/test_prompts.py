from __future__ import annotations

import pandas as pd
import pytest

from rlxf_utils.prompts import (
    PAPER_PROMPT_TEMPLATE,
    build_policy_prompt,
    econ_area,
    serialize_condition,
    serialize_frame,
)

CTX = {
    "country": "KENYA",
    "arrangement_type": "ECF",
    "econ_descriptor": "1.2. Revenue administration, including customs",
}


def test_serialisation_uses_only_the_four_paper_fields() -> None:
    row = {
        **CTX,
        "status": "NM",
        "comments": "missed by a day",
        "test_date": "2010",
        "label": "Non-MET",
    }
    s = serialize_condition(row, "Adopt  a new\ncustoms code.")
    assert s == (
        "Country: KENYA. Arrangement: ECF. Area: 1.2. Revenue administration, including customs. "
        "Condition: Adopt a new customs code."
    )
    for leak in ("NM", "missed", "2010", "Non-MET"):
        assert leak not in s


def test_frame_and_single_serialisation_agree() -> None:
    df = pd.DataFrame(
        [{**CTX, "description": "Adopt the law."}, {**CTX, "country": "GHANA", "description": "x"}]
    )
    assert serialize_frame(df) == [
        serialize_condition(r, r["description"]) for r in df.to_dict("records")
    ]
    with pytest.raises(KeyError, match="lacks columns"):
        serialize_frame(df.drop(columns="country"))
    with pytest.raises(KeyError, match="context lacks"):
        serialize_condition({"country": "X"}, "t")


def test_policy_prompt_is_the_papers_template() -> None:
    p = build_policy_prompt(CTX, PAPER_PROMPT_TEMPLATE)
    assert p.startswith("Given the economic indicators and historical performance of Kenya, ")
    assert "under the ECF for achieving revenue administration, including customs?" in p
    assert p.endswith("Describe the proposed condition.")
    with pytest.raises(KeyError, match="unknown field"):
        build_policy_prompt(CTX, "{nope}")


def test_econ_area() -> None:
    assert (
        econ_area("11.4. Anti-corruption legislation/policy")
        == "anti-corruption legislation/policy"
    )
    assert econ_area("Central Bank") == "central Bank"


def test_model_inputs_refuse_outcome_columns() -> None:
    """The pipeline's serialiser will not read an outcome column as the condition text."""
    df = pd.DataFrame(
        [{**CTX, "description": "Adopt the law.", "Comments": "met on time", "status": "M"}]
    )
    assert serialize_frame(df) == [serialize_condition(CTX, "Adopt the law.")]
    for column in ("Comments", "status"):  # any case
        with pytest.raises(ValueError, match="outcome fields"):
            serialize_frame(df, text_column=column)
