"""The reward-model section: accuracy against the paper's claim per protocol, the encoders
compared, calibration, within-context ranking and the reference check, in words."""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from rlxf_utils.artifacts import ArtifactMissing, RunDir
from rlxf_utils.report.wording import (
    ABOVE,
    BELOW,
    UNCLEAR,
    ci,
    interval,
    listing,
    markdown_table,
    num,
    pct,
    phrase,
    say,
    verdict_code,
)
from rlxf_utils.reward.encoders import ENCODER_NAMES
from rlxf_utils.reward.model import PAPER_ACCURACY
from rlxf_utils.stats import level

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
    above = cand[cand.apply(lambda r: all(r[f"{k}_low"] > PAPER_ACCURACY for k in four), axis=1)]
    short = cand[cand.apply(lambda r: any(r[f"{k}_high"] < PAPER_ACCURACY for k in four), axis=1)]
    if len(above):
        who = listing([f"{labels[r.model]} ({r.protocol})" for r in above.itertuples()])
        return (
            f"the paper's {PAPER_ACCURACY:.0%} on accuracy, precision, recall and F1 is reached, with "
            f"every {lvl} interval above it, by {who}"
        )
    best = cand.loc[cand["accuracy"].idxmax()]
    return (
        f"no model's {lvl} intervals lie above the paper's {PAPER_ACCURACY:.0%} on all of accuracy, "
        f"precision, recall and F1 under any protocol, and {len(short)} of {len(cand)} fall "
        f"significantly short of it on at least one; the best accuracy is "
        f"{pct(best['accuracy'])} [{pct(best['accuracy_low'])}, {pct(best['accuracy_high'])}] "
        f"({labels[best['model']]}, {best['protocol']})"
    )


