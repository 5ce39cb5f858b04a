"""Every planner prices a step with its contexts (issue 47, item 2): the closed form of a run of
steps against a step-by-step sum, the batching replay against a brute-force engine, the floor
against every replayed plan, the simulator against the replay, and the adaptive planner's
priced choice between splitting a group and keeping it whole."""

from __future__ import annotations

import itertools
import random

import pytest

from streamrl.components.skewness.adaptive import AdaptiveDispatcher
from streamrl.components.skewness.batching import decode_schedule, simulate_instance
from streamrl.components.skewness.latency import LatencyModel
from streamrl.components.skewness.schedulers import FIFOScheduler
from streamrl.records import Request
from streamrl.sim.instance import SimInstance


def context_model(load: str = "widest", context_s: float = 2e-5) -> LatencyModel:
    return LatencyModel(
        [1, 4, 16], [0.004, 0.005, 0.008], context_s=context_s, load=load, profiled_context=20
    )


def brute_force(lengths, batch, model, contexts):
    """Continuous batching one decode step at a time, each step priced by ``step_s``."""
    waiting = list(zip(lengths, contexts))[::-1]
    running: list[list[float]] = []  # [tokens left, context]
    now, finishes = 0.0, []
    while waiting or running:
        admitted = []
        while waiting and len(running) < batch:
            left, held = waiting.pop()
            running.append([left, held])
            admitted.append(held)
        if admitted:  # one batched prefill: every row padded to the widest (or each its own)
            paid = len(admitted) * max(admitted) if model.load == "widest" else sum(admitted)
            now += model.prefill_base_s + model.prefill_token_s * paid
        now += model.step_s([held for _, held in running])
        for row in running:
            row[0] -= 1
            row[1] += 1
        finishes += [now for left, _ in running if left <= 0]
        running = [row for row in running if row[0] > 0]
    return finishes


@pytest.mark.parametrize("load", ["widest", "total"])
def test_a_run_of_steps_in_closed_form_is_the_sum_of_its_steps(load):
    model = context_model(load)
    for contexts, steps in [([5], 40), ([5, 30, 2], 17), ([50, 60], 9), ([1, 1, 1, 1], 1)]:
        summed = sum(model.step_s([c + j for c in contexts]) for j in range(steps))
        assert model.decode_s(contexts, steps) == pytest.approx(summed, rel=1e-12)
        seconds = model.decode_s(contexts, steps)
        assert model.steps_within(contexts, seconds, 10 * steps) == pytest.approx(steps)


@pytest.mark.parametrize("load", ["widest", "total"])
def test_the_batching_replay_is_a_step_by_step_engine(load):
    model = context_model(load)
    model.prefill_base_s, model.prefill_token_s = 0.01, 1e-5
    draw = random.Random(3)
    lengths = [draw.randint(1, 120) for _ in range(30)]
    contexts = [draw.randint(4, 200) for _ in range(30)]
    replayed = [end for _, end in decode_schedule(lengths, 8, model, contexts=contexts)]
    assert max(replayed) == pytest.approx(max(brute_force(lengths, 8, model, contexts)))
    assert sorted(replayed) == pytest.approx(brute_force(lengths, 8, model, contexts))
    # Without the context term the replay is the paper's PTL(BS) alone.
    plain = LatencyModel(model.batch_sizes, model.ptl_s)
    assert simulate_instance(lengths, 8, plain) < simulate_instance(lengths, 8, model, contexts)


@pytest.mark.parametrize("load", ["widest", "total"])
def test_no_replayed_plan_beats_the_floor(load):
    model = context_model(load, context_s=1e-4)
    draw = random.Random(7)
    lengths = [draw.choice([8, 12, 20, 300]) for _ in range(12)]
    longest_s, work_s = model.makespan_floor(lengths, 2, 4, [10] * len(lengths))
    assert longest_s > 300 * 0.004  # its own context adds to the fastest steps
    best = float("inf")
    for assignment in itertools.islice(itertools.product((0, 1), repeat=12), 0, 4096, 7):
        parts = [[n for n, a in zip(lengths, assignment) if a == i] for i in (0, 1)]
        makespan = max(
            simulate_instance(sorted(p, reverse=True), 4, model, [10] * len(p)) for p in parts
        )
        best = min(best, makespan)
    assert best >= max(longest_s, work_s)
    assert best < 2 * max(longest_s, work_s)  # and the floor is not vacuous


def test_the_simulator_decodes_as_the_replay_prices():
    model = context_model("total")
    lengths = [40, 7, 90, 13, 25]
    instance = SimInstance(0, model, 2, FIFOScheduler(), prompt_tokens=30)
    requests = [Request(f"p{i}", [1] * 30, n, forced_length=n) for i, n in enumerate(lengths)]
    instance.release(requests, 0.0)
    finished = instance.advance(1e9)
    replay = decode_schedule(lengths, 2, model, contexts=[30] * len(lengths))
    assert sorted(at for _, at in finished) == pytest.approx(sorted(end for _, end in replay))
    assert max(at for _, at in finished) > simulate_instance(lengths, 2, LatencyModel([1], [0.004]))


