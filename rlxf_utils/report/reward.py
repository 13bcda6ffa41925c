"""The reward-model section: accuracy against the paper's claim per protocol, the encoders
compared, calibration, within-context ranking and the reference check. This module reads the
run's artifacts and builds each sentence's context (numbers, verdict codes, ids and the models'
labels); the words are the author's, in `reports/templates/reward.jinja`."""

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
    num,
    pct,
    sentence,
    table,
    verdict_code,
)
from rlxf_utils.reward.encoders import ENCODER_NAMES
from rlxf_utils.reward.model import PAPER_ACCURACY
from rlxf_utils.stats import bound_verdict, level

REWARD_LABELS = {"majority": "majority class", "tfidf": "TF-IDF + LR", "encoder": "fine-tuned encoder",
                 "context_only": "context only", "text_only": "text only"}  # fmt: skip

STAGE = "notebook 02_reward_model"


def _say(name: str, c: dict[str, Any]) -> str:
    return sentence("reward", name, c)


def reward_labels(meta: dict[str, Any]) -> dict[str, str]:
    """Model name -> label: REWARD_LABELS with each encoder named by what it is, e.g.
    'fine-tuned all-MiniLM-L6-v2' (`reward/metrics.json`'s `encoders`; older runs lack it)."""
    labels = dict(REWARD_LABELS)
    for name, enc in meta.get("encoders", {}).items():
        labels[name] = f"fine-tuned {enc['label']}"
    return labels


def _diff(r: Any) -> dict[str, Any]:
    """A comparison's verdict code and paired difference with its interval."""
    return {"verdict": verdict_code(r["verdict"]), "diff": r["diff"], "low": r["diff_low"],
            "high": r["diff_high"]}  # fmt: skip


def _paper(m: pd.DataFrame, labels: dict[str, str]) -> dict[str, Any]:
    """The scorers whose intervals lie above the paper's 82% on all four measures, else the best
    accuracy and how many scorers fall significantly short on at least one."""
    four = ["accuracy", "precision", "recall", "f1"]
    cand = m[~m["model"].isin(["majority", "context_only", "text_only"])]
    above = cand[cand.apply(lambda r: all(r[f"{k}_low"] > PAPER_ACCURACY for k in four), axis=1)]
    short = cand[cand.apply(lambda r: any(r[f"{k}_high"] < PAPER_ACCURACY for k in four), axis=1)]
    best = cand.loc[cand["accuracy"].idxmax()]
    return {
        "paper": PAPER_ACCURACY,
        "above": [{"label": labels[r.model], "protocol": r.protocol} for r in above.itertuples()],
        "best": {"label": labels[best["model"]], "protocol": best["protocol"],
                 "accuracy": best["accuracy"], "low": best["accuracy_low"],
                 "high": best["accuracy_high"]},
        "n_short": len(short),
        "n_scorers": len(cand),
    }  # fmt: skip


def _by_verdict(rows: pd.DataFrame, order: tuple[str, ...] = (ABOVE, BELOW, UNCLEAR)) -> list:
    """[verdict code, [protocols]] for each code of `order` that some row's verdict has."""
    codes = rows["verdict"].map(verdict_code)
    groups = [[c, rows.loc[codes == c, "protocol"].tolist()] for c in order]
    return [g for g in groups if g[1]]


