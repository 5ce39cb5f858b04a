"""The weight sync's GPU path on an HF instance, checked by checksum: a step of
scripts/gpu_check.sh.

    python scripts/gpu_weights_check.py MODEL_DIR [--device cuda|cpu]

The trainer's copy of the policy on the device (float32, as FSDP's masters), a generation service
with one HF-engine instance on the same device in bfloat16 (cuda; float32 on the CPU); each of two
versions is changed on the device, staged bucket by bucket in the wire dtype, received into the
instance's staging and loaded onto its parameters. After each, the instance's fingerprint (a hash
of every parameter's bytes) must equal that of the trainer's weights cast to the wire dtype, and
differ from the version before. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time
from copy import deepcopy

import torch

from streamrl.components.generation.engines import HFEngine
from streamrl.components.generation.hf_weights import fingerprint
from streamrl.components.generation.service import StreamGenerationService
from streamrl.policy.models import load_policy


def main(model_dir: str, device: str) -> dict:
    wire = torch.bfloat16 if device == "cuda" else torch.float32
    policy, _ = load_policy(model_dir, torch.float32, device)
    gpus = 1 if device == "cuda" else 0
    result: dict = {"device": device, "wire_dtype": str(wire), "versions": []}
    engine = HFEngine(dtype=str(wire).removeprefix("torch."))
    with StreamGenerationService(
        model_dir,
        1,
        engine=engine,
        gpus_per_instance=gpus,
        gpu_ids=[0] if gpus else None,  # the trainer's GPU: the instance shares it
        trainer_device=device,
    ) as service:
        before = set(service.fingerprints().values())
        for version in (1, 2):
            with torch.no_grad():
                for p in policy.parameters():
                    p.add_(torch.randn_like(p) * 0.01)
            started = time.perf_counter()
            service.update(policy, version=version)
            seconds = time.perf_counter() - started
            expected = fingerprint(deepcopy(policy).to(device="cpu", dtype=wire))
            held = set(service.fingerprints().values())
            result["versions"].append(
                {
                    "version": version,
                    "s": round(seconds, 3),
                    "match": held == {expected},
                    "changed": held != before,
                }
            )
            before = held
    result["ok"] = all(v["match"] and v["changed"] for v in result["versions"])
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = parser.parse_args()
    print(json.dumps(main(args.model_dir, args.device)))
