"""Draw a run's timeline (``streamrl.training.timeline`` spans) so it stays readable at any length.

Up to ``full_iterations`` iterations (60 by default) the chart is one Gantt chart of the whole
run: a row per lane, a colour per stage, a dashed line where each iteration's training starts.
Its ``it N`` labels are thinned to every 1, 2, 5, 10, 20, ... iterations so that, measured in
pixels at the axes' width, no two overlap.

Beyond that a Gantt chart is a smear (200 iterations leave a few pixels each), so the chart
summarises instead, in three panels:

1. the trainer's seconds per iteration, stacked by stage: the bubbles (``wait``), the periodic
   gaps (``checkpoint``, ``eval``) and time no span recorded stand out as taller bars;
2. each generator's busy share per iteration (overlapping samples counted once);
3. the last ``detail_iterations`` iterations in full, as the Gantt chart above (the steady state,
   where a run spends its time).

Every colour, shade and mark drawn has a legend entry below the chart.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path

from streamrl.training.timeline import STAGES, Span, busy_fraction, lane_order

DETAIL_ITERATIONS = 10
"""The iterations a summarised chart draws in full, the last ones."""

# Same order as STAGES; "wait" in pale grey, as it is idle time.
COLOURS = dict(
    zip(
        STAGES,
        (
            *("#1f77b4", "#ff7f0e", "#d62728", "#9467bd", "#c5b0d5", "#c7c7c7", "#8c564b"),
            *("#2ca02c", "#17becf"),
        ),
    )
)
UNRECORDED_COLOUR = "white"
# What each stage means, in the legend (a reader should not need the docs to read the chart).
LEGEND_LABELS = {
    "generate": "generate: one sample (darker: several at once)",
    "train": "train: a micro-batch's forward/backward",
    "step": "optimizer step",
    "sync": "weight sync (trainer waits)",
    "sync-bg": "weight transfer (background)",
    "wait": "wait: trainer idle, no samples yet",
    "colocated-switch": "switch generate <-> train",
    "checkpoint": "checkpoint save",
    "eval": "held-out evaluation",
}
GAP_STAGES = frozenset({"checkpoint", "eval"})  # hatched: the trainer's work between iterations
GENERATOR_ALPHA = 0.35  # overlapping samples on a generator lane add up to a darker shade
LABEL_STEPS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)
ITERATION_LABEL = "iteration-label"  # the gid of the "it N" labels (tests find them by it)


def draw_timeline(
    spans: Sequence[Span], path: str | Path, title: str = "", *, full_iterations: int = 60
) -> Path:
    """Draw ``spans`` as a timeline PNG: the whole run as a Gantt chart, or a summary past
    ``full_iterations`` iterations (see the module's docstring).

    Returns:
        ``path``.

    Raises:
        ValueError: ``spans`` is empty.
    """
    fig = timeline_figure(spans, title, full_iterations=full_iterations)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, bbox_inches="tight")
    return path


def timeline_figure(spans: Sequence[Span], title: str = "", *, full_iterations: int = 60):
    """The ``matplotlib.figure.Figure`` that ``draw_timeline`` saves (drawn on an Agg canvas)."""
    if not spans:
        raise ValueError("No spans to draw: the trace is empty.")
    # The Agg canvas directly, not pyplot: no global backend switch (which would break an
    # interactive session that imports this module) and no figure left open afterwards.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    lanes = sorted({s.lane for s in spans}, key=lane_order)
    starts = iteration_starts(spans)
    summarise = len(starts) > full_iterations
    gantt_height = 0.55 * len(lanes) + 1.2
    height = gantt_height + 1.4 + (4.6 if summarise else 0.0)
    fig = Figure(figsize=(12, height), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    if summarise:
        ratios = (2.2, 1.3, gantt_height)
        overview, busy, detail = fig.subplots(3, 1, height_ratios=ratios)
        windows = _windows(spans, starts)
        _draw_trainer_seconds(overview, spans, windows)
        _draw_generator_busy(busy, spans, lanes, windows)
        first = sorted(starts)[-DETAIL_ITERATIONS]
        detail_title = f"the last {DETAIL_ITERATIONS} iterations in full"
        gantt = _draw_gantt(detail, spans, lanes, starts, from_s=starts[first], title=detail_title)
    else:
        gantt = _draw_gantt(fig.add_subplot(), spans, lanes, starts, from_s=None, title="")
    if title:
        fig.suptitle(title)
    _legend(fig, spans, with_unrecorded=summarise)
    fig.canvas.draw()  # lays the axes out: the labels are thinned at their final width
    _label_iterations(gantt, {i: t for i, t in starts.items() if t >= gantt.t_from})
    return fig


def iteration_starts(spans: Sequence[Span]) -> dict[int, float]:
    """The earliest start of each iteration's trainer spans (of any spans, without a trainer)."""
    tagged = [s for s in spans if s.iteration >= 0]
    on_trainer = [s for s in tagged if s.lane == "trainer"]
    starts: dict[int, float] = {}
    for s in on_trainer or tagged:
        starts[s.iteration] = min(starts.get(s.iteration, s.start_s), s.start_s)
    return starts


class _Gantt:
    """A drawn Gantt axes and the time it starts at (seconds since the first span)."""

    def __init__(self, ax, t0: float, t_from: float) -> None:
        self.ax, self.t0, self.t_from = ax, t0, t_from


def _draw_gantt(
    ax, spans: Sequence[Span], lanes: list[str], starts: dict[int, float], from_s, title: str
) -> _Gantt:
    """Spans ending after ``from_s`` (all: ``None``) as bars, and a dashed line per iteration."""
    t0 = min(s.start_s for s in spans)
    t_from = t0 if from_s is None else from_s
    t_end = max(s.end_s for s in spans)
    shown = [s for s in spans if s.end_s > t_from]
    _draw_bars(ax, shown, lanes, t0, t_from)
    for start in starts.values():
        if start >= t_from:
            ax.axvline(start - t0, color="0.35", linestyle="--", linewidth=0.6, zorder=3)
    labels = [f"{lane} (busy {busy_fraction(spans, lane):.0%})" for lane in lanes]
    ax.set_yticks(range(len(lanes)), labels)
    ax.set_ylim(len(lanes) - 0.5, -0.5)  # first lane on top
    ax.set_xlim(t_from - t0, max(t_end - t0, t_from - t0 + 1e-9))
    ax.set_xlabel("seconds since the first span")
    ax.grid(axis="x", color="0.9", zorder=0)
    ax.set_axisbelow(True)
    ax.set_title(title, pad=14, fontsize=10)  # the pad leaves room for the "it N" labels
    return _Gantt(ax, t0, t_from)


def _draw_bars(ax, spans: Sequence[Span], lanes: list[str], t0: float, t_from: float) -> None:
    rows = {lane: i for i, lane in enumerate(lanes)}
    bars: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for s in spans:
        start = max(s.start_s, t_from)
        bars.setdefault((s.lane, s.name), []).append((start - t0, s.end_s - start))
    # A thin white edge separates back-to-back trainer stages (micro-batches), where they are
    # a few pixels wide; hundreds of them would turn the lane white.
    edges = sum(len(r) for (lane, _), r in bars.items() if lane == "trainer") <= 300
    for (lane, name), ranges in bars.items():
        concurrent, gap = lane.startswith("generator-"), name in GAP_STAGES
        edge = "white" if edges and not concurrent else "none"
        ax.broken_barh(
            ranges,
            (rows[lane] - 0.35, 0.7),
            facecolor=COLOURS[name],
            alpha=GENERATOR_ALPHA if concurrent else 0.95,
            zorder=2,
            # A gap's hatch takes the edge colour (matplotlib < 3.10): dark, as in the legend.
            edgecolor="0.2" if gap else edge,
            linewidth=0.0 if gap else 0.4,
            hatch="//" if gap else None,
        )


def _label_iterations(gantt: _Gantt, starts: dict[int, float]) -> None:
    """Label the dashed lines ``it N``, every 1, 2, 5, 10, ... iterations: the smallest step
    whose labels all fit between each other, measured in pixels (iterations can differ in
    length); past the largest step, any label that would touch the previous one is left out."""
    ax = gantt.ax
    renderer = ax.figure.canvas.get_renderer()
    pad_px, offset_pt = 6.0, 2.0
    widest = ax.text(0, 0, f"it {max(starts, default=0)}", fontsize=8)
    label_px = widest.get_window_extent(renderer).width + pad_px
    widest.remove()
    x_px = {i: ax.transData.transform((t - gantt.t0, 0))[0] for i, t in starts.items()}
    step = next((n for n in LABEL_STEPS if _fits(x_px, n, label_px)), LABEL_STEPS[-1])
    right_px = float("-inf")
    for iteration in sorted(starts):
        if iteration % step:
            continue
        left = x_px[iteration] + offset_pt * ax.figure.dpi / 72
        if left < right_px + pad_px:
            continue
        text = ax.annotate(
            f"it {iteration}",
            (starts[iteration] - gantt.t0, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(offset_pt, 2),
            textcoords="offset points",
            fontsize=8,
            color="0.3",
            gid=ITERATION_LABEL,
        )
        text.set_in_layout(False)  # laid out already: the title's pad holds them
        right_px = text.get_window_extent(renderer).x1


def _fits(x_px: dict[int, float], step: int, label_px: float) -> bool:
    """Whether labels every ``step`` iterations, ``label_px`` wide, leave each other room."""
    xs = sorted(x for i, x in x_px.items() if i % step == 0)
    return all(b - a >= label_px for a, b in pairwise(xs))


def _windows(spans: Sequence[Span], starts: dict[int, float]) -> list[tuple[int, float, float]]:
    """``(iteration, from_s, to_s)`` per iteration: from its training's start to the next one's
    (the first from the first span, the last to the last span's end)."""
    order = sorted(starts)
    edges = [starts[i] for i in order]
    edges[0] = min(s.start_s for s in spans)
    edges.append(max(s.end_s for s in spans))
    return [(it, edges[k], edges[k + 1]) for k, it in enumerate(order)]


def _draw_trainer_seconds(ax, spans: Sequence[Span], windows) -> None:
    """Panel 1: the trainer's seconds per iteration window, stacked by stage, then the time no
    trainer span covers (Lightning, logging: hollow)."""
    froms = [lo for _, lo, _ in windows]
    seconds: dict[str, list[float]] = {}
    for s in spans:
        if s.lane == "trainer":
            k = max(bisect_right(froms, s.start_s) - 1, 0)
            seconds.setdefault(s.name, [0.0] * len(windows))[k] += s.end_s - s.start_s
    x = [it for it, _, _ in windows]
    bottom = [0.0] * len(windows)
    for name in [n for n in STAGES if n in seconds]:
        hatch = "//" if name in GAP_STAGES else None
        ax.bar(x, seconds[name], 0.8, bottom, color=COLOURS[name], hatch=hatch, linewidth=0)
        bottom = [b + v for b, v in zip(bottom, seconds[name])]
    unrecorded = [max(hi - lo - b, 0.0) for (_, lo, hi), b in zip(windows, bottom)]
    ax.bar(x, unrecorded, 0.8, bottom, color=UNRECORDED_COLOUR, edgecolor="0.5", linewidth=0.4)
    ax.set_xlim(x[0] - 0.6, x[-1] + 0.6)
    ax.set_ylabel("trainer s")
    ax.set_title("the trainer's time per iteration, by stage", fontsize=10)
    ax.grid(axis="y", color="0.9")
    ax.set_axisbelow(True)


def _draw_generator_busy(ax, spans: Sequence[Span], lanes: list[str], windows) -> None:
    """Panel 2: each generator lane's busy share of each iteration window."""
    x = [it for it, _, _ in windows]
    for lane in lanes:
        if lane == "trainer":
            continue
        own = [s for s in spans if s.lane == lane]
        busy = [100 * busy_fraction(own, lane, lo, hi) for _, lo, hi in windows]
        ax.plot(x, busy, linewidth=1.0, label=lane)
    ax.set_xlim(x[0] - 0.6, x[-1] + 0.6)
    ax.set_ylim(0, 105)
    ax.set_ylabel("busy %")
    ax.set_xlabel("iteration")
    ax.set_title("each generator's busy share per iteration", fontsize=10)
    ax.grid(color="0.9")
    if ax.lines:
        ax.legend(loc="lower left", fontsize=8, ncol=min(len(ax.lines), 6))


def _legend(fig, spans: Sequence[Span], with_unrecorded: bool) -> None:
    """One entry per stage in ``spans`` (with its shade on a generator lane), the iteration
    lines, and the summary's hollow "not recorded" bars; below the axes, never on bars."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    present = {(s.name, s.lane.startswith("generator-")) for s in spans}
    handles = []
    for name in STAGES:
        on_generator = (name, True) in present
        if on_generator or (name, False) in present:
            alpha = GENERATOR_ALPHA if on_generator and (name, False) not in present else 0.95
            hatch = "//" if name in GAP_STAGES else None
            label = LEGEND_LABELS[name]
            handles.append(Patch(facecolor=COLOURS[name], alpha=alpha, hatch=hatch, label=label))
    iteration = Line2D([], [], color="0.35", linestyle="--", label="an iteration starts (it N)")
    handles.append(iteration)
    if with_unrecorded:
        label = "no span (Lightning, logging)"
        handles.append(Patch(facecolor=UNRECORDED_COLOUR, edgecolor="0.5", label=label))
    ncol = min(len(handles), 4)
    fig.legend(handles=handles, loc="outside lower center", ncol=ncol, frameon=False, fontsize=9)
