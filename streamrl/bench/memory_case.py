"""One case of ``streamrl bench memory``, measured in the process it runs in
(``python -m streamrl.bench.memory_case --case JSON``; ``streamrl.bench.memory.run_case``
starts it): build the model and AdamW's state, run one training step of the case's path, then
the log-prob + loss part alone, and print the figures as one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import re
import resource
import socket
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from streamrl.algorithms.base import LossInputs
from streamrl.algorithms.grpo import GRPO
from streamrl.bench.full_logprobs import full_vocab_logprobs
from streamrl.bench.memory import GIB, TEMPERATURE, MemoryCase
from streamrl.components.training.layout import TrainBatch, layout_batch
from streamrl.components.training.sharding import enable_activation_checkpointing, shard_model
from streamrl.policy.logprobs import causal_lm, completion_logprobs, head_logprobs, output_head
from streamrl.records import Sample
from streamrl.runtime.peak_memory import peak_memory_bytes, reset_peak_memory, resident_bytes

_OOM_MARKERS = ("can't allocate memory", "out of memory", "bad_alloc")


def measure_case(case: MemoryCase) -> dict[str, Any]:
    """Measure ``case`` in this process (what ``run_case``'s process does).

    Returns:
        ``parameters``; ``static_bytes``, resident once the model and AdamW's state exist;
        ``peak_bytes``, the process's peak up to the end of the step; ``step_peak_bytes`` and
        ``step_extra_bytes``, the step's own peak and that minus ``static_bytes``;
        ``logprob_extra_bytes``, the peak of the log-prob + loss part (forward and backward,
        from the final hidden states) over what was resident before it, measured first (before
        AdamW's state exists); ``step_s`` and
        ``tokens_per_s``. Out of memory: what was measured so far, ``oom``, the ``phase`` it
        failed in and ``needed_bytes`` (in use then + the failed allocation).
    """
    device = torch.device(case.device)
    mesh = _one_rank_mesh(device) if case.path == "new" else None
    _limit_memory(case.memory_limit_bytes, device)
    out: dict[str, Any] = {"phase": "setup", "oom": False}
    try:
        _measure(case, device, mesh, out)
    except (RuntimeError, MemoryError) as err:  # torch.OutOfMemoryError is a RuntimeError
        oom = isinstance(err, torch.OutOfMemoryError | MemoryError)
        if not oom and not any(marker in str(err) for marker in _OOM_MARKERS):
            raise
        failed = _failed_allocation_bytes(str(err))
        in_use = _current_bytes(device)  # the failing frames still hold their tensors
        out.update(oom=True, in_use_at_failure_bytes=in_use, failed_allocation_bytes=failed)
        out.update(needed_bytes=None if failed is None else in_use + failed, error=str(err)[:300])
    finally:
        if mesh is not None:
            torch.distributed.destroy_process_group()
    return out


def _measure(case: MemoryCase, device: torch.device, mesh: Any, out: dict[str, Any]) -> None:
    new = case.path == "new"
    torch.manual_seed(case.seed)
    model = _build_model(case).to(device).train()
    out["parameters"] = sum(p.numel() for p in model.parameters())
    if new:  # the trainer as it is now
        enable_activation_checkpointing(model)
        shard_model(model, mesh, precision="bf16-mixed")
    vocab, pad = model.config.vocab_size, int(model.config.pad_token_id or 0)
    batch = layout_batch(_samples(case, vocab), "packed" if new else "padded", pad, device)
    # The log-prob + loss part first, before AdamW's state exists: it is measured over what is
    # resident before it, and so it fits where the whole old step does not.
    out["phase"] = "logprobs"
    logprobs_of_hidden = (_new_head if new else _old_head)(model, batch, case.chunk_tokens)
    gc.collect()
    before = _current_bytes(device)
    reset_peak_memory(device)
    _grpo_loss(batch, logprobs_of_hidden()).backward()
    out.update(logprob_extra_bytes=peak_memory_bytes(device) - before, vocab=vocab)
    del logprobs_of_hidden
    model.zero_grad(set_to_none=True)
    gc.collect()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    for p in model.parameters():  # a step on zero gradients creates AdamW's state
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    out["static_bytes"] = static = _current_bytes(device)
    setup_peak = peak_memory_bytes(device)
    reset_peak_memory(device)
    out["phase"], times = "step", []
    for _ in range(case.repeats + (case.repeats > 1)):  # the warm-up step is not timed
        _synchronize(device)
        started = time.perf_counter()
        logprobs = (_new_logprobs if new else _old_logprobs)(model, batch, case.chunk_tokens)
        _grpo_loss(batch, logprobs).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del logprobs
        _synchronize(device)
        times.append(time.perf_counter() - started)
    step_peak = peak_memory_bytes(device)
    step_s = statistics.median(times[1:] if case.repeats > 1 else times)
    out.update(step_peak_bytes=step_peak, peak_bytes=max(setup_peak, step_peak))
    out.update(step_extra_bytes=step_peak - static, step_s=round(step_s, 4), phase="done")
    out["tokens_per_s"] = round(case.batch * (case.prompt + case.seq) / step_s, 2)


def _build_model(case: MemoryCase) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config

    if case.model_dir is not None:
        config = AutoConfig.from_pretrained(case.model_dir, local_files_only=True)
    else:
        positions = max(32768, case.prompt + case.seq)
        config = Qwen2Config(
            **case.shape,
            tie_word_embeddings=True,
            pad_token_id=0,
            max_position_embeddings=positions,
        )
    config.use_cache = False
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _samples(case: MemoryCase, vocab: int) -> list[Sample]:
    generator = torch.Generator().manual_seed(case.seed)
    samples = []
    for i in range(case.batch):
        ids = torch.randint(1, vocab, (case.prompt + case.seq,), generator=generator).tolist()
        # About what a random model gives (near uniform): the ratios stay in the clip range.
        behaviour = (0.01 * torch.randn(case.seq, generator=generator) - math.log(vocab)).tolist()
        samples.append(Sample(f"p{i}", i, ids[: case.prompt], ids[case.prompt :], behaviour, 0, 0))
    return samples


def _grpo_loss(batch: TrainBatch, current: torch.Tensor) -> torch.Tensor:
    """GRPO's loss of the micro-batch as the trainer takes it; ``current``: ``[batch, width]``."""
    signs = [(-1.0) ** i for i in range(len(batch.samples))]
    advantages = torch.tensor(signs, device=current.device)  # [batch]
    inputs = LossInputs(current * batch.mask, batch.behaviour, advantages, batch.mask)
    return GRPO(group_size=2).loss(inputs).sum() / len(batch.samples)


def _old_logprobs(model: Any, batch: TrainBatch, chunk_tokens: int | None) -> torch.Tensor:
    rows = batch.padded(int(model.config.pad_token_id or 0))
    width = batch.width
    return full_vocab_logprobs(
        model, rows.input_ids, rows.attention, rows.starts, width, TEMPERATURE
    )


def _new_logprobs(model: Any, batch: TrainBatch, chunk_tokens: int | None) -> torch.Tensor:
    chunk = chunk_tokens
    scored = completion_logprobs(model, batch.tokens, TEMPERATURE, chunk_tokens=chunk, entropy=True)
    return batch.per_sample(scored.logprobs)  # [batch, width]


def _old_head(model: Any, batch: TrainBatch, chunk_tokens: int | None) -> Callable[[], Any]:
    """The old log-probs of the decoder's output (a leaf, every position of the padded rows)."""
    rows = batch.padded(int(model.config.pad_token_id or 0))
    with torch.no_grad():
        decoded = model.get_decoder()(input_ids=rows.input_ids, attention_mask=rows.attention)
    hidden = decoded.last_hidden_state.requires_grad_()  # [batch, seq, hidden]
    head, mask, starts, width = output_head(model), rows.attention, rows.starts, batch.width
    # full_vocab_logprobs takes a model: this one's logits are the head's on the leaf.
    logits = lambda **_: SimpleNamespace(logits=head(hidden))  # noqa: E731
    return lambda: full_vocab_logprobs(logits, rows.input_ids, mask, starts, width, TEMPERATURE)


def _new_head(model: Any, batch: TrainBatch, chunk_tokens: int | None) -> Callable[[], Any]:
    """The new log-probs of the decoder's output at the scored positions (a leaf)."""
    lm, captured = causal_lm(model), []
    hook = lm.get_decoder().register_forward_hook(lambda *args: captured.append(args[-1]))
    with torch.no_grad():
        completion_logprobs(model, batch.tokens, TEMPERATURE, chunk_tokens=chunk_tokens)
    hook.remove()
    model.reshard()  # FSDP2 keeps the root gathered after a forward without a backward
    tokens = batch.tokens
    hidden = captured.pop().last_hidden_state[tokens.rows, tokens.cols].requires_grad_()
    head = output_head(lm)

    def gathered(p: torch.Tensor) -> torch.Tensor:  # what FSDP gathers: bf16 under bf16-mixed
        return (p.full_tensor() if isinstance(p, DTensor) else p).detach().to(hidden.dtype)

    weight, bias = gathered(head.weight).requires_grad_(), head.bias
    bias = None if bias is None else gathered(bias)
    return lambda: batch.per_sample(
        head_logprobs(hidden, weight, bias, tokens.targets, TEMPERATURE, chunk_tokens, True)[0]
    )


def _one_rank_mesh(device: torch.device) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    url = f"tcp://127.0.0.1:{port}"
    torch.distributed.init_process_group(backend, init_method=url, world_size=1, rank=0)
    return init_device_mesh(device.type, (1,))


def _limit_memory(limit_bytes: int | None, device: torch.device) -> None:
    """Cap what the process may allocate from now on: a fraction of the GPU on CUDA, its address
    space on the CPU (virtual memory: never a looser bound than resident memory)."""
    if limit_bytes is None:
        return
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit_bytes / total), device)
        return
    torch.ones(256, 256) @ torch.ones(256, 256)  # starts the thread pool (its stacks count too)
    size = int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    soft = size + limit_bytes if hard == resource.RLIM_INFINITY else min(hard, size + limit_bytes)
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _failed_allocation_bytes(message: str) -> int | None:
    """The size in an allocator's message: "allocate N bytes" (CPU), "allocate 2.00 GiB"."""
    if match := re.search(r"allocate (\d+) bytes", message):
        return int(match.group(1))
    if match := re.search(r"allocate ([\d.]+) ([KMGT]?i?B)", message):
        scale = {"B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": GIB, "TiB": 1024**4}
        return int(float(match.group(1)) * scale.get(match.group(2), 1))
    return None


def _current_bytes(device: torch.device) -> int:
    return int(torch.cuda.memory_allocated(device)) if device.type == "cuda" else resident_bytes()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m streamrl.bench.memory_case", description="one case of streamrl bench memory"
    )
    parser.add_argument("--case", required=True, help="a MemoryCase as JSON (what run_case passes)")
    case = MemoryCase(**json.loads(parser.parse_args().case))
    from streamrl.runtime.quiet import quiet_libraries

    quiet_libraries()
    print(json.dumps(measure_case(case)), flush=True)


if __name__ == "__main__":
    _main()
