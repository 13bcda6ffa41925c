"""The reward RL optimises and its audit, saved together as one bundle (`reward_model/`), and the
audit trained on rows disjoint from the reward's."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from rlxf_utils.artifacts import atomic_dir, write_json
from rlxf_utils.config import RewardConfig
from rlxf_utils.prompts import (
    serialize_frame,
)
from rlxf_utils.reward.model import (
    BUNDLE_KIND,
    FORMAT_VERSION,
    SCORE_PRECISIONS,
    RewardModel,
    RewardModelError,
    read_marker,
)
from rlxf_utils.reward.protocol import ProtocolResult, take_rows
from rlxf_utils.reward.tfidf import TfidfAuditModel, train_tfidf


def train_disjoint_audit(
    labelled: pd.DataFrame, holdout: Mapping[str, Any], cfg: RewardConfig, seed: int
) -> TfidfAuditModel:
    """The audit model of RL: TF-IDF + LR on `holdout['audit_train']`, calibrated on `audit_val`.

    Those rows are the reward protocol's held-out rows of RL training countries: the reward model
    never trained on them and RL's history references (evaluation countries) are not among them.
    """
    tr = take_rows(labelled, holdout["audit_train"], "holdout.audit_train")
    va = take_rows(labelled, holdout["audit_val"], "holdout.audit_val")
    if tr["y"].nunique() < 2:
        raise ValueError(
            "data/holdout.json audit_train holds one class only; cannot train the audit"
        )
    audit = train_tfidf(
        serialize_frame(tr), tr["y"].astype(int).to_numpy(), serialize_frame(va),
        va["y"].astype(int).to_numpy(), cfg, seed,
    )  # fmt: skip
    audit.meta.update({
        "trained_on": "data/holdout.json:audit_train", "n_train": len(tr), "n_val": len(va),
        "row_ids": {"train": sorted(int(i) for i in tr["row_id"]),
                    "val": sorted(int(i) for i in va["row_id"])},
    })  # fmt: skip
    return audit


def save_reward_bundle(
    path: str | Path,
    result: ProtocolResult,
    reward_source: str,
    audit: TfidfAuditModel,
    score_check: Mapping[str, Any] | None = None,
) -> Path:
    """Write `reward_model/` (see the module docstring): the scorer, the audit and `bundle.json`.

    `reward_source` is 'encoder', 'tfidf' or a compared encoder's name; an encoder source is
    saved as `encoder/` (`bundle.json` names which one it is). `audit` is the disjoint-rows
    audit (`train_disjoint_audit`), never the protocol's own TF-IDF. `score_check`
    (`score_precision_check`) records the precision RL and evaluation score with.
    """
    scorer = result.scorer(reward_source)  # raises naming what the protocol trained
    encoder = scorer if isinstance(scorer, RewardModel) else result.encoder
    name = reward_source if isinstance(scorer, RewardModel) else "encoder"
    check = dict(score_check or {})

    def write(d: Path) -> None:
        if encoder is not None:
            metrics = {
                "protocol": result.protocol,
                "model": name,
                "test": result.metrics.to_dict("records"),
                "calibration": result.calibration.to_dict("records"),
                "train_log": result.train_log.to_dict("records"),
                "timing": result.timing,
            }
            encoder.save(d / "encoder", extra_json={"metrics.json": metrics})
        audit.save(d / "audit")
        if reward_source == "tfidf":
            result.audit.save(d / "tfidf")
        write_json(d / "bundle.json", {
            "kind": BUNDLE_KIND,
            "format_version": FORMAT_VERSION,
            "reward_source": reward_source,
            "protocol": result.protocol,
            "encoder": "encoder" if encoder is not None else None,
            "encoder_model": encoder.meta.get("encoder") if encoder is not None else None,
            "tfidf": "tfidf" if reward_source == "tfidf" else None,
            "audit": "audit",
            "audit_trained_on": audit.meta.get("trained_on"),
            # the row ids each judge learned from (`protocol.learned_rows`, the audit's
            # train / val): checked against the disjoint pools (tests/test_trainer_rows.py)
            "trained_on_rows": {"reward": result.extra.get("row_ids"),
                                "audit": audit.meta.get("row_ids")},
            "score_precision": check.get("used", "fp32"),
            "score_check": check,
        })  # fmt: skip

    path = Path(path)
    atomic_dir(path, write)  # a killed rerun leaves the old bundle or the new one, never a mix
    return path


def load_reward(
    path: str | Path, device: str | None = None, precision: str | None = None
) -> tuple[RewardModel | TfidfAuditModel, RewardModel | TfidfAuditModel | None]:
    """Load `reward_model/`: (the scorer that feeds RL, the disjoint-rows audit).

    An encoder scorer is put in `precision` (default: the `score_precision` notebook 02 checked
    and recorded in `bundle.json`; see `RewardModel.with_precision`).
    """
    path = Path(path)
    bundle = read_marker(path, "bundle.json", BUNDLE_KIND)
    audit = TfidfAuditModel.load(path / bundle["audit"])
    source = bundle.get("reward_source")
    if source == "tfidf":
        if not bundle.get("tfidf"):
            raise RewardModelError(
                f"{path / 'bundle.json'}: reward_source is 'tfidf' but no 'tfidf' folder is named"
            )
        return TfidfAuditModel.load(path / bundle["tfidf"]), audit
    if not isinstance(source, str) or not source:
        raise RewardModelError(
            f"{path / 'bundle.json'}: field 'reward_source' is {source!r}; expected 'encoder', "
            "'tfidf' or a compared encoder's name"
        )
    if not bundle.get("encoder"):
        raise RewardModelError(
            f"{path / 'bundle.json'}: reward_source is {source!r} but no encoder folder is named"
        )
    precision = precision or bundle.get("score_precision", "fp32")
    if precision not in SCORE_PRECISIONS:
        raise RewardModelError(
            f"{path / 'bundle.json'}: score_precision {precision!r}; expected one of {SCORE_PRECISIONS}"
        )
    return RewardModel.load(path / bundle["encoder"], device).with_precision(precision), audit
