"""Notebook 04's tables: KL per policy, the summary with gains and tests, the reward-KL frontier
of every snapshot, held-out perplexity and the paper's Table 3."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from rlxf_utils.artifacts import RunDir
from rlxf_utils.evaluation.best_of_n import best_of_n_kl_bound
from rlxf_utils.evaluation.draws import kept_pass
from rlxf_utils.evaluation.measures import text_table
from rlxf_utils.evaluation.sampling import (
    add_rewards,
    apply_cut_rule,
    frame_logprobs,
    sample_tuned,
)
from rlxf_utils.markdown import display_country
from rlxf_utils.models.generation import build_prompts, sampling_kwargs
from rlxf_utils.models.logprobs import kl_estimate, perplexity
from rlxf_utils.models.policies import PolicySet
from rlxf_utils.stats import (
    bootstrap_ci,
    family_alpha,
    paired_table,
    summarise_policies,
)
from rlxf_utils.stats.selection import lee_bounds


def kl_table(samples: pd.DataFrame, generated: Sequence[str], best_of_n: int) -> pd.DataFrame:
    """KL(policy || start policy) per policy, measured the same way for all: Monte-Carlo over the
    policy's own samples (sequence level); for best-of-N the upper bound log N - (N - 1) / N."""
    rows = []
    for pol in generated:
        g = samples[samples["policy"] == pol]
        est = kl_estimate(g["logp_policy"], g["logp_ref"], g["n_tokens"])
        rows.append({"policy": pol, **{k: est[k] for k in ("kl", "kl_se", "kl_per_token")},
                     "kl_kind": "sampled"})  # fmt: skip
    rows.append({"policy": "best_of_n", "kl": best_of_n_kl_bound(best_of_n), "kl_se": 0.0,
                 "kl_kind": "upper bound"})  # fmt: skip
    return pd.DataFrame(rows)


#: Policies whose gain over the start policy no reader asks: the zero-shot model (not tuned from
#: the start policy) and the three references from history (real descriptions: their own
#: contrast, `history.history_contrast`). They keep their Ave(R) and its interval.
NOT_ASKED_VS_START = ("base", "random_policy", "history_met", "history_nonmet")


def vs_start_family(policies: Sequence[str], start: str) -> list[str]:
    """The policies of the vs-start family, in order: every method tuned or selected from the
    start policy (`sft_met`, each algorithm, best-of-N), the question the study asks of each;
    not the start itself nor `NOT_ASKED_VS_START`. Its size m sets the family's level."""
    return [p for p in dict.fromkeys(policies) if p != start and p not in NOT_ASKED_VS_START]


def finished_only(samples: pd.DataFrame) -> pd.DataFrame:
    """The responses that ended before the token cap (`finished` true; a history reference: its
    description fits in the cap). Which responses finish is an outcome of the policy, so the
    gain among finished responses, on the prompts where both policies finished one, compares two
    differently selected subsets: a description of that subset, never a check of the full gain.
    What it can say about the answers that would finish under either policy is bounded by
    `finished_bounds` (Lee's trimming bounds within countries)."""
    if "finished" not in samples:
        return samples.iloc[:0]
    return samples[samples["finished"].eq(True)]


def finished_shares(samples: pd.DataFrame) -> pd.DataFrame:
    """The responses with a `finished` value (generated text, and history's descriptions: whether
    each fits in the evaluation's cap), with `finished_share` 1.0 where the response ended before
    the cap and 0.0 where it was cut: per prompt its mean is the policy's finished share there."""
    if "finished" not in samples:
        return samples.iloc[:0].assign(finished_share=pd.Series(dtype=float))
    rows = samples.dropna(subset=["finished"])
    return rows.assign(finished_share=rows["finished"].astype(bool).astype(float))


#: The Lee bounds' columns in the summary, per judge prefix (`gain_finished`, ...): the bounds,
#: the interval that covers them and the prompts they rest on.
LEE_COLUMNS = {"lee_lower": "lower", "lee_upper": "upper", "lee_low": "low", "lee_high": "high",
               "lee_prompts": "prompts"}  # fmt: skip


