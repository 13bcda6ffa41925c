"""The RL section: SFT, each algorithm's training, its settings and its critic, in words."""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from rlxf_utils.artifacts import RunDir
from rlxf_utils.config import CRITIC_INIT
from rlxf_utils.report.wording import (
    ci,
    display_country,
    interval,
    is_present,
    listing,
    markdown_table,
    num,
    say,
    short_text,
    spaced,
)


def moves_sentence(rows: pd.DataFrame) -> str:
    """How each algorithm's training reward moved (`rl.summary_table`'s rows, by algorithm), the
    algorithms that log no training reward (ILHF from history, the offline methods: they sample
    nothing while they train) said together once, not 'nan'."""
    moved = rows["reward_last"].map(is_present) & rows["reward_first"].map(is_present)
    parts = [move_sentence(algo, r) for algo, r in rows[moved].iterrows()]
    silent = rows[~moved]
    if len(silent):
        one = len(silent) == 1
        secs = listing([f"{t:.0f}" for t in silent["step_time_s"]])
        parts.append(
            f"{listing(list(silent.index))} {'samples' if one else 'sample'} nothing while "
            f"{'it trains' if one else 'they train'}, so {'it logs' if one else 'they log'} no "
            f"training reward ({secs} s per step)"
        )
    return "; ".join(parts)


def move_sentence(algo: str, r: pd.Series) -> str:
    """How one algorithm's training reward moved (a row of `rl.summary_table` whose algorithm
    logs a training reward)."""
    d = r["reward_last"] - r["reward_first"]
    first = r.get("reward_first_step", 1)
    since = (f" (from step {first:.0f}: before it, the guide wrote or finished every response)"
             if is_present(first) and first > 1 else "")  # fmt: skip
    return (
        f"{algo}'s mean training reward on the responses it wrote alone went from "
        f"{num(r['reward_first'])}{since} to {num(r['reward_last'])} "
        f"({'+' if d >= 0 else '−'}{abs(d):.3f}) at a final KL of {r['kl_last']:.2f} nats, "
        f"{r['step_time_s']:.0f} s per step"
    )


#: The report's sentence on how PPO's critic starts (`rl.critic_init`).
CRITIC_SENTENCE = {
    "reward": "The critic is the frozen reward model plus a learned correction: its value at each "
    "token is the reward model's score of the response so far in its context, a prior that is never "
    "trained, plus a linear head on the policy's hidden states (detached, so the critic does not move "
    "the policy) that starts at zero. This is not Stiennon et al.'s (2020) critic, a copy of the reward "
    "model whose weights are trained as the value function: here the prior cannot be unlearned, and "
    "the RLGF schemes' two critics (the policy's and the guide's) share it and differ only by their heads",
    "mean": "The critic is a value head on the policy's hidden states that starts on the reward's "
    "scale (zero weights, its bias at the first batch's mean reward)",
}


#: The training log's KL estimators (`rl.core.KL_ESTIMATORS`) in a table cell, by how they start.
KL_SHORT = {"k1": "k1, learner's tokens", "TRL's k3": "TRL's k3", "TRL's k1": "TRL's k1", "no": "·"}


def kl_short(estimator: Any) -> str:
    """A log's `kl_estimator` in a table cell (`KL_SHORT`; '·' when unknown)."""
    return next((v for k, v in KL_SHORT.items() if str(estimator).startswith(k)), "·")


def _rl_summary_display(summ: pd.DataFrame) -> pd.DataFrame:
    """notebook 03's `rl_summary` with short headers a page can hold: one cell per quantity."""

    def cell(x: Any, digits: int) -> str:
        return num(x, digits) if is_present(x) else "·"

    def arrow(a: Any, b: Any, digits: int) -> str:
        return f"{cell(a, digits)} → {cell(b, digits)}" if is_present(a) else "·"

    rows = []
    for _, r in summ.iterrows():
        ev = r.get("explained_variance_last_third")
        rows.append({
            "algorithm": r["algorithm"], "steps": int(r["steps"]),
            "reward (first → last 3 steps)": arrow(r.get("reward_first"), r.get("reward_last"), 3),
            "final KL": cell(r.get("kl_last"), 2),
            "KL measured as": kl_short(r.get("kl_estimator")),
            "entropy": cell(r.get("entropy_last"), 2),
            "critic EV, last third [CI]": ci(ev, r.get("explained_variance_low"), r.get("explained_variance_high")) if is_present(ev) else "·",
            "β (first → last)": arrow(r.get("beta_first"), r.get("beta_last"), 4),
            "s / step": cell(r.get("step_time_s"), 1), "tokens / s": cell(r.get("tokens_per_s"), 0),
        })  # fmt: skip
    return pd.DataFrame(rows)


