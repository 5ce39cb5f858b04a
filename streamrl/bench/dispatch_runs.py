"""A dispatch bench's batch as requests, and its plans generated for real (``streamrl bench
dispatch`` without ``--simulate``): every row's wall-clock makespan, the requests its planner
moved, and where each run's samples ran (``instance_loads``: per instance, its samples, their
tokens, the widest and when it finished), StreamRL §5.3's placement made visible."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

from streamrl.bench.settings import DispatchBench
from streamrl.components.generation.service import StreamGenerationService
from streamrl.components.skewness.schedulers import LPTScheduler
from streamrl.records import Request, Sample


def prompt_id(index: int) -> str:
    """The bench's id of its ``index``-th prompt."""
    return f"p{index}"


def requests_for(
    prompt_ids: list[list[int]], true: list[list[int]], iteration: int = 0
) -> list[Request]:
    """One request per sample: prompt ``i``'s sample ``j`` is forced to ``true[i][j]`` tokens;
    every request has the same budget (the longest), which tells nothing about its own."""
    cap = max(n for lengths in true for n in lengths)
    return [
        Request(prompt_id(i), ids, cap, sample_index=j, forced_length=n, iteration=iteration)
        for i, (ids, lengths) in enumerate(zip(prompt_ids, true))
        for j, n in enumerate(lengths)
    ]


def per_sample(scores: list[float] | None, true: list[list[int]]) -> list[float] | None:
    """Per-prompt scores repeated for each of the prompt's samples (the oracle's are already
    per sample)."""
    if scores is None or len(scores) == sum(map(len, true)):
        return scores
    return [score for score, lengths in zip(scores, true) for _ in lengths]


def run_real(
    plans: dict, settings: DispatchBench, prompt_ids, true, model_dir: Path
) -> tuple[dict[str, float], dict[str, int], dict[str, list[list[dict]]]]:
    """Median wall-clock makespan and requests moved of each row over ``settings.repeats``
    generations, and where each measured generation's samples ran (``instance_loads``).

    One service serves every row, the rows interleaved in each repeat so that drift on a
    shared machine hits them alike. Its instances admit LPT: requests without a prediction
    (random dispatch) keep submission order, i.e. FIFO.
    """
    times: dict[str, list[float]] = {label: [] for label in plans}
    moves: dict[str, list[int]] = {label: [] for label in plans}
    loads: dict[str, list[list[dict]]] = {label: [] for label in plans}
    with StreamGenerationService(
        model_dir,
        settings.instances,
        max_batch_size=settings.max_batch_size,
        temperature=1.0,  # as its figures were measured
        scheduler=LPTScheduler,
    ) as sgs:
        runs = [(None, *next(iter(plans.items())))]  # one unmeasured warm-up run
        runs += [
            (label, label, plan) for _ in range(settings.repeats) for label, plan in plans.items()
        ]
        for iteration, (measured, _, (dispatcher, scores)) in enumerate(runs):
            sgs.dispatcher = dispatcher
            requests = requests_for(prompt_ids, true, iteration)
            moved = sgs.counts["requests_moved"]
            started, wall = time.perf_counter(), time.time()
            samples = list(sgs.generate(requests, per_sample(scores, true)))
            if measured is not None:
                times[measured].append(time.perf_counter() - started)
                moves[measured].append(sgs.counts["requests_moved"] - moved)
                loads[measured].append(instance_loads(samples, wall))
    return (
        {label: statistics.median(t) for label, t in times.items()},
        {label: statistics.median(m) for label, m in moves.items()},
        loads,
    )


def instance_loads(samples: list[Sample], started: float) -> list[dict]:
    """Where one generation's samples ran: per instance, its samples, their tokens, the widest
    (on the HF engine every row of a batch pays for it at each step) and when its last sample
    finished, in seconds from ``started`` (wall clock, as the samples' timestamps)."""
    by_instance: dict[int, list[Sample]] = {}
    for sample in samples:
        by_instance.setdefault(sample.instance_id, []).append(sample)
    return [
        {
            "instance": instance,
            "samples": len(ran),
            "tokens": sum(s.length for s in ran),
            "widest": max(s.length for s in ran),
            "end_s": round(max(s.finished_s for s in ran) - started, 3),
        }
        for instance, ran in sorted(by_instance.items())
    ]


def print_instance_loads(loads: dict[str, list[list[dict]]]) -> None:
    """Each row's runs, one line each, on stderr (``instance_loads``)."""
    for label, runs in loads.items():
        for n, run in enumerate(runs, start=1):
            where = " | ".join(
                f"instance {i['instance']}: {i['samples']} samples, {i['tokens']} tokens, "
                f"widest {i['widest']}, done {i['end_s']:.2f} s"
                for i in run
            )
            print(f"  {label} run {n}: {where}", file=sys.stderr)
