"""Families of paired comparisons between policies (the RLGF questions, RL against the offline
methods): each question a family under each measure, one multiplicity rule for all; two methods
are compared pairwise only at comparable KL to the start policy (`kl_matched`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import pandas as pd

from rlxf_utils.stats import bound_verdict, paired_comparison, per_prompt_means, prompt_clusters

#: The columns of `question_comparisons`.
QUESTION_COLUMNS = ["question", "measure", "policy", "versus", "n", "n_clusters", "diff", "low",
                    "high", "verdict", "p_family", "ci_level", "bound", "mde", "kl",
                    "kl_versus"]  # fmt: skip

#: KL (nats per response) below which two policies count as equally close to the start policy
#: whatever their ratio: half a nat is within the evaluation's own noise of a 48-prompt KL.
KL_FLOOR = 0.5

#: The columns of `unmatched_pairs`.
UNMATCHED_COLUMNS = ["question", "policy", "versus", "kl", "kl_versus", "ratio"]


def kl_matched(kl_a: float, kl_b: float, ratio: float | None) -> bool:
    """Whether two policies are at comparable KL to the start policy: the larger KL at most
    `ratio` times the smaller, each counted as at least `KL_FLOOR` nats (`ratio` None: every pair
    is; a missing KL: not matched). A pair far apart in KL compares two points of different
    reward-KL trade-offs, not two methods (Gao et al., 2022): it is compared along the frontier
    and against best-of-N at each one's own KL instead."""
    if ratio is None:
        return True
    if not all(isinstance(k, (int, float)) and math.isfinite(k) for k in (kl_a, kl_b)):
        return False
    lo, hi = sorted((max(float(kl_a), KL_FLOOR), max(float(kl_b), KL_FLOOR)))
    return hi <= ratio * lo


def policy_kls(summary: pd.DataFrame) -> dict[str, float]:
    """Each policy's KL to the start policy (the evaluation summary's `kl`, nats per response);
    empty for a summary without it (then every pair is compared)."""
    return summary.set_index("policy")["kl"].astype(float).to_dict() if "kl" in summary else {}


def unmatched_pairs(
    pairs: Sequence[tuple[str, str, str]], kl: Mapping[str, float], ratio: float | None
) -> pd.DataFrame:
    """The (question, policy, versus) pairs `kl_matched` leaves out, with both KLs and their
    ratio (each at least `KL_FLOOR`)."""
    rows = []
    for q, a, b in pairs:
        ka, kb = kl.get(a, math.nan), kl.get(b, math.nan)
        if not kl_matched(ka, kb, ratio):
            fa, fb = max(ka, KL_FLOOR), max(kb, KL_FLOOR)
            rows.append({"question": q, "policy": a, "versus": b, "kl": ka, "kl_versus": kb,
                         "ratio": max(fa, fb) / min(fa, fb)})  # fmt: skip
    return pd.DataFrame(rows, columns=UNMATCHED_COLUMNS)


def question_comparisons(
    samples: pd.DataFrame,
    pairs: Sequence[tuple[str, str, str]],
    n_boot: int,
    alpha: float,
    seed: int,
    measures: Sequence[str] = ("reward", "audit_reward"),
    kl: Mapping[str, float] | None = None,
    kl_ratio: float | None = None,
) -> pd.DataFrame:
    """(question, policy, versus) comparisons under each measure, of the pairs at comparable KL
    (`kl`: each policy's KL to the start policy; pairs `kl_matched` at `kl_ratio` are compared,
    the rest left to `unmatched_pairs` and out of the families; `kl` None: every pair, as
    before). Per pair: per-prompt mean rewards on the
    prompts both answered, difference with a cluster t interval over countries
    (`stats.paired.paired_comparison`), `verdict` read from that interval. Each question is a
    family under each measure (`stats.family_alpha`): its m intervals at level 1 - alpha / m
    (`ci_level`), `p_family` below alpha exactly when the verdict is given; `bound`, the largest
    advantage of the policy the interval allows, and `mde`, the family's minimum detectable
    difference at 80% power (`stats.power.mde`), say how large a difference a 'not
    distinguishable' leaves open."""
    kl = dict(kl or {})
    if kl:
        pairs = [(q, a, b) for q, a, b in pairs
                 if kl_matched(kl.get(a, math.nan), kl.get(b, math.nan), kl_ratio)]  # fmt: skip
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
                         "bound": res["bound"], "mde": res["mde"],
                         "kl": kl.get(a, math.nan), "kl_versus": kl.get(b, math.nan)})  # fmt: skip
    return pd.DataFrame(rows)[QUESTION_COLUMNS]
