"""Notebook 02's stage: every protocol, the comparisons and tables, the bundle RL uses."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from rlxf_utils.prompts import (
    serialize_frame,
)

if TYPE_CHECKING:  # heavy imports stay lazy so that `import rlxf_utils.reward` is cheap
    pass
from rlxf_utils.artifacts import hash_path
from rlxf_utils.data.splits import load_holdout, load_splits
from rlxf_utils.reward.bundle import save_reward_bundle, train_disjoint_audit
from rlxf_utils.reward.calibration import CALIBRATION_SHARE
from rlxf_utils.reward.encoders import encoder_label
from rlxf_utils.reward.figures import plot_confusion, plot_encoders, plot_reliability
from rlxf_utils.reward.model import RewardModel, score_precision_check
from rlxf_utils.reward.protocol import (
    ProtocolResult,
    load_protocol_result,
    protocol_key,
    run_protocol,
    save_protocol_result,
    take_rows,
)
from rlxf_utils.reward.tables import (
    accuracy_table,
    comparison_tables,
    encoder_table,
    most_confident_errors,
    per_area_accuracy,
    reference_check_table,
    within_context_table,
)
from rlxf_utils.reward.training import configure_threads

log = logging.getLogger(__name__)


@dataclass
class RewardStage:
    """What notebook 02 computes: per-protocol results and the tables it wrote to the run dir."""

    results: list[ProtocolResult]
    tables: dict[str, pd.DataFrame]
    reward_dir: Path


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
    configure_threads(cfg.reward.num_threads)
    labelled, splits = load_splits(run)
    results = protocol_results(cfg, run, labelled, splits, model_factory)
    chosen = next(r for r in results if r.protocol == cfg.reward.reward_protocol)
    reward_dir, reference_check, score_check = save_rl_reward(cfg, run, labelled, splits, chosen)
    tables = reward_tables(cfg, results, chosen, reference_check)
    for name, df in tables.items():
        run.write_table(name, df)
    write_reward_summary(cfg, run, results, tables, score_check)
    return RewardStage(results, tables, reward_dir)


def protocol_results(
    cfg: Any, run: Any, labelled: pd.DataFrame, splits: Any,
    model_factory: Callable[[], tuple[Any, Any]] | None,
) -> list[ProtocolResult]:  # fmt: skip
    """Every protocol trained and scored (`reward.protocol.run_protocol`), or read back when its
    cache records the same settings, seeds and data; their test predictions written."""
    rc = cfg.reward
    alpha, n_boot = cfg.evaluation.alpha, cfg.evaluation.n_boot
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
    return results


def save_rl_reward(
    cfg: Any, run: Any, labelled: pd.DataFrame, splits: Any, chosen: ProtocolResult
) -> tuple[Any, pd.DataFrame, dict[str, Any]]:
    """The reward bundle RL and evaluation read (`reward_model/`): the chosen protocol's scorer,
    its check in the precision they score in, and the audit trained on its own disjoint rows;
    with the reference check (both judges on the held-out references). Returns (bundle dir,
    reference check, precision check)."""
    rc = cfg.reward
    holdout = load_holdout(run)
    audit = train_disjoint_audit(labelled, holdout, rc, cfg.run.seed)
    scorer = chosen.scorer(rc.reward_source)
    score_check: dict[str, Any] = {}
    if isinstance(scorer, RewardModel):  # the precision RL and evaluation will score in
        test_rows = take_rows(
            labelled, splits[rc.reward_protocol]["test"], f"{rc.reward_protocol}.test"
        )
        score_check = score_precision_check(
            scorer, serialize_frame(test_rows), rc.score_precision, rc.score_tolerance,
            rc.score_batch_size, fp32=protocol_fp32_scores(chosen, rc, test_rows),
        )  # fmt: skip
    reward_dir = save_reward_bundle(
        run.path("reward_model"), chosen, rc.reward_source, audit, score_check
    )
    reference_check = reference_check_table(
        labelled, holdout, chosen, audit, cfg.evaluation.n_boot, cfg.evaluation.alpha, cfg.run.seed
    )
    return reward_dir, reference_check, score_check


def protocol_fp32_scores(
    chosen: ProtocolResult, rc: Any, test_rows: pd.DataFrame
) -> tuple[np.ndarray, float] | None:
    """The reward source's fp32 P(MET) of `test_rows` and its pace, as the protocol scored its
    test set (`fit_encoder`: `margins_texts` at `reward.score_batch_size`, calibrated as
    `score_texts`), in `test_rows`' order; None where the protocol's predictions cannot give
    them (a row it did not score), and the check scores them itself."""
    name = rc.reward_source
    pred, pace = chosen.predictions, chosen.timing.get(f"{name}_score_texts_per_s")
    if pace is None or f"p_{name}" not in pred or "row_id" not in test_rows:
        return None
    by_row = pred.set_index("row_id")[f"p_{name}"]
    if by_row.index.has_duplicates or not test_rows["row_id"].isin(by_row.index).all():
        return None
    return by_row.loc[test_rows["row_id"]].to_numpy(dtype=np.float64), float(pace)


def _encoders(rc: Any) -> dict[str, str]:
    """Each trained encoder's name -> its setting (the main one, then the compared ones)."""
    return {"encoder": rc.encoder, **{c.name: c.encoder for c in rc.compare_encoders}}


