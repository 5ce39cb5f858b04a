"""Memory-bounded log-probs: the chunked head and packed micro-batches give the numbers (and the
gradients) of the full-vocabulary computation, without ever holding a ``[tokens, vocab]`` tensor."""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from streamrl.bench.full_logprobs import full_vocab_logprobs
from streamrl.components.training.layout import layout_batch
from streamrl.policy.logprobs import completion_logprobs, head_logprobs
from streamrl.policy.models import build_tiny_model
from streamrl.records import Sample


def _samples(vocab: int, shapes: list[tuple[int, int]], seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for i, (prompt, completion) in enumerate(shapes):
        ids = [rng.randrange(3, vocab) for _ in range(prompt + completion)]
        out.append(Sample(f"p{i}", 0, ids[:prompt], ids[prompt:], [0.0] * completion, 0, 0))
    return out


SHAPES = [(3, 5), (7, 2), (2, 11), (4, 4), (1, 1)]


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _full_vocab(model, samples, temperature):
    """The reference: padded rows, logits over the whole vocabulary at every position."""
    batch = layout_batch(samples, "padded", 0, torch.device("cpu"))
    rows = batch.padded(0)
    values = full_vocab_logprobs(
        model, rows.input_ids, rows.attention, rows.starts, batch.width, temperature
    )
    return values, batch.mask


@pytest.mark.parametrize("layout", ["packed", "padded"])
@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_chunked_logprobs_and_gradients_equal_the_full_vocabulary_ones(tokenizer, layout, chunk):
    model = build_tiny_model(tokenizer, "test", seed=0).train()
    samples = _samples(len(tokenizer), SHAPES)
    weights = torch.randn(len(samples), max(s.length for s in samples))
    full, mask = _full_vocab(model, samples, 0.7)
    (full * mask * weights).sum().backward()
    expected = _grads(model)
    model.zero_grad()

    batch = layout_batch(samples, layout, 0, torch.device("cpu"))
    out = completion_logprobs(model, batch.tokens, 0.7, chunk_tokens=chunk, entropy=True)
    chunked = batch.per_sample(out.logprobs)
    (chunked * mask * weights).sum().backward()

    torch.testing.assert_close(chunked * mask, full * mask, atol=1e-5, rtol=0)
    for name, grad in _grads(model).items():
        torch.testing.assert_close(grad, expected[name], atol=1e-5, rtol=1e-5, msg=name)
    assert set(_grads(model)) == set(expected)


def test_head_gradients_with_a_bias_and_the_entropy_match_autograd():
    torch.manual_seed(0)
    hidden = torch.randn(13, 8, requires_grad=True)
    weight = torch.randn(29, 8, requires_grad=True)
    bias = torch.randn(29, requires_grad=True)
    targets = torch.randint(0, 29, (13,))
    upstream = torch.randn(13)

    logits = (hidden @ weight.T + bias) / 1.3
    logp = torch.log_softmax(logits, -1)
    (logp.gather(1, targets[:, None]).squeeze(1) * upstream).sum().backward()
    expected = [t.grad.clone() for t in (hidden, weight, bias)]
    entropy = -(logp.exp() * logp).sum(-1).detach()
    for t in (hidden, weight, bias):
        t.grad = None

    out = head_logprobs(hidden, weight, bias, targets, 1.3, chunk_tokens=4, entropy=True)
    (out.logprobs * upstream).sum().backward()
    for t, want in zip((hidden, weight, bias), expected):
        torch.testing.assert_close(t.grad, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.entropy, entropy, atol=1e-5, rtol=1e-5)
    assert not out.entropy.requires_grad


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any operation creates."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_tensor_of_tokens_times_vocabulary_is_ever_made():
    torch.manual_seed(0)
    tokens, vocab, chunk = 64, 4096, 8
    hidden = torch.randn(tokens, 16, requires_grad=True)
    weight = torch.randn(vocab, 16, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,))
    with _LargestTensor() as seen:
        head_logprobs(hidden, weight, None, targets, 0.9, chunk, entropy=True)[0].sum().backward()
    # One chunk of logits, and the head's weight (and its gradient): never tokens x vocab.
    assert seen.largest <= max(chunk * vocab, weight.numel())
    with _LargestTensor() as full:
        torch.log_softmax(hidden @ weight.T, -1).gather(1, targets[:, None]).sum().backward()
    assert full.largest >= tokens * vocab  # what the recorder would have caught


def test_packed_rows_give_each_sample_its_own_logprobs(tokenizer):
    model = build_tiny_model(tokenizer, "test", seed=1).eval()
    samples = _samples(len(tokenizer), SHAPES, seed=2)
    batch = layout_batch(samples, "packed", 0, torch.device("cpu"))
    assert batch.tokens.input_ids.shape == (1, sum(len(s.prompt_ids) + s.length for s in samples))
    with torch.no_grad():
        packed = batch.per_sample(completion_logprobs(model, batch.tokens, 1.0).logprobs)
        for row, sample in enumerate(samples):
            alone = layout_batch([sample], "padded", 0, torch.device("cpu"))
            expected = completion_logprobs(model, alone.tokens, 1.0).logprobs
            torch.testing.assert_close(packed[row, : sample.length], expected, atol=1e-5, rtol=0)
            assert packed[row, sample.length :].abs().sum() == 0


def test_the_default_layout_packs_only_where_attention_runs_per_sample():
    """``layout_for``: flash-attention's variable-length kernels attend within each packed
    sample; SDPA and eager attention would attend through a dense mask over the whole row."""
    from types import SimpleNamespace

    from streamrl.components.training.layout import layout_for

    def model(implementation):
        return SimpleNamespace(config=SimpleNamespace(_attn_implementation=implementation))

    assert layout_for(model("flash_attention_2")) == "packed"
    assert layout_for(model("flash_attention_3")) == "packed"
    for implementation in ("sdpa", "eager", None):
        assert layout_for(model(implementation)) == "padded"
