"""Parameters of the reward model: the encoder and the encoders compared, protocols, calibration,
precision, and the forensic arm."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from rlxf_utils.config.base import Section

#: Model names a compared encoder may not take: notebook 02's own columns (`p_<name>`).
RESERVED_REWARD_NAMES = ("encoder", "tfidf", "majority", "context_only", "text_only")


#: 'auto': 'bf16' where the device runs bf16 natively, else 'fp32' (`config.precision`, resolved
#: when the parameters are read).
Precision = Literal["fp32", "bf16", "auto"]


ScorePrecision = Literal["fp32", "bf16", "int8", "auto"]


class CompareEncoder(Section):
    """One more encoder fine-tuned and reported beside `reward.encoder` (notebook 02, the report).

    Unset training settings are the main encoder's (`reward.*`). Its test predictions are
    `p_<name>` in `reward/predictions_<protocol>.parquet`; `reward.reward_source: <name>` makes it
    the RL reward (it must then be trained on `reward.reward_protocol`).
    """

    name: str = Field(pattern=r"^[a-z][a-z0-9_]*$")
    """Short name in tables and columns (`p_<name>`); not one of notebook 02's own model names."""
    encoder: str = Field(min_length=1)
    """'embedded:mpnet' (the PyPI-packaged all-mpnet-base-v2), 'embedded:minilm', a hub id or a
    path"""
    protocols: list[Literal["random", "grouped", "temporal"]] | None = None
    """Protocols to train it on (null: every protocol in reward.protocols)."""
    max_length: int | None = Field(default=None, ge=8, le=512)
    """Tokens per input (null: `reward.max_length`)."""
    epochs: float | None = Field(default=None, gt=0)
    """Upper bound on training epochs (null: `reward.epochs`)."""
    batch_size: int | None = Field(default=None, gt=0)
    """Examples per step (null: `reward.batch_size`)."""
    learning_rate: float | None = Field(default=None, gt=0, lt=1)
    """Its own learning rate (null: `reward.learning_rate`)."""
    evals_per_epoch: int | None = Field(default=None, ge=1)
    """Validation checks per epoch (null: `reward.evals_per_epoch`)."""
    early_stopping_patience: int | None = Field(default=None, ge=1)
    """Checks without improvement before stopping (null: `reward.early_stopping_patience`)."""
    freeze_embeddings: bool | None = None
    """Freeze the embedding layer (null: `reward.freeze_embeddings`)."""
    freeze_layers: int | None = Field(default=None, ge=0)
    """Freeze the lowest layers (null: `reward.freeze_layers`)."""
    train_precision: Precision | None = None
    """Training precision (null: `reward.train_precision`)."""

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

    encoder: str = Field(default="embedded:minilm", min_length=1)
    """'embedded:minilm' (the PyPI-packaged all-MiniLM-L6-v2), 'embedded:mpnet', a hub id or a
    path"""
    compare_encoders: list[CompareEncoder] = Field(default_factory=list)
    """More encoders trained on the same splits and reported beside `encoder`."""
    max_length: int = Field(default=128, ge=8, le=512)
    """Tokens per serialised condition (longer ones are truncated)."""
    epochs: float = Field(default=3.0, gt=0)
    """Upper bound on training epochs; early stopping keeps the best validation checkpoint."""
    batch_size: int = Field(default=32, gt=0)
    """Examples per optimiser step."""
    learning_rate: float = Field(default=1e-4, gt=0, lt=1)
    """AdamW learning rate of the encoder."""
    learning_rate_grid: list[float] = Field(default_factory=list)
    """>1 value: pick on validation"""
    weight_decay: float = Field(default=0.01, ge=0)
    """AdamW weight decay."""
    warmup_ratio: float = Field(default=0.1, ge=0, lt=1)
    """Share of the steps with a linear learning-rate warm-up."""
    class_weighting: Literal["none", "balanced"] = "balanced"
    """'balanced': a class-balanced loss with prior-corrected logits; 'none': the plain loss."""
    early_stopping_patience: int | None = Field(default=2, ge=1)
    """Evaluations without gain."""
    evals_per_epoch: int = Field(default=1, ge=1)
    """Validation checks per epoch (checkpoint selection and early stopping)."""
    selection_metric: Literal["roc_auc", "nll", "accuracy", "f1"] = "roc_auc"
    """What picks the checkpoint on the selection half of the validation slice."""
    freeze_embeddings: bool = True
    """Freeze the embedding layer (faster, less overfitting)."""
    freeze_layers: int = Field(default=0, ge=0)
    """Lowest encoder layers kept frozen (speed)."""
    group_by_length: bool = True
    """Length-grouped batches with dynamic padding (faster)."""
    calibrate: bool = True
    """Platt scaling on the validation slice: a temperature and an offset
    (`reward.calibration.fit_platt`)."""
    ece_bins: int = Field(default=10, ge=2)
    """Bins of the expected calibration error and the reliability diagram."""
    score_batch_size: int = Field(default=64, gt=0)
    """Texts per scoring batch."""
    train_precision: Precision = "fp32"
    """Encoder fine-tuning arithmetic: fp32, or bf16 autocast (CPU avx512_bf16 / GPU). bf16 trains
    in about half the time and was not distinguishable from fp32 in what the encoder learns
    (bench/reward_precision.py; docs/measurements.md); 'auto': bf16 where the device runs it
    natively, else fp32 (an AVX2-only CPU runs bf16 products 55x slower than fp32)."""
    score_precision: ScorePrecision = "fp32"
    """How RL, evaluation and the risk notebook score with the encoder: fp32, bf16 weights, or
    int8 dynamic quantisation of the encoder's linear layers (the classifier head stays fp32);
    'auto': bf16 where the device runs it natively, else fp32. Notebook 02 checks the setting
    against fp32 (`score_tolerance`); bench/reward.py measures each setting's throughput."""
    score_tolerance: float = Field(default=0.02, gt=0, lt=1)
    """Largest |P(MET) - fp32's P(MET)| on the reward protocol's test rows that
    `score_precision` may show; above it notebook 02 warns and the bundle keeps fp32"""
    num_threads: int | None = Field(default=None, ge=1)
    """Torch threads (null: every core; 1 when another job shares the cores)."""
    progress: bool = True
    """Show progress bars while training."""
    tfidf_ngram_max: int = Field(default=2, ge=1, le=3)
    """The TF-IDF model's longest word n-gram."""
    tfidf_min_df: int = Field(default=2, ge=1)
    """The TF-IDF model's minimum document frequency."""
    tfidf_max_features: int | None = Field(default=50000, gt=0)
    """The TF-IDF model's vocabulary cap (null: no cap)."""
    tfidf_c: float = Field(default=1.0, gt=0)
    """Inverse L2 strength of the TF-IDF logistic regression."""
    protocols: list[Literal["random", "grouped", "temporal"]] = Field(
        default_factory=lambda: ["random", "grouped", "temporal"], min_length=1
    )
    """Split protocols every reward model is trained and tested on."""
    reward_protocol: Literal["random", "grouped", "temporal"] = "grouped"
    """Its model feeds RL."""
    reward_source: str = Field(default="encoder", min_length=1)
    """Which model feeds RL: 'encoder' (the paper's choice), 'tfidf', or a compare_encoders name."""

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
    """Run notebook 02's forensic arm (it never feeds RL)."""
    protocol: Literal["random", "grouped", "temporal"] = "random"
    """The paper's: random 20%."""
    variants: list[ForensicVariant] = Field(
        default_factory=lambda: [
            "description", "paper_input", "staff_comments", "dates", "arrangement_id", "combined"
        ],
        min_length=1,
    )  # fmt: skip
    """Inputs the TF-IDF model is trained on, each a variant (the first two: what the paper
    allows)."""
    encoder_variants: list[ForensicVariant] = Field(default_factory=list)
    """Variants also fine-tuned with the reward encoder (minutes each on CPU)."""

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
