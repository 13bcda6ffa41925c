"""The forensic arm of notebook 02: what it takes for a MONA classifier to reach the paper's 82%.

The paper reports accuracy, precision, recall and F1 "surpassing 82% on each" on 20% unseen data
(Atashbar 2024, IMF WP/24/114, Case Study: Results, p. 17). The study's reward models, given the
paper's inputs, stay far below that (`reward_accuracy_vs_paper`). This module asks which inputs
the paper's protocol does *not* allow would close the gap: the staff `Comments` written after the
assessment (they often state the outcome), the test, approval, review and end dates, and the
arrangement identifier, each alone and all combined, under the paper's random split.

This module is the ONE place in `rlxf_utils` allowed to read `Comments` (`load_forensic_fields`);
`tests/test_forensic.py` enforces that. Its models are scored and discarded: nothing here is
saved to `reward_model/` or can feed RL. Outputs: `reward/forensic.parquet` (metrics with
bootstrap CIs), `reward/forensic.json` (what was read, the paper's claim, timing),
`tables/reward_forensic.*` and `figures/reward_forensic.png`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from rlxf_utils.artifacts import sha256_file
from rlxf_utils.data.labels import parse_date
from rlxf_utils.data.mona import normalise_rows
from rlxf_utils.data.read import read_records
from rlxf_utils.data.schema import OUTCOME_COLUMNS, DataError, detect_schema
from rlxf_utils.data.splits import load_splits
from rlxf_utils.plots import WIDTH, setup_style
from rlxf_utils.prompts import serialize_frame
from rlxf_utils.reward.calibration import classification_metrics
from rlxf_utils.reward.model import PAPER_ACCURACY
from rlxf_utils.reward.tfidf import train_tfidf
from rlxf_utils.reward.training import train_encoder
from rlxf_utils.stats import (
    bootstrap_weights,
    check_alpha,
    level,
    percentile_ci,
    weighted_auc,
    weighted_rates,
)

log = logging.getLogger(__name__)


__all__ = [
    "FORENSIC_COLUMNS",
    "PAPER_CLAIM",
    "PAPER_CLAIM_SOURCE",
    "VARIANTS",
    "ForensicStage",
    "bootstrap_metrics",
    "forensic_inputs",
    "load_forensic_fields",
    "plot_forensic",
    "run_forensic",
    "run_forensic_stage",
]


log = logging.getLogger(__name__)


#: A quoted claim from the paper, not a result of this study: accuracy, precision, recall and F1
#: "surpassing 82% on each" on 20% unseen data (the same constant as `reward.model.PAPER_ACCURACY`).
PAPER_CLAIM: float = PAPER_ACCURACY


PAPER_CLAIM_SOURCE = (
    "Atashbar (2024), IMF WP/24/114, Case Study: Results, p. 17: the BERT classifier, evaluated "
    "on 20% unseen data, attained accuracy, precision, recall and F1 score 'surpassing 82% on each'"
)


#: Normalised name -> source column per schema, for the fields the paper's protocol forbids.
#: `comments` comes from `data.schema.OUTCOME_COLUMNS`; a schema lacking a column reads as empty.
FORENSIC_COLUMNS: dict[str, dict[str, str | None]] = {
    "mona_2002_vintage": {
        "test_date": "TestDate",
        "approval_date": "ApprovalDate",
        "board_date": "BoardActDate",
        "review_type": "ReviewType",
        "review_sequence": "ReviewSequence",
        "initial_end_date": "InitialEndDate",
        "revised_end_date": "RevisedEndDate",
    },
    "imf_current_export": {
        "test_date": "Test Date",
        "approval_date": "Approval Date",
        "board_date": "Board Action Date",
        "review_type": "Review Type",
        "review_sequence": None,
        "initial_end_date": None,
        "revised_end_date": None,
    },
}


DATE_FIELDS = tuple(FORENSIC_COLUMNS["mona_2002_vintage"])


#: Input variants: what the TF-IDF / encoder model is given; `allowed` marks the paper's inputs.
VARIANTS: dict[str, dict[str, Any]] = {
    "description": {"allowed": True, "inputs": "condition text only"},
    "paper_input": {
        "allowed": True,
        "inputs": "the paper's four fields: country, arrangement type, economic descriptor, text",
    },
    "staff_comments": {"allowed": False, "inputs": "staff Comments (written after the assessment)"},
    "dates": {
        "allowed": False,
        "inputs": "test, approval, board-action and end dates; review type and sequence",
    },
    "arrangement_id": {"allowed": False, "inputs": "arrangement identifier"},
    "combined": {
        "allowed": False,
        "inputs": "the paper's four fields + Comments + dates + arrangement identifier",
    },
}


METRICS = ("accuracy", "precision", "recall", "f1", "roc_auc")


def load_forensic_fields(
    path: str | Path,
    conditions: pd.DataFrame,
    met: Sequence[str] = ("M", "PM"),
    not_assessed: Sequence[str] = ("SB", "PC", "PA", ""),
) -> pd.DataFrame:
    """`conditions` joined by row_id with the raw file's Comments, dates and arrangement id.

    The only reader of `Comments` in the package (forensic use only, never a reward input). The
    file is parsed by the same code as `data.mona.load_mona`, so `row_id` is the same record number;
    each row's country, text and status are re-derived and must equal `conditions`' or a
    `DataError` names the file, the row and both values.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: file not found; expected the MONA file notebook 01 read")
    need = {"row_id", "country", "description", "status_raw"}
    missing = sorted(need - set(conditions.columns))
    if missing:
        raise KeyError(f"conditions lack columns {missing}; expected at least {sorted(need)}")
    repairs: list[str] = []
    header, body, _, _ = read_records(path.read_bytes(), path, repairs)  # the loader's reader
    schema = detect_schema(header, path)
    src = pd.DataFrame(body, columns=header, dtype="str")
    norm = normalise_rows(src, schema, met, not_assessed)

    ids = conditions["row_id"].to_numpy(dtype=np.int64)
    outside = ids[(ids < 0) | (ids >= len(src))]
    if len(outside):
        raise DataError(
            f"{path}: the run's conditions name row_id {int(outside[0])} but the file has "
            f"{len(src)} records; expected the file notebook 01 read (data/load_report.json)"
        )
    for col in ("country", "description", "status_raw"):
        theirs = norm[col].to_numpy()[ids].astype(str)
        ours = conditions[col].astype(str).to_numpy()
        bad = np.flatnonzero(theirs != ours)
        if len(bad):
            i = bad[0]
            raise DataError(
                f"{path}: {len(bad)} row(s) do not match the run's conditions on '{col}', e.g. "
                f"row_id {int(ids[i])}: file {theirs[i]!r}, conditions {ours[i]!r}; expected "
                "the same file notebook 01 read (compare data/load_report.json's sha256)"
            )
    comment_col = next((c for c in OUTCOME_COLUMNS if c in src.columns), None)
    out = conditions.copy()
    out["comments"] = _raw(src, comment_col, ids)
    for name, col in FORENSIC_COLUMNS[schema].items():
        out[f"forensic_{name}"] = _raw(src, col, ids)
    out["forensic_arrangement_id"] = norm["arrangement_id"].to_numpy()[ids].astype(str)
    if comment_col is None:
        log.warning("%s: no Comments column (%s); the staff_comments variant sees empty text", path,
                    "/".join(OUTCOME_COLUMNS))  # fmt: skip
    return out


