"""What the working paper says about stages 02-05, computed from the run directory.

Each `*_section(run)` returns `(variables, includes)`: values that the report's prose quotes
through `{{< var stage.key >}}` (numbers formatted once, here, and sentences whose wording
depends on a result, e.g. whether a test rejected) and compact markdown tables written to
`_generated/`. Nothing is typed into the report source: a missing artifact raises
`ArtifactMissing` naming the file and the notebook that writes it.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from .artifacts import RunDir, fmt_num, fmt_pct, is_present, markdown_table
from .evaluation import best_of_n_kl_bound
from .models import display_country

__all__ = ["SECTIONS", "eval_section", "reward_section", "risk_section", "rl_section"]

PAPER_CLAIM = 0.82  # the paper's reported accuracy / precision / recall / F1 ("surpassing 82%")


f3 = fmt_num  # three decimals, 'n/a' when missing
pct = fmt_pct


def ci(mid: float, low: float, high: float) -> str:
    return f"{f3(mid)} [{f3(low)}, {f3(high)}]"


def pval(p: float) -> str:
    if not is_present(p):
        return "n/a"
    return "<0.001" if p < 0.001 else f"{p:.3f}"


def _short(text: Any, n: int = 160) -> str:
    s = " ".join(str(text).split())
    return s if len(s) <= n else s[: n - 1].rstrip() + "…"


def listing(items: list[str]) -> str:
    """'a', 'a and b', 'a, b and c'."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


