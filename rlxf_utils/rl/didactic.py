"""ILHF's one-token didactic example (Xu et al., 2023, §2.3): ILHF reproduces the population's
preferences where REINFORCE with a KL penalty collapses onto the majority."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pandas as pd
import torch
from torch import nn

from rlxf_utils.rl.ilhf import ilhf_loss


def didactic(
    method: str,
    steps: int = 400,
    batch: int = 256,
    lr: float = 0.02,
    kl_coef: float = 1.0,
    pretrain: Sequence[float] = (0.77, 0.23),
    preference: Sequence[float] = (2 / 3, 1 / 3),
    seed: int = 0,
) -> pd.DataFrame:
    """Fine-tune a one-token policy (logits over two responses, starting at `pretrain`) on
    feedback from a population preferring response 0 with probability `preference[0]`.

    `method='ilhf'`: pairs sampled from the policy, a 0/1 label drawn from the population
    (P(a > b) = pref_a / (pref_a + pref_b)), the ILHF loss. `method='reinforce'`: REINFORCE with
    the population's logits log(preference) as the reward (what the paper grants it) and a
    per-sample KL penalty `kl_coef` * log(pi / pi_pretrain), mean baseline. Returns per step the
    policy's probability of each response.
    """
    if method not in ("ilhf", "reinforce"):
        raise ValueError(f"method={method!r}; expected 'ilhf' or 'reinforce'")
    gen = torch.Generator().manual_seed(seed)
    log_pre = torch.log(torch.tensor(pretrain, dtype=torch.float64))
    pref = torch.tensor(preference, dtype=torch.float64)
    theta = nn.Parameter(log_pre.clone())
    opt = torch.optim.Adam([theta], lr=lr)
    rows = []
    for step in range(steps + 1):
        logp = torch.log_softmax(theta, -1)
        probs = logp.detach().exp()
        rows.append({"method": method, "step": step, "p0": float(probs[0]),
                     "p1": float(probs[1])})  # fmt: skip
        if step == steps:
            break
        if method == "ilhf":
            a = torch.multinomial(probs, batch, replacement=True, generator=gen)
            b = torch.multinomial(probs, batch, replacement=True, generator=gen)
            p_a = pref[a] / (pref[a] + pref[b])
            label = (torch.rand(batch, generator=gen, dtype=torch.float64) < p_a).double()
            loss = ilhf_loss(logp[a], logp[b], label)
        else:
            y = torch.multinomial(probs, batch, replacement=True, generator=gen)
            reward = torch.log(pref)[y] - kl_coef * (logp[y].detach() - log_pre[y])
            loss = -((reward - reward.mean()) * logp[y]).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return pd.DataFrame(rows)


def didactic_figure(
    kl_coefs: Sequence[float] = (0.1, 1.0), seed: int = 0
) -> tuple[Any, pd.DataFrame]:
    """The paper's Figure 1 on our code: P(less-preferred response) over fine-tuning for ILHF and
    REINFORCE with a KL penalty, against the population's 1/3 and pretraining's 0.23. Returns
    (figure, the end point of each run)."""
    import matplotlib.pyplot as plt

    runs = {"ILHF": didactic("ilhf", seed=seed)}
    for beta in kl_coefs:
        runs[f"REINFORCE + KL (beta {beta:g})"] = didactic("reinforce", kl_coef=beta, seed=seed)
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for label, frame in runs.items():
        ax.plot(frame["step"], frame["p1"], label=label)
    ax.axhline(1 / 3, color="black", ls="--", lw=0.9, label="population: 1/3")
    ax.axhline(0.23, color="grey", ls=":", lw=0.9, label="pretraining: 0.23")
    ax.set(xlabel="fine-tuning step", ylabel="P(less-preferred response)",
           title="One-token didactic example (Xu et al., 2023, §2.3)")  # fmt: skip
    ax.legend(fontsize=8, loc="center right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    ends = pd.DataFrame([{"method": k, "p_less_preferred": float(v["p1"].tail(50).mean())}
                         for k, v in runs.items()])  # fmt: skip
    return fig, ends
