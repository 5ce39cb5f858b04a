"""Skewness bubbles: latency model (Eq. 1, 2), Algorithm 2, LPT admission (hand-worked values)."""

from __future__ import annotations

import pytest

from streamrl.components import HFStreamGenerator
from streamrl.components.skewness.batching import simulate_instance
from streamrl.components.skewness.dispatch import RandomDispatcher
from streamrl.components.skewness.latency import PAPER_7B_H800_MS, LatencyModel
from streamrl.components.skewness.schedulers import LPTScheduler
from streamrl.components.skewness.skew_dispatch import SkewAwareDispatcher
from streamrl.policy.models import build_tiny_model
from streamrl.records import Request

TABLE_MS = {1: 1.0, 2: 1.0, 4: 1.1, 8: 1.2, 16: 1.5, 32: 2.0}
D = [10] * 60 + [100] * 40  # P50 = 10, P90 = 100


def test_latency_model_interpolates_and_applies_eq_1_and_2():
    model = LatencyModel.from_table_ms(TABLE_MS)
    assert model.ptl(3) == pytest.approx(0.00105)  # halfway between 1.0 ms and 1.1 ms
    assert model.ptl(11) == pytest.approx(0.0013125)  # 1.2 + 0.3 * 3 / 8 ms
    assert model.ptl(64) == pytest.approx(0.0030)  # last segment extended: 2.0 + 0.5 * 32/16
    assert model.sample_latency(100, 8) == pytest.approx(0.12)  # Eq. 1: 1.2 ms x 100
    # Eq. 2: 40 samples, at most 16 per batch -> 3 rounds of PTL(16) x 10 tokens.
    assert model.instance_latency(40, 10, 16) == pytest.approx(0.0015 * 10 * 3)
    paper = LatencyModel.from_table_ms(PAPER_7B_H800_MS)
    assert paper.ptl(512) == pytest.approx(0.037)


def test_simulated_continuous_batching_rewards_lpt_order():
    model = LatencyModel([1, 2], [1.0, 1.5])  # 1 s per step alone, 1.5 s with two running
    # FIFO [1, 1, 4]: both 1s together (1.5), then the 4 alone (4 x 1.0) = 5.5 s.
    assert simulate_instance([1, 1, 4], 2, model) == pytest.approx(5.5)
    # LPT [4, 1, 1]: (4,1) one step 1.5, (3,1) one step 1.5, then 2 alone = 5.0 s.
    assert simulate_instance([4, 1, 1], 2, model) == pytest.approx(5.0)


def test_makespan_floor_is_met_where_a_plan_can_meet_it_and_never_beaten():
    model = LatencyModel([1, 2], [1.0, 1.5])  # 2 tokens per 1.5 s at best, 1 s a step alone
    # Four samples of 3 on one instance, two at a time: exactly the work floor (12 / (2 / 1.5)).
    longest, work = model.makespan_floor([3, 3, 3, 3], 1, 2)
    assert (longest, work) == (pytest.approx(3.0), pytest.approx(9.0))
    assert simulate_instance([3, 3, 3, 3], 2, model) == pytest.approx(work)
    # One long sample alone takes 4 s; six tokens take 4.5 s at the best rate; no order beats it.
    assert model.makespan_floor([4, 1, 1], 1, 2) == (pytest.approx(4.0), pytest.approx(4.5))
    for order in ([1, 1, 4], [4, 1, 1], [1, 4, 1]):
        assert simulate_instance(order, 2, model) >= 4.5
    # The slot limit counts: with one slot the best rate is one token a second.
    assert model.makespan_floor([3, 3], 2, 1) == (pytest.approx(3.0), pytest.approx(3.0))


