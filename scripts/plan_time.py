"""Time the dispatchers' planning calls in one real ``streamrl bench dispatch`` run.

A plan's wall time delays every instance's first token (the bench's makespan counts it), and a
planner's moves take main-process CPU beside the decoding instances. This wraps
``AdaptiveDispatcher.plan`` / ``rebalance`` / ``finished`` and ``SkewAwareDispatcher.plan`` with a
timer, runs the bench with the arguments given, and prints each call's count, total and longest.

    python scripts/plan_time.py --instances 2 --predictions ranker --policies skew,adaptive \\
        --repeats 3
"""

from __future__ import annotations

import functools
import sys
import time
from collections import defaultdict

from streamrl.components.skewness.adaptive import AdaptiveDispatcher
from streamrl.components.skewness.skew_dispatch import SkewAwareDispatcher

TIMED = {AdaptiveDispatcher: ("plan", "rebalance", "finished"), SkewAwareDispatcher: ("plan",)}
SECONDS: dict[str, list[float]] = defaultdict(list)


def timed(cls: type, name: str) -> None:
    """Replace ``cls.name`` by itself under a timer (``SECONDS``)."""
    method = getattr(cls, name)

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            SECONDS[f"{cls.__name__}.{name}"].append(time.perf_counter() - started)

    setattr(cls, name, wrapper)


if __name__ == "__main__":  # the generator instances are spawned processes
    from streamrl.cli.main import main

    for cls, names in TIMED.items():
        for name in names:
            timed(cls, name)
    code = main(["bench", "dispatch", *sys.argv[1:]])
    for call, seconds in SECONDS.items():
        print(
            f"{call}: {len(seconds)} calls, {sum(seconds):.3f} s in all, "
            f"longest {max(seconds) * 1000:.1f} ms",
            file=sys.stderr,
        )
    sys.exit(code)
