"""Rewards off the trainer's critical path: a pool of worker processes, replaced when they fail.

A verifier can be slow (a symbolic math check, a reward model's forward pass, a unit test run).
Scored inline, it would stall the trainer between backward passes; ``RewardPool`` scores each
sample in a worker process the moment it arrives (§4.1's stream: the trainer keeps training on
the groups already scored) and hands back the results as they finish. A worker drains what has
queued up and scores it as one batch, so a batched reward (a reward model) sees batches.

Rewards are user code, and user code crashes: a verifier calls sympy, a sandbox or a compiler
that segfaults, leaks or hangs on one pathological completion. A worker that dies, or whose call
runs past ``timeout_s`` (it is killed), is replaced like a generator instance, and what it held
is scored again; the completions it was scoring are suspects, each scored again alone. A
completion whose scoring kills or hangs a worker twice is a **reward fault**: it comes back as
a ``Scored`` with ``fault`` set (the trainer leaves it out of the loss, like an episode its
environment cut), is written to ``faults_path`` for the user, and the run goes on. Past
``max_restarts`` replacements the run stops. A reward that *raises* or returns something that is
not a finite number stops the run with a ``RewardError`` naming the prompt: that is a bug to fix,
not a completion to skip. ``workers=0`` scores inline, in the caller's process, with the same
checks (and no protection). Workers are started with ``spawn`` (no copy of the trainer's threads
or CUDA state) and are daemons, terminated by ``close()`` (also on error and Ctrl-C, via
``with``).

Examples:
    >>> with RewardPool([RewardSpec("exact")], workers=0) as pool:
    ...     pool.submit("k", "42", {"prompt_id": "p0", "answer": "42"})
    ...     [(s.key, s.total) for s in pool.collect()]
    [('k', 1.0)]
"""

from __future__ import annotations

import contextlib
import json
import math
import multiprocessing as mp
import pickle
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

from streamrl.errors import RewardError
from streamrl.rewards.spec import RewardSpec, load_rewards
from streamrl.rewards.worker import (
    BatchScored,
    BatchStarted,
    Built,
    Job,
    ScoringFailed,
    Unbuilt,
    WorkerMessage,
    worker_main,
)
from streamrl.runtime.atomic_files import write_text_atomic

#: A completion whose scoring killed or hung this many workers is a reward fault.
STRIKES_TO_FAULT = 2


@dataclass
class Scored:
    """The reward of one submitted completion: the weighted total and each reward's value, or,
    for a reward fault, ``fault`` (why it could not be scored) and a ``total`` of nan."""

    key: Hashable
    total: float
    parts: dict[str, float]
    fault: str | None = None


@dataclass
class _Worker:
    slot: int  # its place in the pool (a replacement takes the same)
    process: Any
    inbox: Any
    results: Any  # the read end of its pipe (``streamrl.rewards.worker``)
    born: float
    ready: bool = False
    assigned: dict[Hashable, Job] = field(default_factory=dict)  # submitted, not yet scored
    running: dict[int, tuple[float, list[Hashable]]] = field(default_factory=dict)  # started


