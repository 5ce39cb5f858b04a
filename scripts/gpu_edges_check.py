"""A trainer's edges on one GPU (scripts/gpu_check.sh): the sharded load, the frozen reference in
bf16, the save, on NCCL.

    python3 scripts/gpu_edges_check.py MODEL_DIR OUT_DIR

One process, a one-rank process group with the backend a GPU run uses ("cpu:gloo,cuda:nccl"):
the policy built on the meta device, sharded with FSDP2 (bf16-mixed) on cuda:0 and filled from
MODEL_DIR by torch.distributed.checkpoint's reader; compared with `from_pretrained` on the GPU,
tensor by tensor; a bf16 KL reference read the same way; the policy written back tensor by tensor
(bf16) and read again. Prints one JSON object: each check, the GPU memory each phase allocated at
its peak, and the seconds.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main(model_dir: str, out: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from streamrl.components.training.reference import reference_policy
    from streamrl.components.training.sharding import shard_model
    from streamrl.policy.model_dir import empty_model, materialize
    from streamrl.training.fsdp import process_group_backend
    from streamrl.training.policy_save import save_policy_shards

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29531", RANK="0", WORLD_SIZE="1")
    backend = process_group_backend("cuda")
    dist.init_process_group(backend, rank=0, world_size=1)
    torch.cuda.set_device(0)
    result: dict = {"backend": backend}
    started = time.perf_counter()
    mesh = init_device_mesh("cuda", (1,))
    policy = empty_model(model_dir, torch.float32)
    reference = reference_policy(policy, True, "bf16-mixed")
    shard_model(policy, mesh, precision="bf16-mixed")
    reference.shard(mesh)
    torch.cuda.reset_peak_memory_stats()
    materialize(policy, model_dir, "cuda")
    reference.place(torch.device("cuda"))
    result["load_s"] = round(time.perf_counter() - started, 2)
    result["load_peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
    params = sum(p.numel() for p in policy.parameters())
    result["fp32_policy_plus_bf16_reference_bytes"] = params * (4 + 2)
    expected = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda()
    same = all(
        torch.equal(p.full_tensor(), dict(expected.named_parameters())[n])
        for n, p in policy.named_parameters()
    )
    ref_dtypes = sorted({str(p.dtype) for p in reference.model.parameters()})
    result.update(policy_equals_from_pretrained=same, reference_dtypes=ref_dtypes)
    del expected
    torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    saved = save_policy_shards(policy, Path(out) / "policy", dtype=torch.bfloat16)
    result["save_s"] = round(time.perf_counter() - started, 2)
    result["save_peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
    loaded = dict(AutoModelForCausalLM.from_pretrained(saved).named_parameters())
    result["saved_equals_bf16_policy"] = all(
        torch.equal(loaded[n], p.full_tensor().to(torch.bfloat16).cpu())
        for n, p in policy.named_parameters()
    )
    dist.destroy_process_group()
    result["ok"] = bool(
        same and result["saved_equals_bf16_policy"] and ref_dtypes == ["torch.bfloat16"]
    )
    return result


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
