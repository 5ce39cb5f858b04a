"""The StreamRL simulator: hand-worked tiny runs, the trace format, the KV-cache batch bound, the
asynchronous variants (staleness bound k, partial rollout finish / keep / recompute), and an
out-of-sample validation against fresh real runs (``streamrl sim validate``, small, slow).
"""

from __future__ import annotations

import numpy as np
import pytest

from streamrl.components.capacity.allocator import TrainerCostModel
from streamrl.components.capacity.elastic import ElasticController
from streamrl.components.skewness.batching import decode_schedule
from streamrl.components.skewness.latency import LatencyModel
from streamrl.components.skewness.schedulers import FIFOScheduler
from streamrl.records import Request
from streamrl.sim.config import GeneratorPool, SimConfig, TrainerPool, Workload
from streamrl.sim.engine import simulate
from streamrl.sim.hardware import H800, LINK_GBPS, QWEN25, decode_latency, kv_batch_limit
from streamrl.sim.instance import SimInstance
from streamrl.sim.presets import paper_config, paper_lengths
from streamrl.sim.validate import (
    CALIBRATION,
    PREDICTED,
    Calibration,
    fit_calibration,
    sim_config,
    sim_mode_fields,
    validate,
)
from streamrl.training.timeline import load_trace

# PTL 1.0 s per step alone, 1.5 s with two running.
TWO_POINT = LatencyModel([1, 2], [1.0, 1.5])


def tiny_config(mode: str, lengths: list[int], s_per_token: float, budget: int, **kw) -> SimConfig:
    """One instance, one sample per prompt, a trainer at ``s_per_token`` per token."""
    generators = GeneratorPool(kw.pop("latency", TWO_POINT), 1, 8)
    trainer = TrainerPool(TrainerCostModel(s_per_token), 1, token_budget=budget)
    workload = Workload(lambda it: list(lengths), len(lengths), 1, 0, ranker_noise=0.0)
    return SimConfig(generators, trainer, workload, mode=mode, iterations=3, warmup=1, **kw)


def test_decode_schedule_two_samples():
    # Lengths 2 and 4 together: 2 steps at BS 2 (1.5 s each) -> the short one ends at 3.0;
    # then 2 steps at BS 1 (1.0 s each) -> 5.0.
    assert decode_schedule([2, 4], 8, TWO_POINT) == [(0.0, 3.0), (0.0, 5.0)]
    # One slot: the second waits for the first (2 s), then runs 4 s alone.
    assert decode_schedule([2, 4], 1, TWO_POINT) == [(0.0, 2.0), (2.0, 6.0)]


def test_one_instance_two_samples_exact_makespan_and_streaming():
    # Budget 1 token: each sample trains on arrival (0.5 s/token): the 2-token sample arrives at
    # 3.0 and trains 3.0-4.0; the 4-token one arrives at 5.0 and trains 5.0-7.0 -> 7.0 s.
    streamed = simulate(tiny_config("sync", [2, 4], 0.5, budget=1))
    assert streamed.gen_s == pytest.approx(5.0)
    assert streamed.iteration_s == pytest.approx(7.0)
    # A huge budget trains both after generation ends: 5.0 + (2 + 4) x 0.5 = 8.0 s.
    batched = simulate(tiny_config("sync", [2, 4], 0.5, budget=10**6))
    assert batched.iteration_s == pytest.approx(8.0)
    # Colocated: the same, plus two GPU switches of 0.25 s: 8.5 s.
    colocated = simulate(tiny_config("colocated", [2, 4], 0.5, budget=1, switch_s=0.25))
    assert colocated.iteration_s == pytest.approx(8.5)


def test_processes_beyond_the_cores_share_them_hand_computed():
    # The same run on one core: the instance decodes [2, 4] alone (3.0 s to the short one's end).
    # The trainer's 2 tokens then compute beside it: 1.0 s of work at half speed, 3.0-5.0, while
    # the instance decodes 1 of its 2 last tokens (1.0 s a step, at half speed); alone again it
    # finishes at 6.0, and the trainer's 4 tokens take 2.0 s alone: 8.0 s.
    shared = simulate(tiny_config("sync", [2, 4], 0.5, budget=1, cores=1))
    assert shared.gen_s == pytest.approx(6.0)
    assert shared.iteration_s == pytest.approx(8.0)
    # Two cores hold both processes: as with a device each (7.0 s above).
    spread = simulate(tiny_config("sync", [2, 4], 0.5, budget=1, cores=2))
    assert (spread.gen_s, spread.iteration_s) == pytest.approx((5.0, 7.0))


