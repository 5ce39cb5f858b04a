"""A trainer launched on GPUs, with the CUDA inventory faked: no GPU and no process is needed.

- one default process group backend for spawned and launched ranks: CPU objects on gloo, CUDA
  tensors on NCCL (``"cpu:gloo,cuda:nccl"``), gloo alone on the CPU;
- ``trainer.devices: [4, 5, 6, 7]``: each rank's device is its GPU and nothing lands on GPU 0,
  the weights' link to the generators included (it leaves from rank 0's own GPU);
- a launched job's waits have the config's timeouts, scaled to the model when unset.
"""

from __future__ import annotations

from datetime import timedelta

import lightning as L
import pytest
import torch.distributed as dist
from lightning.fabric.accelerators import cuda as lightning_cuda
from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

import streamrl.runtime.devices
from streamrl.algorithms import GRPO
from streamrl.policy.models import build_tiny_model, build_tokenizer
from streamrl.run import trainer_ranks
from streamrl.run.config import RunConfig
from streamrl.run.trainer_ranks import RankSetup, join_launched_job, rank_timeouts
from streamrl.runtime.devices import resolve_placement
from streamrl.training.builders import build_module
from streamrl.training.fsdp import process_group_backend
from streamrl.training.rank_timeouts import RankTimeouts


@pytest.fixture
def eight_gpus(monkeypatch):
    """This machine has 8 GPUs, for streamrl and for Lightning's CUDA accelerator."""
    monkeypatch.setattr(streamrl.runtime.devices, "cuda_device_count", lambda: 8)
    monkeypatch.setattr(lightning_cuda, "num_cuda_devices", lambda: 8)
    monkeypatch.setattr(lightning_cuda, "is_cuda_available", lambda: True)
    import lightning.pytorch.accelerators.cuda as pl_cuda

    monkeypatch.setattr(pl_cuda, "num_cuda_devices", lambda: 8)
    monkeypatch.setattr(pl_cuda.CUDAAccelerator, "is_available", staticmethod(lambda: True))


def test_the_backend_carries_objects_on_gloo_and_cuda_tensors_on_nccl():
    assert process_group_backend("cuda") == "cpu:gloo,cuda:nccl"
    assert process_group_backend("cpu") == "gloo"


def _sharded_trainer(placement, monkeypatch, local_rank: int) -> L.Trainer:
    # The strategy makes this process rank `local_rank` for Lightning's rank-zero-only calls
    # (loggers write nothing elsewhere): undone after the test, for the tests that follow.
    for flag in (fabric_rank_zero_only, utils_rank_zero_only):
        monkeypatch.setattr(flag, "rank", flag.rank)
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setenv("RANK", str(local_rank))
    monkeypatch.setenv("WORLD_SIZE", str(placement.ranks))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29512")
    monkeypatch.setenv("NODE_RANK", "0")
    policy = build_tiny_model(build_tokenizer(), "test")
    module = build_module(
        policy, GRPO(group_size=2), None, iterations=1, temperature=1.0, sharded=True
    )
    setup = RankSetup(GRPO(group_size=2), 1, placement=placement)
    return setup.trainer(module)


@pytest.mark.parametrize("local_rank", [0, 3])
def test_trainer_gpus_4_to_7_put_each_rank_on_its_own_gpu_and_nothing_on_gpu_0(
    eight_gpus, monkeypatch, local_rank
):
    placement = resolve_placement("cuda", [4, 5, 6, 7], generator_gpus_per_instance=1)
    assert placement.lightning_devices() == [4, 5, 6, 7]
    assert placement.generator_gpus == (0, 1, 2, 3)  # the generators take the others
    trainer = _sharded_trainer(placement, monkeypatch, local_rank)
    strategy = trainer.strategy
    assert strategy.process_group_backend == "cpu:gloo,cuda:nccl"
    assert [str(d) for d in strategy.parallel_devices] == [f"cuda:{g}" for g in (4, 5, 6, 7)]
    assert str(strategy.root_device) == f"cuda:{4 + local_rank}"


def test_the_weights_leave_from_rank_zeros_own_gpu(eight_gpus):
    from streamrl.run.trainer_ranks import trainer_device

    placement = resolve_placement("cuda", [4, 5, 6, 7])
    assert trainer_device(placement) == "cuda:4"
    assert trainer_device(resolve_placement("cpu", 2)) == "cpu"


def test_a_launched_job_joins_with_the_backend_and_the_timeouts(eight_gpus, monkeypatch):
    calls = []
    for name in ("MASTER_ADDR", "MASTER_PORT"):  # the join sets them: undone after the test
        monkeypatch.setenv(name, "recorded")  # (monkeypatch restores only what it saw)
        monkeypatch.delenv(name)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: calls.append(("init", a, k)))
    monkeypatch.setattr(dist, "new_group", lambda **k: calls.append(("group", (), k)) or "g")

    class Job:
        main_address, main_port = "10.0.0.1", 29500

        def global_rank(self):
            return 1

        def world_size(self):
            return 8

    timeouts = RankTimeouts(collective_s=111.0, prepare_s=2222.0, share_s=3.0)
    join_launched_job(Job(), resolve_placement("cuda", [4, 5, 6, 7]), timeouts)
    (_, args, init), (_, _, group) = calls
    assert args == ("cpu:gloo,cuda:nccl",)
    assert init["timeout"] == timedelta(seconds=111.0) and init["world_size"] == 8
    assert group == {"backend": "gloo", "timeout": timedelta(seconds=2222.0)}
    assert trainer_ranks._LAUNCH_GROUP == ["g"]
    trainer_ranks._LAUNCH_GROUP.clear()


def test_the_ranks_timeouts_are_the_configs_or_scale_with_the_model(tmp_path):
    config = RunConfig()
    config.trainer.prepare_timeout_s = 99.0
    small = rank_timeouts(config)  # the tiny policy
    assert (small.collective_s, small.prepare_s, small.share_s) == (300.0, 99.0, 912.8)
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 10_000_000)  # 0.01 GB of weights
    big = rank_timeouts(config, tmp_path)
    assert (big.collective_s, big.prepare_s) == (300.3, 99.0)  # 300 s + 30 s per GB
