#!/usr/bin/env bash
# Wheels a lent GPU machine lacks (it has torch, CuPy, lightning and pytest, but no network):
# the versions this project's .venv runs, for the machine's Python 3.12, saved in .whl/ (ignored
# by git; the device tool carries it). Run here once before scripts/gpu_check.sh goes there.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
PY=${PY:-.venv/bin/python}
pins=$($PY -m pip freeze 2>/dev/null | grep -iE '^(datasets|dill|multiprocess|transformers|tokenizers|huggingface.hub|safetensors|torchdata|hf-xet)==')
mkdir -p .whl
for pin in $pins; do
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl "$pin" 2>&1 | { grep -v "is ignored: it is neither" || true; }
done
du -sh .whl
