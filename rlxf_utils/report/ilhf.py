"""The ILHF section: inclusiveness (cross-entropy of history, diversity) against the comparators,
and what the history run learned. This module reads notebook 04's tables and the run's
parameters and builds each sentence's context (numbers, verdict codes, policy ids); the words
are the author's, in `reports/templates/ilhf.jinja`."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from rlxf_utils.algorithms import ILHF_ALGORITHMS, algorithm_label
from rlxf_utils.artifacts import RunDir
from rlxf_utils.evaluation.ilhf import HISTORY, MEASURES, TEST_COLUMNS
from rlxf_utils.markdown import is_present, markdown_table
from rlxf_utils.report.evaluation import eval_meta, table_note
from rlxf_utils.report.wording import ci, num, phrase, sentence, verdict_code
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


def inclusive_sentences(tables: Mapping[str, pd.DataFrame], algos: Sequence[str], start: str,
                        alpha: float) -> dict[str, str]:  # fmt: skip
    """The section's verdicts as sentences (no final full stop): `variety`, `reward` and
    `population` (each ILHF algorithm against PPO, `sft_met` and the start policy on pairwise
    similarity, Ave(R) and held-out MET cross-entropy), `verdicts` (the three in one paragraph,
    or the one sentence saying no ILHF algorithm ran), `collapse` (PPO against the start policy
    on pairwise similarity) and `history` (the history references' and the start policy's
    numbers, the yardstick). Every verb is the vocabulary's phrase of a verdict read from an
    interval; a run without an ILHF algorithm or without PPO says so."""
    lvl = level(alpha)
    tests = tables.get("eval_inclusive_tests")
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
    variables: dict[str, Any] = {"level": lvl, "start": start,
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

    def cell(r: pd.Series, col: str, signed: bool = False) -> str:
        if not is_present(r[col]):
            return "·"
        lo, hi = r.get(f"{col}_low", math.nan), r.get(f"{col}_high", math.nan)
        if is_present(lo) and is_present(hi):
            return ci(r[col], lo, hi, signed=signed)
        return num(r[col], signed=signed)

    with_sd = t["reward_sd"].notna().any()
    rows = [
        {"policy": r["label"], f"Ave(R) [{lvl} CI]": cell(r, "ave_r"),
         **({f"reward SD [{lvl} CI]": cell(r, "reward_sd")} if with_sd else {}),
         "KL (nats)": f"{r['kl']:.2f}" if is_present(r["kl"]) else "·",
         "MET cross-entropy": cell(r, "xent_met"),
         f"vs {start} [{lvl} CI]": cell(r, "xent_met_vs_start", signed=True),
         "area entropy": cell(r, "area_entropy"), "area KL from history": cell(r, "area_kl_to_history"),
         "distinct-2": cell(r, "distinct_2"),
         f"pairwise similarity [{lvl} CI]": cell(r, "pairwise_sim")}
        for _, r in t.iterrows()
    ]  # fmt: skip
    tests = tables["eval_inclusive_tests"]
    if tests.empty:
        tests_md = table_note(_say("no_tests_note", sentences))
    else:
        tt = tests.assign(
            measure=tests["measure"].map(MEASURES),
            policy=tests["policy"].map(algorithm_label),
            versus=tests["versus"].map(algorithm_label),
            **{f"difference [{lvl} CI]": [ci(a, b, c, signed=True) for a, b, c in zip(tests["diff"], tests["low"], tests["high"], strict=True)]},
        )  # fmt: skip
        tests_md = markdown_table(
            tt[["measure", "policy", "versus", "n", "n_clusters", f"difference [{lvl} CI]",
                "verdict"]].assign(verdict=tt["verdict"].map(lambda v: phrase("direction", v)))
            .rename(columns={"n": "units", "n_clusters": "countries"})
        )  # fmt: skip
    return variables, {
        "ilhf_table.md": markdown_table(pd.DataFrame(rows)),
        "ilhf_tests.md": tests_md,
    }
