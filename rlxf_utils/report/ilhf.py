"""The ILHF section's words: inclusiveness (cross-entropy of history, diversity) against the
comparators, and what the history run learned."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from rlxf_utils.algorithms import ILHF_ALGORITHMS, algorithm_label
from rlxf_utils.artifacts import RunDir
from rlxf_utils.evaluation.ilhf import HISTORY, MEASURES, TEST_COLUMNS
from rlxf_utils.report.evaluation import eval_meta, table_note
from rlxf_utils.report.wording import (
    ci,
    is_present,
    listing,
    markdown_table,
    num,
    phrase,
    say,
    verdict_code,
)
from rlxf_utils.stats import level

_QUESTION = {
    "pairwise_sim": "pairwise similarity",
    "reward": "Ave(R)",
    "xent_met": "cross-entropy, nats per token",
}


def _ran(algos: Sequence[str]) -> list[str]:
    return [a for a in algos if a in ILHF_ALGORITHMS]


def inclusive_sentences(tables: Mapping[str, pd.DataFrame], algos: Sequence[str], start: str,
                        alpha: float) -> dict[str, str]:  # fmt: skip
    """The section's verdicts as sentences (no final full stop): `variety`, `reward` and
    `population` (each ILHF algorithm against PPO, `sft_met` and the start policy on pairwise
    similarity, Ave(R) and held-out MET cross-entropy), `verdicts` (the three in one paragraph,
    or the one sentence saying no ILHF algorithm ran), `collapse` (PPO against the start policy
    on pairwise similarity) and `history` (the history references' and the start policy's
    numbers, the yardstick). Every verb is the vocabulary's phrase (`wording.phrase`) of a verdict read from an interval; a run without
    an ILHF algorithm or without PPO says so."""
    lvl = level(alpha)
    tests = tables.get("eval_inclusive_tests")
    tests = tests if tests is not None else pd.DataFrame(columns=TEST_COLUMNS)
    table = tables.get("eval_inclusive")
    ran = _ran(algos)
    out: dict[str, str] = {}
    if not ran:
        none = (
            f"No ILHF algorithm ran: this run trained {listing([algorithm_label(a) for a in algos])}, "
            "so whether inclusive learning keeps the population's variety, and at what reward, is "
            "not answered here"
        )
        out.update(variety=none, reward=none, population=none)
    else:
        for measure, key in (("pairwise_sim", "variety"), ("reward", "reward"),
                             ("xent_met", "population")):  # fmt: skip
            parts = []
            for a in ran:
                t = tests[(tests["measure"] == measure) & (tests["policy"] == a)]
                if t.empty:
                    parts.append(f"{algorithm_label(a)} was not compared on this measure")
                    continue
                groups: dict[str, list[str]] = {}  # comparators with one verdict share its verb
                for _, r in t.iterrows():
                    groups.setdefault(verdict_code(r["verdict"]), []).append(
                        f"{algorithm_label(r['versus'])} ({ci(r['diff'], r['low'], r['high'], signed=True)})"
                    )
                parts.append(f"{algorithm_label(a)} " + "; it ".join(
                    f"{phrase('ilhf_' + measure, v)} {listing(who)}" for v, who in groups.items()))  # fmt: skip
            out[key] = (
                f"{'; '.join(parts)} (difference in {_QUESTION[measure]}, {lvl} cluster-bootstrap "
                "CI over countries)"
            )
    c = tests[(tests["measure"] == "pairwise_sim") & (tests["policy"] == "ppo")]
    if "ppo" not in algos:
        out["collapse"] = "PPO did not run, so whether it narrows the variety of one prompt's samples is not measured here"  # fmt: skip
    elif c.empty:
        out["collapse"] = "PPO's samples were not compared with the start policy's"
    else:
        r = c.iloc[0]
        word = say("collapse", r["low"], r["high"])
        out["collapse"] = (
            f"PPO's samples of one prompt are {word} those of {algorithm_label(r['versus'])} "
            f"(difference in pairwise similarity {ci(r['diff'], r['low'], r['high'], signed=True)}, {lvl} "
            "cluster-bootstrap CI over countries)"
        )
    out["history"] = _history_sentence(table, start)
    out["verdicts"] = (
        f"Variety: {out['variety']}. Reward: {out['reward']}. Closeness to the population: "
        f"{out['population']}"
        if ran
        else out["variety"]
    )
    return out


def _history_sentence(table: pd.DataFrame | None, start: str) -> str:
    """The yardstick: pairwise similarity (with its CI) and area entropy of the history
    references and of the start policy, from `eval_inclusive`."""
    if table is None or table.empty:
        return "No policy was measured for variety"
    t = table.set_index("policy")
    names = {"history_met": "real MET descriptions of the same contexts",
             "history_nonmet": "real Non-MET ones", start: f"the start policy {start}"}  # fmt: skip
    parts = [
        f"{names[p]} {num(t.loc[p, 'pairwise_sim'])} [{num(t.loc[p, 'pairwise_sim_low'])}, "
        f"{num(t.loc[p, 'pairwise_sim_high'])}], {num(t.loc[p, 'area_entropy'])} nats"
        for p in (*HISTORY, start)
        if p in t.index
    ]
    if not parts:
        return "No history reference was measured for variety"
    return (
        "For scale (mean pairwise similarity of one prompt's samples [CI]; entropy of their "
        "economic areas): " + "; ".join(parts)
    )


def ilhf_markdown(tables: Mapping[str, pd.DataFrame], algos: Sequence[str], start: str,
                  alpha: float) -> str:  # fmt: skip
    """The section's verdicts as a markdown list (notebook 04)."""
    s = inclusive_sentences(tables, algos, start, alpha)
    if not _ran(algos):
        return f"- {s['variety']}.\n- **Does PPO collapse the variety?** {s['collapse']}.\n- {s['history']}."
    return "\n".join([
        f"- **Does ILHF keep the population's variety?** {s['variety']}.",
        f"- **At what reward?** {s['reward']}.",
        f"- **Closer to the population (held-out MET descriptions)?** {s['population']}.",
        f"- **Does PPO collapse the variety?** {s['collapse']}.",
        f"- {s['history']}.",
    ])  # fmt: skip


