"""Every interval and test of the study in one place: bootstrap and cluster-bootstrap intervals
(`intervals`), paired comparisons with Holm's adjustment (`paired`), bootstrap by weights for
classification metrics (`weighted`), rates with Wilson intervals and clustered trend tests
(`rates`), correlations with intervals (`correlation`). Imports nothing of the study's.
"""

from .correlation import corr, spearman, spearman_ci
from .intervals import (
    basic_ci,
    bootstrap_ci,
    bootstrap_reps,
    check_alpha,
    ci_sign,
    cluster_bootstrap,
    family_alpha,
    interval_p,
    level,
    mean_ci,
    percentile_ci,
    sign_of,
    stat_ci,
)
from .paired import (
    holm,
    paired_comparison,
    paired_table,
    per_prompt_means,
    prompt_clusters,
    summarise_policies,
)
from .rates import rate_by, rate_heterogeneity, rate_shift, rate_trend, wilson_z
from .weighted import (
    bootstrap_weights,
    weighted_auc,
    weighted_ece,
    weighted_rates,
    within_group_auc,
)

__all__ = [
    "basic_ci",
    "bootstrap_ci",
    "bootstrap_reps",
    "bootstrap_weights",
    "check_alpha",
    "ci_sign",
    "cluster_bootstrap",
    "corr",
    "family_alpha",
    "holm",
    "interval_p",
    "level",
    "mean_ci",
    "paired_comparison",
    "paired_table",
    "per_prompt_means",
    "percentile_ci",
    "prompt_clusters",
    "rate_by",
    "rate_heterogeneity",
    "rate_shift",
    "rate_trend",
    "sign_of",
    "spearman",
    "spearman_ci",
    "stat_ci",
    "summarise_policies",
    "weighted_auc",
    "weighted_ece",
    "weighted_rates",
    "wilson_z",
    "within_group_auc",
]
