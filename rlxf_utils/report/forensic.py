"""The forensic arm's section: where each variant stands against the paper's 82% claim."""

from __future__ import annotations

from typing import Any

import pandas as pd

from rlxf_utils.artifacts import RunDir
from rlxf_utils.report.wording import (
    ABOVE,
    BELOW,
    UNCLEAR,
    ci,
    listing,
    markdown_table,
    pct,
    phrase,
)
from rlxf_utils.stats import bound_verdict, level

FORENSIC_MEASURES = (("accuracy", "accuracy"), ("precision", "precision"), ("recall", "recall"), ("f1", "F1"))  # fmt: skip


MODEL_NAMES = {
    "tfidf": "TF-IDF + LR",
    "encoder": "fine-tuned encoder",
    "majority": "majority class",
}


def claim_position(row: pd.Series, claim: float) -> str:
    """'above' if every measure's CI lies above the claim, 'below' if any lies below it, else
    'not distinguishable' (verdict codes of `stats.bound_verdict`): read from the intervals, never
    from the point estimates."""
    codes = [bound_verdict(row[f"{m}_low"] - claim, row[f"{m}_high"] - claim)
             for m, _ in FORENSIC_MEASURES]  # fmt: skip
    if BELOW in codes:
        return BELOW
    return ABOVE if all(c == ABOVE for c in codes) else UNCLEAR


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
        up = g[g["position"] == ABOVE]
        short = g[g["position"] == BELOW]
        mid = g[g["position"] == UNCLEAR]
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
            bits.append(f"{listing([name(r) for _, r in mid.iterrows()])} {phrase('beat', UNCLEAR)} it "
                        f"on at least one measure and {'lies' if len(mid) == 1 else 'lie'} below it on none")  # fmt: skip
        parts.append(f"with {label}, {'; '.join(bits)}")
    up_allowed = allowed["position"].eq(ABOVE).any()
    up_forbidden = forbidden[forbidden["position"] == ABOVE]
    if up_allowed:
        concl = (f"a figure above {claim:.0%} is reachable here with the paper's own inputs, so this "
                 "arm does not show that it needs forbidden ones")  # fmt: skip
    elif len(up_forbidden) and not allowed.empty and allowed["position"].eq(BELOW).all():
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
        row[f"vs {claim:.0%}"] = (
            "·" if r["model"] == "majority" else phrase("claim", claim_position(r, claim))
        )
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