def group_plan(latency: LatencyModel, split_groups: bool | None) -> int:
    """A long group of 4 and 120 short prompts planned over 2 instances of 4 slots: how many
    instances the long group's samples span."""
    requests = [Request("long", [1] * 8, 400, i) for i in range(4)]
    requests += [Request(f"short{p}", [1] * 8, 400) for p in range(120)]
    scores = [300.0] * 4 + [30.0] * 120
    planner = AdaptiveDispatcher(
        latency, 4, split_groups=split_groups, recent_lengths=[30] * 30 + [300] * 10
    )
    parts = planner.plan(requests, scores, 2)
    return len({i for i, part in enumerate(parts) for r in part if r.prompt_id == "long"})


def test_splitting_a_group_is_a_priced_decision():
    # A step that pays for its widest row: split, the long group's rows widen both instances'
    # batches of short samples all along; whole, one instance runs the short ones narrow.
    widest = LatencyModel([1, 8], [0.004, 0.006], context_s=5e-5, load="widest")
    assert group_plan(widest, None) == 1
    # Without a context term splitting balances the work better, and is kept.
    plain = LatencyModel([1, 8], [0.004, 0.006])
    assert group_plan(plain, None) == 2
    assert group_plan(widest, True) == 2 and group_plan(plain, False) == 1


def test_a_length_that_never_finishes_is_refused_not_replayed_forever():
    with pytest.raises(ValueError, match="finite"):
        decode_schedule([3, float("nan")], 2, context_model())


def test_the_move_overhead_follows_the_model_measured_after_the_planner_is_built():
    # A run builds its planner on a placeholder model and measures the real one later.
    latency = LatencyModel([1], [float("nan")])
    planner = AdaptiveDispatcher(latency, 4)
    latency.update_from(context_model())
    assert planner.move_overhead_s == pytest.approx(2 * 0.004)
    assert AdaptiveDispatcher(latency, 4, move_overhead_s=0.5).move_overhead_s == 0.5


@pytest.mark.parametrize("method", ["replay", "eq2"])
def test_algorithm_1_and_the_elastic_triggers_price_the_prompt(method):
    """Algorithm 1's T_gen and the elastic controller's delta' start every context at the
    prompt: with a model of context, 400-token prompts make generation longer in every mode
    and method; a PTL(BS) table is unchanged by them."""
    from streamrl.components.capacity.allocator import (
        ResourceAllocator,
        TrainerCostModel,
        predict_generation_s,
    )
    from streamrl.components.capacity.elastic import ElasticController

    lengths = [float(random.Random(i).randint(20, 300)) for i in range(64)]
    priced, flat = context_model(context_s=2e-4), LatencyModel([1, 4, 16], [0.004, 0.005, 0.008])
    for model in (priced, flat):
        short = predict_generation_s(model, lengths, 4, 16, method, prompt_tokens=0)
        long = predict_generation_s(model, lengths, 4, 16, method, prompt_tokens=400)
        assert (long > 1.5 * short) if model is priced else (long == short)
    for mode in ("async", "sync"):  # T_gen, and the sync critical path's finish times
        allocator = ResourceAllocator(
            priced, TrainerCostModel(2e-5), max_batch_size=16, mode=mode, method=method
        )
        long = allocator.evaluate(8, 8, lengths, prompt_tokens=400).gen_s
        assert long > 1.5 * allocator.evaluate(8, 8, lengths, prompt_tokens=0).gen_s
    controller = ElasticController(priced, 16, method=method)
    assert controller.predicted_gen_s(2, lengths, 400) > 1.5 * controller.predicted_gen_s(
        2, lengths
    )


def test_a_script_measures_the_model_of_context_the_run_uses(tokenizer):
    """``measure_latency`` (what a script builds its dispatcher with) times batch sizes at the
    short prompt and at longer ones the model's context holds: a model of context, paid for by
    the widest row as on the HF engine, like the instances' own profile."""
    from streamrl.policy.models import build_tiny_model
    from streamrl.training.builders import measure_latency

    policy = build_tiny_model(tokenizer, "test", seed=0)
    model = measure_latency(policy, tokenizer, max_batch_size=8, contexts=(64, 10_000))
    assert model.batch_sizes == [1, 2, 4, 8] and model.load == "widest"
    assert model.prices_context  # 8 x 64-token prefills and steps cost more than short ones
    assert model.prefill_s([64] * 8) > model.prefill_s([4] * 8)
