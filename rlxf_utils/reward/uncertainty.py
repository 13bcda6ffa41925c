"""Reward uncertainty: a bootstrap ensemble of logistic heads on the reward encoder's features.

The reward model gives one P(MET) per response and no sign of how sure it is. Its encoder's
frozen features (the input of the classifier's final linear layer, `RewardModel.margins_and_features`)
are kept fixed and B logistic-regression heads are fitted on them, each on a bootstrap resample
(stratified by label, seeded) of the reward model's own training rows: the reward protocol's
training split, serialised exactly as the reward model saw it (`reward.protocol.run_protocol`), subsampled
to `evaluation.reward_heads_rows`. Where the training rows pin the heads down they agree; where a
response's features lie away from them they disagree. The standard deviation of the heads' P(MET)
(over the B heads, ddof 0) is that epistemic uncertainty per response (`reward_sd`); its mean per
policy, beside Ave(R), asks whether RL moved into text the reward model is unsure about. The heads'
own P(MET) is not the calibrated reward and is not reported; only their spread is.

Layout under the run dir (written by `fit_or_load`, refitted when its settings change)::

    reward_model/uncertainty/
      rlxf_reward_heads.json   kind marker, format version, settings (heads, rows, seed,
                               protocol, C, fingerprints of the encoder and of the rows), fit info
      heads.npz                coef (B x d), intercept (B,), row_ids (the rows fitted on)

The arrays are written first and the marker last, each atomically, so a marker names a complete
fit.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from rlxf_utils.artifacts import atomic_dir, write_json
from rlxf_utils.data.splits import load_splits
from rlxf_utils.prompts import response_contexts, serialize_frame
from rlxf_utils.reward.calibration import sigmoid
from rlxf_utils.reward.model import RewardModel, RewardModelError, read_marker, serialize_inputs
from rlxf_utils.reward.protocol import take_rows

log = logging.getLogger(__name__)


HEADS_KIND = "rlxf-reward-heads"


FORMAT_VERSION = 1


MARKER = "rlxf_reward_heads.json"


ARRAYS = "heads.npz"


#: Where `fit_or_load` keeps the heads, relative to the run dir.
FOLDER = "reward_model/uncertainty"


#: Inverse L2 strength of every head (sklearn's C): fixed, recorded in the marker.
HEAD_C = 1.0


class RewardHeadsError(RewardModelError):
    """A saved heads folder that cannot be used; the message names the file and the field."""


class RewardHeads:
    """B logistic heads on reward features: `predict(features) -> (mean, sd)` of P(MET) per row."""

    def __init__(
        self,
        coef: np.ndarray,
        intercept: np.ndarray,
        settings: Mapping[str, Any] | None = None,
        row_ids: Sequence[int] | np.ndarray | None = None,
    ):
        self.coef = np.atleast_2d(np.asarray(coef, dtype=np.float64))
        self.intercept = np.asarray(intercept, dtype=np.float64).ravel()
        if self.coef.shape[0] != self.intercept.shape[0] or self.coef.shape[0] < 1:
            raise ValueError(
                f"heads need one intercept per coefficient row; got coef {self.coef.shape} and "
                f"intercept {self.intercept.shape}"
            )
        self.settings: dict[str, Any] = dict(settings or {})
        self.row_ids = np.asarray([] if row_ids is None else row_ids, dtype=np.int64)

    def __repr__(self) -> str:
        return f"RewardHeads(heads={self.n_heads}, features={self.dim})"

    @property
    def n_heads(self) -> int:
        return int(self.coef.shape[0])

    @property
    def dim(self) -> int:
        return int(self.coef.shape[1])

    @classmethod
    def fit(
        cls,
        features: np.ndarray,
        y: Sequence[int] | np.ndarray,
        n_heads: int,
        seed: int,
        c: float = HEAD_C,
        settings: Mapping[str, Any] | None = None,
        row_ids: Sequence[int] | np.ndarray | None = None,
    ) -> RewardHeads:
        """Fit `n_heads` logistic regressions, each on a bootstrap resample of (features, y).

        The resample is stratified (MET and Non-MET rows resampled separately, each to its own
        count), so every head sees both classes; head b draws from `default_rng([seed, b])`.
        """
        from sklearn.linear_model import LogisticRegression

        x = np.asarray(features, dtype=np.float64)
        y = np.asarray(y, dtype=int)
        if x.ndim != 2 or len(x) != len(y):
            raise ValueError(
                f"features must be (n, d) with one label per row; got {x.shape}, {y.shape}"
            )
        if n_heads < 1:
            raise ValueError(f"n_heads must be >= 1; got {n_heads}")
        classes = [np.flatnonzero(y == k) for k in (0, 1)]
        if any(len(c_) == 0 for c_ in classes) or not set(np.unique(y)) <= {0, 1}:
            raise ValueError(
                f"heads need 0/1 labels with both classes present; got counts "
                f"{[len(c_) for c_ in classes]} of {len(y)} rows"
            )
        coef, intercept = [], []
        for b in range(n_heads):
            rng = np.random.default_rng([seed, b])
            idx = np.concatenate([rng.choice(c_, size=len(c_), replace=True) for c_ in classes])
            lr = LogisticRegression(C=c, max_iter=2000)
            lr.fit(x[idx], y[idx])
            coef.append(lr.coef_[0])
            intercept.append(lr.intercept_[0])
        return cls(np.vstack(coef), np.asarray(intercept), settings, row_ids)

    def probabilities(self, features: np.ndarray) -> np.ndarray:
        """P(MET) of every head for every row: (n, B)."""
        x = np.asarray(features, dtype=np.float64)
        if x.ndim != 2 or x.shape[1] != self.dim:
            raise ValueError(f"features must be (n, {self.dim}); got {x.shape}")
        return sigmoid(x @ self.coef.T + self.intercept)

    def predict(self, features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(mean, sd) of P(MET) across the heads per row; sd is 0 with one head (ddof 0)."""
        p = self.probabilities(features)
        return p.mean(axis=1), p.std(axis=1, ddof=0)

    # -- persistence ----------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Write `heads.npz` and the marker `rlxf_reward_heads.json`, replacing `path` as a whole."""
        marker = {
            "kind": HEADS_KIND,
            "format_version": FORMAT_VERSION,
            "n_heads": self.n_heads,
            "dim": self.dim,
            "settings": self.settings,
        }

        def write(d: Path) -> None:
            with open(d / ARRAYS, "wb") as fh:
                np.savez(fh, coef=self.coef, intercept=self.intercept, row_ids=self.row_ids)
            write_json(d / MARKER, marker)

        path = Path(path)
        atomic_dir(path, write)  # the old folder or the new one, never a mix
        return path

    @staticmethod
    def read_marker(path: str | Path) -> dict[str, Any]:
        """The checked marker of a heads folder; a missing, foreign or corrupt one is a clear error."""
        marker_path = Path(path) / MARKER
        marker = read_marker(Path(path), MARKER, HEADS_KIND, RewardHeadsError)
        for key, kind in (("n_heads", int), ("dim", int), ("settings", dict)):
            if not isinstance(marker.get(key), kind):
                raise RewardHeadsError(
                    f"{marker_path}: field {key!r} is {marker.get(key)!r}; expected {kind.__name__}"
                )
        return marker

    @classmethod
    def load(cls, path: str | Path) -> RewardHeads:
        """Rebuild from `save`'s files; the arrays must match the marker's `n_heads` and `dim`."""
        path = Path(path)
        marker = cls.read_marker(path)
        npz = path / ARRAYS
        if not npz.is_file():
            raise RewardHeadsError(f"{npz}: missing; the heads store coef and intercept there")
        try:
            with np.load(npz, allow_pickle=False) as arrays:
                coef, intercept = arrays["coef"], arrays["intercept"]
                row_ids = arrays["row_ids"]
        except Exception as exc:
            raise RewardHeadsError(
                f"{npz}: unreadable ({type(exc).__name__}: {exc}); expected arrays coef, "
                "intercept, row_ids"
            ) from exc
        want = (marker["n_heads"], marker["dim"])
        if coef.shape != want or intercept.shape != (want[0],):
            raise RewardHeadsError(
                f"{npz}: coef {coef.shape} / intercept {intercept.shape} disagree with "
                f"{path / MARKER} fields 'n_heads' and 'dim' {want}"
            )
        return cls(coef, intercept, marker["settings"], row_ids)


