"""Where the trainer runs and which GPUs the generators take (``streamrl.runtime.devices``), with
the CUDA inventory faked: no GPU and no process is needed."""

from __future__ import annotations

import os
import types

import pytest
import torch

import streamrl.runtime.devices
from streamrl.components.generation import clusters, ray_instance
from streamrl.components.generation.clusters import LocalCluster, RayCluster
from streamrl.components.generation.engines import VLLMEngine
from streamrl.components.generation.ray_instance import RayOptions
from streamrl.components.generation.service import StreamGenerationService
from streamrl.errors import ConfigError
from streamrl.runtime.devices import (
    Placement,
    pin_visible_gpu,
    resolve_placement,
    visible_gpu_count,
)


@pytest.fixture
def gpus(monkeypatch):
    """Fake this machine's GPU count: ``gpus(8)``."""

    def fake(count: int) -> None:
        monkeypatch.setattr(streamrl.runtime.devices, "cuda_device_count", lambda: count)

    return fake


# -- the trainer -------------------------------------------------------------------------------


def test_auto_picks_cuda_with_gpus_and_the_cpu_without(gpus):
    gpus(8)
    on_gpu = resolve_placement()
    assert (on_gpu.accelerator, on_gpu.trainer_gpus, on_gpu.precision) == (
        "cuda",
        (0,),
        "bf16-mixed",
    )
    gpus(0)
    on_cpu = resolve_placement()
    assert (on_cpu.accelerator, on_cpu.trainer_gpus, on_cpu.precision) == ("cpu", (), "32-true")
    assert on_cpu.lightning_devices() == 1


def test_cuda_without_a_gpu_is_refused(gpus):
    gpus(0)
    with pytest.raises(ConfigError, match=r"is_available\(\) is False.*trainer.accelerator: cpu"):
        resolve_placement("cuda")


def test_unknown_accelerator_and_precision_suggest_the_close_name(gpus):
    gpus(0)
    with pytest.raises(ConfigError, match=r"trainer.accelerator: .*did you mean 'cuda'"):
        resolve_placement("cdua")
    with pytest.raises(ConfigError, match=r"trainer.precision: .*did you mean 'bf16-mixed'"):
        resolve_placement("cpu", precision="bf16-mix")


def test_an_explicit_precision_wins_over_the_default(gpus):
    gpus(8)
    assert resolve_placement("cuda", precision="32-true").precision == "32-true"
    gpus(0)
    assert resolve_placement("cpu", precision="bf16-mixed").precision == "bf16-mixed"


def test_devices_as_a_number_and_as_a_list_on_cuda(gpus):
    gpus(8)
    first_two = resolve_placement("cuda", devices=2)
    assert (first_two.trainer_gpus, first_two.lightning_devices()) == ((0, 1), [0, 1])
    named = resolve_placement("cuda", devices=[3, 6], num_nodes=2)
    assert (named.trainer_gpus, named.lightning_devices()) == ((3, 6), [3, 6])
    assert (named.ranks_per_node, named.ranks) == (2, 4)


def test_devices_on_the_cpu_are_processes_and_a_list_is_refused(gpus):
    gpus(0)
    placement = resolve_placement("cpu", devices=3)
    assert (placement.ranks_per_node, placement.trainer_gpus) == (3, ())
    assert placement.lightning_devices() == 3
    with pytest.raises(ConfigError, match=r"trainer.devices .*on the CPU give a number"):
        resolve_placement("cpu", devices=[0, 1])


@pytest.mark.parametrize(
    ("devices", "message"),
    [
        ([0, 8], r"trainer.devices \[0, 8\] names GPU\(s\) \[8\] but this machine has 8"),
        ([1, 1], r"trainer.devices \[1, 1\] repeats GPU\(s\) \[1\]"),
        ([], r"trainer.devices is an empty list"),
        (9, r"trainer.devices is 9 but this machine has 8 GPU\(s\)"),
        (0, r"trainer.devices must be a number of processes >= 1"),
    ],
)
def test_impossible_trainer_gpus_are_refused(gpus, devices, message):
    gpus(8)
    with pytest.raises(ConfigError, match=message):
        resolve_placement("cuda", devices=devices)


def test_num_nodes_below_one_is_refused(gpus):
    gpus(0)
    with pytest.raises(ConfigError, match=r"trainer.num_nodes must be >= 1, got 0"):
        resolve_placement("cpu", num_nodes=0)


def test_sharded_for_several_ranks_or_bf16_mixed(gpus):
    gpus(0)
    assert not resolve_placement("cpu").sharded
    assert resolve_placement("cpu", devices=2).sharded  # 2 ranks
    assert resolve_placement("cpu", num_nodes=2).sharded  # 2 ranks over 2 nodes
    assert resolve_placement("cpu", precision="bf16-mixed").sharded  # FSDP2's policy
    gpus(8)
    assert resolve_placement("cuda").sharded  # bf16-mixed is CUDA's default


