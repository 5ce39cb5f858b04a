"""Measure ``PTL(BS)`` of the real generator backend (StreamRL §5.1, Fig. 6-right).

The latency model is fitted from the backend that will run, never assumed: for each batch size
the profiler decodes that many sequences at a forced length and divides the time by the length.
``Profiler.fit_grid`` also varies the context each row holds (issue 47): at each batch size and
context it admits every row at once, times the generator's first step (the batched prefill and
one token) and then each decode step on its own; ``LatencyModel.fit`` then prices a step from
its batch size and its rows' contexts, and a prefill from its tokens.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from typing import Literal

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
        runs = (self._run(batch_size, self.prompt_ids, self.tokens) for _ in range(self.repeats))
        return statistics.median(runs) / self.tokens

    def _run(self, batch_size: int, prompt: Sequence[int], tokens: int) -> float:
        """Seconds to prefill ``batch_size`` copies of ``prompt`` and decode ``tokens`` each."""
        generator = HFStreamGenerator(self.model, max_batch_size=batch_size, greedy=True)
        generator.submit(
            Request(f"p{i}", list(prompt), tokens, forced_length=tokens) for i in range(batch_size)
        )
        started = time.perf_counter()
        for _ in generator.stream():
            pass
        return time.perf_counter() - started

    def step_and_prefill(self, batch_size: int, context: int) -> tuple[float, float]:
        """Median seconds of one decode step and of the prefill, with ``batch_size`` rows whose
        prompts hold ``context`` tokens (the profiling prompt repeated), all admitted at once."""
        prompt = (self.prompt_ids * math.ceil(context / len(self.prompt_ids)))[:context]
        steps, prefills = [], []
        for _ in range(self.repeats):
            generator = HFStreamGenerator(self.model, max_batch_size=batch_size, greedy=True)
            length = 1 + self.tokens
            generator.submit(
                Request(f"p{i}", prompt, length, forced_length=length) for i in range(batch_size)
            )
            started = time.perf_counter()
            generator.step()  # every row admitted: one batched prefill, then the first token
            first = time.perf_counter() - started
            times = []
            for _ in range(self.tokens):
                started = time.perf_counter()
                generator.step()
                times.append(time.perf_counter() - started)
            steps.append(statistics.median(times))
            prefills.append(max(0.0, first - steps[-1]))
        return statistics.median(steps), statistics.median(prefills)

    def fit_grid(
        self,
        batch_sizes: Sequence[int],
        contexts: Sequence[int],
        load: Literal["widest", "total"] = "widest",
    ) -> tuple[LatencyModel, list[dict[str, float]]]:
        """A ``LatencyModel`` of batch size and context from timings over the grid of
        ``batch_sizes`` x ``contexts`` (one torch thread), and the grid as timed: each cell's
        measured and modelled step, and its prefill. A step's rows hold their prompt and, on
        average, half the timed tokens."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as in a generator instance
        try:
            cells = []
            for batch in sorted(set(batch_sizes)):
                for context in sorted(set(contexts)):
                    step, prefill = self.step_and_prefill(batch, context)
                    cells.append({"batch": batch, "context": context, "step_s": step})
                    cells[-1]["prefill_s"] = prefill
        finally:
            torch.set_num_threads(threads)
        middle = 1 + self.tokens // 2  # the tokens a row holds past its prompt, on average
        steps = [([c["context"] + middle] * c["batch"], c["step_s"]) for c in cells]
        prefills = [(c["batch"] * c["context"], c["prefill_s"]) for c in cells]
        model = LatencyModel.fit(
            steps, prefills, load=load, profiled_context=min(contexts) + middle
        )
        for cell, (rows, _) in zip(cells, steps, strict=True):
            cell["model_s"] = model.step_s(rows)
        return model, cells

    def fit(self, batch_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64)) -> LatencyModel:
        """A ``LatencyModel`` from measurements at ``batch_sizes`` (one torch thread)."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as in a generator instance
        try:
            sizes = sorted(set(batch_sizes))
            return LatencyModel(sizes, [self.measure(b) for b in sizes])
        finally:
            torch.set_num_threads(threads)
