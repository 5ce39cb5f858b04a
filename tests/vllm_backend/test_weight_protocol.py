"""vLLM's weight-transfer protocol on vLLM's CPU build, through our gloo backend: the very calls a
GPU run makes (``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights``,
``finish_weight_update``), several instances on one broadcast, checksums after every version,
and transfers broken on purpose caught."""

from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("vllm")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch
from hosted_instance import HostedInstance
from test_vllm_generator import _forced, _hf_greedy, _moe_and_other, _policy
from test_vllm_service import _logprobs

from streamrl.components.generation.engines import VLLMEngine
from streamrl.components.generation.service import StreamGenerationService
from streamrl.components.generation.timeouts import Timeouts
from streamrl.components.weights.checksums import (
    WeightMismatchError,
    verify_applied,
    verify_digests,
)
from streamrl.components.weights.instances_client import InstancesClient
from streamrl.components.weights.path import WeightPath
from streamrl.components.weights.vllm_protocol import (
    GlooWeightTransferEngine,
    WireSource,
    trainer_engine,
)
from streamrl.policy.models import build_tiny_model, build_tokenizer, save_policy
from streamrl.records import Request

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore:.*reduce_op.*:FutureWarning"),
]


class DropsWhatItReceives(GlooWeightTransferEngine):
    """A worker backend that joins every broadcast and applies nothing: the silent no-op of
    vLLM's NCCL path off CUDA (vLLM PR #57022), or an adapter never applied (verl #7495)."""

    def receive_weights(self, update_info):  # type: ignore[no-untyped-def]
        model, self.model = self.model, _Nowhere()
        try:
            super().receive_weights(update_info)  # every bucket crosses, and goes nowhere
        finally:
            self.model = model
        self.loaded_digests = {}


class _Nowhere:
    def load_weights(self, weights):  # type: ignore[no-untyped-def]
        return set()


#: The error names the instance and the first tensor that differs.
NAMED = r"instance-0 .* 'model\.embed_tokens\.weight'"
#: Registered in each instance's process (``hosted_instance``), as a vLLM plugin would be.
NOOP = "streamrl_test_drops"


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_policy(_policy(seed=0), build_tokenizer(), tmp_path_factory.mktemp("policy"))


def _instances(policy_dir: Path, count: int, **kwargs) -> dict[str, HostedInstance]:
    """``count`` instances, each a process of its own (as in a run)."""
    backends = {NOOP: f"{__name__}:DropsWhatItReceives"}
    return {
        f"instance-{k}": HostedInstance(policy_dir, backends, instance_id=k, **kwargs)
        for k in range(count)
    }


def _sender(policy, instances: dict[str, HostedInstance]):
    """The trainer's engine for ``instances`` (vLLM's factory), sending ``policy`` in float32."""
    source = WireSource(policy.named_parameters, torch.float32)
    return trainer_engine(source, InstancesClient(instances, timeout_s=60), timeout_s=60)


def _check(sender, instances: dict[str, HostedInstance]) -> None:
    for name, instance in instances.items():
        for loaded in instance.loaded_digests():
            verify_digests(sender.sent_digests, loaded, name)
        for applied in instance.applied_digests():
            assert verify_applied(sender.sent_digests, applied, name) > 0


def test_one_broadcast_reaches_every_instance_and_checksums_agree(policy_dir):
    instances = _instances(policy_dir, 3)
    try:
        client = InstancesClient(instances, timeout_s=60)
        assert client.world_size == 4
        sender = trainer_engine(WireSource(dict().items), client, timeout_s=60)
        for version, seed in ((1, 1), (2, 0)):
            trainer = _policy(seed)
            sender.source = WireSource(trainer.named_parameters, torch.float32)
            sender.send_weights(str(version), digests=True)
            assert len(sender.sent_digests) == len(list(trainer.parameters()))
            _check(sender, instances)
            for instance in instances.values():
                requests = _forced([8] * 4, tag=f"v{version}")
                samples = {s.prompt_id: s for s in instance.generate(requests)}
                for req in requests:
                    assert samples[req.prompt_id].token_ids == _hf_greedy(trainer, req)[0]
                    assert samples[req.prompt_id].token_versions == [version] * 8
    finally:
        for instance in instances.values():
            instance.close()


