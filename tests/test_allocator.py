"""Algorithm 1 (StreamRL §4.2) on hand-worked cases, and Fig. 10's splits on the paper presets."""

from __future__ import annotations

import pytest

from streamrl.components.capacity.allocator import (
    ResourceAllocator,
    TrainerCostModel,
    predict_generation_s,
    sync_critical_path_s,
)
from streamrl.components.skewness.latency import LatencyModel
from streamrl.sim.hardware import QWEN25, decode_latency, kv_batch_limit, trainer_cost
from streamrl.sim.presets import PAPER_PROMPT_TOKENS, paper_lengths

CONST = LatencyModel([1], [0.01])  # 10 ms per step at any batch size


def test_trainer_cost_model_data_parallel_scaling():
    cost = TrainerCostModel(
        s_per_token=0.001, microbatch_overhead_s=0.1, step_s=0.5, dp_efficiency=0.5
    )
    assert cost.speedup(1) == 1.0 and cost.speedup(3) == 2.0
    # 3000 tokens: 3 s on one unit, 1.5 s on three; + 2 micro-batches x 0.1 + step 0.5.
    assert cost.train_s(3000, units=3, microbatches=2) == pytest.approx(2.2)
    assert cost.microbatch_s(1000, units=3) == pytest.approx(0.6)
    with pytest.raises(ValueError, match="dp_efficiency"):
        TrainerCostModel(0.001, dp_efficiency=0.0)


def test_predict_generation_rounds():
    # 8 samples of 100 tokens, 2 slots per instance: 4 rounds of 1 s on one instance.
    assert predict_generation_s(CONST, [100] * 8, 1, 2) == pytest.approx(4.0)
    assert predict_generation_s(CONST, [100] * 8, 4, 2) == pytest.approx(1.0)
    assert predict_generation_s(CONST, [100] * 8, 4, 2, method="eq2") == pytest.approx(1.0)


def test_sync_critical_path_streams_samples():
    # Samples finish at 1 s and 3 s, 10 tokens each at 0.1 s/token: train 1-2, then 3-4.
    cost = TrainerCostModel(0.1)
    assert sync_critical_path_s([3.0, 1.0], [10, 10], cost, units=1) == pytest.approx(4.0)


def test_single_datacenter_plan_balances_stages():
    # 8 samples, 2 slots: generation 4 s on 1 GPU, 2 s on 2 or 3; training 0.8 s on one GPU
    # (800 tokens x 1 ms), 0.4 s on two. Best: 2/2 (max 2.0), ties broken to fewer gen GPUs.
    alloc = ResourceAllocator(CONST, TrainerCostModel(1e-3), max_batch_size=2, alternatives=2)
    plan = alloc.plan(4, [100] * 8)
    assert (plan.gen_gpus, plan.train_gpus, plan.iteration_s) == (2, 2, pytest.approx(2.0))
    assert [(a.gen_gpus, a.train_gpus) for a in plan.alternatives] == [(3, 1), (1, 3)]
    # A trainer 10x slower (8 s on one GPU) gets three GPUs: max(4, 8/3) = 4 beats max(2, 4).
    slow = ResourceAllocator(CONST, TrainerCostModel(1e-2), max_batch_size=2).plan(4, [100] * 8)
    assert (slow.gen_gpus, slow.train_gpus) == (1, 3)
    with pytest.raises(ValueError, match="cannot hold"):
        alloc.plan(1, [100] * 8)


def test_sync_objective_adds_weight_transfer():
    alloc = ResourceAllocator(
        CONST, TrainerCostModel(1e-3), max_batch_size=2, mode="sync", weight_sync_s=0.5
    )
    plan = alloc.evaluate(2, 2, [100] * 8)
    # Two instances, 4 samples each in 2 rounds: four finish at 1 s, four at 2 s. The trainer
    # (0.05 s per sample on 2 GPUs) trains 1.0-1.2 and 2.0-2.2, then 0.5 s of weights.
    assert plan.iteration_s == pytest.approx(2.7)


def test_cross_datacenter_shrinks_the_faster_stage():
    # Generation pool of 8 instances (1 slot each, 8 samples): 1 round = 1 s. Training pool of
    # 2 GPUs: 800 tokens x 5 ms / 2 = 2 s. Generation is faster: keep the fewest instances
    # whose time stays <= 2 s. Algorithm 2 puts 2 tail samples on 1 instance; 6 regular ones
    # need 3 instances for 2 rounds: 4 instances (2 s), 4 released.
    alloc = ResourceAllocator(CONST, TrainerCostModel(5e-3), max_batch_size=1)
    plan = alloc.plan_cross(8, 2, [100] * 8)
    assert (plan.gen_gpus, plan.train_gpus, plan.released_gpus) == (4, 2, 4)
    assert plan.gen_s <= plan.train_s
    # The mirror case: a fast trainer is shrunk to the fewest GPUs that keep up.
    fast = ResourceAllocator(CONST, TrainerCostModel(1e-3), max_batch_size=1)
    plan = fast.plan_cross(1, 8, [100] * 8)  # generation 8 s; training 0.8 s per GPU
    assert (plan.gen_gpus, plan.train_gpus, plan.released_gpus) == (1, 1, 7)


@pytest.mark.parametrize("model,budget,paper", [("32b", 64, (40, 24)), ("72b", 128, (80, 48))])
def test_paper_fig10_splits(model, budget, paper):
    shape = QWEN25[model]
    lengths = paper_lengths(1024, 20000, seed=0)
    context = PAPER_PROMPT_TOKENS + sum(lengths) / len(lengths)
    alloc = ResourceAllocator(
        decode_latency(shape),
        trainer_cost(shape),
        shape.gen_tp,
        kv_batch_limit(shape, decode_latency_gpu(), context),
    )
    plan = alloc.plan(budget, lengths, PAPER_PROMPT_TOKENS)
    assert (plan.gen_gpus, plan.train_gpus) == paper
    even = alloc.evaluate(budget // 2, budget // 2, lengths, PAPER_PROMPT_TOKENS)
    assert even.gen_s > even.train_s  # the even split leaves generation the bottleneck
    assert plan.iteration_s < even.iteration_s


def decode_latency_gpu():
    from streamrl.sim.hardware import H800

    return H800
