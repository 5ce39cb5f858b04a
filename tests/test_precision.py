"""The trainer's memory savers keep its numbers: activation checkpointing gives the same
gradients, bf16-mixed (FSDP2's mixed-precision policy) the same loss within bf16's precision, and
a sharded reference policy holds only its shard on each rank, in bf16."""

from __future__ import annotations

import copy
import os
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from streamrl.algorithms import GRPO
from streamrl.algorithms.base import LossInputs
from streamrl.components.training.layout import layout_batch
from streamrl.components.training.reference import FrozenCopy
from streamrl.components.training.sharding import (
    enable_activation_checkpointing,
    local_bytes,
    shard_model,
)
from streamrl.policy.logprobs import causal_lm, completion_logprobs
from streamrl.policy.lora import LoRASpec, apply_lora
from streamrl.policy.models import build_tiny_model, build_tokenizer
from streamrl.records import Sample

pytestmark = pytest.mark.timeout(180)
WORLD = 2
#: bf16 keeps 8 bits of mantissa: a loss of O(1) summed from O(100) tokens moves by about 1e-2.
BF16_LOSS_ATOL = 2e-2


def _samples(vocab: int, seed: int = 0) -> list[Sample]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, (prompt, completion) in enumerate([(4, 9), (6, 3), (2, 14), (5, 7)]):
        ids = torch.randint(3, vocab, (prompt + completion,), generator=gen).tolist()
        behaviour = (-torch.rand(completion, generator=gen) * 4).tolist()
        out.append(Sample(f"p{i}", 0, ids[:prompt], ids[prompt:], behaviour, 0, 0))
    return out


def _loss(model: torch.nn.Module, samples: list[Sample]) -> torch.Tensor:
    """GRPO's summed loss over ``samples`` (what ``StreamRLModule.backward_micro`` runs)."""
    batch = layout_batch(samples, "packed", 0, torch.device("cpu"))
    current = batch.per_sample(completion_logprobs(model, batch.tokens, 0.7).logprobs)
    inputs = LossInputs(
        logprobs=current * batch.mask,
        old_logprobs=batch.behaviour,
        advantages=torch.tensor([1.0, -0.5, 0.25, -0.75]),
        mask=batch.mask,
    )
    return GRPO(group_size=4).loss(inputs).sum()


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_activation_checkpointing_gives_the_same_gradients(tokenizer, lora):
    model = build_tiny_model(tokenizer, "test", seed=0).train()
    if lora:
        model = apply_lora(model, LoRASpec(r=4))
        for name, p in model.named_parameters():  # B = 0 at init: move it, so A gets gradients
            if "lora_B" in name:
                p.data.normal_(0, 0.1)
    checkpointed = copy.deepcopy(model)
    enable_activation_checkpointing(checkpointed)
    samples = _samples(len(tokenizer))
    forwards = []
    layer = causal_lm(checkpointed).get_decoder().layers[0]
    # The layer's forward is checkpointed (its own hooks stay outside); its MLP runs inside,
    # and is entered again when the backward pass recomputes the layer.
    layer.mlp.register_forward_pre_hook(lambda *_: forwards.append(1))

    _loss(model, samples).backward()
    _loss(checkpointed, samples).backward()

    assert len(forwards) == 2  # the layer ran again in the backward pass: it is checkpointed
    expected = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    got = {n: p.grad for n, p in checkpointed.named_parameters() if p.requires_grad}
    assert set(got) == set(expected) and all(g is not None for g in got.values())
    for name, grad in got.items():
        torch.testing.assert_close(grad, expected[name], atol=1e-6, rtol=1e-5, msg=name)


