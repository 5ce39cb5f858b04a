"""Pipeline timelines: span recording, trace files, busy fractions and the Gantt chart."""

from __future__ import annotations

import json
import time

import pytest

from streamrl.cli.main import parse_command
from streamrl.records import Sample
from streamrl.training.timeline import (
    STAGES,
    TRACE_VERSION,
    Span,
    TraceRecorder,
    busy_fraction,
    load_trace,
    mean_running,
    trainer_span,
)
from streamrl.training.timeline_chart import (
    ITERATION_LABEL,
    LEGEND_LABELS,
    draw_timeline,
    timeline_figure,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _sample(instance_id: int, started: float, finished: float, index: int = 0) -> Sample:
    return Sample(
        prompt_id=f"p{index}",
        sample_index=index,
        prompt_ids=[1, 2],
        token_ids=[3, 4, 5],
        logprobs=[-0.1] * 3,
        weight_version=7,
        instance_id=instance_id,
        submitted_s=started - 0.5,
        started_s=started,
        finished_s=finished,
    )


def _pipeline(iterations: int = 3, gaps_every: int = 0) -> list[Span]:
    """Two generators and a trainer: generate, wait, train, step, sync per iteration (5 s),
    and every ``gaps_every`` iterations a 3 s checkpoint and a 4 s evaluation after it."""
    spans, t = [], 100.0
    for it in range(iterations):
        if gaps_every and it % gaps_every == gaps_every - 1:
            spans += [
                Span("trainer", "checkpoint", t + 5.0, t + 8.0, it),
                Span("trainer", "eval", t + 8.0, t + 12.0, it),
            ]
        spans += [
            Span("generator-0", "generate", t, t + 2.0, it),
            Span("generator-0", "generate", t + 0.5, t + 3.0, it),
            Span("generator-1", "generate", t, t + 4.0, it),
            Span("trainer", "wait", t, t + 1.0, it),
            Span("trainer", "train", t + 1.0, t + 4.0, it),
            Span("trainer", "step", t + 4.0, t + 4.5, it),
            Span("trainer", "sync", t + 4.5, t + 5.0, it),
        ]
        t += 12.0 if gaps_every and it % gaps_every == gaps_every - 1 else 5.0
    return spans


def test_busy_fraction_counts_overlaps_once():
    spans = [
        Span("g", "generate", 0.0, 2.0),
        Span("g", "generate", 1.0, 3.0),
        Span("g", "generate", 5.0, 6.0),
        Span("other", "generate", 0.0, 10.0),  # another lane does not count
    ]
    assert busy_fraction(spans, "g", 0.0, 10.0) == pytest.approx(0.4)
    assert busy_fraction(spans, "g", 2.0, 6.0) == pytest.approx(0.5)  # clipped to the window
    assert busy_fraction(spans, "g", 0.0, 4.0) == pytest.approx(0.75)  # [5, 6] lies outside
    assert busy_fraction(spans, "g") == pytest.approx(0.4)  # default window: the whole trace
    # Occupancy counts every open span: two running at once over [1, 2].
    assert mean_running(spans, "g", 0.0, 4.0) == pytest.approx((2 + 2) / 4)
    assert mean_running(spans, "g", 1.0, 2.0) == pytest.approx(2.0)
    assert mean_running(spans, "g", 6.0, 6.0) == 0.0
    assert busy_fraction(spans, "missing") == 0.0


def test_busy_fraction_treats_wait_as_idle():
    spans = [Span("trainer", "wait", 0.0, 3.0), Span("trainer", "train", 3.0, 4.0)]
    assert busy_fraction(spans, "trainer") == pytest.approx(0.25)


def test_recorder_busy_fraction_matches_function():
    recorder = TraceRecorder()
    for span in _pipeline():
        recorder.add(span)
    assert recorder.busy_fraction("generator-0") == pytest.approx(9.0 / 15.0)


def test_span_rejects_unknown_stage_and_reversed_times():
    with pytest.raises(ValueError, match="did you mean 'train'"):
        Span("trainer", "trian", 0.0, 1.0)
    with pytest.raises(ValueError, match="ends before it starts"):
        Span("trainer", "train", 2.0, 1.0)


def test_bounded_recorder_drops_oldest_and_counts():
    recorder = TraceRecorder(max_spans=3)
    for i in range(5):
        recorder.add(Span("trainer", "train", float(i), i + 0.5, iteration=i))
    assert [s.iteration for s in recorder.spans] == [2, 3, 4]
    assert recorder.dropped == 2
    assert recorder.recorded == 5


def test_span_context_manager_times_block_even_on_error():
    recorder = TraceRecorder()
    before = time.time()
    with recorder.span("trainer", "step", iteration=4, tokens=12) as meta:
        meta["extra"] = True
    with pytest.raises(RuntimeError), recorder.span("trainer", "sync", iteration=4):
        raise RuntimeError("boom")
    step, sync = recorder.spans
    assert (step.lane, step.name, step.iteration) == ("trainer", "step", 4)
    assert step.meta == {"tokens": 12, "extra": True}
    assert before <= step.start_s <= step.end_s <= sync.start_s <= sync.end_s <= time.time()
    assert sync.name == "sync"


def test_add_samples_builds_generator_lanes():
    recorder = TraceRecorder()
    samples = [_sample(0, 10.0, 12.0, 0), _sample(1, 10.5, 11.0, 1), _sample(0, 11.0, 13.0, 2)]
    unstamped = _sample(2, 0.0, 0.0)  # never admitted: no timestamps, must not reach the chart
    assert recorder.add_samples([*samples, unstamped], iteration=3) == 3
    spans = recorder.spans
    assert [s.lane for s in spans] == ["generator-0", "generator-1", "generator-0"]
    assert [(s.start_s, s.end_s) for s in spans] == [(10.0, 12.0), (10.5, 11.0), (11.0, 13.0)]
    assert all(s.name == "generate" and s.iteration == 3 for s in spans)
    assert spans[1].meta == {"prompt_id": "p1", "sample_index": 1, "length": 3, "weight_version": 7}


def test_json_round_trip(tmp_path):
    recorder = TraceRecorder(max_spans=20)
    for span in _pipeline():
        recorder.add(span)
    recorder.add(Span("generator-0", "generate", 90.0, 91.0, meta={"prompt_id": "x", "length": 5}))
    path = recorder.to_json(tmp_path / "sub" / "trace.json")
    raw = json.loads(path.read_text())
    assert raw["version"] == TRACE_VERSION and raw["dropped"] == 2
    assert raw["t0"] == min(s.start_s for s in recorder.spans)
    assert load_trace(path) == recorder.spans


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"spans": []}', "missing key.*version"),
        ('{"epochs": 3, "loss": 0.1}', "missing key.*version, spans"),
        ("[1, 2]", "expected a JSON object"),
        ("not json", "not valid JSON"),
        (
            '{"version": 1, "spans": [{"lane": "trainer", "name": "train"}]}',
            "#0 is missing start_s",
        ),
        ('{"version": 3, "spans": []}', "unsupported trace version 3.*reads 1, 2"),
    ],
)
def test_load_trace_rejects_non_traces(tmp_path, content, message):
    path = tmp_path / "metrics.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=f"{message}"):
        load_trace(path)


