"""``streamrl sim validate``: calibrate the simulator on one real run, then predict other runs.

StreamRL §4.2 rests on a profiler-based estimation model ``P``: "a few profiling runs model
training and generation time accurately". This module tests that claim for our simulator out of
sample, on this machine, against the real ``streamrl bench pipeline`` code:

1. **Profile** (micro-benchmarks, no bench run): the real generator backend's latency, twice
   (``Profiler``): the old ``PTL(BS)`` table on short prompts, and the model of batch size and
   context (issue 47: ``Profiler.fit_grid``, a step's cost growing with its widest row, and the
   prefills); and the trainer's cost per padded token on one (and, for colocated rows, two)
   torch threads (``streamrl.sim.calibrate.measure_trainer_cost``). Each latency model is
   calibrated and simulated on its own, so every row shows the old model beside the new; the
   new one also knows the machine's cores (``SimConfig.cores``: while more processes compute
   than there are cores, each runs ``computing / cores`` times slower), shown beside the same
   model without them.
2. **Calibrate on one real configuration** (``bench.pipeline.run_mode``, a sync run). From its
   trace come what the micro-benchmarks cannot see: the generator's slowdown beside a computing
   trainer (contention: the one factor for which the simulated ``gen_s`` equals the real one),
   one factor on the trainer's cost (the real step also builds loss inputs and runs Lightning's
   hooks), the blocking weight update and the training loop's own time per iteration.
3. **Predict** every other configuration (other lengths, batch, micro-batch budget, instance
   count, generator slots, mode: a ``bench.pipeline.BENCH_MODES`` name, the asynchronous
   variants with their staleness bound and partial-rollout policy included): run it fresh for
   real, simulate it with the calibrated model, compare samples/s (and the mean token staleness).
   Rows with partial rollout ``"recompute"`` add one micro-benchmark: the real generator's
   re-prefill cost per padded token (``calibrate.measure_recompute_cost``).

Nothing is fitted to the predicted rows, and no stored number is on the "real" side.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from streamrl.components.capacity.allocator import TrainerCostModel
from streamrl.components.skewness.latency import LatencyModel
from streamrl.runtime.cores import usable_cores
from streamrl.sim.bench_rows import (
    CALIBRATION,
    LENGTH_SETS,
    MAX_BATCH_SIZE,
    PREDICTED,
    BenchConfig,
    bench_mode,
    fat_tail_lengths,
    shipped_lengths,
    sim_mode_fields,
)
from streamrl.sim.calibrate import (
    DEFAULT_SHAPES,
    PROMPT_TOKENS,
    measure_recompute_cost,
    measure_trainer_cost,
)
from streamrl.sim.config import GeneratorPool, SimConfig, TrainerPool, Workload
from streamrl.sim.engine import simulate

#: Micro-batch shapes timed by a quick calibration (the full one times ``DEFAULT_SHAPES``).
QUICK_SHAPES = ((4, 16), (16, 32), (8, 128), (32, 64))
PROFILE_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
#: Prompt widths of the context model's grid: the bench's prompts, then rows that have grown
#: through the shipped and the fat-tail lengths (up to 200 tokens).
PROFILE_CONTEXTS = (PROMPT_TOKENS, 64, 160)


__all__ = [  # the rows live in ``bench_rows``; importable from here as before
    "CALIBRATION",
    "LENGTH_SETS",
    "MAX_BATCH_SIZE",
    "PREDICTED",
    "BenchConfig",
    "Calibration",
    "bench_mode",
    "fat_tail_lengths",
    "fit_calibration",
    "shipped_lengths",
    "sim_config",
    "sim_mode_fields",
    "validate",
]


@dataclass
class Calibration:
    """The simulator's inputs, measured on this machine (see the module docstring).

    Attributes:
        latency: ``PTL(BS)`` of one generator process alone.
        trainer / colocated_trainer: cost per micro-batch on one / two threads, micro-benchmark
            times ``trainer_scale``.
        slowdown: ``PTL`` multiplier while other processes compute (fitted on the run's gen_s).
        trainer_scale: real train_s over the micro-benchmark's prediction of it.
        sync_s: the blocking weight update (median of the run's exposed sync).
        overhead_s: loop time per iteration outside wait, train and sync (median residual).
        prefill_s_per_token: a re-prefill's cost per padded token (partial rollout
            ``"recompute"``; micro-benchmark, 0 when no row needs it).
        cores: the cores the real runs had (``usable_cores``), which their processes share
            (``SimConfig.cores``); 0: none shared, one slowdown for every row.
    """

    latency: LatencyModel
    trainer: TrainerCostModel
    colocated_trainer: TrainerCostModel | None
    slowdown: float
    trainer_scale: float
    sync_s: float
    overhead_s: float
    prefill_s_per_token: float = 0.0
    cores: int = 0

    def to_dict(self) -> dict:
        fields = asdict(self)
        per_token = fields.pop("prefill_s_per_token")
        out = {k: round(v, 5) for k, v in fields.items() if isinstance(v, float)}
        out["ptl_ms"] = [round(p * 1000, 3) for p in self.latency.ptl_s]
        out["cores"] = self.cores
        out["trainer_s_per_token"] = self.trainer.s_per_token
        out["prefill_us_per_token"] = round(per_token * 1e6, 4)
        return out


def run_real(
    config: BenchConfig, model_dir: Path, iterations: int, warmup: int, seed: int = 0
) -> dict:
    """One fresh real run of ``config`` through ``bench.pipeline.run_mode`` (no trace kept)."""
    from streamrl.bench.pipeline import run_mode
    from streamrl.bench.settings import PipelineBench

    settings = PipelineBench(
        seed=seed,
        batch=config.batch,
        group_size=config.group_size,
        warmup=warmup,
        iterations=iterations,
        generators=config.instances,
        colocated_generators=config.instances,
        max_batch_size=config.max_batch_size,
        max_tokens_per_micro_batch=config.token_budget,
    )
    result = run_mode(config.mode, model_dir, LENGTH_SETS[config.lengths](), settings)
    result.pop("_trace", None)
    return result


def sim_config(config: BenchConfig, cal: Calibration, iterations: int, warmup: int) -> SimConfig:
    """``config`` as the simulator sees it, with the calibrated inputs."""
    table = LENGTH_SETS[config.lengths]()

    def cycled(iteration: int) -> list[int]:  # the bench cycles its lengths, one per prompt
        return [table[(iteration * config.batch + j) % len(table)] for j in range(config.batch)]

    # The colocated generators slow down as much as a disaggregated generator beside the
    # trainer (an assumption, not a fit); processes beyond the cores share them (``cores``).
    generators = GeneratorPool(
        cal.latency,
        config.instances,
        config.max_batch_size,
        slowdown=cal.slowdown,
        colocated_slowdown=cal.slowdown,
        # A fixed admission cost where the model prices no prefill of its own (``PTL(BS)``).
        prefill_s=0.0 if cal.latency.prices_context else cal.latency.ptl(1),
        prefill_s_per_token=cal.prefill_s_per_token,
    )
    trainer = TrainerPool(cal.trainer, 1, token_budget=config.token_budget)
    workload = Workload(cycled, config.batch, config.group_size, PROMPT_TOKENS, ranker_noise=0.0)
    return SimConfig(
        generators,
        trainer,
        workload,
        **sim_mode_fields(config.mode),
        dispatch="round_robin",
        admission="fifo",
        iterations=iterations,
        warmup=warmup,
        sync_latency_s=cal.sync_s,
        colocated_cost=cal.colocated_trainer,
        colocated_token_budget=config.token_budget,
        iteration_overhead_s=cal.overhead_s,
        labels={"config": config.name},
        cores=cal.cores,
    )


def _scaled(cost: TrainerCostModel, factor: float) -> TrainerCostModel:
    return replace(
        cost,
        s_per_token=cost.s_per_token * factor,
        microbatch_overhead_s=cost.microbatch_overhead_s * factor,
        step_s=cost.step_s * factor,
    )


def fit_calibration(
    config: BenchConfig,
    real: dict,
    latency: LatencyModel,
    trainer: TrainerCostModel,
    colocated_trainer: TrainerCostModel | None,
    iterations: int,
    warmup: int,
    prefill_s_per_token: float = 0.0,
    cores: int = 0,
) -> Calibration:
    """Fit contention, the trainer factor, sync and loop time on one real ``sync`` run.

    Args:
        config: the calibration configuration (its mode must be ``sync``, where generation
            and training take turns: the slowdown fitted to ``gen_s``, the generation phase
            from first admission to last finish, real and simulated alike, is the contention).
        real: ``run_real``'s medians for it.
        latency / trainer / colocated_trainer: the micro-benchmarks' models.
        prefill_s_per_token: the re-prefill micro-benchmark's cost per token (kept as it is).
        cores: the cores the real runs had (``SimConfig.cores``; 0: none shared).

    Raises:
        ValueError: ``config`` is not a sync run.
    """
    if config.mode != "sync":
        raise ValueError(f"Calibrate on a sync run (got {config.mode!r}): its phases take turns.")
    overhead = max(
        0.0,
        real["iteration_s"]
        - real["train_s"]
        - real["exposed_sync_s"]
        - real["trainer_idle_frac"] * real["iteration_s"],
    )
    cal = Calibration(
        latency,
        trainer,
        colocated_trainer,
        1.0,
        1.0,
        real["exposed_sync_s"],
        overhead,
        prefill_s_per_token,
        cores,
    )
    lo, hi = 0.25, 8.0  # gen_s grows with the slowdown: bisect it onto the real gen_s
    for _ in range(30):
        cal.slowdown = (lo * hi) ** 0.5
        gen_s = simulate(sim_config(config, cal, iterations, warmup)).gen_s
        lo, hi = (cal.slowdown, hi) if gen_s < real["gen_s"] else (lo, cal.slowdown)
    if not 0.26 < cal.slowdown < 7.9:
        raise ValueError(
            f"Calibration: no slowdown in [0.25, 8] makes the simulated gen_s match the real "
            f"{real['gen_s']:.3f} s (stuck at {cal.slowdown:.2f}); the profile or the simulator's "
            "generator model is off. Re-run on a quieter machine or check the PTL profile."
        )
    train_s = simulate(sim_config(config, cal, iterations, warmup)).train_s
    cal.trainer_scale = real["train_s"] / train_s  # train_s is linear in the cost model
    cal.trainer = _scaled(trainer, cal.trainer_scale)
    if colocated_trainer is not None:
        cal.colocated_trainer = _scaled(colocated_trainer, cal.trainer_scale)
    return cal


def profile(
    quick: bool, two_threads: bool
) -> tuple[dict[str, LatencyModel], TrainerCostModel, TrainerCostModel | None]:
    """The micro-benchmarks: both latency models (``"context"``, of batch size and context;
    ``"ptl"``, ``PTL(BS)`` on short prompts as before issue 47) and the trainer's cost on one
    (and two) threads."""
    from streamrl.components.skewness.profiler import Profiler
    from streamrl.sim.calibrate import _tiny_policy

    policy, tokenizer = _tiny_policy()
    prompt = tokenizer("copy abcdefgh=")["input_ids"]
    profiler = Profiler(policy, prompt, tokens=32, repeats=1 if quick else 3)
    sizes = PROFILE_BATCH_SIZES[::2] if quick else PROFILE_BATCH_SIZES
    context, _ = profiler.fit_grid(sizes, PROFILE_CONTEXTS, "widest")  # as the HF engine pays
    models = {"context": context, "ptl": profiler.fit(PROFILE_BATCH_SIZES)}
    shapes, repeats = (QUICK_SHAPES, 2) if quick else (DEFAULT_SHAPES, 5)
    one = measure_trainer_cost(1, shapes, repeats)
    two = measure_trainer_cost(2, shapes, repeats) if two_threads else None
    return models, one, two


def profile_recompute(quick: bool) -> float:
    """The re-prefill micro-benchmark: seconds per padded token (``measure_recompute_cost``)."""
    from streamrl.sim.calibrate import RECOMPUTE_SHAPES, _tiny_policy

    policy, tokenizer = _tiny_policy()
    prompt = tokenizer("copy abcdefgh=")["input_ids"]
    shapes = RECOMPUTE_SHAPES[::2] if quick else RECOMPUTE_SHAPES
    _, per_token = measure_recompute_cost(policy, prompt, shapes, 1 if quick else 3)
    return per_token


def interleaved_runs(
    configs: Sequence[BenchConfig],
    model_dir: Path,
    iterations: int,
    warmup: int,
    repeats: int,
    seed: int = 0,
) -> dict[str, dict]:
    """Each configuration's real medians over ``repeats`` fresh runs, taken in rounds: one run
    of every configuration per round. A machine whose speed drifts over the minutes of a
    validation (a shared host, another tenant) then slows every configuration alike, instead
    of the ones that happened to run in its slow minutes. (It leaves the spread between single
    runs: docs/simulator.md has a row measured at 66 and 115 samples/s minutes apart.)"""
    runs: dict[str, list[dict]] = {c.name: [] for c in configs}
    for round_ in range(repeats):
        for config in configs:
            print(
                f"real run {round_ + 1}/{repeats}: {config.name} ({config.describe()})",
                file=sys.stderr,
                flush=True,
            )
            runs[config.name].append(run_real(config, model_dir, iterations, warmup, seed))
    return {name: _median_runs(each) for name, each in runs.items()}


def _median_runs(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def validate(
    predicted: Sequence[BenchConfig] = tuple(PREDICTED.values()),
    calibration: BenchConfig = CALIBRATION,
    iterations: int = 6,
    warmup: int = 1,
    repeats: int = 3,
    quick: bool = False,
    seed: int = 0,
) -> dict:
    """Calibrate on ``calibration``, then run and simulate every ``predicted`` configuration.

    Args:
        predicted: the out-of-sample configurations.
        calibration: the one real run the model is fitted on (a sync run).
        iterations / warmup: measured and unmeasured iterations of every run (real and sim).
        repeats: real runs per configuration (medians).
        quick: fewer profiling repeats and micro-batch shapes (for tests).

    Returns:
        ``{"calibration": {...}, "rows": {name: {real, sim, error, ...}}, "max_abs_error"}``
        for the new model (context, processes sharing the cores); the same keys ending in
        ``_unshared`` for the context model alone (one slowdown for every row), and in ``_ptl``
        for the old ``PTL(BS)`` one, each calibrated on the same real run.
    """
    from streamrl.bench import model_dir_for

    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    variants = {c.mode: bench_mode(c.mode) for c in (calibration, *predicted)}  # fail early
    say("profiling the generator (PTL(BS), and over batch sizes x contexts) and the trainer ...")
    latencies, one, two = profile(quick, any(c.mode == "colocated" for c in predicted))
    recompute = any(v.partial_rollout == "recompute" for v in variants.values())
    per_token = profile_recompute(quick) if recompute else 0.0
    cores = usable_cores()  # the real runs' processes share them
    # The new model (context, processes sharing the cores), the context model alone, and the
    # old one (PTL(BS), one slowdown for every row), each calibrated on the same real run.
    variants = {
        "context": (latencies["context"], cores),
        "unshared": (latencies["context"], 0),
        "ptl": (latencies["ptl"], 0),
    }
    rows = {}
    with tempfile.TemporaryDirectory(prefix="streamrl-validate-") as tmp:
        model_dir = model_dir_for("tiny", Path(tmp), seed)
        configs = (calibration, *predicted)
        real = interleaved_runs(configs, model_dir, iterations, warmup, repeats, seed)
        fitted_on = real[calibration.name]
        cals = {
            name: fit_calibration(
                calibration, fitted_on, model, one, two, iterations, warmup, per_token, shared
            )
            for name, (model, shared) in variants.items()
        }
        rows[calibration.name] = _row(calibration, fitted_on, cals, iterations, warmup, True)
        for config in predicted:
            rows[config.name] = _row(config, real[config.name], cals, iterations, warmup)
    result = {"rows": rows, "iterations": iterations, "warmup": warmup, "repeats": repeats}
    for name, cal in cals.items():
        tail = _suffix(name)
        errors = [abs(r[f"error{tail}"]) for r in rows.values() if not r["fitted"]]
        result[f"calibration{tail}"] = cal.to_dict()
        result[f"max_abs_error{tail}"] = round(max(errors), 4) if errors else None
    print_table(result)
    return result


# Plain keys for the new model's results; the others' end in ``_<variant>``.
def _suffix(model: str) -> str:
    return "" if model == "context" else f"_{model}"


def _row(
    config: BenchConfig,
    real: dict,
    cals: dict[str, Calibration],
    iterations: int,
    warmup: int,
    fitted: bool = False,
) -> dict:
    """One row: the real medians beside each calibrated model's simulation (the context
    model's keys plain, the others' suffixed with their name)."""
    row = {
        "config": config.describe(),
        "fitted": fitted,
        "real": round(real["samples_per_s"], 2),
        "real_gen_s": round(real["gen_s"], 3),
        "real_train_s": round(real["train_s"], 3),
        "real_token_lag": round(real.get("token_lag_mean", 0.0), 3),
    }
    for name, cal in cals.items():
        sim, tail = simulate(sim_config(config, cal, iterations, warmup)), _suffix(name)
        row[f"sim{tail}"] = round(sim.samples_per_s, 2)
        row[f"error{tail}"] = round(sim.samples_per_s / real["samples_per_s"] - 1, 4)
        row[f"sim_gen_s{tail}"] = round(sim.gen_s, 3)
        row[f"sim_train_s{tail}"] = round(sim.train_s, 3)
        row[f"sim_token_lag{tail}"] = round(sim.token_lag_mean, 3)
    return row


def print_table(result: dict) -> None:
    """The validation table on stderr: real vs simulated samples/s and the relative error of
    each model the result holds (the new one, the context model alone, the old ``PTL(BS)``)."""
    tails = {  # each model the result holds: its name, its keys' suffix
        k.removeprefix("calibration").removeprefix("_") or "context": k.removeprefix("calibration")
        for k in result
        if k.startswith("calibration")
    }
    for name, tail in tails.items():
        cal = result[f"calibration{tail}"]
        print(
            f"calibrated ({name}): slowdown {cal['slowdown']:.3f}, trainer "
            f"x{cal['trainer_scale']:.3f}, sync {cal['sync_s']:.3f} s, loop "
            f"{cal['overhead_s']:.3f} s/iteration, PTL ms {cal['ptl_ms']}",
            file=sys.stderr,
        )
    head = "".join(f"{'sim/s ' + n:>16}{'error':>8}" for n in tails)
    print(
        f"{'config':<19}{'setting':<68}{'real/s':>8}{head}{'lag real':>10}{'lag sim':>9}",
        file=sys.stderr,
    )
    for name, row in result["rows"].items():
        tag = f"{name}*" if row["fitted"] else name
        sims = "".join(f"{row['sim' + t]:>16.1f}{row['error' + t]:>+8.1%}" for t in tails.values())
        print(
            f"{tag:<19}{row['config']:<68}{row['real']:>8.1f}{sims}"
            f"{row['real_token_lag']:>10.3f}{row['sim_token_lag']:>9.3f}",
            file=sys.stderr,
        )
    print("* fitted on this run (in-sample); the other rows are out of sample", file=sys.stderr)
    for name, tail in tails.items():
        if result.get(f"max_abs_error{tail}") is not None:
            worst = result[f"max_abs_error{tail}"]
            print(f"largest out-of-sample error ({name}): {worst:.1%}", file=sys.stderr)