@pytest.mark.parametrize(("objective", "expected"), [("sum", (2, 2)), ("max", (3, 1))])
def test_algorithm_2_hand_worked(objective, expected):
    # 40 samples on 4 instances, alpha 0.2 -> 8 tail samples (L_a = P90 = 100) and 32 regular
    # (L_r = P50 = 10), at most 32 per batch. Eq. 2 per pool (ms):
    #   N_l=1: tail 8 -> 1.2*100 = 120;   regular ceil(32/3)=11 -> 1.3125*10 = 13.1
    #   N_l=2: tail 4 -> 1.1*100 = 110;   regular 16 -> 1.5*10 = 15      sum 125, max 110
    #   N_l=3: tail 3 -> 1.05*100 = 105;  regular 32 -> 2.0*10 = 20      sum 125, max 105
    dispatcher = SkewAwareDispatcher(
        LatencyModel.from_table_ms(TABLE_MS), 32, objective=objective, recent_lengths=D
    )
    assert dispatcher.split(40, 4) == expected


def test_plan_isolates_the_predicted_tail_and_keeps_groups_together():
    dispatcher = SkewAwareDispatcher(
        LatencyModel.from_table_ms(TABLE_MS), 32, objective="sum", recent_lengths=D
    )
    scores_by_prompt = {f"p{i}": float(10 + i) for i in range(20)}  # p19 longest
    requests = [Request(p, [3], 200, s) for p in scores_by_prompt for s in range(2)]
    scores = [scores_by_prompt[r.prompt_id] for r in requests]
    parts = dispatcher.plan(requests, scores, 4)
    n_long, _ = dispatcher.last_split
    assert sorted(r.key for part in parts for r in part) == sorted(r.key for r in requests)
    tail = {r.prompt_id for part in parts[:n_long] for r in part}
    assert tail == {f"p{i}" for i in range(16, 20)}  # top 20% of 20 prompts
    for part in parts:
        for r in part:
            assert all(
                r.prompt_id not in {q.prompt_id for q in other}
                for other in parts
                if other is not part
            )
            assert r.predicted_length == scores_by_prompt[r.prompt_id]
    with pytest.raises(ValueError, match="one predicted length per request"):
        dispatcher.plan(requests, scores[:3], 4)
    # No ranker yet: no tail pool, prompts balanced over every instance.
    unscored = dispatcher.plan(requests, None, 4)
    assert [len(part) for part in unscored] == [10, 10, 10, 10]


def test_max_objective_isolates_only_when_the_replayed_makespan_says_so():
    model = LatencyModel([1, 2], [1.0, 2.0])  # a second running sequence doubles the step
    dispatcher = SkewAwareDispatcher(model, 2, recent_lengths=[1] * 8 + [20] * 2)
    # 8 prompts of 1 token and 2 of 20 on 2 instances, 2 slots each.
    # Isolated (N_l = 1): the two 20s share instance 0: 20 steps x 2 s = 40 s.
    # Balanced: one 20 per instance with four 1s: a step of (20, 1) costs 2 s, four times,
    # then 16 steps alone at 1 s -> 24 s. Balancing wins.
    scores = [1.0] * 8 + [20.0] * 2
    requests = [Request(f"p{i}", [3], 32, forced_length=int(s)) for i, s in enumerate(scores)]
    parts = dispatcher.plan(requests, scores, 2)
    assert dispatcher.last_split == (0, 2)
    assert sorted(max(r.forced_length for r in part) for part in parts) == [20, 20]
    # On 3 instances with 1-slot tail instances, isolation runs each 20 alone (20 s) and the
    # eight 1s on the third instance (4 steps x 2 s); balancing puts 1s beside a 20 (> 20 s).
    wide = SkewAwareDispatcher(model, 2, alpha=0.2, recent_lengths=scores, tail_batch_size=1)
    parts = wide.plan(requests, scores, 3)
    n_long, _ = wide.last_split
    assert n_long == 2 and wide.batch_limits(3) == [1, 1, 2]
    assert all(max(r.forced_length for r in part) == 20 for part in parts[:n_long])
    with pytest.raises(ValueError, match="tail_batch_size"):
        SkewAwareDispatcher(model, 2, tail_batch_size=3)


def test_random_dispatcher_keeps_groups_together_and_covers_all():
    requests = [Request(f"p{i}", [3], 8, s) for i in range(30) for s in range(3)]
    parts = RandomDispatcher(seed=1).plan(requests, None, 4)
    assert sum(len(p) for p in parts) == 90
    assert all(len({r.prompt_id for r in p}) * 3 == len(p) for p in parts)


