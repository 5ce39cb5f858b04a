"""Measure ``PTL(BS)`` of the real generator backend (StreamRL §5.1, Fig. 6-right).

The latency model is fitted from the backend that will run, never assumed: for each batch size
the profiler decodes that many sequences at a forced length and divides the time by the length.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from streamrl.components.generation.hf_generator import HFStreamGenerator
from streamrl.components.skewness.latency import LatencyModel
from streamrl.records import Request


class Profiler:
    """Times decode steps of an ``HFStreamGenerator`` at several batch sizes.

    Args:
        model: the policy, as the generator instances will run it.
        prompt_ids: the prompt every profiled sequence starts from.
        tokens: forced output length per sequence (prefill is amortised over it).
        repeats: runs per batch size; the median is kept.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        prompt_ids: Sequence[int],
        *,
        tokens: int = 32,
        repeats: int = 3,
    ) -> None:
        self.model, self.prompt_ids = model, list(prompt_ids)
        self.tokens, self.repeats = tokens, repeats

    def measure(self, batch_size: int) -> float:
        """Median seconds per decode step with ``batch_size`` sequences running."""
        times = []
        for _ in range(self.repeats):
            generator = HFStreamGenerator(self.model, max_batch_size=batch_size, greedy=True)
            generator.submit(
                Request(f"p{i}", self.prompt_ids, self.tokens, forced_length=self.tokens)
                for i in range(batch_size)
            )
            started = time.perf_counter()
            for _ in generator.stream():
                pass
            times.append((time.perf_counter() - started) / self.tokens)
        return statistics.median(times)

    def fit(self, batch_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64)) -> LatencyModel:
        """A ``LatencyModel`` from measurements at ``batch_sizes`` (one torch thread)."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as in a generator instance
        try:
            sizes = sorted(set(batch_sizes))
            return LatencyModel(sizes, [self.measure(b) for b in sizes])
        finally:
            torch.set_num_threads(threads)