def optimiser_rows(rl: dict[str, Any]) -> list[tuple[str, str]]:
    """The settings table's rows for the one optimiser every algorithm shares and the
    approximate-KL early stop (none for runs from before `rl.optimizer`)."""
    o = rl.get("optimizer")
    if o is None:
        return []
    stop = rl.get("approx_kl_stop")
    return [
        (
            "optimiser, every algorithm (ours and TRL's)",
            f"AdamW, eps {o['eps']:g}, weight decay {o['weight_decay']:g}, betas "
            f"({o['beta1']:g}, {o['beta2']:g}), {o['lr_schedule']} learning rate, "
            f"gradients clipped at norm {o['max_grad_norm']:g}",
        ),
        (
            "approximate-KL early stop of a batch's epochs",
            "none (TRL's GRPO and RLOO have none)"
            if stop is None
            else f"at {stop:g}, every RL algorithm",
        ),
    ]


def kl_regime_sentence(rl: dict[str, Any]) -> str:
    """How every RL algorithm's KL coefficient β is controlled, from the run's parameters."""
    if rl["adaptive_kl"]:
        return (f"every RL algorithm with a KL penalty (ILHF has none) starts at β = {rl['kl_coef']:g} and adapts it once per step "
                f"towards {rl['target_kl']:g} nats per response by the same rule (K_β = "
                f"{rl['kl_adapt_rate']:g}), from its own KL on the step's responses")  # fmt: skip
    return f"every RL algorithm with a KL penalty (ILHF has none) keeps β = {rl['kl_coef']:g} fixed"


