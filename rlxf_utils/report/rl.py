"""The RL section: SFT, each algorithm's training, its settings and its critic. The sentences are
macros of `reports/templates/rl.jinja`; this module reads notebook 03's tables into their
contexts (numbers, flags, ids) and writes the tables."""

from __future__ import annotations

import math
import re
from typing import Any

import pandas as pd

from rlxf_utils.artifacts import RunDir
from rlxf_utils.config import CRITIC_INIT
from rlxf_utils.markdown import is_present, markdown_table
from rlxf_utils.report.wording import display_name, name_cells, sentence, spaced, table, value


def moves_context(rows: pd.DataFrame) -> dict[str, Any]:
    """`moves` of `reports/templates/rl.jinja`: how each algorithm's training reward moved
    (`rl.summary_table`'s rows, by algorithm), and the algorithms that log no training reward
    (ILHF from history, the offline methods: they sample nothing while they train)."""
    moved = rows["reward_last"].map(is_present) & rows["reward_first"].map(is_present)
    silent = rows[~moved]
    return {
        "moved": [
            {"algorithm": algo, "first": value(r["reward_first"]), "last": value(r["reward_last"]),
             "first_step": value(r.get("reward_first_step", 1)), "kl": value(r["kl_last"]),
             "step_time_s": value(r["step_time_s"])}
            for algo, r in rows[moved].iterrows()
        ],
        "silent": {"algorithms": list(silent.index),
                   "step_time_s": [value(t) for t in silent["step_time_s"]]},
    }  # fmt: skip


def ppo_context(rows: pd.DataFrame, rl: dict[str, Any]) -> dict[str, Any]:
    """`ppo_sentence`: PPO's critic and β (None where PPO did not run)."""
    r = rows.loc["PPO"] if "PPO" in rows.index else None
    ppo = None if r is None else {
        k: value(r.get(col, math.nan))
        for k, col in (("ev", "explained_variance_last_third"), ("ev_low", "explained_variance_low"),
                       ("ev_high", "explained_variance_high"),
                       ("prior_ev", "explained_variance_prior_last_third"),
                       ("beta_first", "beta_first"), ("beta_last", "beta_last"))
    }  # fmt: skip
    return {"ppo": ppo, **kl_context(rl)}


def kl_context(rl: dict[str, Any]) -> dict[str, Any]:
    """`kl_regime_sentence`: the run's KL control parameters and GRPO's loss."""
    keys = ("adaptive_kl", "kl_coef", "target_kl", "grpo_loss_type", "kl_step_ratio",
            "kl_smoothing")  # fmt: skip
    out = {k: rl[k] for k in keys}
    out["kl_coef_range"] = list(rl["kl_coef_range"])
    return out


def sft_context(sft: pd.DataFrame) -> dict[str, Any]:
    """`sft_sentence`: notebook 03's `sft_summary` rows (none when no supervised stage ran)."""
    cols = ("policy", "examples", "outcomes", "steps", "seconds", "tokens_per_s", "loss_first",
            "loss_last")  # fmt: skip
    runs = [{k: value(r[k]) for k in cols} for _, r in sft.iterrows()]
    for r in runs:
        r["examples"], r["steps"] = int(r["examples"]), int(r["steps"])
    return {"runs": runs}


#: The training log's KL estimators (`rl.core.KL_ESTIMATORS`) in a table cell, by how they start.
KL_SHORT = {"k1": "k1, learner's tokens", "TRL's k3": "TRL's k3", "TRL's k1": "TRL's k1", "no": "·"}


def kl_short(estimator: Any) -> str:
    """A log's `kl_estimator` in a table cell (`KL_SHORT`; '·' when unknown)."""
    return next((v for k, v in KL_SHORT.items() if str(estimator).startswith(k)), "·")


