"""The TF-IDF + logistic-regression model (the audit reward and a baseline), stored as JSON and
npz, never pickled."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from rlxf_utils.artifacts import atomic_dir, write_json
from rlxf_utils.config import RewardConfig
from rlxf_utils.reward.calibration import calibration_report, fit_platt, prior_bias, sigmoid
from rlxf_utils.reward.model import (
    AUDIT_KIND,
    FORMAT_VERSION,
    RewardModelError,
    read_marker,
    serialize_inputs,
)


class TfidfAuditModel:
    """TF-IDF + logistic regression on the serialised input; saved as JSON + npz, never pickled."""

    def __init__(
        self,
        vectorizer_params: dict[str, Any],
        vocabulary: dict[str, int],
        idf: np.ndarray,
        coef: np.ndarray,
        intercept: float,
        temperature: float = 1.0,
        meta: dict[str, Any] | None = None,
        offset: float = 0.0,
    ):
        from sklearn.feature_extraction.text import TfidfVectorizer

        self.vectorizer_params = dict(vectorizer_params)
        self.vocabulary = dict(vocabulary)
        self.idf = np.asarray(idf, dtype=np.float64)
        self.coef = np.asarray(coef, dtype=np.float64).ravel()
        self.intercept = float(intercept)
        self.temperature = float(temperature)
        self.offset = float(offset)  # Platt offset, added after dividing by the temperature
        self.meta: dict[str, Any] = dict(meta or {})
        if not (len(self.vocabulary) == len(self.idf) == len(self.coef)):
            raise RewardModelError(
                f"audit model sizes disagree: vocabulary {len(self.vocabulary)}, idf {len(self.idf)}, coef {len(self.coef)}"
            )
        self._vec = TfidfVectorizer(vocabulary=self.vocabulary, **self.vectorizer_params)
        self._vec.idf_ = self.idf

    def __repr__(self) -> str:
        return (
            f"TfidfAuditModel(features={len(self.vocabulary)}, T={self.temperature:.3f}, "
            f"offset={self.offset:+.3f})"
        )

    def margins_texts(self, texts: Sequence[str]) -> np.ndarray:
        """Uncalibrated logit of P(MET) for serialised texts."""
        x = self._vec.transform(list(texts))
        return np.asarray(x @ self.coef + self.intercept, dtype=np.float64).ravel()

    def score_texts(
        self, texts: Sequence[str], batch_size: int | None = None, calibrated: bool = True
    ) -> np.ndarray:
        """Calibrated P(MET) for already-serialised inputs (`batch_size` accepted for interface parity)."""
        margin = self.margins_texts(texts)
        if not calibrated:
            return sigmoid(margin)
        return sigmoid(margin / self.temperature + self.offset)

    def score(
        self,
        contexts: pd.DataFrame | Sequence[Mapping[str, Any]],
        texts: Sequence[str],
        batch_size: int | None = None,
        calibrated: bool = True,
    ) -> np.ndarray:
        """Calibrated P(MET) of each condition text in its context (same interface as RewardModel)."""
        return self.score_texts(serialize_inputs(contexts, texts), calibrated=calibrated)

    def save(self, path: str | Path) -> Path:
        """Write `rlxf_audit.json` (parameters, vocabulary, temperature) and `arrays.npz`."""
        marker = {
            "kind": AUDIT_KIND,
            "format_version": FORMAT_VERSION,
            "vectorizer_params": self.vectorizer_params,
            "temperature": self.temperature,
            "offset": self.offset,
            "meta": self.meta,
            "vocabulary": self.vocabulary,
        }

        def write(d: Path) -> None:
            with open(d / "arrays.npz", "wb") as fh:
                np.savez(fh, idf=self.idf, coef=self.coef, intercept=np.array([self.intercept]))
            write_json(d / "rlxf_audit.json", marker)

        path = Path(path)
        atomic_dir(path, write)  # the old folder or the new one, never a mix
        return path

    @classmethod
    def load(cls, path: str | Path) -> TfidfAuditModel:
        """Rebuild from `save`'s files; a missing, foreign or corrupt folder gives a clear error."""
        path = Path(path)
        marker = read_marker(path, "rlxf_audit.json", AUDIT_KIND)
        for key in ("vectorizer_params", "vocabulary", "temperature"):
            if key not in marker:
                raise RewardModelError(f"{path / 'rlxf_audit.json'}: field '{key}' missing")
        npz = path / "arrays.npz"
        if not npz.is_file():
            raise RewardModelError(
                f"{npz}: missing; the audit model stores idf and coefficients there"
            )
        try:
            with np.load(npz, allow_pickle=False) as arrays:
                idf, coef, intercept = arrays["idf"], arrays["coef"], arrays["intercept"]
        except Exception as exc:
            raise RewardModelError(
                f"{npz}: unreadable ({type(exc).__name__}: {exc}); expected arrays idf, coef, intercept"
            ) from exc
        params = dict(marker["vectorizer_params"])
        if "ngram_range" in params:
            params["ngram_range"] = tuple(params["ngram_range"])
        return cls(
            params,
            marker["vocabulary"],
            idf,
            coef,
            float(intercept[0]),
            marker["temperature"],
            marker.get("meta"),
            float(marker.get("offset", 0.0)),
        )


def train_tfidf(
    train_texts: Sequence[str],
    train_y: Sequence[int],
    val_texts: Sequence[str] | None,
    val_y: Sequence[int] | None,
    cfg: RewardConfig,
    seed: int,
    calibrate: bool | None = None,
) -> TfidfAuditModel:
    """Fit TF-IDF + logistic regression (class weighting as the encoder's), Platt-scale on val.

    `val_*` serve only the calibration (nothing is selected on them), so they may be the same
    calibration rows as the encoder's.
    """
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression

    params: dict[str, Any] = {
        "ngram_range": (1, cfg.tfidf_ngram_max),
        "min_df": cfg.tfidf_min_df,
        "max_features": cfg.tfidf_max_features,
        "sublinear_tf": True,
        "lowercase": True,
        "dtype": np.float64,
    }
    vec = TfidfVectorizer(**params)
    x = vec.fit_transform(list(train_texts))
    lr = LogisticRegression(
        C=cfg.tfidf_c,
        class_weight="balanced" if cfg.class_weighting == "balanced" else None,
        max_iter=2000,
        random_state=seed,
    )
    lr.fit(x, np.asarray(train_y, dtype=int))
    vocab = {str(k): int(v) for k, v in vec.vocabulary_.items()}
    saved = {k: v for k, v in params.items() if k != "dtype"}
    intercept = float(lr.intercept_[0]) + prior_bias(
        train_y, cfg
    )  # undo class weighting's prior shift
    model = TfidfAuditModel(
        saved, vocab, vec.idf_, lr.coef_[0], intercept, 1.0, {"seed": seed, "n_train": len(train_y)}
    )
    do_cal = cfg.calibrate if calibrate is None else calibrate
    if do_cal and val_texts is not None and val_y is not None and len(val_y):
        margin = model.margins_texts(val_texts)
        model.temperature, model.offset = fit_platt(margin, np.asarray(val_y))
        model.meta["calibration"] = {
            "slice": "calibration",
            "method": "platt",
            **calibration_report(
                margin, np.asarray(val_y), model.temperature, model.offset, cfg.ece_bins
            ),
        }
    return model
