"""Pipeline timelines: record what each generator instance and the trainer did, and when.

A timeline shows pipeline bubbles (idle gaps) at a glance where logs only list durations. The
pieces: ``Span`` (one timed stage on one lane), ``TraceRecorder`` (collects spans in bounded
memory and writes a JSON trace), ``load_trace`` / ``busy_fraction`` (read a trace back and
measure it), ``draw_timeline`` (a Gantt chart PNG) and ``add_timeline_command`` (the
``streamrl timeline TRACE`` sub-command).
"""

from __future__ import annotations

import argparse
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

STAGES = ("generate", "train", "step", "sync", "sync-bg", "wait", "colocated-switch")
"""The stage names a span may carry (one colour each on the chart)."""

# A "wait" span marks the trainer blocked on samples: it is the bubble itself, not work.
IDLE_STAGES = frozenset({"wait"})

TRACE_VERSION = 1
# Same order as STAGES; "wait" in grey, as it is idle time.
_COLOURS = dict(
    zip(STAGES, ("#1f77b4", "#ff7f0e", "#d62728", "#9467bd", "#c5b0d5", "#c7c7c7", "#8c564b"))
)
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
    if trace["version"] != TRACE_VERSION:
        raise ConfigError(f"{path}: unsupported trace version {trace['version']!r}.")
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


def _iteration_starts(spans: Sequence[Span]) -> dict[int, float]:
    """The earliest start of each iteration's trainer spans (of any spans, without a trainer)."""
    tagged = [s for s in spans if s.iteration >= 0]
    on_trainer = [s for s in tagged if s.lane == "trainer"]
    starts: dict[int, float] = {}
    for s in on_trainer or tagged:
        starts[s.iteration] = min(starts.get(s.iteration, s.start_s), s.start_s)
    return starts


def draw_timeline(spans: Sequence[Span], path: str | Path, title: str = "") -> Path:
    """Draw ``spans`` as a Gantt chart PNG: one row per lane, one colour per stage.

    Overlapping spans on a generator lane are semi-transparent, so a batch of concurrent
    samples shows darker; dashed lines mark where each iteration's training starts.

    Returns:
        ``path``.
    """
    if not spans:
        raise ValueError("No spans to draw: the trace is empty.")
    # The Agg canvas directly, not pyplot: no global backend switch (which would break an
    # interactive session that imports this module) and no figure left open afterwards.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    lanes = sorted({s.lane for s in spans}, key=lane_order)
    t0 = min(s.start_s for s in spans)
    t_end = max(s.end_s for s in spans)
    fig = Figure(figsize=(12, max(2.8, 0.55 * len(lanes) + 1.9)), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    _draw_bars(ax, spans, lanes, t0)
    for iteration, start in sorted(_iteration_starts(spans).items()):
        ax.axvline(start - t0, color="0.3", linestyle="--", linewidth=0.8, zorder=3)
        ax.annotate(
            f"it {iteration}",
            (start - t0, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(2, 2),
            textcoords="offset points",
            fontsize=8,
            color="0.3",
        )
    labels = [f"{lane} (busy {busy_fraction(spans, lane):.0%})" for lane in lanes]
    ax.set_yticks(range(len(lanes)), labels)
    ax.set_ylim(len(lanes) - 0.5, -0.5)  # first lane on top
    ax.set_xlim(0, max(t_end - t0, 1e-9))
    ax.set_xlabel("seconds since the first span")
    ax.grid(axis="x", color="0.9", zorder=0)
    ax.set_axisbelow(True)
    if title:
        ax.set_title(title, pad=14)
    names = [name for name in STAGES if any(s.name == name for s in spans)]
    handles = [Patch(color=_COLOURS[name], label=name) for name in names]
    # Outside the axes, below them, so it never covers bars.
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), frameon=False)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, bbox_inches="tight")
    return path


def _draw_bars(ax, spans: Sequence[Span], lanes: list[str], t0: float) -> None:
    rows = {lane: i for i, lane in enumerate(lanes)}
    bars: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for s in spans:
        bars.setdefault((s.lane, s.name), []).append((s.start_s - t0, s.end_s - s.start_s))
    for (lane, name), ranges in bars.items():
        concurrent = lane.startswith("generator-")
        ax.broken_barh(
            ranges,
            (rows[lane] - 0.35, 0.7),
            facecolor=_COLOURS[name],
            alpha=0.35 if concurrent else 0.95,
            zorder=2,
            # A thin white edge separates back-to-back trainer stages (micro-batches).
            edgecolor="none" if concurrent else "white",
            linewidth=0.4,
        )


def add_timeline_command(subparsers: argparse._SubParsersAction) -> None:
    """Register ``timeline TRACE [-o PNG] [--title T]`` on an argparse subparsers object."""
    parser = subparsers.add_parser(
        "timeline", help="draw a pipeline timeline (Gantt chart PNG) from a trace JSON"
    )
    parser.add_argument("trace", metavar="TRACE", help="trace JSON written by TraceRecorder")
    parser.add_argument("-o", "--output", help="PNG path (default: TRACE with a .png suffix)")
    parser.add_argument("--title", default=None, help="chart title (default: the trace's name)")
    parser.set_defaults(func=run_timeline_command)


def run_timeline_command(args: argparse.Namespace) -> dict:
    """Load ``args.trace``, draw it; returns the PNG path, span count and busy fractions."""
    spans = load_trace(args.trace)
    if not spans:
        raise ConfigError(f"{args.trace} holds no spans: nothing to draw.")
    output = args.output or Path(args.trace).with_suffix(".png")
    title = Path(args.trace).name if args.title is None else args.title
    path = draw_timeline(spans, output, title)
    lanes = sorted({s.lane for s in spans}, key=lane_order)
    return {
        "png": str(path),
        "spans": len(spans),
        "lanes": {lane: round(busy_fraction(spans, lane), 4) for lane in lanes},
    }