# ---------------------------------------------------------------------------------------------
# 02 reward model
# ---------------------------------------------------------------------------------------------
def reward_section(run: RunDir) -> tuple[dict[str, Any], dict[str, str]]:
    stage = "notebook 02_reward_model"
    meta = run.read_json("reward/metrics.json", stage=stage)
    m = pd.DataFrame(meta["metrics"])
    cal = pd.DataFrame(meta["calibration"])
    src, proto = meta["reward_source"], meta["reward_protocol"]
    main = "encoder" if src == "encoder" else "tfidf"
    protocols = list(dict.fromkeys(m["protocol"]))
    acc = m.pivot(index="protocol", columns="model", values="accuracy").loc[protocols]
    has_enc = "encoder" in acc.columns

    rows = []
    for p in protocols:
        g = m[m["protocol"] == p].set_index("model")
        for model, label in (
            ("majority", "majority class"),
            ("tfidf", "TF-IDF + LR"),
            ("encoder", "fine-tuned encoder"),
        ):
            if model in g.index:
                r = g.loc[model]
                rows.append({"protocol": p, "model": label, "accuracy": r["accuracy"], "precision": r["precision"],
                             "recall": r["recall"], "F1": r["f1"], "macro-F1": r["macro_f1"], "AUC": r["roc_auc"],
                             "Brier": r["brier"], "ECE": r["ece"]})  # fmt: skip
    metrics_md = markdown_table(pd.DataFrame(rows))

    best_acc = float(acc.drop(columns=["context_only", "text_only"], errors="ignore").max().max())
    reached = [p for p in protocols if (m[(m.protocol == p) & m.model.isin(["tfidf", "encoder"])][["accuracy", "precision", "recall", "f1"]] > PAPER_CLAIM).all(axis=1).any()]  # fmt: skip
    paper_verdict = (
        f"no model reaches the paper's {PAPER_CLAIM:.0%} on all four measures under any protocol; the best accuracy is {pct(best_acc)}"
        if not reached
        else f"the paper's {PAPER_CLAIM:.0%} on all four measures is reached under the {listing(reached)} protocol(s)"
    )
    if has_enc:
        wins = [p for p in protocols if acc.loc[p, "encoder"] > acc.loc[p, "tfidf"]]
        enc_vs = (
            "the fine-tuned encoder is more accurate than TF-IDF + LR under every protocol"
            if len(wins) == len(protocols)
            else "TF-IDF + LR is at least as accurate as the fine-tuned encoder under every protocol"
            if not wins
            else f"the fine-tuned encoder is more accurate than TF-IDF + LR only under the {listing(wins)} protocol(s)"
        )
    else:
        enc_vs = "no encoder was trained in this run"
    cal_main = cal[(cal["protocol"] == proto) & (cal["model"] == main)].iloc[0]
    cal_md = markdown_table(
        cal[["protocol", "model", "temperature", "test_ece_before", "test_ece_after", "test_brier_before", "test_brier_after"]]
        .rename(columns={"test_ece_before": "ECE before", "test_ece_after": "ECE after",
                         "test_brier_before": "Brier before", "test_brier_after": "Brier after"})
    )  # fmt: skip
    wc = m[m["protocol"] == proto].set_index("model")
    within_md = markdown_table(
        m[m["model"].isin(["tfidf", "encoder", "context_only", "text_only"])][
            ["protocol", "model", "roc_auc", "auc_within_country", "auc_within_area"]
        ].rename(columns={"roc_auc": "AUC", "auc_within_country": "AUC within country", "auc_within_area": "AUC within area"})
    )  # fmt: skip
    ctx_auc, txt_auc = wc.loc["context_only", "roc_auc"], wc.loc["text_only", "roc_auc"]
    timing = meta.get("timing", {}).get(proto, {})
    mm = wc.loc[main]
    variables = {
        "source": "fine-tuned encoder" if src == "encoder" else "TF-IDF + logistic regression",
        "protocol": proto,
        "paper_verdict": paper_verdict,
        "encoder_vs_tfidf": enc_vs,
        "main_accuracy": pct(mm["accuracy"]),
        "main_auc": f3(mm["roc_auc"]),
        "main_f1": f3(mm["f1"]),
        "majority_accuracy": pct(wc.loc["majority", "accuracy"]),
        "temperature": f"{cal_main['temperature']:.2f}",
        "ece_before": f3(cal_main["test_ece_before"]),
        "ece_after": f3(cal_main["test_ece_after"]),
        "brier_before": f3(cal_main["test_brier_before"]),
        "brier_after": f3(cal_main["test_brier_after"]),
        "calibration_verdict": "lowered"
        if cal_main["test_ece_after"] < cal_main["test_ece_before"]
        else "did not lower",
        "context_only_auc": f3(ctx_auc),
        "text_only_auc": f3(txt_auc),
        "within_country_auc": f3(mm["auc_within_country"]),
        "within_area_auc": f3(mm["auc_within_area"]),
        "reads_text": (
            "the text alone carries more signal than the context fields alone"
            if txt_auc > ctx_auc
            else "the context fields alone carry at least as much signal as the text, so much of the reward is a prior over contexts"
        ),
        "encoder_train_s": f"{timing.get('encoder_train_s', float('nan')):.0f}",
        "score_texts_per_s": f"{timing.get('encoder_score_texts_per_s', float('nan')):.0f}",
    }
    return variables, {
        "reward_metrics.md": metrics_md,
        "reward_calibration.md": cal_md,
        "reward_within.md": within_md,
    }


