"""The policies of a run by name: `PolicySet` holds every evaluated policy on two sets of weights
(the base and the start policy), and `load_named_policy` loads one."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from rlxf_utils.algorithms import SFT_POLICIES
from rlxf_utils.artifacts import ArtifactMissing, RunDir
from rlxf_utils.config import StudyConfig
from rlxf_utils.models.ensemble import (
    is_ensemble,
    is_packed,
    load_particles,
    mixture_logprobs,
    thompson_draw,
    unpack_particles,
)
from rlxf_utils.models.generation import (
    autocast,
    generate,
)
from rlxf_utils.models.loading import load_policy, load_policy_with_adapter, load_start_policy
from rlxf_utils.models.logprobs import sequence_logprobs
from rlxf_utils.runtime import resolve_device


class PolicySet:
    """Every evaluated policy on two sets of weights: the base (zero-shot, `sft`, `sft_met`
    adapters) and the start policy RL began from (the RL adapters; adapters off: the reference)."""

    def __init__(self, cfg: Any, run: RunDir, algos: Sequence[str]):
        from peft import PeftModel

        device = resolve_device(cfg.compute.device)  # the GPU when there is one (paper profile)
        self.autocast_dtype = cfg.policy.autocast
        self.start_name = cfg.rl.start_policy
        self.base, self.tok = load_policy(cfg.policy, device=device)
        self.algos = list(algos)
        self.sft_names = list(SFT_POLICIES) if cfg.sft.enabled else []

        def adapter(name: str, stage: str) -> Path:
            path = run.require(f"policy/{name}/adapter", stage=stage)
            if not (path / "adapter_config.json").is_file():
                raise ArtifactMissing(f"{path}: no adapter_config.json; {stage} did not finish")
            return path

        self.particles: dict[str, list[str]] = {}  # ILHF ensembles: their particles' adapters

        def attach(model: Any, names: Sequence[str], stage: str) -> Any:
            for name in names:
                if is_ensemble(run.path(f"policy/{name}/adapter")):
                    model, self.particles[name] = load_particles(
                        model, run.path(f"policy/{name}/adapter"), name
                    )
                    continue
                path = adapter(name, f"{stage} ({name})")
                if not isinstance(model, PeftModel):
                    model = PeftModel.from_pretrained(model, str(path), adapter_name=name)
                else:
                    model.load_adapter(str(path), adapter_name=name)
            return model

        on_base = self.sft_names + (self.algos if self.start_name == "base" else [])
        self.base_model: Any = attach(self.base, on_base, "notebook 03")
        self.home = {n: self.base_model for n in on_base}
        if self.start_name == "base":
            self.start_model = self.base_model
        else:
            start, _ = load_start_policy(cfg.policy, self.start_name, run.root, device=device)
            self.start_model = attach(start, self.algos, "notebook 03")
            self.home.update({n: self.start_model for n in self.algos})
        for m in {
            id(self.base_model): self.base_model,
            id(self.start_model): self.start_model,
        }.values():
            m.eval()

    @property
    def names(self) -> list[str]:
        """Generated policies in table order: base, the supervised policies, the RL algorithms."""
        return ["base", *self.sft_names, *self.algos]

    @contextlib.contextmanager
    def use(self, name: str) -> Iterator[Any]:
        """The model acting as policy `name` ('base': zero-shot; 'start': RL's reference), under
        the configured autocast. The start policy by its own name ('sft' when RL starts there) is
        RL's reference itself, the merged weights with adapters off, not the base with its
        adapter unmerged: the two differ by rounding (under bfloat16 autocast, KL(sft || start)
        measured -0.04 nats on a tiny model; tests/test_eval_start_kl.py)."""
        with autocast(self.autocast_dtype, self.base.device):
            if name in ("start", self.start_name) and self.start_name != "base":
                yield from self._disabled(self.start_model)
            elif name in ("base", "start"):
                yield from self._disabled(self.base_model)
            else:
                model = self.home[name]
                model.set_adapter(self.particles.get(name, [name])[0])
                yield model

    def generate(self, name: str, prompts: Sequence[str], k: int, desc: str,
                 gen_kw: Mapping[str, Any]) -> pd.DataFrame:  # fmt: skip
        """k responses per prompt from policy `name`; an ILHF ensemble answers each prompt with a
        particle drawn uniformly (Thompson sampling, seeded by the sampling seed)."""
        parts = self.particles.get(name)
        draw = (
            [parts[z] for z in thompson_draw(len(prompts), len(parts), int(gen_kw["seed"]))]
            if parts
            else None
        )
        with self.use(name) as m:
            return generate(m, self.tok, prompts, k, desc=desc, adapter_names=draw, **gen_kw)

    def sequence_logprobs(self, name: str, prompts: Sequence[Any], responses: Sequence[Any],
                          batch_size: int, **kw: Any) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
        """`sequence_logprobs` under policy `name`; an ensemble's density is its mixture's,
        log mean_m pi_m(y | x) over its particles."""
        parts = self.particles.get(name)
        if not parts:
            with self.use(name) as m:
                return sequence_logprobs(
                    m, self.tok, prompts, responses, batch_size=batch_size, **kw
                )
        model, per, n = self.home[name], [], None
        with autocast(self.autocast_dtype, self.base.device):
            for part in parts:
                model.set_adapter(part)
                lp, n = sequence_logprobs(
                    model, self.tok, prompts, responses, batch_size=batch_size, **kw
                )
                per.append(lp)
        return mixture_logprobs(per), n

    @staticmethod
    def _disabled(model: Any) -> Iterator[Any]:
        if hasattr(model, "disable_adapter"):
            with model.disable_adapter():
                yield model
        else:
            yield model

    def reference(self) -> Any:
        """RL's KL reference: the start policy (adapters off on its weights)."""
        return self.use("start")

    def load_snapshot(self, algo: str, weights: Path) -> str:
        """Load a snapshot's adapter weights beside `algo` (same config) as policy 'snapshot': one
        adapter, or for an ILHF ensemble every particle the file packs (`ensemble.pack_particles`),
        then sampled and scored as the final ensemble is (Thompson draws, the mixture density)."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        model, tensors = self.home[algo], load_file(str(weights))
        self.home["snapshot"] = model
        parts = self.particles.get(algo)
        if parts:  # (adapter name, the final adapter whose config it takes, its weights)
            states = unpack_particles(tensors, weights)
            want = [p.removeprefix(f"{algo}__") for p in parts]
            if list(states) != want:
                raise ValueError(
                    f"{weights}: particles {list(states)}; {algo}'s ensemble has {want}"
                )
            targets = [(f"snapshot__{w}", part, state)
                       for w, part, state in zip(want, parts, states.values(), strict=True)]  # fmt: skip
        elif is_packed(tensors):
            raise ValueError(f"{weights}: an ensemble's snapshot, but {algo} is one adapter")
        else:
            targets = [("snapshot", algo, tensors)]
        for name, like, state in targets:
            if name not in model.peft_config:
                model.add_adapter(name, model.peft_config[like])
            set_peft_model_state_dict(model, state, adapter_name=name)
        if parts:
            self.particles["snapshot"] = [name for name, _, _ in targets]
        else:
            self.particles.pop("snapshot", None)
        return "snapshot"


def load_named_policy(cfg: StudyConfig, run_dir: str | Path, name: str) -> tuple[Any, Any]:
    """A policy of this run by name: 'base' (zero-shot), 'sft' / 'sft_met' (LoRA on the base) or
    an RL algorithm (LoRA on the start policy; an ILHF ensemble with every particle loaded).
    Evaluation and the before/after samples use `models.policies.PolicySet` instead (one load per set
    of weights, Thompson draws for ensembles)."""

    rd = RunDir(run_dir)
    if name == "base":
        return load_policy(cfg.policy)
    adapter = rd.require(f"policy/{name}/adapter", "notebook 03")
    if name in ("sft", "sft_met"):
        return load_policy_with_adapter(cfg.policy, adapter)
    from peft import PeftModel

    model, tok = load_start_policy(cfg.policy, cfg.rl.start_policy, rd.root)
    if is_ensemble(adapter):
        model, _ = load_particles(model, adapter, name)
    else:
        model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    return model, tok
