"""The algorithm registry: every method that trains a policy from the start policy, one entry each.

An entry says what the method is called (`label`), which family it belongs to (`family`: the
report's sections and evaluation's analyses group by it), the function that trains it (`trainer`,
`"module:function"`, called with a `rl.trainer.TrainJob` by `rl.stage.run_algorithm` in the
process `rl.launch` starts), the parameter sections besides `rl` that shape a run (`sections`:
they join its up-to-date marker), and what it needs of the RL settings. Config validation
(`algorithms.algorithm`), notebook 03, evaluation and the report read this table; adding an algorithm is
one entry here and one trainer.

The trainer is named, not imported: this module sits below everything (the parameters import
it), and the trainers import torch, transformers and the rest of the study.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

Family = Literal["ppo", "trl", "rlgf", "ilhf", "offline"]

#: What each family is, in words (the report's methods section and `settings.json`).
FAMILIES: dict[str, str] = {
    "ppo": "PPO, ours (classic RLHF form, learned critic, KL penalty in the reward)",
    "trl": "group-baseline policy gradient through TRL (no critic)",
    "rlgf": "RL with guided feedback on our PPO (Chang et al., 2023)",
    "ilhf": "inclusive learning: the policy is its own reward (Xu et al., 2023)",
    "offline": "learning from experience without RL: KTO, DPO, rejection-sampling fine-tuning",
}


@dataclass(frozen=True)
class Algorithm:
    """One registered algorithm."""

    #: id in params (`algorithms.algorithm`) and the run dir (`policy/<id>/`)
    id: str
    #: display name in tables, figures and prose
    label: str
    family: Family
    #: `"module:function"` that trains it from a `TrainJob` and returns its log
    trainer: str
    #: StudyConfig sections besides `rl` and `policy` whose values change a run
    sections: tuple[str, ...] = ()
    #: runs on one process whatever `compute.num_processes` (ILHF's ensemble)
    one_process: bool = False
    #: needs several responses per prompt in every minibatch (a group baseline)
    groups: bool = False
    #: pairs the responses of a prompt (an even `num_generations` and `minibatch_size`)
    pairs: bool = False
    #: adds the RLGF paper's MLE term, eta (`rlgf.mle_coef`) x the NLL of historical MET
    #: descriptions of each minibatch's contexts (its objective for every algorithm, PPO too)
    mle: bool = False

    def train(self, job: Any) -> Any:
        """Train from `job` (a `rl.trainer.TrainJob`); returns the training log."""
        return trainer_of(self)(job)


def trainer_of(algo: Algorithm) -> Callable[[Any], Any]:
    """The function named by `algo.trainer`."""
    module, _, name = algo.trainer.partition(":")
    return getattr(importlib.import_module(module), name)


ALGORITHMS: dict[str, Algorithm] = {
    a.id: a
    for a in (
        Algorithm("ppo", "PPO", "ppo", "rlxf_utils.rl.ppo:run_ppo"),
        # PPO with the RLGF algorithms' MLE term: what guidance is compared with (guidance alone)
        Algorithm("ppo_mle", "PPO + MLE", "ppo", "rlxf_utils.rl.ppo:run_ppo", ("rlgf",), mle=True),
        Algorithm("grpo", "GRPO", "trl", "rlxf_utils.rl.trl_runs:run_trl", groups=True),
        Algorithm("rloo", "RLOO", "trl", "rlxf_utils.rl.trl_runs:run_trl", groups=True),
        Algorithm("ppo_pp", "PPO++", "rlgf", "rlxf_utils.rl.rlgf:run_rlgf", ("rlgf",), mle=True),
        Algorithm(
            "aggrevated", "AggreVaTeD", "rlgf", "rlxf_utils.rl.rlgf:run_rlgf", ("rlgf",), mle=True
        ),
        Algorithm("lols", "LOLS", "rlgf", "rlxf_utils.rl.rlgf:run_rlgf", ("rlgf",), mle=True),
        Algorithm("d2lols", "D²LOLS", "rlgf", "rlxf_utils.rl.rlgf:run_rlgf", ("rlgf",), mle=True),
        Algorithm(
            "ilhf_history",
            "ILHF (history)",
            "ilhf",
            "rlxf_utils.rl.ilhf:run_ilhf",
            ("ilhf",),
            one_process=True,
        ),  # fmt: skip
        Algorithm(
            "ilhf_online",
            "ILHF (online)",
            "ilhf",
            "rlxf_utils.rl.ilhf:run_ilhf",
            ("ilhf",),
            one_process=True,
            pairs=True,
        ),  # fmt: skip
        # without RL (`rl.offline`): from MONA's outcomes, from historical pairs, from best-of-N
        Algorithm("kto", "KTO", "offline", "rlxf_utils.rl.offline:run_offline", ("offline",)),
        Algorithm("dpo", "DPO", "offline", "rlxf_utils.rl.offline:run_offline", ("offline",)),
        Algorithm(
            "rft", "RFT (best-of-N)", "offline", "rlxf_utils.rl.offline:run_offline", ("offline",)
        ),  # fmt: skip
    )
}


def algorithm(algo_id: str) -> Algorithm:
    """The registered algorithm `algo_id`; a clear error for an unknown id."""
    try:
        return ALGORITHMS[algo_id]
    except KeyError:
        raise ValueError(
            f"unknown algorithm {algo_id!r}; expected one of {', '.join(ALGORITHMS)}"
        ) from None


def of_family(family: Family) -> tuple[str, ...]:
    """The ids of one family, in the registry's order."""
    return tuple(a.id for a in ALGORITHMS.values() if a.family == family)


#: The RL-with-guided-feedback algorithms (`rl.rlgf`): they need the guide policy.
RLGF_ALGORITHMS: tuple[str, ...] = of_family("rlgf")
#: Inclusive learning (`rl.ilhf`): the policy is its own reward; ensembles of LoRA particles.
ILHF_ALGORITHMS: tuple[str, ...] = of_family("ilhf")
#: Learning from experience without RL (`rl.offline`): KTO, DPO, rejection-sampling fine-tuning.
OFFLINE_ALGORITHMS: tuple[str, ...] = of_family("offline")
#: The RL algorithms proper (policy-gradient against the reward model): PPO, TRL's, the RLGF ones.
RL_ALGORITHMS: tuple[str, ...] = (*of_family("ppo"), *of_family("trl"), *RLGF_ALGORITHMS)

#: The supervised policies (`rl.sft`) and which outcomes each learns from.
SFT_POLICIES: dict[str, str] = {"sft": "all", "sft_met": "met"}

#: Display names of evaluation's references from history (not algorithms).
REFERENCE_LABELS: dict[str, str] = {
    "history_met": "history (MET)",
    "history_nonmet": "history (Non-MET)",
    "random_policy": "random policy",
}

#: Display names of the policies that are not algorithms: the zero-shot model, the supervised
#: policies, best-of-N and the references.
POLICY_LABELS: dict[str, str] = {
    "base": "zero-shot model",
    "sft": "SFT",
    "sft_met": "SFT on MET rows",
    "best_of_n": "best-of-N",
    **REFERENCE_LABELS,
}


def algorithm_label(name: str) -> str:
    """Display name of a policy or algorithm id ('d2lols' -> 'D²LOLS'); other names unchanged."""
    if name in ALGORITHMS:
        return ALGORITHMS[name].label
    return POLICY_LABELS.get(name, name)
