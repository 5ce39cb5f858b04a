"""One reward worker process: builds the run's rewards, then scores what queues up in batches.

``RewardPool`` (``streamrl.rewards.pool``) starts these with ``spawn`` and replaces one that dies
or hangs. Each worker talks back on a pipe of its own: a ``Queue`` shared by the workers is
written under one lock, which a worker killed mid-write holds forever (every other worker's
results are then lost), and its feeder thread may not have written a message when a segfault
strikes; ``Connection.send`` has written the message when it returns. So that the pool knows
which completions a dead worker was scoring, the worker says so *before* it calls the rewards.
A completion the pool suspects (it was being scored when a worker died) comes back marked
``solo`` and is scored in a batch of its own, so that a second death names it alone.
"""

from __future__ import annotations

import queue
import signal
import sys
import time
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, NamedTuple

from streamrl.errors import RewardError
from streamrl.rewards.spec import RewardSpec, load_rewards
from streamrl.runtime.cores import free_cores

__all__ = ["BatchScored", "BatchStarted", "Built", "Job", "ScoringFailed", "Unbuilt", "worker_main"]


class Job(NamedTuple):
    """One completion to score, as it travels to a worker."""

    key: Hashable
    completion: str
    row: dict
    solo: bool = False  # a suspect: scored in a batch of its own


# -- what a worker tells the pool, in order: Built (or Unbuilt), then per batch BatchStarted and
# -- BatchScored (or ScoringFailed) -------------------------------------------------------------


@dataclass(frozen=True)
class Built:
    """The rewards are built: the worker takes jobs."""


@dataclass(frozen=True)
class Unbuilt:
    """The rewards could not be built (``why``): the run stops with it."""

    why: str


@dataclass(frozen=True)
class BatchStarted:
    """Batch ``number`` of ``keys`` is being scored since ``since`` (this process's wall clock):
    said before the rewards are called, so a death names what it was scoring."""

    number: int
    keys: list[Hashable]
    since: float


@dataclass(frozen=True)
class BatchScored:
    """Batch ``number`` scored: each key's total and each reward's part, in ``keys``' order."""

    number: int
    keys: list[Hashable]
    totals: list[float]
    parts: dict[str, list[float]]


@dataclass(frozen=True)
class ScoringFailed:
    """A reward broke its contract (``RewardError``): the run stops with ``message``."""

    message: str


WorkerMessage = Built | Unbuilt | BatchStarted | BatchScored | ScoringFailed


def worker_main(specs: list[RewardSpec], inbox: Any, results: Any, max_batch: int) -> None:
    """Build the rewards, report ``Built`` (or ``Unbuilt``), then score batches until ``None``.

    Messages on ``results`` (a ``Connection``) are ``WorkerMessage`` records: ``Built`` or
    ``Unbuilt``, then per batch ``BatchStarted`` and ``BatchScored`` (or ``ScoringFailed``).
    """
    # Ctrl-C reaches the whole process group: the trainer decides, and stops us (``close``).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        rewards = load_rewards(specs)
    except Exception as err:  # reported to the trainer, which stops the run with it
        results.send(Unbuilt(repr(err)))
        return
    results.send(Built())
    held: list[Job | None] = []  # taken from the inbox, for the next batch
    for number in range(1 << 62):
        batch = _next_batch(inbox, held, max_batch)
        jobs = [job for job in batch if job is not None]
        if jobs:
            keys = [job.key for job in jobs]
            _size_threads()
            results.send(BatchStarted(number, keys, time.time()))
            try:
                totals, parts = rewards.score([j.completion for j in jobs], [j.row for j in jobs])
            except RewardError as err:
                results.send(ScoringFailed(str(err)))
                return
            results.send(BatchScored(number, keys, totals, parts))
        if None in batch:  # the pool's stop
            return


def _size_threads() -> None:
    """A reward that computes with torch (a reward model) uses the cores free now, as the
    trainer's steps do: a spinning OpenMP team beside busy cores collapses (bench contention).
    A reward that does not import torch is left alone (nothing to size)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(free_cores())


def _next_batch(inbox: Any, held: list[Job | None], max_batch: int) -> list[Job | None]:
    """What queued up: one suspect alone, or up to ``max_batch`` others (``None``: stop)."""
    first = held.pop(0) if held else inbox.get()
    batch = [first]
    if first is None or first.solo:
        return batch
    while len(batch) < max_batch:
        try:
            job = inbox.get_nowait()
        except queue.Empty:
            break
        if job is not None and job.solo:  # not in this batch: it is scored alone, next
            held.append(job)
            break
        batch.append(job)
        if job is None:
            break
    return batch
