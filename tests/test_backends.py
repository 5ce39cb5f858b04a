"""Which device each generator instance gets (pure logic; GPUs faked by a device count)."""

from __future__ import annotations

import pytest
import torch

from streamrl.components.generation.engines import instance_device
from streamrl.errors import ConfigError


def test_instances_take_gpus_round_robin_and_spare_the_trainers_for_nccl(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert [instance_device(i, 1, "local") for i in range(5)] == [
        "cuda:0",
        "cuda:1",
        "cuda:2",
        "cuda:3",
        "cuda:0",
    ]
    assert [instance_device(i, 1, "local", spare_first=True) for i in range(4)] == [
        "cuda:1",
        "cuda:2",
        "cuda:3",
        "cuda:1",
    ]
    assert instance_device(7, 1, "ray") == "cuda"  # Ray sets CUDA_VISIBLE_DEVICES
    assert instance_device(0, 0, "local") == "cpu"


def test_nccl_on_one_gpu_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"GPUs of their own .* this machine has 1"):
        instance_device(0, 1, "local", spare_first=True)
