"""Every interval and test of the study in one place: bootstrap and cluster-bootstrap intervals
(`intervals`: with the cluster-robust t interval and the verdict with an equivalence margin),
paired comparisons with Holm's adjustment (`paired`), bootstrap by weights for
classification metrics (`weighted`), rates with Wilson intervals and clustered trend tests
(`rates`), correlations with intervals (`correlation`), variance components, minimum detectable effects
and the evaluation's design (`power`), and training seeds as replications (`replications`).
Imports nothing of the study's.
"""

from .correlation import corr, spearman, spearman_ci
from .intervals import (
    basic_ci,
    bm_df,
    bootstrap_ci,
    bootstrap_reps,
    bound_verdict,
    check_alpha,
    ci_sign,
    cluster_bootstrap,
    cluster_t,
    contrast_bootstrap,
    family_alpha,
    interval_p,
    level,
    mean_ci,
    null_bound,
    percentile_ci,
    sign_of,
    stat_ci,
    tail_resamples,
)
from .paired import (
    holm,
    paired_comparison,
    paired_table,
    per_prompt_means,
    prompt_clusters,
    summarise_policies,
)
from .power import (
    COMPONENTS,
    allocate,
    choose_design,
    component_table,
    design_grid,
    design_se,
    mde,
    paired_differences,
    variance_components,
)
from .rates import rate_by, rate_heterogeneity, rate_shift, rate_trend, wilson_z
from .replications import MAX_SEEDS, replicated_gain, satterthwaite_df, seeds_for_mde
from .weighted import (
    bootstrap_weights,
    weighted_auc,
    weighted_ece,
    weighted_rates,
    within_group_auc,
)

__all__ = [
    "COMPONENTS",
    "MAX_SEEDS",
    "allocate",
    "basic_ci",
    "bm_df",
    "bootstrap_ci",
    "bootstrap_reps",
    "bootstrap_weights",
    "bound_verdict",
    "check_alpha",
    "choose_design",
    "ci_sign",
    "cluster_bootstrap",
    "cluster_t",
    "contrast_bootstrap",
    "component_table",
    "corr",
    "design_grid",
    "design_se",
    "family_alpha",
    "holm",
    "interval_p",
    "level",
    "mde",
    "mean_ci",
    "null_bound",
    "paired_comparison",
    "paired_differences",
    "paired_table",
    "per_prompt_means",
    "percentile_ci",
    "prompt_clusters",
    "rate_by",
    "rate_heterogeneity",
    "rate_shift",
    "rate_trend",
    "replicated_gain",
    "satterthwaite_df",
    "seeds_for_mde",
    "sign_of",
    "spearman",
    "spearman_ci",
    "stat_ci",
    "summarise_policies",
    "tail_resamples",
    "variance_components",
    "weighted_auc",
    "weighted_ece",
    "weighted_rates",
    "wilson_z",
    "within_group_auc",
]
