"""One split protocol end to end: the encoder, TF-IDF and baselines trained and scored on its test
rows, calibrated, and saved so that a rerun reuses it."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from rlxf_utils.artifacts import to_jsonable, write_json
from rlxf_utils.config import CompareEncoder, RewardConfig
from rlxf_utils.data.splits import grouped_take, stratified_take
from rlxf_utils.prompts import (
    CONTEXT_FIELDS,
    check_no_forbidden,
    serialize_condition,
    serialize_frame,
)
from rlxf_utils.reward.calibration import (
    CAL_KEYS,
    CALIBRATION_SHARE,
    calibration_report,
    classification_metrics,
    sigmoid,
)
from rlxf_utils.reward.model import FORMAT_VERSION, RewardModel, RewardModelError
from rlxf_utils.reward.statistics import protocol_statistics
from rlxf_utils.reward.tfidf import TfidfAuditModel, train_tfidf
from rlxf_utils.reward.training import train_encoder

log = logging.getLogger(__name__)


@dataclass
class ProtocolResult:
    """Everything one split protocol produced: test predictions, metrics, calibration, models."""

    protocol: str
    # one row per test condition: ids, context, y, p_<model>, p_<model>_raw
    predictions: pd.DataFrame
    # one row per model: point metrics, `<metric>_low/_high` and within-group AUCs with CIs
    metrics: pd.DataFrame
    # per calibrated model: Platt T and offset, ECE/Brier/NLL before/after on the calibration
    # half and on test, test ECE intervals and the paired test of after - before
    calibration: pd.DataFrame
    train_log: pd.DataFrame
    timing: dict[str, float]
    encoder: RewardModel | None = None
    audit: TfidfAuditModel | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # paired bootstrap comparisons on this protocol's test rows (reward_stats.COMPARISONS)
    comparisons: pd.DataFrame = field(default_factory=pd.DataFrame)
    # reward.compare_encoders trained on this protocol, by name
    compared: dict[str, RewardModel] = field(default_factory=dict)

    def scorer(self, source: str) -> RewardModel | TfidfAuditModel:
        """The model a `reward_source` names: 'encoder', 'tfidf' or a compared encoder's name."""
        model = {"encoder": self.encoder, "tfidf": self.audit, **self.compared}.get(source)
        if model is None:
            trained = ["tfidf", *(["encoder"] if self.encoder is not None else []), *self.compared]
            raise ValueError(
                f"reward_source {source!r}: protocol {self.protocol!r} trained no such model; "
                f"it has {trained}"
            )
        return model


def take_rows(conditions: pd.DataFrame, ids: Sequence[int], where: str) -> pd.DataFrame:
    frame = conditions.set_index("row_id", drop=False)
    missing = pd.Index(ids).difference(frame.index)
    if len(missing):
        raise KeyError(
            f"splits.json {where}: {len(missing)} row_ids not in conditions.parquet (e.g. {list(missing[:3])})"
        )
    out = frame.loc[list(ids)].reset_index(drop=True)
    if out["y"].isna().any():
        raise ValueError(
            f"splits.json {where}: contains excluded (unlabelled) rows; splits must hold labelled rows only"
        )
    return out