def reward_section(run: RunDir) -> tuple[dict[str, Any], dict[str, str]]:
    """Variables and tables of notebook 02: every verdict is read from a bootstrap interval."""
    meta = run.read_json("reward/metrics.json", stage=STAGE)
    missing = [k for k in ("alpha", "comparisons", "protocol_differences") if k not in meta]
    if missing:
        raise ArtifactMissing(
            f"{run.path('reward/metrics.json')}: fields {missing} missing; rerun {STAGE}"
        )
    alpha = meta["alpha"]
    lvl = level(alpha)
    m = pd.DataFrame(meta["metrics"])
    cal = pd.DataFrame(meta["calibration"])
    comp = pd.DataFrame(meta["comparisons"])
    pdiff = pd.DataFrame(meta["protocol_differences"])
    src, proto = meta["reward_source"], meta["reward_protocol"]
    main = src
    labels = reward_labels(meta)
    scorers = m[~m["model"].isin(["context_only", "text_only"])]

    metrics_md = table("reward_metrics", scorers, labels=labels)

    acc = comp[(comp["measure"] == "accuracy") & (comp["comparison"] == "encoder vs TF-IDF")]
    pm = pdiff[pdiff["model"] == main] if len(pdiff) else pdiff
    cal_main = cal[(cal["protocol"] == proto) & (cal["model"] == main)].iloc[0]
    cal_md = table("reward_calibration", cal, labels=labels, lvl=lvl)
    within = m[m["model"] != "majority"]
    within_md = table("reward_within", within, labels=labels, lvl=lvl)
    tests_md = table("reward_tests", comp, lvl=lvl)

    wc = m[m["protocol"] == proto].set_index("model")
    mm = wc.loc[main]
    t_vs_c = comp[(comp["protocol"] == proto) & (comp["comparison"] == "text only vs context only")]
    timing = meta.get("timing", {}).get(proto, {})

    def auc_ci(stem: str) -> str:
        return ci(
            mm[f"auc_within_{stem}"], mm[f"auc_within_{stem}_low"], mm[f"auc_within_{stem}_high"]
        )

    c = {
        "level": lvl,
        "labels": labels,
        "source": main,
        **_paper(m, labels),
        "has_encoder": "encoder" in set(m["model"]),
        "encoder_groups": _by_verdict(acc),
        "reference": pm["reference"].iloc[0] if len(pm) else None,
        "protocol_groups": _by_verdict(pm, order=(BELOW, ABOVE, UNCLEAR)) if len(pm) else [],
        "protocol_diffs": [
            {"protocol": r.protocol, "diff": r.diff, "low": r.diff_low, "high": r.diff_high}
            for r in pm.itertuples()
        ],  # fmt: skip
        "ece_verdict": verdict_code(cal_main["ece_verdict"]),
        "probes": _diff(t_vs_c.iloc[0]) if len(t_vs_c) else None,
    }
    variables = {
        "source": labels[src] if src != "tfidf" else "TF-IDF + logistic regression",
        "protocol": proto,
        "level": lvl,
        "calibration_share": f"{meta.get('calibration_share', 0.5):.0%}",
        **{k: _say(k, c) for k in ("paper_verdict", "encoder_vs_tfidf", "protocol_sentence",
                                   "calibration_verdict", "reads_text")},  # fmt: skip
        "paper_claim": f"{PAPER_ACCURACY:.0%}",
        "main_accuracy": pct(mm["accuracy"]),
        "main_accuracy_ci": f"[{pct(mm['accuracy_low'])}, {pct(mm['accuracy_high'])}]",
        "main_auc": num(mm["roc_auc"]),
        "main_f1": num(mm["f1"]),
        "majority_accuracy": pct(wc.loc["majority", "accuracy"]),
        "temperature": f"{cal_main['temperature']:.2f}",
        "offset": f"{cal_main['offset']:+.2f}",
        "ece_before": num(cal_main["test_ece_before"]),
        "ece_after": num(cal_main["test_ece_after"]),
        "ece_diff_ci": interval(cal_main["ece_diff_low"], cal_main["ece_diff_high"]),
        "brier_before": num(cal_main["test_brier_before"]),
        "brier_after": num(cal_main["test_brier_after"]),
        "context_only_auc": num(wc.loc["context_only", "roc_auc"]),
        "text_only_auc": num(wc.loc["text_only", "roc_auc"]),
        "within_country_auc": auc_ci("country"),
        "within_area_auc": auc_ci("area"),
        "within_context_auc": auc_ci("context"),
        "within_context_groups": str(int(mm["n_context_groups"])),
        "encoder_train_s": f"{timing.get(f'{main}_train_s', math.nan):.0f}",
        "score_texts_per_s": f"{timing.get(f'{main}_score_texts_per_s', math.nan):.0f}",
    }  # fmt: skip
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

    Returns ({encoders_sentence, evidence_sentence, score_sentence, encoder_desc, compared_desc,
    mpnet_note}, markdown table).
    """
    meta = meta if meta is not None else run.read_json("reward/metrics.json", stage=STAGE)
    comp = pd.DataFrame(meta.get("comparisons", []))
    labels = reward_labels(meta)
    encoders = meta.get("encoders", {})
    keys = ("encoders_sentence", "evidence_sentence", "score_sentence", "encoder_desc",
            "compared_desc", "mpnet_note")  # fmt: skip
    if not run.exists("tables/reward_encoders.csv") or not encoders:
        return dict.fromkeys(keys, _say("encoders_stale", {})), ""
    t = run.read_table("reward_encoders", STAGE)
    md = table("reward_encoders", t, lvl=lvl)
    compared = [k for k in encoders if k != "encoder"]
    proto = meta["reward_protocol"]

    def cost(name: str, protocol: str) -> dict[str, Any] | None:
        r = t[(t["model"] == name) & (t["protocol"] == protocol)]
        if not len(r):
            return None
        r = r.iloc[0]
        return {"epochs": r["epochs_run"], "train_s": r["train_s"],
                "texts_per_s": r["score_texts_per_s"]}  # fmt: skip

    pairs = []
    for name in compared:
        for p in t.loc[t["model"] == name, "protocol"]:
            c = comp[(comp["comparison"] == f"{name} vs encoder") & (comp["protocol"] == p)]
            if not len(c):
                continue
            bits = [{"measure": word, **_diff(c[c["measure"] == measure].iloc[0])}
                    for measure, word in (("accuracy", "accuracy"), ("roc_auc", "AUC"))
                    if (c["measure"] == measure).any()]  # fmt: skip
            pairs.append({"name": name, "protocol": p, "bits": bits, "row": cost(name, p),
                          "base": cost("encoder", p), "calls": _calls(run, p, name)})  # fmt: skip
    check = meta.get("score_check") or {}
    if check:
        requested = check.get("requested", "fp32")
        check = {**check, "requested": requested, "kept": check.get("used") == requested}

    def desc(name: str) -> dict[str, Any]:
        e = encoders[name]
        protocols = sorted(set(t.loc[t["model"] == name, "protocol"]))
        return {"desc": ENCODER_NAMES.get(e["setting"]), "label": e["label"],
                "setting": e["setting"], "protocols": protocols}  # fmt: skip

    ctx = {
        "level": lvl,
        "labels": labels,
        "protocol": proto,
        "source": meta["reward_source"],
        "pairs": pairs,
        "evidence": _encoder_evidence(comp, compared, proto),
        "check": check,
        "compared": [desc(n) for n in compared],
    }
    mpnet = any(encoders[n]["setting"] == "embedded:mpnet" for n in ["encoder", *compared])
    return {
        "encoders_sentence": _say("encoders_sentence", ctx),
        "mpnet_note": " " + _say("mpnet_note", ctx) if mpnet else "",
        "evidence_sentence": _say("evidence_sentence", ctx),
        "score_sentence": _say("score_sentence", ctx),
        "encoder_desc": sentence("reward", "encoder_desc", desc("encoder")),
        "compared_desc": _say("compared_desc", ctx),
    }, md


def _calls(run: RunDir, protocol: str, name: str) -> dict[str, Any] | None:
    """Where accuracy cannot separate two encoders because their MET/Non-MET calls at 0.5 are the
    same on every test row (from `reward/predictions_<protocol>.parquet`): code 'MET' or 'Non-MET'
    (every row called so) or 'same', and the rows `n`; None where the calls differ."""
    rel = f"reward/predictions_{protocol}.parquet"
    if not run.exists(rel):
        return None
    pred = run.read_parquet(rel)
    if f"p_{name}" not in pred or "p_encoder" not in pred or not len(pred):
        return None
    a, b = pred[f"p_{name}"] >= 0.5, pred["p_encoder"] >= 0.5
    if not (a == b).all():
        return None
    code = "MET" if a.all() else "Non-MET" if not a.any() else "same"
    return {"code": code, "n": len(pred)}


def _encoder_evidence(comp: pd.DataFrame, compared: list[str], proto: str) -> list[dict[str, str]]:
    """Which encoder the reward protocol's paired intervals favour (accuracy and AUC together),
    per compared encoder: ABOVE (it) where one measure is significantly higher and none lower,
    BELOW (the reward encoder) the reverse, UNCLEAR where neither is, 'mixed' one each."""
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
        code = ABOVE if ABOVE in v and BELOW not in v else BELOW if BELOW in v and ABOVE not in v else (
            UNCLEAR if v == {UNCLEAR} else "mixed")  # fmt: skip
        found.append({"name": name, "code": code})
    return found


def reference_check(run: RunDir, lvl: str) -> tuple[str, str]:
    """Every scorer's AUC on the reference rows (evaluation countries), which none trained on."""
    if not run.path("data/holdout.json").exists():
        return _say("reference_sentence", {"holdout": None}), ""
    holdout = run.read_json("data/holdout.json", "notebook 01_data_exploration")
    t = run.read_table("reward_reference_check", STAGE)
    md = table("reward_reference_check", t, lvl=lvl)
    c = {
        "holdout": True,
        "countries": len(holdout["eval_countries"]),
        "reference_rows": len(holdout["reference"]),
        "protocol": holdout["reward_protocol"],
        "audit_train": len(holdout["audit_train"]),
        "audit_val": len(holdout["audit_val"]),
        "rows": [{"model": r.model, "auc": r.auc, "low": r.auc_low, "high": r.auc_high,
                  "verdict": bound_verdict(r.auc_low - 0.5, r.auc_high - 0.5)}
                 for r in t.itertuples()],
    }  # fmt: skip
    return _say("reference_sentence", c), md


