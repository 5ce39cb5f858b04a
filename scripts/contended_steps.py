"""Decode steps of 64 rows at narrow and wide contexts, alone and beside another process decoding.

Does a generator instance's step slow down more at a wide context than at a narrow one when a
second instance decodes beside it on the other core (docs/skewness.md, "Where each plan put the
work")? Each figure is the median of 3 timed steps of the tiny policy (``Profiler``, one torch
thread, as in a generator instance).

Run: python scripts/contended_steps.py   (about 1 min on 2 cores; nothing else running)
"""

import multiprocessing as mp
import tempfile
import time
from pathlib import Path

import torch

from streamrl.bench.dispatch import PROFILE_PROMPT, PROFILE_TOKENS
from streamrl.bench.inputs import model_dir_for
from streamrl.components.skewness.profiler import Profiler
from streamrl.policy.models import load_policy

ROWS, CONTEXTS, NEIGHBOUR_CONTEXTS = 64, (16, 320, 860), (16, 860)


def profiler(model_dir: Path) -> Profiler:
    policy, _ = load_policy(model_dir)
    return Profiler(policy, PROFILE_PROMPT, tokens=PROFILE_TOKENS, repeats=1)


def neighbour(model_dir: Path, context: int, stop) -> None:
    """Another instance: decode steps of ``ROWS`` rows at ``context`` until ``stop``."""
    torch.set_num_threads(1)
    timed = profiler(model_dir)
    while not stop.is_set():
        timed.step_and_prefill(ROWS, context)


def steps_ms(timed: Profiler) -> dict[int, float]:
    return {
        c: 1e3 * sorted(timed.step_and_prefill(ROWS, c)[0] for _ in range(3))[1] for c in CONTEXTS
    }


if __name__ == "__main__":
    torch.set_num_threads(1)
    spawn = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = model_dir_for("tiny", Path(tmp), 0, context=max(CONTEXTS) + 2 * PROFILE_TOKENS)
        timed = profiler(model_dir)
        alone = steps_ms(timed)
        print(f"alone: {', '.join(f'{c} tokens {ms:.2f} ms' for c, ms in alone.items())}")
        for context in NEIGHBOUR_CONTEXTS:
            stop = spawn.Event()
            other = spawn.Process(target=neighbour, args=(model_dir, context, stop), daemon=True)
            other.start()
            try:
                time.sleep(10.0)  # it imports and reaches its loop
                beside = steps_ms(timed)
            finally:
                stop.set()
                other.join(timeout=30)
                if other.is_alive():
                    other.kill()
            print(
                f"beside {ROWS} rows at {context}: "
                + ", ".join(
                    f"{c} tokens {ms:.2f} ms (x{ms / alone[c]:.2f})" for c, ms in beside.items()
                )
            )
