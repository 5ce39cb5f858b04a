"""The stream generation service with real spawned processes (few, bounded: each costs seconds)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from streamrl.components.generation.engines import HFEngine
from streamrl.components.generation.hf_generator import fingerprint
from streamrl.components.generation.service import GeneratorError, StreamGenerationService
from streamrl.components.generation.timeouts import Timeouts
from streamrl.components.skewness.schedulers import FIFOScheduler, LPTScheduler
from streamrl.components.weights.path import WeightPath
from streamrl.errors import ConfigError
from streamrl.policy.models import build_tiny_model, save_policy
from streamrl.protocols import AdmissionScheduler, Cluster, EngineSpec, StreamGenerator
from streamrl.records import Request, Sample

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("policy")
    save_policy(build_tiny_model(tokenizer, "test", seed=0), tokenizer, path)
    return path


def requests_for(tokenizer, n_prompts: int, group: int, forced: list[int] | None = None):
    out = []
    for i in range(n_prompts):
        ids = tokenizer(f"copy {'abc'[: 1 + i % 3]}=")["input_ids"]
        for s in range(group):
            length = forced[i] if forced else None
            out.append(Request(f"p{i}", ids, max_tokens=24, sample_index=s, forced_length=length))
    return out


def test_two_instances_stream_every_request_once_in_completion_order(model_dir, tokenizer):
    forced = [20, 2, 12, 4, 16, 6]  # prompt i gets forced length forced[i]
    reqs = requests_for(tokenizer, 6, 2, forced)
    with StreamGenerationService(model_dir, 2, max_batch_size=8) as sgs:
        samples = list(sgs.generate(reqs))
        assert sorted(s.key for s in samples) == sorted(r.key for r in reqs)
        assert {s.instance_id for s in samples} == {0, 1}
        assert all(s.length == forced[int(s.prompt_id[1:])] for s in samples)
        # Streamed in completion order: within an instance, shorter forced lengths come first.
        for instance in (0, 1):
            lengths = [s.length for s in samples if s.instance_id == instance]
            assert lengths == sorted(lengths)
        finished = [s.finished_s for s in samples]
        assert finished == sorted(finished)
        assert all(s.weight_version == 0 and len(s.logprobs) == s.length for s in samples)


@pytest.mark.parametrize(
    ("transport", "gpus"),
    [
        ("gloo", 0),
        ("bucketed", 0),
        pytest.param("gloo", 1, marks=pytest.mark.gpu, id="gloo-generators-on-gpu"),
    ],
)
def test_update_makes_generator_weights_equal_trainer_weights(
    model_dir, tokenizer, transport, gpus
):
    policy = build_tiny_model(tokenizer, "test", seed=0)
    with StreamGenerationService(
        model_dir, 2, max_batch_size=4, weights=WeightPath(transport), gpus_per_instance=gpus
    ) as sgs:
        assert set(sgs.fingerprints().values()) == {fingerprint(policy)}
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        sgs.update(policy, version=7)
        assert set(sgs.fingerprints().values()) == {fingerprint(policy)}
        assert [i.weight_version for i in sgs.instances()] == [7, 7]
        samples = list(sgs.generate(requests_for(tokenizer, 2, 1)))
        assert {s.weight_version for s in samples} == {7}
    assert not [p for p in mp.active_children() if p.name.startswith("streamrl-generator")]


def test_added_instance_gets_current_weights_then_requests_and_nothing_is_lost(
    model_dir, tokenizer
):
    policy = build_tiny_model(tokenizer, "test", seed=0)
    with StreamGenerationService(model_dir, 1, max_batch_size=4) as sgs:
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        sgs.update(policy, version=3)
        # Requests in flight while the new instance starts: none may be lost or repeated.
        first = requests_for(tokenizer, 4, 2, [30] * 4)
        sgs.submit(first)
        new_id = sgs.add_instance()
        assert sgs.instances()[new_id].state == "starting"
        done = [sgs.next_sample() for _ in first]
        assert sorted(s.key for s in done) == sorted(r.key for r in first)
        assert {s.instance_id for s in done} == {0}
        sgs.add_instance(wait=True)  # a third, while the second may still be joining
        assert [i.state for i in sgs.instances()] == ["active"] * 3
        assert [i.weight_version for i in sgs.instances()] == [3, 3, 3]
        assert set(sgs.fingerprints().values()) == {fingerprint(policy)}
        second = requests_for(tokenizer, 6, 1)
        samples = list(sgs.generate(second))
        assert {s.instance_id for s in samples} == {0, 1, 2}
        assert {s.weight_version for s in samples} == {3}
        with torch.no_grad():  # later versions reach the added instances too
            for p in policy.parameters():
                p.mul_(0.9)
        sgs.update(policy, version=4)
        assert set(sgs.fingerprints().values()) == {fingerprint(policy)}
    assert not [p for p in mp.active_children() if p.name.startswith("streamrl-generator")]


def test_removed_instance_finishes_what_it_holds_then_stops(model_dir, tokenizer):
    with StreamGenerationService(model_dir, 2, max_batch_size=4) as sgs:
        first = requests_for(tokenizer, 4, 2, [40] * 4)
        sgs.submit(first)
        assert sgs.remove_instance() == 1  # the newest active one, while it holds requests
        assert sgs.instances()[1].state == "draining"
        done = [sgs.next_sample() for _ in first]
        assert sorted(s.key for s in done) == sorted(r.key for r in first)
        assert {s.instance_id for s in done} == {0, 1}  # its requests were finished, not cut
        assert sgs.instances()[1].state == "stopped"
        second = list(sgs.generate(requests_for(tokenizer, 3, 1)))
        assert {s.instance_id for s in second} == {0}
        with pytest.raises(ValueError, match="at least one active instance"):
            sgs.remove_instance()
    assert not [p for p in mp.active_children() if p.name.startswith("streamrl-generator")]


def test_instance_that_dies_at_start_is_named_and_cleaned_up(tmp_path):
    with pytest.raises(GeneratorError, match=r"instance 0 failed:(.|\n)*No model directory"):
        StreamGenerationService(tmp_path / "missing", 1, timeouts=Timeouts(start_s=60)).start()
    assert not [p for p in mp.active_children() if p.name.startswith("streamrl-generator")]


@pytest.mark.faults
def test_instance_killed_without_restarts_left_raises_instead_of_hanging(model_dir, tokenizer):
    reqs = requests_for(tokenizer, 4, 2, [200] * 4)
    with StreamGenerationService(
        model_dir, 1, max_batch_size=2, timeouts=Timeouts(sample_s=30), max_restarts=0
    ) as sgs:
        stream = sgs.generate(reqs)
        os.kill(sgs.instances()[0].pid, signal.SIGKILL)
        with pytest.raises(GeneratorError, match=r"instance 0 .* died(.|\n)*max_restarts=0"):
            list(stream)
    assert not [p for p in mp.active_children() if p.name.startswith("streamrl-generator")]


@pytest.mark.faults
@pytest.mark.parametrize("fault", ["kill", "hang"])
def test_failed_instance_is_replaced_and_its_requests_requeued(
    model_dir, tokenizer, tmp_path, fault
):
    policy = build_tiny_model(tokenizer, "test", seed=0)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    status = tmp_path / "instances.json"
    reqs = requests_for(tokenizer, 6, 2, [120] * 6)
    with StreamGenerationService(
        model_dir, 2, max_batch_size=4, timeouts=Timeouts(heartbeat_s=4), status_path=status
    ) as sgs:
        sgs.update(policy, version=2)
        stream = sgs.generate(reqs)
        samples = [next(stream)]
        victim = json.loads(status.read_text())["0"]["pid"]
        os.kill(victim, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        samples += list(stream)
        # Every request answered exactly once; the replacement got the current weights first.
        assert sorted(s.key for s in samples) == sorted(r.key for r in reqs)
        assert sgs.counts["instances_restarted"] == 1 and sgs.counts["requests_requeued"] > 0
        sgs.wait_active()  # the replacement may still be loading
        states = {i.instance_id: (i.state, i.weight_version) for i in sgs.instances()}
        assert states == {0: ("failed", 2), 1: ("active", 2), 2: ("active", 2)}
        assert {s.weight_version for s in samples} == {2}
        written = json.loads(status.read_text())
        assert written["0"]["state"] == "failed" and written["2"]["state"] == "active"
        assert set(sgs.fingerprints().values()) == {fingerprint(policy)}
    assert not [p for p in mp.active_children() if p.name.startswith("streamrl-generator")]


# -- a user's engine and scheduler, defined here: nothing inside the library knows them ---------


def _log(path: str, line: str) -> None:
    with open(path, "a") as out:  # one short append per line: lines of two processes never mix
        out.write(line + "\n")


class CountingGenerator:
    """Wraps the HF generator (no subclass) and logs what its instance does to it."""

    def __init__(self, inner: StreamGenerator, log: str, instance_id: int) -> None:
        self.inner, self.log, self.instance_id, self.steps = inner, log, instance_id, 0

    @property
    def weight_version(self) -> int:
        return self.inner.weight_version

    @property
    def idle(self) -> bool:
        return self.inner.idle

    def submit(self, requests: Iterable[Request]) -> None:
        self.inner.submit(requests)

    def step(self) -> list[Sample]:
        self.steps += 1
        return self.inner.step()

    def stream(self) -> Iterator[Sample]:
        while not self.idle:
            yield from self.step()

    def set_batch_limit(self, limit: int) -> None:
        self.inner.set_batch_limit(limit)

    def weight_templates(self) -> Mapping[str, torch.Tensor]:
        return self.inner.weight_templates()

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        self.inner.load_weights(state_dict, version)
        _log(self.log, f"load {self.instance_id} version={version} after_steps={self.steps > 0}")

    def fingerprint(self) -> str:
        return self.inner.fingerprint()


@dataclass(frozen=True)
class CountingEngine:
    """A ``GenerationEngine`` of plain settings: the HF engine's generator, counted."""

    log: str

    def check(self, *, cluster: Cluster, gpus_per_instance: int) -> None:
        _log(self.log, f"check {cluster} {gpus_per_instance} pid={os.getpid()}")

    def __call__(self, spec: EngineSpec, scheduler: AdmissionScheduler) -> StreamGenerator:
        _log(
            self.log,
            f"build {spec.instance_id} pid={os.getpid()} seed={spec.seed} device={spec.device} "
            f"batch={spec.max_batch_size} greedy={spec.greedy} queue={type(scheduler).__name__}",
        )
        return CountingGenerator(HFEngine()(spec, scheduler), self.log, spec.instance_id)


