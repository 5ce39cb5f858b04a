"""The stream generation service on a real local Ray cluster: instances are Ray actors.

One cluster for the module (num_cpus=2, no dashboard, no token auth, its session folder under the
test's tmp). Actors take half a CPU each so three fit beside the driver.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from extension_plugins import AllOnFirstInstance

from streamrl.components.generation.hf_generator import fingerprint
from streamrl.components.generation.ray_instance import RayOptions
from streamrl.components.generation.service import StreamGenerationService
from streamrl.components.generation.timeouts import Timeouts
from streamrl.components.skewness.latency import LatencyModel
from streamrl.components.skewness.schedulers import LPTScheduler
from streamrl.policy.models import build_tiny_model, save_policy
from streamrl.records import Request

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def ray_options(tmp_path_factory):
    options = RayOptions(
        num_cpus=2, cpus_per_instance=0.5, temp_dir=str(tmp_path_factory.mktemp("ray"))
    )
    yield options
    ray.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("policy")
    save_policy(build_tiny_model(tokenizer, "test", seed=0), tokenizer, path)
    return path


def requests_for(tokenizer, lengths: list[int], iteration: int = 0) -> list[Request]:
    ids = tokenizer("copy ab=")["input_ids"]
    return [
        Request(f"p{i}", ids, max_tokens=32, iteration=iteration, forced_length=n)
        for i, n in enumerate(lengths)
    ]


def test_ray_actors_stream_update_grow_and_survive_a_kill(model_dir, tokenizer, ray_options):
    policy = build_tiny_model(tokenizer, "test", seed=0)
    service = StreamGenerationService(
        model_dir,
        2,
        max_batch_size=4,
        cluster="ray",
        ray=ray_options,
        timeouts=Timeouts(heartbeat_s=30),
    )
    with service:
        # The instances are Ray actors: their processes are Ray workers, not our children.
        infos = service.instances()
        assert all(i.state == "active" and i.pid not in (None, os.getpid()) for i in infos)

        # generate: every request once, streamed in completion order.
        lengths = [18, 2, 10, 4, 14, 6]
        samples = list(service.generate(requests_for(tokenizer, lengths)))
        assert sorted(s.prompt_id for s in samples) == sorted(f"p{i}" for i in range(6))
        assert all(s.length == lengths[int(s.prompt_id[1:])] for s in samples)
        assert {s.instance_id for s in samples} == {0, 1}
        for instance in (0, 1):  # streamed as they finish: shorter forced lengths first
            mine = [s.length for s in samples if s.instance_id == instance]
            assert mine == sorted(mine)

        # update: weights cross a torch.distributed group that includes the actors.
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(0.01)
        service.update(policy, version=1)
        assert set(service.fingerprints().values()) == {fingerprint(policy)}

        # add_instance: a new actor catches up to version 1 before it takes requests.
        new = service.add_instance(wait=True)
        assert service.instances()[new].weight_version == 1
        assert service.fingerprints()[new] == fingerprint(policy)

        # kill an actor while it holds requests: replaced, its requests requeued, none lost.
        reqs = requests_for(tokenizer, [24] * 9, iteration=1)
        service.submit(reqs)
        victim = service.pool.handles[0]
        ray.kill(victim.proc.actor, no_restart=True)
        got = [service.next_sample() for _ in reqs]
        assert sorted(s.key for s in got) == sorted(r.key for r in reqs)
        assert service.counts["instances_restarted"] == 1
        assert service.instances()[0].state == "failed"
        service.wait_active()  # the replacement actor, with the current weights
        assert sum(i.state == "active" for i in service.instances()) == 3
        assert service.fingerprints()[3] == fingerprint(policy)

        retired = service.remove_instance()
        assert service.instances()[retired].state == "stopped"
    assert not any(i.alive for i in service.instances())


def test_gpus_the_ray_cluster_lacks_fail_before_any_actor_starts(model_dir, ray_options):
    from streamrl.errors import ConfigError

    service = StreamGenerationService(
        model_dir, 1, cluster="ray", gpus_per_instance=1, ray=ray_options
    )
    with pytest.raises(ConfigError, match=r"need 1 GPU\(s\) each but the Ray cluster has 0"):
        service.start()
    assert service.instances() == []


def test_fit_config_switches_to_ray_with_one_field(tmp_path, fit_small, ray_options):
    """The same `streamrl fit` config as a local run, plus `cluster: ray`."""
    from streamrl.components.generation.ray_instance import connect

    connect(ray_options)  # the module's cluster (a run would otherwise start one of its own)
    fit_small(generation={"num_instances": 2}, cluster="ray")
    status = json.loads((tmp_path / "out" / "instances.json").read_text())
    assert [s["state"] for s in status.values()] == ["stopped", "stopped"]
    assert all(s["pid"] not in (None, os.getpid()) for s in status.values())


def test_ray_actors_move_requests_between_them(model_dir, tokenizer, ray_options):
    """Moving work mid-flight on Ray actors (issue 34): everything planned onto one actor, the
    other takes its share by moves; every sample once, greedy tokens as one instance gives."""
    lengths = [22, 3, 18, 5, 14, 7, 20, 4, 16, 9]
    with StreamGenerationService(model_dir, 1, max_batch_size=4, greedy=True) as one:
        baseline = {s.key: s.token_ids for s in one.generate(requests_for(tokenizer, lengths))}
    planner = AllOnFirstInstance(LatencyModel([1, 4], [0.002, 0.008]), max_batch_size=4)
    with StreamGenerationService(
        model_dir,
        2,
        max_batch_size=4,
        greedy=True,
        cluster="ray",
        ray=ray_options,
        dispatcher=planner,
        scheduler=LPTScheduler,
    ) as sgs:
        scores = [float(n) for n in lengths]
        samples = list(sgs.generate(requests_for(tokenizer, lengths), scores))
        moved = sgs.counts["requests_moved"]
    assert sorted(s.key for s in samples) == sorted(baseline)
    assert all(s.token_ids == baseline[s.key] for s in samples)
    assert moved >= 1 and {s.instance_id for s in samples} == {0, 1}
