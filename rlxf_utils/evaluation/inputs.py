"""What every family of the evaluation stage reads and writes: its inputs (`load_inputs`: the
settings, held-out contexts and prompts, the reward and audit models, the policies), the phase
timer, what a family returns (`Measured`) and what the families have produced so far
(`Evaluation`)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import Any

import pandas as pd
import torch

from rlxf_utils.artifacts import ArtifactMissing, RunDir
from rlxf_utils.data.contexts import heldout_rows, load_contexts
from rlxf_utils.data.planted import planted_probability
from rlxf_utils.data.splits import load_holdout, load_splits
from rlxf_utils.evaluation.best_of_n import pool_sampling
from rlxf_utils.evaluation.draws import draw
from rlxf_utils.evaluation.sampling import add_rewards
from rlxf_utils.models.generation import build_prompts, sampling_kwargs
from rlxf_utils.models.policies import PolicySet
from rlxf_utils.reward.bundle import load_reward
from rlxf_utils.reward.uncertainty import fit_or_load
from rlxf_utils.runtime import warm_up_kernels
from rlxf_utils.stats import family_alpha

log = logging.getLogger(__name__)


class PhaseTimer:
    """Wall seconds per named phase of a long stage, logged as each ends (the stage's progress)
    and kept in `seconds` for its summary file."""

    def __init__(self, stage: str):
        self.stage, self.seconds = stage, {}
        #: the phases whose draws were read back (`evaluation.draws`), not drawn again
        self.reused: list[str] = []
        self._t0 = time.perf_counter()

    def reuse(self, phase: str, seconds: float) -> None:
        """Phase `phase` read back a draw that took `seconds` when it was drawn: those seconds
        count in its time (the cost of drawing, which the design reads), and it is listed in
        `reused`."""
        self.seconds[phase] = round(self.seconds.get(phase, 0.0) + seconds, 1)
        self.read_back(phase, seconds)

    def read_back(self, what: str, seconds: float) -> None:
        """`what` (a phase, or one policy's part of one) was read back from `eval/draws`, where
        it took `seconds` when made: listed in `reused`, its time not counted."""
        self.reused.append(what)
        log.info("%s: %s read back from %s (made in %.0f s)", self.stage, what, "eval/draws",
                 seconds)  # fmt: skip

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        t0 = time.perf_counter()
        yield
        dt = time.perf_counter() - t0
        self.seconds[phase] = round(self.seconds.get(phase, 0.0) + dt, 1)
        log.info("%s: %s took %.0f s (%.0f s so far)", self.stage, phase, dt,
                 time.perf_counter() - self._t0)  # fmt: skip


@dataclass
class EvalInputs:
    """What every family reads: the settings, the run dir, the held-out contexts and their
    prompts, the reward and audit models (and the reward heads), the labelled data and the
    policies (two sets of weights, adapters switched on them)."""

    cfg: Any
    run: RunDir
    progress: bool
    #: wall seconds per phase: `evaluation.design` reads the sampling phases' (`PER_*_PHASES`)
    timer: PhaseTimer
    contexts: list[dict[str, Any]]
    reward_model: Any
    audit_model: Any
    #: the reward heads of `reward_sd` (`reward.uncertainty`); None: no reward_sd
    heads: Any
    labelled: pd.DataFrame
    #: `data/holdout.json`: the rows no policy trained on (`policy`) and the references' rows
    holdout: dict[str, Any]
    algos: list[str]
    pset: PolicySet
    prompts: list[str]

    @property
    def ec(self) -> Any:
        return self.cfg.evaluation

    @property
    def seed(self) -> int:
        return self.cfg.run.seed

    @property
    def start(self) -> str:
        return self.pset.start_name

    @property
    def curve_ns(self) -> list[int]:
        """The best-of-N curve's N, each once, in order."""
        return sorted(set(self.ec.best_of_n_curve))

    @property
    def country(self) -> pd.Series:
        """Each prompt's country: the bootstrap's cluster."""
        return pd.Series([c["country"] for c in self.contexts])

    def sampling(self, name: str) -> dict[str, Any]:
        """The sampling settings of policy `name`: RL's policies sample with their own seed."""
        return sampling_kwargs(self.cfg, self.progress, trained=name in self.algos)

    def draw(self, kind: str, name: str, k: int, gen_kw: dict[str, Any], phase: str,
             judges: bool = True) -> pd.DataFrame:  # fmt: skip
        """Policy `name`'s k responses per prompt with their log-probs (`draws.draw`: read back
        where the same draw was kept, else drawn and kept), timed in `phase`."""
        return draw(self.cfg, self.run, self.pset, kind, name, self.prompts, k, gen_kw,
                    self.ec.logprob_batch_size, desc=name if kind == "samples" else phase,
                    judges=judges, timer=self.timer, phase=phase)  # fmt: skip

    def draw_pool(self) -> pd.DataFrame:
        """Best-of-N's pool: max(`best_of_n_curve`, `best_of_n`) start-policy candidates per
        prompt, drawn with another seed than the policies' own samples (`pool_sampling`), without
        the judges' log-probs (phase 'best-of-N pool')."""
        ec = self.ec
        n_pool = max(max(ec.best_of_n_curve), ec.best_of_n)
        return self.draw("pool", self.start, n_pool, pool_sampling(self.sampling(self.start)),
                         "best-of-N pool", judges=False)  # fmt: skip

    def heldout(self) -> pd.DataFrame:
        """The held-out historical descriptions whose perplexity every policy is measured on."""
        return heldout_rows(self.labelled, self.run.read_parquet("data/contexts.parquet"),
                            self.ec.heldout_rows, self.seed)  # fmt: skip

    def score(self, df: pd.DataFrame) -> pd.DataFrame:
        """`df` with `reward`, `reward_sd` and `audit_reward` (`sampling.add_rewards`, in place),
        and in the positive control `planted`, the text's true P*(MET | text) (`data.planted`);
        a response cut at the evaluation cap scored by `evaluation.cut_responses`, P* alike."""
        planted = self.cfg.data.planted
        if planted is not None:  # the positive control: every response's true P*(MET | text)
            df["planted"] = planted_probability(df["response"].astype(str).tolist(), planted)
        return add_rewards(df, self.contexts, self.reward_model, self.audit_model,
                           self.cfg.rl.reward_batch_size, self.heads,
                           self.ec.cut_responses)  # fmt: skip


def load_inputs(
    cfg: Any, run: RunDir, progress: bool = True, reward_models: bool = True
) -> EvalInputs:
    """Load the models, contexts and policies once (phase `loading`); ArtifactMissing names what
    an earlier notebook should have written. `reward_models=False`: no reward or audit model and no
    reward heads (an evaluation lane, `evaluation.lanes`, samples and scores log-probs only)."""
    ec, rl = cfg.evaluation, cfg.rl
    if ec.num_threads is not None:
        torch.set_num_threads(ec.num_threads)
    warm_up_kernels()
    timer = PhaseTimer("evaluation")
    with timer("loading"):
        contexts = load_contexts(run.root, "eval", ec.max_prompts, cfg.run.seed)
        reward_model = audit_model = heads = None
        if reward_models:
            reward_model, audit_model = load_reward(
                run.require("reward_model", stage="notebook 02 (reward model)")
            )
            if audit_model is None:
                raise ArtifactMissing(
                    f"{run.path('reward_model')}: no audit model; rerun notebook 02"
                )
            heads = fit_or_load(run, cfg, reward_model)  # None: no reward_sd
        labelled, _ = load_splits(run)
        labelled = labelled.reset_index(drop=True)
        algos = list(rl.algorithm)
        pset = PolicySet(cfg, run, algos)
    prompts = build_prompts(contexts, pset.tok, rl.prompt_template, cfg.policy)
    return EvalInputs(cfg, run, progress, timer, contexts, reward_model, audit_model, heads,
                      labelled, load_holdout(run), algos, pset, prompts)  # fmt: skip


@dataclass
class Measured:
    """What one family produced: tables `eval_*`, entries of `eval/summary.json`, figures
    (matplotlib figures, written by the stage), files under `eval/` (`.parquet`, `.jsonl`) and
    what later families read (`products`: fields of `Evaluation`)."""

    tables: dict[str, pd.DataFrame] = field(default_factory=dict)
    entries: dict[str, Any] = field(default_factory=dict)
    figures: dict[str, Any] = field(default_factory=dict)
    files: dict[str, pd.DataFrame] = field(default_factory=dict)
    products: dict[str, Any] = field(default_factory=dict)


@dataclass
class Evaluation:
    """The inputs and what the families have produced so far (each family's `products` and
    tables, filled in the order of `EVAL_FAMILIES`)."""

    inp: EvalInputs
    #: every response (the compared policies', best-of-N's, history's), one row each
    samples: pd.DataFrame = field(default_factory=pd.DataFrame)
    #: best-of-N's candidates: N start-policy responses per prompt, apart from its own samples
    pool: pd.DataFrame = field(default_factory=pd.DataFrame)
    #: the policies in the order of the tables and figures
    order: list[str] = field(default_factory=list)
    #: MiniLM sentence embeddings (grounding, and ILHF's similarity)
    encoder: Any = None
    #: one row per policy (`tables.summary_table`), and every paired comparison
    summary: pd.DataFrame = field(default_factory=pd.DataFrame)
    paired: pd.DataFrame = field(default_factory=pd.DataFrame)
    #: the vs-start family: its size sets the simultaneous level
    family: list[str] = field(default_factory=list)
    #: each RL policy's last training step, and its snapshots' samples
    trained: dict[str, int] = field(default_factory=dict)
    snap_samples: pd.DataFrame = field(default_factory=pd.DataFrame)
    frontier: pd.DataFrame = field(default_factory=pd.DataFrame)
    #: every held-out description's NLL under every policy
    ppl_rows: pd.DataFrame = field(default_factory=pd.DataFrame)
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)

    @property
    def alpha_family(self) -> float:
        """The vs-start family's simultaneous level: the gains' bars and curve, as in the tables."""
        return family_alpha(self.inp.ec.alpha, len(self.family))

    def take(self, measured: Measured) -> None:
        """Keep what a family produced: its products (fields above) and its tables."""
        products = {f.name for f in fields(self)} - {"inp", "tables"}
        for name, value in measured.products.items():
            if name not in products:
                raise AttributeError(f"{name!r} is not one of the evaluation's {sorted(products)}")
            setattr(self, name, value)
        self.tables |= measured.tables