def encoder_fingerprint(reward_model: RewardModel) -> str:
    """sha256 of the encoder's weights (every state-dict tensor, in order) and its max length."""
    import torch

    h = hashlib.sha256(f"max_length={reward_model.max_length}".encode())
    for name, t in reward_model.model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def training_rows(
    labelled: pd.DataFrame,
    splits: Mapping[str, Mapping[str, Sequence[int]]],
    protocol: str,
    rows: int,
    seed: int,
) -> pd.DataFrame:
    """The reward protocol's training rows (`splits[protocol]['train']`), a seeded subsample of
    at most `rows` of them, in the split's order."""
    if protocol not in splits or "train" not in splits[protocol]:
        raise KeyError(
            f"data/splits.json has no {protocol!r}.train; the reward protocol "
            f"(reward.reward_protocol) must be one of {sorted(splits)}"
        )
    tr = take_rows(labelled, splits[protocol]["train"], f"{protocol}.train")
    if len(tr) > rows:
        keep = np.sort(np.random.default_rng(seed).choice(len(tr), size=rows, replace=False))
        tr = tr.iloc[keep].reset_index(drop=True)
    return tr


def fit_or_load(run: Any, cfg: Any, reward_model: Any) -> RewardHeads | None:
    """The heads of this run's reward model: reused from `reward_model/uncertainty/` when its
    marker's settings match, fitted (and saved) otherwise.

    None, with the reason logged, when `evaluation.reward_heads` is 0 or the reward model is not
    an encoder (the TF-IDF reward source has no features to put heads on). The settings are the
    head count, the row budget, the seed, the protocol, C and fingerprints of the encoder's
    weights and of the serialised training rows with their labels, so a retrained reward model,
    changed splits or other parameters refit the heads.
    """

    ec = cfg.evaluation
    if ec.reward_heads == 0:
        log.info("reward uncertainty off: evaluation.reward_heads is 0")
        return None
    if not isinstance(reward_model, RewardModel):
        log.info(
            "reward uncertainty skipped: the reward source is %s, which has no encoder features",
            type(reward_model).__name__,
        )
        return None
    labelled, splits = load_splits(run)
    protocol = cfg.reward.reward_protocol
    rows = training_rows(labelled, splits, protocol, ec.reward_heads_rows, cfg.run.seed)
    texts = serialize_frame(rows)  # the reward model's training serialisation (run_protocol)
    y = rows["y"].astype(int).to_numpy()
    data_sha = hashlib.sha256(
        "\n".join(f"{int(v)}\t{t}" for v, t in zip(y, texts, strict=True)).encode()
    )
    settings = {
        "heads": int(ec.reward_heads),
        "rows": int(ec.reward_heads_rows),
        "seed": int(cfg.run.seed),
        "protocol": protocol,
        "c": HEAD_C,
        "encoder_sha256": encoder_fingerprint(reward_model),
        "rows_sha256": data_sha.hexdigest(),
        "n_rows": len(rows),
    }
    folder = run.path(FOLDER)
    if (folder / MARKER).exists():
        try:
            saved = RewardHeads.load(folder)
        except RewardHeadsError as exc:
            log.warning("%s; refitting the reward heads", exc)
        else:
            if saved.settings == settings:
                log.info("reward heads reused from %s (%d heads)", folder, saved.n_heads)
                return saved
            changed = sorted(k for k in settings if saved.settings.get(k) != settings[k])
            log.info("reward heads in %s were fitted with other %s; refitting", folder, changed)
    _, feats = reward_model.margins_and_features(texts, cfg.reward.score_batch_size)
    heads = RewardHeads.fit(
        feats,
        y,
        ec.reward_heads,
        cfg.run.seed,
        settings=settings,
        row_ids=rows["row_id"].to_numpy(),
    )
    heads.save(folder)
    log.info(
        "reward heads: %d fitted on %d training rows, saved to %s", heads.n_heads, len(rows), folder
    )
    return heads


