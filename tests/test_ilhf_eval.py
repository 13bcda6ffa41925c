"""The ILHF evaluation (`evaluation.ilhf`): cross-entropy of held-out MET descriptions, variety against
the history of the same contexts, verdicts from intervals, the report section. Synthetic frames
and a bag-of-words encoder stand in for the models."""

from __future__ import annotations

import functools
import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from rlxf_utils.artifacts import RunDir
from rlxf_utils.evaluation.ilhf import (
    ilhf_figures,
    ilhf_tables,
    pairwise_similarity,
    xent_difference,
    xent_met,
)
from rlxf_utils.report.ilhf import ilhf_markdown, inclusive_sentences
from rlxf_utils.report.wording import ABOVE, BELOW, UNCLEAR, phrase
from rlxf_utils.stats import level

N_PROMPTS, K, N_COUNTRIES = 20, 3, 10
ALGOS = ["ppo", "grpo", "ilhf_history"]
SFT_AREAS = ["fiscal", "fiscal", "monetary", "financial"]


def bag_of_words(texts):
    """Fixed vectors: counts of each word over a vocabulary of every word seen so far (a text's
    vector never depends on the other texts of the call: the vocabulary only grows)."""
    for t in texts:
        for w in str(t).split():
            VOCAB.setdefault(w, len(VOCAB))
    out = np.zeros((len(texts), 512))
    for i, t in enumerate(texts):
        for w in str(t).split():
            out[i, VOCAB[w]] += 1.0
    return out / np.linalg.norm(out, axis=1, keepdims=True)


VOCAB: dict[str, int] = {}


def _response(pol: str, p: int, j: int) -> str:
    if pol == "ppo":
        return f"same answer p{p}"  # every sample of a prompt the same: similarity 1
    if pol == "ilhf_history":
        return f"ilhf{p}x{j}"  # one distinct word each: similarity 0
    if pol.startswith("history"):
        return f"{pol} h{p}x{j}"  # share one word of two: 1/2
    return f"{pol} p{p} s{j}"  # share two words of three: 2/3


def _samples(n_history_met: int = K) -> pd.DataFrame:
    """Prompt p of country C{p % 10}. Rewards: sft 0.5 (+ a small per-prompt wave), sft_met +0.05,
    ILHF +0.10, PPO ILHF's plus a per-country amount averaging zero, GRPO sft's."""
    rows = []
    for p in range(N_PROMPTS):
        c = p % N_COUNTRIES
        base = 0.5 + 0.02 * math.sin(p)
        for pol in ["sft", "sft_met", *ALGOS, "best_of_n", "history_met", "history_nonmet"]:
            k = (
                1
                if pol == "best_of_n"
                else (n_history_met if pol == "history_met" and p % 2 else K)
            )
            for j in range(k):
                r = base + {"sft_met": 0.05, "ilhf_history": 0.1, "ppo": 0.1 + 0.01 * (c - 4.5),
                            "history_met": 0.2}.get(pol, 0.0)  # fmt: skip
                area = {"sft": SFT_AREAS[(3 * p + j) % 4], "ppo": "fiscal",
                        "history_met": ["fiscal", "monetary", "trade"][j % 3]}.get(pol, "monetary")  # fmt: skip
                rows.append({"policy": pol, "prompt_id": p, "sample_id": j, "country": f"C{c}",
                             "reward": r, "response": _response(pol, p, j), "top_area": area})  # fmt: skip
    return pd.DataFrame(rows)


def _summary(samples: pd.DataFrame) -> pd.DataFrame:
    per = samples.groupby(["policy", "prompt_id"])["reward"].mean().groupby("policy").mean()
    return pd.DataFrame({"policy": per.index, "n_prompts": N_PROMPTS, "ave_r": per.to_numpy(),
                         "ave_r_low": per.to_numpy() - 0.01, "ave_r_high": per.to_numpy() + 0.01,
                         "kl": 0.5, "distinct_2": 0.7})  # fmt: skip


