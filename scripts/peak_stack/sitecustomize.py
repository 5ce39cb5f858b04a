"""Where a process's memory peaks: its resident memory sampled every 10 ms, with the main
thread's Python stack at every new peak.

Python imports ``sitecustomize`` at start-up from ``PYTHONPATH``, so every process of a run
(trainer ranks, generator instances, workers) samples itself when ``PEAK_PROBE_DIR`` is set:

    PEAK_PROBE_DIR=/tmp/peaks PYTHONPATH=scripts/peak_stack \\
        streamrl fit --config configs/qwen0.5b-cpu.yaml

Each process writes ``peak-<pid>.json`` there about once a second: ``peak`` (the largest
``VmRSS`` seen, when, and the stack then) and ``timeline`` (time, ``VmRSS``, the innermost frames)
at every change of 50 MB. A peak is sampled, so a spike shorter than 10 ms can be missed, and the
stack is where the main thread was when the sample was taken (a C++ operation that allocated
from another thread shows the Python frame waiting on it). Unset, it does nothing.
"""

import os

if os.environ.get("PEAK_PROBE_DIR"):
    import json
    import sys
    import threading
    import time
    import traceback

    def _rss() -> int:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0

    def _frames(frame, depth: int) -> str:
        stack = traceback.extract_stack(frame)[-depth:]
        return " < ".join(
            f"{os.path.basename(s.filename)}:{s.lineno}:{s.name}" for s in reversed(stack)
        )

    def _sample() -> None:
        main = threading.main_thread().ident
        path = os.path.join(os.environ["PEAK_PROBE_DIR"], f"peak-{os.getpid()}.json")
        started, written, best = time.time(), 0.0, 0
        peak: dict = {}
        timeline: list = []
        while True:
            time.sleep(0.01)
            rss, now = _rss(), time.time() - started
            frame = sys._current_frames().get(main)
            if not timeline or abs(rss - timeline[-1][1]) > 50 * 2**20:
                timeline.append((round(now, 2), rss, _frames(frame, 6) if frame else ""))
            if rss > best:
                best = rss
                stack = traceback.format_stack(frame)[-25:] if frame else []
                peak = {"rss": rss, "t": round(now, 2), "stack": stack, "argv": sys.argv}
            if now - written > 1.0:
                written = now
                with open(path, "w") as out:
                    json.dump({"peak": peak, "timeline": timeline}, out)

    threading.Thread(target=_sample, daemon=True, name="peak-probe").start()