def test_async_overlaps_generation_with_training():
    # Generation of one 10-token sample takes 10 s; training it takes 10 s. Sync: 20 s per
    # iteration. Async: batch k+1 is generated while batch k trains -> max(10, 10) = 10 s.
    const = LatencyModel([1], [1.0])
    sync = simulate(tiny_config("sync", [10], 1.0, budget=1, latency=const))
    asyn = simulate(tiny_config("async", [10], 1.0, budget=1, latency=const))
    assert sync.iteration_s == pytest.approx(20.0)
    assert asyn.iteration_s == pytest.approx(10.0)
    assert asyn.trainer_idle_frac == pytest.approx(0.0, abs=1e-9)


def test_weight_transfer_is_bytes_over_bandwidth():
    const = LatencyModel([1], [1.0])
    kw = dict(latency=const, weight_bytes=1e9, link_gbps=80.0)  # 8 Gbit / 80 Gbit/s = 0.1 s
    sync = simulate(tiny_config("sync", [10], 1.0, budget=1, **kw))
    assert sync.exposed_sync_s == pytest.approx(0.1)
    assert sync.iteration_s == pytest.approx(20.1)
    asyn = simulate(tiny_config("async", [10], 1.0, budget=1, **kw))
    assert asyn.exposed_sync_s == 0.0
    background = [s for s in asyn.trace.spans if s.name == "sync-bg"]
    assert background and all(s.end_s - s.start_s == pytest.approx(0.1) for s in background)
    # The paper's 72B weights (bf16) over the 80 Gbps cross-datacenter link: >= 14.4 s.
    seconds = QWEN25["72b"].weight_bytes * 8 / (LINK_GBPS["cross-dc"] * 1e9)
    assert seconds == pytest.approx(14.54, abs=0.01)


def test_trace_is_the_real_format(tmp_path):
    result = simulate(tiny_config("sync", [2, 4], 0.5, budget=1))
    spans = load_trace(result.trace.to_json(tmp_path / "trace.json"))
    lanes = {s.lane for s in spans}
    assert {"generator-0", "trainer"} <= lanes
    assert {s.name for s in spans} >= {"generate", "train", "step", "sync"}


def test_elastic_adds_instances_when_generation_lags():
    const = LatencyModel([1], [0.01])
    config = tiny_config("async", [100] * 8, 1e-4, budget=1, latency=const)
    config.generators.max_batch_size = 1  # 8 rounds of 1 s on one instance; training 0.08 s
    config.iterations = 8
    config.elastic = ElasticController(const, max_batch_size=1, max_instances=4)
    result = simulate(config)
    counts = [it["instances"] for it in result.per_iteration]
    assert counts[0] == 1 and counts[-1] == 4 and counts == sorted(counts)


def test_paper_lengths_shape():
    lengths = np.asarray(paper_lengths(20000, 20000, seed=0))
    assert lengths.max() <= 20000 and 5000 < lengths.mean() < 7000
    assert 2000 < np.median(lengths) < 4500  # a peak around 2-3K, a fat tail
    short = paper_lengths(1000, 5000, seed=0)  # the 5K set: the same draw scaled by 1/4
    assert max(short) <= 5000
    assert np.mean(short) == pytest.approx(np.mean(paper_lengths(1000, 20000, 0)) / 4, rel=0.01)


def test_decode_latency_scaling():
    seven = decode_latency(QWEN25["7b"])
    assert seven.ptl(1) == pytest.approx(0.0083)  # the paper's table, unchanged
    big = decode_latency(QWEN25["72b"])  # 72.7/7.62/4 TP x 8.3 ms + 80 x 2 x 12 us
    assert big.ptl(1) == pytest.approx(72.7 / 7.62 / 4 * 0.0083 + 160 * 12e-6, rel=1e-6)


