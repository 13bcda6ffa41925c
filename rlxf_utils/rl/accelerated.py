"""A `Trainer` whose processes are accelerate's: one on a CPU or a GPU, several under `accelerate
launch` (DDP, DeepSpeed ZeRO-2). It owns the accelerator, this process's rank, the reductions that
keep every process in step (statistics that decide control flow are over the global batch), and
the multi-process side of checkpoints (every rank's random state, kept by the main process).
PPO and the RLGF trainers are such trainers; ILHF's run on one process and use `Trainer`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from rlxf_utils.rl.trainer import Trainer
from rlxf_utils.runtime import rng_state


class AcceleratedTrainer(Trainer):
    """`Trainer` on accelerate's processes; subclasses set `self.module` (the prepared model)."""

    module: Any

    def __init__(self, output_dir: str | Path, checkpoint_every: int, steps: int,
                 accelerator: Any = None):  # fmt: skip
        from accelerate import Accelerator, DistributedDataParallelKwargs

        super().__init__(output_dir, checkpoint_every, steps)
        # DDP: a critic-only warm-up step leaves the policy's LoRA unused, and RLGF's extra critics
        # sit idle on steps of another scheme, so unused parameters must be allowed
        self.accelerator = accelerator or Accelerator(
            kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)]
        )
        ds = getattr(self.accelerator.state, "deepspeed_plugin", None)
        if ds is not None and getattr(ds, "zero_stage", 0) == 3:
            raise ValueError(
                "PPO and the RLGF algorithms generate with the full weights on every process; "
                "DeepSpeed ZeRO-3 shards them. Use params/accelerate/deepspeed_zero2.yaml or "
                "multi_gpu_ddp.yaml for them (ZeRO-3 suits GRPO/RLOO, which TRL gathers)"
            )
        self.world = self.accelerator.num_processes
        self.rank = self.accelerator.process_index

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    def _sum(self, t: torch.Tensor) -> torch.Tensor:
        """`t` summed over every process (itself on one process: the one-process arithmetic is
        unchanged)."""
        if self.world == 1:
            return t
        return self.accelerator.reduce(t.detach().to(self.device), reduction="sum")

    def _global_mean(self, x: torch.Tensor) -> float:
        """Mean of a per-response tensor over the global batch (equal shares per process)."""
        return float(self._sum(x.float().sum()) / (x.numel() * self.world))

    def _rank_weight_spread(self) -> float:
        """Largest difference between processes in any trainable tensor's sum (0: identical
        weights, as DDP must keep them); NaN on one process."""
        if self.world == 1:
            return float("nan")
        sums = torch.stack([p.detach().double().sum() for p in self.module.parameters()
                            if p.requires_grad]).to(self.device)  # fmt: skip
        every = self.accelerator.gather(sums.unsqueeze(0))  # (world, n_tensors)
        return float((every.max(0).values - every.min(0).values).abs().max())

    # -- the base Trainer's process hooks -------------------------------------------------------
    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    def wait(self) -> None:
        self.accelerator.wait_for_everyone()

    def rng_states(self) -> list[dict[str, Any]]:
        rngs = [rng_state()]
        if self.world > 1:
            from accelerate.utils import gather_object

            rngs = gather_object(rngs)
        return rngs

    def own_rng(self, states: Sequence[Mapping[str, Any]], path: Path) -> Mapping[str, Any]:
        if len(states) != self.world:  # run_algorithm's marker holds the process count
            raise ValueError(
                f"{path}: saved by {len(states)} process(es), resumed by {self.world}; remove the "
                "checkpoints or resume with the same compute.num_processes"
            )
        return states[self.rank]
