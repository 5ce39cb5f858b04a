"""Measure this machine's trainer cost and contended decode latency for the CPU preset.

The simulator predicts the real ``streamrl bench pipeline`` only if it is fed what that bench runs
on: the decode latency ``PTL(BS)`` of one generator process (``streamrl profile``), the cost of a
forward/backward pass of the trainer per padded token (measured here, on 1 and on 2 threads),
how much a generator process slows down while the trainer computes on the other core (measured
here by profiling while a second process trains) and what a re-prefill of the running sequences
costs (partial rollout ``"recompute"``, measured here on the real generator). StreamRL §4.2 calls
this the profiler-based estimation model ``P``; the paper gives no functional form, so the
trainer and the re-prefill are fitted as ``seconds = overhead + s_per_token x padded_tokens``.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from collections.abc import Sequence

import numpy as np

from streamrl.components.capacity.allocator import TrainerCostModel
from streamrl.components.skewness.latency import LatencyModel

#: Micro-batch shapes timed: (rows, completion tokens); the bench's prompts are ~12 tokens.
DEFAULT_SHAPES = (
    (4, 16),
    (8, 16),
    (16, 16),
    (4, 64),
    (8, 32),
    (16, 32),
    (4, 128),
    (8, 64),
    (4, 200),
    (16, 64),
    (8, 128),
    (32, 32),
    (16, 128),
    (32, 64),
)
PROMPT_TOKENS = 12


def _tiny_policy(seed: int = 0):
    from streamrl.policy.models import build_tiny_model, build_tokenizer

    tokenizer = build_tokenizer()
    return build_tiny_model(tokenizer, "demo", seed=seed), tokenizer


def _micro_batch_s(policy, rows: int, width: int, repeats: int) -> float:
    import torch

    from streamrl.algorithms.base import LossInputs
    from streamrl.algorithms.grpo import GRPO
    from streamrl.components.training.layout import layout_batch
    from streamrl.policy.logprobs import completion_logprobs
    from streamrl.records import Sample

    loss_fn = GRPO(group_size=4)
    seq = PROMPT_TOKENS + width
    vocab = policy.config.vocab_size
    times = []
    for _ in range(repeats):
        ids = torch.randint(3, vocab, (rows, seq)).tolist()  # [rows, seq]
        samples = [
            Sample(f"p{r}", 0, row[:PROMPT_TOKENS], row[PROMPT_TOKENS:], [0.0] * width, 0, 0)
            for r, row in enumerate(ids)
        ]
        started = time.perf_counter()
        batch = layout_batch(samples, "padded", 0, torch.device("cpu"))  # the sim pads
        logprobs = batch.per_sample(completion_logprobs(policy, batch.tokens).logprobs)
        inputs = LossInputs(
            logprobs, logprobs.detach() - 0.01, torch.randn(rows), torch.ones(rows, width)
        )
        loss_fn.loss(inputs).sum().backward()
        times.append(time.perf_counter() - started)
    return min(times)  # the least disturbed run: other processes only ever add time


def measure_trainer_cost(
    threads: int = 1, shapes: Sequence[tuple[int, int]] = DEFAULT_SHAPES, repeats: int = 5
) -> TrainerCostModel:
    """Fit ``overhead + s_per_token x tokens`` to timed micro-batches of the tiny demo policy.

    Args:
        threads: torch threads of the trainer (1 in the bench's sync/async modes, 2 colocated).
        shapes: ``(rows, completion tokens)`` of the timed micro-batches.
        repeats: timings per shape (the fastest kept).

    Returns:
        A one-unit ``TrainerCostModel`` with the measured optimizer step time.
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        policy, _ = _tiny_policy()
        optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-5)
        _micro_batch_s(policy, 4, 16, 2)  # warm-up
        tokens = [rows * (PROMPT_TOKENS + width) for rows, width in shapes]
        seconds = [_micro_batch_s(policy, rows, width, repeats) for rows, width in shapes]
        slope, intercept = np.polyfit(tokens, seconds, 1)
        steps = []
        for _ in range(repeats):
            started = time.perf_counter()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            steps.append(time.perf_counter() - started)
            _micro_batch_s(policy, 4, 16, 1)
    finally:
        torch.set_num_threads(before)
    return TrainerCostModel(
        s_per_token=float(slope),
        microbatch_overhead_s=max(0.0, float(intercept)),
        step_s=min(steps),
    )


