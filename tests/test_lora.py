"""LoRA policies: only adapters train, only adapters travel, and the generators use them."""

from __future__ import annotations

import multiprocessing as mp
import pickle
import sys

import pytest
import torch

from streamrl.components.generation.engines import HFEngine
from streamrl.components.generation.hf_generator import HFStreamGenerator, fingerprint
from streamrl.components.generation.service import StreamGenerationService
from streamrl.errors import ConfigError
from streamrl.policy.lora import (
    LoRASpec,
    MergedLoRA,
    adapter_weights,
    apply_lora,
    sync_bytes,
    synced_weights,
)
from streamrl.policy.models import build_tiny_model, save_policy
from streamrl.records import Request

pytestmark = pytest.mark.timeout(120)


def requests_for(tokenizer) -> list[Request]:
    prompts = ["copy abc=", "rev xyz=", "sort 31=", "count aab:"]
    return [
        Request(f"p{i}", tokenizer(p)["input_ids"], max_tokens=12) for i, p in enumerate(prompts)
    ]


def greedy_tokens(samples) -> dict[str, list[int]]:
    return {s.prompt_id: s.token_ids for s in samples}


def test_spec_round_trips_through_dict_and_pickle_and_rejects_bad_values():
    spec = LoRASpec(r=4, alpha=8, dropout=0.1, target_modules=["q_proj", "v_proj"])
    assert spec.target_modules == ("q_proj", "v_proj")  # a list becomes a tuple (hashable)
    assert LoRASpec.from_dict(spec.to_dict()) == spec
    assert pickle.loads(pickle.dumps(spec.to_dict())) == spec.to_dict()
    with pytest.raises(ConfigError, match="did you mean 'alpha'"):
        LoRASpec.from_dict({"alpah": 8})
    with pytest.raises(ConfigError, match="r >= 1"):
        LoRASpec(r=0)


def test_missing_peft_or_target_is_a_config_error_that_says_what_to_do(tiny_model, monkeypatch):
    with pytest.raises(ConfigError, match=r"no linear module named \['qkv'\]"):
        apply_lora(tiny_model, LoRASpec(target_modules=("qkv",)))
    with pytest.raises(ConfigError, match="no LoRA parameters"):
        adapter_weights(tiny_model)
    assert synced_weights(tiny_model) is tiny_model  # a plain policy: the whole model travels
    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` now raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'streamrl\[peft\]'"):
        apply_lora(tiny_model, LoRASpec())


def test_only_adapter_parameters_train(tiny_model):
    base = {n: p.detach().clone() for n, p in tiny_model.named_parameters()}
    policy = apply_lora(tiny_model, LoRASpec(r=4))
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    adapters = adapter_weights(policy)
    assert trainable == set(adapters) and len(adapters) == 3 * 4 * 2  # layers x q/k/v/o x A/B
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    for _ in range(2):  # B starts at zero: A gets a gradient from the second step on
        policy(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    changed = {n for n, p in policy.named_parameters() if not torch.equal(p, before[n])}
    assert changed == set(adapters)
    # The adapters were injected into the model itself; its base tensors are untouched.
    now = {n.replace(".base_layer", ""): p for n, p in tiny_model.named_parameters()}
    assert all(torch.equal(p, now[n]) for n, p in base.items())
    assert synced_weights(policy).keys() == adapters.keys()  # what an update carries


def test_merged_generator_decodes_like_the_peft_forward_and_unmerges_exactly(tokenizer):
    policy = apply_lora(build_tiny_model(tokenizer, "test"), LoRASpec()).eval()
    with torch.no_grad():
        for p in adapter_weights(policy).values():
            p.normal_(0, 0.3)
    generator_side = apply_lora(build_tiny_model(tokenizer, "test"), LoRASpec()).eval()
    generator_side.load_state_dict(policy.state_dict())
    merged = MergedLoRA(generator_side)
    assert fingerprint(generator_side) != fingerprint(policy)  # merged: base weights moved
    with merged.unmerged():
        assert fingerprint(generator_side) == fingerprint(policy)  # bit for bit
    assert _greedy(generator_side, tokenizer) == _greedy(policy, tokenizer)


def _greedy(model, tokenizer) -> dict[str, list[int]]:
    gen = HFStreamGenerator(model, max_batch_size=4, greedy=True)
    gen.submit(requests_for(tokenizer))
    return greedy_tokens(gen.stream())


def test_generators_receive_only_adapters_and_decode_with_them(tmp_path, tokenizer):
    spec = LoRASpec(r=8)
    save_policy(build_tiny_model(tokenizer, "test", seed=0), tokenizer, tmp_path / "base")
    policy = apply_lora(build_tiny_model(tokenizer, "test", seed=0), spec).eval()
    with StreamGenerationService(
        tmp_path / "base", 2, engine=HFEngine(lora=spec), max_batch_size=4, greedy=True
    ) as sgs:
        before = greedy_tokens(sgs.generate(requests_for(tokenizer)))
        assert before == _greedy(policy, tokenizer)  # B = 0: the adapters change nothing yet
        with torch.no_grad():  # what a few training steps would do to the adapters
            for p in adapter_weights(policy).values():
                p.add_(torch.randn_like(p) * 0.3)
        sent = sgs.weight_sync.bytes_sent
        sgs.update(adapter_weights(policy), version=1)
        per_version = sgs.weight_sync.bytes_sent - sent  # one copy: the 2nd gets it from the 1st
        assert per_version == sync_bytes(adapter_weights(policy))
        assert per_version < sync_bytes(policy) / 10  # pushing the whole policy: > 10x more
        assert set(sgs.fingerprints().values()) == {fingerprint(policy)}
        samples = list(sgs.generate(requests_for(tokenizer)))
        assert {s.weight_version for s in samples} == {1}
        after = greedy_tokens(samples)
        assert after == _greedy(policy, tokenizer)  # the trainer's model decodes the same
        assert after != before  # so the adapters arrived and are used
    assert not [p for p in mp.active_children() if p.name.startswith("streamrl-generator")]


def test_fit_with_lora_trains_adapters_only(tmp_path, fit_small):
    """Through ``streamrl fit``: every base tensor of the trained policy is bit for bit the
    starting policy's, and every adapter tensor (A and B, in every targeted layer) moved."""
    from streamrl.policy.models import load_policy

    # Rewards of the 20-step warm start are mostly 0: "partial" and 3 steps x 4 prompts x 4
    # samples give every adapter a gradient (B starts at 0, so A moves from the 2nd step on).
    summary = fit_small(lora={"r": 4}, reward="partial", iterations=3, group_size=4)
    ckpt = torch.load(tmp_path / "out" / "checkpoints" / "last.ckpt", weights_only=True)
    trained = {k.removeprefix("policy."): v for k, v in ckpt["state_dict"].items()}
    # The adapters as the run created them (apply_lora is seeded), on the starting weights.
    start = apply_lora(load_policy(summary["model_dir"])[0], LoRASpec(r=4, alpha=16.0))
    initial = dict(start.state_dict())
    assert trained.keys() == initial.keys()
    adapters = set(adapter_weights(start))
    assert len(adapters) == 3 * 4 * 2  # layers x q/k/v/o x A/B
    frozen_moved = [
        n for n in initial if n not in adapters and not torch.equal(trained[n], initial[n])
    ]
    assert not frozen_moved, f"base weights changed: {frozen_moved}"
    still = [n for n in adapters if torch.equal(trained[n], initial[n])]
    assert not still, f"adapters that did not train: {still}"