def test_draw_timeline_writes_png(tmp_path):
    import matplotlib.image

    path = draw_timeline(_pipeline(), tmp_path / "timeline.png", title="three iterations")
    assert path == tmp_path / "timeline.png"
    assert path.read_bytes()[:8] == PNG_MAGIC
    height, width = matplotlib.image.imread(path).shape[:2]
    assert width > 0 and height > 0


def test_draw_timeline_rejects_empty(tmp_path):
    with pytest.raises(ValueError, match="empty"):
        draw_timeline([], tmp_path / "empty.png")


def test_timeline_command_end_to_end(tmp_path):
    recorder = TraceRecorder()
    for span in _pipeline():
        recorder.add(span)
    trace = recorder.to_json(tmp_path / "run.json")
    _, run = parse_command(["timeline", str(trace)])
    result = run()
    assert result["png"] == str(tmp_path / "run.png")
    assert result["spans"] == 21
    assert result["lanes"] == pytest.approx(
        {"generator-0": 0.6, "generator-1": 0.8, "trainer": 0.8}
    )
    assert list(result["lanes"]) == ["generator-0", "generator-1", "trainer"]
    assert (tmp_path / "run.png").read_bytes()[:8] == PNG_MAGIC
    json.dumps(result)  # the CLI prints it as JSON

    out = tmp_path / "charts" / "custom.png"
    _, run = parse_command(["timeline", str(trace), "-o", str(out), "--title", "run 1"])
    assert run()["png"] == str(out) and out.read_bytes()[:8] == PNG_MAGIC


def test_version_1_traces_still_load(tmp_path):
    span = {"lane": "trainer", "name": "train", "start_s": 1.0, "end_s": 2.0, "iteration": 0}
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"version": 1, "t0": 1.0, "dropped": 0, "spans": [span]}))
    assert load_trace(path) == [Span("trainer", "train", 1.0, 2.0, 0)]


def _drawn(figure):
    figure.canvas.draw()
    return figure.canvas.get_renderer()


def _labels(figure) -> list:
    return [t for t in figure.findobj() if getattr(t, "get_gid", lambda: None)() == ITERATION_LABEL]


