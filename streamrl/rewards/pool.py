"""Rewards off the trainer's critical path: a pool of worker processes with a per-call timeout.

A verifier can be slow (a symbolic math check, a reward model's forward pass, a unit test run).
Scored inline, it would stall the trainer between backward passes; ``RewardPool`` scores each
sample in a worker process the moment it arrives (§4.1's stream: the trainer keeps training on
the groups already scored) and hands back the results as they finish. A worker drains what has
queued up and scores it as one batch, so a batched reward (a reward model) sees batches.

Every call has a deadline: a reward that hangs is killed after ``timeout_s`` and the run stops
with a ``RewardError`` naming the prompt, as does one that raises or returns something that is
not a finite number. ``workers=0`` scores inline, in the caller's process, with the same checks.
Workers are started with ``spawn`` (no copy of the trainer's threads or CUDA state) and are
daemons, terminated by ``close()`` (also on error and Ctrl-C, via ``with``).

Examples:
    >>> with RewardPool([RewardSpec("exact")], workers=0) as pool:
    ...     pool.submit("k", "42", {"prompt_id": "p0", "answer": "42"})
    ...     [(s.key, s.total) for s in pool.collect()]
    [('k', 1.0)]
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import queue
import signal
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from streamrl.errors import RewardError
from streamrl.rewards.spec import RewardSpec, load_rewards


@dataclass
class Scored:
    """The reward of one submitted completion: the weighted total and each reward's value."""

    key: Hashable
    total: float
    parts: dict[str, float]


@dataclass
class _Worker:
    process: Any
    inbox: Any
    assigned: dict[Hashable, str]  # key -> prompt id, submitted and not yet scored
    busy: tuple[float, list[Hashable]] | None = None  # (since, keys) of the batch being scored


