"""What a simulated run measured: ``SimResult``, built from the engine's per-iteration records
and trace (``summarize``), with the same names as ``streamrl bench pipeline``."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from streamrl.records import PIPELINE_COLUMNS
from streamrl.sim.config import SimConfig
from streamrl.sim.instance import SimInstance
from streamrl.training.timeline import TraceRecorder, busy_fraction


@dataclass
class SimResult:
    """What a simulated run measured (same names as ``streamrl bench pipeline``).

    Attributes:
        samples_per_s: samples per iteration over the median iteration time.
        iteration_s / gen_s / train_s: medians over the measured iterations.
        trainer_idle_frac / generator_idle_frac: idle share of the measured window.
        exposed_sync_s: median weight-transfer time the trainer was blocked on.
        cost_per_sample: GPU price x time per sample.
        token_lag_mean: mean over measured iterations of the mean trained token's staleness
            (the real bench's ``token_lag_mean``); ``token_lag_max`` the largest.
        recompute_s: generator seconds spent re-prefilling running samples (partial rollout
            ``"recompute"``), the whole run, every instance.
        per_iteration: one dict per iteration (times, instances, elastic decision).
        trace: the spans.
    """

    samples_per_s: float
    iteration_s: float
    gen_s: float
    train_s: float
    trainer_idle_frac: float
    generator_idle_frac: float
    exposed_sync_s: float
    cost_per_sample: float
    token_lag_mean: float = 0.0
    token_lag_max: int = 0
    recompute_s: float = 0.0
    per_iteration: list[dict] = field(default_factory=list)
    trace: TraceRecorder = field(default_factory=TraceRecorder)

    def summary(self) -> dict:
        """The scalar results, rounded, as a JSON-ready dict."""
        keys = (*PIPELINE_COLUMNS, "cost_per_sample")
        return {k: round(float(getattr(self, k)), 6) for k in keys}


def summarize(
    config: SimConfig, iters: list[dict], trace: TraceRecorder, instances: list[SimInstance]
) -> SimResult:
    """Medians over the measured iterations (after ``config.warmup``) of a finished run.

    A re-prefill has no span of its own (the trace format knows no such stage): the running
    samples' ``generate`` spans cover it, and ``recompute_s`` sums it."""
    measured = iters[config.warmup :]
    start, end = measured[0]["start_s"], measured[-1]["end_s"]
    spans = trace.spans
    lanes = sorted({s.lane for s in spans if s.lane.startswith("generator-")})
    gen_busy = [busy_fraction(spans, lane, start, end) for lane in lanes]
    samples = config.workload.samples
    iteration_s = statistics.median(it["iteration_s"] for it in measured)
    return SimResult(
        samples_per_s=samples / iteration_s,
        iteration_s=iteration_s,
        gen_s=statistics.median(it["gen_s"] for it in measured),
        train_s=statistics.median(it["train_s"] for it in measured),
        trainer_idle_frac=1.0 - busy_fraction(spans, "trainer", start, end),
        generator_idle_frac=1.0 - statistics.mean(gen_busy) if gen_busy else 1.0,
        exposed_sync_s=statistics.median(it["exposed_sync_s"] for it in measured),
        cost_per_sample=_cost(config, measured) / (samples * len(measured)),
        token_lag_mean=statistics.mean(it["token_lag_mean"] for it in measured),
        token_lag_max=max(it["token_lag_max"] for it in measured),
        recompute_s=sum(inst.recompute_s for inst in instances),
        per_iteration=iters,
        trace=trace,
    )


def lag_stats(lags: dict[int, int]) -> dict:
    """An iteration's trained tokens by staleness (``{lag: tokens}``) -> their mean staleness
    (the real ``train/token_staleness_mean``) and the largest."""
    total = sum(lags.values())
    mean = sum(lag * n for lag, n in lags.items()) / total if total else 0.0
    return {
        "token_lag_mean": mean,
        "token_lag_max": max((k for k, n in lags.items() if n), default=0),
    }


def _cost(config: SimConfig, measured: list[dict]) -> float:
    gen, trainer = config.generators, config.trainer
    total = 0.0
    for it in measured:
        gen_price = it["instances"] * gen.gpus_per_instance * gen.price_per_gpu_s
        train_price = trainer.gpus * trainer.price_per_gpu_s
        if config.mode == "colocated":  # the same GPUs do both stages
            price = max(gen_price, train_price)
        else:
            price = gen_price + train_price
        total += price * (it["end_s"] - it["start_s"])
    return total
