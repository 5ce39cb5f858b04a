"""Seconds to load one weight version into a vLLM engine, old path beside new (vLLM's CPU build).

At a real shape (``--size 0.5b``: Qwen2.5-0.5B, random weights, saved in bfloat16 so the
engine and the staging run bfloat16), each case in a fresh process, ``--repeats`` loads each,
the median reported:

- ``old-iterator``: what ``VLLMStreamGenerator.load_weights`` did before: an iterator of the
  staging's views handed to ``reload_weights`` through ``collective_rpc`` in the instance's own
  process (one rank only: an iterator cannot reach another process);
- ``staging-tp1``: the shared-file staging, mapped once by vLLM's worker, loaded on one order;
- ``staging-tp2``: the same with ``tensor_parallel_size=2``: two worker processes, each loading
  its shard from the same mapped files.

    .venv-vllm/bin/python benchmarks/vllm_load.py --size 0.5b --repeats 3

Last line: one JSON object, ``{"cases": [{"case", "tensor_parallel", "load_s", "loads"}...]}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = {"old-iterator": 1, "staging-tp1": 1, "staging-tp2": 2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="0.5b", choices=["demo", "0.5b"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--case", choices=list(CASES), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        print(json.dumps(_measure(args.model, args.case, args.repeats)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        model = _bf16_policy(args.size, Path(tmp))
        cases = []
        for case in CASES:  # each in a fresh process: one engine at a time
            run = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--case",
                    case,
                    "--model",
                    str(model),
                    "--repeats",
                    str(args.repeats),
                ],
                capture_output=True,
                text=True,
                check=False,
                timeout=900,
            )
            if run.returncode != 0:
                raise SystemExit(f"{case} failed:\n{run.stderr[-3000:]}")
            cases.append(json.loads(run.stdout.strip().splitlines()[-1]))
            print(f"{case}: {cases[-1]['load_s']:.3f} s per version", file=sys.stderr)
    print(json.dumps({"size": args.size, "cases": cases}))


def _bf16_policy(size: str, folder: Path) -> Path:
    import torch

    from streamrl.policy.models import load_policy, save_policy, write_random_policy

    fp32 = write_random_policy(folder / "fp32", size, context=256)
    policy, tokenizer = load_policy(fp32, dtype=torch.bfloat16)
    return save_policy(policy, tokenizer, folder / "bf16")


def _measure(model: str, case: str, repeats: int) -> dict:
    import torch

    from streamrl.components.generation.vllm_generator import VLLMStreamGenerator
    from streamrl.components.generation.vllm_worker import reprocess_lm_heads

    ranks = CASES[case]
    gen = VLLMStreamGenerator(
        model,
        max_batch_size=2,
        tensor_parallel_size=ranks,
        max_model_len=256,
        kv_cache_memory_bytes=64 << 20,
    )
    try:
        staging = gen.weight_staging()
        with torch.no_grad():
            for _, view in staging.named():
                view.normal_(0, 0.02)
        loads = []
        for version in range(1, repeats + 1):
            started = time.perf_counter()
            if case == "old-iterator":
                gen._engine.collective_rpc(
                    "reload_weights",
                    kwargs=dict(weights_iterator=iter(staging.named()), is_checkpoint_format=True),
                )
                gen._engine.apply_model(reprocess_lm_heads)
            else:
                gen.load_weights(dict(staging.named()), version)
            loads.append(time.perf_counter() - started)
    finally:
        gen.close()
    return {
        "case": case,
        "tensor_parallel": ranks,
        "load_s": statistics.median(loads),
        "loads": [round(x, 3) for x in loads],
        "bytes": staging.nbytes,
    }


if __name__ == "__main__":
    main()