ILHF_TABLES = ("eval_inclusive", "eval_inclusive_tests")


def _ilhf_ran_sentence(algos: list[str], params: dict[str, Any]) -> str:
    ran = [algorithm_label(a) for a in algos]
    ilhf = [a for a in algos if a in ILHF_ALGORITHMS]
    if not ilhf:
        return (
            f"This run trained {listing(ran)}; no ILHF algorithm ran, so only the other policies' "
            "variety is measured below"
        )
    m = int(params.get("ilhf", {}).get("particles", 1))
    each = "each " if len(ilhf) > 1 else ""
    ens = (
        f"{each}an ensemble of {m} LoRA particles (a particle drawn per prompt answers it; the "
        "mixture of all scores a text)"
        if m > 1
        else f"{each}a single LoRA adapter (one particle)"
    )
    return (
        f"This run trained {listing(ran)}; the ILHF {'ones are' if len(ilhf) > 1 else 'one is'} "
        f"{listing([algorithm_label(a) for a in ilhf])}, {ens}"
    )


def departures_sentence(params: dict[str, Any]) -> str:
    """Where this run's ILHF is not the paper's Algorithm 2, from its parameters."""
    ic = params.get("ilhf", {})
    eta = ic.get("prior_reg", 1.0)
    if ic.get("prior_scaling", "map") == "paper":
        pull = (f"The pull towards each particle's initial weights is the paper's, "
                f"η‖φ − φ₀‖² with η = {eta:g} added to every minibatch's mean loss")  # fmt: skip
    else:
        pull = (f"Where we depart from the paper: the pull towards each particle's initial weights "
                f"is η/N‖φ − φ₀‖² (η = {eta:g}, N the pairs of one epoch: "
                f"{ic.get('history_max_pairs', 256)} at most in history mode, the step's pairs online), "
                "the MAP reading of η for a summed loss, where Algorithm 2 adds η‖φ − φ₀‖² to each "
                "minibatch's loss; its φ is not our LoRA weights, so η's scale does not carry over "
                "as such (`ilhf.prior_scaling: paper` runs the paper's)")  # fmt: skip
    particles = int(ic.get("particles", 1))
    ens = (f"{particles} particles, where the paper uses 10 to 50" if particles > 1
           else "one particle: plain ILHF, unperturbed and without bootstrap weights")  # fmt: skip
    return (
        f"{pull}. The ensemble has {ens}. Three properties of history mode follow from the data, "
        "not from a choice: its MET-over-Non-MET labels are certain (P = 1), so @eq-ilhf has no "
        "finite optimum there and the margin grows until the pull and the step count stop it; its "
        "P = 1/2 pairs are two different conditions of one context, so they push the two "
        "descriptions' summed log-likelihoods together, which rewards neither's content but "
        "their lengths; and nothing is sampled in history mode, so Thompson sampling has nothing "
        "to act on there"
    )


def ilhf_section(run: RunDir, params: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The ILHF section: each policy's variety (pairwise similarity, area entropy and KL to the
    history, distinct-2) and held-out MET cross-entropy beside its Ave(R), and the verdicts of
    each ILHF algorithm against PPO, `sft_met` and the start policy, read from notebook 04's
    tables; every verb comes from an interval (`inclusive_sentences`). A run without an
    ILHF algorithm says so; a run dir older than these tables says so instead of failing."""

    stage = "notebook 04_evaluation"
    algos, start, alpha = eval_meta(run, params, stage)
    lvl = level(alpha)
    variables: dict[str, Any] = {"level": lvl, "start": start,
                                 "ran_sentence": _ilhf_ran_sentence(algos, params),
                                 "departures_sentence": departures_sentence(params)}  # fmt: skip
    missing = [t for t in ILHF_TABLES if not run.exists(f"tables/{t}.csv")]
    if missing:
        note = (
            f"This run directory predates the ILHF evaluation (no {', '.join(f'tables/{t}.csv' for t in missing)}); "
            f"rerun {stage} to produce it"
        )  # fmt: skip
        short = f"Not in this run directory, which predates the ILHF evaluation (rerun {stage})"
        keys = ("variety", "reward", "population", "verdicts", "collapse", "history")
        variables.update({f"{k}_sentence": short for k in keys})
        return variables, {"ilhf_table.md": table_note(note), "ilhf_tests.md": table_note(note)}
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
        tests_md = table_note(f"No comparison was made: {sentences['variety']}")
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