# -- notebook 02's narrative --------------------------------------------------------------------
def accuracy_lines(tables: dict[str, pd.DataFrame], lvl: str) -> str:
    """Test accuracy per protocol against the paper, encoder against TF-IDF, and how accuracy moves
    from the random split to the others, each verdict read from its paired interval."""
    acc, comp = tables["reward_accuracy_vs_paper"], tables["reward_comparisons"]
    c = {"level": lvl}
    lines = []
    for row in acc.to_dict("records"):
        vs = comp[
            (comp["protocol"] == row["protocol"]) & (comp["comparison"] == "encoder vs TF-IDF")
        ]
        vs = vs[vs["measure"] == "accuracy"]
        r = {**row, "vs": _diff(vs.iloc[0]) if len(vs) else None}
        lines.append(sentence("reward", "accuracy_line", c, r))
    lines += [
        sentence("reward", "protocol_line", c, {**r, "verdict": verdict_code(r["verdict"])})
        for r in tables["reward_protocol_differences"].to_dict("records")
    ]
    return _say("accuracy_heading", c) + "\n\n" + "\n".join(lines)


def calibration_lines(cal: pd.DataFrame, model: str, lvl: str) -> str:
    """Per protocol: the fitted temperature and offset and what calibration did to the test ECE."""
    return "\n".join(
        sentence("reward", "calibration_line", {"level": lvl}, r)
        for r in cal[cal["model"] == model].to_dict("records")
    )


