"""Where a real run's speed goes between runs: the machine's cores alone and in pairs, beside
the pipeline itself, in rounds.

Each round times (1) a 256x256 matmul loop in one process alone, (2) the same loop in two
processes at once (one per core), then (3) one real run of ``sim validate``'s calibration
configuration (``streamrl bench pipeline --modes sync`` at its defaults). On a VM whose two
vCPUs the host sometimes runs on one physical core, (2) drops while (1) does not; a run of the
pipeline, two busy processes or more, slows with it. One JSON line per round on stdout.

    python scripts/machine_drift.py --rounds 8
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import tempfile
import time
from pathlib import Path


def matmuls_per_s(seconds: float, out: mp.Queue | None = None) -> float:
    """A one-thread matmul loop's rate over ``seconds`` (put on ``out`` too, if given)."""
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    started, n = time.perf_counter(), 0
    while time.perf_counter() - started < seconds:
        a @ b
        n += 1
    rate = n / (time.perf_counter() - started)
    if out is not None:
        out.put(rate)
    return rate


def pair(seconds: float) -> list[float]:
    """Two loops at once, in two processes."""
    out: mp.Queue = mp.Queue()
    procs = [mp.Process(target=matmuls_per_s, args=(seconds, out)) for _ in range(2)]
    for p in procs:
        p.start()
    rates = [out.get(timeout=seconds + 60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=4.0, help="per matmul probe")
    args = parser.parse_args()
    from streamrl.bench import model_dir_for
    from streamrl.sim.bench_rows import CALIBRATION
    from streamrl.sim.validate import run_real

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = model_dir_for("tiny", Path(tmp), 0)
        for round_ in range(args.rounds):
            alone = matmuls_per_s(args.seconds)
            both = pair(args.seconds)
            run = run_real(CALIBRATION, model_dir, iterations=6, warmup=1)
            line = {
                "round": round_,
                "alone_per_s": round(alone),
                "pair_per_s": [round(r) for r in both],
                "pair_over_alone": round(min(both) / alone, 3),
                "run_samples_per_s": round(run["samples_per_s"], 1),
                "run_gen_s": round(run["gen_s"], 3),
                "run_train_s": round(run["train_s"], 3),
            }
            print(json.dumps(line), flush=True)


if __name__ == "__main__":  # the pair and the run's generators are spawned processes
    mp.set_start_method("spawn", force=True)
    main()
