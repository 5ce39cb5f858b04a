"""The vLLM engine behind the stream generation service and `streamrl fit` (`rl.engine: vllm`).

Runs in ``make test-vllm``'s virtualenv: generator instances are spawned processes whose
generator is ``VLLMStreamGenerator``; weights reach them over their gloo group and are loaded
into the running engine.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vllm: make test-vllm")

import torch
from extension_plugins import AllOnFirstInstance

from streamrl.components.generation.engines import VLLMEngine
from streamrl.components.generation.service import StreamGenerationService
from streamrl.components.skewness.latency import LatencyModel
from streamrl.components.skewness.schedulers import LPTScheduler
from streamrl.components.weights.path import WeightPath
from streamrl.policy.models import build_tiny_model, build_tokenizer, save_policy
from streamrl.records import Request

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(600),
    pytest.mark.filterwarnings("ignore:.*reduce_op.*:FutureWarning"),
]
ENGINE = dict(enforce_eager=True, kv_cache_memory_bytes=16 << 20)


def _requests(iteration: int) -> list[Request]:
    prompts = [[5, 6, 7], [9, 10, 11, 12], [20, 21]]
    return [
        Request(f"p{i}", ids, max_tokens=12, iteration=iteration, forced_length=4 + 4 * i)
        for i, ids in enumerate(prompts)
    ]


def test_service_streams_from_vllm_instances_and_updates_their_weights(tmp_path):
    tokenizer = build_tokenizer()
    policy = build_tiny_model(tokenizer, "demo", seed=0)  # head size 32: vLLM's CPU attention
    model_dir = save_policy(policy, tokenizer, tmp_path / "policy")
    service = StreamGenerationService(
        model_dir, 2, engine=VLLMEngine(options=ENGINE), max_batch_size=4, greedy=True
    )
    with service:
        before = {s.prompt_id: s for s in service.generate(_requests(0))}
        assert [before[f"p{i}"].length for i in range(3)] == [4, 8, 12]
        assert all(s.weight_version == 0 and len(s.logprobs) == s.length for s in before.values())
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(torch.randn_like(p) * 0.2)
        service.update(policy, version=1)
        after = {s.prompt_id: s for s in service.generate(_requests(1))}
        assert {s.weight_version for s in after.values()} == {1}
        assert any(after[k].token_ids != before[k].token_ids for k in before)  # new weights used
        assert service.counts["samples_returned"] == 6


def test_a_bfloat16_checkpoint_runs_and_travels_in_bfloat16_bucket_by_bucket(tmp_path):
    """vLLM runs the checkpoint's dtype; the trainer's float32 weights are cast to it when
    staged, travel in small buckets (one copy per version: the second instance gets it from the
    first), are loaded bucket by bucket, and the engine's log-probs then match the trainer's
    within bfloat16's tolerance."""
    tokenizer = build_tokenizer()
    policy = build_tiny_model(tokenizer, "demo", seed=0)
    model_dir = save_policy(policy.to(torch.bfloat16), tokenizer, tmp_path / "policy")
    policy = policy.float()
    service = StreamGenerationService(
        model_dir,
        2,
        engine=VLLMEngine(options=ENGINE),
        max_batch_size=4,
        greedy=True,
        weights=WeightPath(bucket_mb=0.25),
    )
    with service:
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(torch.randn_like(p) * 0.2)
        service.update(policy, version=1)
        sync = service.weight_sync
        assert sync.dtype == torch.bfloat16 and len(sync.staged.buffers) > 3
        assert {b.dtype for b in sync.staged.buffers} == {torch.bfloat16}
        assert sync.bytes_sent == sum(p.numel() for p in policy.parameters()) * 2
        samples = list(service.generate(_requests(1)))
    assert {s.weight_version for s in samples} == {1}
    # The trainer's log-probs with the weights as they travelled (rounded to bfloat16); what is
    # left is the engine computing in bfloat16. The weights before the update are far off.
    before = build_tiny_model(tokenizer, "demo", seed=0).to(torch.bfloat16).float()
    sent = policy.to(torch.bfloat16).float()
    for s in samples:
        got = torch.tensor(s.logprobs)
        gap = (got - _logprobs(sent, s, tokenizer)).abs().max()
        stale = (got - _logprobs(before, s, tokenizer)).abs().max()
        assert gap < 0.25 < stale  # measured: gaps 0.05-0.17, stale 3.7-3.9


