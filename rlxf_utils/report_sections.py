"""What the working paper says about stages 02-05, computed from the run directory.

Each `*_section(run)` returns `(variables, includes)`: values that the report's prose quotes
through `{{< var stage.key >}}` (numbers formatted once, here, and sentences whose wording
depends on a result, e.g. whether a test rejected) and compact markdown tables written to
`_generated/`. Nothing is typed into the report source: a missing artifact raises
`ArtifactMissing` naming the file and the notebook that writes it.
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from .artifacts import (
    ArtifactMissing,
    RunDir,
    fmt_num,
    fmt_p,
    fmt_pct,
    is_present,
    listing,
    markdown_table,
)
from .config import CRITIC_INIT, ILHF_ALGORITHMS, RLGF_ALGORITHMS, algorithm_label
from .evaluation import best_of_n_kl_bound, ci_verdict, level
from .models import display_country
from .reward_uncertainty import FOLDER as HEADS_FOLDER
from .reward_uncertainty import MARKER as HEADS_MARKER
from .reward_uncertainty import sd_verdict

__all__ = [
    "SECTIONS",
    "data_section",
    "eval_section",
    "gain_verb",
    "history_sentence",
    "move_sentence",
    "forensic_section",
    "forensic_verdict",
    "ilhf_section",
    "reference_check",
    "reward_section",
    "risk_section",
    "rl_section",
    "rlgf_section",
    "uncertainty_sentence",
]

PAPER_CLAIM = 0.82  # the paper's reported accuracy / precision / recall / F1 ("surpassing 82%")


f3 = fmt_num  # three decimals, 'n/a' when missing
pct = fmt_pct


def _spaced(name: Any) -> str:
    """A name with spaces for underscores, so a long one wraps in a narrow PDF column."""
    return str(name).replace("_", " ")


def move_sentence(algo: str, r: pd.Series) -> str:
    """How one algorithm's training reward moved (a row of `rl.summary_table`); an algorithm
    that logs no training reward (ILHF from history: no reward model) is said to, not 'nan'."""
    d = r["reward_last"] - r["reward_first"]
    if not is_present(d):
        return (
            f"{algo} trains without the reward model, so it logs no training reward, "
            f"{r['step_time_s']:.0f} s per step"
        )
    return (
        f"{algo}'s mean training reward went from {f3(r['reward_first'])} to {f3(r['reward_last'])} "
        f"({'+' if d >= 0 else '−'}{abs(d):.3f}) at a final KL of {r['kl_last']:.2f} nats, "
        f"{r['step_time_s']:.0f} s per step"
    )


#: The report's sentence on how PPO's critic starts (`rl.critic_init`).
CRITIC_SENTENCE = {
    "reward": "The critic starts from the reward model, as in Stiennon et al. (2020): its value at each "
    "token is the reward model's score of the response so far in its context, plus a linear head "
    "on the policy's hidden states that starts at zero and learns the rest",
    "mean": "The critic is a value head on the policy's hidden states that starts on the reward's "
    "scale (zero weights, its bias at the first batch's mean reward)",
}


def ci(mid: float, low: float, high: float) -> str:
    return f"{f3(mid)} [{f3(low)}, {f3(high)}]"


def pval(p: float) -> str:
    if not is_present(p):
        return "n/a"
    return "<0.001" if p < 0.001 else f"{p:.3f}"


def _short(text: Any, n: int = 160) -> str:
    s = " ".join(str(text).split())
    return s if len(s) <= n else s[: n - 1].rstrip() + "…"


# ---------------------------------------------------------------------------------------------
# 01 data
# ---------------------------------------------------------------------------------------------
def data_section(run: RunDir) -> dict[str, Any]:
    """The data section's tested sentences (notebook 01's `rates.data_findings`) and its level."""
    s = run.read_json("data/summary.json", stage="notebook 01_data_exploration")
    f = s.get("findings")
    if not f:
        raise ArtifactMissing(
            f"{run.path('data/summary.json')}: field 'findings' missing; rerun notebook 01_data_exploration"
        )
    return {
        "level": f["level"],
        "trend_sentence": f["trend_sentence"],
        "shift_sentence": f["shift_sentence"],
        "area_sentence": f["area_sentence"],
        "arrangement_type_sentence": f["arrangement_type_sentence"],
    }


# ---------------------------------------------------------------------------------------------
# 02 reward model
# ---------------------------------------------------------------------------------------------
REWARD_LABELS = {"majority": "majority class", "tfidf": "TF-IDF + LR", "encoder": "fine-tuned encoder",
                 "context_only": "context only", "text_only": "text only"}  # fmt: skip


def reward_labels(meta: dict[str, Any]) -> dict[str, str]:
    """Model name -> label: REWARD_LABELS with each encoder named by what it is, e.g.
    'fine-tuned all-MiniLM-L6-v2' (`reward/metrics.json`'s `encoders`; older runs lack it)."""
    labels = dict(REWARD_LABELS)
    for name, enc in meta.get("encoders", {}).items():
        labels[name] = f"fine-tuned {enc['label']}"
    return labels


def _paper_verdict(m: pd.DataFrame, lvl: str, labels: dict[str, str] = REWARD_LABELS) -> str:
    """Whether any model's intervals lie above the paper's 82% on all four measures."""
    four = ["accuracy", "precision", "recall", "f1"]
    cand = m[~m["model"].isin(["majority", "context_only", "text_only"])]
    above = cand[cand.apply(lambda r: all(r[f"{k}_low"] > PAPER_CLAIM for k in four), axis=1)]
    short = cand[cand.apply(lambda r: any(r[f"{k}_high"] < PAPER_CLAIM for k in four), axis=1)]
    if len(above):
        who = listing([f"{labels[r.model]} ({r.protocol})" for r in above.itertuples()])
        return (
            f"the paper's {PAPER_CLAIM:.0%} on accuracy, precision, recall and F1 is reached, with "
            f"every {lvl} interval above it, by {who}"
        )
    best = cand.loc[cand["accuracy"].idxmax()]
    return (
        f"no model's {lvl} intervals lie above the paper's {PAPER_CLAIM:.0%} on all of accuracy, "
        f"precision, recall and F1 under any protocol, and {len(short)} of {len(cand)} fall "
        f"significantly short of it on at least one; the best accuracy is "
        f"{pct(best['accuracy'])} [{pct(best['accuracy_low'])}, {pct(best['accuracy_high'])}] "
        f"({labels[best['model']]}, {best['protocol']})"
    )


def _by_verdict(rows: pd.DataFrame, phrases: dict[str, str], what: str) -> str:
    """'<phrase> under the a and b protocols and <phrase> under c' from per-protocol verdicts."""
    parts = []
    for verdict, phrase in phrases.items():
        ps = rows.loc[rows["verdict"] == verdict, "protocol"].tolist()
        if ps:
            parts.append(f"{phrase} under the {listing(ps)} protocol{'s' if len(ps) > 1 else ''}")
    return f"{what} {listing(parts)}" if parts else f"{what}: no comparison was made"


def reward_section(run: RunDir) -> tuple[dict[str, Any], dict[str, str]]:
    """Variables and tables of notebook 02: every verdict is read from a bootstrap interval."""
    stage = "notebook 02_reward_model"
    meta = run.read_json("reward/metrics.json", stage=stage)
    missing = [k for k in ("alpha", "comparisons", "protocol_differences") if k not in meta]
    if missing:
        raise ArtifactMissing(
            f"{run.path('reward/metrics.json')}: fields {missing} missing; rerun {stage}"
        )
    alpha = meta["alpha"]
    lvl = level(alpha)
    m = pd.DataFrame(meta["metrics"])
    cal = pd.DataFrame(meta["calibration"])
    comp = pd.DataFrame(meta["comparisons"])
    pdiff = pd.DataFrame(meta["protocol_differences"])
    src, proto = meta["reward_source"], meta["reward_protocol"]
    main = src
    has_enc = "encoder" in set(m["model"])
    labels = reward_labels(meta)
    scorers = m[~m["model"].isin(["context_only", "text_only"])]

    rows = []
    for r in scorers.itertuples():
        rows.append({"protocol": r.protocol, "model": labels[r.model], "accuracy": r.accuracy,
                     "precision": r.precision, "recall": r.recall, "F1": r.f1, "macro-F1": r.macro_f1,
                     "AUC": r.roc_auc, "Brier": r.brier, "ECE": r.ece})  # fmt: skip
    metrics_md = markdown_table(pd.DataFrame(rows))

    def interval(d: pd.Series, scale: float = 1.0, digits: int = 3) -> str:
        return (f"{scale * d['diff']:+.{digits}f} [{scale * d['diff_low']:+.{digits}f}, "
                f"{scale * d['diff_high']:+.{digits}f}]")  # fmt: skip

    acc = comp[(comp["measure"] == "accuracy") & (comp["comparison"] == "encoder vs TF-IDF")]
    if has_enc:
        enc_vs = _by_verdict(
            acc,
            {"higher": "more accurate", "lower": "less accurate", "not distinguishable": "not distinguishable in accuracy"},
            f"against TF-IDF + LR, the {labels['encoder']} is",
        )  # fmt: skip
        enc_vs += f" (paired {lvl} bootstrap intervals of the accuracy difference)"
    else:
        enc_vs = "no encoder was trained in this run"
    pm = pdiff[pdiff["model"] == main] if len(pdiff) else pdiff
    if len(pm):
        protocol_sentence = _by_verdict(
            pm,
            {"lower": "falls", "higher": "rises", "not distinguishable": "does not change significantly"},
            f"Against the {pm['reference'].iloc[0]} split, the {labels[main]}'s test accuracy",
        ) + " (" + "; ".join(f"{r.protocol} {100 * r.diff:+.1f} points [{100 * r.diff_low:+.1f}, {100 * r.diff_high:+.1f}]"
                             for r in pm.itertuples()) + ")"  # fmt: skip
    else:
        protocol_sentence = (
            "Only one protocol was run, so accuracy is not compared across protocols"
        )

    cal_main = cal[(cal["protocol"] == proto) & (cal["model"] == main)].iloc[0]
    cal_word = {"lower": "lowered", "higher": "raised"}.get(
        cal_main["ece_verdict"], "did not significantly change"
    )
    cal_md = markdown_table(
        pd.DataFrame(
            {
                "protocol": cal["protocol"],
                "model": cal["model"].map(labels),
                "T": cal["temperature"].map(lambda x: f"{x:.2f}"),
                "offset": cal["offset"].map(lambda x: f"{x:+.2f}"),
                "calibration rows": cal["n_calibration"].astype(int),
                f"ECE before [{lvl} CI]": [ci(a, b, c) for a, b, c in zip(cal.test_ece_before, cal.test_ece_before_low, cal.test_ece_before_high, strict=True)],
                f"ECE after [{lvl} CI]": [ci(a, b, c) for a, b, c in zip(cal.test_ece_after, cal.test_ece_after_low, cal.test_ece_after_high, strict=True)],
                f"after − before [{lvl} CI]": [ci(a - b, lo, hi) for a, b, lo, hi in zip(cal.test_ece_after, cal.test_ece_before, cal.ece_diff_low, cal.ece_diff_high, strict=True)],
                "Brier before": cal["test_brier_before"].map(f3),
                "Brier after": cal["test_brier_after"].map(f3),
            }
        )
    )  # fmt: skip
    within = m[m["model"] != "majority"]
    within_md = markdown_table(
        pd.DataFrame(
            {
                "protocol": within["protocol"],
                "model": within["model"].map(labels),
                f"AUC [{lvl} CI]": [ci(r.roc_auc, r.roc_auc_low, r.roc_auc_high) for r in within.itertuples()],
                **{
                    f"within {name} [{lvl} CI]": [
                        ci(getattr(r, f"auc_within_{stem}"), getattr(r, f"auc_within_{stem}_low"), getattr(r, f"auc_within_{stem}_high"))
                        for r in within.itertuples()
                    ]
                    for stem, name in (("country", "country"), ("area", "area"), ("context", "context"))
                },
            }
        )
    )  # fmt: skip
    tests_md = markdown_table(
        pd.DataFrame(
            {
                "protocol": comp["protocol"],
                "comparison": comp["comparison"],
                "measure": comp["measure"].map({"accuracy": "accuracy", "roc_auc": "AUC", "ece": "ECE"}),
                "a": comp["value_a"].map(f3),
                "b": comp["value_b"].map(f3),
                f"a − b [{lvl} CI]": [interval(r) for _, r in comp.iterrows()],
                "verdict": comp["verdict"],
            }
        )
    )  # fmt: skip

    wc = m[m["protocol"] == proto].set_index("model")
    mm = wc.loc[main]
    t_vs_c = comp[(comp["protocol"] == proto) & (comp["comparison"] == "text only vs context only")]
    if len(t_vs_c):
        r = t_vs_c.iloc[0]
        reads_text = {
            "higher": "the text alone ranks conditions better than the context fields alone",
            "lower": "the context fields alone rank conditions better than the text alone, so much of the reward is a prior over contexts",
        }.get(r["verdict"], "the text alone and the context fields alone cannot be told apart")  # fmt: skip
        reads_text += f" (AUC difference {interval(r)}, {lvl} CI)"
    else:
        reads_text = "the probes were not compared"
    timing = meta.get("timing", {}).get(proto, {})

    def auc_ci(stem: str) -> str:
        return ci(
            mm[f"auc_within_{stem}"], mm[f"auc_within_{stem}_low"], mm[f"auc_within_{stem}_high"]
        )

    variables = {
        "source": labels[src] if src != "tfidf" else "TF-IDF + logistic regression",
        "protocol": proto,
        "level": lvl,
        "calibration_share": f"{meta.get('calibration_share', 0.5):.0%}",
        "paper_verdict": _paper_verdict(m, lvl, labels),
        "encoder_vs_tfidf": enc_vs,
        "protocol_sentence": protocol_sentence,
        "main_accuracy": pct(mm["accuracy"]),
        "main_accuracy_ci": f"[{pct(mm['accuracy_low'])}, {pct(mm['accuracy_high'])}]",
        "main_auc": f3(mm["roc_auc"]),
        "main_f1": f3(mm["f1"]),
        "majority_accuracy": pct(wc.loc["majority", "accuracy"]),
        "temperature": f"{cal_main['temperature']:.2f}",
        "offset": f"{cal_main['offset']:+.2f}",
        "ece_before": f3(cal_main["test_ece_before"]),
        "ece_after": f3(cal_main["test_ece_after"]),
        "ece_diff_ci": f"[{cal_main['ece_diff_low']:+.3f}, {cal_main['ece_diff_high']:+.3f}]",
        "brier_before": f3(cal_main["test_brier_before"]),
        "brier_after": f3(cal_main["test_brier_after"]),
        "calibration_verdict": cal_word,
        "context_only_auc": f3(wc.loc["context_only", "roc_auc"]),
        "text_only_auc": f3(wc.loc["text_only", "roc_auc"]),
        "within_country_auc": auc_ci("country"),
        "within_area_auc": auc_ci("area"),
        "within_context_auc": auc_ci("context"),
        "within_context_groups": str(int(mm["n_context_groups"])),
        "reads_text": reads_text,
        "encoder_train_s": f"{timing.get(f'{main}_train_s', math.nan):.0f}",
        "score_texts_per_s": f"{timing.get(f'{main}_score_texts_per_s', math.nan):.0f}",
    }
    ref_sentence, ref_md = reference_check(run, lvl)
    variables["reference_sentence"] = ref_sentence
    enc_vars, enc_md = encoders_section(run, lvl, meta)
    variables.update(enc_vars)
    return variables, {
        "reward_encoders.md": enc_md,
        "reward_metrics.md": metrics_md,
        "reward_calibration.md": cal_md,
        "reward_within.md": within_md,
        "reward_tests.md": tests_md,
        "reward_reference_check.md": ref_md,
    }


def encoders_section(
    run: RunDir, lvl: str, meta: dict[str, Any] | None = None
) -> tuple[dict[str, str], str]:
    """The encoders side by side: the table `reward_encoders`, a sentence per compared encoder
    whose verdicts come from the paired intervals of `<name> vs encoder`, which encoder the
    evidence favours on the reward protocol, and the precision RL scores in.

    Returns ({encoders_sentence, evidence_sentence, score_sentence}, markdown table).
    """
    stage = "notebook 02_reward_model"
    meta = meta if meta is not None else run.read_json("reward/metrics.json", stage=stage)
    comp = pd.DataFrame(meta.get("comparisons", []))
    labels = reward_labels(meta)
    encoders = meta.get("encoders", {})
    if not run.exists("tables/reward_encoders.csv") or not encoders:
        stale = f"This run directory predates the encoder comparison; rerun {stage}"
        keys = (
            "encoders_sentence",
            "evidence_sentence",
            "score_sentence",
            "encoder_desc",
            "compared_desc",
            "mpnet_note",
        )
        return dict.fromkeys(keys, stale), ""
    t = run.read_table("reward_encoders", stage)
    md = markdown_table(
        pd.DataFrame(
            {
                "protocol": t["protocol"],
                "model": t["label"],
                "parameters (M)": t["parameters_m"].map(lambda x: "–" if pd.isna(x) else f"{x:.0f}"),
                "train (s)": t["train_s"].map(lambda x: f"{x:.0f}"),
                "epochs run": t["epochs_run"].map(lambda x: "–" if pd.isna(x) else f"{x:.1f}"),
                "scoring (texts/s)": t["score_texts_per_s"].map(lambda x: "–" if pd.isna(x) else f"{x:.0f}"),
                f"accuracy [{lvl} CI]": [ci(r.accuracy, r.accuracy_low, r.accuracy_high) for r in t.itertuples()],
                f"AUC [{lvl} CI]": [ci(r.roc_auc, r.roc_auc_low, r.roc_auc_high) for r in t.itertuples()],
                f"AUC within context [{lvl} CI]": [ci(r.auc_within_context, r.auc_within_context_low, r.auc_within_context_high) for r in t.itertuples()],
            }
        )
    )  # fmt: skip
    compared = [k for k in encoders if k != "encoder"]
    words = {"higher": "higher", "lower": "lower", "not distinguishable": "not distinguishable"}
    parts = []
    evidence = _encoder_evidence(comp, compared, meta, labels)
    for name in compared:
        for proto in t.loc[t["model"] == name, "protocol"]:
            c = comp[(comp["comparison"] == f"{name} vs encoder") & (comp["protocol"] == proto)]
            if not len(c):
                continue
            bits = []
            for measure, word in (("accuracy", "accuracy"), ("roc_auc", "AUC")):
                r = c[c["measure"] == measure]
                if len(r):
                    r = r.iloc[0]
                    scale, unit = (100, " points") if measure == "accuracy" else (1, "")
                    bits.append(
                        f"{word} {words.get(r['verdict'], r['verdict'])} "
                        f"({scale * r['diff']:+.{1 if scale == 100 else 3}f}{unit} "
                        f"[{scale * r['diff_low']:+.{1 if scale == 100 else 3}f}, {scale * r['diff_high']:+.{1 if scale == 100 else 3}f}])"
                    )  # fmt: skip
            row = t[(t["model"] == name) & (t["protocol"] == proto)].iloc[0]
            base = t[(t["model"] == "encoder") & (t["protocol"] == proto)]

            def ep(r: pd.Series) -> str:
                return f"{r['epochs_run']:g} epoch{'s' if r['epochs_run'] != 1 else ''}"

            cost = (
                f"; it trained for {ep(row)} in {row['train_s']:.0f} s against {ep(base.iloc[0])} in "
                f"{base['train_s'].iloc[0]:.0f} s and scores {row['score_texts_per_s']:.0f} texts/s in fp32 "
                f"against {base['score_texts_per_s'].iloc[0]:.0f}"
                if len(base) else f"; it trained for {ep(row)} in {row['train_s']:.0f} s"
            )  # fmt: skip
            parts.append(
                f"on the {proto} protocol the {labels[name]}, against the {labels['encoder']}, is "
                f"{' and '.join(bits)}{cost}{_calls(run, proto, name)}"
            )
    if parts:
        sentence = (
            f"Paired {lvl} intervals of the difference (arrangements resampled): "
            + "; ".join(parts)
        )
    else:
        sentence = (
            f"This run compared no second encoder (reward.compare_encoders is empty); the "
            f"{labels['encoder']} stands alone beside TF-IDF + LR"
        )
    check = meta.get("score_check") or {}
    if check.get("requested", "fp32") != "fp32":
        kept = check["used"] == check["requested"]
        score_sentence = (
            f"RL and evaluation score with the reward model in {check['requested']}: on the "
            f"{check['n']} test rows of the reward protocol its P(MET) differs from fp32's by at most "
            f"{check['max_abs_diff']:.4f} (mean {check['mean_abs_diff']:.4f}; tolerance "
            f"{check['tolerance']}), {100 * check['decision_changes']:.1f}% of MET/Non-MET decisions "
            f"change, and it scores {check['texts_per_s']:.0f} texts/s against fp32's "
            f"{check['fp32_texts_per_s']:.0f}"
            + ("" if kept else "; above the tolerance, so this run scored in fp32 instead")
        )
    elif check:
        score_sentence = (
            f"RL and evaluation score with the reward model in fp32 ({check['fp32_texts_per_s']:.0f} texts/s "
            f"on the reward protocol's test rows)"
        )
    else:
        score_sentence = "RL scores with the reward model as notebook 02 trained it"
    from .reward import ENCODER_NAMES

    def desc(name: str) -> str:
        setting = encoders[name]["setting"]
        return ENCODER_NAMES.get(setting, f"{encoders[name]['label']} ({setting})")

    def trained_on(name: str) -> str:
        protocols = sorted(set(t.loc[t["model"] == name, "protocol"]))
        return f"the {listing(protocols)} protocol{'s' if len(protocols) > 1 else ''}"

    compared_desc = (
        "beside it this run trains " + listing([f"{desc(n)} on {trained_on(n)}" for n in compared])
        if compared else "this run compares no other encoder (reward.compare_encoders is empty)"
    )  # fmt: skip
    mpnet_note = (
        " all-mpnet-base-v2 matches bert-base-uncased's *size* (12 layers, 768 hidden units, 110M "
        "parameters) but not its pretraining: it starts from MPNet (masked and permuted language "
        "modelling) and was then trained by sentence-transformers with a contrastive objective on "
        "about a billion sentence pairs, whereas bert-base-uncased is a masked language model of "
        "BooksCorpus and English Wikipedia. Its numbers are those of a BERT-base-sized encoder, not a "
        "reproduction of the paper's."
        if any(encoders[n]["setting"] == "embedded:mpnet" for n in ["encoder", *compared])
        else ""
    )
    return {
        "encoders_sentence": sentence,
        "mpnet_note": mpnet_note,
        "evidence_sentence": evidence,
        "score_sentence": score_sentence,
        "encoder_desc": desc("encoder"),
        "compared_desc": compared_desc,
    }, md


def _calls(run: RunDir, protocol: str, name: str) -> str:
    """A clause when accuracy cannot separate two encoders because their MET/Non-MET calls at
    0.5 are the same on every test row (from `reward/predictions_<protocol>.parquet`)."""
    rel = f"reward/predictions_{protocol}.parquet"
    if not run.exists(rel):
        return ""
    pred = run.read_parquet(rel)
    if f"p_{name}" not in pred or "p_encoder" not in pred or not len(pred):
        return ""
    a, b = pred[f"p_{name}"] >= 0.5, pred["p_encoder"] >= 0.5
    if not (a == b).all():
        return ""
    if a.all() or not a.any():
        call = "MET" if a.all() else "Non-MET"
        return (
            f" (at the 0.5 threshold both call every one of the {len(pred):,} test rows {call}, so accuracy "
            "cannot separate them; AUC, which ranks, can)"
        )
    return f" (both make the same MET/Non-MET call on every one of the {len(pred):,} test rows)"


def _encoder_evidence(
    comp: pd.DataFrame, compared: list[str], meta: dict[str, Any], labels: dict[str, str]
) -> str:
    """Which encoder the reward protocol's paired intervals favour (accuracy and AUC together),
    and which one feeds RL. An encoder is favoured when one measure is significantly higher and
    none significantly lower; otherwise the evidence does not separate them."""
    proto, src = meta["reward_protocol"], meta["reward_source"]
    feeds = f"RL optimises the {labels.get(src, src)} (reward.reward_source: {src})"
    found = []
    for name in compared:
        c = (
            comp[(comp["comparison"] == f"{name} vs encoder") & (comp["protocol"] == proto)]
            if len(comp)
            else comp
        )
        c = c[c["measure"].isin(["accuracy", "roc_auc"])] if len(c) else c
        if not len(c):
            continue
        v = set(c["verdict"])
        if "higher" in v and "lower" not in v:
            found.append(f"the evidence favours the {labels[name]} over the {labels['encoder']}")
        elif "lower" in v and "higher" not in v:
            found.append(f"the evidence favours the {labels['encoder']} over the {labels[name]}")
        elif v == {"not distinguishable"}:
            found.append(
                f"the paired intervals do not separate the {labels[name]} from the "
                f"{labels['encoder']} in accuracy or AUC, so the evidence favours neither and the "
                f"smaller, faster one costs less"
            )
        else:
            found.append(
                f"the {labels[name]} and the {labels['encoder']} each win on one measure, so the "
                "evidence favours neither"
            )
    if not found:
        return f"No second encoder was trained on the {proto} protocol, so there is no choice to weigh; {feeds}"
    return f"On the {proto} protocol (the one that feeds RL), {'; '.join(found)}. {feeds}"


def reference_check(run: RunDir, lvl: str) -> tuple[str, str]:
    """Every scorer's AUC on the reference rows (evaluation countries), which none trained on."""
    stage = "notebook 02_reward_model"
    if not run.path("data/holdout.json").exists():
        return "This run has no evaluation holdout (data/holdout.json); rerun notebook 01", ""
    holdout = run.read_json("data/holdout.json", "notebook 01_data_exploration")
    t = run.read_table("reward_reference_check", stage)
    md = markdown_table(
        t.assign(**{f"AUC [{lvl} CI]": [ci(r.auc, r.auc_low, r.auc_high) for r in t.itertuples()]})[
            ["model", "rows", "met_share", "mean_p", f"AUC [{lvl} CI]"]
        ],
        floatfmt=".3f",
    )
    parts = [
        f"{r.model} {ci(r.auc, r.auc_low, r.auc_high)}, "
        + ci_verdict(
            r.auc_low - 0.5, r.auc_high - 0.5, "above", "below", "not distinguishable from"
        )
        + " chance"
        for r in t.itertuples()
    ]
    sentence = (
        f"The {len(holdout['eval_countries'])} evaluation countries' {len(holdout['reference'])} rows "
        f"sit inside the {holdout['reward_protocol']} protocol's test split, and the audit model "
        f"trains on {len(holdout['audit_train'])} other held-out rows (calibrated on "
        f"{len(holdout['audit_val'])}), so no reference that evaluation scores was seen by either "
        f"model. On those rows the AUC is: " + "; ".join(parts)
    )
    return sentence, md


# ---------------------------------------------------------------------------------------------
# 02 reward model: the forensic arm (inputs the paper's protocol forbids; never feeds RL)
# ---------------------------------------------------------------------------------------------
FORENSIC_MEASURES = (("accuracy", "accuracy"), ("precision", "precision"), ("recall", "recall"), ("f1", "F1"))  # fmt: skip
MODEL_NAMES = {
    "tfidf": "TF-IDF + LR",
    "encoder": "fine-tuned encoder",
    "majority": "majority class",
}


def claim_position(row: pd.Series, claim: float) -> str:
    """'above' if every measure's CI lies above the claim, 'below' if any lies below it, else
    'indistinguishable': read from the intervals, never from the point estimates."""
    words = [ci_verdict(row[f"{m}_low"] - claim, row[f"{m}_high"] - claim, "above", "below", "neither")
             for m, _ in FORENSIC_MEASURES]  # fmt: skip
    if "below" in words:
        return "below"
    return "above" if all(w == "above" for w in words) else "indistinguishable"


def forensic_verdict(table: pd.DataFrame, claim: float, alpha: float) -> str:
    """What the forensic arm says about how a figure above the paper's claim could arise.

    A variant *reaches* the claim when the {1-alpha} CI of each of accuracy, precision, recall and
    F1 lies above it (the paper claims all four), *falls short* when any CI lies below it.
    """
    lvl = level(alpha)
    t = table[table["model"] != "majority"].copy()
    t["position"] = [claim_position(r, claim) for _, r in t.iterrows()]

    def name(r: pd.Series) -> str:
        return f"{r['variant']} ({MODEL_NAMES.get(r['model'], r['model'])})"

    def acc(r: pd.Series) -> str:
        return (
            f"accuracy {pct(r['accuracy'])} [{pct(r['accuracy_low'])}, {pct(r['accuracy_high'])}]"
        )

    allowed, forbidden = t[t["allowed_by_protocol"]], t[~t["allowed_by_protocol"]]
    parts = []
    for label, g in (
        ("the inputs the paper allows", allowed),
        ("inputs the protocol forbids", forbidden),
    ):
        if g.empty:
            continue
        up = g[g["position"] == "above"]
        short = g[g["position"] == "below"]
        mid = g[g["position"] == "indistinguishable"]
        bits = []
        if len(up):
            bits.append(f"{listing([f'{name(r)}, {acc(r)}' for _, r in up.iterrows()])} "
                        f"{'reaches' if len(up) == 1 else 'reach'} it on all four measures")  # fmt: skip
        if len(short):
            best = short.loc[short["accuracy"].idxmax()]
            bits.append(f"{listing([name(r) for _, r in short.iterrows()])} "
                        f"{'falls' if len(short) == 1 else 'fall'} short of it on at least one measure "
                        f"(best: {name(best)}, {acc(best)})")  # fmt: skip
        if len(mid):
            bits.append(f"{listing([name(r) for _, r in mid.iterrows()])} cannot be told apart from it "
                        f"on at least one measure and {'lies' if len(mid) == 1 else 'lie'} below it on none")  # fmt: skip
        parts.append(f"with {label}, {'; '.join(bits)}")
    up_allowed = allowed["position"].eq("above").any()
    up_forbidden = forbidden[forbidden["position"] == "above"]
    if up_allowed:
        concl = (f"a figure above {claim:.0%} is reachable here with the paper's own inputs, so this "
                 "arm does not show that it needs forbidden ones")  # fmt: skip
    elif len(up_forbidden) and not allowed.empty and allowed["position"].eq("below").all():
        concl = (f"in this run a figure above {claim:.0%} arises only when the model sees "
                 f"{listing(sorted(set(up_forbidden['variant'])))} inputs, which the paper's protocol "
                 "forbids (staff Comments are written after the assessment and often state its outcome), "
                 "and never from the paper's own inputs")  # fmt: skip
    elif len(up_forbidden):
        concl = (f"only inputs the protocol forbids ({listing(sorted(set(up_forbidden['variant'])))}) "
                 f"reach {claim:.0%} on all four measures; the paper's own inputs are not shown to fall short")  # fmt: skip
    else:
        concl = f"no input variant, allowed or forbidden, reaches {claim:.0%} on all four measures"
    return (f"Against the paper's claim of more than {claim:.0%} on accuracy, precision, recall and F1 "
            f"({lvl} bootstrap intervals resampling whole arrangements): " + "; ".join(parts) + f". So {concl}.")  # fmt: skip


def forensic_section(run: RunDir, params: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The forensic arm's table and verdict, or a note that the arm was off in this run."""
    fc = params.get("forensic", {})
    if not fc.get("enabled", False):
        note = (
            "The forensic arm was not run (`forensic.enabled` is false in this run's parameters)."
        )
        empty = markdown_table(pd.DataFrame([{"variant": "not run", "model": "", "accuracy": ""}]))
        return {"verdict": note, "protocol": "n/a", "claim": "n/a", "seconds": "n/a",
                "fields": "n/a", "encoder_note": "", "models": "n/a"}, {"reward_forensic.md": empty}  # fmt: skip
    stage = "notebook 02_reward_model (forensic arm)"
    table = run.read_parquet("reward/forensic.parquet", stage)
    meta = run.read_json("reward/forensic.json", stage)
    claim, alpha = float(meta["paper_claim"]), float(meta["alpha"])
    lvl = level(alpha)
    rows = []
    for _, r in table.iterrows():
        row = {"inputs": r["variant"], "model": MODEL_NAMES.get(r["model"], r["model"]),
               "paper allows": "yes" if r["allowed_by_protocol"] else "no"}  # fmt: skip
        for m, label in (*FORENSIC_MEASURES, ("roc_auc", "AUC")):
            row[f"{label} [{lvl} CI]"] = ci(r[m], r[f"{m}_low"], r[f"{m}_high"])
        row[f"vs {claim:.0%}"] = "·" if r["model"] == "majority" else claim_position(r, claim)
        rows.append(row)
    fields = meta["fields_read"]
    vintage = fields.get("mona_2002_vintage", {})
    read = [*fields.get("staff_comments", [])[:1], *[c for c in vintage.values() if c]]
    enc = [v for v in meta.get("encoder_variants", [])]
    families = sorted(set(table["model"]) - {"majority"}, key=list(MODEL_NAMES).index)
    variables = {
        "models": listing([MODEL_NAMES[m] for m in families]),
        "verdict": forensic_verdict(table, claim, alpha),
        "protocol": meta["protocol"],
        "claim": f"{claim:.0%}",
        "claim_source": meta["paper_claim_source"],
        "seconds": f"{meta['stage_seconds']:.0f}",
        "fields": ", ".join(f"`{c}`" for c in read),
        "n_test": str(meta["n_test"]),
        "encoder_note": (
            f"The fine-tuned encoder was also trained on {listing(enc)}."
            if enc
            else "The encoder family was not run on the forensic inputs in this profile "
            "(`forensic.encoder_variants` is empty: minutes per variant on CPU)."
        ),
    }
    return variables, {"reward_forensic.md": markdown_table(pd.DataFrame(rows))}


# ---------------------------------------------------------------------------------------------
# 03 RL fine-tuning
# ---------------------------------------------------------------------------------------------
def _rl_summary_display(summ: pd.DataFrame) -> pd.DataFrame:
    """notebook 03's `rl_summary` with short headers a page can hold: one cell per quantity."""

    def num(x: Any, digits: int) -> str:
        return fmt_num(x, digits) if is_present(x) else "·"

    def arrow(a: Any, b: Any, digits: int) -> str:
        return f"{num(a, digits)} → {num(b, digits)}" if is_present(a) else "·"

    rows = []
    for _, r in summ.iterrows():
        ev = r.get("explained_variance_last_third")
        rows.append({
            "algorithm": r["algorithm"], "steps": int(r["steps"]),
            "reward (first → last 3 steps)": arrow(r.get("reward_first"), r.get("reward_last"), 3),
            "final KL": num(r.get("kl_last"), 2), "entropy": num(r.get("entropy_last"), 2),
            "critic EV, last third [CI]": ci(ev, r.get("explained_variance_low"), r.get("explained_variance_high")) if is_present(ev) else "·",
            "β (first → last)": arrow(r.get("beta_first"), r.get("beta_last"), 4),
            "s / step": num(r.get("step_time_s"), 1), "tokens / s": num(r.get("tokens_per_s"), 0),
        })  # fmt: skip
    return pd.DataFrame(rows)


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
            ("KL coefficient (initial), PPO adaptive, target, K_beta", f"{rl['kl_coef']:g}, {rl['adaptive_kl']}, {rl['target_kl']:g}, {rl['kl_adapt_rate']:g}"),
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
        response=samples["response"].map(_short), country=samples["country"].map(display_country)
    )[["policy", "country", "econ_descriptor", "response", "reward"]]
    rows = summ.set_index("algorithm")
    ppo_sentence = ""
    if "PPO" in rows.index:
        r = rows.loc["PPO"]
        ev_word = ci_verdict(r.get("explained_variance_low", math.nan),
                             r.get("explained_variance_high", math.nan),
                             "positive", "negative", "no clearly positive")  # fmt: skip
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
            f"[{r.get('explained_variance_low', math.nan):.2f}, {r.get('explained_variance_high', math.nan):.2f}]{prior}); {beta}"
        )
    moves = [move_sentence(algo, r) for algo, r in rows.iterrows()]
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
        "critic": CRITIC_SENTENCE[critic_init],
    }
    includes = {
        # spaces, not underscores: long names wrap in the PDF's narrow columns
        "rl_algorithm_settings.md": markdown_table(
            algo_settings.assign(setting=algo_settings["setting"].map(_spaced))
        ),
        "sft_summary.md": markdown_table(sft.rename(columns=_spaced), floatfmt=".3f")
        if not sft.empty
        else "SFT was not run.",
        "rl_settings.md": markdown_table(settings),
        "rl_summary.md": markdown_table(_rl_summary_display(summ)),
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
def gain_verb(gain: float, p_holm: float, alpha: float) -> str:
    """'raised' / 'lowered' when the Holm-adjusted paired test over prompts rejects at `alpha`
    (the direction is the gain's), else 'did not significantly change'."""
    if not (is_present(p_holm) and p_holm < alpha):
        return "did not significantly change"
    return "raised" if gain > 0 else "lowered"


def history_sentence(hist: dict[str, float], contrast: dict[str, Any]) -> str:
    """Where the reward and audit models place real MET against real Non-MET descriptions of the
    same held-out contexts, read from the paired interval over prompts (`history_contrast`)."""
    if not ("history_met" in hist and "history_nonmet" in hist and contrast.get("reward")):
        return "The held-out contexts evaluated here do not hold both MET and Non-MET history"
    parts = []
    for col, who in (("reward", "the reward model"), ("audit_reward", "the audit model")):
        h = contrast.get(col)
        if not h:
            continue
        word = ci_verdict(
            h["ci_low"], h["ci_high"], "above", "below", "not distinguishably apart from"
        )
        parts.append(f"{who} places what was met {word} what was not "
                     f"(difference {ci(h['mean_diff'], h['ci_low'], h['ci_high'])})")  # fmt: skip
    return (
        f"Real MET descriptions for the same contexts, from rows neither model trained on, score "
        f"{f3(hist['history_met'])} and real Non-MET ones {f3(hist['history_nonmet'])}; on the "
        f"{contrast['reward']['n']} prompts ({contrast['reward']['n_clusters']} countries) that have "
        "both, " + " and ".join(parts)
    )


def eval_section(run: RunDir, alpha: float = 0.05) -> tuple[dict[str, Any], dict[str, str]]:
    stage = "notebook 04_evaluation"
    meta = run.read_json("eval/summary.json", stage=stage)
    s = pd.DataFrame(meta["summary"]).set_index("policy")
    paired = run.read_table("eval_paired", stage)
    t3 = run.read_table("eval_table3", stage)
    algos = meta["algorithms"]
    start = meta.get("start_policy", "base")
    vs_bon = pd.DataFrame(meta.get("vs_best_of_n", []))
    alpha = meta.get("alpha", alpha)
    lvl = level(alpha)
    ppl = pd.DataFrame(meta.get("heldout_perplexity", []))

    def gain_cell(r: pd.Series, col: str) -> str:
        if pd.isna(r.get(col)):
            return "·"
        low, high = r[col + "_low"], r[col + "_high"]
        return f"{r[col]:+.3f} [{low:+.3f}, {high:+.3f}] ({fmt_p(r[col + '_p_holm'])})"

    rows, cost = [], []
    for pol, r in s.iterrows():
        rows.append({
            "policy": pol, "prompts": int(r["n_prompts"]),
            f"Ave(R) [{lvl} CI]": ci(r["ave_r"], r["ave_r_low"], r["ave_r_high"]),
            f"reward SD [{lvl} CI]": ci(r["reward_sd"], r["reward_sd_low"], r["reward_sd_high"]) if is_present(r.get("reward_sd")) else "·",
            f"gain vs {start} [{lvl} CI] (Holm p)": gain_cell(r, "gain"),
            f"audit [{lvl} CI]": ci(r["audit"], r["audit_low"], r["audit_high"]),
            f"audit gain [{lvl} CI] (Holm p)": gain_cell(r, "audit_gain"),
            f"reward − audit gap [{lvl} CI]": "·" if pd.isna(r.get("gap")) else ci(r["gap"], r["gap_low"], r["gap_high"]),
        })  # fmt: skip
        cost.append({
            "policy": pol,
            "KL (nats)": "·" if pd.isna(r["kl"]) else (f"≤ {r['kl']:.2f}" if r["kl_kind"] == "upper bound" else f"{r['kl']:.2f}"),
            "perplexity": f"{r['perplexity']:.1f}",
            "finished": "·" if pd.isna(r.get("finished")) else f"{r['finished']:.0%}",
            "words": f"{r['mean_words']:.1f}",
            "distinct-2": f3(r["distinct_2"]),
            "rep-3": f3(r["rep_3"]),
            f"grounded MET [{lvl} CI]": ci(r["grounded_met"], r["grounded_low"], r["grounded_high"]),
            "max similarity": f3(r["max_sim"]),
        })  # fmt: skip
    summary_md = markdown_table(pd.DataFrame(rows))
    cost_md = markdown_table(pd.DataFrame(cost))
    pt = paired.assign(
        **{
            f"difference [{lvl} CI]": [ci(a, b, c) for a, b, c in zip(paired.mean_diff, paired.ci_low, paired.ci_high, strict=True)],
            "d_z": paired["cohens_dz"].map(lambda x: f"{x:.2f}"),
            "p (t, Holm)": paired["p_ttest_holm"].map(pval),
            "p (Wilcoxon, Holm)": paired["p_wilcoxon_holm"].map(pval),
        }
    )[["measure", "policy", "n", "n_clusters", f"difference [{lvl} CI]", "d_z", "p (t, Holm)", "p (Wilcoxon, Holm)"]]  # fmt: skip
    t3_md = markdown_table(
        t3.assign(
            prompt=t3["prompt"].map(lambda x: _short(x, 70)), response=t3["response"].map(_short)
        )[["prompt", "policy", "response", "reward"]]
    )

    sentences, concl = [], []
    for algo in algos:
        r = s.loc[algo]
        verb = gain_verb(r["gain"], r["gain_p_holm"], alpha)
        a_verb = gain_verb(r["audit_gain"], r["audit_gain_p_holm"], alpha)
        sentences.append(
            f"{algorithm_label(algo)} {verb} Ave(R) on the held-out prompts (from {f3(s.loc[start, 'ave_r'])} for {start} to "
            f"{ci(r['ave_r'], r['ave_r_low'], r['ave_r_high'])}; paired gain {r['gain']:+.3f}, Holm-adjusted "
            f"Wilcoxon {fmt_p(r['gain_p_holm'])}) and {a_verb} the audit model's reward ({r['audit_gain']:+.3f}, "
            f"{fmt_p(r['audit_gain_p_holm'])}), at a KL of {r['kl']:.2f} nats to the starting policy"
        )
        gap_word = ci_verdict(r.get("gap_low", math.nan), r.get("gap_high", math.nan),
                              "larger than", "smaller than", "not distinguishable from")  # fmt: skip
        concl.append(
            f"{algorithm_label(algo)} {verb} the reward it was trained on and {a_verb} the disjoint-rows audit "
            f"reward (its reward gain {gap_word} its audit gain)"
        )
    hist = {
        p: s.loc[p, "ave_r"]
        for p in ("history_met", "history_nonmet", "random_policy")
        if p in s.index
    }
    hist_sentence = history_sentence(hist, meta.get("history_contrast", {}))
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
            f"{algorithm_label(r['policy'])} ({f3(r['ave_r'])} at {r['kl']:.2f} nats) lies {where} the best-of-N curve "
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
    marker = f"{HEADS_FOLDER}/{HEADS_MARKER}"  # the reward heads' settings (reward_uncertainty)
    heads = run.read_json(marker) if run.exists(marker) else None
    variables = {
        "n_prompts": str(meta["n_prompts"]),
        "level": lvl,
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
        "uncertainty_sentence": uncertainty_sentence(s, algos, start, lvl, heads),
    }
    return variables, {
        "eval_summary.md": summary_md,
        "eval_cost.md": cost_md,
        "eval_paired.md": markdown_table(pt),
        "eval_table3.md": t3_md,
        "eval_heldout_perplexity.md": ppl_md,
    }


def uncertainty_sentence(
    s: pd.DataFrame, algos: list[str], start: str, lvl: str, heads: dict[str, Any] | None
) -> str:
    """The reward heads' verdict per RL policy (`sd_verdict`: from the CI of `sd_gain`), with the
    mean SD of P(MET) and its change; `s` is the eval summary indexed by policy, `heads` the
    marker of `reward_model/uncertainty/` (None when the run fitted none)."""
    measured = (
        "reward_sd" in s.columns and start in s.index and is_present(s.loc[start, "reward_sd"])
    )
    if not measured:
        return (
            "This run measured no reward uncertainty: its reward source has no encoder features "
            "or evaluation.reward_heads is 0"
        )
    rows = heads["settings"].get("n_rows", "n/a") if heads else "n/a"
    intro = f"This run fitted {heads['n_heads']} heads on {rows} training rows. " if heads else ""
    parts = []
    for algo in algos:
        if algo not in s.index:
            continue
        r = s.loc[algo]
        low, high = r.get("sd_gain_low", math.nan), r.get("sd_gain_high", math.nan)
        parts.append(
            f"{algorithm_label(algo)} {sd_verdict(low, high)} (mean SD "
            f"{ci(r['reward_sd'], r['reward_sd_low'], r['reward_sd_high'])}; paired change "
            f"{ci(r.get('sd_gain', math.nan), low, high)})"
        )
    start_sd = ci(
        s.loc[start, "reward_sd"], s.loc[start, "reward_sd_low"], s.loc[start, "reward_sd_high"]
    )
    body = "; ".join(parts) if parts else "no RL policy was evaluated"
    return (
        f"{intro}Against the start policy {start} (mean SD {start_sd}), with {lvl} "
        f"cluster-bootstrap intervals of the paired change: {body}"
    )


# ---------------------------------------------------------------------------------------------
# 04 evaluation: RL with guided feedback (the RLGF paper's table, Figures 2 and 3, verdicts)
# ---------------------------------------------------------------------------------------------
RLGF_TABLES = ("eval_rlgf", "eval_easy_hard", "eval_guidance")


def _note_table(text: str) -> str:
    """A one-cell table standing in for one the run lacks (captions and cross-references hold)."""
    return markdown_table(pd.DataFrame({"note": [text]}))


def _eval_meta(run: RunDir, params: dict[str, Any], stage: str) -> tuple[list[str], str, float]:
    """(RL algorithms, start policy, alpha) of notebook 04's summary, falling back to the run's
    parameters for a summary that predates those fields."""
    meta = run.read_json("eval/summary.json", stage=stage)
    algos = list(meta.get("algorithms", params.get("rl", {}).get("algorithm", [])))
    alpha = meta.get("alpha", params.get("evaluation", {}).get("alpha", 0.05))
    return algos, meta.get("start_policy", "base"), alpha


def rlgf_section(run: RunDir, params: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The RLGF section: the paper's table, easy vs hard prompts and the two verdicts (does
    guidance beat PPO, does RL beat `sft_met`), read from notebook 04's tables; every verb comes
    from an interval (`rlgf_eval.guidance_sentences`). A run without a guided algorithm says which
    algorithms ran; a run dir older than these tables says so instead of failing."""
    from . import rlgf_eval

    stage = "notebook 04_evaluation"
    algos, start, alpha = _eval_meta(run, params, stage)
    lvl = level(alpha)
    ran = [algorithm_label(a) for a in algos]
    guided = [algorithm_label(a) for a in algos if a in RLGF_ALGORITHMS]
    if guided:
        ran_sentence = (
            f"This run trained {listing(ran)}; the guided {'ones are' if len(guided) > 1 else 'one is'} "
            f"{listing(guided)}, with `{params.get('rlgf', {}).get('guide', 'sft_met')}` as the guide"
        )
    else:
        ran_sentence = f"This run trained {listing(ran)}; none of them is guided"
    variables: dict[str, Any] = {
        "level": lvl,
        "start": start,
        "ran_sentence": ran_sentence,
        "guide": params.get("rlgf", {}).get("guide", "sft_met"),
    }
    words = {"arrangement_type": "arrangement type", "econ_descriptor": "economic descriptor"}

    def key_words(keys: Any) -> str:
        return " × ".join(words.get(k, k) for k in keys)

    key = key_words(rlgf_eval.CONTEXT_KEYS)
    missing = [t for t in RLGF_TABLES if not run.exists(f"tables/{t}.csv")]
    if missing:
        note = (
            f"This run directory predates the RLGF evaluation (no {', '.join(f'tables/{t}.csv' for t in missing)}); "
            f"rerun {stage} to produce it"
        )
        short = f"Not in this run directory, which predates the RLGF evaluation (rerun {stage})"
        variables.update(guidance_sentence=short, rl_vs_sft_met_sentence=short,
                         easy_hard_sentence=short, context_key=key, median="n/a")  # fmt: skip
        text = _note_table(note)
        return variables, {
            "rlgf_table.md": text,
            "rlgf_guidance.md": text,
            "rlgf_easy_hard.md": text,
        }

    table = run.read_table("eval_rlgf", stage)
    easy_hard = run.read_table("eval_easy_hard", stage)
    guidance = run.read_table("eval_guidance", stage)
    verdicts = rlgf_eval.guidance_sentences(guidance, algos, alpha)
    variables.update(
        guidance_sentence=verdicts["guidance"],
        rl_vs_sft_met_sentence=verdicts["rl_vs_sft_met"],
        easy_hard_sentence=rlgf_eval.easy_hard_sentences(easy_hard, start, alpha, preamble=False),
    )
    diff = run.read_table("eval_prompt_difficulty", stage) if run.exists(
        "tables/eval_prompt_difficulty.csv") else pd.DataFrame()  # fmt: skip
    variables["context_key"] = (
        key_words(str(diff["context_key"].iloc[0]).split(" × ")) if len(diff) else key
    )
    variables["median"] = f3(easy_hard["median_met_rate"].iloc[0]) if len(easy_hard) else "n/a"

    def kl_cell(r: pd.Series) -> str:
        if not is_present(r["kl"]):
            return "·"
        return f"≤ {r['kl']:.2f}" if r["kl_kind"] == "upper bound" else f"{r['kl']:.2f}"

    rows = [
        {"policy": r["label"], f"Ave(R) [{lvl} CI]": ci(r["ave_r"], r["ave_r_low"], r["ave_r_high"]),
         f"audit [{lvl} CI]": ci(r["audit"], r["audit_low"], r["audit_high"]), "KL (nats)": kl_cell(r),
         "output perplexity": f"{r['output_ppl']:.1f}" if is_present(r["output_ppl"]) else "·",
         "MET perplexity": f"{r['met_ppl']:.1f}" if is_present(r["met_ppl"]) else "·",
         "distinct-2": f3(r["distinct_2"]),
         "finished": f"{r['finished']:.0%}" if is_present(r["finished"]) else "·"}
        for _, r in table.iterrows()
    ]  # fmt: skip
    table_md = markdown_table(pd.DataFrame(rows))
    if easy_hard.empty:
        eh_md = _note_table(
            "Every held-out prompt's context has the same historical MET rate: no split"
        )
    else:
        eh = easy_hard.assign(
            half=easy_hard["half"].replace({"hard_minus_easy": "hard − easy"}),
            **{
                f"Ave(R) [{lvl} CI]": [ci(a, b, c) for a, b, c in zip(easy_hard.ave_r, easy_hard.ave_r_low, easy_hard.ave_r_high, strict=True)],
                f"gain over {start} [{lvl} CI]": [ci(a, b, c) if is_present(a) else "·" for a, b, c in zip(easy_hard.gain, easy_hard.gain_low, easy_hard.gain_high, strict=True)],
                "verdict": easy_hard["gain_verdict"].fillna(""),
            },
        )  # fmt: skip
        eh_md = markdown_table(
            eh[["label", "half", "n_prompts", "n_countries", f"Ave(R) [{lvl} CI]",
                f"gain over {start} [{lvl} CI]", "verdict"]].rename(
                columns={"label": "policy", "n_prompts": "prompts", "n_countries": "countries"})
        )  # fmt: skip
    if guidance.empty:
        g_md = _note_table(f"No comparison was made: {verdicts['guidance']}")
    else:
        g = guidance.assign(
            question=guidance["question"].map(rlgf_eval.QUESTIONS),
            measure=guidance["measure"].map(rlgf_eval.MEASURES),
            policy=guidance["policy"].map(algorithm_label),
            versus=guidance["versus"].map(algorithm_label),
            **{f"difference [{lvl} CI]": [ci(a, b, c) for a, b, c in zip(guidance["diff"], guidance["low"], guidance["high"], strict=True)],
               "p (Wilcoxon, Holm)": guidance["p_holm"].map(pval)},
        )  # fmt: skip
        g_md = markdown_table(
            g[["question", "measure", "policy", "versus", "n", "n_clusters",
               f"difference [{lvl} CI]", "verdict", "p (Wilcoxon, Holm)"]].rename(
                columns={"n": "prompts", "n_clusters": "countries"})
        )  # fmt: skip
    return variables, {
        "rlgf_table.md": table_md,
        "rlgf_guidance.md": g_md,
        "rlgf_easy_hard.md": eh_md,
    }


# ---------------------------------------------------------------------------------------------
# 04 evaluation: inclusive learning (the ILHF paper's KL to the population and diversity)
# ---------------------------------------------------------------------------------------------
ILHF_TABLES = ("eval_inclusive", "eval_inclusive_tests")
#: Figures of the ILHF section a run dir older than `ilhf_eval` lacks (`report.placeholder_figures`).


def _ilhf_ran_sentence(algos: list[str], params: dict[str, Any]) -> str:
    ran = [algorithm_label(a) for a in algos]
    ilhf = [a for a in algos if a in ILHF_ALGORITHMS]
    if not ilhf:
        return (
            f"This run trained {listing(ran)}; no ILHF algorithm ran, so only the other policies' "
            "variety is measured below"
        )
    m = int(params.get("ilhf", {}).get("particles", 1))
    each = "each " if len(ilhf) > 1 else ""
    ens = (
        f"{each}an ensemble of {m} LoRA particles (a particle drawn per prompt answers it; the "
        "mixture of all scores a text)"
        if m > 1
        else f"{each}a single LoRA adapter (one particle)"
    )
    return (
        f"This run trained {listing(ran)}; the ILHF {'ones are' if len(ilhf) > 1 else 'one is'} "
        f"{listing([algorithm_label(a) for a in ilhf])}, {ens}"
    )


def ilhf_section(run: RunDir, params: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The ILHF section: each policy's variety (pairwise similarity, area entropy and KL to the
    history, distinct-2) and held-out MET cross-entropy beside its Ave(R), and the verdicts of
    each ILHF algorithm against PPO, `sft_met` and the start policy, read from notebook 04's
    tables; every verb comes from an interval (`ilhf_eval.inclusive_sentences`). A run without an
    ILHF algorithm says so; a run dir older than these tables says so instead of failing."""
    from . import ilhf_eval

    stage = "notebook 04_evaluation"
    algos, start, alpha = _eval_meta(run, params, stage)
    lvl = level(alpha)
    variables: dict[str, Any] = {"level": lvl, "start": start,
                                 "ran_sentence": _ilhf_ran_sentence(algos, params)}  # fmt: skip
    missing = [t for t in ILHF_TABLES if not run.exists(f"tables/{t}.csv")]
    if missing:
        note = (
            f"This run directory predates the ILHF evaluation (no {', '.join(f'tables/{t}.csv' for t in missing)}); "
            f"rerun {stage} to produce it"
        )  # fmt: skip
        short = f"Not in this run directory, which predates the ILHF evaluation (rerun {stage})"
        keys = ("variety", "reward", "population", "verdicts", "collapse", "history")
        variables.update({f"{k}_sentence": short for k in keys})
        return variables, {"ilhf_table.md": _note_table(note), "ilhf_tests.md": _note_table(note)}
    tables = {t: run.read_table(t, stage) for t in ILHF_TABLES}
    sentences = ilhf_eval.inclusive_sentences(tables, algos, start, alpha)
    variables.update({f"{k}_sentence": v for k, v in sentences.items()})
    t = tables["eval_inclusive"]

    def cell(r: pd.Series, col: str) -> str:
        if not is_present(r[col]):
            return "·"
        lo, hi = r.get(f"{col}_low", math.nan), r.get(f"{col}_high", math.nan)
        return ci(r[col], lo, hi) if is_present(lo) and is_present(hi) else f3(r[col])

    with_sd = t["reward_sd"].notna().any()
    rows = [
        {"policy": r["label"], f"Ave(R) [{lvl} CI]": cell(r, "ave_r"),
         **({f"reward SD [{lvl} CI]": cell(r, "reward_sd")} if with_sd else {}),
         "KL (nats)": f"{r['kl']:.2f}" if is_present(r["kl"]) else "·",
         "MET cross-entropy": cell(r, "xent_met"),
         f"vs {start} [{lvl} CI]": cell(r, "xent_met_vs_start"),
         "area entropy": cell(r, "area_entropy"), "area KL from history": cell(r, "area_kl_to_history"),
         "distinct-2": cell(r, "distinct_2"),
         f"pairwise similarity [{lvl} CI]": cell(r, "pairwise_sim")}
        for _, r in t.iterrows()
    ]  # fmt: skip
    tests = tables["eval_inclusive_tests"]
    if tests.empty:
        tests_md = _note_table(f"No comparison was made: {sentences['variety']}")
    else:
        tt = tests.assign(
            measure=tests["measure"].map(ilhf_eval.MEASURES),
            policy=tests["policy"].map(algorithm_label),
            versus=tests["versus"].map(algorithm_label),
            **{f"difference [{lvl} CI]": [ci(a, b, c) for a, b, c in zip(tests["diff"], tests["low"], tests["high"], strict=True)]},
        )  # fmt: skip
        tests_md = markdown_table(
            tt[["measure", "policy", "versus", "n", "n_clusters", f"difference [{lvl} CI]",
                "verdict"]].rename(columns={"n": "units", "n_clusters": "countries"})
        )  # fmt: skip
    return variables, {
        "ilhf_table.md": markdown_table(pd.DataFrame(rows)),
        "ilhf_tests.md": tests_md,
    }


# ---------------------------------------------------------------------------------------------
# 05 risks
# ---------------------------------------------------------------------------------------------
def risk_section(run: RunDir) -> tuple[dict[str, Any], dict[str, str]]:
    """Variables and tables of notebook 05, from `risk/summary.json` and its tables."""
    from .risk import report_content

    return report_content(run)


SECTIONS = ("reward", "forensic", "rl", "eval", "rlgf", "ilhf", "risk")
