"""The generation latency model of StreamRL §5.1 (Eq. 1 and 2) and a batching simulator.

``PTL(BS)`` is the per-token decode latency at batch size ``BS``, measured on the real backend
(``streamrl.components.skewness.profiler``) or taken from the paper's table. With it:

- Eq. 1: sample latency = ``PTL(BS) x L``;
- Eq. 2: instance latency = ``PTL(BS) x L_avg x ceil(M / BS)`` for ``M`` samples on one instance.

``PTL(BS)`` is profiled on short prompts, but a decode step also reads every cached token its
attention spans: on the HF engine's rectangular slot cache every row pays for the widest one
(``B x W``), on paged attention (vLLM) the step pays for the tokens cached (the sum of the
contexts). ``LatencyModel.step_s`` prices a step from its batch's contexts with one more term,
seconds per token of that load beyond the profiled context, and ``prefill_s`` a prefill from its
tokens; ``LatencyModel.fit`` recovers both from timed steps and prefills. A model without them
(an old ``PTL(BS)`` table) prices every step at ``PTL(BS)``. ``decode_s`` prices a run of steps
whose rows grow a token a step, in closed form: Eq. 2 (``instance_latency``), the makespan floor,
the batching replay (``streamrl.components.skewness.batching``) and the simulator all price a
span with it, so every planner sees what context costs.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Literal

import numpy as np

from streamrl.runtime.atomic_files import write_text_atomic

#: PTL of a 7B model on one H800 with vLLM, read off the paper's Fig. 6 (ms per token).
PAPER_7B_H800_MS = {
    1: 8.3,
    2: 8.6,
    4: 8.9,
    8: 9.0,
    16: 9.4,
    32: 10.2,
    64: 11.7,
    128: 15.2,
    256: 21.2,
    512: 37.0,
}


@dataclass
class LatencyModel:
    """Per-token decode latency as a function of batch size, from measured points.

    Between measured batch sizes ``ptl`` interpolates linearly; above the largest it extends the
    last segment; below the smallest it holds the first value.

    Attributes:
        batch_sizes: measured batch sizes, ascending.
        ptl_s: seconds per decode step at each of them, with every row at ``profiled_context``.
        context_s: seconds a decode step costs per token of its context load beyond the
            profiled one (0: ``PTL(BS)`` alone, as the paper's model).
        load: the statistic of a batch's contexts a step pays for: ``"widest"`` (batch size x
            the widest row: a rectangular slot cache, the HF engine) or ``"total"`` (the tokens
            cached: paged attention, vLLM).
        profiled_context: the tokens each row held when ``ptl_s`` was measured.
        prefill_base_s / prefill_token_s: a prefill's fixed cost and its cost per prompt token.

    Examples:
        >>> model = LatencyModel([1, 4], [0.010, 0.016])
        >>> round(model.ptl(2), 4), round(model.instance_latency(8, 100, 4), 2)
        (0.012, 3.2)
    """

    batch_sizes: list[int]
    ptl_s: list[float]
    context_s: float = 0.0
    load: Literal["widest", "total"] = "widest"
    profiled_context: float = 0.0
    prefill_base_s: float = 0.0
    prefill_token_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.batch_sizes or len(self.batch_sizes) != len(self.ptl_s):
            raise ValueError("LatencyModel: need one PTL per batch size, at least one point.")
        if sorted(self.batch_sizes) != list(self.batch_sizes) or min(self.batch_sizes) < 1:
            raise ValueError("LatencyModel: batch sizes must be ascending and >= 1.")
        if self.load not in ("widest", "total"):
            raise ValueError(f"LatencyModel: load is 'widest' or 'total', got {self.load!r}.")
        if min(self.context_s, self.prefill_base_s, self.prefill_token_s) < 0:
            raise ValueError("LatencyModel: a cost per token cannot be negative.")

    @classmethod
    def from_table_ms(cls, table: dict[int, float]) -> LatencyModel:
        """From ``{batch_size: milliseconds per token}``."""
        sizes = sorted(table)
        return cls(sizes, [table[b] / 1000 for b in sizes])

    def update_from(self, other: LatencyModel) -> None:
        """Take ``other``'s points and costs, in place: whoever holds this model (the
        dispatcher, the elastic controller) plans with them from now on."""
        for field in fields(self):
            value = getattr(other, field.name)
            setattr(self, field.name, list(value) if isinstance(value, list) else value)

    @property
    def prices_context(self) -> bool:
        """Whether a step's or a prefill's cost depends on the tokens its rows hold (then equal
        predicted tokens are not equal time)."""
        return self.context_s > 0 or self.prefill_token_s > 0

    def ptl(self, batch_size: float) -> float:
        """Seconds per decode step with ``batch_size`` running sequences."""
        sizes, values = self.batch_sizes, self.ptl_s
        if batch_size <= sizes[0] or len(sizes) == 1:
            return values[0]
        i = min(bisect.bisect_left(sizes, batch_size), len(sizes) - 1)
        (b0, v0), (b1, v1) = (sizes[i - 1], values[i - 1]), (sizes[i], values[i])
        return v0 + (v1 - v0) * (batch_size - b0) / (b1 - b0)

    def context_load(self, contexts: Sequence[int]) -> float:
        """The tokens a decode step over rows of ``contexts`` tokens reads, as this engine pays
        for them (``load``)."""
        if not contexts:
            return 0.0
        return len(contexts) * max(contexts) if self.load == "widest" else float(sum(contexts))

    def step_s(self, contexts: Sequence[int]) -> float:
        """Seconds of one decode step over rows holding ``contexts`` tokens each: ``PTL`` of
        their number, plus ``context_s`` per token of load beyond the profiled context.

        Examples:
            >>> model = LatencyModel([1, 4], [0.010, 0.016], context_s=1e-5, profiled_context=8)
            >>> round(model.step_s([8, 8, 8, 8]), 4), round(model.step_s([8, 8, 8, 108]), 4)
            (0.016, 0.02)
        """
        beyond = self.context_load(contexts) - len(contexts) * self.profiled_context
        return self.ptl(len(contexts)) + self.context_s * max(0.0, beyond)

    def prefill_s(self, prompts: Sequence[float]) -> float:
        """Seconds of one batched prefill of rows holding ``prompts`` tokens each (0 for
        none), paid for as the engine pays for a step's load: the HF engine pads every row to
        the widest (``"widest"``), paged attention reads the tokens themselves (``"total"``)."""
        if not prompts:
            return 0.0
        return self.prefill_base_s + self.prefill_token_s * self.context_load(prompts)

    def decode_s(self, contexts: Sequence[float], steps: float) -> float:
        """Seconds of ``steps`` decode steps over rows that start at ``contexts`` tokens and
        each grow by one a step (no row finishing on the way): ``step_s`` summed in closed
        form. Each step adds one token per row to either load, so the load beyond the profiled
        context is an arithmetic series, clamped at 0 while it is negative.

        Examples:
            >>> model = LatencyModel([1, 2], [0.010, 0.012], context_s=1e-4, load="total")
            >>> round(model.decode_s([10, 20], 3), 6)  # loads 30, 32, 34
            0.0456
        """
        return self.decode_load_s(len(contexts), self.context_load(contexts), steps)

    def decode_load_s(self, rows: int, load: float, steps: float) -> float:
        """``decode_s`` of ``rows`` rows whose first step's load (``context_load``) is
        ``load``: what a replay that keeps the load itself passes."""
        if rows == 0 or steps <= 0:
            return 0.0
        seconds = steps * self.ptl(rows)
        if self.context_s == 0:
            return seconds
        first = load - rows * self.profiled_context
        skipped = min(steps, max(0.0, math.ceil(-first / rows))) if first < 0 else 0.0
        counted = steps - skipped  # steps whose load is past the profiled one
        start = first + rows * skipped
        beyond = counted * start + rows * counted * (counted - 1) / 2
        return seconds + self.context_s * max(0.0, beyond)

    def steps_within(self, contexts: Sequence[float], seconds: float, most: float) -> float:
        """How many decode steps (at most ``most``) rows at ``contexts`` complete in
        ``seconds``: ``decode_s`` inverted (by bisection; exact when there is no context
        term)."""
        if seconds <= 0 or not contexts:
            return 0.0
        if self.context_s == 0:
            return min(most, seconds / self.ptl(len(contexts)))
        if self.decode_s(contexts, most) <= seconds:
            return most
        low, high = 0.0, most
        for _ in range(50):
            middle = (low + high) / 2
            low, high = (
                (middle, high) if self.decode_s(contexts, middle) <= seconds else (low, middle)
            )
        return low

    @classmethod
    def fit(
        cls,
        steps: Sequence[tuple[Sequence[int], float]],
        prefills: Sequence[tuple[int, float]] = (),
        *,
        load: Literal["widest", "total"] = "widest",
        profiled_context: float | None = None,
    ) -> LatencyModel:
        """The model that best explains timed decode steps and prefills (least squares).

        Each batch size gets its own ``PTL`` and every step shares one cost per token of load:
        ``seconds = PTL(b) + context_s x (load - b x profiled_context)``; a prefill is
        ``prefill_base_s + prefill_token_s x tokens``. A negative fitted cost (a load that does
        not slow the steps down, within noise) is taken as 0.

        Args:
            steps: ``(contexts, seconds)`` of each timed step: the tokens each of its rows held.
            prefills: ``(prompt tokens, seconds)`` of each timed prefill.
            load: the statistic the engine pays for (``"widest"``, ``"total"``).
            profiled_context: the context ``PTL(b)`` stands for; ``None``: the shortest row
                timed.
        """
        if not steps:
            raise ValueError("LatencyModel.fit: give at least one timed step.")
        sizes = sorted({len(contexts) for contexts, _ in steps})
        if sizes[0] < 1:
            raise ValueError("LatencyModel.fit: a step has at least one row.")
        if profiled_context is None:
            profiled_context = float(min(min(contexts) for contexts, _ in steps))
        probe = cls(sizes, [0.0] * len(sizes), load=load, profiled_context=profiled_context)
        seconds = np.array([s for _, s in steps], dtype=float)
        rows = np.zeros((len(steps), len(sizes) + 1))
        for i, (contexts, _) in enumerate(steps):
            rows[i, sizes.index(len(contexts))] = 1.0
            rows[i, -1] = probe.context_load(contexts) - len(contexts) * profiled_context
        solution = np.linalg.lstsq(rows, seconds, rcond=None)[0]
        if solution[-1] < 0:  # no measurable context cost: PTL(b) alone
            solution = [*np.linalg.lstsq(rows[:, :-1], seconds, rcond=None)[0].tolist(), 0.0]
        probe.ptl_s = [float(v) for v in solution[:-1]]
        probe.context_s = float(solution[-1])
        if prefills:
            tokens = np.array([[1.0, t] for t, _ in prefills])  # equal rows: either load
            base, per_token = np.linalg.lstsq(tokens, [s for _, s in prefills], rcond=None)[0]
            probe.prefill_base_s, probe.prefill_token_s = (
                max(0.0, float(base)),
                max(0.0, float(per_token)),
            )
        return probe

    def sample_latency(self, length: float, batch_size: float) -> float:
        """Eq. 1: ``PTL(BS) x L``."""
        return self.ptl(batch_size) * length

    def instance_latency(
        self, samples: int, avg_length: float, max_batch_size: int, prompt_tokens: float = 0.0
    ) -> float:
        """Eq. 2: ``PTL(BS) x L_avg x ceil(M / BS)`` with ``BS = min(M, max_batch_size)``, each
        of the ``ceil(M / BS)`` rounds priced with its contexts (``decode_s``: rows from
        ``prompt_tokens`` to ``prompt_tokens + L_avg``) and its prefill."""
        if samples <= 0:
            return 0.0
        batch = min(samples, max_batch_size)
        prompts = [prompt_tokens] * batch
        one_round = self.decode_s(prompts, avg_length) + self.prefill_s(prompts)
        return one_round * math.ceil(samples / batch)

    def makespan_floor(
        self,
        lengths: Sequence[int],
        instances: int,
        max_batch_size: int,
        prompts: Sequence[float] | None = None,
    ) -> tuple[float, float]:
        """Two times no plan of ``lengths`` beats on ``instances`` of at most ``max_batch_size``
        slots, whatever it dispatches, admits or moves (a move only adds a re-prefill):

        - the longest sample: it decodes one token a step, each step at least the fastest
          ``PTL(b)`` plus what its own growing context costs (other rows only add load);
        - the work: every token decoded, each instance at its best tokens per second
          (``b / PTL(b)``, at the ``b`` that maximises it), plus the context every token is
          decoded over (a step's load is at least the sum of its rows' contexts, whichever
          statistic the engine pays for).

        ``prompts`` (each sample's prompt tokens; default 0) start the contexts; prefills are
        not counted (a floor). A target below the larger of the two cannot be met by any
        dispatcher on this latency model; only faster steps (speculative decoding) move it.

        Returns:
            ``(longest_s, work_s)``.

        Examples:
            >>> model = LatencyModel.from_table_ms({1: 10.0, 4: 20.0})
            >>> [round(s, 3) for s in model.makespan_floor([100, 10, 10, 10], 1, 4)]
            [1.0, 0.65]
        """
        sizes = range(1, max_batch_size + 1)
        fastest_step = min(self.ptl(b) for b in sizes)
        best_rate = max(b / self.ptl(b) for b in sizes)  # tokens per second of one instance
        prompts = [0.0] * len(lengths) if prompts is None else prompts
        longest_s = max(
            n * fastest_step + self.decode_s([p], n) - n * self.ptl(1)
            for n, p in zip(lengths, prompts)
        )
        pc = self.profiled_context
        beyond = sum(n * (p - pc) + n * (n - 1) / 2 for n, p in zip(lengths, prompts))
        work_s = (sum(lengths) / best_rate + self.context_s * max(0.0, beyond)) / instances
        return longest_s, work_s

    def to_json(self, path: str | Path) -> Path:
        """Write the model to ``path`` whole (``write_text_atomic``: processes that cache the
        same model at once never leave half a file)."""
        path = Path(path)
        write_text_atomic(path, json.dumps(asdict(self), indent=2))
        return path

    @classmethod
    def from_json(cls, path: str | Path) -> LatencyModel:
        """A model written by ``to_json``; a ``PTL(BS)`` table of before the context term
        (only ``batch_sizes`` and ``ptl_s``) loads as that table alone."""
        data = json.loads(Path(path).read_text())
        known = {field.name for field in fields(cls)} - {"batch_sizes", "ptl_s"}
        costs = {key: value for key, value in data.items() if key in known}
        ptl_s = [float(v) for v in data["ptl_s"]]
        return cls([int(b) for b in data["batch_sizes"]], ptl_s, **costs)