# -- the generators ----------------------------------------------------------------------------


def test_generators_default_to_the_gpus_the_trainer_does_not_hold(gpus):
    gpus(8)
    placement = resolve_placement("cuda", devices=[0, 1, 2, 3], generator_gpus_per_instance=1)
    assert placement.generator_gpus == (4, 5, 6, 7)
    assert [placement.generator_device(i) for i in (0, 3, 5)] == ["cuda:4", "cuda:7", "cuda:5"]
    on_cpu = resolve_placement("cpu", generator_gpus_per_instance=1)
    assert on_cpu.generator_gpus == tuple(range(8))  # a CPU trainer leaves them all


def test_named_generator_gpus_are_taken_round_robin(gpus):
    gpus(8)
    placement = resolve_placement(
        "cuda", devices=[0, 1], generator_gpus_per_instance=1, generator_devices=[6, 2]
    )
    assert placement.generator_gpus == (6, 2)
    assert [placement.generator_device(i) for i in range(3)] == ["cuda:6", "cuda:2", "cuda:6"]


def test_trainer_and_generators_sharing_a_gpu_is_refused(gpus):
    gpus(8)
    with pytest.raises(ConfigError) as refused:
        resolve_placement(
            "cuda", devices=[0, 1], generator_gpus_per_instance=1, generator_devices=[1, 2]
        )
    assert str(refused.value).startswith(
        "trainer.devices [0, 1] and rl.generation.gpu_ids [1, 2] share GPU(s) [1]: a GPU either "
        "trains or generates"
    )


def test_overlap_is_refused_on_ray_too(gpus):
    gpus(8)
    with pytest.raises(ConfigError, match=r"share GPU\(s\) \[0\]"):
        resolve_placement(
            "cuda", generator_gpus_per_instance=1, generator_devices=[0], local_generators=False
        )
    ray_placement = resolve_placement(
        "cuda", generator_gpus_per_instance=1, generator_devices=[5], local_generators=False
    )
    assert ray_placement.generator_gpus == (5,)  # all a local Ray cluster may hand out


def test_a_trainer_holding_every_gpu_is_refused(gpus):
    gpus(2)
    with pytest.raises(
        ConfigError,
        match=r"trainer holds all 2 GPUs .*\[0, 1\].*rl.generation.gpus_per_instance: 0",
    ):
        resolve_placement("cuda", devices=2, generator_gpus_per_instance=1)
    assert resolve_placement("cuda", devices=2).generator_gpus == ()  # CPU generators are fine


def test_generator_gpus_without_any_gpu_and_ignored_lists_are_refused(gpus):
    gpus(0)
    with pytest.raises(
        ConfigError, match=r"rl.generation.gpus_per_instance=1 but this machine has no CUDA GPU"
    ):
        resolve_placement("cpu", generator_gpus_per_instance=1)
    gpus(8)
    with pytest.raises(
        ConfigError, match=r"rl.generation.gpu_ids .* rl.generation.gpus_per_instance is 0"
    ):
        resolve_placement("cuda", generator_devices=[4])
    with pytest.raises(ConfigError, match=r"rl.generation.gpu_ids \[4, 9\] names GPU\(s\) \[9\]"):
        resolve_placement("cuda", generator_gpus_per_instance=1, generator_devices=[4, 9])


def test_placement_generator_device_on_the_cpu():
    placement = Placement("cpu", 1, 1, (), (), "32-true")
    assert placement.generator_device(3) == "cpu"


# -- what the generation service does with them ------------------------------------------------


def test_instance_device_takes_the_given_gpus_round_robin():
    assert [LocalCluster().device(i, 1, gpu_ids=[4, 5]) for i in range(3)] == [
        "cuda:4",
        "cuda:5",
        "cuda:4",
    ]
    # The trainer's GPUs are already left out of gpu_ids: no spare cuda:0 for NCCL.
    assert LocalCluster().device(0, 1, spare_first=True, gpu_ids=[4, 5]) == "cuda:4"
    assert LocalCluster().device(0, 0, gpu_ids=[4]) == "cpu"
    assert RayCluster().device(1, 1, gpu_ids=[4]) == "cuda"


