#!/usr/bin/env bash
# The one prepared check for a lent GPU machine (its image as it is: Python 3.12, torch + CUDA 13,
# no network). Here first, once: python scripts/gpu_wheels.py (the wheels the image lacks, into
# .whl/). Then, with the device tool:
#   run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=420)
# Installs the carried wheels under /tmp, then runs scripts/gpu_check.py: every step under
# `timeout -k`, the whole under a 6-minute deadline, the verdict JSON as the last stdout line and
# in $OUT/gpu_check.json ($OUT also holds steps.log; large files stay under /tmp/gpu-check).
# GPU_CHECK_DEVICE=cpu runs the same steps on the CPU, small (tests/test_gpu_check.py).
set -uo pipefail
cd "$(dirname "$0")/.."
export GPU_CHECK_STARTED=$(date +%s)
export OUT=${OUT:-gpu-check-out} GPU_CHECK_WORK=${GPU_CHECK_WORK:-/tmp/gpu-check}
mkdir -p "$OUT" "$GPU_CHECK_WORK"
if compgen -G ".whl/*.whl" > /dev/null; then
  timeout -k 5 30 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target "$GPU_CHECK_WORK/site" .whl/*.whl > "$GPU_CHECK_WORK/wheels.log" 2>&1
  export PYTHONPATH=$GPU_CHECK_WORK/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD:$PWD/scripts${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false MPLBACKEND=Agg
exec timeout -k 5 360 python3 scripts/gpu_check.py