def _by_verdict(rows: pd.DataFrame, key: str, what: str,
                order: tuple[str, ...] = (ABOVE, BELOW, UNCLEAR)) -> str:  # fmt: skip
    """'<phrase> under the a and b protocols and <phrase> under c' from per-protocol verdicts, each
    phrase the vocabulary's `key` (`wording.phrase`) for a verdict code, in `order`."""
    parts = []
    codes = rows["verdict"].map(verdict_code)
    for code in order:
        ps = rows.loc[codes == code, "protocol"].tolist()
        if ps:
            parts.append(
                f"{phrase(key, code)} under the {listing(ps)} protocol{'s' if len(ps) > 1 else ''}"
            )
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

    def diff_ci(d: pd.Series) -> str:
        return ci(d["diff"], d["diff_low"], d["diff_high"], signed=True)

    acc = comp[(comp["measure"] == "accuracy") & (comp["comparison"] == "encoder vs TF-IDF")]
    if has_enc:
        enc_vs = _by_verdict(
            acc,
            "encoder_accuracy",
            f"against TF-IDF + LR, the {labels['encoder']} is",
        )  # fmt: skip
        enc_vs += f" (paired {lvl} bootstrap intervals of the accuracy difference)"
    else:
        enc_vs = "no encoder was trained in this run"
    pm = pdiff[pdiff["model"] == main] if len(pdiff) else pdiff
    if len(pm):
        protocol_sentence = _by_verdict(
            pm,
            "protocol_accuracy",
            f"Against the {pm['reference'].iloc[0]} split, the {labels[main]}'s test accuracy",
            order=(BELOW, ABOVE, UNCLEAR),
        ) + " (" + "; ".join(f"{r.protocol} {100 * r.diff:+.1f} points {interval(100 * r.diff_low, 100 * r.diff_high, digits=1)}"
                             for r in pm.itertuples()) + ")"  # fmt: skip
    else:
        protocol_sentence = (
            "Only one protocol was run, so accuracy is not compared across protocols"
        )

    cal_main = cal[(cal["protocol"] == proto) & (cal["model"] == main)].iloc[0]
    cal_word = phrase("gain", cal_main["ece_verdict"])
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
                f"after − before [{lvl} CI]": [ci(a - b, lo, hi, signed=True) for a, b, lo, hi in zip(cal.test_ece_after, cal.test_ece_before, cal.ece_diff_low, cal.ece_diff_high, strict=True)],
                "Brier before": cal["test_brier_before"].map(num),
                "Brier after": cal["test_brier_after"].map(num),
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
                "a": comp["value_a"].map(num),
                "b": comp["value_b"].map(num),
                f"a − b [{lvl} CI]": [diff_ci(r) for _, r in comp.iterrows()],
                "verdict": comp["verdict"].map(lambda v: phrase("direction", v)),
            }
        )
    )  # fmt: skip

    wc = m[m["protocol"] == proto].set_index("model")
    mm = wc.loc[main]
    t_vs_c = comp[(comp["protocol"] == proto) & (comp["comparison"] == "text only vs context only")]
    if len(t_vs_c):
        r = t_vs_c.iloc[0]
        reads_text = phrase("probes", r["verdict"])
        if verdict_code(r["verdict"]) == BELOW:
            reads_text += ", so much of the reward is a prior over contexts"
        reads_text += f" (AUC difference {diff_ci(r)}, {lvl} CI)"
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
        "paper_claim": f"{PAPER_ACCURACY:.0%}",
        "encoder_vs_tfidf": enc_vs,
        "protocol_sentence": protocol_sentence,
        "main_accuracy": pct(mm["accuracy"]),
        "main_accuracy_ci": f"[{pct(mm['accuracy_low'])}, {pct(mm['accuracy_high'])}]",
        "main_auc": num(mm["roc_auc"]),
        "main_f1": num(mm["f1"]),
        "majority_accuracy": pct(wc.loc["majority", "accuracy"]),
        "temperature": f"{cal_main['temperature']:.2f}",
        "offset": f"{cal_main['offset']:+.2f}",
        "ece_before": num(cal_main["test_ece_before"]),
        "ece_after": num(cal_main["test_ece_after"]),
        "ece_diff_ci": f"{interval(cal_main['ece_diff_low'], cal_main['ece_diff_high'])}",
        "brier_before": num(cal_main["test_brier_before"]),
        "brier_after": num(cal_main["test_brier_after"]),
        "calibration_verdict": cal_word,
        "context_only_auc": num(wc.loc["context_only", "roc_auc"]),
        "text_only_auc": num(wc.loc["text_only", "roc_auc"]),
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
                        f"{word} {phrase('direction', r['verdict'])} "
                        f"({num(r['diff'], 1 if scale == 100 else 3, True, scale)}{unit} "
                        f"{interval(r['diff_low'], r['diff_high'], 1 if scale == 100 else 3, scale=scale)})"
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
        v = set(c["verdict"].map(verdict_code))
        if ABOVE in v and BELOW not in v:
            found.append(f"the evidence favours the {labels[name]} over the {labels['encoder']}")
        elif BELOW in v and ABOVE not in v:
            found.append(f"the evidence favours the {labels['encoder']} over the {labels[name]}")
        elif v == {UNCLEAR}:
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
        + say("position_from", r.auc_low - 0.5, r.auc_high - 0.5)
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


# -- notebook 02's narrative --------------------------------------------------------------------
def accuracy_lines(tables: dict[str, pd.DataFrame], lvl: str) -> str:
    """Test accuracy per protocol against the paper, encoder against TF-IDF, and how accuracy moves
    from the random split to the others, each verdict read from its paired interval."""
    acc, comp = tables["reward_accuracy_vs_paper"], tables["reward_comparisons"]
    lines = []
    for row in acc.itertuples():
        line = (
            f"- **{row.protocol}**: encoder {row.encoder:.1%}, TF-IDF LR {row.tfidf_lr:.1%}, majority "
            f"class {row.majority:.1%} (paper: {row.paper_claim:.0%})"
        )
        c = comp[(comp["protocol"] == row.protocol) & (comp["comparison"] == "encoder vs TF-IDF")]
        c = c[c["measure"] == "accuracy"]
        if len(c):
            r = c.iloc[0]
            verdict = phrase("encoder_vs_tfidf", r["verdict"])
            line += (
                f"; encoder − TF-IDF {100 * r['diff']:+.1f} points, paired {lvl} CI "
                f"{interval(100 * r['diff_low'], 100 * r['diff_high'], digits=1)}: {verdict}"
            )
        lines.append(line + ".")
    for r in tables["reward_protocol_differences"].itertuples():
        move = phrase("protocol_accuracy", r.verdict)
        lines.append(
            f"- {r.model} accuracy under **{r.protocol}** against **{r.reference}**: {r.accuracy:.1%} "
            f"vs {r.accuracy_reference:.1%}, {100 * r.diff:+.1f} points ({lvl} CI "
            f"{interval(100 * r.diff_low, 100 * r.diff_high, digits=1)}): it {move}."
        )
    return "Test accuracy per protocol:\n\n" + "\n".join(lines)


