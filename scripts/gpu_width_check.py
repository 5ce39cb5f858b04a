"""The trainer's step at a 7B width against the memory model: a step of scripts/gpu_check.sh.

    python scripts/gpu_width_check.py [--device cuda|cpu]

Qwen2.5-7B's width (hidden 3584, 28 heads, 4 key/value heads, vocabulary 151,936) with two decoder
layers: one training step of the trainer as it is (FSDP2 on one rank, bf16-mixed, every layer
checkpointed, packed rows, chunked log-probs, AdamW), in a fresh process
(``streamrl bench memory``'s ``new`` path), on 4,160 tokens. Its peak allocated GPU memory is
compared with the memory model's estimate for the same shape and tokens
(``capacity.memory.trainer_memory``, less its runtime reserve, which the allocator does not see):
ok when measured <= estimated. ``--device cpu`` runs a small width (the step runs; the peak is
the process's resident set, not comparable) for the script's own test. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json

from streamrl.bench.memory import MemoryCase, model_shape, run_case
from streamrl.components.capacity.memory import RUNTIME_RESERVE_BYTES, ModelShape, trainer_memory

#: The 7B width, two layers (cuda); a small width for the CPU.
WIDTHS = {
    "cuda": dict(
        hidden_size=3584, num_hidden_layers=2, num_attention_heads=28, num_key_value_heads=4
    ),
    "cpu": dict(
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=4096,
    ),
}
SEQ = {"cuda": 4096, "cpu": 192}


def main(device: str) -> dict:
    shape = model_shape("0.5b", **WIDTHS[device])
    case = MemoryCase("new", seq=SEQ[device], shape=shape, device=device)
    measured = run_case(case, timeout_s=120.0)
    model = ModelShape(
        hidden=shape["hidden_size"],
        layers=shape["num_hidden_layers"],
        heads=shape["num_attention_heads"],
        kv_heads=shape["num_key_value_heads"],
        head_dim=shape["hidden_size"] // shape["num_attention_heads"],
        intermediate=shape["intermediate_size"],
        vocab=shape["vocab_size"],
        tied=True,  # the bench's shapes tie the embeddings
    )
    tokens = case.batch * (case.prompt + case.seq)
    estimate = trainer_memory(model, 1, tokens, activation_checkpointing=True)
    allocated = estimate.total - RUNTIME_RESERVE_BYTES
    peak = measured.get("peak_bytes")
    result = {
        "device": device,
        "shape": shape,
        "tokens": tokens,
        "measured_peak_bytes": peak,
        "estimated_bytes": allocated,
        "estimate_rows": estimate.rows(),
        "measured_over_estimated": round(peak / allocated, 3) if peak else None,
        "step_s": measured.get("step_s"),
        "oom": measured.get("oom"),
    }
    finished = peak is not None and not measured.get("oom") and "error" not in measured
    result["ok"] = finished and (device == "cpu" or peak <= allocated)
    if "error" in measured:
        result["error"] = str(measured["error"])[-300:]
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    print(json.dumps(main(parser.parse_args().device)))