def finished_bounds(samples: pd.DataFrame, start: str, col: str, policies: Sequence[str],
                    alpha: float) -> pd.DataFrame:  # fmt: skip
    """Per policy of `policies`, Lee's trimming bounds within countries on its gain in `col` over
    the start policy among responses that would finish under either (`stats.selection.lee_bounds`:
    clusters are countries; the interval around the bounds at the family's level
    `stats.family_alpha(alpha, m)`, m the policies bounded), one row each (`policy` and
    `LEE_COLUMNS`' sources)."""
    fam = [p for p in policies if p in set(samples["policy"])]
    if start not in set(samples["policy"]) or not fam or "finished" not in samples:
        return pd.DataFrame(columns=["policy", *LEE_COLUMNS.values()])
    a = family_alpha(alpha, len(fam))
    rows = [{"policy": p, **lee_bounds(samples, p, start, col, cluster_col="country", alpha=a)}
            for p in fam]  # fmt: skip
    return pd.DataFrame(rows)


def summary_table(
    samples: pd.DataFrame,
    generated: Sequence[str],
    start: str,
    best_n: int,
    n_boot: int,
    alpha: float,
    seed: int,
    margin: float | None = None,
    power: float = 0.8,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(policy x measures with CIs, paired tests vs the start policy for reward and audit reward).

    Every CI and test treats the prompt's country as the unit (a cluster bootstrap of Ave(R), a
    cluster t interval of the paired gains): prompts of one country share it in both the prompt
    and the reward model's input, so they are not independent. The paired gains are one family
    per measure, `vs_start_family` (each at its simultaneous level; the other policies' gain
    columns are NaN), each with its verdict at the equivalence `margin` (`{prefix}_verdict`),
    its bound and its MDE at `power` (`{prefix}_mde`). `gap` is the gain under the reward minus
    the gain under the audit, per prompt; `gain_finished` and `audit_gain_finished` the gains
    among finished responses only (`finished_only`: one family per judge, of the members with a
    finished response on a prompt where the start policy has one), a description of a subset the
    policies select, with its Lee bounds `{prefix}_lee_lower`, `_lee_upper`, the interval that
    covers them `_lee_low`, `_lee_high` and its `_lee_prompts` (`finished_bounds`);
    `finished_gain` the change in the share of responses finished before the cap against the
    start policy (`finished_shares`: a family of its own, every generated member with a share);
    `gain_as_written` and `audit_gain_as_written` the gains with every cut response scored as
    written (`evaluation.sampling.apply_cut_rule`: the cut rule's sensitivity); `finished`
    each policy's share of responses that ended before the evaluation's cap. `reward_sd` is the mean SD
    of the reward heads' P(MET) (`reward.uncertainty`) with its CI and `sd_gain` its paired
    change against the start policy (NaN where no response has one).
    """
    kw = dict(n_boot=n_boot, alpha=alpha, seed=seed, cluster_col="country")
    pkw = dict(kw, policies=vs_start_family(samples["policy"].unique(), start), margin=margin,
               power=power)  # fmt: skip
    samples = samples.assign(reward_minus_audit=samples["reward"] - samples["audit_reward"])
    rew = summarise_policies(samples, "reward", **kw)
    aud = summarise_policies(samples, "audit_reward", **kw)
    grd = summarise_policies(
        samples.dropna(subset=["grounded_met_rate"]), "grounded_met_rate", **kw
    )
    with_sd = samples.dropna(subset=["reward_sd"]) if "reward_sd" in samples else samples.iloc[:0]
    sd_paired = (
        [paired_table(with_sd, start, "reward_sd", **pkw).assign(measure="reward_sd")]
        if start in set(with_sd["policy"])
        else []
    )
    done = finished_only(samples)
    fin_paired = [
        paired_table(done, start, col, **pkw).assign(measure=f"{col}_finished")
        for col in ("reward", "audit_reward")
        if start in set(done["policy"])
    ]
    # the finished share as its own family (issue 78): a gain scored with cut responses as failed
    # is a change in the share finished times the mean score plus the share times the change in
    # that score, so length enters every gain; this family shows the first part beside it
    shares = finished_shares(samples)
    share_family = [p for p in pkw["policies"] if p in set(shares["policy"])]
    share_paired = (
        [paired_table(shares, start, "finished_share", **{**pkw, "policies": share_family})
         .assign(measure="finished_share")]
        if start in set(shares["policy"]) and share_family
        else []
    )  # fmt: skip
    # the sensitivity reading of the cut rule: every response scored as written
    as_written = [
        paired_table(samples, start, f"{col}_as_written", **pkw).assign(measure=f"{col}_as_written")
        for col in ("reward", "audit_reward")
        if f"{col}_as_written" in samples and start in set(samples["policy"])
    ]
    paired = pd.concat(
        [
            paired_table(samples, start, "reward", **pkw).assign(measure="reward"),
            paired_table(samples, start, "audit_reward", **pkw).assign(measure="audit_reward"),
            paired_table(samples, start, "reward_minus_audit", **pkw).assign(measure="gap"),
            *sd_paired,
            *fin_paired,
            *share_paired,
            *as_written,
        ],
        ignore_index=True,
    )
    text = text_table(samples)
    kl = kl_table(samples, generated, best_n)
    ppl = {
        pol: perplexity(g["logp_base"], g["n_tokens"])
        for pol, g in samples.groupby("policy", sort=False)
    }
    out = rew[
        ["policy", "n_prompts", "n_clusters", "n_samples", "ave_r", "ci_low", "ci_high"]
    ].rename(columns={"ci_low": "ave_r_low", "ci_high": "ave_r_high"})
    out = out.merge(
        aud[["policy", "ave_r", "ci_low", "ci_high"]].rename(
            columns={"ave_r": "audit", "ci_low": "audit_low", "ci_high": "audit_high"}
        ),
        on="policy",
    )
    for measure, prefix in (("reward", "gain"), ("audit_reward", "audit_gain"), ("gap", "gap"),
                            ("reward_sd", "sd_gain"), ("reward_finished", "gain_finished"),
                            ("audit_reward_finished", "audit_gain_finished"),
                            ("finished_share", "finished_gain"),
                            ("reward_as_written", "gain_as_written"),
                            ("audit_reward_as_written", "audit_gain_as_written")):  # fmt: skip
        p = paired[paired["measure"] == measure].set_index("policy")
        out[prefix] = out["policy"].map(p["mean_diff"])
        out[f"{prefix}_low"] = out["policy"].map(p["ci_low"])
        out[f"{prefix}_high"] = out["policy"].map(p["ci_high"])
        out[f"{prefix}_p_family"] = out["policy"].map(p["p_family"])
        out[f"{prefix}_verdict"] = out["policy"].map(p["verdict"]) if len(p) else None
        out[f"{prefix}_mde"] = out["policy"].map(p["mde"]) if len(p) else math.nan
    for col, prefix in (("reward", "gain_finished"), ("audit_reward", "audit_gain_finished")):
        lee = finished_bounds(samples, start, col, pkw["policies"], alpha).set_index("policy")
        for name, src in LEE_COLUMNS.items():
            out[f"{prefix}_{name}"] = out["policy"].map(lee[src]).astype(float)
    out = out.merge(kl[["policy", "kl", "kl_se", "kl_kind"]], on="policy", how="left")
    out["perplexity"] = out["policy"].map(ppl)
    out["finished"] = out["policy"].map(shares.groupby("policy")["finished_share"].mean())
    if "reward_truncated" in samples:  # the reward model read only the beginning of the input
        cut_in = samples.dropna(subset=["reward_truncated"]).groupby("policy")["reward_truncated"]
        out["reward_truncated"] = out["policy"].map(cut_in.mean().astype(float))
    out = out.merge(text[["policy", "mean_words", "distinct_2", "rep_3"]], on="policy")
    out = out.merge(
        grd[["policy", "ave_r", "ci_low", "ci_high"]].rename(
            columns={"ave_r": "grounded_met", "ci_low": "grounded_low", "ci_high": "grounded_high"}
        ),
        on="policy",
        how="left",
    )
    out["max_sim"] = out["policy"].map(samples.groupby("policy")["max_sim"].mean())
    sd = summarise_policies(with_sd, "reward_sd", **kw).set_index("policy") if len(with_sd) else None  # fmt: skip
    for col, src in (("reward_sd", "ave_r"), ("reward_sd_low", "ci_low"), ("reward_sd_high", "ci_high")):  # fmt: skip
        out[col] = out["policy"].map(sd[src]).astype(float) if sd is not None else math.nan
    return out, paired


def frontier_points(
    pset: PolicySet,
    run: RunDir,
    prompts: Sequence[str],
    contexts: Sequence[Mapping[str, Any]],
    reward_model: Any,
    audit_model: Any,
    cfg: Any,
    timer: Any,
    progress: bool = True,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Reward, audit reward and KL of every algorithm's snapshots (evenly thinned to the
    configured count; the final policies are measured with the full sample count elsewhere), and
    the snapshots' samples (`algo`, `step`, `prompt_id`, rewards and log-probs: the
    over-optimisation curve's per-prompt gains). Each snapshot's samples and log-probs are kept
    in `eval/draws/` (`draws.kept_pass`), so a rerun samples only the snapshots that changed."""
    ec, rl = cfg.evaluation, cfg.rl
    rows, frames = [], []
    for algo in pset.algos:
        for path in frontier_snapshots(run, algo, cfg):
            step = snapshot_step(path)
            df = snapshot_draw(pset, run, prompts, cfg, timer, algo, path, progress)
            add_rewards(df, contexts, reward_model, audit_model, rl.reward_batch_size,
                        cut_responses=ec.cut_responses)  # fmt: skip
            per = df.groupby("prompt_id")["reward"].mean()
            ave, lo, hi = bootstrap_ci(per, ec.n_boot, ec.alpha, cfg.run.seed,
                                          clusters=[contexts[i]["country"] for i in per.index])  # fmt: skip
            kl = kl_estimate(df["logp_policy"], df["logp_ref"], df["n_tokens"])
            rows.append({"algo": algo, "step": step, "reward": ave, "reward_low": lo, "reward_high": hi,
                         "audit_reward": df["audit_reward"].mean(), "kl": kl["kl"], "kl_se": kl["kl_se"],
                         "source": "snapshot"})  # fmt: skip
            keep = ["prompt_id", "sample_id", "reward", "audit_reward", "finished", "logp_policy",
                    "logp_ref"]  # fmt: skip
            frames.append(df[[c for c in keep if c in df]].assign(algo=algo, step=step))
    return pd.DataFrame(rows), (pd.concat(frames, ignore_index=True) if frames else pd.DataFrame())


def snapshot_step(path: Path) -> int:
    """The training step of a snapshot's adapter file (`.../step_0008/adapter_model.safetensors`)."""
    return int(path.parent.name.split("_")[1])


def frontier_snapshots(run: RunDir, algo: str, cfg: Any) -> list[Path]:
    """The adapter files of `algo`'s snapshots on the frontier: those before its last step (the
    final policy is measured apart), evenly thinned to `evaluation.frontier_max_checkpoints`."""
    last = trained_steps(run, algo, cfg.rl.steps)
    snaps = [
        path
        for path in sorted(run.path(f"policy/{algo}/snapshots").glob("step_*/adapter_model.safetensors"))
        if snapshot_step(path) < last
    ]  # fmt: skip
    most = cfg.evaluation.frontier_max_checkpoints
    if most and len(snaps) > most:
        keep = np.linspace(0, len(snaps) - 1, most).round().astype(int)
        snaps = [snaps[i] for i in sorted(set(keep))]
    return snaps


def snapshot_draw(pset: PolicySet, run: RunDir, prompts: Sequence[str], cfg: Any, timer: Any,
                  algo: str, path: Path, progress: bool = True) -> pd.DataFrame:  # fmt: skip
    """One snapshot's samples with their log-probs under it and the start policy, kept in
    `eval/draws/` (`draws.kept_pass`): what `frontier_points` scores, and what an evaluation
    lane (`evaluation.lanes`) draws ahead of it."""
    ec = cfg.evaluation
    gen_kw = sampling_kwargs(cfg, progress, trained=True)
    step = snapshot_step(path)

    def sample() -> pd.DataFrame:
        name = pset.load_snapshot(algo, path)
        df = sample_tuned(pset, name, prompts, ec.frontier_samples_per_prompt, gen_kw,
                          ec.logprob_batch_size, desc=f"{algo} step {step}", judges=False)  # fmt: skip
        with pset.reference() as ref:
            df["logp_ref"] = frame_logprobs(ref, pset.tok, df, ec.logprob_batch_size)
        return df

    return kept_pass(cfg, run, "frontier", algo, prompts,
                     {**gen_kw, "logprob_batch": ec.logprob_batch_size}, sample, timer,
                     f"frontier {algo} step {step}", ec.frontier_samples_per_prompt, path)  # fmt: skip


def table3(pset: PolicySet, contexts: Sequence[Mapping[str, Any]], labelled: pd.DataFrame,
           reward_model: Any, audit_model: Any, cfg: Any, run: RunDir, timer: Any) -> pd.DataFrame:  # fmt: skip
    """The paper's Table 3: its completion prompts for held-out countries, pre- and post-RL.
    Each policy's completions are kept in `eval/draws/` (`draws.kept_pass`): a rerun or a
    further seed completes only the policies whose weights changed; all are scored again."""
    ec, rl = cfg.evaluation, cfg.rl
    items, prompts, ctx = table3_prompts(contexts, labelled, cfg)
    rows = []
    for name in pset.names:
        df = table3_draw(pset, cfg, run, timer, name, prompts)
        df["reward"] = reward_model.score(
            ctx, df["response"].tolist(), batch_size=rl.reward_batch_size
        )
        df["audit_reward"] = audit_model.score(ctx, df["response"].tolist())
        apply_cut_rule(df, ec.cut_responses)  # the rule every evaluated response is scored by
        r, a = df["reward"], df["audit_reward"]
        for (c, sc), p, text, rr, aa in zip(items, prompts, df["response"], r, a, strict=True):
            rows.append({"country": c, "econ_descriptor": sc.econ_descriptor, "prompt": p, "policy": name,
                         "response": text, "reward": float(rr), "audit_reward": float(aa)})  # fmt: skip
    return pd.DataFrame(rows)


def table3_prompts(contexts: Sequence[Mapping[str, Any]], labelled: pd.DataFrame,
                   cfg: Any) -> tuple[list[tuple[str, Any]], list[str], list[dict[str, Any]]]:  # fmt: skip
    """Table 3's (country, scenario) items, their completion prompts and their contexts: the
    `evaluation.table3_countries` held-out countries with the most prompts, each country's most
    frequent arrangement type."""
    ec = cfg.evaluation
    counts = pd.Series([c["country"] for c in contexts]).value_counts(sort=False)
    countries = (
        counts.rename_axis("country").reset_index(name="n")
        .sort_values(["n", "country"], ascending=[False, True])["country"].head(ec.table3_countries).tolist()
    )  # fmt: skip
    arrangement = labelled.groupby("country")["arrangement_type"].agg(
        lambda s: s.value_counts().index[0]
    )
    items = [(c, sc) for c in countries for sc in ec.table3_scenarios]
    prompts = [sc.prompt.format(country=display_country(c)) for c, sc in items]
    ctx = [
        {"country": c, "arrangement_type": arrangement[c], "econ_descriptor": sc.econ_descriptor}
        for c, sc in items
    ]
    return items, prompts, ctx


def table3_draw(pset: PolicySet, cfg: Any, run: RunDir, timer: Any, name: str,
                prompts: Sequence[str]) -> pd.DataFrame:  # fmt: skip
    """Policy `name`'s Table 3 completions, kept in `eval/draws/` (`draws.kept_pass`)."""
    kw = sampling_kwargs(cfg, False)
    return kept_pass(cfg, run, "table3", name, prompts, kw,
                     lambda: pset.generate(name, prompts, 1, f"Table 3 {name}", kw),
                     timer, f"table 3 {name}")  # fmt: skip


def heldout_perplexity(pset: PolicySet, rows: pd.DataFrame, template: str, cfg: Any,
                       batch: int, run: RunDir, timer: Any) -> tuple[pd.DataFrame, pd.DataFrame]:  # fmt: skip
    """Perplexity of held-out historical descriptions (+ end token) after their context's RL
    prompt, under every generated policy: MET and Non-MET rows separately, and all together;
    and per row and policy (`row`, `country`, `y`, `nll` summed over its `n_tokens`), for
    per-country intervals (the population cross-entropy of the ILHF comparison).

    The rows are of held-out (eval) countries, which neither SFT nor RL saw; a policy that writes
    MONA conditions finds them far likelier than the zero-shot base does.

    Each policy's log-probs are kept in `eval/draws/` (`draws.kept_pass`), so a rerun or a
    further seed scores only the policies whose weights changed.
    """
    y = rows["y"].to_numpy()
    out, per_row = [], []
    for name in pset.names:
        kept = heldout_draw(pset, rows, template, cfg, batch, run, timer, name)
        lp, n = kept["lp"].to_numpy(), kept["n"].to_numpy()
        per_row.append(pd.DataFrame({"policy": name, "row": np.arange(len(rows)),
                                     "country": rows["country"].astype(str).to_numpy(), "y": y,
                                     "nll": -np.asarray(lp, float), "n_tokens": n}))  # fmt: skip
        rec = {"policy": name, "rows": len(rows)}
        for label, sel in (("met", y == 1), ("nonmet", y == 0), ("all", np.ones_like(y, bool))):
            rec[f"ppl_{label}"] = perplexity(lp[sel], n[sel]) if sel.any() else math.nan
            rec[f"nll_{label}"] = float(-lp[sel].sum() / n[sel].sum()) if sel.any() else math.nan
        out.append(rec)
    return pd.DataFrame(out), pd.concat(per_row, ignore_index=True)


def heldout_draw(pset: PolicySet, rows: pd.DataFrame, template: str, cfg: Any, batch: int,
                 run: RunDir, timer: Any, name: str) -> pd.DataFrame:  # fmt: skip
    """Policy `name`'s log-probs (`lp`) and token counts (`n`) of the held-out descriptions
    `rows` (+ end token) after their context's RL prompt, kept in `eval/draws/`."""
    prompts = build_prompts(rows.to_dict("records"), pset.tok, template, cfg.policy)
    texts = [" ".join(str(t).split()) for t in rows["description"]]
    settings = {"texts": hashlib.sha256("\0".join(texts).encode()).hexdigest(),
                "batch_size": int(batch), "append_eos": True, "padding_side": "left"}  # fmt: skip

    def score() -> pd.DataFrame:
        lp, n = pset.sequence_logprobs(name, prompts, texts, batch, append_eos=True,
                                       padding_side="left")  # fmt: skip
        return pd.DataFrame({"lp": lp, "n": n})

    return kept_pass(cfg, run, "perplexity", name, prompts, settings, score, timer,
                     f"held-out perplexity {name}")  # fmt: skip


def trained_steps(run: RunDir, algo: str, default: int) -> int:
    """How many training steps `algo`'s final policy took (its `settings.json`'s `steps`; ILHF
    from history counts its steps in pairs, not in RL's batches), or `default` (`rl.steps`) for
    a run that did not record them."""
    rel = f"policy/{algo}/settings.json"
    if not run.exists(rel):
        return default
    return int(run.read_json(rel, stage="notebook 03_ppo_finetuning").get("steps") or default)
