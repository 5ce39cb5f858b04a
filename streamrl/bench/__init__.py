"""Benchmarks behind ``streamrl bench ...``: medians over repeats, baseline in the same run."""

from __future__ import annotations

from streamrl.bench.inputs import BUILT_IN, load_lengths, model_dir_for

__all__ = ["BUILT_IN", "load_lengths", "model_dir_for"]
