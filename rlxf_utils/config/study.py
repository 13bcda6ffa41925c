"""Parameters of evaluation, risk and compute, and the whole study (`StudyConfig`) with the checks
that span sections."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from rlxf_utils.algorithms import RLGF_ALGORITHMS
from rlxf_utils.config.base import Section
from rlxf_utils.config.data import DataConfig, RunConfig
from rlxf_utils.config.policy import (
    ILHFConfig,
    OfflineConfig,
    PolicyConfig,
    RLConfig,
    RLGFConfig,
    SFTConfig,
)
from rlxf_utils.config.precision import resolve
from rlxf_utils.config.reward import ForensicConfig, RewardConfig


class Table3Scenario(Section):
    """One of the paper's Table 3 completion prompts; `{country}` is filled from held-out contexts."""

    prompt: str = Field(min_length=1)
    """The paper's Table 3 prompt; `{country}` is filled with a held-out country."""
    econ_descriptor: str = Field(min_length=1)
    """The MONA economic descriptor the reward is scored under."""

    @field_validator("prompt")
    @classmethod
    def _has_country(cls, v: str) -> str:
        if "{country}" not in v:
            raise ValueError("must contain the placeholder {country}")
        return v


class Headline(Section):
    """The one comparison that answers the study's question, fixed in the params before any
    result is read (the estimand: each method's mean gain in P(MET) over the start policy on the
    held-out prompts, cut answers scored by `evaluation.cut_responses`); every other family of
    the report is secondary."""

    family: Literal["vs_start", "kl_budget"] = "vs_start"
    """'vs_start': every method as trained against the start policy (`eval_methods`);
    'kl_budget': every method's gain at the first of `evaluation.kl_budgets` it reaches."""
    judge: Literal["audit_reward", "reward"] = "audit_reward"
    """'audit_reward': the disjoint-rows audit no method was optimised against; 'reward': the
    RL reward model the methods were optimised against."""