def test_lpt_scheduler_orders_longest_first_and_breaks_ties_fifo():
    s = LPTScheduler()
    for pid, n in [("a", 3), ("b", 9), ("c", 5), ("d", 9), ("e", None)]:
        s.push(Request(pid, [3], 16, predicted_length=n))
    assert [s.pop().prompt_id for _ in range(5)] == ["b", "d", "c", "a", "e"]
    with pytest.raises(IndexError):
        s.pop()


def test_generator_admits_in_lpt_order(tokenizer):
    generator = HFStreamGenerator(
        build_tiny_model(tokenizer, "test"), max_batch_size=1, scheduler=LPTScheduler(), greedy=True
    )
    generator.submit(
        Request(pid, [5, 6], 8, forced_length=n, predicted_length=n)
        for pid, n in [("a", 2), ("b", 6), ("c", 4)]
    )
    assert [s.prompt_id for s in generator.stream()] == ["b", "c", "a"]


def _bench_json(capsys, argv: list[str]) -> dict:
    import json

    from streamrl.cli.main import main

    assert main(["bench", "dispatch", *argv]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def _check_dispatch_contract(result: dict, rows: set[str], prompts: int, mode: str) -> None:
    """Keys and relations every ``bench dispatch`` JSON must satisfy."""
    makespan, ratio = result["makespan_s"], result["ratio_to_random"]
    assert set(makespan) == set(ratio) == rows
    assert result["prompts"] == prompts and result["mode"] == mode
    for label, seconds in makespan.items():
        assert ratio[label] == pytest.approx(seconds / makespan["random"], abs=1e-3)
        assert result["ratio_to_skew"][label] == pytest.approx(seconds / makespan["skew"], abs=1e-3)
    for label, quality in result["predictions"].items():
        assert label.startswith(("skew", "adaptive"))
        assert quality["source"] in ("ranker", "noisy", "file")
        assert 0.0 <= quality["recall@20"] <= 1.0 and -1.0 <= quality["kendall_tau"] <= 1.0
    assert result["recall@20"] == result["predictions"]["skew"]["recall@20"]  # the headline
    assert result["history"]["p50"] <= result["history"]["p90"]


def test_bench_dispatch_simulated_contract_and_order(capsys):
    # 128 prompts of the default file on 2 instances (64 each, 32 slots), paper PTL table.
    argv = ["--simulate", "--instances", "2", "--latency", "paper-7b-h800", "--prompts", "128"]
    result = _bench_json(capsys, argv)
    rows = {"random", "skew", "skew_noisy", "adaptive", "oracle"}
    _check_dispatch_contract(result, rows, 128, "simulated")
    assert set(result["requests_moved"]) == rows  # moves only by the planner that makes them
    assert all(n == 0 for label, n in result["requests_moved"].items() if label != "adaptive")
    makespan, quality = result["makespan_s"], result["predictions"]
    # The headline is the library's ranker, trained on the earlier iteration (2 x 128 samples).
    assert quality["skew"]["source"] == "ranker" and quality["skew_noisy"]["source"] == "noisy"
    assert quality["skew"]["trained_on"] == result["history"]["samples"] == 256
    assert quality["skew_noisy"]["sigma"] == 0.25
    # Replays are exact: nothing beats the latency model's floor (the longest sample at the
    # fastest step, every token at the best tokens/s), the oracle beats random, and no
    # prediction beats the oracle by more than the 4/3 LPT slack.
    floor = result["makespan_floor_s"]
    assert floor == max(result["longest_sample_s"], result["work_s"]) > 0
    assert all(v >= floor - 1e-4 for v in makespan.values())
    assert makespan["oracle"] < makespan["random"]
    assert makespan["skew"] < makespan["random"]  # measured: 0.925 of random for this seed
    assert all(makespan["oracle"] <= v * 4 / 3 for v in makespan.values())


def test_bench_dispatch_gives_the_adaptive_planner_its_own_arguments(capsys, monkeypatch):
    """``--adaptive {moves: false}`` reaches ``AdaptiveDispatcher`` beside the bench's own
    latency model, slots and ``D``; an argument it does not take fails before any work."""
    import inspect

    import streamrl.bench.dispatch as bench
    from streamrl.cli.main import main
    from streamrl.components.skewness.adaptive import AdaptiveDispatcher

    given, seen = [], []

    class Recording(AdaptiveDispatcher):
        __signature__ = inspect.signature(AdaptiveDispatcher)  # what the bench checks against

        def __init__(self, *args, **kwargs):
            given.append(kwargs)
            super().__init__(*args, **kwargs)

        def plan(self, requests, scores, instances):
            seen.extend((r.length_dist, score) for r, score in zip(requests, scores))
            return super().plan(requests, scores, instances)

    monkeypatch.setattr(bench, "AdaptiveDispatcher", Recording)
    argv = ["--simulate", "--instances", "2", "--latency", "paper-7b-h800", "--prompts", "16"]
    result = _bench_json(
        capsys, [*argv, "--policies", "skew,adaptive", "--adaptive", "{moves: false}"]
    )
    (kwargs,) = given
    assert kwargs["moves"] is False and len(kwargs["recent_lengths"]) == 32
    assert result["requests_moved"]["adaptive"] == 0
    # As in a run, it plans on the ranker's calibrated distributions, their medians the scores.
    assert len(seen) == 16 and all(d.sigma > 0 for d, _ in seen)
    assert all(d.median == pytest.approx(score) for d, score in seen)
    given.clear()
    assert main(["bench", "dispatch", *argv, "--adaptive", "{mvoes: false}"]) == 2
    err = capsys.readouterr().err
    assert "error: --adaptive: " in err and "takes no option(s) ['mvoes']" in err
    assert "(did you mean 'moves'?)" in err and not given  # refused before any plan was built
    assert main(["bench", "dispatch", *argv, "--adaptive", "{max_batch_size: 8}"]) == 2
    assert "--adaptive: ['max_batch_size'] are the bench's to set" in capsys.readouterr().err


def _recording(monkeypatch) -> list:
    """Swap the bench's ``SkewAwareDispatcher`` for one that records what it is given."""
    import streamrl.bench.dispatch as bench

    made = []

    class Recording(SkewAwareDispatcher):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.given_d, self.seen = list(self.recent), []
            made.append(self)

        def plan(self, requests, scores, instances):
            self.seen.append(([(r.forced_length, r.max_tokens) for r in requests], list(scores)))
            return super().plan(requests, scores, instances)

    monkeypatch.setattr(bench, "SkewAwareDispatcher", Recording)
    return made


def test_skew_policy_never_receives_the_true_lengths(tmp_path, capsys, monkeypatch):
    import json

    from streamrl.bench.predictions import batch_and_history

    true = [3 * i + 1 for i in range(40)]
    predicted = [float(n) for n in reversed(true)]  # anti-correlated with the truth
    (tmp_path / "true.json").write_text(json.dumps(true))
    (tmp_path / "pred.json").write_text(json.dumps(predicted))
    made = _recording(monkeypatch)
    argv = [
        "--simulate",
        "--instances",
        "4",
        "--latency",
        "paper-7b-h800",
        "--lengths",
        str(tmp_path / "true.json"),
        "--predicted",
        str(tmp_path / "pred.json"),
    ]
    result = _bench_json(capsys, argv)
    skew, oracle = made  # rows in order: random, skew, oracle
    _, earlier = batch_and_history(true, 40, 80, 0.25, 0)
    # Skew: D from the earlier iteration, the user's predictions as scores, and requests that
    # carry no forced length and one shared token budget.
    assert skew.given_d == earlier.lengths and sorted(skew.given_d) != true
    ((requests, scores),) = skew.seen
    assert scores == predicted
    assert {forced for forced, _ in requests} == {None}
    assert {budget for _, budget in requests} == {max(true)}
    # Only the oracle is given the truth.
    assert oracle.given_d == true and oracle.seen[0][1] == [float(n) for n in true]
    assert result["predictions"]["skew"]["kendall_tau"] == -1.0


def test_ranker_predictions_read_the_prompts_only():
    from streamrl.bench.predictions import Batch, batch_and_history, predict

    batch, earlier = batch_and_history(list(range(2, 120, 3)), 40, 200, 0.25, seed=0)
    first = predict("ranker", batch, earlier, ranker_noise=0.25, seed=0)
    # Same prompts, other truth: identical predictions (the truth is never read).
    shuffled = Batch(batch.prompts, list(reversed(batch.lengths)))
    assert predict("ranker", shuffled, earlier, ranker_noise=0.25, seed=0).lengths == first.lengths
    assert first.info["trained_on"] == 200 and not set(batch.prompts) & set(earlier.prompts)
    # The text carries signal: the ranker orders the batch far better than chance.
    from streamrl.components.skewness.ranking_metrics import kendall_tau

    assert kendall_tau(first.lengths, batch.lengths) > 0.3


@pytest.mark.timeout(300)
def test_bench_dispatch_real_runs_lengths_past_the_tiny_context(tmp_path, capsys):
    import json

    # 300 tokens exceed the tiny model's default context (256): it is built with enough.
    (tmp_path / "long.json").write_text(json.dumps([300, 5, 9, 12, 7, 4, 30, 6]))
    argv = [
        "--lengths",
        str(tmp_path / "long.json"),
        "--instances",
        "2",
        "--repeats",
        "1",
        "--max-batch-size",
        "4",
        "--predictions",
        "ranker",
    ]
    result = _bench_json(capsys, argv)
    _check_dispatch_contract(result, {"random", "skew", "adaptive", "oracle"}, 8, "real")
    # Wall clock on a shared machine: the longest sample alone bounds each row loosely.
    assert all(v >= 0.5 * result["longest_sample_s"] for v in result["makespan_s"].values())
    # Where each row's samples ran: all 8, their tokens, the 300-token one the widest, and
    # the run no sooner done than its last instance.
    for label, (run,) in result["instance_loads"].items():
        assert sum(i["samples"] for i in run) == 8, label
        assert sum(i["tokens"] for i in run) == 300 + 5 + 9 + 12 + 7 + 4 + 30 + 6, label
        assert max(i["widest"] for i in run) == 300 and {i["instance"] for i in run} <= {0, 1}
        assert 0 < max(i["end_s"] for i in run) <= result["makespan_s"][label] + 0.05, label


def test_recall_and_kendall_hand_computed():
    from streamrl.components.skewness.ranking_metrics import kendall_tau, recall_at_k

    assert recall_at_k([5, 4, 3, 2, 1], [9, 1, 8, 2, 0], 0.4) == 0.5
    assert recall_at_k([1, 2, 3, 4, 5], [1, 2, 3, 4, 5], 0.2) == 1.0
    assert kendall_tau([1, 2, 3, 4], [10, 20, 40, 30]) == pytest.approx(4 / 6)
    assert kendall_tau([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)


def test_profile_command_measures_ptl(tmp_path, capsys):
    import json

    from streamrl.cli.main import main

    out = tmp_path / "profile.json"
    argv = ["profile", "--batch-sizes", "1,4", "--contexts", "16,96", "--tokens", "4"]
    assert main([*argv, "--repeats", "1", "-o", str(out)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["batch_sizes"] == [1, 4] and all(p > 0 for p in result["ptl_ms"])
    # The grid as timed, each cell beside the fitted model's price of it.
    cells = [(c["batch"], c["context"]) for c in result["grid"]]
    assert cells == [(1, 16), (1, 96), (4, 16), (4, 96)]
    assert all(c["model_s"] > 0 for c in result["grid"]) and result["fit_error"]["max"] >= 0
    model = LatencyModel.from_json(out)
    assert model.batch_sizes == [1, 4] and model.ptl(2) > 0 and model.load == "widest"
    assert model.context_s == pytest.approx(result["context_us_per_token"] * 1e-6, abs=1e-11)