class LastInFirstOut:
    """An admission queue of the user's: the newest request first."""

    def __init__(self) -> None:
        self.waiting: list[Request] = []

    def push(self, request: Request) -> None:
        self.waiting.append(request)

    def pop(self) -> Request:
        return self.waiting.pop()

    def __len__(self) -> int:
        return len(self.waiting)


def newest_first() -> AdmissionScheduler:
    """A scheduler factory that is a function, not a class."""
    return LastInFirstOut()


def test_a_users_engine_and_scheduler_factory_run_in_every_instance(model_dir, tokenizer, tmp_path):
    log = str(tmp_path / "engine.log")
    policy = build_tiny_model(tokenizer, "test", seed=0)
    reqs = requests_for(tokenizer, 6, 1, [4] * 6)
    with StreamGenerationService(
        model_dir,
        2,
        engine=CountingEngine(log),
        scheduler=newest_first,
        max_batch_size=1,  # one at a time: completion order is admission order
        greedy=True,
        seed=5,
    ) as sgs:
        samples = list(sgs.generate(reqs))
        assert sorted(s.key for s in samples) == sorted(r.key for r in reqs)
        for instance in (0, 1):  # each instance admitted its requests newest first
            order = [int(s.prompt_id[1:]) for s in samples if s.instance_id == instance]
            assert len(order) == 3 and order == sorted(order, reverse=True)
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(0.01)
        sgs.update(policy, version=1)
        assert set(sgs.fingerprints().values()) == {fingerprint(policy)}
        pids = {i.instance_id: i.pid for i in sgs.instances()}
    lines = Path(log).read_text().splitlines()
    assert lines[0] == f"check local 0 pid={os.getpid()}"  # here, before any process started
    builds = sorted(line for line in lines if line.startswith("build"))
    assert builds == [
        f"build {i} pid={pids[i]} seed={5 + i} device=cpu batch=1 greedy=True queue=LastInFirstOut"
        for i in (0, 1)
    ]  # in each instance's own process, with its own queue
    loads = sorted(line for line in lines if line.startswith("load"))
    assert loads == [f"load {i} version=1 after_steps=True" for i in (0, 1)]
    assert not [p for p in mp.active_children() if p.name.startswith("streamrl-generator")]