def _ppl_rows() -> pd.DataFrame:
    """40 held-out rows (even ones MET) of country C{(r // 2) % 10}; per token, ILHF is 0.5 nats below
    sft everywhere, PPO ILHF's plus a per-country amount averaging zero, sft_met 0.2 below sft."""
    rng = np.random.default_rng(0)
    rows = []
    for r in range(40):
        c, n = (r // 2) % N_COUNTRIES, 5 + r % 4
        sft = n * (3.0 + rng.normal(0, 0.3))
        nll = {"base": sft + 2 * n, "sft": sft, "sft_met": sft - 0.2 * n,
               "ilhf_history": sft - 0.5 * n, "ppo": sft - 0.5 * n + 0.1 * (c - 4.5) * n,
               "grpo": sft}  # fmt: skip
        for pol, v in nll.items():
            rows.append({"policy": pol, "row": r, "country": f"C{c}", "y": int(r % 2 == 0),
                         "nll": v, "n_tokens": n})  # fmt: skip
    return pd.DataFrame(rows)


def _tables(algos=ALGOS, alpha: float = 0.05, n_history_met: int = K) -> dict[str, pd.DataFrame]:
    """`ilhf_tables` on the synthetic frames (computed once per arguments; copies returned)."""
    return {k: v.copy() for k, v in _computed(tuple(algos), alpha, n_history_met).items()}


@functools.cache
def _computed(algos: tuple[str, ...], alpha: float, n_history_met: int) -> dict[str, pd.DataFrame]:
    samples = _samples(n_history_met)
    keep = ["sft", "sft_met", *algos, "best_of_n", "history_met", "history_nonmet"]
    samples = samples[samples.policy.isin(keep)]
    ppl = _ppl_rows()
    ppl = ppl[ppl.policy.isin(["base", "sft", "sft_met", *algos])]
    return ilhf_tables(
        samples, _summary(samples), ppl, list(algos), "sft", 400, alpha, 0, bag_of_words
    )


def test_xent_met_and_its_difference_by_hand() -> None:
    rows = pd.DataFrame({"policy": ["a", "a", "a", "b", "b", "b"], "row": [0, 1, 2] * 2,
                         "country": ["X", "Y", "X"] * 2, "y": [1, 1, 0] * 2,
                         "nll": [10.0, 6.0, 99.0, 8.0, 4.0, 1.0], "n_tokens": [4, 2, 7] * 2})  # fmt: skip
    xe = xent_met(rows)
    assert xe["a"] == pytest.approx(16 / 6) and xe["b"] == pytest.approx(12 / 6)  # MET rows only
    d = xent_difference(rows, "a", "b", 200, 0.05, 0)
    assert d["diff"] == pytest.approx(4 / 6) and d["n"] == 2 and d["n_clusters"] == 2
    # cluster t on the difference's linearisation (issue 59, item 5; the percentile bootstrap of
    # the ratio gave [0.5, 1]): by hand, with R_a = 16/6, R_b = 2 and 3 tokens a row on average,
    # row 0 carries 4/6 + (10 - 4 R_a) / 3 - (8 - 4 R_b) / 3 = 4/9 and row 1 4/6 + 2/9 = 8/9; two
    # countries of one row each: the one-sample t on 1 df, half-width t(0.975, 1) x (8/9 - 4/9) / 2
    half = stats.t.ppf(0.975, 1) * (2 / 9)
    assert (d["low"], d["high"]) == pytest.approx((4 / 6 - half, 4 / 6 + half))
    t = _tables()["eval_inclusive"].set_index("policy")
    ppl = _ppl_rows()
    met = ppl[(ppl.y == 1) & (ppl.policy == "sft_met")]
    assert t.loc["sft_met", "xent_met"] == pytest.approx(met.nll.sum() / met.n_tokens.sum())
    assert t.loc["sft_met", "xent_met_vs_start"] == pytest.approx(-0.2)
    assert t.loc["ilhf_history", "xent_met_vs_start"] == pytest.approx(-0.5)
    assert t.loc["ilhf_history", "xent_met_vs_start_high"] == pytest.approx(-0.5)  # every country
    assert t.loc["sft", "xent_met_vs_start"] == 0.0 and t.loc["sft", "n_met_rows"] == 20
    assert t.loc[["history_met", "history_nonmet"], "xent_met"].isna().all()  # no density


def test_pairwise_similarity_is_one_for_identical_samples_and_lower_for_distinct_ones() -> None:
    samples = _samples(n_history_met=1)
    sims = pairwise_similarity(samples, ["sft", "ppo", "ilhf_history", "history_met"],
                                         bag_of_words)  # fmt: skip
    by = sims.groupby("policy")["pairwise_sim"]
    assert np.allclose(by.get_group("ppo"), 1.0)
    assert np.allclose(by.get_group("sft"), 2 / 3) and np.allclose(
        by.get_group("ilhf_history"), 0.0
    )
    # history_met has one description on odd prompts: only the even prompts have a pair
    assert sorted(sims.loc[sims.policy == "history_met", "prompt_id"]) == list(range(0, 20, 2))
    assert "best_of_n" not in set(sims["policy"])
    t = _tables(n_history_met=1)["eval_inclusive"].set_index("policy")
    assert t.loc["ppo", "pairwise_sim"] == pytest.approx(1.0)
    assert t.loc["ilhf_history", "pairwise_sim"] == pytest.approx(0.0, abs=1e-12)
    assert t.loc["history_met", "n_prompts_sim"] == 10 and t.loc["sft", "n_prompts_sim"] == 20
    with pytest.raises(ValueError, match="one embedding row per text"):
        pairwise_similarity(samples, ["sft"], lambda texts: np.ones((1, 3)))


def test_area_entropy_and_kl_from_history_by_hand() -> None:
    t = _tables()["eval_inclusive"].set_index("policy")
    # sft: fiscal 1/2, monetary 1/4, financial 1/4 (60 responses)
    assert t.loc["sft", "area_entropy"] == pytest.approx(
        -(0.5 * math.log(0.5) + 0.5 * math.log(0.25))
    )
    assert t.loc["ppo", "area_entropy"] == 0.0  # one area only
    # KL(history || policy) with half a response added per area, over the four areas seen
    areas = ["financial", "fiscal", "monetary", "trade"]
    hist = (
        np.array([0, 20, 20 + 60, 20], float) + 0.5
    )  # history_met: fiscal/monetary/trade; nonmet: monetary
    ppo = np.array([0, 60, 0, 0], float) + 0.5
    p, q = hist / hist.sum(), ppo / ppo.sum()
    assert len(areas) == 4 and t.loc["ppo", "area_kl_to_history"] == pytest.approx(
        float((p * np.log(p / q)).sum())
    )
    assert t.loc["ppo", "area_kl_to_history"] > t.loc["sft", "area_kl_to_history"] > 0


def test_table_rows_and_columns() -> None:
    tables = _tables()
    t = tables["eval_inclusive"]
    assert t["policy"].tolist() == ["sft", "sft_met", "ppo", "grpo", "ilhf_history", "history_met",
                                    "history_nonmet"]  # fmt: skip
    assert t.set_index("policy").loc["ilhf_history", "label"] == "ILHF (history)"
    assert t["reward_sd"].isna().all()  # the summary has none
    s = _summary(_samples()).set_index("policy")
    assert np.allclose(t.set_index("policy")["ave_r"], s.loc[t["policy"], "ave_r"])
    samples = _samples()
    summary = _summary(samples).assign(reward_sd=0.1)
    with_sd = ilhf_tables(samples, summary, _ppl_rows(), ALGOS, "sft", 50, 0.05, 0,
                                    bag_of_words)["eval_inclusive"]  # fmt: skip
    assert (with_sd["reward_sd"] == 0.1).all()


def test_verdicts_follow_the_intervals() -> None:
    tests = _tables()["eval_inclusive_tests"]
    g = tests.set_index(["measure", "policy", "versus"])
    pairs = {(a, b) for _, a, b in g.index}
    assert pairs == {("ilhf_history", v) for v in ("ppo", "sft_met", "sft")} | {("ppo", "sft")}
    # a clear positive: ILHF is 0.10 above sft on every prompt
    r = g.loc[("reward", "ilhf_history", "sft")]
    assert r["diff"] == pytest.approx(0.1) and r["low"] > 0 and r["verdict"] == "above"
    # a null: PPO differs from ILHF by per-country amounts averaging zero
    r = g.loc[("reward", "ilhf_history", "ppo")]
    assert r["low"] < 0 < r["high"] and r["verdict"] == "not distinguishable"
    assert r["n"] == 20 and r["n_clusters"] == 10
    assert g.loc[("pairwise_sim", "ilhf_history", "ppo"), "verdict"] == "below"  # more varied
    assert g.loc[("pairwise_sim", "ppo", "sft"), "verdict"] == "above"  # PPO collapses
    assert g.loc[("xent_met", "ilhf_history", "sft"), "verdict"] == "below"
    assert g.loc[("xent_met", "ilhf_history", "ppo"), "verdict"] == "not distinguishable"
    assert g.loc[("xent_met", "ilhf_history", "sft"), "n"] == 20  # the MET rows, paired
    md = ilhf_markdown(_tables(), ALGOS, "sft", 0.05)  # each verb the phrase of its verdict code
    for key, code in (("ilhf_pairwise_sim", BELOW), ("ilhf_reward", UNCLEAR), ("ilhf_reward", ABOVE),
                      ("ilhf_xent_met", BELOW), ("collapse", ABOVE)):  # fmt: skip
        assert phrase(key, code) in md, (key, code)
    assert "PPO (-1.000" in md and "SFT (+0.100 [+0.100, +0.100])" in md
    # the verb follows the interval, not the point estimate: SFT joins the unclear comparators
    fake = _tables()
    t = fake["eval_inclusive_tests"]
    sel = (t.measure == "reward") & (t.policy == "ilhf_history") & (t.versus == "sft")
    t.loc[sel, ["diff", "low", "high", "verdict"]] = [0.08, -0.01, 0.17, "not distinguishable"]
    unclear, clear = inclusive_sentences(fake, ALGOS, "sft", 0.05)["reward"].split("; it ")
    assert phrase("ilhf_reward", UNCLEAR) in unclear and "SFT (+0.080 [-0.010, +0.170])" in unclear
    assert phrase("ilhf_reward", ABOVE) in clear and "SFT on MET rows (" in clear


def test_markdown_says_when_no_ilhf_algorithm_ran() -> None:
    tables = _tables(["ppo", "grpo"])
    assert set(tables["eval_inclusive_tests"]["policy"]) == {"ppo"}  # PPO vs start only
    md = ilhf_markdown(tables, ["ppo", "grpo"], "sft", 0.05)
    assert "PPO and GRPO" in md.splitlines()[0] and phrase("collapse", ABOVE) in md
    none = _tables(["grpo"])
    assert none["eval_inclusive_tests"].empty
    s = inclusive_sentences(none, ["grpo"], "sft", 0.05)
    assert s["verdicts"] == s["variety"] == s["reward"] == s["population"]  # the one 'none ran'
    assert "GRPO" in s["variety"] and "PPO" in s["collapse"] and "GRPO" not in s["collapse"]


def test_figure_has_every_policy_and_the_history_lines() -> None:
    import matplotlib

    matplotlib.use("Agg")
    tables = _tables()
    fig = ilhf_figures(tables, "sft", 0.1)["eval_inclusive"]
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels[:5] == ["SFT", "SFT on MET rows", "PPO", "GRPO", "ILHF (history)"]
    assert "history (MET)" in labels and "history (MET) (no density)" in labels
    assert "90% CI" in fig._suptitle.get_text()


def _eval_run(tmp_path, algos, with_tables: bool = True) -> RunDir:
    run = RunDir(tmp_path / "run")
    run.write_json("eval/summary.json", {"algorithms": algos, "start_policy": "sft", "alpha": 0.1})
    if with_tables:
        for name, df in _tables(algos, alpha=0.1).items():
            run.write_table(name, df)
    return run


def test_report_section_reads_the_tables(tmp_path) -> None:
    import re

    from rlxf_utils.config import PROJECT_ROOT
    from rlxf_utils.report.ilhf import ilhf_section

    v, inc = ilhf_section(_eval_run(tmp_path, ALGOS), {"ilhf": {"particles": 3}})
    assert v["level"] == "90%" and v["start"] == "SFT"
    assert "PPO, GRPO and ILHF (history);" in v["ran_sentence"] and " 3 " in v["ran_sentence"]
    assert phrase("ilhf_pairwise_sim", BELOW) in v["verdicts_sentence"]
    # the tests' intervals are at their family's level, 1 - alpha / m, and the words say so
    # (issue 59, item 5: the sentence said the plain 90% of a cluster bootstrap)
    tests = RunDir(tmp_path / "run").read_table("eval_inclusive_tests")
    fam = level(1 - float(tests["ci_level"].iloc[0]))
    assert fam != v["level"] and v["tests_level"] == fam
    assert f"{fam} simultaneous cluster t CI" in v["collapse_sentence"]
    assert f"{fam} simultaneous cluster t CI" in v["reward_sentence"]
    rows = [r for r in inc["ilhf_table.md"].splitlines() if r.startswith("| ")]
    assert [r.split("|")[1].strip() for r in rows[1:]] == [
        "SFT", "SFT on MET rows", "PPO", "GRPO", "ILHF (history)", "history (MET)", "history (Non-MET)"]  # fmt: skip
    assert r"pairwise similarity \[90% CI\]" in rows[0] and "reward SD" not in rows[0]
    assert "lower" in inc["ilhf_tests.md"] and "pairwise similarity" in inc["ilhf_tests.md"]
    assert rf"difference \[{fam} CI\]" in inc["ilhf_tests.md"]
    # every variable the report source quotes is provided, every include is generated
    qmd = (PROJECT_ROOT / "reports/rlxf_report.qmd").read_text(encoding="utf-8")
    used = set(re.findall(r"\{\{< var ilhf\.(\w+) >\}\}", qmd))
    assert used and used <= set(v)
    assert set(re.findall(r"_generated/(ilhf_\w+\.md)", qmd)) == set(inc)


def test_report_section_without_ilhf_or_without_tables(tmp_path) -> None:
    from rlxf_utils.report.ilhf import ilhf_section

    v, inc = ilhf_section(_eval_run(tmp_path / "a", ["ppo", "grpo"]), {})
    assert "PPO and GRPO;" in v["ran_sentence"]
    assert (
        v["verdicts_sentence"] == v["variety_sentence"] and "PPO and GRPO" in v["variety_sentence"]
    )
    assert "ILHF" not in inc["ilhf_table.md"]
    v, inc = ilhf_section(_eval_run(tmp_path / "b", ["ilhf_history"], with_tables=False), {})
    stale = {
        v[f"{k}_sentence"]
        for k in ("variety", "reward", "population", "verdicts", "collapse", "history")
    }
    assert len(stale) == 1 and "04_evaluation" in stale.pop()
    for md in inc.values():
        assert md.startswith("| note |") and "tables/eval_inclusive.csv" in md


def test_an_ilhf_algorithm_meets_a_comparator_only_at_comparable_kl() -> None:
    """ILHF (history) far from PPO in KL (0.6 against 9 nats): its tests against PPO leave the
    family (and are listed as unmatched pairs), those against SFT on MET rows (0.8) and the
    start policy stay; without a ratio every pair is tested, as before."""
    from rlxf_utils.evaluation.ilhf import comparator_pairs, inclusive_tests, pairwise_similarity
    from rlxf_utils.evaluation.questions import unmatched_pairs

    samples = _samples(K)
    samples = samples[samples.policy.isin(["sft", "sft_met", *ALGOS])]
    sims = pairwise_similarity(samples, ["sft", "sft_met", *ALGOS], bag_of_words)
    kl = {"ilhf_history": 0.6, "ppo": 9.0, "sft_met": 0.8, "sft": 0.0}
    every = inclusive_tests(samples, _ppl_rows(), sims, ALGOS, "sft", 100, 0.05, 0)
    matched = inclusive_tests(samples, _ppl_rows(), sims, ALGOS, "sft", 100, 0.05, 0, kl, 2.0)
    assert "ppo" in set(every.loc[every.policy == "ilhf_history", "versus"])
    assert set(matched.loc[matched.policy == "ilhf_history", "versus"]) == {"sft_met", "sft"}
    assert matched["ci_level"].iloc[0] < every["ci_level"].iloc[0]  # smaller family, 1 - a / m
    left = unmatched_pairs(comparator_pairs(samples, ALGOS), kl, 2.0)
    assert list(zip(left.policy, left.versus, strict=True)) == [("ilhf_history", "ppo")]
