"""The study's parameters: one typed section per stage, validated before any work starts.

`load_config(path)` reads a profile (`params/*.yaml`, which may `extend` another) into a
`StudyConfig`; an unknown key, a wrong type or an impossible value raises `ConfigError` naming the
file, the key and what was expected. Sections: `base` (shared base and errors), `data` (run,
labels, splits), `policy` (policy, LoRA, SFT, RL, RLGF, ILHF), `reward` (reward model, forensic
arm), `study` (evaluation, risk, compute and the whole study), `load` (reading files).
"""

from .base import PROJECT_ROOT, ConfigError, Section, portable_path
from .data import DataChecks, DataConfig, LabelConfig, RunConfig, SplitConfig, SplitProtocol
from .load import PATH_KEYS, load_config
from .policy import (
    CRITIC_INIT,
    ILHFConfig,
    LoraSettings,
    OfflineConfig,
    OptimizerConfig,
    PolicyConfig,
    RLConfig,
    RLGFConfig,
    SFTConfig,
)
from .reward import (
    RESERVED_REWARD_NAMES,
    CompareEncoder,
    ForensicConfig,
    ForensicVariant,
    Precision,
    RewardConfig,
    ScorePrecision,
)
from .study import (
    ComputeConfig,
    EvaluationConfig,
    LabelMapping,
    RiskConfig,
    StudyConfig,
    Table3Scenario,
)

__all__ = [
    "DataChecks",
    "CRITIC_INIT",
    "CompareEncoder",
    "ComputeConfig",
    "ConfigError",
    "DataConfig",
    "EvaluationConfig",
    "ForensicConfig",
    "ForensicVariant",
    "ILHFConfig",
    "OfflineConfig",
    "OptimizerConfig",
    "LabelConfig",
    "LabelMapping",
    "LoraSettings",
    "PATH_KEYS",
    "PROJECT_ROOT",
    "PolicyConfig",
    "Precision",
    "RESERVED_REWARD_NAMES",
    "RLConfig",
    "RLGFConfig",
    "RewardConfig",
    "RiskConfig",
    "RunConfig",
    "SFTConfig",
    "ScorePrecision",
    "Section",
    "SplitConfig",
    "SplitProtocol",
    "portable_path",
    "StudyConfig",
    "Table3Scenario",
    "load_config",
]
