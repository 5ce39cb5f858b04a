"""Python, NumPy and torch random states as plain values and tensors, so checkpoints that hold
them load with ``torch.load(weights_only=True)``."""

from __future__ import annotations

import random

import numpy as np
import torch


def rng_state() -> dict:
    """Random states as plain values and tensors (checkpoints load with ``weights_only``)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)],
    }


def set_rng_state(state: dict) -> None:
    """Restore what ``rng_state`` returned."""
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
