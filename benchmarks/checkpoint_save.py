"""Memory and seconds to write one run checkpoint, Lightning's writer beside ours.

At a real shape (``--size 0.5b``: Qwen2.5-0.5B, random float32 weights and AdamW states after
one real step, about 5.9 GB of tensors), each case in a fresh process:

- ``lightning``: ``TorchCheckpointIO`` (Lightning 2.x's default): ``torch.save`` into an
  in-memory buffer, then the buffer's bytes written through fsspec;
- ``atomic``: ``streamrl.training.checkpointing.AtomicCheckpointIO``: ``torch.save`` streamed to a
  partial file, fsync, rename.

Reported per case: the process's resident memory before the save, its peak (``VmHWM``) after,
the difference (what the save itself costs), and the seconds the save took.

    .venv/bin/python benchmarks/checkpoint_save.py --size 0.5b

Last line: one JSON object, ``{"cases": [{"case", "rss_before_gb", "peak_gb", "save_extra_gb",
"save_s", "file_gb"}...]}``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = ("lightning", "atomic")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="0.5b", choices=["demo", "0.5b"])
    parser.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        print(json.dumps(_case(args.case, args.size, Path(args.out))))
        return
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in CASES:
            command = [sys.executable, __file__, "--size", args.size, "--case", case]
            out = subprocess.run(
                [*command, "--out", str(Path(tmp) / f"{case}.ckpt")],
                capture_output=True,
                text=True,
                check=True,
                timeout=1800,
            ).stdout
            results.append(json.loads(out.strip().splitlines()[-1]))
            print(json.dumps(results[-1]), file=sys.stderr)
    print(json.dumps({"size": args.size, "cases": results}))


def _case(case: str, size: str, out: Path) -> dict:
    import torch
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    from streamrl.policy.models import build_tiny_model, build_tokenizer
    from streamrl.runtime.peak_memory import peak_memory_bytes
    from streamrl.training.checkpointing import AtomicCheckpointIO

    model = build_tiny_model(build_tokenizer(), size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    for p in model.parameters():  # one real step: the AdamW states hold real values
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    checkpoint = {
        "state_dict": model.state_dict(),
        "optimizer_states": [optimizer.state_dict()],
        "global_step": 1,
    }
    before = _rss_bytes()
    Path("/proc/self/clear_refs").write_text("5")  # the peak from here on: the save's own
    writer = TorchCheckpointIO() if case == "lightning" else AtomicCheckpointIO()
    started = time.perf_counter()
    writer.save_checkpoint(checkpoint, out)
    seconds = time.perf_counter() - started
    peak = peak_memory_bytes()
    gb = 1024**3
    return {
        "case": case,
        "rss_before_gb": round(before / gb, 2),
        "peak_gb": round(peak / gb, 2),
        "save_extra_gb": round((peak - before) / gb, 2),
        "save_s": round(seconds, 1),
        "file_gb": round(out.stat().st_size / gb, 2),
    }


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


if __name__ == "__main__":
    main()
