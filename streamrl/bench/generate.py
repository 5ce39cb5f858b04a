"""``streamrl bench generate``: decode throughput of the continuous-batching generator against
batched Hugging Face ``generate`` on the same model, prompts and forced lengths, one thread."""

from __future__ import annotations

import random
import statistics
import sys
import time

import torch

from streamrl.bench.inputs import DEFAULT_CONTEXT, check_context, tokenizer_for
from streamrl.components.generation.hf_generator import HFStreamGenerator
from streamrl.errors import ConfigError
from streamrl.policy.models import build_tiny_model, build_tokenizer, load_policy
from streamrl.records import Request
from streamrl.tasks import make_prompt_set


def load_model(model: str, context: int = 0):
    """``(policy, tokenizer)``: the built-in ``"tiny"`` demo model (with at least ``context``
    positions) or a model directory, refused before any work if its context is shorter."""
    if model == "tiny":
        tokenizer = build_tokenizer()
        positions = max(DEFAULT_CONTEXT["tiny"], context)
        return build_tiny_model(
            tokenizer, "demo", max_positions=positions, seed=0
        ).eval(), tokenizer
    check_context(model, context)
    return load_policy(model)


def _time_stream(model, prompts: list[list[int]], tokens: int, batch: int) -> float:
    generator = HFStreamGenerator(model, max_batch_size=batch, greedy=True)
    generator.submit(
        Request(f"p{i}", ids, tokens, forced_length=tokens) for i, ids in enumerate(prompts)
    )
    started = time.perf_counter()
    produced = sum(s.length for s in generator.stream())
    return produced / (time.perf_counter() - started)


@torch.inference_mode()
def _time_hf_generate(model, tokenizer, texts: list[str], tokens: int, batch: int) -> float:
    tokenizer.padding_side = "left"
    started, produced = time.perf_counter(), 0
    for i in range(0, len(texts), batch):
        enc = tokenizer(texts[i : i + batch], return_tensors="pt", padding=True)
        out = model.generate(
            **enc,
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
        produced += (out.shape[1] - enc["input_ids"].shape[1]) * out.shape[0]
    return produced / (time.perf_counter() - started)


def bench_generate(
    model: str, batch_sizes: list[int], max_tokens: int, repeats: int, n_prompts: int
) -> dict:
    """Tokens/s of both decoders for each batch size (median of ``repeats``).

    Returns:
        ``{"tokens_per_s": {"stream": {bs: ..}, "hf_generate": {bs: ..}}, "ratio": {bs: ..}}``.
    """
    torch.set_num_threads(1)
    if max_tokens < 1 or n_prompts < 1 or not batch_sizes or min(batch_sizes) < 1:
        raise ConfigError(
            "bench generate: --max-tokens, --prompts and every batch size must be "
            f">= 1; got {max_tokens}, {n_prompts}, {batch_sizes}."
        )
    texts = make_prompt_set(n_prompts, seed=random.Random(0).randint(0, 999))["prompt"]
    tokenizer = tokenizer_for(model)
    prompts = [tokenizer(t)["input_ids"] for t in texts]
    # --max-tokens past the built-in model's context: build it with the context it needs.
    policy, tokenizer = load_model(model, context=max(map(len, prompts)) + max_tokens)
    result: dict = {"tokens_per_s": {"stream": {}, "hf_generate": {}}, "ratio": {}}
    print(
        f"{'batch':>6} {'stream tok/s':>14} {'hf generate tok/s':>18} {'ratio':>7}", file=sys.stderr
    )
    for batch in batch_sizes:
        ours = statistics.median(
            _time_stream(policy, prompts, max_tokens, batch) for _ in range(repeats)
        )
        base = statistics.median(
            _time_hf_generate(policy, tokenizer, texts, max_tokens, batch) for _ in range(repeats)
        )
        result["tokens_per_s"]["stream"][batch] = round(ours, 1)
        result["tokens_per_s"]["hf_generate"][batch] = round(base, 1)
        result["ratio"][batch] = round(ours / base, 3)
        print(f"{batch:>6} {ours:>14.0f} {base:>18.0f} {ours / base:>7.2f}", file=sys.stderr)
    return result
