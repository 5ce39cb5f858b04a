"""Environments in worker processes: user code that crashes takes down a worker, not the trainer.

On threads of the trainer (``EpisodeRunner``'s default for the built-in, pure-Python
environments), an environment that segfaults, calls ``os._exit``, leaks memory or holds the GIL
in C code takes the trainer with it. ``EnvWorkers`` runs every environment in one of ``workers``
processes instead (``spawn``: no copy of the trainer's threads or CUDA state); ``make()`` gives
the runner a ``RemoteEnv``, whose ``reset``/``step``/``close`` run there, each call on a thread
of the worker so that a slow step holds up no other episode.

A worker that dies fails every call it had open, and every later call of its environments, with
``EnvWorkerLost``; the runner starts those episodes again from their prompts on a replacement
(made at the next ``make()``), so nothing is lost or trained twice. After a step runs past the
runner's timeout, ``check`` pings its worker; one that does not answer within
``ping_timeout_s`` (stopped, or stuck in C code holding the GIL) is killed, and replaced the same
way. Past ``max_restarts`` replacements ``make()`` raises ``EnvError``: the run stops. The pids
go to ``status_path`` (slot -> pid, for operators and ``scripts/chaos.py``).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import multiprocessing as mp
import signal
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from streamrl.errors import EnvError
from streamrl.protocols import Environment
from streamrl.records import Step
from streamrl.runtime.atomic_files import write_text_atomic

__all__ = ["EnvWorkerLost", "EnvWorkers", "RemoteEnv"]

#: The call id of a worker's first message: it has started (``make_env`` unpickled).
READY = -1


class EnvWorkerLost(RuntimeError):
    """The process holding an environment died or hung: its episode starts again."""


@dataclass
class _Worker:
    slot: int
    process: Any
    requests: Any  # our end of its pipe of calls
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    open: dict[int, Future] = field(default_factory=dict)  # call id -> its reply
    envs: int = 0  # environments it holds
    lost: bool = False
    ready: threading.Event = field(default_factory=threading.Event)  # it imported make_env


class RemoteEnv:
    """An ``Environment`` living in an env worker process (``EnvWorkers.make``)."""

    def __init__(self, pool: EnvWorkers, worker: _Worker, env_id: int, name: str) -> None:
        self.pool, self.worker, self.env_id, self.env_name = pool, worker, env_id, name

    def reset(self, row: Mapping) -> str | list[dict]:
        return self.pool.call(self, "reset", dict(row))

    def step(self, action: str) -> Step:
        return self.pool.call(self, "step", action)

    def close(self) -> None:
        with contextlib.suppress(EnvWorkerLost):  # gone with its worker
            self.pool.call(self, "close")
        self.worker.envs -= 1


class EnvWorkers:
    """``workers`` processes that hold the run's environments (module docstring).

    Args:
        make_env: makes one environment (picklable: a class or a module-level function, or a
            ``functools.partial`` of one).
        workers: processes.
        max_restarts: workers replaced (after a death or a hang) before ``make()`` raises.
        ping_timeout_s: how long ``check`` waits for a worker's answer.
        start_timeout_s: the most a worker may take to start (import ``make_env``'s module).
        call_timeout_s: the most any call may wait for its answer (the runner's own
            ``env_timeout_s`` is shorter and cuts the episode first).
        status_path: a JSON file rewritten whenever a worker starts, slot -> pid, or ``None``.
    """

    def __init__(
        self,
        make_env: Callable[[], Environment],
        workers: int = 2,
        *,
        max_restarts: int = 10,
        ping_timeout_s: float = 5.0,
        start_timeout_s: float = 180.0,
        call_timeout_s: float = 600.0,
        status_path: str | Path | None = None,
    ) -> None:
        if workers < 1 or max_restarts < 0:
            raise ValueError(f"EnvWorkers: need workers >= 1 and max_restarts >= 0, got {workers}.")
        self.make_env, self.workers, self.max_restarts = make_env, workers, max_restarts
        self.ping_timeout_s, self.call_timeout_s = ping_timeout_s, call_timeout_s
        self.start_timeout_s = start_timeout_s
        self.status_path = Path(status_path) if status_path is not None else None
        func = getattr(make_env, "func", make_env)  # a functools.partial's function
        self.env_name = getattr(func, "__name__", type(func).__name__)
        self._ctx = mp.get_context("spawn")
        self._pool: list[_Worker] = []
        self._ids = itertools.count()
        self._lock = threading.Lock()  # the pool's list (steps call from their threads)
        #: Workers replaced after a death or a hang.
        self.restarts = 0

    def __enter__(self) -> EnvWorkers:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Start the workers and wait until each has imported ``make_env`` (a step's timeout
        never counts a worker's start).

        Raises:
            EnvError: a worker did not start within ``start_timeout_s``.
        """
        if not self._pool:
            self._pool = [self._spawn(slot) for slot in range(self.workers)]
            for worker in self._pool:
                self._await_ready(worker)
            self._write_status()

    def _await_ready(self, worker: _Worker) -> None:
        if not worker.ready.wait(self.start_timeout_s) or worker.lost:
            self.close()
            raise EnvError(
                f"Environment worker {worker.slot} did not start within "
                f"{self.start_timeout_s:.0f}s (exit code {worker.process.exitcode}): the module "
                f"of {self.env_name} must import in a fresh process (spawn)."
            )

    def _spawn(self, slot: int) -> _Worker:
        ours, theirs = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(
            target=env_worker_main,
            args=(self.make_env, theirs),
            name=f"streamrl-env-{slot}",
            daemon=True,
        )
        process.start()
        theirs.close()
        worker = _Worker(slot, process, ours)
        threading.Thread(
            target=self._read, args=(worker,), daemon=True, name=f"streamrl-env-reader-{slot}"
        ).start()
        return worker

    def _write_status(self) -> None:
        if self.status_path is not None:
            pids = {str(w.slot): w.process.pid for w in self._pool}
            write_text_atomic(self.status_path, json.dumps(pids))

    def make(self) -> RemoteEnv:
        """A new environment on the least loaded worker (a lost one is replaced first).

        Raises:
            EnvError: more than ``max_restarts`` workers were lost.
        """
        with self._lock:
            for i, worker in enumerate(self._pool):
                if worker.lost or not worker.process.is_alive():
                    self._replace(i, worker)
            worker = min(self._pool, key=lambda w: w.envs)
            worker.envs += 1
        return RemoteEnv(self, worker, next(self._ids), self.env_name)

    def _replace(self, i: int, worker: _Worker) -> None:
        self._lose(worker)
        self.restarts += 1
        if self.restarts > self.max_restarts:
            raise EnvError(
                f"Environment worker {worker.slot} was lost (exit code "
                f"{worker.process.exitcode}): {self.restarts} worker failures, past "
                f"max_restarts={self.max_restarts} (env.max_restarts), so the run stops. Make "
                f"{self.env_name} robust, or raise env.max_restarts."
            )
        self._pool[i] = self._spawn(worker.slot)
        self._await_ready(self._pool[i])
        self._write_status()

    def call(self, env: RemoteEnv, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        """``method(*args)`` on ``env`` in its worker; its result, or its exception re-raised.

        Raises:
            EnvWorkerLost: the worker died (or was killed as hung) before it answered, or did
                not answer within ``timeout_s`` (default ``call_timeout_s``).
        """
        worker = env.worker
        reply: Future = Future()
        call_id = next(self._ids)
        # Registered before the check: a worker lost in between fails it (``_lose``), rather
        # than leave it waiting out ``call_timeout_s``.
        worker.open[call_id] = reply
        try:
            if worker.lost:
                raise OSError("lost")
            with worker.send_lock:
                worker.requests.send((call_id, env.env_id, method, args))
        except (OSError, ValueError):
            self._lose(worker)
        try:
            return reply.result(timeout=timeout_s or self.call_timeout_s)
        except FutureTimeout:
            raise EnvWorkerLost(
                f"environment worker {worker.slot} did not answer within "
                f"{timeout_s or self.call_timeout_s:g}s"
            ) from None
        finally:
            worker.open.pop(call_id, None)

    def check(self, env: RemoteEnv) -> bool:
        """Whether ``env``'s worker answers a ping within ``ping_timeout_s``; one that does not
        is killed (its environments' calls fail with ``EnvWorkerLost``)."""
        try:
            self.call(env, "ping", timeout_s=self.ping_timeout_s)
            return True
        except EnvWorkerLost:
            self._lose(env.worker)
            return False

    def _read(self, worker: _Worker) -> None:
        """The replies of one worker, until its pipe closes (it died, or the pool closed)."""
        try:
            while True:
                call_id, ok, value = worker.requests.recv()
                if call_id == READY:
                    worker.ready.set()
                    continue
                reply = worker.open.get(call_id)
                if reply is not None:
                    reply.set_result(value) if ok else reply.set_exception(value)
        except (EOFError, OSError, ValueError):
            pass
        self._lose(worker)
        worker.ready.set()  # a start that failed: ``_await_ready`` sees it lost

    def _lose(self, worker: _Worker) -> None:
        """Mark ``worker`` lost, kill it, and fail every call it had open."""
        worker.lost = True
        if worker.process.is_alive():
            worker.process.kill()
        for reply in list(worker.open.values()):
            if not reply.done():
                with contextlib.suppress(Exception):  # answered meanwhile
                    reply.set_exception(
                        EnvWorkerLost(f"environment worker {worker.slot} died or hung")
                    )

    def close(self) -> None:
        """Stop every worker (those that do not stop within a second are killed)."""
        for worker in self._pool:
            with contextlib.suppress(OSError, ValueError), worker.send_lock:
                worker.requests.send(None)
        for worker in self._pool:
            worker.process.join(timeout=1.0)
            worker.lost = True
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join(timeout=5.0)
            worker.requests.close()
        self._pool = []


def env_worker_main(make_env: Callable[[], Environment], conn: Any) -> None:
    """An env worker: each call ``(id, env id, method, args)`` on a thread of its own, the
    answer ``(id, ok, value)``; a ``ping`` answered by this loop itself (a worker whose loop
    cannot run, stopped or stuck holding the GIL, does not answer)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer decides, and stops us
    envs: dict[int, Environment] = {}
    lock = threading.Lock()
    conn.send((READY, True, None))

    def answer(call_id: int, ok: bool, value: Any) -> None:
        with lock:
            try:
                conn.send((call_id, ok, value))
            except Exception as err:  # a value or an exception that cannot pickle
                conn.send((call_id, False, RuntimeError(f"{value!r} ({err})")))

    def run(call_id: int, env_id: int, method: str, args: tuple) -> None:
        try:
            if method == "reset":
                envs[env_id] = envs.get(env_id) or make_env()
            env = envs.pop(env_id, None) if method == "close" else envs[env_id]
            value = getattr(env, method)(*args) if env is not None else None
            answer(call_id, True, value)
        except BaseException as err:  # handed to the runner, which names the environment
            answer(call_id, False, err)

    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        if message[2] == "ping":
            answer(message[0], True, None)
            continue
        # named as the runner's own step threads are (an environment may look)
        threading.Thread(target=run, args=message, daemon=True, name="streamrl-env").start()