def rl_section(run: RunDir, params: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The RL section's variables (its sentences, macros of `reports/templates/rl.jinja`, and
    the run's settings) and tables, from notebook 03's tables and the run's parameters."""
    stage = "notebook 03_ppo_finetuning"
    summ = run.read_table("rl_summary", stage)
    samples = run.read_table("rl_samples_before_after", stage)
    algo_settings = run.read_table("rl_algorithm_settings", stage)
    sft = run.read_table("sft_summary", stage) if params["sft"]["enabled"] else pd.DataFrame()
    rl, pol = params["rl"], params["policy"]
    critic_init = rl.get("critic_init", "mean")  # runs from before the setting: the head alone
    rows = summ.set_index("algorithm")
    variables = {
        "algorithms": sentence("rl", "algorithms", {"algorithms": list(rows.index)}),
        "steps": str(rl["steps"]),
        "batch_size": str(rl["batch_size"]),
        "moves": sentence("rl", "moves", moves_context(rows)),
        # the template's fields ({arrangement_type}) by the names the reader knows them by
        "template": re.sub(
            r"\{(\w+)\}",
            lambda m: "{" + display_name(m.group(1)) + "}",
            " ".join(rl["prompt_template"].split()),
        ),  # fmt: skip
        "ppo_sentence": sentence("rl", "ppo_sentence", ppo_context(rows, rl)),
        "prompts_per_step": str(rl["batch_size"] // rl["num_generations"]),
        "num_generations": str(rl["num_generations"]),
        "opt_steps": str(rl["update_epochs"] * (rl["batch_size"] // rl["minibatch_size"])),
        "start_policy": display_name(rl["start_policy"]),
        "sft_sentence": sentence("rl", "sft_sentence", sft_context(sft)),
        "critic": sentence("rl", "critic_sentence", {"init": critic_init}),
        "kl_regime": sentence("rl", "kl_regime_sentence", kl_context(rl)),
    }
    includes = {
        # spaces, not underscores: long names wrap in the PDF's narrow columns
        "rl_algorithm_settings.md": markdown_table(
            stacked_columns(
                name_cells(algo_settings.assign(setting=algo_settings["setting"].map(spaced))),
                "setting",
            )
        ),
        "sft_summary.md": markdown_table(name_cells(sft).rename(columns=spaced), floatfmt=".3f")
        if not sft.empty
        else sentence("rl", "sft_table_missing", {}),
        "rl_settings.md": table("rl_settings", rl=rl, pol=pol, critic=CRITIC_INIT[critic_init]),
        "rl_summary.md": table("rl_summary", summ, kl_short=kl_short),
        "rl_samples.md": table("rl_samples", samples),
        "rl_train_experience.md": markdown_table(
            name_cells(_experience_display(run, stage)), floatfmt=".3g"
        ),
    }
    return variables, includes


#: The most algorithm columns a side-by-side table shows at once: more run past the PDF's margin.
MAX_SIDE_BY_SIDE = 7


def stacked_columns(df: pd.DataFrame, key: str, width: int = MAX_SIDE_BY_SIDE) -> pd.DataFrame:
    """A table of one column per algorithm (`key` naming the rows) as blocks of at most `width`
    algorithms stacked in one table: each block after the first opens with a row that repeats
    the header for its algorithms (`key`'s header in the first cell), short blocks padded."""
    cols = [c for c in df.columns if c != key]
    if len(cols) <= width:
        return df
    blocks = [cols[i : i + width] for i in range(0, len(cols), width)]
    heads = [str(c) for c in blocks[0]]
    frames = []
    for n, block in enumerate(blocks):
        part = df[[key, *block]].astype(str)
        part.columns = [key, *heads[: len(block)]]
        if n:
            names = pd.DataFrame([[key, *[str(c) for c in block]]], columns=part.columns)
            part = pd.concat([names, part], ignore_index=True)
        frames.append(part.reindex(columns=[key, *heads], fill_value=""))
    return pd.concat(frames, ignore_index=True)


def _experience_display(run: RunDir, stage: str) -> pd.DataFrame:
    """tables/rl_train_experience.csv as the reader sees it: 'method' for the id column, RL's
    name capitalised, and whether a run resumed from a checkpoint as yes / no."""
    t = run.read_table("rl_train_experience", stage)
    if "resumed" in t:
        t = t.assign(resumed=t["resumed"].map(lambda r: "yes" if bool(r) else "no"))
    t = t.rename(columns={"algo": "method", "contexts_shared_with_rl": "contexts shared with RL",
                          "resumed": "resumed from a checkpoint"})  # fmt: skip
    return t.rename(columns=spaced)