class EvaluationConfig(Section):
    """Alignment evaluation (notebook 04) on the held-out contexts."""

    max_prompts: int | None = Field(default=48, gt=0)
    """Held-out contexts evaluated, a seeded sample (null: all). What a design can detect
    depends on the run's variance components (`tables/eval_design`), which vary between runs;
    the between-country part divides by the held-out countries alone, so past a point only more
    countries, not more prompts or samples, lower the MDE. default.yaml's 48 at 4 samples is
    what its time budget holds; every held-out context is full.yaml's (docs/statistics.md)."""
    max_new_tokens: int | None = Field(default=None, gt=0)
    """Evaluation's own token cap: every evaluated policy, best-of-N's candidates, the frontier's
    snapshots and Table 3 sample up to this many new tokens (null: `rl.max_new_tokens`; at
    least that). RL trains at `rl.max_new_tokens`; a longer cap here lets answers a policy
    learned to write longer finish, and costs only the tokens they use (finished rows leave
    the compact sampler's batch)."""
    cut_responses: Literal["as_written", "failed"] = "failed"
    """The rule for a response still cut at the evaluation cap, fixed before any result is read:
    'failed' scores it as a failed proposal, P(MET) = 0 under the reward model and the audit,
    for every policy alike (its as-written scores are kept in the samples, `reward_as_written`
    and `audit_reward_as_written`); 'as_written' scores the cut text as it stands."""
    samples_per_prompt: int = Field(default=4, ge=1)
    """K responses per prompt and policy."""
    best_of_n: int = Field(default=4, ge=2)
    """The best-of-N policy row: N start-policy samples."""
    best_of_n_curve: list[int] = Field(default_factory=lambda: [1, 2, 4, 8, 16], min_length=1)
    """The best-of-N curve of the reward-KL frontier: N candidates per prompt, drawn from the
    start policy independently of the samples it is compared with (a pool of max(N) per prompt)"""
    heldout_rows: int | None = Field(default=300, gt=0)
    """Held-out descriptions for perplexity."""
    batch_size: Annotated[int, Field(gt=0)] | Literal["auto"] = 16
    """Generation batch; 'auto': 64 on a CPU (the largest bench/generation.py measured to pay on
    two cores), on a GPU as many rows as 80% of its free memory holds
    (`models.decode.auto_batch_size`)."""
    logprob_batch_size: int = Field(default=16, gt=0)
    """Responses per log-probability pass (policy and reference)."""
    n_boot: int = Field(default=2000, ge=100)
    """Bootstrap resamples of a bootstrap interval; a family's intervals at 1 - alpha / m take
    at least 50 beyond each bound (`stats.tail_resamples`), and the paired gains over the start
    policy use a cluster t interval, no resamples"""
    alpha: float = Field(default=0.05, gt=0.0, lt=0.5)
    """Significance level of every interval and test of the study (intervals at 1 - alpha)."""
    power: float = Field(default=0.8, gt=0.0, lt=1.0)
    """Power of the minimum detectable effect (MDE) stated for each family: the true gain its
    interval excludes zero for with this probability"""
    kl_match_ratio: float | None = Field(default=2.0, ge=1.0)
    """Two methods are compared pairwise (the RLGF questions, RL against the offline methods)
    only when the larger of their KLs to the start policy is at most this many times the smaller
    (each counted as at least half a nat: `evaluation.questions.KL_FLOOR`); the others are
    listed, not compared, and each method still meets best-of-N and the frontier at its own KL
    (null: every pair is compared)."""
    equivalence_margin: float = Field(default=0.01, gt=0.0, lt=1.0)
    """Smallest gain in P(MET) a reader would care about: a comparison whose whole interval
    lies within +/- this margin is 'equivalent', not merely 'not distinguishable' (why 0.01:
    the report's methods)"""
    target_mde: float | None = Field(default=0.004, gt=0.0)
    """MDE the evaluation's design is sized for (the issue's target for a gain over the start
    policy at the family's level): `eval_design` names the cheapest design that reaches it (null:
    only the best design at the run's own sampling cost)"""
    grounding_k: int = Field(default=10, ge=1)
    """Nearest historical conditions per response."""
    kl_budgets: list[float] = Field(default_factory=lambda: [0.5, 1.0, 2.0, 4.0], min_length=1)
    """KL budgets (nats per response, increasing) at which every pair of methods whose reward-KL
    curves reach them is compared, each method's reward read off its curve
    (`evaluation.curves`); fixed before any run."""
    kl_budget_span: float | None = Field(default=4.0, gt=1.0)
    """A budget b is read off a method's curve only where one of the two points around b lies
    within this factor of it: the first beyond at most this many times b, or the last below (not
    the start policy, at 0) at least b over it (null: wherever the curve reaches b). Five snapshots over 16 steps
    put neighbouring points of a curve whose KL grows with the steps within a factor of 3; a
    curve that passes b with no point within a factor of 4 (a method without snapshots whose final
    policy sits at 29 nats) is listed, not read: linear in KL across that gap is an assumption,
    not a measurement."""
    headline: Headline = Field(default_factory=Headline)
    """The headline comparison, stated before the run (`Headline`)."""
    frontier: bool = True
    """Score every algorithm's snapshots for the reward-KL frontier."""
    frontier_samples_per_prompt: int = Field(default=1, ge=1)
    """Responses per prompt for each frontier snapshot."""
    frontier_max_checkpoints: int | None = Field(default=None, gt=0)
    """Evenly spaced subset."""
    table3_countries: int = Field(default=2, ge=1)
    """Held-out countries filled into the paper's Table 3 prompts."""
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
    """The paper's Table 3 prompts."""
    show_samples: int = Field(default=3, ge=0)
    """Full samples per policy shown in the notebook."""
    num_threads: int | None = Field(default=None, gt=0)
    """Torch threads for evaluation (null: every core)."""
    reward_heads: int = Field(default=10, ge=0)
    """Reward uncertainty: logistic heads on the reward encoder's frozen features, each fitted
    on a bootstrap resample; their SD of P(MET) is the epistemic uncertainty per response (0:
    off)"""
    reward_heads_rows: int = Field(default=2000, ge=50)
    """Reward-training rows (the reward protocol's train split, seeded subsample) the heads fit
    on"""

    @field_validator("kl_budgets")
    @classmethod
    def _budgets(cls, v: list[float]) -> list[float]:
        if any(b <= 0 for b in v) or any(b >= c for b, c in zip(v, v[1:], strict=False)):
            raise ValueError(f"KL budgets must be positive and increasing (nats); got {v}")
        return v


