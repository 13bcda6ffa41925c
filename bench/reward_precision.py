"""Does bf16 fine-tuning of the reward encoder change what it learns? A paired test on MONA.

Trains the profile's encoder on the `grouped` protocol twice through notebook 02's own path
(`reward.protocol.run_protocol`): the main model with `train_precision: bf16`, its twin (a compared encoder
with the same settings) in fp32, on the same rows, seed, selection and calibration halves. The
paired bootstrap intervals of (fp32 twin - bf16) in accuracy and AUC on the test rows, both
training times and both models' test metrics go to the JSON.

    .venv/bin/python bench/reward_precision.py [--params params/default.yaml] [--run-dir runs/default]
        [--encoder embedded:minilm] [--out bench/results/reward_precision.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from rlxf_utils.artifacts import RunDir, to_jsonable  # noqa: E402
from rlxf_utils.config import (
    CompareEncoder,  # noqa: E402
    load_config,  # noqa: E402
)
from rlxf_utils.data.splits import load_splits  # noqa: E402
from rlxf_utils.data.stage import run_data_stage  # noqa: E402
from rlxf_utils.reward.encoders import EMBEDDED_MINILM
from rlxf_utils.reward.protocol import run_protocol
from rlxf_utils.reward.training import configure_threads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="params/default.yaml")
    ap.add_argument("--run-dir", default=None, help="reuse data/ of an existing run dir")
    ap.add_argument("--encoder", default=EMBEDDED_MINILM)
    ap.add_argument("--protocol", default="grouped")
    ap.add_argument("--out", default="bench/results/reward_precision.json")
    args = ap.parse_args()

    load_before = os.getloadavg()
    cfg = load_config(args.params)
    threads = configure_threads(None)
    rc = cfg.reward.model_copy(
        update={"encoder": args.encoder, "train_precision": "bf16", "compare_encoders": [],
                "num_threads": threads, "progress": False}
    )  # fmt: skip
    twin = CompareEncoder(name="fp32_twin", encoder=args.encoder, train_precision="fp32")
    with tempfile.TemporaryDirectory() as tmp:
        run = RunDir(args.run_dir or tmp)
        if not run.exists("data/splits.json"):
            run_data_stage(cfg, run)
        labelled, splits = load_splits(run)
    res = run_protocol(
        labelled, splits, args.protocol, rc, cfg.run.seed, alpha=cfg.evaluation.alpha,
        n_boot=cfg.evaluation.n_boot, compare=[twin],
    )  # fmt: skip
    m = res.metrics.set_index("model")
    keep = ["accuracy", "accuracy_low", "accuracy_high", "roc_auc", "roc_auc_low", "roc_auc_high",
            "auc_within_context", "ece", "n"]  # fmt: skip
    comp = res.comparisons[res.comparisons["comparison"] == "fp32_twin vs encoder"]
    result = {
        "profile": args.params,
        "encoder": args.encoder,
        "protocol": args.protocol,
        "bf16": {**m.loc["encoder", keep].to_dict(), "train_s": res.timing["encoder_train_s"],
                 "epochs_run": res.timing["encoder_epochs_run"]},
        "fp32": {**m.loc["fp32_twin", keep].to_dict(), "train_s": res.timing["fp32_twin_train_s"],
                 "epochs_run": res.timing["fp32_twin_epochs_run"]},
        "fp32_minus_bf16": comp[["measure", "diff", "diff_low", "diff_high", "verdict"]].to_dict("records"),
        "alpha": cfg.evaluation.alpha,
        "torch_threads": threads,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
    }  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(to_jsonable(result), indent=2) + "\n", encoding="utf-8")
    print(
        json.dumps(
            to_jsonable({k: result[k] for k in ("bf16", "fp32", "fp32_minus_bf16")}), indent=2
        )
    )


if __name__ == "__main__":
    main()
