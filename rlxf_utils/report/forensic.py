"""The forensic arm's section: where each variant stands against the paper's 82% claim. Python
reads the intervals into verdict codes and picks the variants; the words are the author's, in
`reports/templates/forensic.jinja`."""

from __future__ import annotations

from typing import Any

import pandas as pd

from rlxf_utils.artifacts import RunDir
from rlxf_utils.markdown import markdown_table
from rlxf_utils.report.wording import ABOVE, BELOW, UNCLEAR, listing, num, pct, sentence, table
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


def claim_groups(table: pd.DataFrame, claim: float) -> tuple[list[dict[str, Any]], str, list[str]]:
    """The verdict's parts: the allowed and the forbidden variants (but the majority class) by
    their `claim_position` (`up`, `short`, `mid`; `best`: the most accurate of `short`), how the
    arm concludes ('allowed', 'only forbidden', 'forbidden' or 'none', see `forensic.jinja`) and
    the forbidden variants that reach the claim."""
    t = table[table["model"] != "majority"].copy()
    t["position"] = [claim_position(r, claim) for _, r in t.iterrows()]
    t["label"] = [MODEL_NAMES.get(m, m) for m in t["model"]]
    allowed, forbidden = t[t["allowed_by_protocol"]], t[~t["allowed_by_protocol"]]
    groups = []
    for is_allowed, g in ((True, allowed), (False, forbidden)):
        if g.empty:
            continue
        short = g[g["position"] == BELOW]
        groups.append({
            "allowed": is_allowed, "short": short.to_dict("records"),
            **{k: g[g["position"] == c].to_dict("records") for k, c in (("up", ABOVE), ("mid", UNCLEAR))},
            "best": short.loc[short["accuracy"].idxmax()].to_dict() if len(short) else None,
        })  # fmt: skip
    reaching = sorted(set(forbidden.loc[forbidden["position"] == ABOVE, "variant"]))
    if allowed["position"].eq(ABOVE).any():
        conclusion = "allowed"
    elif reaching and not allowed.empty and allowed["position"].eq(BELOW).all():
        conclusion = "only forbidden"
    else:
        conclusion = "forbidden" if reaching else "none"
    return groups, conclusion, reaching


def forensic_verdict(table: pd.DataFrame, claim: float, alpha: float) -> str:
    """What the forensic arm says about how a figure above the paper's claim could arise.

    A variant *reaches* the claim when the {1-alpha} CI of each of accuracy, precision, recall and
    F1 lies above it (the paper claims all four), *falls short* when any CI lies below it.
    """
    return sentence("forensic", "verdict", claim, alpha, *claim_groups(table, claim))


def forensic_section(run: RunDir, params: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The forensic arm's table and verdict, or a note that the arm was off in this run."""
    fc = params.get("forensic", {})
    if not fc.get("enabled", False):
        empty = markdown_table(pd.DataFrame([{"variant": "not run", "model": "", "accuracy": ""}]))
        return {"verdict": sentence("forensic", "not_run"), "protocol": "n/a", "claim": "n/a",
                "seconds": "n/a", "fields": "n/a", "encoder_note": "", "models": "n/a"}, {
                "reward_forensic.md": empty}  # fmt: skip
    stage = "notebook 02_reward_model (forensic arm)"
    results = run.read_parquet("reward/forensic.parquet", stage)
    meta = run.read_json("reward/forensic.json", stage)
    claim, alpha = float(meta["paper_claim"]), float(meta["alpha"])
    lvl = level(alpha)
    fields = meta["fields_read"]
    vintage = fields.get("mona_2002_vintage", {})
    read = [*fields.get("staff_comments", [])[:1], *[c for c in vintage.values() if c]]
    families = sorted(set(results["model"]) - {"majority"}, key=list(MODEL_NAMES).index)
    variables = {
        "models": listing([MODEL_NAMES[m] for m in families]),
        "verdict": forensic_verdict(results, claim, alpha),
        "protocol": meta["protocol"],
        "claim": pct(claim, 0),
        "claim_source": meta["paper_claim_source"],
        "seconds": num(meta["stage_seconds"], 0),
        "fields": ", ".join(f"`{c}`" for c in read),
        "n_test": str(meta["n_test"]),
        "encoder_note": sentence(
            "forensic", "encoder_note", list(meta.get("encoder_variants", []))
        ),
    }
    md = table(
        "reward_forensic",
        results,
        lvl=lvl,
        claim=claim,
        models=MODEL_NAMES,
        position=claim_position,
    )
    return variables, {"reward_forensic.md": md}
