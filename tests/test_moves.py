"""Moving requests between generator instances mid-flight (issue 34, item 3): the generator's
release and resume, the planner's decisions, and the service's moves with real processes,
including instances killed during a move."""

from __future__ import annotations

import math
import os
import signal

import pytest
from extension_plugins import AllOnFirstInstance

from streamrl.components.generation.admission import AdmissionQueue
from streamrl.components.generation.hf_generator import HFStreamGenerator
from streamrl.components.generation.rebalancing import Rebalancing
from streamrl.components.generation.service import StreamGenerationService
from streamrl.components.skewness.adaptive import AdaptiveDispatcher
from streamrl.components.skewness.group_context import GroupContext
from streamrl.components.skewness.latency import LatencyModel
from streamrl.components.skewness.schedulers import LPTScheduler
from streamrl.components.skewness.skew_dispatch import SkewAwareDispatcher
from streamrl.policy.models import build_tiny_model, save_policy
from streamrl.records import InstanceLoad, LengthDistribution, Request, Sample

pytestmark = pytest.mark.timeout(240)


def _requests(n: int, forced: list[int] | None = None, group: int = 1) -> list[Request]:
    return [
        Request(
            f"p{i}",
            [5, 6, 7 + i % 9, 8 + i % 5],
            max_tokens=24,
            sample_index=s,
            forced_length=None if forced is None else forced[i],
        )
        for i in range(n)
        for s in range(group)
    ]


# -- the generator: release and resume ---------------------------------------------------------
def test_a_moved_running_request_gives_the_tokens_logprobs_and_versions_of_an_unmoved_run(
    tiny_model,
):
    unmoved = HFStreamGenerator(tiny_model, max_batch_size=4, greedy=True)
    unmoved.submit(_requests(4))
    for _ in range(3):
        unmoved.step()
    unmoved.load_weights({}, version=1)  # mid-sequence: later tokens carry version 1
    baseline = {s.key: s for s in unmoved.stream()}

    source = HFStreamGenerator(tiny_model, max_batch_size=4, greedy=True, instance_id=0)
    target = HFStreamGenerator(tiny_model, max_batch_size=4, greedy=True, instance_id=1)
    target.load_weights({}, version=1)
    source.submit(_requests(4))
    finished = [s for _ in range(3) for s in source.step()]
    source.load_weights({}, version=1)
    finished += source.step()
    moved = source.release([("p1", 0, 0), ("p3", 0, 0), ("gone", 0, 0)])
    assert sorted(r.prompt_id for r in moved) == ["p1", "p3"]
    assert all(r.progress is not None and len(r.progress.token_ids) == 4 for r in moved)
    assert source.num_running == 2
    target.submit(moved)
    finished += list(source.stream()) + list(target.stream())

    assert sorted(s.key for s in finished) == sorted(baseline)
    for sample in finished:
        base = baseline[sample.key]
        assert sample.token_ids == base.token_ids
        assert sample.logprobs == pytest.approx(base.logprobs, abs=1e-4)
        assert sample.token_versions == base.token_versions
        assert sample.weight_version == base.weight_version == 0
    on_target = [s for s in finished if s.instance_id == 1]
    assert {s.prompt_id for s in on_target} == {"p1", "p3"}
    # The target prefilled the prompt and the 4 tokens it came with.
    assert all(s.prefill_tokens == len(s.prompt_ids) + 4 for s in on_target)


def test_waiting_requests_leave_in_admission_order_and_the_rest_keep_theirs():
    queue = AdmissionQueue(max_batch_size=1, scheduler=LPTScheduler())
    lengths = {"a": 3.0, "b": 9.0, "c": 5.0, "d": 7.0}
    queue.submit(
        [Request(p, [1], 16, predicted_length=n) for p, n in lengths.items()], context_length=32
    )
    assert [r.prompt_id for r in queue.withdraw({("d", 0, 0), ("b", 0, 0)})] == ["b", "d"]
    assert queue.reprioritize({("a", 0, 0): 10.0}) == 1
    assert [r.prompt_id for r in queue.withdraw({("c", 0, 0)})] == ["c"]
    assert [req.prompt_id for req, _ in queue.admit(running=0, now=0.0)] == ["a"]


# -- the planner -------------------------------------------------------------------------------
def _load(instance: int, batch: int, running=(), waiting=()) -> InstanceLoad:
    return InstanceLoad(instance, batch, list(running), list(waiting))