class RewardPool:
    """Scores completions with the run's rewards in ``workers`` processes (or inline).

    Args:
        specs: the run's rewards (``RewardSpec.from_config``).
        workers: worker processes; 0 scores inline in ``submit``.
        timeout_s: the most one scoring call (one batch) may take before its worker is killed.
        max_batch: the most completions a worker scores in one call.
        start_timeout_s: the most a worker may take to import and build the rewards.
        status_path: a JSON file written once the workers are up, worker id -> pid (for
            operators and ``scripts/chaos.py``), or ``None``.

    Raises:
        ConfigError: a reward that does not resolve (checked in this process first).
        RewardError: from ``collect``: a reward raised, hung, or returned a bad value.
    """

    def __init__(
        self,
        specs: Sequence[RewardSpec],
        *,
        workers: int = 2,
        timeout_s: float = 60.0,
        max_batch: int = 64,
        start_timeout_s: float = 180.0,
        status_path: str | Path | None = None,
    ) -> None:
        if workers < 0 or timeout_s <= 0 or max_batch < 1:
            raise ValueError(
                f"RewardPool: need workers >= 0, timeout_s > 0 and max_batch >= 1, got "
                f"workers={workers}, timeout_s={timeout_s}, max_batch={max_batch}."
            )
        self.specs, self.workers, self.timeout_s = list(specs), workers, timeout_s
        self.max_batch, self.start_timeout_s = max_batch, start_timeout_s
        self.status_path = Path(status_path) if status_path is not None else None
        self._inline = load_rewards(self.specs)  # checks every spec before a process starts
        self.labels = self._inline.labels
        self._done: list[Scored] = []
        self._pool: list[_Worker] = []
        self._outbox: Any = None

    def __enter__(self) -> RewardPool:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Start the worker processes and wait until each has built its rewards."""
        if self.workers == 0 or self._pool:
            return
        ctx = mp.get_context("spawn")
        self._outbox = ctx.Queue()
        try:
            for wid in range(self.workers):
                inbox = ctx.Queue()
                process = ctx.Process(
                    target=_worker_main,
                    args=(wid, self.specs, inbox, self._outbox, self.max_batch),
                    name=f"streamrl-reward-{wid}",
                    daemon=True,
                )
                process.start()
                self._pool.append(_Worker(process, inbox, {}))
            self._wait_ready()
            if self.status_path is not None:
                pids = {str(wid): w.process.pid for wid, w in enumerate(self._pool)}
                self.status_path.parent.mkdir(parents=True, exist_ok=True)
                self.status_path.write_text(json.dumps(pids))
        except BaseException:
            self.close()
            raise

    def _wait_ready(self) -> None:
        deadline, ready = time.monotonic() + self.start_timeout_s, set()
        while len(ready) < self.workers:
            try:
                kind, wid, *rest = self._outbox.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise RewardError(
                    f"Reward workers did not start within {self.start_timeout_s:.0f}s; a reward "
                    "module may take long to import (raise start_timeout_s)."
                ) from None
            if kind == "fatal":
                raise RewardError(f"Reward worker {wid} could not build the rewards: {rest[0]}")
            ready.add(wid)

    @property
    def pending(self) -> int:
        """Completions submitted and not yet returned by ``collect``."""
        return sum(len(w.assigned) for w in self._pool) + len(self._done)

    def submit(self, key: Hashable, completion: str, row: dict) -> None:
        """Queue one completion for scoring; its ``Scored`` comes out of ``collect``."""
        if self.workers == 0:
            totals, parts = self._inline.score([completion], [row])
            self._done.append(Scored(key, totals[0], {k: v[0] for k, v in parts.items()}))
            return
        if not self._pool:
            raise RuntimeError("RewardPool.submit before start(); use it in a `with` block.")
        worker = min(self._pool, key=lambda w: len(w.assigned))
        worker.assigned[key] = str(row.get("prompt_id"))
        worker.inbox.put((key, completion, row))

    def collect(self, timeout_s: float = 0.0) -> list[Scored]:
        """The results that are ready, waiting up to ``timeout_s`` for at least one.

        Raises:
            RewardError: a reward raised or returned a bad value, a call ran past
                ``timeout_s`` (its worker is killed), or a worker died.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            self._drain(block_s=0.0)
            if self._done or time.monotonic() >= deadline or not self.pending:
                done, self._done = self._done, []
                return done
            self._drain(block_s=min(0.05, max(0.0, deadline - time.monotonic())))

    def _drain(self, block_s: float) -> None:
        if self._outbox is None:  # inline: scored in submit
            return
        try:
            message = (
                self._outbox.get(timeout=block_s) if block_s > 0 else self._outbox.get_nowait()
            )
            while True:
                self._handle(message)
                message = self._outbox.get_nowait()
        except queue.Empty:
            pass
        self._check_workers()

    def _handle(self, message: tuple) -> None:
        kind, wid, *rest = message
        worker = self._pool[wid]
        if kind == "start":  # the worker's wall clock: the trainer may read this late
            worker.busy = (rest[1], rest[0])
        elif kind == "done":
            keys, totals, parts = rest
            worker.busy = None
            for i, key in enumerate(keys):
                worker.assigned.pop(key, None)
                self._done.append(Scored(key, totals[i], {k: v[i] for k, v in parts.items()}))
        elif kind == "error":
            raise RewardError(rest[0])

    def _check_workers(self) -> None:
        now = time.time()
        for wid, worker in enumerate(self._pool):
            if worker.busy is not None and now - worker.busy[0] > self.timeout_s:
                prompts = sorted({worker.assigned.get(k, "?") for k in worker.busy[1]})
                worker.process.kill()
                raise RewardError(
                    f"Reward call on prompt(s) {prompts} did not return within "
                    f"{self.timeout_s:g}s (rl.reward_timeout_s); its worker {wid} was killed. "
                    "Make the reward faster or give it more time."
                )
            if not worker.process.is_alive():
                prompts = sorted(set(worker.assigned.values()))
                raise RewardError(
                    f"Reward worker {wid} died (exit code {worker.process.exitcode}) while "
                    f"scoring prompt(s) {prompts}."
                )

    def close(self) -> None:
        """Stop every worker (those that do not stop within a second are killed)."""
        for worker in self._pool:
            if worker.process.is_alive():
                with contextlib.suppress(ValueError, OSError):  # queue already closed
                    worker.inbox.put_nowait(None)
        for worker in self._pool:
            worker.process.join(timeout=1.0)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join(timeout=5.0)
            worker.inbox.cancel_join_thread()
        if self._outbox is not None:
            self._outbox.cancel_join_thread()
        self._pool, self._outbox = [], None


def _worker_main(wid: int, specs: list[RewardSpec], inbox: Any, outbox: Any, max_batch: int):
    """A reward worker: build the rewards, then score batches of whatever has queued up."""
    # Ctrl-C reaches the whole process group: the trainer decides, and stops us (``close``).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        rewards = load_rewards(specs)
    except Exception as err:  # reported to the trainer, which stops the run with it
        outbox.put(("fatal", wid, repr(err)))
        return
    outbox.put(("ready", wid))
    while True:
        items = [inbox.get()]
        while items[-1] is not None and len(items) < max_batch:
            try:
                items.append(inbox.get_nowait())
            except queue.Empty:
                break
        stop = items[-1] is None
        items = [item for item in items if item is not None]
        if items:
            keys, completions, rows = map(list, zip(*items))
            outbox.put(("start", wid, keys, time.time()))
            try:
                totals, parts = rewards.score(completions, rows)
            except RewardError as err:
                outbox.put(("error", wid, str(err)))
                return
            outbox.put(("done", wid, keys, totals, parts))
        if stop:
            return