# ---------------------------------------------------------------------------------------------
# 03 RL fine-tuning
# ---------------------------------------------------------------------------------------------
def rl_section(run: RunDir, params: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    stage = "notebook 03_ppo_finetuning"
    summ = run.read_table("rl_summary", stage)
    samples = run.read_table("rl_samples_before_after", stage)
    algo_settings = run.read_table("rl_algorithm_settings", stage)
    sft = run.read_table("sft_summary", stage) if params["sft"]["enabled"] else pd.DataFrame()
    rl, pol = params["rl"], params["policy"]
    settings = pd.DataFrame(
        [
            ("policy", pol["model"] if pol["model"] != "embedded" else "SmolLM2-135M-Instruct (embedded)"),
            ("LoRA rank / alpha / targets", f"{pol['lora']['rank']} / {pol['lora']['alpha']} / {', '.join(pol['lora']['target_modules'])}"),
            ("start policy (and KL reference)", rl["start_policy"]),
            ("steps x prompts x responses per prompt", f"{rl['steps']} x {rl['batch_size'] // rl['num_generations']} x {rl['num_generations']}"),
            ("max new tokens, temperature, top-p", f"{rl['max_new_tokens']}, {rl['temperature']}, {rl['top_p']}"),
            ("learning rate", f"{rl['learning_rate']:g}"),
            ("KL coefficient (initial), PPO adaptive, target, K_beta", f"{rl['kl_coef']:g}, {rl['adaptive_kl']}, {rl['target_kl']:g}, {rl['kl_adapt_rate']:g}"),
            ("update epochs x minibatches (optimiser steps per batch, every algorithm)", f"{rl['update_epochs']} x {rl['batch_size'] // rl['minibatch_size']}"),
            ("PPO clip (policy / value), value coefficient", f"{rl['clip_range']} / {rl['clip_range_value'] if rl['clip_range_value'] is not None else 'none'}, {rl['vf_coef']:g}"),
            ("mixed precision", pol.get("autocast") or "none (fp32)"),
            ("GAE gamma / lambda", f"{rl['gamma']} / {rl['lam']}"),
            ("training prompts", "all training contexts" if rl["max_prompts"] is None else str(rl["max_prompts"])),
        ],
        columns=["setting", "value"],
    )  # fmt: skip
    shown = samples.assign(
        response=samples["response"].map(_short), country=samples["country"].map(display_country)
    )[["policy", "country", "econ_descriptor", "response", "reward"]]
    rows = summ.set_index("algorithm")
    ppo_sentence = ""
    if "PPO" in rows.index:
        r = rows.loc["PPO"]
        ev_word = "positive" if r["explained_variance_last_third"] > 0 else "not positive"
        if rl["adaptive_kl"]:
            beta = (f"β, adapted towards {rl['target_kl']:g} nats with K_β = {rl['kl_adapt_rate']:g}, moved from "
                    f"{r['beta_first']:.4f} to {r['beta_last']:.4f}")  # fmt: skip
        else:
            beta = f"β stayed fixed at {r['beta_first']:.4f}"
        ppo_sentence = (
            f"PPO's critic explained {ev_word} variance of the returns over the last third of its steps "
            f"(mean {r['explained_variance_last_third']:.2f}); {beta}"
        )
    moves = []
    for algo, r in rows.iterrows():
        d = r["reward_last"] - r["reward_first"]
        moves.append(
            f"{algo}'s mean training reward went from {f3(r['reward_first'])} to {f3(r['reward_last'])} "
            f"({'+' if d >= 0 else '−'}{abs(d):.3f}) at a final KL of {r['kl_last']:.2f} nats, "
            f"{r['step_time_s']:.0f} s per step"
        )
    variables = {
        "algorithms": listing([a for a in rows.index]),
        "steps": str(rl["steps"]),
        "batch_size": str(rl["batch_size"]),
        "moves": "; ".join(moves),
        "template": " ".join(rl["prompt_template"].split()),
        "ppo_sentence": ppo_sentence or "PPO did not run",
        "prompts_per_step": str(rl["batch_size"] // rl["num_generations"]),
        "num_generations": str(rl["num_generations"]),
        "opt_steps": str(rl["update_epochs"] * (rl["batch_size"] // rl["minibatch_size"])),
        "start_policy": rl["start_policy"],
        "sft_sentence": _sft_sentence(sft),
    }
    includes = {
        "rl_algorithm_settings.md": markdown_table(algo_settings),
        "sft_summary.md": markdown_table(sft, floatfmt=".3f")
        if not sft.empty
        else "SFT was not run.",
        "rl_settings.md": markdown_table(settings),
        "rl_summary.md": markdown_table(summ, floatfmt=".3f"),
        "rl_samples.md": markdown_table(shown),
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


# ---------------------------------------------------------------------------------------------
# 04 evaluation
# ---------------------------------------------------------------------------------------------
def eval_section(run: RunDir, alpha: float = 0.05) -> tuple[dict[str, Any], dict[str, str]]:
    stage = "notebook 04_evaluation"
    meta = run.read_json("eval/summary.json", stage=stage)
    s = pd.DataFrame(meta["summary"]).set_index("policy")
    paired = run.read_table("eval_paired", stage)
    t3 = run.read_table("eval_table3", stage)
    algos = meta["algorithms"]
    start = meta.get("start_policy", "base")
    vs_bon = pd.DataFrame(meta.get("vs_best_of_n", []))
    ppl = pd.DataFrame(meta.get("heldout_perplexity", []))

    def gain_cell(r: pd.Series, col: str) -> str:
        if pd.isna(r.get(col)):
            return "·"
        return f"{r[col]:+.3f} (p={pval(r[col + '_p_holm'])})"

    rows, cost = [], []
    for pol, r in s.iterrows():
        rows.append({
            "policy": pol, "prompts": int(r["n_prompts"]),
            "Ave(R) [95% CI]": ci(r["ave_r"], r["ave_r_low"], r["ave_r_high"]),
            f"gain vs {start}": gain_cell(r, "gain"),
            "audit [95% CI]": ci(r["audit"], r["audit_low"], r["audit_high"]),
            "audit gain": gain_cell(r, "audit_gain"),
        })  # fmt: skip
        cost.append({
            "policy": pol,
            "KL (nats)": "·" if pd.isna(r["kl"]) else (f"≤ {r['kl']:.2f}" if r["kl_kind"] == "upper bound" else f"{r['kl']:.2f}"),
            "perplexity": f"{r['perplexity']:.1f}",
            "finished": "·" if pd.isna(r.get("finished")) else f"{r['finished']:.0%}",
            "words": f"{r['mean_words']:.1f}",
            "distinct-2": f3(r["distinct_2"]),
            "rep-3": f3(r["rep_3"]),
            "grounded MET [95% CI]": ci(r["grounded_met"], r["grounded_low"], r["grounded_high"]),
            "max similarity": f3(r["max_sim"]),
        })  # fmt: skip
    summary_md = markdown_table(pd.DataFrame(rows))
    cost_md = markdown_table(pd.DataFrame(cost))
    pt = paired.assign(
        **{
            "difference [95% CI]": [ci(a, b, c) for a, b, c in zip(paired.mean_diff, paired.ci_low, paired.ci_high, strict=True)],
            "d_z": paired["cohens_dz"].map(lambda x: f"{x:.2f}"),
            "p (t, Holm)": paired["p_ttest_holm"].map(pval),
            "p (Wilcoxon, Holm)": paired["p_wilcoxon_holm"].map(pval),
        }
    )[["measure", "policy", "n", "difference [95% CI]", "d_z", "p (t, Holm)", "p (Wilcoxon, Holm)"]]  # fmt: skip
    t3_md = markdown_table(
        t3.assign(
            prompt=t3["prompt"].map(lambda x: _short(x, 70)), response=t3["response"].map(_short)
        )[["prompt", "policy", "response", "reward"]]
    )

    sentences, concl = [], []
    for algo in algos:
        r = s.loc[algo]
        sig = r["gain_p_holm"] < alpha
        verb = ("raised" if r["gain"] > 0 else "lowered") if sig else "did not significantly change"
        a_sig = r["audit_gain_p_holm"] < alpha
        a_verb = (
            ("raised" if r["audit_gain"] > 0 else "lowered")
            if a_sig
            else "did not significantly change"
        )
        sentences.append(
            f"{algo.upper()} {verb} Ave(R) on the held-out prompts (from {f3(s.loc[start, 'ave_r'])} for {start} to "
            f"{ci(r['ave_r'], r['ave_r_low'], r['ave_r_high'])}; paired gain {r['gain']:+.3f}, Holm-adjusted "
            f"Wilcoxon p = {pval(r['gain_p_holm'])}) and {a_verb} the audit model's reward ({r['audit_gain']:+.3f}, "
            f"p = {pval(r['audit_gain_p_holm'])}), at a KL of {r['kl']:.2f} nats to the starting policy"
        )
        concl.append(
            f"{algo.upper()} {verb} the reward it was trained on and {a_verb} the independent audit reward"
        )
    hist = {
        p: s.loc[p, "ave_r"]
        for p in ("history_met", "history_nonmet", "random_policy")
        if p in s.index
    }
    if "history_met" in hist and "history_nonmet" in hist:
        order = "above" if hist["history_met"] > hist["history_nonmet"] else "not above"
        hist_sentence = (
            f"Real MET descriptions for the same contexts score {f3(hist['history_met'])} and real Non-MET ones "
            f"{f3(hist['history_nonmet'])}: the reward model places what was met {order} what was not"
        )
    else:
        hist_sentence = (
            "The held-out contexts evaluated here do not hold both MET and Non-MET history"
        )
    b = s.loc["best_of_n"]
    g = s.dropna(subset=["grounded_met"])
    bon_sentences = []
    curve_end = best_of_n_kl_bound(max(meta.get("best_of_n_curve") or [1]))

    def bon_kl(
        r: pd.Series,
    ) -> float:  # the curve's KL the policy was compared at (older runs lack it)
        return r["best_of_n_kl"] if pd.notna(r.get("best_of_n_kl")) else min(r["kl"], curve_end)

    for _, r in vs_bon.iterrows():
        where = {
            "above": "above",
            "below": "below",
            "not distinguishable": "not distinguishable from",
        }[r["verdict"]]
        bon_sentences.append(
            f"{r['policy'].upper()} ({f3(r['ave_r'])} at {r['kl']:.2f} nats) lies {where} the best-of-N curve "
            f"({f3(r['best_of_n_at_kl'])} at {bon_kl(r):.2f} nats"
            f"{': its KL is beyond the curve, compared with the largest N' if r['beyond_curve'] else ', the same KL'}; "
            f"difference {ci(r['diff'], r['diff_low'], r['diff_high'])})"
        )  # fmt: skip
    ppl_md = "No held-out perplexity was measured."
    ppl_sentence = ""
    if not ppl.empty:
        ppl_md = markdown_table(
            ppl[["policy", "rows", "ppl_met", "ppl_nonmet", "ppl_all"]].rename(
                columns={"ppl_met": "MET", "ppl_nonmet": "Non-MET", "ppl_all": "all"}
            ),
            floatfmt=".1f",
        )
        pp = ppl.set_index("policy")
        ppl_sentence = "; ".join(f"{p} {pp.loc[p, 'ppl_all']:.1f}" for p in pp.index)
    fin = s["finished"].dropna() if "finished" in s else pd.Series(dtype=float)
    variables = {
        "n_prompts": str(meta["n_prompts"]),
        "k": str(meta["samples_per_prompt"]),
        "best_n": str(meta["best_of_n"]),
        "algo_sentences": "; ".join(sentences) if sentences else "No RL algorithm was evaluated",
        "conclusion": "; ".join(concl) if concl else "no tuned policy was evaluated",
        "history_sentence": hist_sentence,
        "random_policy": f3(hist.get("random_policy", float("nan"))),
        "base_ave_r": f3(s.loc["base", "ave_r"]),
        "start": start,
        "start_ave_r": f3(s.loc[start, "ave_r"]),
        "bon_sentences": "; ".join(bon_sentences)
        if bon_sentences
        else "No RL algorithm was compared with best-of-N",
        "bon_curve": ", ".join(str(n) for n in meta.get("best_of_n_curve", [])),
        "ppl_sentence": ppl_sentence,
        "finished_sentence": "; ".join(f"{p} {v:.0%}" for p, v in fin.items()),
        "best_ave_r": f3(b["ave_r"]),
        "best_gain": f"{b['gain']:+.3f}",
        "best_audit_gain": f"{b['audit_gain']:+.3f}",
        "best_kl": f"{b['kl']:.2f}",
        "grounding_sentence": "; ".join(f"{p} {f3(r['grounded_met'])}" for p, r in g.iterrows()),
    }
    return variables, {
        "eval_summary.md": summary_md,
        "eval_cost.md": cost_md,
        "eval_paired.md": markdown_table(pt),
        "eval_table3.md": t3_md,
        "eval_heldout_perplexity.md": ppl_md,
    }


# ---------------------------------------------------------------------------------------------
# 05 risks
# ---------------------------------------------------------------------------------------------
def risk_section(run: RunDir) -> tuple[dict[str, Any], dict[str, str]]:
    """Variables and tables of notebook 05, from `risk/summary.json` and its tables."""
    from .risk import report_content

    return report_content(run)


SECTIONS = ("reward", "rl", "eval", "risk")