@dataclass(frozen=True)
class NoGPUHere:
    def check(self, *, cluster: Cluster, gpus_per_instance: int) -> None:
        raise ConfigError("NoGPUHere: this engine needs a GPU.")

    def __call__(self, spec: EngineSpec, scheduler: AdmissionScheduler) -> StreamGenerator:
        raise AssertionError("never built: check failed first")


def test_engine_and_scheduler_are_checked_before_any_process_starts(model_dir):
    def service(**kwargs):
        return StreamGenerationService(model_dir, 1, **kwargs)

    with pytest.raises(ConfigError, match="this engine needs a GPU"):
        service(engine=NoGPUHere())
    with pytest.raises(ConfigError, match=r"temperature must be > 0, got 0.0; pass greedy=True"):
        service(temperature=0.0)  # refused here, not inside each generator process
    with pytest.raises(TypeError, match=r"engine object, e\.g\. HFEngine\(\).*not the name 'hf'"):
        service(engine="hf")
    with pytest.raises(TypeError, match=r"pass an instance, e\.g\. HFEngine\(\), not the class"):
        service(engine=HFEngine)
    with pytest.raises(TypeError, match="object is no GenerationEngine"):
        service(engine=object())
    for queue in ("lpt", LPTScheduler()):  # a name, or one queue where each instance needs one
        with pytest.raises(TypeError, match="pass a factory that makes one admission queue"):
            service(scheduler=queue)
    with pytest.raises(TypeError, match=r"scheduler: .* cannot be pickled"):
        service(scheduler=lambda: FIFOScheduler())
    assert service(engine=HFEngine(), scheduler=LPTScheduler).instances() == []  # not started
    assert not [p for p in mp.active_children() if p.name.startswith("streamrl-generator")]


def test_dispatcher_and_instances_must_agree_on_the_batch_size(tmp_path):
    from streamrl.components.skewness.latency import LatencyModel
    from streamrl.components.skewness.skew_dispatch import SkewAwareDispatcher

    latency = LatencyModel.from_table_ms({1: 1.0, 64: 2.0})
    dispatcher = SkewAwareDispatcher(latency, max_batch_size=64)
    with pytest.raises(ValueError, match=r"up to 64 sequences but the instances have max_batch"):
        StreamGenerationService(tmp_path, 2, max_batch_size=32, dispatcher=dispatcher)