def test_the_planner_moves_queued_work_to_an_idle_instance():
    planner = AdaptiveDispatcher(max_batch_size=2, recent_lengths=[40] * 50)
    reqs = _requests(6)
    planner.plan(reqs, [40.0] * 6, 1)  # all on one instance: 2 run, 4 wait
    moves = planner.rebalance([_load(0, 2, [(reqs[0], 5), (reqs[1], 5)], reqs[2:]), _load(1, 2)])
    moved = [k for m in moves for k in m.keys]
    assert all(m.source == 0 and m.target == 1 for m in moves)
    assert len(moved) == 2 and not {reqs[0].key, reqs[1].key} & set(moved)  # waiting ones


def test_a_running_request_moves_only_where_decoding_it_apart_is_faster():
    reqs = _requests(4)
    running = [(r, 10) for r in reqs]
    flat = AdaptiveDispatcher(LatencyModel([1, 4], [0.01, 0.01]), max_batch_size=4)
    flat.plan(reqs, [200.0, 30.0, 30.0, 30.0], 1)
    # Per-token latency flat in the batch size: moving the long one only adds its re-prefill.
    assert flat.rebalance([_load(0, 4, running), _load(1, 4)]) == []
    steep = AdaptiveDispatcher(LatencyModel([1, 4], [0.01, 0.04]), max_batch_size=4)
    steep.plan(reqs, [200.0, 30.0, 30.0, 30.0], 1)
    moves = steep.rebalance([_load(0, 4, running), _load(1, 4)])
    assert reqs[0].key in [k for m in moves for k in m.keys]


def test_group_context_pulls_the_siblings_estimate_towards_their_finished_lengths():
    context = GroupContext(within_sigma=0.2)
    prior = LengthDistribution(math.log(100), 0.6)
    short = context.posterior(prior, [30, 35, 40])
    assert short.median < 50 and short.sigma < prior.sigma
    long = context.posterior(prior, [300, 320])
    assert long.median > 200
    # Learned from finished groups: spread inside a group is what the groups show.
    for k in range(10):
        context.observe_group([50 + k, 55 + k, 60 + k])
    assert context.within_sigma == pytest.approx(0.0917, abs=0.01)


def test_the_planner_reprices_the_siblings_of_a_finished_sample():
    planner = AdaptiveDispatcher(max_batch_size=8, recent_lengths=[10, 100] * 20)
    reqs = _requests(1, group=4)
    planner.plan(reqs, [100.0] * 4, 1)
    before = reqs[1].predicted_length
    costs = planner.finished(
        Sample("p0", 0, reqs[0].prompt_ids, [1] * 5, [0.0] * 5, 0, 0, iteration=0)
    )
    assert set(costs) == {r.key for r in reqs[1:]}
    assert all(c < before / 2 for c in costs.values())


def test_point_predictions_are_widened_by_the_predictors_own_error_once_it_is_known():
    # D is bimodal: its spread is the modes', far wider than a good predictor's error.
    d = [10, 300] * 50
    planner = AdaptiveDispatcher(max_batch_size=8, recent_lengths=d)
    first = _requests(40)
    planner.plan(first, [20.0] * 40, 1)
    assert planner.distribution(first[0]).sigma == pytest.approx(math.log(30) / 2)  # D's
    for r in first:  # every sample ran twice its prediction: the error is log 2, always
        planner.finished(Sample(r.prompt_id, 0, r.prompt_ids, [1] * 40, [0.0] * 40, 0, 0))
    later = [Request(f"q{i}", [5, 6], 24, iteration=1) for i in range(4)]
    planner.plan(later, [20.0] * 4, 1)
    assert planner.distribution(later[0]).sigma == pytest.approx(math.log(2))
    # Kept in its state; or given outright.
    resumed = AdaptiveDispatcher(max_batch_size=8)
    resumed.load_state_dict(planner.state_dict())
    assert list(resumed.residuals) == list(planner.residuals)
    given = AdaptiveDispatcher(max_batch_size=8, recent_lengths=d, prediction_sigma=0.1)
    given.plan(later, [20.0] * 4, 1)
    assert given.distribution(later[0]).sigma == 0.1


