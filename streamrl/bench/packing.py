"""``streamrl bench packing``: tokens/s of one training step on packed and on padded rows.

The trainer's step (``streamrl.components.training.layout`` -> ``streamrl.policy.logprobs`` ->
a loss -> backward) on the same micro-batch laid out three ways, in one process, interleaved:

- ``padded``: one row per sample, right-padded, SDPA with an attention mask (rows x longest);
- ``packed-dense``: one packed row under SDPA, kept apart by Hugging Face's block-diagonal mask
  (the micro-batch's tokens squared);
- ``packed-varlen``: one packed row through ``streamrl.policy.varlen_attention`` (SDPA on a
  jagged tensor of the samples: each sample's tokens squared, no mask).

Two micro-batch kinds: the demo's (32 short samples, completions drawn as the demo's tasks draw
them) and a long-tailed one (one 896-token sample beside 15 short ones). Tokens/s counts real
tokens (prompt and completion), the median of ``repeats`` timed steps after a warm-up.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass

import torch

from streamrl.components.training.layout import layout_batch
from streamrl.policy.logprobs import completion_logprobs
from streamrl.policy.models import build_tiny_model, build_tokenizer
from streamrl.policy.varlen_attention import NAME, register
from streamrl.records import Sample

PATHS = ("padded", "packed-dense", "packed-varlen")


@dataclass(frozen=True)
class MicroBatchKind:
    """A micro-batch to time: ``(prompt, completion)`` tokens of each sample."""

    name: str
    lengths: tuple[tuple[int, int], ...]

    @property
    def tokens(self) -> int:
        return sum(p + c for p, c in self.lengths)


def micro_batch_kinds(seed: int = 0) -> list[MicroBatchKind]:
    """The demo's micro-batch (32 samples: 12-token prompts, completions log-normal around 6
    tokens as the demo's tasks draw them, up to 48) and a long-tailed one (one 896-token
    completion beside 15 of 12-64 tokens)."""
    g = torch.Generator().manual_seed(seed)
    demo = torch.exp(torch.randn(32, generator=g) * 0.8 + 1.8).clamp(1, 48).round().int()
    tail = torch.randint(12, 65, (15,), generator=g)
    return [
        MicroBatchKind("demo", tuple((12, int(c)) for c in demo)),
        MicroBatchKind("long-tailed", ((16, 896), *((12, int(c)) for c in tail))),
    ]


def bench_packing(size: str = "demo", repeats: int = 5, seed: int = 0) -> dict:
    """Time every path on every micro-batch kind (module docstring); returns the rows, printed
    as a table on stderr."""
    torch.set_num_threads(1)
    tokenizer = build_tokenizer()
    models = {}
    for path in PATHS:
        model = build_tiny_model(tokenizer, size, max_positions=2048, seed=seed).train()
        if path == "packed-varlen":
            model.config._attn_implementation = register()
        models[path] = model
    rows = []
    for kind in micro_batch_kinds(seed):
        samples = _samples(kind, seed)
        timings: dict[str, list[float]] = {path: [] for path in PATHS}
        for repeat in range(repeats + 1):  # interleaved; the first round warms up
            for path in PATHS:
                seconds = _step(models[path], samples, "padded" if path == "padded" else "packed")
                if repeat:
                    timings[path].append(seconds)
        for path in PATHS:
            median = statistics.median(timings[path])
            rows.append(
                {
                    "kind": kind.name,
                    "path": path,
                    "samples": len(kind.lengths),
                    "tokens": kind.tokens,
                    "padded_tokens": len(kind.lengths) * max(p + c for p, c in kind.lengths),
                    "step_s": median,
                    "tokens_per_s": kind.tokens / median,
                }
            )
    _print(rows)
    return {"size": size, "repeats": repeats, "attention": NAME, "rows": rows}


def _samples(kind: MicroBatchKind, seed: int) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i, (prompt, completion) in enumerate(kind.lengths):
        ids = torch.randint(3, 50, (prompt + completion,), generator=g).tolist()
        behaviour = [-1.0] * completion
        samples.append(Sample(f"p{i}", 0, ids[:prompt], ids[prompt:], behaviour, 0, 0))
    return samples


def _step(model: torch.nn.Module, samples: list[Sample], layout: str) -> float:
    """Seconds of one forward and backward pass of the trainer's log-probs on ``samples``."""
    started = time.perf_counter()
    batch = layout_batch(samples, layout, 0, torch.device("cpu"))
    scored = completion_logprobs(model, batch.tokens, 0.7)
    (batch.per_sample(scored.logprobs) * batch.mask).sum().backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - started


def _print(rows: list[dict]) -> None:
    print(
        f"{'micro-batch':<13}{'path':<15}{'tokens':>8}{'step ms':>10}{'tokens/s':>10}",
        file=sys.stderr,
    )
    for r in rows:
        print(
            f"{r['kind']:<13}{r['path']:<15}{r['tokens']:>8}{r['step_s'] * 1000:>10.1f}"
            f"{r['tokens_per_s']:>10.0f}",
            file=sys.stderr,
        )
