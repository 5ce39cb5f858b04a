"""Network-aware weight broadcast (StreamRL §6): plans, their cost model, the simulator's use of
it, and one bounded multi-process run (spawned gloo processes standing in for two sites)."""

from __future__ import annotations

import datetime
import io
import multiprocessing as mp
import queue

import pytest
import torch
import torch.distributed as dist

from streamrl.components.capacity.allocator import TrainerCostModel
from streamrl.components.skewness.latency import LatencyModel
from streamrl.components.weights.broadcast_tree import (
    BroadcastPlan,
    Edge,
    Node,
    TreeBroadcaster,
    direct_plan,
    plan_broadcast,
    plan_time_s,
)
from streamrl.components.weights.transport import make_store
from streamrl.errors import ConfigError
from streamrl.sim.config import GeneratorPool, SimConfig, TrainerPool, Workload

GB = 1e9


def edges_of(plan: BroadcastPlan) -> list[tuple[str, list[str], str]]:
    return [(str(e.sender), [str(r) for r in e.receivers], e.link) for e in plan.edges]


def test_one_copy_per_remote_site_then_local_fan_out():
    sites = {"dc-a": [0, 1, 2, 3], "dc-b": [4, 5], "dc-c": [6]}
    plan = plan_broadcast(sites, "dc-a", trainer_ranks=2)
    assert edges_of(plan) == [
        ("trainer0@dc-a", ["instance4@dc-b"], "dc-a->dc-b"),  # rank 0 takes the first link
        ("trainer1@dc-a", ["instance6@dc-c"], "dc-a->dc-c"),  # ranks in turn
        ("trainer0@dc-a", ["instance0@dc-a", "instance1@dc-a"], "dc-a"),  # two local trees
        ("trainer1@dc-a", ["instance2@dc-a", "instance3@dc-a"], "dc-a"),
        ("instance4@dc-b", ["instance5@dc-b"], "dc-b"),  # dc-c has no one to fan out to
    ]
    assert plan.link_copies() == {"dc-a->dc-b": 1, "dc-a->dc-c": 1}
    assert sorted(n.index for n in plan.instances()) == list(range(7))
    # Today: one copy per instance, so dc-b's link carries two.
    assert direct_plan(sites, "dc-a").link_copies() == {"dc-a->dc-b": 2, "dc-a->dc-c": 1}


def test_trainer_site_without_instances_and_uneven_trees():
    plan = plan_broadcast({"cloud": [0, 1, 2]}, "local", trainer_ranks=[3, 7])
    assert edges_of(plan) == [
        ("trainer3@local", ["instance0@cloud"], "local->cloud"),
        ("instance0@cloud", ["instance1@cloud", "instance2@cloud"], "cloud"),
    ]
    trees = plan_broadcast({"a": [0, 1, 2, 3, 4]}, "a", trainer_ranks=3)
    assert [len(e.receivers) for e in trees.edges] == [1, 2, 2]  # 5 split as evenly as can be


@pytest.mark.parametrize(
    "sites, ranks, match",
    [
        ({"a": []}, 1, "No generator"),
        ({"a": [0], "b": [0]}, 1, "more than one place"),
        ({"a": [0]}, 0, "trainer rank"),
        ({"a": [0]}, [1, 1], "trainer rank"),
    ],
)
def test_bad_sites_raise_config_errors(sites, ranks, match):
    with pytest.raises(ConfigError, match=match):
        plan_broadcast(sites, "a", ranks)


def test_plan_rejects_a_sender_without_weights():
    a, b = Node("instance", 0, "x"), Node("instance", 1, "x")
    with pytest.raises(ConfigError, match="no weights yet"):
        BroadcastPlan((Edge(a, (b,)),))


def test_plan_time_72b_bf16_over_80_gbps():
    # 72B bf16 = 144 GB = 1152 Gbit: 14.4 s over the 80 Gbps link, 5.76 s at 200 Gbps locally.
    weights, sites = 144 * GB, {"dc-a": [0, 1], "dc-b": [2, 3, 4, 5]}
    aware = plan_time_s(plan_broadcast(sites, "dc-a"), weights, local_gbps=200, link_gbps=80)
    assert aware == pytest.approx(14.4 + 5.76)  # the link, then dc-b's local broadcast
    direct = plan_time_s(direct_plan(sites, "dc-a"), weights, local_gbps=200, link_gbps=80)
    assert direct == pytest.approx(4 * 14.4)  # four copies share the link
    # No remote site: one local tree per trainer rank, each one pipelined broadcast.
    local = plan_time_s(plan_broadcast({"dc-a": [0, 1, 2]}, "dc-a", 2), weights, 200, 80)
    assert local == pytest.approx(5.76)