def _raw(src: pd.DataFrame, col: str | None, ids: np.ndarray) -> np.ndarray:
    if col is None or col not in src.columns:
        return np.full(len(ids), "", dtype=object)
    vals = src[col].fillna("").astype(str).str.split().str.join(" ").to_numpy()
    return vals[ids]


def _date_tokens(field: str, raw: str) -> str:
    """'09/21/2007' -> 'test_date_y2007 test_date_m2007_09'; non-dates ('Continuous') kept as words."""
    parsed = parse_date(raw) if raw.strip() else None
    if parsed is None:
        return f"{field}: {raw}" if raw.strip() else ""
    return f"{field}_y{parsed.year} {field}_m{parsed.year}_{parsed.month:02d}"


def forensic_inputs(frame: pd.DataFrame, variant: str) -> list[str]:
    """One input string per row for `variant` (see `VARIANTS`); `frame` is `load_forensic_fields`'."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown forensic variant {variant!r}; expected one of {list(VARIANTS)}")
    if variant == "description":
        return frame["description"].fillna("").astype(str).tolist()
    if variant == "paper_input":
        return serialize_frame(frame)
    needed = {
        "staff_comments": ["comments"],
        "dates": [f"forensic_{f}" for f in DATE_FIELDS],
        "arrangement_id": ["forensic_arrangement_id"],
    }
    cols = sorted({c for cs in needed.values() for c in cs})
    missing = [c for c in cols if c not in frame.columns]
    if missing:
        raise KeyError(f"frame lacks {missing}; build it with forensic.load_forensic_fields")
    comments = [f"Comments: {c}" for c in frame["comments"].astype(str)]
    dates = [
        " ".join(t for t in (_date_tokens(f, str(r[f"forensic_{f}"])) for f in DATE_FIELDS) if t)
        for r in frame[needed["dates"]].to_dict("records")
    ]
    arr = [f"arrangement_{a}".replace(" ", "_") for a in frame["forensic_arrangement_id"]]
    if variant == "staff_comments":
        return comments
    if variant == "dates":
        return dates
    if variant == "arrangement_id":
        return arr
    # combined: short fields first so that an encoder's max_length truncation cuts the text last
    paper = serialize_frame(frame)
    return [f"{a} {d} {c} {p}" for a, d, c, p in zip(arr, dates, comments, paper, strict=True)]


def bootstrap_metrics(
    y: Sequence[int],
    p: Sequence[float],
    n_boot: int,
    alpha: float,
    seed: int,
    threshold: float = 0.5,
    clusters: Sequence[Any] | None = None,
) -> dict[str, float]:
    """Point values (`reward.calibration.classification_metrics`) and percentile-bootstrap CIs over test rows.

    `clusters` (one label per row, e.g. the arrangement): resample whole clusters, as the reward
    section's intervals do, since conditions of one arrangement share reviews and staff. Returns
    `<metric>`, `<metric>_low`, `<metric>_high` for accuracy, precision, recall, F1 and ROC-AUC at
    level 1 - alpha, plus `n` and `n_clusters`. Depends only on its arguments.
    """
    check_alpha(alpha)
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1; got {n_boot}")
    y = np.asarray(y, dtype=int)
    p = np.asarray(p, dtype=float)
    if len(y) != len(p) or len(y) == 0:
        raise ValueError(f"need equal, non-empty y and p; got {len(y)} and {len(p)}")
    point = classification_metrics(y, p, threshold=threshold)
    w = bootstrap_weights(len(y), n_boot, seed, clusters)
    draws = {**weighted_rates(w, y, p, threshold), "roc_auc": weighted_auc(w, y, p)}
    n_clusters = len(y) if clusters is None else len(set(map(str, clusters)))
    out: dict[str, float] = {"n": point["n"], "n_clusters": n_clusters}
    for m in METRICS:
        low, high = percentile_ci(draws[m], alpha)
        out.update({m: point[m], f"{m}_low": low, f"{m}_high": high})
    return out


def run_forensic(
    frame: pd.DataFrame,
    split: Mapping[str, Sequence[int]],
    cfg: Any,
    seed: int,
    variants: Sequence[str],
    encoder_variants: Sequence[str] = (),
    n_boot: int = 2000,
    alpha: float = 0.05,
    model_factory: Callable[[], tuple[Any, Any]] | None = None,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Train TF-IDF + LR (and the encoder for `encoder_variants`) per variant; score the test split.

    `frame` is `load_forensic_fields`' output; `split` holds `train`, `val` (temperature) and
    `test` row_id lists; `cfg` is a `RewardConfig`. Returns (metrics with CIs, one row per model
    and variant plus the majority class; test predictions). Models are discarded, never saved.
    """
    for part in ("train", "val", "test"):
        if part not in split:
            raise KeyError(f"split lacks {part!r}; expected train, val and test row_id lists")
    unknown = [v for v in [*variants, *encoder_variants] if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown forensic variant(s) {unknown}; expected {list(VARIANTS)}")
    by_id = frame.set_index("row_id", drop=False)
    parts = {}
    for part in ("train", "val", "test"):
        ids = pd.Index(split[part])
        absent = ids.difference(by_id.index)
        if len(absent):
            raise KeyError(f"split.{part}: {len(absent)} row_ids not in the frame, e.g. {list(absent[:3])}")  # fmt: skip
        parts[part] = by_id.loc[ids].reset_index(drop=True)
    ys = {k: v["y"].astype(int).to_numpy() for k, v in parts.items()}
    yte = ys["test"]
    # the reward section's unit of resampling: conditions of one arrangement share reviews and staff
    arrangement = "arrangement_id" if "arrangement_id" in frame else "forensic_arrangement_id"
    clusters = parts["test"][arrangement].astype(str).tolist()
    pred = pd.DataFrame({"row_id": parts["test"]["row_id"].to_numpy(), "y": yte})
    rows: list[dict[str, Any]] = []

    def score(model: str, variant: str, p: np.ndarray, seconds: float) -> None:
        pred[f"p_{model}_{variant}"] = p
        info = VARIANTS.get(variant, {"allowed": True, "inputs": "none (constant training MET share)"})  # fmt: skip
        m = bootstrap_metrics(yte, p, n_boot, alpha, seed, clusters=clusters)
        rows.append({"variant": variant, "model": model, "allowed_by_protocol": info["allowed"],
                     "inputs": info["inputs"], "train_s": seconds, **m})  # fmt: skip

    score("majority", "none", np.full(len(yte), ys["train"].mean()), 0.0)
    for variant in variants:
        x = {k: forensic_inputs(v, variant) for k, v in parts.items()}
        t0 = time.perf_counter()
        model = train_tfidf(x["train"], ys["train"], x["val"], ys["val"], cfg, seed)
        score("tfidf", variant, model.score_texts(x["test"]), time.perf_counter() - t0)
        log.info("forensic %s (tfidf): accuracy %.3f", variant, rows[-1]["accuracy"])
    for variant in encoder_variants:
        x = {k: forensic_inputs(v, variant) for k, v in parts.items()}
        t0 = time.perf_counter()
        enc, _ = train_encoder(
            x["train"], ys["train"], x["val"], ys["val"], cfg, seed, model_factory=model_factory
        )
        p = enc.score_texts(x["test"], cfg.score_batch_size)
        score("encoder", variant, p, time.perf_counter() - t0)
        log.info("forensic %s (encoder): accuracy %.3f", variant, rows[-1]["accuracy"])
        del enc
    return pd.DataFrame(rows), pred


def plot_forensic(table: pd.DataFrame, claim: float = PAPER_CLAIM, alpha: float = 0.05) -> Any:
    """Accuracy and F1 per variant and model with bootstrap CIs; a line at the paper's claim."""
    import matplotlib.pyplot as plt

    setup_style()
    t = table.iloc[::-1].reset_index(drop=True)
    labels = [f"{r.variant} ({r.model})" for r in t.itertuples()]
    palette = {"allowed": "#1b6ca8", "forbidden": "#d1495b", "baseline": "#9e9e9e"}
    kinds = ["baseline" if m == "majority" else "allowed" if a else "forbidden"
             for m, a in zip(t["model"], t["allowed_by_protocol"], strict=True)]  # fmt: skip
    colors = [palette[k] for k in kinds]
    fig, axes = plt.subplots(1, 2, figsize=(WIDTH, 0.32 * len(t) + 1.3), sharey=True)
    for ax, m, title in zip(axes, ("accuracy", "f1"), ("accuracy", "F1 (MET)"), strict=True):
        err = np.vstack([t[m] - t[f"{m}_low"], t[f"{m}_high"] - t[m]]).clip(min=0)
        ax.barh(np.arange(len(t)), t[m], xerr=err, color=colors, alpha=0.85, error_kw={"lw": 0.8})
        ax.axvline(claim, color="black", ls="--", lw=0.9, label=f"paper's claim {claim:.0%}")
        ax.set_xlim(0, 1)
        ax.set_xlabel(f"{title} ({level(alpha)} CI, arrangements resampled)")
        ax.grid(axis="y", visible=False)
    axes[0].set_yticks(np.arange(len(t)), labels, fontsize=7.5)
    handles = [plt.Rectangle((0, 0), 1, 1, color=palette[k]) for k in palette]
    handles.append(axes[0].get_lines()[0])
    names = ["inputs the paper allows", "inputs the protocol forbids", "majority class",
             f"paper's claim ({claim:.0%}, quoted)"]  # fmt: skip
    fig.legend(handles, names, loc="lower center", ncol=4, fontsize=7.5,
               bbox_to_anchor=(0.5, -0.02 - 0.6 / (len(t) + 4)))  # fmt: skip
    fig.suptitle("Forensic arm: test metrics under the random protocol", fontsize=10)
    return fig


@dataclass
class ForensicStage:
    """What `run_forensic_stage` computed and wrote."""

    table: pd.DataFrame
    predictions: pd.DataFrame
    meta: dict[str, Any]
    figure: Path


def run_forensic_stage(
    cfg: Any, run: Any, model_factory: Callable[[], tuple[Any, Any]] | None = None
) -> ForensicStage:
    """Load the forbidden fields, score every variant on `cfg.forensic.protocol`, write outputs.

    `cfg` is a `StudyConfig`, `run` a `RunDir` holding notebook 01's `data/`. Writes only
    `reward/forensic.parquet`, `reward/forensic.json`, `tables/reward_forensic.*` and
    `figures/reward_forensic.png`; never `reward_model/`.
    """
    import matplotlib.pyplot as plt

    fc = cfg.forensic
    if not fc.enabled:
        raise ValueError("forensic.enabled is false in the parameters; the forensic arm is off")
    t0 = time.perf_counter()
    labelled, splits = load_splits(run)
    if fc.protocol not in splits:
        raise KeyError(f"data/splits.json has no protocol {fc.protocol!r}; found {sorted(splits)}")
    report = run.read_json("data/load_report.json", stage="notebook 01_data_exploration")
    digest = sha256_file(cfg.data.path)
    if report.get("sha256") and report["sha256"] != digest:
        raise DataError(
            f"{cfg.data.path}: sha256 {digest} differs from the file notebook 01 read "
            f"({report['sha256']}, data/load_report.json); rerun notebook 01 or restore the file"
        )
    lab = cfg.data.labels
    frame = load_forensic_fields(cfg.data.path, labelled, lab.met, lab.not_assessed)
    table, pred = run_forensic(
        frame, splits[fc.protocol], cfg.reward, cfg.run.seed, fc.variants, fc.encoder_variants,
        cfg.evaluation.n_boot, cfg.evaluation.alpha, model_factory,
    )  # fmt: skip
    table.insert(0, "protocol", fc.protocol)
    table["paper_claim"] = PAPER_CLAIM
    elapsed = time.perf_counter() - t0
    meta = {
        "protocol": fc.protocol,
        "paper_claim": PAPER_CLAIM,
        "paper_claim_is": "a quoted claim from the paper, not a result of this study",
        "paper_claim_source": PAPER_CLAIM_SOURCE,
        "alpha": cfg.evaluation.alpha,
        "n_boot": cfg.evaluation.n_boot,
        "variants": list(fc.variants),
        "encoder_variants": list(fc.encoder_variants),
        "fields_read": {"staff_comments": list(OUTCOME_COLUMNS), **FORENSIC_COLUMNS},
        "n_train": len(splits[fc.protocol]["train"]),
        "n_val": len(splits[fc.protocol]["val"]),
        "n_test": len(splits[fc.protocol]["test"]),
        "comments_nonempty_share": float((frame["comments"] != "").mean()),
        "stage_seconds": elapsed,
        "feeds_rl": False,
    }
    run.write_parquet("reward/forensic.parquet", table)
    run.write_json("reward/forensic.json", meta)
    shown = ["variant", "model", "allowed_by_protocol", "accuracy", "accuracy_low",
             "accuracy_high", "precision", "recall", "f1", "f1_low", "f1_high", "roc_auc"]  # fmt: skip
    run.write_table("reward_forensic", table[shown])
    fig = plot_forensic(table, PAPER_CLAIM, cfg.evaluation.alpha)
    path = run.write_figure("reward_forensic", fig)
    plt.close(fig)
    log.info("forensic arm: %d models in %.1f s", len(table), elapsed)
    return ForensicStage(table, pred, meta, path)
