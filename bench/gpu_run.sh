#!/bin/bash
# bench/gpu_scale.py on a GPU machine (one H100: about 5 minutes on 2026-11-26, before the merged
# `generate` rows at every batch and --profile were added), set up as bench/device_check.sh sets up
# its checks: the pinned wheels this checkout's environment holds, installed into /tmp/site
# (the device has torch with CUDA, not this project's pins, and no network).
#
#   here:  bash bench/device_check.sh --download   # once: wheels into .whl/ (git-ignored)
#   there: bash bench/gpu_run.sh                    # carry .whl; writes to $OUT (or bench/results)
#
# Writes gpu_scale.json + gpu_scale.png (tokens/s, step times, peak memory, the paper profile's
# projected hours and what they assume), gpu_profile.json (where a decode step's time goes on
# generate and on the compact loop: busiest ops, host syncs), gpu_scale.log, nvidia_smi.txt and
# test_decode_gpu.log.
set -u
LOGS=${OUT:-bench/results}
mkdir -p "$LOGS"
if ls .whl/*.whl > /dev/null 2>&1; then
  rm -rf /tmp/site
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 3
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD  # an environment that already has the pins (make install)
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv > "$LOGS/nvidia_smi.txt" 2>&1
# batches 32 (the rollout's) and 128, plus what `auto` picks: each path runs twice per size
timeout 540 python3 bench/gpu_scale.py --profile --batch-sizes 32 128 --out "$LOGS" > "$LOGS/gpu_scale.log" 2>&1
echo "gpu_scale: exit $? ($(tail -1 "$LOGS/gpu_scale.log"))"
# the decode path's tests on this machine (PPO's rollout runs on the GPU there)
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_decode.py > "$LOGS/test_decode_gpu.log" 2>&1
echo "tests/test_decode.py: $(tail -1 "$LOGS/test_decode_gpu.log")"
exit 0