def test_simulator_uses_the_plan_when_sites_are_set():
    gen = GeneratorPool(LatencyModel([1], [0.01]), instances=6, max_batch_size=4)
    trainer = TrainerPool(TrainerCostModel(s_per_token=1e-3), units=1, token_budget=64)
    workload = Workload(lambda it: [4, 4], prompts=2)
    common = dict(weight_bytes=144 * GB, link_gbps=80.0, sync_latency_s=1.0)
    flat = SimConfig(gen, trainer, workload, **common)
    assert flat.weight_transfer_s == pytest.approx(14.4 + 1.0)  # unchanged without sites
    sited = SimConfig(
        gen,
        trainer,
        workload,
        **common,
        sites={"a": [0, 1], "b": [2, 3, 4, 5]},
        trainer_site="a",
        local_gbps=200.0,
    )
    assert sited.weight_transfer_s == pytest.approx(14.4 + 5.76 + 1.0)
    with pytest.raises(ConfigError, match="more than one place"):
        SimConfig(gen, trainer, workload, sites={"a": [0], "b": [0]}, trainer_site="a")


# -- one real run: 1 trainer rank (this process) + 4 spawned instances in 2 sites --------------

SITES = {"dc-a": [0, 1], "dc-b": [2, 3]}
TIMEOUT_S = 60.0


def trainer_weights() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(8, 4, generator=g),
        torch.randn(4, generator=g).to(torch.bfloat16),
        torch.tensor(3.5),
        torch.arange(6),
    ]


def instance_main(instance_id: int, port: int, results: mp.Queue) -> None:
    """A generator instance stand-in: join the plan's groups, receive (and forward)."""
    try:
        plan = plan_broadcast(SITES, "dc-a")
        member = next(n for n in plan.instances() if n.index == instance_id)
        store = dist.TCPStore(
            "127.0.0.1", port, 5, False, timeout=datetime.timedelta(seconds=TIMEOUT_S)
        )
        tensors = [torch.zeros_like(t) for t in trainer_weights()]
        tree = TreeBroadcaster(plan, member, store, bucket_bytes=64, timeout_s=TIMEOUT_S)
        tree.broadcast(tensors)
        # As bytes: a tensor put on the queue is shared through this process's fd server, which
        # is gone if the process exits before the test reads it (a flaky FileNotFoundError).
        buf = io.BytesIO()
        torch.save(tensors, buf)
        results.put((instance_id, buf.getvalue(), dict(tree.sent_bytes), dict(tree.received_bytes)))
    except BaseException as err:
        results.put((instance_id, repr(err), {}, {}))


def test_tree_broadcast_across_processes():
    ctx = mp.get_context("spawn")
    store = make_store(5, TIMEOUT_S)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=instance_main, args=(i, store.port, results), daemon=True)
        for i in range(4)
    ]
    try:
        for proc in procs:
            proc.start()
        plan = plan_broadcast(SITES, "dc-a")
        weights = trainer_weights()
        tree = TreeBroadcaster(
            plan, Node("trainer", 0, "dc-a"), store, bucket_bytes=64, timeout_s=TIMEOUT_S
        )
        moved = tree.broadcast(weights)
        got = {}
        for _ in procs:
            try:
                instance_id, *rest = results.get(timeout=TIMEOUT_S)
            except queue.Empty:
                pytest.fail(f"an instance did not report within {TIMEOUT_S} s")
            if isinstance(rest[0], bytes):
                rest[0] = torch.load(io.BytesIO(rest[0]))
            got[instance_id] = rest
    finally:
        for proc in procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    payload = sum(t.numel() * t.element_size() for t in weights)
    assert moved == 2 * payload  # the trainer is on two edges: across the link and local
    for instance_id, (tensors, _, _) in got.items():
        assert not isinstance(tensors, str), f"instance {instance_id} failed: {tensors}"
        assert all(torch.equal(a, b) for a, b in zip(tensors, weights)), instance_id
    # One copy crossed dc-a -> dc-b (trainer to instance 2), which then fanned out in dc-b.
    assert tree.sent_bytes == {"dc-a->dc-b": payload, "dc-a": payload}
    assert got[2][1] == {"dc-b": payload} and got[2][2] == {"dc-a->dc-b": payload}
    crossed = sum(r.get("dc-a->dc-b", 0) for _, _, r in got.values())
    assert crossed == payload  # not 2 x payload, as one group per instance would send
    assert [got[i][2] for i in (0, 1, 3)] == [{"dc-a": payload}] * 2 + [{"dc-b": payload}]
