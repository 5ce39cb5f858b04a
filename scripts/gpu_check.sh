#!/usr/bin/env bash
# The one prepared check for a lent GPU machine: the trainer's real-hardware path on one GPU.
#   1. the `gpu`-marked tests;
#   2. `streamrl fit` end to end on a random-init Qwen2.5-0.5B-shaped model (494M parameters,
#      vocabulary 151,936): trainer.accelerator cuda, bf16-mixed (FSDP2 on NCCL, one rank),
#      every decoder layer checkpointed, chunked log-probs, 4k-token samples (a random policy
#      does not stop), the HF generator on the same GPU (rl.share_trainer_gpus) in bfloat16: each
#      weight version staged from the CUDA trainer into pinned host buffers in bf16, bucket by
#      bucket, received into the instance's staging and loaded onto its GPU (gloo: NCCL refuses
#      two members on one GPU), the engine-gap correction on;
#      each rank reading its own rows of the directory, the held-out evaluations decoded on the
#      generator instance, the trained policy written tensor by tensor (its directory is read
#      back);
#   2b. scripts/gpu_edges_check.py: the sharded load on NCCL ("cpu:gloo,cuda:nccl"), compared
#      with from_pretrained tensor by tensor, the bf16 reference, the save, their GPU peaks;
#   3. `streamrl bench memory` at the same shape, --seq 4096, old path beside the new;
#   4. if this machine's Python has vLLM (it cannot be carried: its wheels pass the carry limit),
#      scripts/gpu_vllm_check.py: one vLLM instance in bfloat16 on the GPU beside the trainer,
#      three weight versions, each load checked against the trainer's log-probs; else recorded
#      as skipped (rc 127);
# then prints one JSON object (peak GPU memory, tokens/s, each step's rc and seconds) and writes
# it to $OUT/gpu_check.json. Each step has its own timeout; a failed step is recorded, not fatal.
# Budget: under 8 minutes in all.
#
# Here, first: scripts/gpu_wheels.sh (the machine has no network). Then, with the device tool:
#   run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=540)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-check-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false MPLBACKEND=Agg
export STREAMRL_CACHE="$OUT/cache" HF_HOME="$OUT/hf"
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

step() {  # step NAME TIMEOUT COMMAND...: run it, record rc and seconds in $OUT/NAME.status
  local name=$1 limit=$2; shift 2
  local started=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.out" 2> "$OUT/$name.log"
  echo "$? $(( $(date +%s) - started ))" > "$OUT/$name.status"
}

step gpu-tests 90 python3 -m pytest tests -m gpu -q -p no:cacheprovider -o addopts="" \
  --junitxml "$OUT/gpu-tests.xml"
step model 60 python3 -m streamrl.cli.main model --size 0.5b --out "$OUT/qwen0.5b" --context 4608

cat > "$OUT/fit.yaml" <<YAML
model: $OUT/qwen0.5b
output_dir: $OUT/fit
data: {tasks: [copy, count], n_train: 32, n_heldout: 2}
rl: {iterations: 2, prompts_per_iteration: 2, group_size: 2, generators: 1, gpus: 1,
     share_trainer_gpus: true, engine: {name: hf, dtype: bfloat16},
     max_batch_size: 4, temperature: 1.0, max_tokens: 4096, eval_max_tokens: 64,
     max_tokens_per_micro_batch: 8400, reward: partial, reward_workers: 0,
     length_predictor: null, checkpoint_every: 0}
trainer: {accelerator: cuda, devices: 1, precision: bf16-mixed, activation_checkpointing: true}
YAML
step fit 240 python3 -m streamrl.cli.main fit --config "$OUT/fit.yaml" --no-progress
step edges 90 python3 scripts/gpu_edges_check.py "$OUT/qwen0.5b" "$OUT/edges"
step bench-memory 120 python3 -m streamrl.cli.main bench memory --shape 0.5b --seq 4096 \
  --device cuda --timeout-s 50
if python3 -c "import vllm" 2> /dev/null; then
  step vllm 100 python3 scripts/gpu_vllm_check.py "$OUT/qwen0.5b" "$OUT/vllm"
else
  echo "vllm is not installed on this machine" > "$OUT/vllm.log"; echo "127 0" > "$OUT/vllm.status"
fi

python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])

def last_json(name):
    path = out / f"{name}.out"
    lines = [l for l in path.read_text().splitlines() if l.startswith("{")] if path.is_file() else []
    return json.loads(lines[-1]) if lines else None

def status(name):
    path = out / f"{name}.status"
    rc, seconds = path.read_text().split() if path.is_file() else ("-1", "0")
    log = out / f"{name}.log"
    tail = log.read_text().strip().splitlines()[-3:] if log.is_file() else []
    return {"rc": int(rc), "wall_s": int(seconds), "log_tail": tail}

fit, memory = last_json("fit"), last_json("bench-memory")
trainer = (fit or {}).get("trainer", {})
result = {
    "env": json.loads((out / "env.json").read_text() or "{}"),
    "gpu_tests": status("gpu-tests"),
    "model": {**status("model"), "result": last_json("model")},
    "fit": {**status("fit"),
            "trainer_peak_gpu_bytes": trainer.get("peak_memory_bytes_per_rank"),
            "samples_per_s": (fit or {}).get("samples_per_s"),
            "train_wall_s": (fit or {}).get("train_wall_s"),
            "samples_trained": (fit or {}).get("samples_trained"),
            "samples_lost": (fit or {}).get("samples_lost"),
            "sync_exposed_s_total": (fit or {}).get("sync_exposed_s_total"),
            "sync_transfer_s_total": (fit or {}).get("sync_transfer_s_total"),
            "eval_wall_s": (fit or {}).get("eval_wall_s"),
            "policy_saved": (out / "fit" / "policy" / "model.safetensors").is_file()},
    "edges": {**status("edges"), "result": last_json("edges")},
    "bench_memory": {**status("bench-memory"),
                     "cases": [{k: c.get(k) for k in ("path", "seq", "peak_bytes", "tokens_per_s",
                                                      "logprob_extra_bytes", "oom")}
                               for c in (memory or {}).get("cases", [])]},
    "vllm": {**status("vllm"), "result": last_json("vllm")},
}
(out / "gpu_check.json").write_text(json.dumps(result, indent=1))
print(json.dumps(result))
PY