def _logprobs(model, sample, tokenizer) -> torch.Tensor:
    ids = torch.tensor([sample.prompt_ids + sample.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(sample.prompt_ids) - 1 : -1].float()
    logits[:, tokenizer.eos_token_id] = float("-inf")  # masked while a forced length runs
    logp = torch.log_softmax(logits, -1)
    return logp.gather(1, torch.tensor(sample.token_ids)[:, None])[:, 0]


def test_fit_switches_to_vllm_with_one_field(fit_small):
    fit_small(model_size="demo", engine="vllm")  # head size 32: vLLM's CPU attention


def test_fit_feeds_vllm_through_its_weight_transfer_protocol(fit_small):
    """rl.weights.protocol: every version through vLLM's four calls, loaded between two steps
    (partial rollout keep, one-step async); nothing lost, every instance on the last version."""
    summary = fit_small(
        model_size="demo",
        engine="vllm",
        weights={"protocol": True},
        generation={"partial_rollout": "keep"},
        module={"mode": "async"},
    )
    assert summary["samples_lost"] == 0 and summary["instances_restarted"] == 0


def test_a_tensor_parallel_instance_gets_updates_and_takes_its_ranks_with_it(tmp_path):
    """An instance whose engine spans two worker processes (tensor_parallel_size=2): weights
    reach both ranks through the instance's shared staging; when the instance is killed, its
    ranks go too (its process group) and the replacement serves on the current weights."""
    psutil = pytest.importorskip("psutil")
    tokenizer = build_tokenizer()
    policy = build_tiny_model(tokenizer, "demo", seed=0)
    model_dir = save_policy(policy, tokenizer, tmp_path / "policy")
    engine = VLLMEngine(options={**ENGINE, "tensor_parallel_size": 2})
    with StreamGenerationService(model_dir, 1, engine=engine, max_batch_size=4, greedy=True) as sgs:
        before = {s.prompt_id: s for s in sgs.generate(_requests(0))}
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(torch.randn_like(p) * 0.2)
        sgs.update(policy, version=1)
        after = {s.prompt_id: s for s in sgs.generate(_requests(1))}
        assert any(after[k].token_ids != before[k].token_ids for k in before)
        instance = sgs.pool.handles[0]
        ranks = psutil.Process(instance.proc.pid).children(recursive=True)
        assert len(ranks) >= 2  # a worker process per rank (plus vLLM's helpers)
        instance.proc.kill()
        again = {s.prompt_id: s for s in sgs.generate(_requests(2))}
        sgs.wait_active()
        assert sgs.counts["instances_restarted"] == 1
        assert [again[k].token_ids for k in after] == [after[k].token_ids for k in after]
        _, alive = psutil.wait_procs(ranks, timeout=10)
        assert not alive, f"ranks outlived their instance: {[p.pid for p in alive]}"


def test_the_gpu_checks_vllm_step_runs_on_the_cpu_build(tmp_path):
    """scripts/gpu_vllm_check.py, which a lent GPU runs at the 0.5B shape, here on vLLM's CPU
    build with a small model: every version loads, and its samples match the weights sent."""
    tokenizer = build_tokenizer()
    model_dir = save_policy(build_tiny_model(tokenizer, "demo", seed=0), tokenizer, tmp_path / "m")
    script = Path(__file__).parents[2] / "scripts" / "gpu_vllm_check.py"
    run = subprocess.run(
        [
            sys.executable,
            str(script),
            str(model_dir),
            str(tmp_path / "out"),
            "--device",
            "cpu",
            "--versions",
            "2",
            "--tokens",
            "16",
        ],
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["ok"] and result["wire_dtype"] == "torch.bfloat16"
    assert [v["samples_at_version"] for v in result["versions"]] == [8, 8]


def test_vllm_instances_move_requests_between_them(tmp_path):
    """Moving work mid-flight on vLLM instances (issue 34): all planned onto one instance, the
    other takes its share by moves (running ones re-prefilled there); every sample once, with
    the greedy tokens one instance gives."""
    tokenizer = build_tokenizer()
    model_dir = save_policy(build_tiny_model(tokenizer, "demo", seed=0), tokenizer, tmp_path / "m")
    lengths = [22, 3, 18, 5, 14, 7, 20, 4]
    requests = [
        Request(f"p{i}", [5, 6, 7 + i], max_tokens=24, forced_length=n)
        for i, n in enumerate(lengths)
    ]
    engine = VLLMEngine(options=ENGINE)
    with StreamGenerationService(model_dir, 1, engine=engine, max_batch_size=4, greedy=True) as one:
        baseline = {s.key: s.token_ids for s in one.generate(requests)}
    planner = AllOnFirstInstance(LatencyModel([1, 4], [0.002, 0.008]), max_batch_size=4)
    with StreamGenerationService(
        model_dir,
        2,
        engine=engine,
        max_batch_size=4,
        greedy=True,
        dispatcher=planner,
        scheduler=LPTScheduler,
    ) as sgs:
        samples = list(sgs.generate(requests, [float(n) for n in lengths]))
        moved = sgs.counts["requests_moved"]
    assert sorted(s.key for s in samples) == sorted(baseline)
    assert all(s.token_ids == baseline[s.key] for s in samples)
    assert moved >= 1 and {s.instance_id for s in samples} == {0, 1}
