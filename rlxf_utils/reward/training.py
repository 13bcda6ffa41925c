"""Fine-tuning a reward encoder: seeds and threads, the training loop with checkpoint selection on
the selection half, and calibration on the other half."""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from rlxf_utils.runtime import resolve_device, warm_up_kernels

if TYPE_CHECKING:  # heavy imports stay lazy so that `import rlxf_utils.reward` is cheap
    import torch

from rlxf_utils.config import RewardConfig
from rlxf_utils.config.precision import resolve as resolve_precision
from rlxf_utils.reward.calibration import (
    calibration_report,
    classification_metrics,
    fit_platt,
    prior_bias,
    sigmoid,
)
from rlxf_utils.reward.encoders import resolve_encoder
from rlxf_utils.reward.model import RewardModel

log = logging.getLogger(__name__)


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
    warm_up_kernels()


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
            p = sigmoid(rm.margins_texts(val_texts, cfg.score_batch_size))
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
    device_type = resolve_device(None).type
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
            use_cpu=device_type == "cpu",
            # bf16 autocast: CPU avx512_bf16 or GPU ('auto': where the device runs it natively)
            bf16=resolve_precision(cfg.train_precision, device_type) == "bf16",
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


def configure_threads(n: int | None = None) -> int:
    """Set torch's intra-op threads (default: the CPUs this process may use) and return the count."""
    import torch

    n = n or len(os.sched_getaffinity(0))
    torch.set_num_threads(n)
    warm_up_kernels()
    return n