def reward_and_sd(
    samples: pd.DataFrame,
    contexts: Sequence[Mapping[str, Any]],
    reward_model: RewardModel,
    heads: RewardHeads,
    batch: int,
) -> tuple[np.ndarray, np.ndarray]:
    """(calibrated P(MET), SD of the heads' P(MET)) of each response in its prompt's context.

    One forward pass gives both: the reward equals `reward_model.score` (the same serialisation
    and batches as `evaluation.sampling._score`), the SD comes from the same pass's features.
    """
    ctx = response_contexts(samples["prompt_id"], contexts)
    texts = serialize_inputs(ctx, samples["response"].tolist())
    margin, feats = reward_model.margins_and_features(texts, batch)
    return reward_model.calibrated(margin), heads.predict(feats)[1]


def add_reward_sd(
    df: pd.DataFrame,
    contexts: Sequence[Mapping[str, Any]],
    reward_model: RewardModel,
    heads: RewardHeads | None,
    batch: int,
) -> pd.DataFrame:
    """Column `reward_sd` (NaN without heads); with heads also `reward`, from the same pass."""
    if heads is None:
        df["reward_sd"] = np.nan
        return df
    df["reward"], df["reward_sd"] = reward_and_sd(df, contexts, reward_model, heads, batch)
    return df