def calibration_lines(cal: pd.DataFrame, model: str, lvl: str) -> str:
    """Per protocol: the fitted temperature and offset and what calibration did to the test ECE."""
    return "\n".join(
        f"- **{r.protocol}** ({r.model}): T {r.temperature:.2f}, offset {r.offset:+.2f} from "
        f"{r.n_calibration} calibration rows; test ECE {r.test_ece_before:.3f} → {r.test_ece_after:.3f} "
        f"(change {r.test_ece_after - r.test_ece_before:+.3f}, paired {lvl} CI "
        f"{interval(r.ece_diff_low, r.ece_diff_high)}: calibration {phrase('gain', r.ece_verdict)} "
        f"the ECE), Brier {r.test_brier_before:.3f} → {r.test_brier_after:.3f}."
        for r in cal[cal["model"] == model].itertuples()
    )


def within_context_sentence(
    tables: dict[str, pd.DataFrame], protocol: str, model: str, lvl: str
) -> str:
    """Context fields alone against text alone, and the pair-weighted AUC within groups."""
    g = tables["reward_within_context"].set_index(["protocol", "model"])
    comp = tables["reward_comparisons"]

    def within(name: str, stem: str) -> str:
        r = g.loc[(protocol, name)]
        return (
            f"{r[f'auc_within_{stem}']:.3f} [{r[f'auc_within_{stem}_low']:.3f}, "
            f"{r[f'auc_within_{stem}_high']:.3f}]"
        )

    tc = comp[(comp["protocol"] == protocol) & (comp["comparison"] == "text only vs context only")]
    tc = tc.iloc[0]
    reads = phrase("probes", tc["verdict"])
    return (
        f"On the **{protocol}** protocol the context fields alone reach AUC "
        f"{g.loc[(protocol, 'context_only'), 'roc_auc']:.3f} and the text alone "
        f"{g.loc[(protocol, 'text_only'), 'roc_auc']:.3f} (difference {tc['diff']:+.3f}, paired {lvl} "
        f"CI {interval(tc['diff_low'], tc['diff_high'])}): {reads}. Pair-weighted within-group AUC "
        f"({lvl} CI) of the {model}: within countries {within(model, 'country')}, within areas "
        f"{within(model, 'area')}, within full contexts {within(model, 'context')}; TF-IDF LR within "
        f"countries {within('tfidf', 'country')}."
    )


def reward_choice_sentence(tables: dict[str, pd.DataFrame], protocol: str, source: str,
                           folder: str, lvl: str) -> str:  # fmt: skip
    """Which model notebook 03 optimises against, where it is saved and how good it is."""
    m = tables["reward_metrics"].set_index(["protocol", "model"]).loc[(protocol, source)]
    return (
        f"Notebook 03 optimises against the **{source}** model trained on the **{protocol}** "
        f"training split, saved to `{folder}/` (test accuracy {m['accuracy']:.1%}, {lvl} CI "
        f"[{m['accuracy_low']:.1%}, {m['accuracy_high']:.1%}], AUC {m['roc_auc']:.3f}, ECE "
        f"{m['ece']:.3f}); the other model is kept beside it as the audit reward."
    )
