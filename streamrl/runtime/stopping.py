"""A run stopped from outside: SIGTERM (a scheduler's preemption, ``timeout``, Kubernetes) or
Ctrl-C, taken as one event.

While a job runs under ``stop_on_signals``, the first SIGTERM or SIGINT raises ``Stopped`` in
the main thread, wherever it waits, and every later one is ignored: a signal sent to the whole
process group also reaches the generators and reward workers, and their deaths must not read as
failures to repair (the service replaced such generators and ran on). ``Stopped`` is no
``Exception``, so it passes every ``except Exception`` on its way out and Lightning's own
interrupt handling re-raises it intact (Lightning turns SIGTERM into an exit code 0 and Ctrl-C
into 1); the ``with`` blocks it crosses stop every child process, and the CLI exits with
``128 + signal`` and the command that resumes the run from its last checkpoint.
"""

from __future__ import annotations

import contextlib
import shlex
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import FrameType

__all__ = [
    "DeadlinePassed",
    "Stopped",
    "hold_signal",
    "ignore_signals",
    "reclaim_signals",
    "resume_hint",
    "shielded",
    "stop_on_signals",
    "stoppable",
    "time_limit",
]

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stopped(BaseException):
    """The run received ``signal`` (its name, e.g. ``"SIGTERM"``) and is stopping."""

    def __init__(self, signum: int) -> None:
        self.signum = int(signum)
        self.signal = signal.Signals(signum).name
        self.exit_code = 128 + int(signum)
        super().__init__(f"stopped by {self.signal}")


class _Stopping:
    """The main thread's stop state: whether a signal came, and how deep in ``shielded``."""

    def __init__(self) -> None:
        self.fired: int | None = None
        self.pending = False
        self.shields = 0
        self.deferred: list[Callable[[], None]] = []  # other signals' handlers (``hold_signal``)
        self.handler: Callable[[int, FrameType | None], None] | None = None


#: A trainer rank > 0 that rank 0 stops (``ignore_signals``): it takes no signal itself.
_ignoring = False


_state: _Stopping | None = None


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Turn the first SIGTERM or SIGINT into ``Stopped`` in the main thread (at the end of a
    ``shielded`` block if one is running), ignore the rest until the block ends, then restore
    the previous handlers. Off the main thread (a notebook's worker thread, say) it does
    nothing: only the main thread receives signals."""
    global _state
    if threading.current_thread() is not threading.main_thread() or _state is not None:
        yield
        return
    previous = {s: signal.getsignal(s) for s in SIGNALS}
    state = _state = _Stopping()

    def stop(signum: int, frame: object) -> None:
        del frame
        if state.fired is not None:  # one event: the group's copies, or a second Ctrl-C,
            return  # change nothing (Lightning puts this handler back when it tears down)
        state.fired = signum
        if state.shields:
            state.pending = True  # raised when the shielded block ends
            return
        raise Stopped(signum)

    state.handler = stop
    for s in SIGNALS:
        signal.signal(s, stop)
    try:
        yield
    finally:
        _state = None
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def shielded() -> Iterator[None]:
    """A stop that arrives inside waits for the block's end: an optimizer step (weights and
    their version), a checkpoint being written, are never left half done. Nothing without
    ``stop_on_signals``."""
    state = _state
    if state is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    state.shields += 1
    try:
        yield
    finally:
        state.shields -= 1
        while not state.shields and state.deferred:
            state.deferred.pop(0)()
        if not state.shields and state.pending:
            state.pending = False
            raise Stopped(state.fired)


@contextlib.contextmanager
def stoppable() -> Iterator[None]:
    """Inside a ``shielded`` block, a place where a stop may land after all (a wait for
    samples, with the other trainer ranks idle): raised here at once, or on entry if one came
    while shielded. Nothing without ``stop_on_signals``."""
    state = _state
    if state is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    shields, state.shields = state.shields, 0
    try:
        if state.pending:
            state.pending = False
            raise Stopped(state.fired)
        yield
    finally:
        state.shields = shields


def ignore_signals() -> None:
    """A trainer rank that rank 0 stops (it kills the ranks it spawned when it leaves): SIGTERM
    and SIGINT, sent to the whole group, are rank 0's to act on, not this rank's."""
    global _ignoring
    _ignoring = True
    for s in SIGNALS:
        signal.signal(s, signal.SIG_IGN)


def reclaim_signals() -> None:
    """Put this process's own SIGTERM and SIGINT handling back in place once Lightning has
    set its own for ``fit``: Lightning's SIGTERM handler runs a collective (a broadcast from rank
    0) inside the handler, which waits forever for ranks that are busy in another collective
    (rank 0's stop deadlocked a run of two trainer ranks). Lightning restores the handlers it
    replaced when ``fit`` ends. Nothing off the main thread or outside ``stop_on_signals`` /
    ``ignore_signals``."""
    if threading.current_thread() is not threading.main_thread():
        return
    handler = signal.SIG_IGN if _ignoring else (_state.handler if _state is not None else None)
    if handler is None:
        return
    for s in SIGNALS:
        signal.signal(s, handler)


def hold_signal(signum: int) -> None:
    """Make the handler now installed for ``signum`` wait for the end of a ``shielded`` block
    too: Lightning's SLURM requeue handler (SIGUSR1) saves a checkpoint the moment it runs, and
    must not save weights stepped under a version not yet counted. Nothing without
    ``stop_on_signals`` or off the main thread; the handler's owner restores its own later."""
    handler = signal.getsignal(signum)
    if _state is None or not callable(handler):
        return
    if threading.current_thread() is not threading.main_thread():
        return

    def held(received: int, frame: FrameType | None) -> None:
        state = _state
        if state is not None and state.shields:
            state.deferred.append(lambda: handler(received, None))
            return
        handler(received, frame)

    signal.signal(signum, held)


class DeadlinePassed(Exception):
    """A ``time_limit`` block ran past its seconds."""


@contextlib.contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Raise ``DeadlinePassed`` in the block if it runs longer than ``seconds`` (a stopped
    run's last checkpoint must not outlast the scheduler's grace period). In the main thread
    only (it uses ``SIGALRM``); elsewhere, or with ``None``, the block runs without a limit."""
    if threading.current_thread() is not threading.main_thread() or seconds is None:
        yield
        return

    def passed(signum: int, frame: object) -> None:
        del signum, frame
        raise DeadlinePassed(f"past {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, passed)
    started = time.monotonic()
    earlier, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if earlier:  # a timer set before (pytest-timeout's, say) runs on where it was
            left = earlier - (time.monotonic() - started)
            signal.setitimer(signal.ITIMER_REAL, max(left, 0.001))


def resume_hint(output_dir: str | Path, argv: Sequence[str]) -> str:
    """What to run to go on after a stop: ``argv`` (a ``fit`` command line) resuming from the
    run's last checkpoint, or why there is none."""
    last = Path(output_dir) / "checkpoints" / "last.ckpt"  # a file, or a folder of shards
    if not last.exists():
        return (
            f"; no checkpoint to resume from in {last.parent} (rl.checkpoints: {{every: N}} "
            "writes one every N iterations): run it again from the start."
        )
    args = list(argv)
    for flag in ("--resume",):  # drop a resume given before: the new one replaces it
        while flag in args:
            at = args.index(flag)
            del args[at : at + 2]
        args = [a for a in args if not a.startswith(f"{flag}=")]
    command = shlex.join(["streamrl", *args, "--resume", str(last)])
    return f"; the last checkpoint is {last}; go on with:\n  {command}"
