"""The rows of ``streamrl sim validate``: real ``streamrl bench pipeline`` configurations
(``BenchConfig``), the calibration run, the predicted rows and the length sets they draw from.

A row's ``mode`` is a ``bench.pipeline.BENCH_MODES`` name; ``sim_mode_fields`` maps it to the
``SimConfig`` fields (module mode, staleness bound, partial-rollout policy) the simulated side
runs, from the same table the real side runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from streamrl.sim.presets import DEFAULT_LENGTHS, paper_lengths

MAX_BATCH_SIZE = 64  # slots per generator instance, as ``bench pipeline`` runs it by default


def bench_mode(name: str):
    """The ``bench.pipeline.BENCH_MODES`` entry ``name`` (imported on first use: the bench pulls
    in Lightning); a ``ValueError`` naming the choices if there is none."""
    from streamrl.bench.pipeline import BENCH_MODES

    if name not in BENCH_MODES:
        raise ValueError(f"Unknown bench mode {name!r}; choose from {', '.join(BENCH_MODES)}.")
    return BENCH_MODES[name]


def sim_mode_fields(name: str) -> dict:
    """The ``SimConfig`` fields of the bench mode ``name``: its module mode, staleness bound
    and partial-rollout policy, as ``run_mode`` runs them."""
    variant = bench_mode(name)
    return {
        "mode": variant.mode,
        "staleness_bound": variant.staleness_bound,
        "partial_rollout": variant.partial_rollout,
    }


def shipped_lengths() -> list[int]:
    """The bench's default lengths (512, median 22.5, p90 75, max 200 tokens)."""
    from streamrl.bench import load_lengths

    return load_lengths(DEFAULT_LENGTHS)


def fat_tail_lengths(count: int = 512, seed: int = 1) -> list[int]:
    """Another long-tail draw, a different shape: the paper presets' CodeMath-like mixture
    (§7.1, Fig. 7; 60% log-normal body, 40% uniform tail) scaled to at most 200 tokens (mean
    58 tokens against the shipped file's 33)."""
    return paper_lengths(count, 200, seed)


LENGTH_SETS: dict[str, Callable[[], list[int]]] = {
    "shipped": shipped_lengths,
    "fat-tail": fat_tail_lengths,
}


@dataclass(frozen=True)
class BenchConfig:
    """One real ``streamrl bench pipeline`` configuration: a row of the validation.

    Attributes:
        name: the row's name (``--configs``).
        mode: a ``bench.pipeline.BENCH_MODES`` name (``colocated``, ``sync``, ``async``,
            ``async-k2``, ``partial-keep``, ...).
        lengths: a key of ``LENGTH_SETS``.
        batch: prompts per iteration.
        group_size: samples per prompt.
        instances: generator instances (one process each).
        token_budget: padded tokens per trainer micro-batch.
        max_batch_size: batch slots per generator instance (the bench's ``--max-batch-size``).
    """

    name: str
    mode: str
    lengths: str = "shipped"
    batch: int = 16
    group_size: int = 4
    instances: int = 1
    token_budget: int = 256
    max_batch_size: int = MAX_BATCH_SIZE

    def describe(self) -> str:
        """A short label: what differs from the bench's defaults."""
        return (
            f"{self.mode}, {self.lengths} lengths, {self.batch}x{self.group_size}, "
            f"{self.instances} inst., {self.max_batch_size} slots, budget {self.token_budget}"
        )


#: The calibration run: ``streamrl bench pipeline --modes sync`` with its defaults.
CALIBRATION = BenchConfig("calibration", "sync")
#: The out-of-sample rows; each changes the mode, the lengths, the batch, the instances or the
#: slots. The asynchronous variants run at 64 slots (trainer-bound on this machine) and at 16
#: (generation-bound, where partial rollout and a larger staleness bound matter).
PREDICTED = {
    c.name: c
    for c in (
        BenchConfig("async", "async"),
        BenchConfig("colocated", "colocated", instances=2, token_budget=4096),
        BenchConfig("fat-tail", "sync", lengths="fat-tail"),
        BenchConfig("fat-tail-async", "async", lengths="fat-tail"),
        BenchConfig("batch-8", "sync", batch=8, token_budget=512),
        BenchConfig("two-instances", "sync", instances=2),
        BenchConfig("async-k2", "async-k2"),
        BenchConfig("partial-keep", "partial-keep"),
        BenchConfig("partial-recompute", "partial-recompute"),
        BenchConfig("async-16", "async", max_batch_size=16),
        BenchConfig("partial-keep-16", "partial-keep", max_batch_size=16),
        BenchConfig("async-k2-16", "async-k2", max_batch_size=16),
    )
}
