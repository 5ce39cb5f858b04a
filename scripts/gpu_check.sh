#!/usr/bin/env bash
# The one prepared check for a lent GPU machine (issue 7): the `gpu`-marked tests, then a short
# `streamrl bench pipeline` on a random-init Qwen2 with Qwen2.5-0.5B's shapes (~494M parameters)
# and forced output lengths, generators and trainer on the GPU. Results: $OUT/gpu_check.json
# (plus the logs). Each step has its own timeout and a failed step is recorded, not fatal.
#
# Here, first: scripts/gpu_wheels.sh (the machine has no network). Then, with the device tool:
#   run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=540)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-check-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false MPLBACKEND=Agg
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

python3 - > "$OUT/env.json" <<'PY'
import json, torch, transformers
print(json.dumps({"torch": torch.__version__, "transformers": transformers.__version__,
                  "cuda": torch.cuda.is_available(),
                  "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}))
PY

started=$(date +%s)
timeout 200 python3 -m pytest tests -m gpu -q -p no:cacheprovider -o addopts="" \
  --junitxml "$OUT/gpu-tests.xml" > "$OUT/gpu-tests.log" 2>&1
tests_rc=$?
tests_s=$(( $(date +%s) - started ))

# Forced lengths with a long tail: the bundled file (median 22.5, max 200 tokens) x2, so three
# modes x 4 iterations fit the step's timeout with HF decoding at ~20 ms per step.
python3 -c "import json; from streamrl.bench.pipeline import DEFAULT_LENGTHS as p; \
print(json.dumps([2 * n for n in json.load(open(p))]))" > "$OUT/lengths.json"
started=$(date +%s)
timeout 300 python3 -m streamrl.cli bench pipeline --device cuda --model qwen2-0.5b \
  --lengths "$OUT/lengths.json" --batch 16 --group-size 4 --iterations 3 --warmup 1 --repeats 1 \
  --generators 1 --colocated-generators 1 --max-batch-size 64 \
  --timeline-dir "$OUT" > "$OUT/bench.json" 2> "$OUT/bench.log"
bench_rc=$?
bench_s=$(( $(date +%s) - started ))

python3 - "$OUT" "$tests_rc" "$tests_s" "$bench_rc" "$bench_s" <<'PY'
import json, sys
from pathlib import Path
out, tests_rc, tests_s, bench_rc, bench_s = sys.argv[1], *map(int, sys.argv[2:])
out = Path(out)
lines = [l for l in (out / "bench.json").read_text().splitlines() if l.startswith("{")]
summary = (out / "gpu-tests.log").read_text().strip().splitlines()[-1:] or [""]
result = {"env": json.loads((out / "env.json").read_text() or "{}"),
          "gpu_tests": {"rc": tests_rc, "wall_s": tests_s, "summary": summary[0]},
          "bench_pipeline": {"rc": bench_rc, "wall_s": bench_s,
                             "result": json.loads(lines[-1]) if lines else None}}
(out / "gpu_check.json").write_text(json.dumps(result, indent=1))
print(json.dumps(result, indent=1))
PY