def test_kv_batch_limit_hand_computed():
    # 72B on a TP-4 H800 instance: 0.9 x 80 GB x 4 = 288 GB, minus 2 x 72.7e9 bytes of bf16
    # weights = 142.6 GB free. K and V of one token: 2 x 80 layers x 8 heads x 128 x 2 bytes =
    # 327,680 bytes. Prompt 400 + max output 20,000 = 20,400 tokens = 6.685 GB per sequence:
    # 142.6 / 6.685 = 21.3 -> 21 sequences.
    assert QWEN25["72b"].kv_bytes_per_token == 327_680
    assert kv_batch_limit(QWEN25["72b"], H800, 20_400) == 21
    # 7B (4 KV heads, 28 layers, TP 1): 72 GB - 15.24 GB = 56.76 GB; 57,344 B/token x 20,400 =
    # 1.170 GB -> 48. The [8, 512] clamp: a 1-token context would give ~990,000.
    assert kv_batch_limit(QWEN25["7b"], H800, 20_400) == 48
    assert kv_batch_limit(QWEN25["7b"], H800, 1) == 512


def test_paper_72b_20k_instances_need_more_than_one_batch():
    # Colocated: 128 GPUs / TP 4 = 32 instances for 1024 samples, 32 each on average, but only 21
    # fit the KV cache at once: the second round is what LPT and skew dispatch reorder (Table 3).
    config = paper_config("paper-72b-20k", "colocated", iterations=1)
    gen = config.generators
    assert gen.max_batch_size == 21 and gen.instances == 32
    assert config.workload.samples / gen.instances > gen.max_batch_size


def test_calibration_needs_a_sync_run():
    with pytest.raises(ValueError, match="sync"):
        fit_calibration(PREDICTED["async"], {}, TWO_POINT, TrainerCostModel(1e-4), None, 1, 0)


# -- validation against a fresh real run (not stored numbers) ---------------------------------

#: The bound on the out-of-sample error. Measured on the quiet 2-core machine with this test's
#: settings (full profile, 6 iterations, medians of 3): fat-tail -7.8%, -14.0%, -13.8%; the
#: simulator predicts sync runs ~10% slow (docs/simulator.md). With 1 run per row the spread was
#: +1% to -28% and with the quick profile -30%, so the test takes medians of 3 on the full
#: profile. It fails a simulator without its contention factor (+131%, see docs/simulator.md).
OUT_OF_SAMPLE_BOUND = 0.30


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_simulator_predicts_a_fresh_real_run_it_was_not_fitted_to():
    """Calibrate on the real sync bench run (shipped lengths), then predict a real run on another
    length distribution (twice the mean, a fatter tail), which the fit never saw."""
    assert CALIBRATION.lengths != PREDICTED["fat-tail"].lengths
    result = validate([PREDICTED["fat-tail"]], iterations=6, warmup=1, repeats=3)
    row = result["rows"]["fat-tail"]
    assert not row["fitted"] and row["real"] > 0
    assert abs(row["error"]) < OUT_OF_SAMPLE_BOUND, result
    # The old PTL(BS) model and the context model without shared cores, calibrated on the same
    # run, are simulated beside it; one generator beside the trainer shares no core.
    assert result["calibration_ptl"]["ptl_ms"] and row["sim_ptl"] > 0
    assert result["max_abs_error_ptl"] == abs(row["error_ptl"])
    assert result["calibration"]["cores"] > 0 and result["calibration_unshared"]["cores"] == 0
    assert row["sim_unshared"] == row["sim"] or result["calibration"]["cores"] < 2


# -- asynchronous variants: staleness bound k, partial rollout (finish / keep / recompute) -------

CONST = LatencyModel([1], [1.0])  # 1 s per decode step at any batch size
#: One 64-token sample and seven 8-token ones per iteration: a long tail on one instance.
LONG_TAIL = [64] + [8] * 7


def async_config(
    policy: str, k: int | None = None, trainer_s_per_token: float = 1e-4, sync_s: float = 0.0, **gen
):
    """One 8-slot instance at 1 s a step, LONG_TAIL, 4-token prompts, async (bound ``k``),
    weights arriving ``sync_s`` after each optimizer step."""
    generators = GeneratorPool(CONST, 1, 8, **gen)
    trainer = TrainerPool(TrainerCostModel(trainer_s_per_token), 1, token_budget=1)
    workload = Workload(lambda it: list(LONG_TAIL), len(LONG_TAIL), 1, 4, ranker_noise=0.0)
    return SimConfig(
        generators,
        trainer,
        workload,
        mode="async",
        staleness_bound=k,
        partial_rollout=policy,
        iterations=4,
        warmup=1,
        sync_latency_s=sync_s,
    )


def generate_spans(result):
    return [s for s in result.trace.spans if s.name == "generate"]