class LabelMapping(Section):
    """One reading of MONA statuses for the label-sensitivity check: MET statuses, statuses dropped."""

    met: list[str] = Field(min_length=1)
    """Statuses labelled MET under this mapping."""
    exclude: list[str] = Field(default_factory=list)
    """Statuses dropped under this mapping (besides `data.labels.not_assessed`)."""

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

    regions_path: Path = Path("../data/regions/imf_regions.csv")
    """Country -> region, with SOURCE.md."""
    min_group_size: int = Field(default=20, ge=1)
    """Groups smaller than this are pooled as 'other'."""
    swap_texts: int = Field(default=40, ge=1)
    """Historical texts in the country-swap test."""
    swap_generated: int = Field(default=40, ge=0)
    """Generated texts in the country-swap test."""
    swap_countries: int = Field(default=12, ge=2)
    """Countries swapped in."""
    length_bins: int = Field(default=5, ge=2)
    """Response-length bins of the reward-against-length table."""
    top_ngrams: int = Field(default=15, ge=1)
    """Bigrams listed among those RL made more frequent."""
    label_mappings: dict[str, LabelMapping] = Field(default_factory=_default_label_mappings)
    """Name -> mapping; 'paper' is the reference and must equal data.labels (its met, nothing
    dropped)"""
    label_variants: list[str] = Field(  # names in label_mappings, compared in this order
        default_factory=lambda: ["paper", "md_as_met", "exclude_cancelled_modified"], min_length=2
    )
    """Label mappings (names in `label_mappings`) compared, in this order."""
    label_model: Literal["tfidf"] = "tfidf"
    """Retrained per label variant (cheap, see notebook 05)."""

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
    """'auto': this process's GPU when CUDA is available, else the CPU; 'cpu'; 'cuda'."""
    processes: Literal["per_stage", "kernel"] = "per_stage"
    """'per_stage': SFT and each RL algorithm in their own process (`accelerate launch`);
    'kernel': inside the notebook's kernel."""
    warm_stages: bool = True
    """'per_stage': consecutive one-process RL algorithms train in turn in one warm process (the
    imports and the reward model loaded once; accelerate's state cleared between them);
    false: each in a process of its own"""
    parallel_stages: int = Field(default=1, ge=1)
    """Warm processes that train the one-process RL algorithms side by side, each with
    `cpu_count // parallel_stages` threads: a warm group's algorithms are dealt to them in turn
    (lane i: the group's algorithms i, i + n, ...). On two CPU cores, where a stage's small
    products keep its second thread idle much of the time, 2 lanes of one thread each train
    more algorithms per minute. An algorithm's thread count follows from this setting alone,
    never from how many algorithms are pending (a rerun of one trains as the first run did).
    With `lane_threads: all`, notebook 04 also draws its samples in this many side-by-side
    processes before its measures (`evaluation.lanes`: the same draws, read back)."""
    lane_threads: Literal["share", "all"] = "share"
    """The threads of each of `parallel_stages` lanes: 'share', `cpu_count // parallel_stages`;
    'all', every core, the lanes' threads then outnumbering the cores and waiting passively
    (`OMP_WAIT_POLICY=PASSIVE`, unless set), so that each algorithm trains with the threads, and
    so the rounding, of one warm process: under bf16 one thread and two round differently."""
    accelerate_config: Path | None = None
    """None: one process with accelerate's defaults"""
    num_processes: int = Field(default=1, ge=1)
    """Processes (GPUs) per RL stage under `accelerate launch` (SFT and ILHF use one)."""
    hf_offline: bool = True
    """Hub access: offline (the embedded models, clusters without internet) unless a profile
    turns it off; HF_HUB_OFFLINE set in the environment still wins"""

    @model_validator(mode="after")
    def _processes_fit(self) -> ComputeConfig:
        if self.processes == "kernel" and self.num_processes > 1:
            raise ValueError(
                f"processes 'kernel' trains inside the notebook: one process, but num_processes "
                f"is {self.num_processes}; use processes: per_stage"
            )
        if self.parallel_stages > 1 and not (self.processes == "per_stage" and self.warm_stages):
            raise ValueError(
                f"parallel_stages {self.parallel_stages} runs warm processes side by side: it "
                f"needs processes: per_stage and warm_stages: true (got {self.processes!r}, "
                f"{self.warm_stages})"
            )
        return self