def within_context_sentence(
    tables: dict[str, pd.DataFrame], protocol: str, model: str, lvl: str
) -> str:
    """Context fields alone against text alone, and the pair-weighted AUC within groups."""
    g = tables["reward_within_context"].set_index(["protocol", "model"])
    comp = tables["reward_comparisons"]
    tc = comp[(comp["protocol"] == protocol) & (comp["comparison"] == "text only vs context only")]

    def within(name: str) -> dict[str, float]:
        r = g.loc[(protocol, name)]
        return {k.removeprefix("auc_within_"): r[k] for k in r.index if k.startswith("auc_within_")}

    return _say("within_context_sentence", {
        "level": lvl, "protocol": protocol, "model": model, "probes": _diff(tc.iloc[0]),
        "context_only_auc": g.loc[(protocol, "context_only"), "roc_auc"],
        "text_only_auc": g.loc[(protocol, "text_only"), "roc_auc"],
        "model_within": within(model), "tfidf_within": within("tfidf"),
    })  # fmt: skip


def reward_choice_sentence(tables: dict[str, pd.DataFrame], protocol: str, source: str,
                           folder: str, lvl: str) -> str:  # fmt: skip
    """Which model notebook 03 optimises against, where it is saved and how good it is."""
    m = tables["reward_metrics"].set_index(["protocol", "model"]).loc[(protocol, source)]
    return _say("reward_choice_sentence", {"level": lvl, "protocol": protocol, "source": source,
                                           "folder": folder, "metrics": m.to_dict()})  # fmt: skip
