"""PPO on the tiny model, run by tests/test_distributed.py under `accelerate launch` with one or
two processes on the same global batch: `python ppo_ranks_worker.py OUT_DIR [RLGF_ALGO]`.

Greedy decoding with a fixed response length makes every response, and every process's token
count, independent of how the batch is split, and one minibatch per epoch makes the optimiser
steps the same: the runs then differ only in the order of floating-point sums.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_ppo import small_cfg, tiny_policy, toy_contexts  # noqa: E402

from rlxf_utils.rl.ppo import PPOTrainer  # noqa: E402

STEPS, NEW_TOKENS = 3, 6


def even_share(contexts: list[dict], texts: list[str]) -> np.ndarray:
    """A dense reward: the share of words with an even index (w0, w2, ...)."""
    words = [[w for w in t.split() if w[1:].isdigit()] for t in texts]
    return np.array([sum(int(w[1:]) % 2 == 0 for w in ws) / max(1, len(ws)) for ws in words],
                    dtype=np.float32)  # fmt: skip


def main(out: Path, algo: str = "ppo") -> None:
    torch.set_num_threads(1)
    model, tok = tiny_policy()
    prompts, contexts = toy_contexts(8)
    if algo != "ppo":  # RLGF: sampled roll-ins by a guide, its critic, the MLE term on references
        from test_rlgf import tiny_guide

        from rlxf_utils.config import RLGFConfig
        from rlxf_utils.rl.rlgf import GuidedPPOTrainer

        ref = tok(" ".join(f"w{i}" for i in range(40, 44)), add_special_tokens=False)["input_ids"]
        refs = [[ref + [tok.eos_token_id]] for _ in prompts]
        cfg = small_cfg(steps=4, batch_size=8, minibatch_size=4, checkpoint_every=2)
        rlgf = RLGFConfig(mle_coef=0.5, switch_fraction=0.5)  # 2 steps of each scheme
        trainer = GuidedPPOTrainer(algo, model, tiny_guide(), tok, prompts, contexts, even_share,
                                   cfg, rlgf, out, references=refs, seed=0)  # fmt: skip
        trainer.train(progress=False)
        return
    cfg = small_cfg(
        steps=STEPS, batch_size=8, minibatch_size=8, update_epochs=3, max_new_tokens=NEW_TOKENS,
        checkpoint_every=1, approx_kl_stop=0.005, value_warmup_steps=1,
    )  # fmt: skip
    trainer = PPOTrainer(
        model, tok, prompts, contexts, even_share, cfg, out, seed=0,
        generation_kwargs={"do_sample": False, "min_new_tokens": NEW_TOKENS},
    )  # fmt: skip
    trainer.train(progress=False)


if __name__ == "__main__":
    main(Path(sys.argv[1]), *sys.argv[2:])