def split_validation(
    val: pd.DataFrame, protocol: str, seed: int, share: float = CALIBRATION_SHARE
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Split a validation slice into (selection, calibration) halves, the protocol's way.

    The grouped protocol keeps whole arrangements on one side (`data.splits.grouped_take`); the others
    stratify by label (`data.splits.stratified_take`). The selection half picks the checkpoint, the
    calibration half, which took no part in that choice, fits Platt scaling.
    """

    if not 0 < share < 1:
        raise ValueError(f"calibration share must lie in (0, 1); got {share}")
    ids = val["row_id"].to_numpy()
    rng = np.random.default_rng(seed + 11)
    if protocol == "grouped":
        rest, taken = grouped_take(ids, val["arrangement_id"].astype(str).to_numpy(), share, rng)
    else:
        rest, taken = stratified_take(ids, val["y"].astype(int).to_numpy(), share, rng)
    if not rest or not taken:
        raise ValueError(
            f"splits.json {protocol}.val: {len(val)} rows cannot be split into a selection and a "
            f"calibration half ({len(rest)} / {len(taken)}); raise data.splits.validation_fraction"
        )
    by_id = val.set_index("row_id", drop=False)
    return (
        by_id.loc[rest].reset_index(drop=True),
        by_id.loc[taken].reset_index(drop=True),
    )


@dataclass
class ProtocolRows:
    """One protocol's rows: training, the validation slice's selection and calibration halves,
    and test; their serialised texts (`x_*`) and labels (`y_*`)."""

    train: pd.DataFrame
    selection: pd.DataFrame
    calibration: pd.DataFrame
    test: pd.DataFrame
    text_column: str

    def __post_init__(self) -> None:
        parts = (self.train, self.selection, self.calibration, self.test)
        self.y_train, self.y_sel, self.y_cal, self.y_test = (d["y"].astype(int).to_numpy() for d in parts)  # fmt: skip
        self.x_train, self.x_sel, self.x_cal, self.x_test = (serialize_frame(d, self.text_column) for d in parts)  # fmt: skip


#: the test rows' columns kept beside the predictions
PREDICTION_KEYS = ["row_id", *CONTEXT_FIELDS, "arrangement_id", "econ_code", "condition_type",
                   "test_year", "description"]  # fmt: skip


def protocol_rows(
    conditions: pd.DataFrame,
    splits: Mapping[str, Mapping[str, Sequence[int]]],
    protocol: str,
    seed: int,
    text_column: str,
) -> ProtocolRows:
    """The rows `splits.json` gives `protocol`, checked (a missing protocol or part, unknown or
    unlabelled rows are errors naming them), the validation slice split in two."""
    if protocol not in splits:
        raise KeyError(f"splits.json has no protocol {protocol!r}; found {sorted(splits)}")
    sp = splits[protocol]
    for part in ("train", "val", "test"):
        if part not in sp:
            raise KeyError(f"splits.json[{protocol!r}] lacks {part!r}; expected train, val, test")
    tr = take_rows(conditions, sp["train"], f"{protocol}.train")
    va = take_rows(conditions, sp["val"], f"{protocol}.val")
    te = take_rows(conditions, sp["test"], f"{protocol}.test")
    sel, cal = split_validation(va, protocol, seed)
    log.info("protocol %s: train %d, val %d (selection %d, calibration %d), test %d",
             protocol, len(tr), len(va), len(sel), len(cal), len(te))  # fmt: skip
    return ProtocolRows(tr, sel, cal, te, text_column)


@dataclass
class _Scored:
    """What the models of one protocol write as they are fitted: the test predictions
    (`p_<model>`, `p_<model>_raw`), timings and calibration rows."""

    pred: pd.DataFrame
    timing: dict[str, float] = field(default_factory=dict)
    cal_rows: list[dict[str, Any]] = field(default_factory=list)


def fit_tfidf_models(
    rows: ProtocolRows, cfg: RewardConfig, seed: int, out: _Scored
) -> TfidfAuditModel:
    """The majority class (the training MET share as a constant P(MET)), the calibrated TF-IDF
    audit, and the two uncalibrated probes (context fields alone, text alone: what carries
    signal); returns the audit."""
    pred, col = out.pred, rows.text_column
    pred["p_majority"] = float(rows.y_train.mean())
    t0 = time.perf_counter()
    audit = train_tfidf(rows.x_train, rows.y_train, rows.x_cal, rows.y_cal, cfg, seed)
    out.timing["tfidf_train_s"] = time.perf_counter() - t0
    pred["p_tfidf_raw"] = audit.score_texts(rows.x_test, calibrated=False)
    pred["p_tfidf"] = audit.score_texts(rows.x_test)
    out.cal_rows.append(_cal_row("tfidf", audit, audit.margins_texts(rows.x_test), rows.y_test, cfg.ece_bins))  # fmt: skip
    context = lambda d: [serialize_condition(r, "") for r in d.to_dict("records")]  # noqa: E731
    ctx_only = train_tfidf(context(rows.train), rows.y_train, None, None, cfg, seed, calibrate=False)  # fmt: skip
    pred["p_context_only"] = ctx_only.score_texts(context(rows.test))
    txt_only = train_tfidf(rows.train[col].fillna("").tolist(), rows.y_train, None, None, cfg,
                           seed, calibrate=False)  # fmt: skip
    pred["p_text_only"] = txt_only.score_texts(rows.test[col].fillna("").tolist())
    return audit


def fit_encoder(
    name: str,
    ecfg: RewardConfig,
    rows: ProtocolRows,
    seed: int,
    model_factory: Callable[[], tuple[Any, Any]] | None,
    out: _Scored,
) -> tuple[RewardModel, pd.DataFrame]:
    """One encoder on the training rows (early-stopped on the selection half, Platt-scaled on the
    calibration half), scored on test as `p_<name>` and `p_<name>_raw`; with its training log."""
    t0 = time.perf_counter()
    enc, tlog = train_encoder(rows.x_train, rows.y_train, rows.x_sel, rows.y_sel, ecfg, seed,
                              model_factory=model_factory, cal_texts=rows.x_cal, cal_y=rows.y_cal)  # fmt: skip
    out.timing[f"{name}_train_s"] = time.perf_counter() - t0
    out.timing[f"{name}_epochs_run"] = float(tlog["epoch"].max()) if len(tlog) else 0.0
    t0 = time.perf_counter()
    margin = enc.margins_texts(rows.x_test, ecfg.score_batch_size)
    out.timing[f"{name}_score_texts_per_s"] = len(rows.x_test) / max(time.perf_counter() - t0, 1e-9)
    out.pred[f"p_{name}_raw"] = sigmoid(margin)
    out.pred[f"p_{name}"] = sigmoid(margin / enc.temperature + enc.offset)
    out.cal_rows.append(_cal_row(name, enc, margin, rows.y_test, ecfg.ece_bins))
    enc.meta["name"] = name
    return enc, tlog.assign(model=name, encoder=ecfg.encoder)


def run_protocol(
    conditions: pd.DataFrame,
    splits: Mapping[str, Mapping[str, Sequence[int]]],
    protocol: str,
    cfg: RewardConfig,
    seed: int,
    train_encoder_model: bool = True,
    model_factory: Callable[[], tuple[Any, Any]] | None = None,
    alpha: float = 0.05,
    n_boot: int = 2000,
    text_column: str = "description",
    boot_seed: int | None = None,
    compare: Sequence[CompareEncoder] = (),
) -> ProtocolResult:
    """Train encoder + TF-IDF audit + context-only/text-only probes on one protocol; score its test set.

    `compare` (from `reward.compare_encoders`) are more encoders trained on the same rows with
    the same selection/calibration halves; their predictions are `p_<name>` beside `p_encoder`.

    The validation slice is split (`split_validation`): its selection half early-stops the
    encoder, its calibration half fits both models' Platt scaling. Test metrics carry bootstrap
    intervals at level 1 - `alpha` (`reward.statistics.protocol_statistics`, seeded by `boot_seed`,
    default `seed`). `text_column` is the
    condition text the models read; an outcome column there is refused (`check_no_forbidden`).
    """
    check_no_forbidden([*CONTEXT_FIELDS, text_column])
    rows = protocol_rows(conditions, splits, protocol, seed, text_column)
    te = rows.test
    out = _Scored(te[[c for c in PREDICTION_KEYS if c in te.columns]].copy().assign(y=rows.y_test))
    audit = fit_tfidf_models(rows, cfg, seed, out)
    encoder, logs = None, []
    if train_encoder_model:
        encoder, tlog = fit_encoder("encoder", cfg, rows, seed, model_factory, out)
        logs.append(tlog)
    compared: dict[str, RewardModel] = {}
    for spec in compare:
        log.info("protocol %s: training compared encoder %s (%s)", protocol, spec.name, spec.encoder)  # fmt: skip
        compared[spec.name], tlog = fit_encoder(spec.name, cfg.for_encoder(spec), rows, seed,
                                                model_factory, out)  # fmt: skip
        logs.append(tlog)
    metrics, calibration, comparisons, acc_reps = _protocol_metrics(
        out, protocol, cfg, encoder is not None, list(compared), alpha, n_boot,
        seed if boot_seed is None else boot_seed,
    )  # fmt: skip
    by_model = metrics.set_index("model")
    for name, enc in (("encoder", encoder), *compared.items()):
        if enc is not None:
            enc.meta.update({"protocol": protocol, "test_metrics": by_model.loc[name].to_dict()})
    audit.meta.update({"protocol": protocol, "test_metrics": by_model.loc["tfidf"].to_dict()})
    return ProtocolResult(
        protocol, out.pred, metrics, calibration,
        pd.concat(logs, ignore_index=True) if logs else pd.DataFrame(), out.timing, encoder, audit,
        extra={"accuracy_replicates": acc_reps, "n_selection": len(rows.selection),
               "n_calibration": len(rows.calibration), "row_ids": learned_rows(rows)},
        comparisons=comparisons.assign(protocol=protocol)[["protocol", *comparisons.columns]]
        if len(comparisons) else comparisons,
        compared=compared,
    )  # fmt: skip


def learned_rows(rows: ProtocolRows) -> dict[str, list[int]]:
    """The row ids this protocol's models learn from: `train` (fitted on), `selection` (picks
    the checkpoint) and `calibration` (fits Platt scaling); the reward bundle records them."""
    return {part: sorted(int(i) for i in getattr(rows, part)["row_id"])
            for part in ("train", "selection", "calibration")}  # fmt: skip


def _protocol_metrics(
    out: _Scored, protocol: str, cfg: RewardConfig, has_encoder: bool, compared: list[str],
    alpha: float, n_boot: int, boot_seed: int,
) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, Any]:  # fmt: skip
    """Every model's test metrics with bootstrap intervals, the calibration table with its ECE
    test, the paired comparisons and the accuracy replicates."""
    pred = out.pred
    encoders = (["encoder"] if has_encoder else []) + compared
    models = ["majority", "tfidf", "context_only", "text_only", *encoders]
    calibrated = [m for m in ("tfidf", *encoders) if f"p_{m}_raw" in pred]
    stats_table, comparisons, acc_reps = protocol_statistics(
        pred, models + [f"{m}_raw" for m in calibrated], n_boot=n_boot, alpha=alpha,
        seed=boot_seed, n_bins=cfg.ece_bins,
        extra_comparisons=encoder_comparisons(compared, has_encoder),
    )  # fmt: skip
    by_model = stats_table.set_index("model")
    y = pred["y"].to_numpy()
    metrics = pd.DataFrame([
        {"protocol": protocol, "model": name,
         **classification_metrics(y, pred[f"p_{name}"].to_numpy(), n_bins=cfg.ece_bins),
         **by_model.loc[name].to_dict()}
        for name in models
    ])  # fmt: skip
    calibration = pd.DataFrame(out.cal_rows)
    if len(calibration):
        calibration = _with_ece_test(calibration, by_model, comparisons)
    return metrics, calibration, comparisons, acc_reps


def encoder_comparisons(names: Sequence[str], has_main: bool) -> list[tuple[str, str, str, str]]:
    """Paired comparisons of each compared encoder: against the main encoder, against TF-IDF,
    and its calibration (in `reward.statistics.COMPARISONS`' form)."""
    out = []
    for name in names:
        if has_main:
            out += [(f"{name} vs encoder", name, "encoder", m) for m in ("accuracy", "roc_auc")]
        out += [(f"{name} vs TF-IDF", name, "tfidf", m) for m in ("accuracy", "roc_auc")]
        out.append((f"{name} calibrated vs raw", name, f"{name}_raw", "ece"))
    return out


def _cal_row(
    model: str,
    scorer: RewardModel | TfidfAuditModel,
    test_margin: np.ndarray,
    yte: np.ndarray,
    n_bins: int,
) -> dict[str, Any]:
    """One calibration-table row: Platt parameters, measures on the calibration half and on test."""
    fit = scorer.meta.get("calibration", {})
    test_cal = calibration_report(test_margin, yte, scorer.temperature, scorer.offset, n_bins)
    return {
        "model": model,
        "method": fit.get("method", "none"),
        "temperature": scorer.temperature,
        "offset": scorer.offset,
        "n_calibration": fit.get("n", 0),
        **{f"cal_{k}": fit.get(k, float("nan")) for k in CAL_KEYS},
        **{f"test_{k}": test_cal[k] for k in CAL_KEYS},
    }


def _with_ece_test(
    calibration: pd.DataFrame, stats: pd.DataFrame, comparisons: pd.DataFrame
) -> pd.DataFrame:
    """Add test-ECE intervals before/after and the paired interval of (after - before)."""
    out = calibration.copy()
    for col in ("test_ece_before_low", "test_ece_before_high", "test_ece_after_low",
                "test_ece_after_high", "ece_diff_low", "ece_diff_high"):  # fmt: skip
        out[col] = float("nan")
    out["ece_verdict"] = "not tested"
    for i, r in out.iterrows():
        m = r["model"]
        if m in stats.index and f"{m}_raw" in stats.index:
            out.loc[i, "test_ece_after_low"] = stats.loc[m, "ece_low"]
            out.loc[i, "test_ece_after_high"] = stats.loc[m, "ece_high"]
            out.loc[i, "test_ece_before_low"] = stats.loc[f"{m}_raw", "ece_low"]
            out.loc[i, "test_ece_before_high"] = stats.loc[f"{m}_raw", "ece_high"]
        c = (
            comparisons[(comparisons["a"] == m) & (comparisons["measure"] == "ece")]
            if len(comparisons)
            else []
        )
        if len(c):
            out.loc[i, "ece_diff_low"] = c["diff_low"].iloc[0]
            out.loc[i, "ece_diff_high"] = c["diff_high"].iloc[0]
            out.loc[i, "ece_verdict"] = c["verdict"].iloc[0]
    return out


#: Reward settings that do not change one protocol's models or test metrics.
_NOT_PROTOCOL_KEYS = {"num_threads", "progress", "protocols", "reward_protocol", "reward_source",
                      "compare_encoders", "score_precision", "score_tolerance"}  # fmt: skip


def protocol_key(
    rc: RewardConfig, protocol: str, compare: Sequence[CompareEncoder], seed: int, alpha: float,
    n_boot: int, boot_seed: int, data_hash: str | None,
) -> dict[str, Any]:  # fmt: skip
    """What one protocol's result depends on: its settings, seeds, intervals and the data."""
    return {
        "protocol": protocol,
        "reward": rc.model_dump(mode="json", exclude=_NOT_PROTOCOL_KEYS),
        "compare": [c.model_dump(mode="json") for c in compare],
        "seed": seed, "alpha": alpha, "n_boot": n_boot, "boot_seed": boot_seed,
        "data": data_hash,
        "format_version": FORMAT_VERSION,
    }  # fmt: skip


def save_protocol_result(path: str | Path, result: ProtocolResult, key: Mapping[str, Any]) -> Path:
    """Write one protocol's result (tables, replicates, every model) so a rerun need not retrain.

    Written to a temporary folder renamed into place; `result.json`, holding `key`, comes last.
    """
    import shutil
    import tempfile

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        result.predictions.to_parquet(tmp / "predictions.parquet", index=False)
        reps = result.extra.get("accuracy_replicates", {})
        np.savez(tmp / "accuracy_replicates.npz", **{k: np.asarray(v) for k, v in reps.items()})
        if result.encoder is not None:
            result.encoder.save(tmp / "encoder")
        if result.audit is not None:
            result.audit.save(tmp / "audit")
        for name, enc in result.compared.items():
            enc.save(tmp / "compared" / name)
        tables = {k: getattr(result, k).to_dict("records")
                  for k in ("metrics", "calibration", "train_log", "comparisons")}  # fmt: skip
        write_json(tmp / "result.json", {
            "kind": "rlxf-reward-protocol", "key": dict(key), "protocol": result.protocol,
            "timing": result.timing, "compared": list(result.compared), "tables": tables,
            "extra": {k: v for k, v in result.extra.items() if k != "accuracy_replicates"},
        })  # fmt: skip
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def load_protocol_result(path: str | Path, key: Mapping[str, Any]) -> ProtocolResult | None:
    """A protocol's saved result when it was computed with `key`; None otherwise (retrain)."""
    path = Path(path)
    try:
        saved = json.loads((path / "result.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if saved.get("kind") != "rlxf-reward-protocol" or saved.get("key") != to_jsonable(dict(key)):
        return None
    try:
        with np.load(path / "accuracy_replicates.npz", allow_pickle=False) as z:
            reps = {k: z[k] for k in z.files}
        encoder = RewardModel.load(path / "encoder") if (path / "encoder").is_dir() else None
        audit = TfidfAuditModel.load(path / "audit") if (path / "audit").is_dir() else None
        compared = {n: RewardModel.load(path / "compared" / n) for n in saved["compared"]}
        predictions = pd.read_parquet(path / "predictions.parquet")
    except (OSError, ValueError, KeyError, RewardModelError) as exc:
        log.warning("%s: saved protocol result unreadable (%s); retraining", path, exc)
        return None
    t = saved["tables"]
    return ProtocolResult(
        saved["protocol"], predictions, pd.DataFrame(t["metrics"]), pd.DataFrame(t["calibration"]),
        pd.DataFrame(t["train_log"]), saved["timing"], encoder, audit,
        extra={**saved["extra"], "accuracy_replicates": reps},
        comparisons=pd.DataFrame(t["comparisons"]), compared=compared,
    )  # fmt: skip