def test_instance_weight_load_policies_hand_computed():
    # One 10-token sample, 4-token prompt, 1 s a step; admission prefill 0.5 s, so decoding
    # starts at 0.5. Version 1 arrives at 4.2 s: 3.7 tokens done, the 4th in progress belongs to
    # version 0. Re-prefill: 0.5 + 0.01 x 1 row x (4 + 4) tokens = 0.58 s.
    def run(policy: str):
        inst = SimInstance(
            0,
            CONST,
            8,
            FIFOScheduler(),
            1.0,
            0.5,
            partial_rollout=policy,
            prefill_s_per_token=0.01,
            prompt_tokens=4,
        )
        inst.release([Request("p", [0], 10, forced_length=10)], 0.0)
        assert inst.advance(4.2) == []
        inst.offer(1, 4.2)
        ((running, at),) = inst.advance(100.0)
        return inst, running, at

    inst, running, at = run("finish")  # loads only once idle
    assert at == pytest.approx(10.5) and running.tokens == {0: 10}
    assert inst.loads == [(pytest.approx(10.5), 1)] and inst.version == 1
    inst, running, at = run("keep")  # loads at once, no pause
    assert at == pytest.approx(10.5) and running.tokens == {0: 4, 1: 6}
    assert inst.loads == [(pytest.approx(4.2), 1)] and inst.recompute_s == 0.0
    inst, running, at = run("recompute")  # loads at once, then re-prefills prompt + 4 tokens
    assert inst.recompute_s == pytest.approx(0.58)
    assert at == pytest.approx(10.5 + 0.58) and running.tokens == {0: 4, 1: 6}


def test_instance_holds_requests_until_it_has_their_weights():
    inst = SimInstance(0, CONST, 8, FIFOScheduler(), partial_rollout="finish")
    inst.release([Request("a", [0], 4, forced_length=4, min_weight_version=1)], 0.0)
    assert not inst.running and len(inst.held) == 1  # needs version 1, holds version 0
    inst.offer(1, 2.0)  # idle: loads at once, then admits it
    assert inst.version == 1 and [r.request.prompt_id for r in inst.running] == ["a"]
    assert inst.running[0].version == 1


def test_partial_keep_beats_finish_when_generation_bound():
    # finish: iteration j+1 needs weights j, which the instance loads only once j's 64-token
    # sample is done (the tail bubble): 64 s an iteration. keep: it loads them as they arrive
    # and fills the 7 idle slots with iteration j+1 while the long sample runs: 32 s.
    finish = simulate(async_config("finish"))
    keep = simulate(async_config("keep"))
    assert finish.iteration_s == pytest.approx(64.0, rel=1e-3)
    assert keep.iteration_s == pytest.approx(32.0, rel=1e-3)
    assert keep.samples_per_s > 1.9 * finish.samples_per_s


def test_finish_keeps_each_sample_on_one_version_keep_does_not():
    for policy in ("finish", "keep"):
        spans = generate_spans(simulate(async_config(policy)))
        for s in spans:  # every token is counted once, under some version
            assert sum(n for _, n in s.meta["token_versions"]) == s.meta["length"]
        spanning = [s for s in spans if len(s.meta["token_versions"]) > 1]
        if policy == "finish":
            assert not spanning
            assert all(s.meta["token_versions"][0][0] == s.meta["weight_version"] for s in spans)
        else:  # the long samples run on under the weights that arrive meanwhile
            assert spanning and all(n > 0 for s in spanning for _, n in s.meta["token_versions"])


