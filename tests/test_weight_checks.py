"""Checksums after a weight sync, in a run: every instance reports what it holds once it loaded a
version to verify, the service compares with the trainer's, and a sync that moved or applied
nothing stops the run naming the instance and the first differing tensor."""

from __future__ import annotations

import pytest
import torch
from extension_plugins import AppliesNothing

from streamrl.components.generation.engines import HFEngine
from streamrl.components.generation.pool import GeneratorError
from streamrl.components.generation.service import StreamGenerationService
from streamrl.components.weights.path import WeightPath
from streamrl.components.weights.sync import AsyncWeightSync
from streamrl.policy.lora import LoRASpec, adapter_weights, apply_lora
from streamrl.policy.models import build_tiny_model, save_policy

pytestmark = pytest.mark.timeout(180)


def _moved(model: torch.nn.Module, scale: float = 0.05) -> torch.nn.Module:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)
    return model


@pytest.mark.parametrize(
    ("every", "checked"), [(None, [1]), (0, []), (2, [1, 2, 4]), (1, [1, 2, 3, 4])]
)
def test_which_versions_are_verified(every, checked):
    sync = AsyncWeightSync(verify_every=every)
    try:
        sync.push({"w": torch.ones(3)}, 1)
        sync.wait_sent(1)
        assert [v for v in range(1, 5) if sync.verifies(v)] == checked
    finally:
        sync.close()


def test_every_instance_checks_the_versions_asked_and_the_trainer_keeps_a_few(tmp_path, tokenizer):
    policy = build_tiny_model(tokenizer, "test", seed=0)
    model_dir = save_policy(policy, tokenizer, tmp_path / "policy")
    with StreamGenerationService(
        model_dir, 2, max_batch_size=4, weights=WeightPath(verify_every=1)
    ) as service:
        for version in range(1, 7):
            service.update(_moved(policy), version=version)
        assert service.counts["weight_versions_verified"] == 2 * 6
        assert sorted(service.weight_sync.digests) == [3, 4, 5, 6]


def test_an_update_never_applied_stops_the_run_naming_the_instance_and_tensor(tmp_path, tokenizer):
    policy = build_tiny_model(tokenizer, "test", seed=0)
    model_dir = save_policy(policy, tokenizer, tmp_path / "policy")
    service = StreamGenerationService(model_dir, 1, engine=AppliesNothing(), max_batch_size=4)
    named = r"instance 0 .* 'model\.embed_tokens\.weight'"
    with service, pytest.raises(GeneratorError, match=named):
        service.update(_moved(policy), version=1)


def test_a_lora_adapter_never_applied_is_caught(tmp_path, tokenizer):
    spec = LoRASpec(r=8)
    model_dir = save_policy(build_tiny_model(tokenizer, "test", seed=0), tokenizer, tmp_path / "m")
    policy = _moved(apply_lora(build_tiny_model(tokenizer, "test", seed=0), spec), 0.3)
    adapters = adapter_weights(policy)
    first = next(iter(adapters))
    service = StreamGenerationService(model_dir, 1, engine=AppliesNothing(lora=spec))
    with service, pytest.raises(GeneratorError, match=f"instance 0 .* '{first}'"):
        service.update(adapters, version=1)
    with StreamGenerationService(model_dir, 1, engine=HFEngine(lora=spec)) as service:
        service.update(adapters, version=1)  # applied: the same check passes
        assert service.counts["weight_versions_verified"] == 1