def test_a_tensor_parallel_instance_takes_a_set_of_gpus_and_sees_only_those(monkeypatch):
    """rl.generation.gpus_per_instance: 2 -> sets of two GPUs, round-robin; the instance's
    process sees its set as cuda:0,1 and vLLM runs a rank on each (faked inventories: no GPU
    needed)."""
    assert [LocalCluster().device(i, 2, gpu_ids=[2, 3, 4, 5, 6]) for i in range(3)] == [
        "cuda:2,3",
        "cuda:4,5",
        "cuda:2,3",  # GPU 6 is left over: no set of two
    ]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 5)
    assert LocalCluster().device(1, 2, spare_first=True) == "cuda:3,4"
    with pytest.raises(
        ConfigError,
        match=r"rl.generation.gpus_per_instance=4 GPUs per generator instance, but .* 3",
    ):
        LocalCluster().device(0, 4, gpu_ids=[1, 2, 3])
    env = {"CUDA_VISIBLE_DEVICES": "7,6,5,4"}
    assert pin_visible_gpu("cuda:1,2", env) == "cuda:0"
    assert env["CUDA_VISIBLE_DEVICES"] == "6,5" and visible_gpu_count(env) == 2
    with pytest.raises(ConfigError, match="not among the 4 GPUs"):
        pin_visible_gpu("cuda:3,4", {"CUDA_VISIBLE_DEVICES": "7,6,5,4"})


def test_tensor_parallel_size_must_match_the_gpus_each_instance_gets():
    engine = VLLMEngine(options={"tensor_parallel_size": 2})
    with pytest.raises(
        ConfigError,
        match=r"tensor_parallel_size=2, but each instance gets rl.generation.gpus_per_instance=1",
    ):
        engine.check(cluster=RayCluster(), gpus_per_instance=1)


def test_the_service_hands_its_gpu_ids_to_each_instance(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # HFEngine.check's question
    launched = {}

    def spawn(ctx, instance_id, what, timeout_s):
        launched[instance_id] = what["device"]

    monkeypatch.setattr(clusters, "InstanceHandle", types.SimpleNamespace(spawn=spawn))
    sgs = StreamGenerationService("unused", num_instances=3, gpus_per_instance=1, gpu_ids=[6, 7])
    for i in range(3):
        sgs._launch(i, "local")
    assert launched == {0: "cuda:6", 1: "cuda:7", 2: "cuda:6"}

    # A local Ray cluster started here gets only these; each actor sees its own as "cuda".
    def spawn_actor(options, instance_id, what, timeout_s):
        launched[instance_id] = (options.gpu_ids, options.gpus_per_instance, what["device"])

    monkeypatch.setattr(
        clusters, "RayInstanceHandle", types.SimpleNamespace(spawn_actor=spawn_actor)
    )
    ray_sgs = StreamGenerationService(
        "unused", 2, gpus_per_instance=1, gpu_ids=[6, 7], cluster="ray"
    )
    ray_sgs._launch(1, "local")
    assert launched[1] == ((6, 7), 1, "cuda")


def test_a_local_ray_cluster_sees_only_the_generators_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    seen = {}

    def init(address=None, **kwargs):
        seen.update(kwargs, visible=os.environ["CUDA_VISIBLE_DEVICES"])

    fake_ray = types.SimpleNamespace(
        is_initialized=lambda: False, init=init, cluster_resources=lambda: {"GPU": 2}
    )
    monkeypatch.setattr(ray_instance, "import_ray", lambda: fake_ray)
    ray_instance.connect(RayOptions(gpus_per_instance=1, gpu_ids=(4, 6)))
    assert (seen["num_gpus"], seen["visible"]) == (2, "4,6")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"  # restored


def test_sharing_the_trainers_gpus_is_an_explicit_choice(gpus):
    gpus(1)
    with pytest.raises(ConfigError, match="the trainer holds all 1 GPUs"):
        resolve_placement("cuda", generator_gpus_per_instance=1)
    shared = resolve_placement("cuda", generator_gpus_per_instance=1, share_trainer_gpus=True)
    assert shared.trainer_gpus == (0,) and shared.generator_gpus == (0,)


def test_a_local_instance_sees_only_its_gpu_before_cuda_starts():
    """vLLM takes "the" GPU of its process and NCCL the current device: each local instance's
    CUDA_VISIBLE_DEVICES names its own GPU (the k-th its parent sees), so none lands on the
    trainer's cuda:0."""
    env: dict[str, str] = {}
    assert pin_visible_gpu("cuda:3", env) == "cuda:0" and env == {"CUDA_VISIBLE_DEVICES": "3"}
    env = {"CUDA_VISIBLE_DEVICES": "2,5,7"}  # the parent was given GPUs 2, 5 and 7
    assert pin_visible_gpu("cuda:1", env) == "cuda:0" and env["CUDA_VISIBLE_DEVICES"] == "5"
    env = {"CUDA_VISIBLE_DEVICES": "2,5"}
    with pytest.raises(ConfigError, match=r"cuda:4 is not among the 2 GPUs.*=2,5"):
        pin_visible_gpu("cuda:4", env)
    for device in ("cpu", "cuda"):  # the CPU; a Ray actor, whose GPU Ray already set
        env = {"CUDA_VISIBLE_DEVICES": "2,5"}
        assert pin_visible_gpu(device, env) == device and env["CUDA_VISIBLE_DEVICES"] == "2,5"