@pytest.mark.parametrize("k", [1, 2, 3])
def test_staleness_bound_paces_admission_and_bounds_token_staleness(k):
    # Trainer-bound (1 s per token trained): the generators run as far ahead as allowed, so
    # iteration j is admitted at exactly version j - k and trained k versions stale. Weights
    # take 5 s to arrive: iteration t + k, dispatched at step t, waits for version t.
    result = simulate(async_config("finish", k, trainer_s_per_token=1.0, sync_s=5.0))
    spans = generate_spans(result)
    assert all(s.meta["weight_version"] >= max(0, s.iteration - k) for s in spans)
    assert min(s.meta["weight_version"] - (s.iteration - k) for s in spans if s.iteration >= k) == 0
    assert result.token_lag_max == k
    assert all(it["token_lag_max"] <= k for it in result.per_iteration)
    starts = [it["start_s"] for it in result.per_iteration]  # k ahead: j runs before step j-k+1
    for j in range(k, len(starts)):
        assert min(s.start_s for s in spans if s.iteration == j) < starts[j - k + 1]
    keep = simulate(async_config("keep", k, sync_s=5.0))  # generation-bound: still within k
    assert 0 < keep.token_lag_mean <= k and keep.token_lag_max <= k
    # The mean is over trained tokens (not samples), iteration by iteration, as the real one.
    per_iteration = {}
    for s in generate_spans(keep):
        lags = per_iteration.setdefault(s.iteration, [0, 0])
        for version, n in s.meta["token_versions"]:
            lags[0], lags[1] = lags[0] + n * (s.iteration - version), lags[1] + n
    measured = [per_iteration[i] for i in range(1, 5)]  # warm-up 1, 4 measured
    assert keep.token_lag_mean == pytest.approx(np.mean([lag / n for lag, n in measured]))


def test_token_staleness_is_zero_in_sync_and_one_in_one_step_finish():
    assert simulate(tiny_config("sync", [2, 4], 0.5, budget=1)).token_lag_mean == 0.0
    assert simulate(async_config("finish")).token_lag_mean == pytest.approx(1.0)


def test_recompute_costs_generator_time_keep_does_not():
    keep = simulate(async_config("keep", prefill_s_per_token=0.01))
    recompute = simulate(async_config("recompute", prefill_s_per_token=0.01))
    assert keep.recompute_s == 0.0 and recompute.recompute_s > 0.0
    decode = lambda r: sum(s.end_s - s.start_s for s in generate_spans(r))  # noqa: E731
    assert decode(recompute) > decode(keep) + recompute.recompute_s * 0.5
    assert recompute.iteration_s > keep.iteration_s
    # A dearer re-prefill costs more.
    dearer = simulate(async_config("recompute", prefill_s_per_token=0.1))
    assert dearer.recompute_s > recompute.recompute_s and dearer.iteration_s > recompute.iteration_s


def test_sim_config_checks_the_new_modes():
    with pytest.raises(ValueError, match="async"):
        tiny_config("sync", [2], 0.5, budget=1, partial_rollout="keep")
    with pytest.raises(ValueError, match="partial_rollout"):
        tiny_config("async", [2], 0.5, budget=1, partial_rollout="sometimes")
    with pytest.raises(ValueError, match="staleness_bound"):
        tiny_config("async", [2], 0.5, budget=1, staleness_bound=0)
    with pytest.raises(ValueError, match="staleness_bound"):
        tiny_config("sync", [2], 0.5, budget=1, staleness_bound=1)
    assert tiny_config("async", [2], 0.5, budget=1).staleness == 1
    assert tiny_config("sync", [2], 0.5, budget=1).staleness == 0


def test_validation_rows_simulate_their_bench_mode():
    """Each row's ``BENCH_MODES`` entry reaches the simulated side (simulation only)."""
    from streamrl.bench.pipeline import BENCH_MODES

    for name, variant in BENCH_MODES.items():
        fields = sim_mode_fields(name)
        assert fields == {
            "mode": variant.mode,
            "staleness_bound": variant.staleness_bound,
            "partial_rollout": variant.partial_rollout,
        }
    rows = {"async-k2", "partial-keep", "partial-recompute", "async-16", "partial-keep-16"}
    assert rows | {"async-k2-16"} <= set(PREDICTED)
    assert {PREDICTED[n].max_batch_size for n in ("async-16", "async-k2-16")} == {16}
    cal = Calibration(
        LatencyModel([1, 64], [0.002, 0.006]),
        TrainerCostModel(1e-5, microbatch_overhead_s=1e-3, step_s=0.01),
        None,
        slowdown=1.2,
        trainer_scale=1.0,
        sync_s=0.02,
        overhead_s=0.04,
        prefill_s_per_token=2e-6,
    )
    sims = {n: simulate(sim_config(PREDICTED[n], cal, 3, 1)) for n in (*rows, "async")}
    assert sims["partial-recompute"].recompute_s > 0.0 and sims["partial-keep"].recompute_s == 0
    assert sims["async-k2"].token_lag_max == 2 and sims["async"].token_lag_max == 1
    spans = generate_spans(sims["async-16"])
    assert max(sum(1 for t in spans if t.start_s <= s.start_s < t.end_s) for s in spans) <= 16
