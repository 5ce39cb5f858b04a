"""Pipeline timelines: record what each generator instance and the trainer did, and when.

A timeline shows pipeline bubbles (idle gaps) at a glance where logs only list durations. The
pieces: ``Span`` (one timed stage on one lane), ``TraceRecorder`` (collects spans in bounded
memory and writes a JSON trace), ``load_trace`` / ``busy_fraction`` (read a trace back and
measure it). ``streamrl.training.timeline_chart`` draws them (``draw_timeline``, a Gantt chart
PNG, which ``streamrl timeline TRACE`` runs).
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from streamrl.errors import ConfigError, unknown_name
from streamrl.records import Sample

STAGES = (
    "generate",
    "train",
    "step",
    "sync",
    "sync-bg",
    "wait",
    "colocated-switch",
    "checkpoint",
    "eval",
)
"""The stage names a span may carry (one colour each on the chart). ``"checkpoint"`` and
``"eval"`` are the trainer saving a checkpoint and evaluating on held-out rows: the periodic
gaps between iterations."""

# A "wait" span marks the trainer blocked on samples: it is the bubble itself, not work.
IDLE_STAGES = frozenset({"wait"})

TRACE_VERSION = 2
"""The version ``TraceRecorder.to_json`` writes. 2 added the ``"checkpoint"`` and ``"eval"``
stages (a version-1 reader would reject them); the file layout is the same."""
READABLE_TRACE_VERSIONS = (1, 2)
"""The versions ``load_trace`` reads: a version-1 trace is a version-2 one without those stages."""
_SPAN_KEYS = ("lane", "name", "start_s", "end_s")


@dataclass
class Span:
    """One stage on one lane, in wall-clock seconds (``time.time()``).

    Attributes:
        lane: the row it belongs to, e.g. ``"generator-0"`` or ``"trainer"``.
        name: the stage, one of ``STAGES``.
        start_s / end_s: when it started and ended.
        iteration: the RL iteration it belongs to, ``-1`` if none.
        meta: a small JSON-serialisable dict (e.g. ``prompt_id``, ``length``).
    """

    lane: str
    name: str
    start_s: float
    end_s: float
    iteration: int = -1
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.name not in STAGES:
            raise ValueError(unknown_name("span stage", self.name, STAGES))
        if self.end_s < self.start_s:
            raise ValueError(f"Span {self.lane}/{self.name} ends before it starts.")


class TraceRecorder:
    """Collects spans in bounded memory; safe to call from several threads.

    Args:
        max_spans: the most spans kept. Beyond it the oldest are dropped (and counted), so a
            long run cannot exhaust memory; the newest part of the timeline is the one kept.
    """

    def __init__(self, max_spans: int = 50_000) -> None:
        if max_spans < 1:
            raise ValueError(f"max_spans must be at least 1, got {max_spans}.")
        self._spans: deque[Span] = deque(maxlen=max_spans)
        self._recorded = 0
        self._lock = threading.Lock()

    def add(self, span: Span) -> None:
        """Record ``span`` (dropping the oldest one when full)."""
        with self._lock:
            self._spans.append(span)
            self._recorded += 1

    @contextlib.contextmanager
    def span(self, lane: str, name: str, iteration: int = -1, **meta) -> Iterator[dict]:
        """Time the ``with`` block as one span; yields its ``meta`` dict to add to.

        The span is recorded even if the block raises, so a failed stage still shows up.
        """
        start = time.time()
        try:
            yield meta
        finally:
            # max(): the wall clock can step back (NTP); a timing aid must never raise.
            self.add(Span(lane, name, start, max(time.time(), start), iteration, meta))

    def add_samples(self, samples: Iterable[Sample], iteration: int) -> int:
        """Record each sample's decoding, admission to finish, on ``generator-<instance_id>``.

        Samples without timestamps (``started_s`` unset) are skipped: placed at the epoch they
        would stretch the chart over decades.

        Returns:
            The number of spans added.
        """
        added = 0
        for s in samples:
            if s.started_s <= 0 or s.finished_s < s.started_s:
                continue
            meta = {
                "prompt_id": s.prompt_id,
                "sample_index": s.sample_index,
                "length": s.length,
                "weight_version": s.weight_version,
            }
            lane = f"generator-{s.instance_id}"
            self.add(Span(lane, "generate", s.started_s, s.finished_s, iteration, meta))
            added += 1
        return added

    @property
    def spans(self) -> list[Span]:
        """The kept spans, oldest first."""
        with self._lock:
            return list(self._spans)

    @property
    def recorded(self) -> int:
        """How many spans were ever added, dropped ones included."""
        return self._recorded

    @property
    def dropped(self) -> int:
        """How many of the oldest spans were dropped to stay within ``max_spans``."""
        with self._lock:
            return self._recorded - len(self._spans)

    def busy_fraction(
        self, lane: str, start_s: float | None = None, end_s: float | None = None
    ) -> float:
        """See the module-level ``busy_fraction``."""
        return busy_fraction(self.spans, lane, start_s, end_s)

    def to_json(self, path: str | Path) -> Path:
        """Write the trace as ``{"version", "t0", "dropped", "spans"}``; returns the path."""
        with self._lock:  # one snapshot, so "dropped" matches "spans"
            spans, dropped = list(self._spans), self._recorded - len(self._spans)
        trace = {
            "version": TRACE_VERSION,
            "t0": min((s.start_s for s in spans), default=None),
            "dropped": dropped,
            "spans": [asdict(s) for s in spans],
        }
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(trace))
        return path


def load_trace(path: str | Path) -> list[Span]:
    """Read the spans of a trace written by ``TraceRecorder.to_json``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ConfigError: (a ``ValueError``) the file is not a trace; the message says what is missing.
    """
    path = Path(path)
    try:
        trace = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path} is not a timeline trace: not valid JSON ({err}).") from err
    if not isinstance(trace, dict):
        raise ConfigError(f"{path} is not a timeline trace: expected a JSON object.")
    missing = [key for key in ("version", "spans") if key not in trace]
    if missing:
        raise ConfigError(
            f"{path} is not a timeline trace: missing key(s) {', '.join(missing)}. "
            "Traces are written by TraceRecorder.to_json."
        )
    if trace["version"] not in READABLE_TRACE_VERSIONS:
        raise ConfigError(
            f"{path}: unsupported trace version {trace['version']!r} (this streamrl reads "
            f"{', '.join(map(str, READABLE_TRACE_VERSIONS))}); upgrade streamrl to read it."
        )
    if not isinstance(trace["spans"], list):
        raise ConfigError(f"{path}: 'spans' must be a list.")
    return [_span_from_dict(item, i, path) for i, item in enumerate(trace["spans"])]


def _span_from_dict(item: object, index: int, path: Path) -> Span:
    where = f"{path}: span #{index}"
    if not isinstance(item, dict):
        raise ConfigError(f"{where} is not a JSON object.")
    missing = [key for key in _SPAN_KEYS if key not in item]
    if missing:
        raise ConfigError(f"{where} is missing {', '.join(missing)}.")
    try:
        lane, name, start, end = (item[key] for key in _SPAN_KEYS)
        iteration, meta = int(item.get("iteration", -1)), dict(item.get("meta") or {})
        return Span(str(lane), str(name), float(start), float(end), iteration, meta)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{where}: {err}") from err


def busy_fraction(
    spans: Sequence[Span], lane: str, start_s: float | None = None, end_s: float | None = None
) -> float:
    """The fraction of ``[start_s, end_s]`` covered by ``lane``'s spans.

    Overlapping spans count once (a generator decodes many samples at a time), and ``"wait"``
    spans count as idle. The window defaults to the extent of all spans, every lane included,
    so lanes are measured against the same stretch of time.
    """
    if start_s is None:
        start_s = min((s.start_s for s in spans), default=0.0)
    if end_s is None:
        end_s = max((s.end_s for s in spans), default=0.0)
    if end_s <= start_s:
        return 0.0
    clipped = (
        (max(s.start_s, start_s), min(s.end_s, end_s))
        for s in spans
        if s.lane == lane and s.name not in IDLE_STAGES
    )
    intervals = sorted((lo, hi) for lo, hi in clipped if hi > lo)  # drop spans outside the window
    busy, reach = 0.0, start_s  # reach: the end of the union so far
    for lo, hi in intervals:
        if hi > reach:
            busy += hi - max(lo, reach)
            reach = hi
    return busy / (end_s - start_s)


def mean_running(spans: Sequence[Span], lane: str, start_s: float, end_s: float) -> float:
    """How many of ``lane``'s spans are open at once on average over ``[start_s, end_s]``: a
    generator's mean number of running sequences (its batch occupancy; a long tail run at a
    small batch lowers it, while ``busy_fraction`` still counts the lane busy)."""
    if end_s <= start_s:
        return 0.0
    covered = sum(
        max(0.0, min(s.end_s, end_s) - max(s.start_s, start_s))
        for s in spans
        if s.lane == lane and s.name not in IDLE_STAGES
    )
    return covered / (end_s - start_s)


def lane_order(lane: str) -> tuple:
    """Sort key: generators by numeric id first, other lanes by name, the trainer last."""
    match = re.fullmatch(r"generator-(\d+)", lane)
    if match:
        return (0, int(match.group(1)), "")
    return (2, 0, "") if lane == "trainer" else (1, 0, lane)


def trainer_span(
    module: object, name: str, iteration: int = -1, **meta
) -> contextlib.AbstractContextManager:
    """Time a block as a ``name`` span on the ``"trainer"`` lane of ``module.trace`` (a
    ``StreamRLModule``'s recorder); a no-op where ``module`` has no ``TraceRecorder``.

    Callbacks use it for the trainer's work outside ``training_step`` (``"checkpoint"``,
    ``"eval"``), so the timeline labels those gaps instead of leaving them blank.
    """
    trace = getattr(module, "trace", None)
    if not isinstance(trace, TraceRecorder):
        return contextlib.nullcontext({})
    return trace.span("trainer", name, iteration, **meta)