def rl_section(run: RunDir, params: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    stage = "notebook 03_ppo_finetuning"
    summ = run.read_table("rl_summary", stage)
    samples = run.read_table("rl_samples_before_after", stage)
    algo_settings = run.read_table("rl_algorithm_settings", stage)
    sft = run.read_table("sft_summary", stage) if params["sft"]["enabled"] else pd.DataFrame()
    rl, pol = params["rl"], params["policy"]
    critic_init = rl.get("critic_init", "mean")  # runs from before the setting: the head alone
    settings = pd.DataFrame(
        [
            ("policy", pol["model"] if pol["model"] != "embedded" else "SmolLM2-135M-Instruct (embedded)"),
            ("LoRA rank / alpha / targets", f"{pol['lora']['rank']} / {pol['lora']['alpha']} / {', '.join(pol['lora']['target_modules'])}"),
            ("start policy (and KL reference)", rl["start_policy"]),
            ("steps x prompts x responses per prompt", f"{rl['steps']} x {rl['batch_size'] // rl['num_generations']} x {rl['num_generations']}"),
            ("max new tokens, temperature, top-p", f"{rl['max_new_tokens']}, {rl['temperature']}, {rl['top_p']}"),
            ("learning rate", f"{rl['learning_rate']:g}"),
            *optimiser_rows(rl),
            ("KL coefficient (initial), adaptive (every RL algorithm), target, K_beta", f"{rl['kl_coef']:g}, {rl['adaptive_kl']}, {rl['target_kl']:g}, {rl['kl_adapt_rate']:g}"),
            ("update epochs x minibatches (optimiser steps per batch, every algorithm)", f"{rl['update_epochs']} x {rl['batch_size'] // rl['minibatch_size']}"),
            ("PPO clip (policy / value), value coefficient", f"{rl['clip_range']} / {rl['clip_range_value'] if rl['clip_range_value'] is not None else 'none'}, {rl['vf_coef']:g}"),
            ("mixed precision", pol.get("autocast") or "none (fp32)"),
            ("GAE gamma / lambda", f"{rl['gamma']} / {rl['lam']}"),
            ("PPO critic at the start", CRITIC_INIT[critic_init]),
            ("training prompts", "all training contexts" if rl["max_prompts"] is None else str(rl["max_prompts"])),
        ],
        columns=["setting", "value"],
    )  # fmt: skip
    shown = samples.assign(
        response=samples["response"].map(short_text),
        country=samples["country"].map(display_country),
    )[["policy", "country", "econ_descriptor", "response", "reward"]]
    rows = summ.set_index("algorithm")
    ppo_sentence = ""
    if "PPO" in rows.index:
        r = rows.loc["PPO"]
        ev_word = say("explained_variance", r.get("explained_variance_low", math.nan),
                      r.get("explained_variance_high", math.nan))  # fmt: skip
        if rl["adaptive_kl"]:
            beta = (f"β, adapted towards {rl['target_kl']:g} nats with K_β = {rl['kl_adapt_rate']:g}, moved from "
                    f"{r['beta_first']:.4f} to {r['beta_last']:.4f}")  # fmt: skip
        else:
            beta = f"β stayed fixed at {r['beta_first']:.4f}"
        prior_ev = r.get("explained_variance_prior_last_third", math.nan)
        prior = (f"; the reward model's scores of the prefixes, its starting point, explained {prior_ev:.2f} "
                 "on their own" if is_present(prior_ev) else "")  # fmt: skip
        ppo_sentence = (
            f"PPO's critic explained {ev_word} variance of the returns over the last third of its steps "
            f"(mean {r['explained_variance_last_third']:.2f}, t interval over those steps "
            f"{interval(r.get('explained_variance_low', math.nan), r.get('explained_variance_high', math.nan), signed=False, digits=2)}{prior}); {beta}"
        )
    variables = {
        "algorithms": listing([a for a in rows.index]),
        "steps": str(rl["steps"]),
        "batch_size": str(rl["batch_size"]),
        "moves": moves_sentence(rows),
        "template": " ".join(rl["prompt_template"].split()),
        "ppo_sentence": ppo_sentence or "PPO did not run",
        "prompts_per_step": str(rl["batch_size"] // rl["num_generations"]),
        "num_generations": str(rl["num_generations"]),
        "opt_steps": str(rl["update_epochs"] * (rl["batch_size"] // rl["minibatch_size"])),
        "start_policy": rl["start_policy"],
        "sft_sentence": _sft_sentence(sft),
        "critic": CRITIC_SENTENCE[critic_init],
        "kl_regime": kl_regime_sentence(rl),
    }
    includes = {
        # spaces, not underscores: long names wrap in the PDF's narrow columns
        "rl_algorithm_settings.md": markdown_table(
            algo_settings.assign(setting=algo_settings["setting"].map(spaced))
        ),
        "sft_summary.md": markdown_table(sft.rename(columns=spaced), floatfmt=".3f")
        if not sft.empty
        else "SFT was not run.",
        "rl_settings.md": markdown_table(settings),
        "rl_summary.md": markdown_table(_rl_summary_display(summ)),
        "rl_samples.md": markdown_table(shown),
        "rl_train_experience.md": markdown_table(
            run.read_table("rl_train_experience", stage).rename(columns=spaced), floatfmt=".3g"
        ),
    }
    return variables, includes


def _sft_sentence(sft: pd.DataFrame) -> str:
    if sft.empty:
        return "No supervised stage ran: RL started from the zero-shot model"
    parts = [
        f"`{r['policy']}` on {int(r['examples'])} {'MET ' if r['outcomes'] == 'met' else ''}descriptions "
        f"({int(r['steps'])} steps, {r['seconds']:.0f} s, {r['tokens_per_s']:.0f} tokens/s; loss "
        f"{r['loss_first']:.2f} to {r['loss_last']:.2f})"
        for _, r in sft.iterrows()
    ]
    return "The supervised stage trained " + " and ".join(parts)