class RewardPool:
    """Scores completions with the run's rewards in ``workers`` processes (or inline).

    Args:
        specs: the run's rewards (``RewardSpec.from_config``).
        workers: worker processes; 0 scores inline in ``submit``.
        timeout_s: the most one scoring call (one batch) may take before its worker is killed
            (and replaced).
        max_batch: the most completions a worker scores in one call.
        start_timeout_s: the most a worker may take to import and build the rewards.
        status_path: a JSON file rewritten whenever a worker starts, slot -> pid (for
            operators and ``scripts/chaos.py``), or ``None``.
        max_restarts: workers replaced (after a death or a timeout) before the run stops.
        faults_path: a JSON-lines file each reward fault is appended to (its prompt id, row,
            completion and why), or ``None``.

    Raises:
        ConfigError: a reward that does not resolve (checked in this process first).
        RewardError: from ``collect``: a reward raised or returned a bad value, a worker could
            not build the rewards, or more than ``max_restarts`` workers failed.
    """

    def __init__(
        self,
        specs: Sequence[RewardSpec],
        *,
        workers: int = 1,
        timeout_s: float = 60.0,
        max_batch: int = 64,
        start_timeout_s: float = 180.0,
        status_path: str | Path | None = None,
        max_restarts: int = 10,
        faults_path: str | Path | None = None,
    ) -> None:
        if workers < 0 or timeout_s <= 0 or max_batch < 1 or max_restarts < 0:
            raise ValueError(
                f"RewardPool: need workers >= 0, timeout_s > 0, max_batch >= 1 and "
                f"max_restarts >= 0, got workers={workers}, timeout_s={timeout_s}, "
                f"max_batch={max_batch}, max_restarts={max_restarts}."
            )
        self.specs, self.workers, self.timeout_s = list(specs), workers, timeout_s
        self.max_batch, self.start_timeout_s = max_batch, start_timeout_s
        self.status_path = Path(status_path) if status_path is not None else None
        self.faults_path = Path(faults_path) if faults_path is not None else None
        self.max_restarts = max_restarts
        self._inline = load_rewards(self.specs)  # checks every spec before a process starts
        self.labels = self._inline.labels
        self._done: list[Scored] = []
        self._pool: list[_Worker] = []
        self._ctx = mp.get_context("spawn")
        self._strikes: dict[Hashable, int] = {}  # suspects: workers their scoring took down
        #: Workers replaced after a death or a timeout, and completions given up as faults.
        self.restarts, self.faults = 0, 0

    def __enter__(self) -> RewardPool:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Start the worker processes and wait until each has built its rewards."""
        if self.workers == 0 or self._pool:
            return
        try:
            self._pool = [self._spawn(slot) for slot in range(self.workers)]
            while not all(w.ready for w in self._pool):
                self._drain(block_s=0.05)
            self._write_status()
        except BaseException:
            self.close()
            raise

    def _spawn(self, slot: int) -> _Worker:
        inbox, (results, child_end) = self._ctx.Queue(), self._ctx.Pipe(duplex=False)
        process = self._ctx.Process(
            target=worker_main,
            args=(self.specs, inbox, child_end, self.max_batch),
            name=f"streamrl-reward-{slot}",
            daemon=True,
        )
        process.start()
        child_end.close()  # ours: reading sees EOF once the child is gone
        return _Worker(slot, process, inbox, results, time.monotonic())

    def _write_status(self) -> None:
        if self.status_path is None:
            return
        pids = {str(w.slot): w.process.pid for w in self._pool}
        write_text_atomic(self.status_path, json.dumps(pids))  # a reader never sees half

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
        self._send(Job(key, completion, row))

    def _send(self, job: Job) -> None:
        worker = min(self._pool, key=lambda w: len(w.assigned))
        worker.assigned[job.key] = job
        worker.inbox.put(job)

    def collect(self, timeout_s: float = 0.0) -> list[Scored]:
        """The results that are ready (reward faults among them), waiting up to ``timeout_s``
        for at least one.

        Raises:
            RewardError: a reward raised or returned a bad value, a worker could not build the
                rewards, or more than ``max_restarts`` workers died or hung.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            self._drain(block_s=0.0)
            if self._done or time.monotonic() >= deadline or not self.pending:
                done, self._done = self._done, []
                return done
            self._drain(block_s=min(0.05, max(0.0, deadline - time.monotonic())))

    def _drain(self, block_s: float) -> None:
        """Handle what the workers sent (waiting up to ``block_s`` for something), then replace
        a worker that died or ran past its timeout."""
        if not self._pool:  # inline: scored in submit
            return
        wait([w.results for w in self._pool], timeout=block_s)
        for worker in list(self._pool):
            try:
                while worker.results.poll():
                    self._handle(worker, worker.results.recv())
            except (EOFError, OSError, pickle.UnpicklingError):  # gone (maybe mid-message)
                worker.process.join(timeout=5.0)
        self._check_workers()

    def _handle(self, worker: _Worker, message: WorkerMessage) -> None:
        match message:
            case Built():
                worker.ready = True
            case Unbuilt(why=why):
                raise RewardError(f"Reward worker {worker.slot} could not build the rewards: {why}")
            case BatchStarted(number=number, keys=keys, since=since):
                worker.running[number] = (since, keys)
            case BatchScored(number=number, keys=keys, totals=totals, parts=parts):
                worker.running.pop(number, None)
                for i, key in enumerate(keys):
                    worker.assigned.pop(key, None)
                    self._strikes.pop(key, None)
                    self._done.append(Scored(key, totals[i], {k: v[i] for k, v in parts.items()}))
            case ScoringFailed(message=text):
                raise RewardError(text)
            case _:
                raise RewardError(f"Reward worker {worker.slot} sent {message!r:.200}")

    def _check_workers(self) -> None:
        now = time.time()
        for worker in list(self._pool):
            oldest = min((since for since, _ in worker.running.values()), default=now)
            if now - oldest > self.timeout_s:
                self._replace(worker, f"did not return within {self.timeout_s:g}s (killed)")
            elif not worker.process.is_alive():
                self._replace(worker, f"died (exit code {worker.process.exitcode})")
            elif not worker.ready and time.monotonic() - worker.born > self.start_timeout_s:
                raise RewardError(
                    f"Reward worker {worker.slot} did not start within "
                    f"{self.start_timeout_s:.0f}s; a reward module may take long to import "
                    "(raise start_timeout_s)."
                )

    def _replace(self, worker: _Worker, why: str) -> None:
        """Kill ``worker``, start its replacement and send what it held again: the completions
        it was scoring as suspects (alone), each a fault at its ``STRIKES_TO_FAULT``-th."""
        worker.process.kill()
        worker.process.join(timeout=5.0)
        suspects = {key for _, keys in worker.running.values() for key in keys}
        jobs = [worker.assigned[key] for key in suspects if key in worker.assigned]
        prompts = sorted({str(job.row.get("prompt_id")) for job in jobs})
        self.restarts += 1
        if self.restarts > self.max_restarts:
            raise RewardError(
                f"Reward worker {worker.slot} {why} while scoring prompt(s) {prompts}: "
                f"{self.restarts} worker failures, past max_restarts="
                f"{self.max_restarts}, so the run stops. Make the reward robust (or faster), or "
                "raise rl.reward_pool's max_restarts / timeout_s."
            )
        worker.inbox.cancel_join_thread()
        worker.results.close()
        self._pool[self._pool.index(worker)] = self._spawn(worker.slot)
        self._write_status()
        for key, job in worker.assigned.items():
            if key not in suspects:
                self._send(job)
            elif self._strikes.get(key, 0) + 1 >= STRIKES_TO_FAULT:
                self._fault(job, f"its scoring killed or hung a reward worker twice (last: {why})")
            else:
                self._strikes[key] = self._strikes.get(key, 0) + 1
                self._send(job._replace(solo=True))

    def _fault(self, job: Job, why: str) -> None:
        self.faults += 1
        self._strikes.pop(job.key, None)
        self._done.append(Scored(job.key, math.nan, {}, fault=why))
        if self.faults_path is not None:
            entry = {
                "prompt_id": job.row.get("prompt_id"),
                "why": why,
                "completion": job.completion,
            }
            self.faults_path.parent.mkdir(parents=True, exist_ok=True)
            with self.faults_path.open("a") as f:
                f.write(json.dumps({**entry, "row": job.row}, default=str) + "\n")

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
            worker.results.close()
        self._pool = []