@pytest.mark.parametrize("iterations", [10, 60, 200])
def test_iteration_labels_never_overlap(iterations):
    figure = timeline_figure(_pipeline(iterations, gaps_every=10))
    renderer = _drawn(figure)
    labels = _labels(figure)
    boxes = [t.get_window_extent(renderer) for t in labels]
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            assert not a.overlaps(b), "two iteration labels overlap"
    numbers = [int(t.get_text().removeprefix("it ")) for t in labels]
    if iterations == 60:  # thinned to a round step, still several of them
        assert len(numbers) >= 5 and numbers[1] > 1 and all(n % numbers[1] == 0 for n in numbers)
    else:  # room for every one (200: the last 10, drawn in full): none left out
        assert numbers == list(range(iterations - 10, iterations))


def _legend_labels(figure) -> list[str]:
    return [t.get_text() for legend in figure.legends for t in legend.get_texts()]


def test_legend_names_every_stage_shade_and_mark():
    spans = [
        *_pipeline(4, gaps_every=2),
        Span("weights", "sync-bg", 101.0, 102.0, 0),
        Span("trainer", "colocated-switch", 140.0, 141.0, 4),
    ]
    labels = _legend_labels(timeline_figure(spans))
    assert labels[: len(STAGES)] == [LEGEND_LABELS[name] for name in STAGES]  # all, in order
    assert "an iteration starts (it N)" in labels
    # Only what is drawn: no checkpoint, eval or background transfer in a plain trace.
    plain = _legend_labels(timeline_figure(_pipeline(3)))
    assert LEGEND_LABELS["checkpoint"] not in plain and LEGEND_LABELS["sync-bg"] not in plain
    assert LEGEND_LABELS["wait"] in plain


def test_long_run_draws_a_summary_and_the_last_iterations_in_full():
    assert len(timeline_figure(_pipeline(60, gaps_every=10)).axes) == 1  # 60: the full chart
    figure = timeline_figure(_pipeline(200, gaps_every=10))
    overview, busy, detail = figure.axes
    # Each iteration's stacked bar is its wall time: 5 s, 12 s after a checkpoint and eval.
    heights: dict[int, float] = {}
    for bar in overview.patches:
        it = round(bar.get_x() + bar.get_width() / 2)
        heights[it] = heights.get(it, 0.0) + bar.get_height()
    assert len(heights) == 200
    assert heights[0] == pytest.approx(5.0) and heights[9] == pytest.approx(12.0)
    assert heights[198] == pytest.approx(5.0) and heights[199] == pytest.approx(12.0)
    # Generator 0 decodes 3 s of each 5 s iteration, 3 s of the 12 s ones.
    line = next(line for line in busy.lines if line.get_label() == "generator-0")
    assert line.get_ydata()[0] == pytest.approx(60.0) and line.get_ydata()[9] == pytest.approx(25.0)
    assert [t.get_text() for t in _labels(figure)] == [f"it {i}" for i in range(190, 200)]
    # It starts at iteration 190: 190 iterations of 5 s and 19 gaps of 7 s after the first.
    assert detail.get_xlim()[0] == pytest.approx(190 * 5.0 + 19 * 7.0)
    assert "no span (Lightning, logging)" in _legend_labels(figure)


def test_trainer_span_records_on_the_module_trace():
    class Module:
        trace = TraceRecorder()

    with trainer_span(Module(), "checkpoint", 4, path="last.ckpt"):
        pass
    (span,) = Module.trace.spans
    assert (span.lane, span.name, span.iteration, span.meta) == (
        "trainer",
        "checkpoint",
        4,
        {"path": "last.ckpt"},
    )
    with trainer_span(object(), "eval"):  # no recorder: nothing to record, nothing raised
        pass


def test_checkpoint_saves_and_evaluations_are_spans(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from lightning.pytorch.callbacks import ModelCheckpoint

    from streamrl.eval.heldout import EvalResult
    from streamrl.eval.periodic import PeriodicEval
    from streamrl.training.checkpointing import CheckpointSchedule

    module = SimpleNamespace(trace=TraceRecorder(), weight_version=10, policy=None)
    trainer = SimpleNamespace(lightning_module=module, global_step=10, loggers=[])
    monkeypatch.setattr(ModelCheckpoint, "_save_checkpoint", lambda self, trainer, path: None)
    CheckpointSchedule(every=10).callback(tmp_path)._save_checkpoint(
        trainer, str(tmp_path / "last.ckpt")
    )
    result = EvalResult(1.0, 1.0, 3.0, 3.0, 3, 1.0, 4)
    PeriodicEval(lambda policy: result, every=10).run(trainer, module)
    names = [(s.name, s.iteration) for s in module.trace.spans]
    assert names == [("checkpoint", 9), ("eval", 9)]  # inside iteration 9, the one just done