def reward_tables(
    cfg: Any, results: list[ProtocolResult], chosen: ProtocolResult, reference_check: pd.DataFrame
) -> dict[str, pd.DataFrame]:
    """The stage's tables `reward_*`, in the order they are written."""
    rc = cfg.reward
    calibration = pd.concat(
        [r.calibration.assign(protocol=r.protocol) for r in results], ignore_index=True
    )
    comparisons, protocol_diffs = comparison_tables(results, cfg.evaluation.alpha)
    return {
        "reward_accuracy_vs_paper": accuracy_table(results),
        "reward_metrics": pd.concat([r.metrics for r in results], ignore_index=True),
        "reward_calibration": calibration[
            ["protocol", *[c for c in calibration.columns if c != "protocol"]]
        ],
        "reward_within_context": within_context_table(results),
        "reward_comparisons": comparisons,
        "reward_protocol_differences": protocol_diffs,
        "reward_reference_check": reference_check,
        "reward_confident_errors": most_confident_errors(
            chosen.predictions, rc.reward_source, k=10
        ),
        "reward_per_area": per_area_accuracy(chosen.predictions),
        "reward_train_log": pd.concat(
            [r.train_log.assign(protocol=r.protocol) for r in results], ignore_index=True
        ),
        "reward_timing": pd.DataFrame([{"protocol": r.protocol, **r.timing} for r in results]),
        "reward_encoders": encoder_table(results, _encoders(rc)),
    }


def write_reward_summary(
    cfg: Any, run: Any, results: list[ProtocolResult], tables: Mapping[str, pd.DataFrame],
    score_check: dict[str, Any],
) -> None:  # fmt: skip
    """`reward/metrics.json` and the figures `reward_reliability`, `reward_confusion` and
    `reward_encoders`."""
    import matplotlib.pyplot as plt

    rc, alpha = cfg.reward, cfg.evaluation.alpha
    encoders = _encoders(rc)
    run.write_json("reward/metrics.json", {
        "reward_source": rc.reward_source, "reward_protocol": rc.reward_protocol,
        "alpha": alpha, "n_boot": cfg.evaluation.n_boot, "calibration_share": CALIBRATION_SHARE,
        "metrics": tables["reward_metrics"].to_dict("records"),
        "calibration": pd.concat([r.calibration.assign(protocol=r.protocol) for r in results],
                                 ignore_index=True).to_dict("records"),
        "comparisons": tables["reward_comparisons"].to_dict("records"),
        "protocol_differences": tables["reward_protocol_differences"].to_dict("records"),
        "timing": {r.protocol: r.timing for r in results},
        "encoders": {k: {"setting": v, "label": encoder_label(v)} for k, v in encoders.items()},
        "score_check": score_check,
    })  # fmt: skip
    for name, fig in (
        ("reward_reliability", plot_reliability(results, (*encoders, "tfidf"))),
        ("reward_confusion", plot_confusion(results, rc.reward_source)),
        ("reward_encoders", plot_encoders(tables["reward_encoders"], alpha)),
    ):
        run.write_figure(name, fig)
        plt.close(fig)