def _rank_main(rank: int, port: int, out_dir: str) -> None:
    """One rank: bf16-mixed loss and gradient norm against float32, and a sharded reference."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (WORLD,))
        tokenizer = build_tokenizer()
        samples = _samples(len(tokenizer))
        fp32 = build_tiny_model(tokenizer, "test", seed=0).train()
        loss_fp32 = _loss(fp32, samples)
        loss_fp32.backward()
        norm_fp32 = torch.cat([p.grad.flatten() for p in fp32.parameters()]).norm()

        reference = FrozenCopy(copy.deepcopy(fp32), torch.bfloat16)
        full_bf16 = local_bytes(reference.model)
        reference.shard(mesh)
        batch = layout_batch(samples, "packed", 0, torch.device("cpu"))
        ref_logprobs = reference.logprobs(batch.tokens, 0.7)
        with torch.no_grad():
            fp32_logprobs = completion_logprobs(fp32, batch.tokens, 0.7).logprobs

        mixed = shard_model(copy.deepcopy(fp32).train(), mesh, precision="bf16-mixed")
        for p in mixed.parameters():
            p.grad = None
        loss_mixed = _loss(mixed, samples)
        loss_mixed.backward()
        grads = [p.grad.full_tensor() for p in mixed.parameters()]
        torch.save(
            {
                "loss_fp32": float(loss_fp32),
                "loss_mixed": float(loss_mixed),
                "norm_fp32": float(norm_fp32),
                "norm_mixed": float(torch.cat([g.flatten() for g in grads]).norm()),
                "grad_dtypes": {str(g.dtype) for g in grads},
                "master_dtypes": {str(p.dtype) for p in mixed.parameters()},
                "reference_bytes": local_bytes(reference.model),
                "reference_full_bf16_bytes": full_bf16,
                "reference_dtypes": {str(p.dtype) for p in reference.model.parameters()},
                "reference_gap": float((ref_logprobs - fp32_logprobs).abs().max()),
                "policy_fp32_bytes": local_bytes(fp32),
            },
            Path(out_dir) / f"rank{rank}.pt",
        )
    finally:
        torch.distributed.destroy_process_group()


def test_bf16_mixed_loss_and_a_sharded_reference_on_two_ranks(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.spawn(_rank_main, args=(port, str(tmp_path)), nprocs=WORLD, join=False)
    deadline = time.monotonic() + 150
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError("ranks still running after 150 s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    for rank in range(WORLD):
        r = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        # bf16 compute over float32 shards: the loss within bf16's precision, the gradient's
        # norm within a few percent; the master weights and the reduced gradients float32.
        assert r["loss_mixed"] == pytest.approx(r["loss_fp32"], abs=BF16_LOSS_ATOL)
        assert r["loss_mixed"] != r["loss_fp32"]  # it did compute in bf16
        assert r["norm_mixed"] == pytest.approx(r["norm_fp32"], rel=0.05)
        assert r["master_dtypes"] == {"torch.float32"} == r["grad_dtypes"]
        # The reference: bf16, and only this rank's half of it (a whole fp32 copy is 4x).
        assert r["reference_dtypes"] == {"torch.bfloat16"}
        assert r["reference_bytes"] <= 0.55 * r["reference_full_bf16_bytes"]
        assert r["reference_bytes"] <= 0.3 * r["policy_fp32_bytes"]
        assert r["reference_gap"] < 0.1  # its log-probs are the starting policy's, in bf16


@pytest.mark.timeout(400)
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_fit_in_bf16_mixed_with_checkpointing_and_a_kl_reference(fit_small, lora):
    """``streamrl fit`` on one FSDP2 rank in bf16-mixed, every layer checkpointed, a KL term
    against the reference (a bf16 shard, or under LoRA the policy with adapters off)."""
    options = {"lora": {"r": 4}} if lora else {}
    summary = fit_small(
        algorithm={"class_path": "grpo", "init_args": {"kl_coef": 0.1}},
        trainer={"precision": "bf16-mixed", "activation_checkpointing": True},
        out="lora" if lora else "full",
        **options,
    )
    trainer = summary["trainer"]
    assert trainer["precision"] == "bf16-mixed" and trainer["activation_checkpointing"]
    assert trainer["ranks"] == 1 and trainer["device"] == "cpu"
    assert len(trainer["peak_memory_bytes_per_rank"]) == 1
    assert summary["iterations"] == 2
    assert summary["algorithm"] == {
        "name": "GRPO",
        "clip_eps": 0.2,
        "kl_coef": 0.1,
        "reference": True,  # the KL term's frozen policy (a bf16 shard, or adapters off)
    }


@pytest.mark.timeout(400)
def test_fit_with_generators_in_bf16_and_two_trainer_ranks(fit_small):
    """Generators in bfloat16, two FSDP2 ranks: every version is staged from the shards (rows
    sent to rank 0) in bfloat16, received and loaded; every token corrected for the gap."""
    summary = fit_small(
        generation={"num_instances": 2},
        engine={"class_path": "hf", "init_args": {"dtype": "bfloat16"}},
        trainer={"devices": 2},
    )
    assert summary["trainer"]["ranks"] == 2 and summary["iterations"] == 2
    assert summary["sync_transfer_s_total"] > 0
