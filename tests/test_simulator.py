"""The StreamRL simulator: hand-worked tiny runs, the trace format, the KV-cache batch bound, and
an out-of-sample validation against fresh real runs (``streamrl sim validate``, small).
"""

from __future__ import annotations

import numpy as np
import pytest

from streamrl.components.capacity.allocator import TrainerCostModel
from streamrl.components.capacity.elastic import ElasticController
from streamrl.components.skewness.batching import decode_schedule
from streamrl.components.skewness.latency import LatencyModel
from streamrl.sim.config import GeneratorPool, SimConfig, TrainerPool, Workload
from streamrl.sim.engine import simulate
from streamrl.sim.hardware import H800, LINK_GBPS, QWEN25, decode_latency, kv_batch_limit
from streamrl.sim.presets import paper_config, paper_lengths
from streamrl.sim.validate import CALIBRATION, PREDICTED, fit_calibration, validate
from streamrl.timeline import load_trace

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