def test_on_a_widest_row_engine_the_planner_keeps_the_papers_plan_unless_another_wins_clearly():
    widest = LatencyModel([1, 8], [0.004, 0.006], context_s=5e-5, load="widest")
    scores = [300.0, 260.0, 240.0] + [30.0 + p % 7 for p in range(27)]
    d = [30] * 30 + [300] * 10

    def plan(planner) -> list[list[str]]:
        requests = [
            Request(f"p{p}", [1] * (4 + p % 5), 400, i) for p in range(30) for i in range(2)
        ]
        parts = planner.plan(requests, [s for s in scores for _ in range(2)], 2)
        return [sorted({r.prompt_id for r in part}) for part in parts]

    paper = plan(SkewAwareDispatcher(widest, 4, recent_lengths=d))
    # Spreading must win by min_gain: by all of it, it never does; the paper's plan is kept.
    assert plan(AdaptiveDispatcher(widest, 4, min_gain=0.99, recent_lengths=d)) == paper
    own = plan(AdaptiveDispatcher(widest, 4, min_gain=0.99, tail_share=None, recent_lengths=d))
    assert own != paper


# -- the service: real instances ---------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("policy")
    save_policy(build_tiny_model(tokenizer, "test", seed=0), tokenizer, path)
    return path


FORCED = [22, 3, 18, 5, 14, 7, 20, 4, 16, 9, 12, 6]


def _baseline(model_dir) -> dict:
    with StreamGenerationService(model_dir, 1, max_batch_size=4, greedy=True) as sgs:
        return {s.key: s.token_ids for s in sgs.generate(_requests(12, FORCED))}


@pytest.mark.parametrize("kill", [None, "source", "source-after-release", "target"])
def test_moved_requests_are_neither_lost_nor_generated_twice(model_dir, kill, monkeypatch):
    """Killed as the moves go out (the release reaches a dead source; the target dies before it
    gets them), or once the source has released them (the rest of its requests requeued)."""
    baseline = _baseline(model_dir)
    planner = AllOnFirstInstance(LatencyModel([1, 4], [0.002, 0.008]), max_batch_size=4)
    planner.kill = kill if kill != "source-after-release" else None
    if kill == "source-after-release":
        released = Rebalancing.released

        def kill_then_take(self, handle, move_id, requests):
            if not getattr(self, "killed", False):
                self.killed = True
                os.kill(handle.proc.pid, signal.SIGKILL)
            return released(self, handle, move_id, requests)

        monkeypatch.setattr(Rebalancing, "released", kill_then_take)
    with StreamGenerationService(
        model_dir,
        2,
        max_batch_size=4,
        greedy=True,
        dispatcher=planner,
        scheduler=LPTScheduler,
        max_restarts=1,
    ) as sgs:
        planner.pids = {i.instance_id: i.pid for i in sgs.instances()}
        samples = list(sgs.generate(_requests(12, FORCED), [float(n) for n in FORCED]))
        counts = dict(sgs.counts)
    assert sorted(s.key for s in samples) == sorted(baseline)  # each once
    assert all(s.token_ids == baseline[s.key] for s in samples)  # greedy: what it would be
    assert all(s.length == FORCED[int(s.prompt_id[1:])] for s in samples)
    assert counts["rebalances"] >= 1
    if kill != "target":  # (a killed target did none: what it took is requeued)
        assert {s.instance_id for s in samples} != {0}  # another instance did work
    if kill != "source":  # a dead source releases nothing: its requests are requeued
        assert counts["requests_moved"] >= 1
    if kill is not None:
        assert counts["instances_restarted"] == 1
    else:
        assert counts.get("instances_restarted", 0) == 0


# -- the simulator: the same planner on simulated instances ------------------------------------
def test_simulated_moves_undo_a_bad_plan_and_count_what_moved():
    from streamrl.sim.moves import simulate_generation

    flat = LatencyModel([1], [0.01])
    lengths = [40, 30, 30, 20, 20, 10, 10, 10]
    reqs = [Request(f"p{i}", [1], 64, forced_length=n) for i, n in enumerate(lengths)]
    scores = [float(n) for n in lengths]
    planned = simulate_generation(AllOnFirstInstance(flat, moves=False), reqs, scores, 2, flat, 2)
    moved = simulate_generation(AllOnFirstInstance(flat), reqs, scores, 2, flat, 2)
    # All on one instance, 2 slots, longest first: 40 | 30+20+20(70)... by hand: 0.9 s.
    assert planned.makespan_s == pytest.approx(0.9)
    assert planned.requests_moved == 0
    # Moves spread the queue over both instances: the total (170 tokens / 4 slots) and the
    # longest (40) bound it below.
    assert 0.43 <= moved.makespan_s < 0.6
    assert moved.requests_moved >= 2 and moved.rebalances >= 1


