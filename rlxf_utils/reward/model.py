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
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from rlxf_utils.artifacts import atomic_dir, write_json
from rlxf_utils.config.precision import resolve
from rlxf_utils.prompts import (
    CONTEXT_FIELDS,
    serialize_condition,
)
from rlxf_utils.runtime import resolve_device

if TYPE_CHECKING:  # heavy imports stay lazy so that `import rlxf_utils.reward` is cheap
    import torch

from rlxf_utils.reward.calibration import sigmoid

log = logging.getLogger(__name__)


#: The paper's headline reward-model accuracy on its 20% unseen data (WP/24/114, section 4).
PAPER_ACCURACY = 0.82


ENCODER_KIND = "rlxf-reward-encoder"


AUDIT_KIND = "rlxf-tfidf-audit"


BUNDLE_KIND = "rlxf-reward-bundle"


FORMAT_VERSION = 1


#: Arithmetic a saved encoder can score in (`RewardModel.with_precision`, reward.score_precision).
SCORE_PRECISIONS = ("fp32", "bf16", "int8")


class RewardModelError(ValueError):
    """A folder that is not a usable saved reward model; the message names the file and the fix."""


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
        the margins. 'auto': 'bf16' where the model's device runs bf16 natively, else 'fp32'.
        """
        import copy
        import warnings

        import torch

        precision = resolve(precision, self.device.type)
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
        return sigmoid(np.asarray(margin, dtype=float) / self.temperature + self.offset)

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
        return self.calibrated(margin) if calibrated else sigmoid(margin)

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
        """Write safetensors weights, config, tokenizer, `rlxf_reward.json` and `calibration.json`
        into `path`, replacing it as a whole."""
        if self.precision != "fp32":
            raise RewardModelError(
                f"a {self.precision} scorer is a view for scoring; save the fp32 model it came from"
            )
        marker = {
            "kind": ENCODER_KIND,
            "format_version": FORMAT_VERSION,
            "max_length": self.max_length,
            "temperature": self.temperature,
            "bias": self.bias,
            "offset": self.offset,
            **{k: v for k, v in self.meta.items() if k not in {"kind", "format_version"}},
        }

        def write(d: Path) -> None:
            self.model.save_pretrained(d, safe_serialization=True)
            self.tokenizer.save_pretrained(d)
            write_json(d / "rlxf_reward.json", marker)
            write_json(
                d / "calibration.json",
                self.meta.get("calibration", {"temperature": self.temperature}),
            )
            for name, obj in (extra_json or {}).items():
                write_json(d / name, obj)

        path = Path(path)
        atomic_dir(path, write)  # a killed save leaves the old folder or the new one, never a mix
        return path

    @classmethod
    def load(cls, path: str | Path, device: str | None = None) -> RewardModel:
        """Load a folder written by `save`; anything else is rejected with a message naming the file."""
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        path = Path(path)
        marker = read_marker(path, "rlxf_reward.json", ENCODER_KIND)
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
        model.to(resolve_device(device))
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
    fp32: tuple[np.ndarray, float] | None = None,
) -> dict[str, Any]:
    """Score `texts` in fp32 and in `precision`; keep `precision` only within `tolerance`.

    Returns the requested and the `used` precision, the largest and mean |P(MET) difference|
    (calibrated), the share of rows whose MET/Non-MET decision at 0.5 changes, and both
    throughputs (texts/s, after one warm-up batch). `used` falls back to fp32, with a warning,
    when the largest difference exceeds `tolerance`.

    `fp32` = (calibrated P(MET) of `texts`, texts/s): the fp32 scores already computed by
    `score_texts(texts, batch_size)` on `rm` (the protocol's test predictions), so the check
    does not score the test set in fp32 a second time.
    """
    texts = list(texts)
    precision = resolve(precision, rm.device.type)  # 'auto': what runs natively
    out: dict[str, Any] = {"requested": precision, "tolerance": tolerance, "n": len(texts)}

    def timed(model: RewardModel) -> tuple[np.ndarray, float]:
        model.score_texts(texts[:batch_size], batch_size)  # warm-up (kernels, allocations)
        t0 = time.perf_counter()
        p = model.score_texts(texts, batch_size)
        return p, len(texts) / max(time.perf_counter() - t0, 1e-9)

    if fp32 is not None and len(fp32[0]) != len(texts):
        raise ValueError(f"fp32 scores for {len(fp32[0])} texts; expected {len(texts)}")
    p32, out["fp32_texts_per_s"] = (
        (np.asarray(fp32[0], dtype=np.float64), float(fp32[1])) if fp32 is not None else timed(rm)
    )
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


def read_marker(
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
