"""The ILHF section: inclusiveness (cross-entropy of history, diversity) against the comparators,
and what the history run learned. This module reads notebook 04's tables and the run's
parameters and builds each sentence's context (numbers, verdict codes, policy ids); the words
are the author's, in `reports/templates/ilhf.jinja`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from rlxf_utils.algorithms import ILHF_ALGORITHMS
from rlxf_utils.artifacts import RunDir
from rlxf_utils.evaluation.ilhf import HISTORY, MEASURES, TEST_COLUMNS
from rlxf_utils.report.evaluation import eval_meta, table_note
from rlxf_utils.report.wording import display_name, sentence, table, verdict_code
from rlxf_utils.stats import level

#: The verdicts' sentences: (measure of `eval_inclusive_tests`, sentence key).
_VERDICTS = (("pairwise_sim", "variety"), ("reward", "reward"), ("xent_met", "population"))


def _say(name: str, c: Mapping[str, Any]) -> str:
    return sentence("ilhf", name, c)


def _ran(algos: Sequence[str]) -> list[str]:
    return [a for a in algos if a in ILHF_ALGORITHMS]


def _groups(t: pd.DataFrame) -> list[list[Any]]:
    """[verdict code, [versus, diff, low, high]] in the order the codes first occur: the
    comparators with one verdict share its verb."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in t.to_dict("records"):
        groups.setdefault(verdict_code(r["verdict"]), []).append(
            {k: r[k] for k in ("versus", "diff", "low", "high")}
        )
    return [[code, rows] for code, rows in groups.items()]


def tests_level(tests: pd.DataFrame | None, alpha: float) -> str:
    """The level of the ILHF tests' intervals ('99.2%'): their family's (`ci_level` of
    `eval_inclusive_tests`, 1 - alpha / m), 1 - `alpha` for a table without it."""
    if tests is None or "ci_level" not in tests or tests["ci_level"].dropna().empty:
        return level(alpha)
    return level(1 - float(tests["ci_level"].dropna().iloc[0]))


def inclusive_sentences(tables: Mapping[str, pd.DataFrame], algos: Sequence[str], start: str,
                        alpha: float) -> dict[str, str]:  # fmt: skip
    """The section's verdicts as sentences (no final full stop): `variety`, `reward` and
    `population` (each ILHF algorithm against PPO, `sft_met` and the start policy on pairwise
    similarity, Ave(R) and held-out MET cross-entropy), `verdicts` (the three in one paragraph,
    or the one sentence saying no ILHF algorithm ran), `collapse` (PPO against the start policy
    on pairwise similarity) and `history` (the history references' and the start policy's
    numbers, the yardstick). Every verb is the vocabulary's phrase of a verdict read from an
    interval, at the tests' family level (`tests_level`); a run without an ILHF algorithm or
    without PPO says so."""
    tests = tables.get("eval_inclusive_tests")
    lvl = tests_level(tests, alpha)
    tests = tests if tests is not None else pd.DataFrame(columns=TEST_COLUMNS)
    ran = _ran(algos)
    out: dict[str, str] = {}
    if not ran:
        none = _say("none_ran", {"algos": list(algos)})
        out.update(variety=none, reward=none, population=none)
    for measure, key in _VERDICTS if ran else ():
        t = tests[tests["measure"] == measure]
        policies = [{"policy": a, "groups": _groups(t[t["policy"] == a])} for a in ran]
        out[key] = _say(
            "measure_sentence", {"measure": measure, "level": lvl, "policies": policies}
        )
    c = tests[(tests["measure"] == "pairwise_sim") & (tests["policy"] == "ppo")]
    out["collapse"] = _say("collapse", {
        "ppo": "ppo" in algos, "level": lvl,
        "collapse": {k: c.iloc[0][k] for k in ("versus", "diff", "low", "high")} if len(c) else None,
    })  # fmt: skip
    out["history"] = _say(
        "history", {"start": start, "history": _history(tables.get("eval_inclusive"), start)}
    )
    out["verdicts"] = _say("verdicts", {"ran": bool(ran), **out})
    return out


def _history(table: pd.DataFrame | None, start: str) -> list[dict[str, Any]] | None:
    """The yardstick's rows of `eval_inclusive` (the history references, then the start policy):
    pairwise similarity with its CI and area entropy; None where no policy was measured."""
    if table is None or table.empty:
        return None
    cols = ["policy", "pairwise_sim", "pairwise_sim_low", "pairwise_sim_high", "area_entropy"]
    t = table.set_index("policy", drop=False)
    return [t.loc[p, cols].to_dict() for p in (*HISTORY, start) if p in t.index]


def ilhf_markdown(tables: Mapping[str, pd.DataFrame], algos: Sequence[str], start: str,
                  alpha: float) -> str:  # fmt: skip
    """The section's verdicts as a markdown list (notebook 04)."""
    s = inclusive_sentences(tables, algos, start, alpha)
    items = ("variety_item", "reward_item", "population_item") if _ran(algos) else ("none_item",)
    return "\n".join(_say(i, s) for i in (*items, "collapse_item", "history_item"))


ILHF_TABLES = ("eval_inclusive", "eval_inclusive_tests")


def ilhf_section(run: RunDir, params: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The ILHF section: each policy's variety (pairwise similarity, area entropy and KL to the
    history, distinct-2) and held-out MET cross-entropy beside its Ave(R), and the verdicts of
    each ILHF algorithm against PPO, `sft_met` and the start policy, read from notebook 04's
    tables; every verb comes from an interval (`inclusive_sentences`). A run without an
    ILHF algorithm says so; a run dir older than these tables says so instead of failing."""

    stage = "notebook 04_evaluation"
    algos, start, alpha = eval_meta(run, params, stage)
    lvl = level(alpha)
    ic = params.get("ilhf", {})
    setup = {"algos": algos, "ilhf": _ran(algos), "particles": int(ic.get("particles", 1)),
             "paper_prior": ic.get("prior_scaling", "map") == "paper",
             "eta": ic.get("prior_reg", 1.0), "max_pairs": ic.get("history_max_pairs", 256)}  # fmt: skip
    variables: dict[str, Any] = {"level": lvl, "tests_level": lvl, "start": display_name(start),
                                 "ran_sentence": _say("ran_sentence", setup),
                                 "departures_sentence": _say("departures_sentence", setup)}  # fmt: skip
    missing = [t for t in ILHF_TABLES if not run.exists(f"tables/{t}.csv")]
    if missing:
        note = table_note(_say("stale_note", {"missing": missing, "stage": stage}))
        short = _say("stale_sentence", {"stage": stage})
        keys = ("variety", "reward", "population", "verdicts", "collapse", "history")
        variables.update({f"{k}_sentence": short for k in keys})
        return variables, {"ilhf_table.md": note, "ilhf_tests.md": note}
    tables = {t: run.read_table(t, stage) for t in ILHF_TABLES}
    sentences = inclusive_sentences(tables, algos, start, alpha)
    variables.update({f"{k}_sentence": v for k, v in sentences.items()})
    t = tables["eval_inclusive"]

    tests = tables["eval_inclusive_tests"]
    if tests.empty:
        tests_md = table_note(_say("no_tests_note", sentences))
    else:
        variables["tests_level"] = tests_level(tests, alpha)
        tests_md = table("ilhf_tests", tests, lvl=variables["tests_level"], measures=MEASURES)
    return variables, {
        "ilhf_table.md": table(
            "ilhf_table", t, lvl=lvl, start=start, with_sd=bool(t["reward_sd"].notna().any())
        ),  # fmt: skip
        "ilhf_tests.md": tests_md,
    }