#: Re-prefills timed: (running rows, tokens generated so far), up to the bench's 64 slots.
RECOMPUTE_SHAPES = ((4, 8), (16, 16), (64, 8), (8, 64), (32, 32), (64, 32), (16, 128), (64, 64))


def measure_recompute_cost(
    policy,
    prompt_ids: Sequence[int],
    shapes: Sequence[tuple[int, int]] = RECOMPUTE_SHAPES,
    repeats: int = 3,
) -> tuple[float, float]:
    """Fit ``seconds = intercept + s_per_token x padded tokens`` to the real re-prefill of
    partial rollout ``"recompute"`` (``HFStreamGenerator.recompute_running``), on one thread as
    in a generator instance, with the policy and prompt ``PTL`` is profiled with.

    Each shape decodes ``rows`` sequences for ``generated`` tokens, then times the re-prefill
    of all of them (prompt and tokens so far, right-padded to the longest: ``rows x (prompt +
    generated)`` padded tokens) ``repeats`` times, keeping the fastest.

    Returns:
        ``(intercept_s, s_per_token)``.
    """
    import torch

    from streamrl.components.generation.hf_generator import HFStreamGenerator
    from streamrl.records import Request

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tokens, seconds = [], []
        for rows, generated in shapes:
            generator = HFStreamGenerator(policy, max_batch_size=rows, greedy=True)
            generator.submit(
                Request(f"r{i}", list(prompt_ids), generated + 2, forced_length=generated + 2)
                for i in range(rows)
            )
            for _ in range(generated):
                generator.step()
            times = []
            for _ in range(repeats + 1):  # the first is a warm-up
                started = time.perf_counter()
                generator.recompute_running()
                times.append(time.perf_counter() - started)
            tokens.append(rows * (len(prompt_ids) + generated))
            seconds.append(min(times[1:]))
        slope, intercept = np.polyfit(tokens, seconds, 1)
    finally:
        torch.set_num_threads(before)
    return max(0.0, float(intercept)), max(0.0, float(slope))


def _burn(stop) -> None:
    import torch

    torch.set_num_threads(1)
    policy, _ = _tiny_policy()
    while not stop.is_set():
        _micro_batch_s(policy, 8, 32, 1)


def measure_contended_ptl(
    batch_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64), tokens: int = 32, repeats: int = 3
) -> tuple[LatencyModel, LatencyModel]:
    """``PTL(BS)`` of one generator alone and while a trainer process computes on another core.

    Returns:
        ``(alone, contended)`` latency models.
    """
    from streamrl.components.skewness.profiler import Profiler

    policy, tokenizer = _tiny_policy()
    prompt = tokenizer("copy abcdefgh=")["input_ids"]
    profiler = Profiler(policy, prompt, tokens=tokens, repeats=repeats)
    alone = profiler.fit(batch_sizes)
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    burner = ctx.Process(target=_burn, args=(stop,), daemon=True)
    burner.start()
    try:
        time.sleep(8.0)  # let it import and reach its loop
        contended = profiler.fit(batch_sizes)
    finally:
        stop.set()
        burner.join(timeout=30)
    return alone, contended


if __name__ == "__main__":  # python -m streamrl.sim.calibrate
    for n in (1, 2):
        print(f"trainer, {n} thread(s):", measure_trainer_cost(n))
    policy, tokenizer = _tiny_policy()
    intercept, per_token = measure_recompute_cost(policy, tokenizer("copy abcdefgh=")["input_ids"])
    print(f"re-prefill: {intercept * 1000:.3f} ms + {per_token * 1e6:.3f} us per padded token")
    alone, contended = measure_contended_ptl()
    ratios = [c / a for a, c in zip(alone.ptl_s, contended.ptl_s)]
    print("PTL alone ms:", [round(p * 1000, 3) for p in alone.ptl_s])
    print("PTL contended ms:", [round(p * 1000, 3) for p in contended.ptl_s])
    print("ratio:", [round(r, 3) for r in ratios], "median", round(statistics.median(ratios), 3))
