"""The alignment-evaluation stage (notebook 04): every policy on the held-out contexts, measured.

`evaluation.inputs.load_inputs` loads the models, contexts and policies once; each family of `evaluation.families.EVAL_FAMILIES` then
runs in turn, a small function of the `Evaluation` so far (the samples first, then the measures
on them) that returns its tables, its entries of `eval/summary.json`, its figures and files
(`Measured`) and what later families read; the stage writes them all at the end.

Policies: `base` (the zero-shot model), the supervised `sft` and `sft_met` (LoRA adapters on the
base), each RL algorithm (`ppo`, `grpo`, `rloo`: LoRA adapters on the start policy, i.e. the base
with `sft` merged in), `best_of_n` (N start-policy candidates per prompt, drawn independently of
the start policy's own samples, the reward model keeps one), and three references drawn from
history for the same contexts: real MET descriptions (`history_met`), real Non-MET descriptions
(`history_nonmet`) and the paper's `random_policy` (real descriptions drawn at random).

Two sets of weights are loaded (the base and the start policy); adapters are switched on them.
Every generated response is scored under three models: the policy itself (`logp_policy`), the
start policy RL was regularised towards (`logp_ref`: KL is measured the same way for every
policy, sequence-level on its own samples) and the zero-shot base (`logp_base`: the perplexity
of the outputs, one fixed judge for all). Every generated policy uses the same prompts, sampling
settings and seed (`run.seed`; the RL algorithms' policies their training seed, the same unless
`rl.seed` is set, as in `rlxf seeds`' further seeds, which so draw their own samples against the
shared start-policy ones). Gains and paired tests are against the start policy. Written to the
run dir:

* `eval/draws/`: each policy's samples and best-of-N's pool as drawn, kept for a rerun or a
  further seed to read back (`evaluation.draws`);
* `eval/samples.parquet` and `eval/samples.jsonl`: one row per response (context, text, reward,
  the reward heads' SD of P(MET) `reward_sd` (`reward.uncertainty`), audit reward, log-probs,
  whether it finished before the cap, grounding);
* `eval/frontier.parquet`: reward, audit reward and KL of every algorithm's snapshots and final
  policy, and the best-of-N curve (N = `best_of_n_curve`, KL at its upper bound);
* `eval/heldout_perplexity.parquet`: perplexity of held-out historical descriptions (MET and
  Non-MET) under every policy;
* `eval/historical_index/`: MiniLM embeddings of every labelled MONA description no policy trained
  on (the policy pool left out; cached);
* `eval/summary.json` and tables `eval_*`, figures `eval_*`; among them the RLGF paper's
  evaluation (`evaluation.rlgf`): tables `eval_rlgf`, `eval_prompt_difficulty`, `eval_easy_hard`,
  `eval_guidance` and figures `eval_reward_perplexity`, `eval_easy_hard`; and the ILHF paper's
  (`evaluation.ilhf`): tables `eval_inclusive`, `eval_inclusive_tests` and figure `eval_inclusive`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pandas as pd

from rlxf_utils.artifacts import RunDir
from rlxf_utils.evaluation.families import EVAL_FAMILIES
from rlxf_utils.evaluation.inputs import Evaluation, load_inputs
from rlxf_utils.evaluation.lanes import run_draw_lanes

#: `eval/summary.json`'s entries, in order: the settings' and the families'.
SUMMARY_KEYS = (
    "algorithms", "start_policy", "max_new_tokens", "rl_max_new_tokens", "cut_responses",
    "policies", "best_of_n_curve", "vs_best_of_n", "overoptimisation", "need_rl", "heldout_perplexity", "n_prompts", "samples_per_prompt",
    "best_of_n", "alpha", "power", "equivalence_margin", "kl_match_ratio", "kl_budgets", "kl_budget_span", "kl_budget_reach", "headline", "control",
    "target_mde", "families", "interval",
    "cluster", "history_contrast", "reference_rows", "summary", "reused_draws", "lanes", "seconds",
)  # fmt: skip


@dataclass
class EvalStage:
    """What notebook 04 computes (also written to the run dir)."""

    samples: pd.DataFrame
    summary: pd.DataFrame
    paired: pd.DataFrame
    frontier: pd.DataFrame
    table3: pd.DataFrame
    algos: list[str]
    tables: dict[str, pd.DataFrame]


def run_evaluation_stage(cfg: Any, run: RunDir, progress: bool = True) -> EvalStage:
    """Generate, score, ground and compare every policy on the held-out contexts; write it all.
    The draws first, in side-by-side processes where `evaluation.lanes.lanes_apply` allows: the
    families then read them back from `eval/draws/`."""
    lanes = run_draw_lanes(cfg, run, echo=print if progress else None)
    inp = load_inputs(cfg, run, progress)
    ev = Evaluation(inp)
    ec = cfg.evaluation
    entries: dict[str, Any] = {
        "algorithms": inp.algos,
        "start_policy": inp.start,
        # evaluation's own token cap, RL's, and the rule a response still cut at it is scored by
        "max_new_tokens": cfg.eval_max_new_tokens,
        "rl_max_new_tokens": cfg.rl.max_new_tokens,
        "cut_responses": ec.cut_responses,
        "alpha": ec.alpha,
        "power": ec.power,
        "equivalence_margin": ec.equivalence_margin,
        "target_mde": ec.target_mde,
        # the draws' side-by-side processes: their tasks and wall seconds (0 lanes: the kernel drew)
        "lanes": lanes,
    }
    figures: dict[str, Any] = {}
    files: dict[str, pd.DataFrame] = {}
    for measure in EVAL_FAMILIES.values():
        measured = measure(ev)
        ev.take(measured)
        entries |= measured.entries
        figures |= measured.figures
        files |= measured.files
    with inp.timer("writing"):
        # wall time per phase, up to this write (a draw read back: the seconds it took when drawn)
        entries["seconds"] = dict(inp.timer.seconds)
        entries["reused_draws"] = list(inp.timer.reused)
        _write(run, ev.tables, figures, files,
               {key: entries[key] for key in SUMMARY_KEYS if key in entries})  # fmt: skip
    return EvalStage(ev.samples, ev.summary, ev.paired, ev.frontier, ev.tables["eval_table3"],
                     inp.algos, ev.tables)  # fmt: skip


def _write(run: RunDir, tables: Mapping[str, pd.DataFrame], figures: Mapping[str, Any],
           files: Mapping[str, pd.DataFrame], summary: Mapping[str, Any]) -> None:  # fmt: skip
    import matplotlib.pyplot as plt

    for rel, df in files.items():
        if rel.endswith(".jsonl"):
            run.write_jsonl(rel, df.to_dict("records"))
        else:
            run.write_parquet(rel, df)
    for name, df in tables.items():
        run.write_table(name, df)
    for name, fig in figures.items():
        run.write_figure(name, fig)
        plt.close(fig)
    run.write_json("eval/summary.json", summary)