def test_a_mixture_of_experts_takes_each_version_through_the_protocol(tmp_path):
    """A tiny Qwen3-MoE instance (its own process) takes a version through vLLM's
    weight-transfer protocol, fused experts sent per expert: it decodes as an engine started
    from those weights, and back."""
    policy, other, moe_dir, requests, expected = _moe_and_other(tmp_path)
    instances = _instances(moe_dir, 1)
    (instance,) = instances.values()
    try:

        def decode() -> dict[str, list[int]]:
            return {s.prompt_id: s.token_ids for s in instance.generate(requests)}

        before = decode()
        for version, trainer, wanted in ((1, other, expected), (2, policy, before)):
            sender = _sender(trainer, instances)
            sender.send_weights(str(version), digests=True)
            verify_digests(sender.sent_digests, instance.loaded_digests()[0], "instance-0")
            assert decode() == wanted
        assert expected != before
    finally:
        instance.close()


def test_a_transfer_that_applies_nothing_is_caught_naming_the_instance_and_tensor(policy_dir):
    instances = _instances(policy_dir, 1, weight_transfer_config={"backend": NOOP})
    (instance,) = instances.values()
    try:
        sender = _sender(_policy(1), instances)
        sender.send_weights("1", digests=True)  # "succeeds": every bucket crossed
        with pytest.raises(WeightMismatchError, match=NAMED):
            verify_digests(sender.sent_digests, instance.loaded_digests()[0], "instance-0")
        with pytest.raises(WeightMismatchError, match=NAMED):
            verify_applied(sender.sent_digests, instance.applied_digests()[0], "instance-0")
    finally:
        instance.close()


def test_a_running_sequence_keeps_its_tokens_across_an_update_with_vllms_version_spans(
    policy_dir,
):
    instances = _instances(policy_dir, 1)
    (instance,) = instances.values()
    try:
        sender = _sender(_policy(1), instances)
        sender.send_weights("1")
        instance.submit(_forced([12]))
        for _ in range(5):
            assert not instance.step()
        ((_, generated),) = instance.running_progress()
        sender.source = WireSource(_policy(0).named_parameters, torch.float32)
        sender.send_weights("2")  # between two steps: the sequence stays, its KV cache too
        (sample,) = instance.generate([])
    finally:
        instance.close()
    # vLLM's spans say which weights drew each token: the first ones version 1, then 2.
    assert sample.token_versions == [1] * generated + [2] * (12 - generated)
    assert sample.weight_version == 1 and sample.length == 12


def test_the_service_feeds_vllm_instances_through_the_protocol(tmp_path):
    """``weight_protocol=True``: each version reaches each vLLM instance through vLLM's calls
    (no host staging in the instances), and the engines then compute the trainer's log-probs."""
    tokenizer = build_tokenizer()
    policy = build_tiny_model(tokenizer, "demo", seed=0)  # head size 32: vLLM's CPU attention
    model_dir = save_policy(policy, tokenizer, tmp_path / "policy")
    service = StreamGenerationService(
        model_dir,
        2,
        engine=VLLMEngine(options=dict(enforce_eager=True, kv_cache_memory_bytes=16 << 20)),
        max_batch_size=4,
        greedy=True,
        partial_rollout="keep",
        # each instance's checksums of every version, as loaded; several buckets
        weights=WeightPath(protocol=True, verify_every=1, bucket_mb=0.25),
    )
    requests = [Request(f"p{i}", [5 + i, 6, 7], max_tokens=8, forced_length=8) for i in range(4)]
    with service:
        old = [list(s.logprobs) for s in service.generate(requests)]
        for version in (1, 2):
            with torch.no_grad():
                for p in policy.parameters():
                    p.add_(torch.randn_like(p) * 0.2)
            service.update(policy, version=version)
            assert [i.weight_version for i in service.instances()] == [version, version]
            samples = list(service.generate(requests))
            assert {s.weight_version for s in samples} == {version}
            for sample in samples:
                got = torch.tensor(sample.logprobs)
                torch.testing.assert_close(
                    got, _logprobs(policy, sample, tokenizer), atol=1e-3, rtol=0
                )
        assert old != [list(s.logprobs) for s in samples]
        assert service.counts["instances_restarted"] == 0
        assert service.counts["weight_versions_verified"] == 2 * 2
        # one broadcast reached both: one model copy left the trainer per version, and the
        # group formed once
        sync, shared = service.pool.weight_sync, service.pool.feeds.shared
        assert sync.bytes_sent == 2 * sync.staged.nbytes
        assert len(shared.formed_s) == 1 and shared.resent == []