class StudyConfig(Section):
    """The whole study's parameters; `source` is the YAML file they came from."""

    run: RunConfig
    """The run's identity and seed."""
    data: DataConfig
    """The MONA file, labels and splits (notebook 01)."""
    reward: RewardConfig = Field(default_factory=RewardConfig)
    """The reward model (notebook 02)."""
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    """The policy LLM and its adapters."""
    sft: SFTConfig = Field(default_factory=SFTConfig)
    """Domain fine-tuning before RL (notebook 03)."""
    rl: RLConfig = Field(default_factory=RLConfig)
    """RL: every algorithm's shared settings (notebook 03)."""
    rlgf: RLGFConfig = Field(default_factory=RLGFConfig)
    """The RLGF algorithms' own settings."""
    ilhf: ILHFConfig = Field(default_factory=ILHFConfig)
    """The ILHF algorithms' own settings."""
    offline: OfflineConfig = Field(default_factory=OfflineConfig)
    """The offline methods' own settings (KTO, DPO, rejection-sampling fine-tuning)."""
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)
    """Evaluation (notebook 04) and the study's significance level."""
    risk: RiskConfig = Field(default_factory=RiskConfig)
    """The risk measures (notebook 05)."""
    forensic: ForensicConfig = Field(default_factory=ForensicConfig)
    """Notebook 02's forensic arm."""
    compute: ComputeConfig = Field(default_factory=ComputeConfig)
    """Devices and processes."""
    source: Path | None = Field(default=None, exclude=True)
    """The parameters file this was read from (set by `load_config`, not a key)."""

    def resolved(self) -> dict[str, Any]:
        """Plain-JSON form of every parameter, defaults filled in (for the manifest)."""
        return self.model_dump(mode="json")

    @property
    def training_seed(self) -> int:
        """The RL algorithms' training seed: `rl.seed`, or `run.seed` when it is null (a further
        seed of `rlxf seeds` sets `rl.seed`; the run's own leaves it null)."""
        return self.run.seed if self.rl.seed is None else self.rl.seed

    @model_validator(mode="after")
    def _resolve_auto_precision(self) -> StudyConfig:
        """'auto' precisions become what this machine runs natively (`config.precision`), so the
        frozen parameters, and every fingerprint over them, hold the arithmetic that ran."""
        if self.policy.autocast == "auto":
            self.policy.autocast = resolve("auto", self.compute.device, "bfloat16", None)
        keys = [(s, "train_precision") for s in (self.reward, *self.reward.compare_encoders)]
        for section, key in [*keys, (self.reward, "score_precision")]:
            if getattr(section, key) == "auto":
                setattr(section, key, resolve("auto", self.compute.device))
        return self

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
    def _history_matches_rl(self) -> StudyConfig:
        """ILHF (history)'s pairs, pairs per step and passes left null: RL's sequences, sequences
        per optimiser step and passes, hence RL's optimiser steps (equal experience)."""
        ic, rl = self.ilhf, self.rl
        if ic.history_max_pairs is None:
            ic.history_max_pairs = max(1, (self.offline.examples or rl.steps * rl.batch_size) // 2)
        if ic.history_batch_pairs is None:
            ic.history_batch_pairs = max(1, rl.minibatch_size // 2)
        if ic.history_epochs is None:
            ic.history_epochs = float(rl.update_epochs)
        return self

    @model_validator(mode="after")
    def _kl_is_of_the_sampled_distribution(self) -> StudyConfig:
        """Evaluation's KL to the start policy, best-of-N's KL bound and the importance ratios
        of PPO and TRL are computed for the full, untempered distribution: sampling from another
        one (temperature != 1 or top-p < 1) would make every KL in the report that of a
        distribution nobody sampled."""
        bad = {k: getattr(self.rl, k) for k in ("temperature", "top_p") if getattr(self.rl, k) != 1}
        if bad:
            raise ValueError(
                f"rl {bad}: the study samples at temperature 1 and top-p 1, the distribution its "
                "KL and importance ratios are computed for (evaluation's KL to the start policy, "
                "best-of-N's bound, PPO's and TRL's ratios); expected rl.temperature: 1.0 and "
                "rl.top_p: 1.0"
            )
        return self

    @property
    def eval_max_new_tokens(self) -> int:
        """Evaluation's token cap: `evaluation.max_new_tokens`, or `rl.max_new_tokens` when null."""
        cap = self.evaluation.max_new_tokens
        return self.rl.max_new_tokens if cap is None else cap

    @model_validator(mode="after")
    def _eval_cap_at_least_rl_cap(self) -> StudyConfig:
        """A policy is evaluated on at least the tokens it was trained to write: a shorter cap
        would cut answers RL scored whole."""
        cap = self.evaluation.max_new_tokens
        if cap is not None and cap < self.rl.max_new_tokens:
            raise ValueError(
                f"evaluation.max_new_tokens={cap} is below rl.max_new_tokens="
                f"{self.rl.max_new_tokens}: evaluation would cut answers RL trained on whole; "
                "expected null (= rl.max_new_tokens) or an integer >= rl.max_new_tokens"
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
    def _offline_batches(self) -> StudyConfig:
        """KTO's reference point pairs each completion with another of its batch (TRL needs at
        least two per process); DPO takes rl.minibatch_size / 2 pairs per optimiser step."""
        per = self.rl.minibatch_size // self.compute.num_processes
        if "kto" in self.rl.algorithm and per < 2:
            raise ValueError(f"rl.minibatch_size={self.rl.minibatch_size}: KTO needs at least 2 "
                             "examples per process and optimiser step (its reference point pairs "
                             "each completion with another of its batch)")  # fmt: skip
        if "dpo" in self.rl.algorithm and (per < 2 or per % 2):
            raise ValueError(f"rl.minibatch_size={self.rl.minibatch_size}: DPO takes "
                             "minibatch_size / 2 pairs per optimiser step (two sequences each); "
                             "expected an even number of at least 2 per process")  # fmt: skip
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
