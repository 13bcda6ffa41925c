"""Training policies (notebook 03).

`core` (GAE, losses, KL controllers, value heads, the prompt schedule), `trainer` (`TrainJob`,
and `Trainer`: the loop, checkpoints, resume, logs and saving every trainer shares), `accelerated`
(the trainer base on accelerate's processes), `rollout` (what a batch carries through an
update), `ppo`, `rlgf` (the guided trainers, a subclass of
PPO's), `ilhf` (inclusive learning on an ensemble), `trl_runs` (GRPO and RLOO through TRL),
`sft` (domain fine-tuning), `didactic` (ILHF's one-token example), `tables` (notebook 03's
tables and figures), `launch` / `worker` / `accelerate_launch` (each stage in its own process),
`memory` (GPU memory of the paper profile), `stage` (notebook 03). Which function trains which
algorithm is the registry's (`rlxf_utils.algorithms`).
"""