class DiesMidUpdate(GlooWeightTransferEngine):
    """A worker backend whose process kills itself (SIGKILL) after an update's first bucket, once
    the test's flag file exists: the instance that claims it (a rename) dies mid-broadcast."""

    def receive_weights(self, update_info):  # type: ignore[no-untyped-def]
        group, flag = self.group, os.environ[DIE_FLAG]

        class Dying:
            def broadcast(self, tensors):  # type: ignore[no-untyped-def]
                group.broadcast(tensors)
                with contextlib.suppress(FileNotFoundError):
                    os.rename(flag, flag + ".claimed")
                    os.kill(os.getpid(), signal.SIGKILL)

        self.group = Dying()
        try:
            super().receive_weights(update_info)
        finally:
            self.group = group


#: The environment variable naming ``DiesMidUpdate``'s flag file.
DIE_FLAG = "STREAMRL_TEST_DIE_FLAG"
DIES = "streamrl_test_dies"


@dataclass(frozen=True)
class DyingBackendEngine(VLLMEngine):
    """vLLM instances on ``DiesMidUpdate`` (registered in the instance's process, as a vLLM
    plugin would be)."""

    def __call__(self, spec, scheduler):  # type: ignore[no-untyped-def]
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

        if DIES not in WeightTransferEngineFactory._registry:
            WeightTransferEngineFactory.register_engine(DIES, DiesMidUpdate)
        return super().__call__(spec, scheduler)


def test_an_instance_dying_mid_broadcast_is_replaced_and_the_others_are_sent_the_version_again(
    tmp_path, monkeypatch
):
    """One broadcast reaches three instances; one dies after the first bucket of version 2. The
    version is sent again on each survivor's own group (they wait for it: no token from a half
    loaded model), only the dead one is replaced, and version 3 reaches every instance on one
    broadcast formed anew, the newcomer included."""
    flag = tmp_path / "die"
    monkeypatch.setenv(DIE_FLAG, str(flag))  # the instances inherit it
    tokenizer = build_tokenizer()
    policy = build_tiny_model(tokenizer, "demo", seed=0)
    model_dir = save_policy(policy, tokenizer, tmp_path / "policy")
    options = dict(
        enforce_eager=True, kv_cache_memory_bytes=16 << 20, weight_transfer_config={"backend": DIES}
    )
    service = StreamGenerationService(
        model_dir,
        3,
        engine=DyingBackendEngine(options=options),
        max_batch_size=4,
        greedy=True,
        partial_rollout="keep",
        weights=WeightPath(protocol=True, verify_every=1, bucket_mb=0.25),  # several buckets
        timeouts=Timeouts(weight_s=20),
        max_restarts=1,
    )
    requests = [Request(f"p{i}", [5 + i, 6, 7], max_tokens=8, forced_length=8) for i in range(6)]
    with service:
        shared = service.pool.feeds.shared
        for version in (1, 2, 3):
            with torch.no_grad():
                for p in policy.parameters():
                    p.add_(torch.randn_like(p) * 0.2)
            if version == 2:
                flag.touch()
            service.update(policy, version=version)
            if version == 2:  # the newcomer catches up alone on version 2, then joins in
                service.pool.wait_active(120)
            samples = list(service.generate(requests))
            assert {s.weight_version for s in samples} == {version}
            for sample in samples:
                expected = _logprobs(policy, sample, tokenizer)
                torch.testing.assert_close(
                    torch.tensor(sample.logprobs), expected, atol=1e-3, rtol=0
                )
        assert (tmp_path / "die.claimed").exists()
        assert service.counts["instances_restarted"] == 1
        assert [v for v, _ in shared.resent] == [2]
        assert len(shared.formed_s) == 2  # at version 1, and at 3 with the newcomer
        assert len(shared.members) == 3 and 3 in shared.members
        assert {i.weight_version for i in service.instances() if i.state == "active"} == {3}


