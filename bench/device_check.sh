#!/bin/bash
# The GPU code paths on tiny models built from a config: every trainer family (SFT, PPO, the RLGF
# algorithms, ILHF, GRPO/RLOO through TRL, KTO/DPO/RFT), evaluation, seeds and the reward model,
# in fp32 and under bf16 autocast, on whatever accelerator torch sees (`compute.device: auto`).
#
# Usage, on a machine whose python3 has torch with CUDA but not this project's pins:
#   here:  bash bench/device_check.sh --download      # wheels into .whl/ (git-ignored via .git/info/exclude)
#   there: bash bench/device_check.sh                 # installs .whl/ into /tmp/site, runs the tests
# Logs go to $OUT (or bench/results/) as device_fp32.log and device_bf16.log.
set -u
# what the device's image lacks or holds in another version; the versions are read from this
# checkout's installed environment (`make install`, from pyproject.toml's pins), never typed here
NEEDED="transformers tokenizers trl peft datasets dill multiprocess pydantic pydantic_core
annotated-types typing-inspection typing_extensions gguf pandas fsspec sentence-transformers
scikit-learn"
if [ "${1:-}" = "--download" ]; then
  mkdir -p .whl .git/info && grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
  WHEELS=$(.venv/bin/python - $NEEDED <<'PY'
import sys
from importlib.metadata import version
print(" ".join(f"{n}=={version(n)}" for n in sys.argv[1:]))
PY
) || exit 3
  exec python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl $WHEELS
fi
LOGS=${OUT:-bench/results}
mkdir -p "$LOGS"
rm -rf /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 -c "import torch; print(torch.__version__, 'cuda' if torch.cuda.is_available() else 'no cuda')"
FILES="tests/test_ppo.py tests/test_rl.py tests/test_rlgf.py tests/test_ilhf.py tests/test_offline.py
tests/test_sft.py tests/test_trainer.py tests/test_evaluation.py tests/test_seeds.py
tests/test_distributed.py tests/test_reward.py tests/test_models.py tests/test_tokenization.py
tests/test_alignment.py tests/test_ilhf_eval.py tests/test_offline_eval.py tests/test_overopt.py
tests/test_reward_uncertainty.py tests/test_reward_encoders.py"
# the mpnet package's weights do not travel (over the size a device call carries)
SKIP="--deselect tests/test_reward_encoders.py::test_the_installed_mpnet_is_bert_base_sized"
python3 -m pytest -q -m "not slow" -p no:cacheprovider -rfE $FILES $SKIP > "$LOGS/device_fp32.log" 2>&1
echo "fp32: $(tail -1 "$LOGS/device_fp32.log")"
RLXF_TEST_AUTOCAST=bfloat16 python3 -m pytest -q -m "not slow" -p no:cacheprovider -rfE $FILES $SKIP \
  > "$LOGS/device_bf16.log" 2>&1
echo "bf16 autocast: $(tail -1 "$LOGS/device_bf16.log")"
grep -E "^(FAILED|ERROR)" "$LOGS/device_fp32.log" "$LOGS/device_bf16.log"
exit 0
