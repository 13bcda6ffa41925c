"""Families of paired comparisons between policies (the RLGF questions, RL against the offline
methods): each question a family under each measure, one multiplicity rule for all."""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

from rlxf_utils.stats import bound_verdict, paired_comparison, per_prompt_means, prompt_clusters

#: The columns of `question_comparisons`.
QUESTION_COLUMNS = ["question", "measure", "policy", "versus", "n", "n_clusters", "diff", "low",
                    "high", "verdict", "p_family", "ci_level", "bound", "mde"]  # fmt: skip


def question_comparisons(
    samples: pd.DataFrame,
    pairs: Sequence[tuple[str, str, str]],
    n_boot: int,
    alpha: float,
    seed: int,
    measures: Sequence[str] = ("reward", "audit_reward"),
) -> pd.DataFrame:
    """(question, policy, versus) comparisons under each measure: per-prompt mean rewards on the
    prompts both answered, difference with a cluster bootstrap CI over countries
    (`stats.paired.paired_comparison`), `verdict` read from that interval. Each question is a
    family under each measure (`stats.family_alpha`): its m intervals at level 1 - alpha / m
    (`ci_level`), `p_family` below alpha exactly when the verdict is given; `bound`, the largest
    advantage of the policy the interval allows, and `mde`, the family's minimum detectable
    difference at 80% power (`stats.power.mde`), say how large a difference a 'not
    distinguishable' leaves open."""
    if not pairs:
        return pd.DataFrame(columns=QUESTION_COLUMNS)
    cl = prompt_clusters(samples, cluster_col="country")
    sizes = pd.Series([q for q, _, _ in pairs]).value_counts()  # each question's family size
    policies = sorted({p for _, a, b in pairs for p in (a, b)})
    rows = []
    for measure in measures:
        wide = per_prompt_means(samples[samples["policy"].isin(policies)], measure)
        for question, a, b in pairs:
            pair = wide[[a, b]].dropna()
            res = paired_comparison(pair[a].to_numpy(), pair[b].to_numpy(), n_boot, seed, alpha,
                                    clusters=cl.loc[pair.index].to_numpy(),
                                    family_size=int(sizes[question]))  # fmt: skip
            rows.append({"question": question, "measure": measure, "policy": a, "versus": b,
                         "n": res["n"], "n_clusters": res.get("n_clusters", res["n"]),
                         "diff": res["mean_diff"], "low": res["ci_low"], "high": res["ci_high"],
                         "verdict": bound_verdict(res["ci_low"], res["ci_high"]),
                         "p_family": res["p_family"], "ci_level": res["ci_level"],
                         "bound": res["bound"], "mde": res["mde"]})  # fmt: skip
    return pd.DataFrame(rows)[QUESTION_COLUMNS]