def test_a_tensor_parallel_instance_takes_each_version_on_both_ranks(tmp_path):
    """Two worker processes in one instance: both join the instance's group (rank offsets 1 and
    2), each loads its shard, and the engine then computes the trainer's log-probs."""
    tokenizer = build_tokenizer()
    policy = build_tiny_model(tokenizer, "demo", seed=0)
    model_dir = save_policy(policy, tokenizer, tmp_path / "policy")
    engine = VLLMEngine(
        options=dict(enforce_eager=True, kv_cache_memory_bytes=16 << 20, tensor_parallel_size=2)
    )
    service = StreamGenerationService(
        model_dir,
        1,
        engine=engine,
        max_batch_size=4,
        greedy=True,
        partial_rollout="keep",
        weights=WeightPath(protocol=True, verify_every=1),
    )
    requests = [Request(f"p{i}", [5 + i, 6, 7], max_tokens=8, forced_length=8) for i in range(2)]
    with service:
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(torch.randn_like(p) * 0.2)
        service.update(policy, version=1)
        for sample in service.generate(requests):
            expected = _logprobs(policy, sample, tokenizer)
            torch.testing.assert_close(torch.tensor(sample.logprobs), expected, atol=1e-3, rtol=0)
        assert service.counts["weight_versions_verified"] == 1


def test_on_cuda_the_trainer_takes_vllms_own_nccl_engine_packed_and_double_buffered(monkeypatch):
    """The GPU branch, without a GPU: an instance on CUDA is built with vLLM's ``nccl``
    backend, and the trainer's engine comes from vLLM's factory with its NCCL init info (the
    group's size from the client, packed buckets of ours, two buffers)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    from streamrl.components.weights.vllm_protocol import GLOO_BACKEND, engine_backend

    assert (engine_backend("cuda:1"), engine_backend("cpu")) == ("nccl", GLOO_BACKEND)
    made = {}
    monkeypatch.setattr(
        WeightTransferTrainerFactory,
        "trainer_init",
        classmethod(lambda cls, info, *, client, source: made.update(info=info, client=client)),
    )
    client = InstancesClient({"a": object(), "b": object()}, ranks={"b": 2})
    trainer_engine(WireSource(dict().items), client, backend="nccl", bucket_bytes=64 << 20, rank=1)
    info = made["info"]
    assert isinstance(info, NCCLTrainerInitInfo) and made["client"] is client
    assert (info.world_size, info.rank, info.packed) == (4, 1, True)
    assert (info.packed_buffer_size_bytes, info.packed_num_buffers) == (64 << 20, 2)
    assert info.master_address == "127.0.0.1" and 0 < info.master_port < 65536
    with pytest.raises(ValueError, match="Unknown weight-transfer backend 'ipc'"):
        trainer_engine(WireSource(dict().items), client, backend="ipc")


def test_the_experts_are_prepacked_again_after_a_reload_on_the_cpu_only(monkeypatch):
    """``reprocess_cpu_layouts`` re-runs the CPU experts' prepack on vLLM's CPU build and
    leaves a mixture of experts alone elsewhere (CUDA's layerwise reload redoes its own layout;
    the platform faked here), never importing the CPU kernels there."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.platforms import current_platform

    from streamrl.components.weights.vllm_protocol import reprocess_cpu_layouts

    prepacked = []
    experts = object.__new__(CPUUnquantizedExperts)
    experts.moe_config = SimpleNamespace(intermediate_size_per_partition=64, activation=None)
    experts.process_weights_after_loading = prepacked.append
    layer = torch.nn.Module()
    layer.quant_method = SimpleNamespace(moe_kernel=SimpleNamespace(fused_experts=experts))
    model = torch.nn.Sequential(layer)
    reprocess_cpu_layouts(model)
    assert prepacked == [layer]
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    reprocess_cpu_layouts(model)
    assert prepacked == [layer]  # not again off the CPU
