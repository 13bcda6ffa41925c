"""Parameters of the run and of the data: identity and seed, the MONA file, its labels and splits."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from rlxf_utils.config.base import Section


class RunConfig(Section):
    """Identity of a run: its name (the folder under runs/), the global seed, the report's title block."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    """The run's folder under `runs/` (letters, digits, `_ . -`; not `.` or `..`)."""
    seed: int = Field(default=20240514, ge=0)
    """The global seed: splits, sampling, LoRA initialisation and every bootstrap derive from
    it."""
    title: str = "Reinforcement Learning from Experience Feedback: a rerun on the IMF MONA database"
    """The report's title."""
    authors: list[str] = Field(default_factory=lambda: ["RLXF study team"])
    """The report's authors."""
    wp_number: str = "WP/24/114 (rerun)"
    """The working-paper number on the report's title block."""

    @field_validator("name")
    @classmethod
    def _plain_folder_name(cls, v: str) -> str:
        if set(v) == {"."}:
            raise ValueError(
                f"{v!r} names no folder of its own (it would make runs/ or the project the run "
                "dir); expected a plain folder name such as 'default' or 'smoke-2024'"
            )
        return v


class LabelConfig(Section):
    """How normalised MONA status codes become labels (the paper: MET = M, PM)."""

    met: list[str] = Field(default_factory=lambda: ["M", "PM"], min_length=1)
    """Normalised status codes labelled MET (the paper: met `M` and partly met `PM`)."""
    not_assessed: list[str] = Field(default_factory=lambda: ["SB", "PC", "PA", ""])
    """Status codes of conditions to be assessed at a later review: not outcomes, excluded."""
    unrecognised: Literal["non_met", "exclude", "error"] = "non_met"
    """A status that is no MONA code (nor spelled out, e.g. 'Not met') and not listed above: the
    paper groups such "others" under Non-MET ('non_met', warned with counts); 'exclude' drops
    them from the labelled rows, 'error' stops the load naming them"""

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
    """Share of each protocol's rows held out as its test set (the paper: 20%)."""
    validation_fraction: float = Field(default=0.1, gt=0.0, lt=1.0)
    """Share carved from each training split for checkpoint selection and calibration."""
    temporal_cutoff_year: int = Field(default=2010, ge=1990, le=2030)
    """Temporal protocol: train on conditions due up to this year, test on later ones."""
    context_eval_fraction: float = Field(default=0.2, gt=0.0, lt=1.0)
    """Share of countries whose prompt contexts are held out from SFT and RL (evaluation's
    prompts)."""
    near_duplicate_threshold: float = Field(default=0.9, gt=0.0, le=1.0)
    """TF-IDF cosine at or above which a test description counts as a near-duplicate of a
    training one."""
    policy_fraction: float = Field(default=0.25, gt=0.0, lt=1.0)
    """Share of the training countries' labelled rows (whole arrangements, from the reward
    protocol's training side) that only the policies learn from: SFT, `sft_met`, the offline
    methods, ILHF's pairs, the MLE references and RL's contexts. No reward model or judge learns
    from them (`data.splits.carve_policy_pool`)."""

    @model_validator(mode="after")
    def _room_for_the_reward_model(self) -> SplitConfig:
        if self.test_fraction + self.policy_fraction >= 1:
            raise ValueError(
                f"test_fraction ({self.test_fraction}) + policy_fraction ({self.policy_fraction}) "
                "leave the reward model no training rows; expected a sum below 1"
            )
        return self


class DataChecks(Section):
    """What a MONA file must look like before any work starts: a wrong column or a wrong export
    (statuses that are no MONA code, empty descriptions, too few rows) stops the run with exit 2
    and what was found. Loosen a threshold here to accept such a file on purpose."""

    max_unrecognised_share: float = Field(default=0.2, ge=0.0, le=1.0)
    """Largest share of rows whose status is no MONA code (the study's vintage has none)."""
    max_empty_description_share: float = Field(default=0.2, ge=0.0, le=1.0)
    """Largest share of rows with an empty condition description."""
    min_labelled_rows: int = Field(default=100, ge=1)
    """Fewest assessed (MET or Non-MET) rows: below it no split has a usable test set."""
    min_rows_per_label: int = Field(default=10, ge=1)
    """Fewest rows of each outcome (a file of one outcome gives a reward model nothing to learn)."""


class PlantedOutcome(Section):
    """The positive control's planted outcome, P*(MET | text) = sigmoid(intercept + strength x z)
    with z the weighted properties of the text (`rlxf_utils.data.planted`): fixed before the
    control is first run, never changed after its results are read."""

    seed: int = Field(ge=0)
    """Seed of the labels drawn from P* (each row's uniform number: the seed and its id)."""
    intercept: float
    """P*'s intercept (default.yaml's: the mean P* over MONA's labelled rows is their MET share)."""
    strength: float = Field(gt=0)
    """The scale of z (default.yaml's: the rule's expected AUC over MONA's labelled rows 0.75)."""
    weights: dict[str, float]
    """Each property's weight: `quantified`, `deadline`, `institution` and `length`."""
    length_centre: float
    """Centre of log words (default.yaml's: their mean over MONA's labelled rows)."""
    length_scale: float = Field(gt=0)
    """Scale of log words (their SD over MONA's labelled rows)."""

    @field_validator("weights")
    @classmethod
    def _every_property(cls, v: dict[str, float]) -> dict[str, float]:
        want = {"quantified", "deadline", "institution", "length"}
        if set(v) != want:
            raise ValueError(f"weights must name exactly {sorted(want)}; got {sorted(v)}")
        return v


class DataConfig(Section):
    """Where the MONA file is, what it must hash to, how to label it and how to split it."""

    path: Path
    """The MONA file (CSV or .xlsx); relative paths are read from the parameters file's folder."""
    sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    """The file's expected sha256 (checked before any work); null: not checked."""
    max_rows: int | None = Field(default=None, gt=0)
    """Cap on the rows used: whole arrangements are subsampled, seeded (null: every row)."""
    labels: LabelConfig = Field(default_factory=LabelConfig)
    """How statuses become MET / Non-MET labels."""
    splits: SplitConfig = Field(default_factory=SplitConfig)
    """The split protocols and the held-out contexts."""
    table2_sample_size: int = Field(default=8, gt=0)
    """Rows in the paper's Table 2 sample (notebook 01)."""
    planted: PlantedOutcome | None = None
    """The positive control (params/control.yaml): every assessed row's label drawn from a
    planted P*(MET | text) instead of MONA's status (kept as `y_observed`); null: the real labels."""
    checks: DataChecks = Field(default_factory=DataChecks)
    """Sanity checks on the file, applied before any work (`rlxf run`, notebook 01, `rlxf data
    summary`)."""


SplitProtocol = Literal["random", "grouped", "temporal"]
