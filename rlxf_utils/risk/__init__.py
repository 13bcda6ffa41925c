"""The paper's risks, measured (notebook 05).

The paper (IMF WP/24/114) names the pitfalls of RLXF without measuring them: historical data may
carry biases and outdated assumptions, the model may overgeneralise, a backward-looking reward
may resist policy innovation, and RL may amplify all of it. Each risk becomes a number here:

1. **Backward-looking bias / drift** (`drift_by_year`, `base_rate_by_year`): the temporal
   protocol's reward model (trained up to the cut-off) scored on each later year, next to the MET
   base rate of every year (label shift).
2. **Group bias / overgeneralisation** (`group_metrics`, `group_bias_table`, `country_swap`):
   accuracy, AUC, calibration gap and ECE by region, arrangement type and economic area; and how
   much the reward of one condition text moves when only the country changes.
3. **Reward hacking** (`length_reward`, `checkpoint_gains`, `rising_ngrams`): reward against
   response length, training-reward gain against audit-reward gain over checkpoints, and the
   bigrams RL made more frequent.
4. **Diversity collapse** (`area_table`, `within_prompt_diversity`): the economic areas the
   responses fall into (entropy, KL to history, coverage) and the diversity among the samples of
   one prompt.
5. **Label-mapping sensitivity** (`relabel`, `label_sensitivity`): the TF-IDF reward retrained
   under the other MET mappings of `risk.label_mappings`, and how much its ranking of texts
   changes.

One module per family (`drift`, `groups`, `swap`, `hacking`, `diversity`, `labels`), shared
helpers in `common` (binary metrics come from `reward`, intervals from `stats`) and the
orchestration in `stage`; the sentences are the report's (`rlxf_utils.report.risk`): every measure is a
pure function of tables; `run_risk_stage` reads the run dir once and loops over `RISK_FAMILIES`
(one small function per entry of the summary, returning its tables, entry and figures, or a note
on the input it lacks), then writes tables `risk_*`, figures `risk_*` and `risk/summary.json`.
Verdicts are read from intervals at `evaluation.alpha` (see `rlxf_utils.report.risk`).
"""

from .common import (
    HISTORY_PREFIX,
    NON_GENERATED,
    UNTUNED,
    RiskError,
    binary_metrics,
    generated_policies,
    missing_note,
    policy_kind,
    prediction_column,
    tuned_policies,
)
from .diversity import area_table, diversity_changes, per_prompt_distinct, within_prompt_diversity
from .drift import base_rate_by_year, drift_by_year, drift_summary, drift_tests
from .groups import (
    assign_regions,
    group_bias_summary,
    group_bias_table,
    group_metrics,
    load_regions,
    pool_small_groups,
)
from .hacking import checkpoint_gains, final_gains, length_reward, rising_ngrams, word_tokens
from .labels import label_sensitivity, mapping_statuses, relabel
from .stage import RISK_FIGURES, RiskStage, run_risk_stage
from .swap import choose_swap_countries, country_swap, swap_summary

__all__ = [
    "HISTORY_PREFIX",
    "NON_GENERATED",
    "RISK_FIGURES",
    "UNTUNED",
    "RiskError",
    "RiskStage",
    "area_table",
    "assign_regions",
    "base_rate_by_year",
    "binary_metrics",
    "checkpoint_gains",
    "choose_swap_countries",
    "country_swap",
    "diversity_changes",
    "drift_by_year",
    "drift_summary",
    "drift_tests",
    "final_gains",
    "generated_policies",
    "group_bias_summary",
    "group_bias_table",
    "group_metrics",
    "label_sensitivity",
    "length_reward",
    "load_regions",
    "mapping_statuses",
    "missing_note",
    "per_prompt_distinct",
    "policy_kind",
    "pool_small_groups",
    "prediction_column",
    "relabel",
    "rising_ngrams",
    "run_risk_stage",
    "swap_summary",
    "tuned_policies",
    "within_prompt_diversity",
    "word_tokens",
]
