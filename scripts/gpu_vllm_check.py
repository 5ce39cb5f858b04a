"""vLLM on the GPU in bfloat16, fed by a trainer on the same GPU: a step of scripts/gpu_check.sh.

A generation service with one vLLM instance (the checkpoint saved in bfloat16, so the engine and
the wire run bfloat16; ``gpu_memory_utilization`` bounded, the trainer's copy of the policy on the
same GPU), three weight versions pushed from the trainer (staged from the GPU into host buffers,
received into the instance's shared staging, loaded by vLLM's worker), and after each load the
greedy samples' log-probs compared with the trainer's own for the weights as they travelled
(rounded to bfloat16) and for the previous version (far off if the load took). Prints one JSON.

    python scripts/gpu_vllm_check.py MODEL_DIR OUT_DIR [--device cuda|cpu]

``--device cpu`` runs the same on vLLM's CPU build (a smoke test of this script: ``make
test-vllm``'s virtualenv, a small model).
"""

from __future__ import annotations

import argparse
import json
import time
from copy import deepcopy
from pathlib import Path

import torch

from streamrl.components.generation.engines import VLLMEngine
from streamrl.components.generation.service import StreamGenerationService
from streamrl.policy.models import load_policy, save_policy
from streamrl.records import Request


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--versions", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()

    policy, tokenizer = load_policy(args.model_dir, dtype=torch.bfloat16)
    checkpoint = save_policy(policy, tokenizer, Path(args.out_dir) / "policy-bf16")
    policy = policy.float().to(args.device).eval()  # the trainer's copy, float32
    options: dict = dict(enforce_eager=True)
    if args.device == "cuda":
        options["gpu_memory_utilization"] = 0.3
    service = StreamGenerationService(
        checkpoint,
        1,
        engine=VLLMEngine(options=options),
        max_batch_size=8,
        greedy=True,
        gpus_per_instance=1 if args.device == "cuda" else 0,
        gpu_ids=[0] if args.device == "cuda" else None,
    )
    prompts = [tokenizer(f"copy {'ab' * (i + 1)}=")["input_ids"] for i in range(8)]
    versions = []
    with service:
        for version in range(1, args.versions + 1):
            previous = _rounded(policy)
            with torch.no_grad():
                for p in policy.parameters():
                    p.add_(torch.randn_like(p) * 0.02)
            started = time.perf_counter()
            service.update(policy, version=version)
            update_s = time.perf_counter() - started
            requests = [
                Request(
                    f"v{version}-{i}",
                    ids,
                    args.tokens,
                    iteration=version,
                    forced_length=args.tokens,
                )
                for i, ids in enumerate(prompts)
            ]
            started = time.perf_counter()
            samples = list(service.generate(requests))
            generate_s = time.perf_counter() - started
            sent = _rounded(policy)
            gaps = [_gap(sent, s, tokenizer) for s in samples]
            stale = [_gap(previous, s, tokenizer) for s in samples]
            versions.append(
                {
                    "version": version,
                    "update_s": round(update_s, 3),
                    "tokens_per_s": round(len(samples) * args.tokens / generate_s, 1),
                    "samples_at_version": sum(s.weight_version == version for s in samples),
                    "gap_max": round(max(gaps), 4),
                    "stale_gap_min": round(min(stale), 4),
                }
            )
        sync = service.weight_sync
        result = {
            "device": args.device,
            "wire_dtype": str(sync.dtype),
            "bytes_per_version": sync.staged.nbytes,
            "versions": versions,
            "ok": all(
                v["gap_max"] < v["stale_gap_min"] and v["samples_at_version"] == 8 for v in versions
            ),
        }
    if args.device == "cuda":
        result["trainer_peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
    print(json.dumps(result))


def _rounded(policy: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``policy`` with its weights rounded to bfloat16 (as they travel)."""
    copy = deepcopy(policy)
    with torch.no_grad():
        for p in copy.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return copy


def _gap(model: torch.nn.Module, sample, tokenizer) -> float:
    """The largest gap between the sample's log-probs and ``model``'s for the same tokens."""
    device = next(model.parameters()).device
    ids = torch.tensor([sample.prompt_ids + sample.token_ids], device=device)
    with torch.no_grad():
        logits = model(ids).logits[0, len(sample.prompt_ids) - 1 : -1].float()
    logits[:, tokenizer.eos_token_id] = float("-inf")  # masked while a forced length runs
    expected = torch.log_softmax(logits, -1).gather(1, ids[0, len(sample.prompt_ids) :, None])[:, 0]
    return float((torch.tensor(sample.logprobs, device=device) - expected).abs().max())


if __name__ == "__main__":
    main()