def test_simulated_speculation_speeds_up_only_the_tail():
    from streamrl.components.generation.speculative import TailSpeculation
    from streamrl.components.skewness.dispatch import RoundRobinDispatcher
    from streamrl.sim.moves import simulate_generation

    flat = LatencyModel([1], [1.0])
    reqs = [Request(f"p{i}", [1], 64, forced_length=n) for i, n in enumerate([10, 10, 10, 40])]
    plain = simulate_generation(RoundRobinDispatcher(), reqs, None, 1, flat, 4)
    tail = TailSpeculation(max_running=1, tokens_per_step=2.0, verify_cost=1.0)
    fast = simulate_generation(RoundRobinDispatcher(), reqs, None, 1, flat, 4, speculation=tail)
    # 10 steps with all four running, then the last 30 tokens at 2 per step (15 steps).
    assert plain.makespan_s == pytest.approx(40.0) and fast.makespan_s == pytest.approx(25.0)


# -- deadlines: several iterations in flight ---------------------------------------------------
def _finished(prompt: str, iteration: int, length: int, start: float, end: float) -> Sample:
    return Sample(
        prompt,
        0,
        [1],
        [0] * length,
        [0.0] * length,
        0,
        0,
        started_s=start,
        finished_s=end,
        iteration=iteration,
    )


def test_the_clock_measures_token_and_iteration_times_from_finished_samples():
    from streamrl.components.skewness.deadlines import IterationClock

    clock = IterationClock(smoothing=1.0)  # the newest measurement only: hand-checkable
    for it in range(3):
        clock.opened(it, [(f"p{it}", 0, it)])
    clock.finished(_finished("p0", 0, 10, 100.0, 101.0))  # 0.1 s per token
    assert clock.lead(2) is None  # one completion: no period yet
    clock.finished(_finished("p1", 1, 10, 102.0, 103.0))  # done 2 s after iteration 0
    assert clock.seconds_per_token == pytest.approx(0.1)
    assert clock.seconds_per_iteration == pytest.approx(2.0)
    assert clock.lead(2) == pytest.approx(0.0)  # the oldest open is 2 itself
    clock.opened(3, [("p3", 0, 3)])
    assert clock.lead(3) == pytest.approx(20.0)  # one period of 2 s at 0.1 s per token


def test_a_later_iterations_long_sample_waits_behind_an_earlier_ones_if_it_has_the_slack():
    from streamrl.components.skewness.deadlines import IterationClock

    planner = AdaptiveDispatcher(max_batch_size=4, recent_lengths=[40, 50, 60] * 20)
    planner.clock = IterationClock(smoothing=1.0)
    for it in (-2, -1):  # two iterations done 5 s apart, at 0.01 s per token
        planner.clock.opened(it, [(f"x{it}", 0, it)])
    planner.clock.finished(_finished("x-2", -2, 100, 0.0, 1.0))
    planner.clock.finished(_finished("x-1", -1, 100, 5.0, 6.0))
    now = Request("short-now", [1], 512, iteration=0)
    later = Request("long-later", [1], 512, iteration=1)
    planner.plan([now, later], [50.0, 300.0], 1)
    # Iteration 1 has 500 tokens of slack: its ~300-token sample costs less than ~50 now.
    assert now.predicted_length > later.predicted_length
    blind = AdaptiveDispatcher(max_batch_size=4, staleness_aware=False)
    now2, later2 = Request("a", [1], 512, iteration=0), Request("b", [1], 512, iteration=1)
    blind.plan([now2, later2], [50.0, 300.0], 1)
    assert later2.predicted_length > now2.predicted_length  # plain LPT: longest first


# -- a run -------------------------------------------------------------------------------------
def test_a_fit_with_the_adaptive_planner_trains_every_sample_once(fit_small):
    """``rl.dispatcher: adaptive`` in a real run (two generators, async, the online ranker):
    whatever it moves, every requested sample is trained and none is lost (``fit_small``)."""
    summary = fit_small(
        dispatcher="adaptive",
        generation={"num_instances": 2},
        module={"mode": "async"},
        iterations=3,
        length_predictor="ranker",
    )
    assert summary["samples_lost"] == 0
