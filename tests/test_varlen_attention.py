"""Packed micro-batches through ``streamrl_varlen`` (SDPA on a jagged tensor of the samples):
the same log-probs and gradients as each sample on its own, with no mask built."""

from __future__ import annotations

import torch

import streamrl.policy.varlen_attention as varlen_module
from streamrl.components.training.layout import layout_batch, layout_for
from streamrl.policy.logprobs import completion_logprobs
from streamrl.policy.models import build_tiny_model, build_tokenizer
from streamrl.policy.varlen_attention import NAME, attention_for, register, varlen_attention
from streamrl.records import Sample


def _samples(lengths: list[tuple[int, int]]) -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i, (prompt, completion) in enumerate(lengths):
        ids = torch.randint(3, 50, (prompt + completion,), generator=g).tolist()
        out.append(Sample(f"p{i}", 0, ids[:prompt], ids[prompt:], [0.0] * completion, 0, 0))
    return out


def test_the_attention_equals_each_sample_on_its_own():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 9, 8), torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8)
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 0, 1, 2]])  # samples of 4, 2 and 3 tokens
    out, _ = varlen_attention(None, q, k, v, None, position_ids=positions)
    start = 0
    for length in (4, 2, 3):
        span = slice(start, start + length)
        expected = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, span],
            k[:, :, span].repeat_interleave(2, dim=1),
            v[:, :, span].repeat_interleave(2, dim=1),
            is_causal=True,
        )  # [1, heads, length, d]
        torch.testing.assert_close(out[0, span], expected[0].transpose(0, 1))
        start += length


def test_padded_rows_go_to_transformers_sdpa():
    """A critic's pass or a generate call on such a model: padded rows and their mask, as SDPA
    takes them."""
    register()
    torch.manual_seed(0)
    tok = build_tokenizer()
    sdpa, varlen = build_tiny_model(tok, "test"), build_tiny_model(tok, "test")
    varlen.config._attn_implementation = NAME
    ids = torch.randint(3, 40, (2, 7))
    mask = torch.tensor([[1] * 7, [0, 0, 1, 1, 1, 1, 1]])
    expected = sdpa(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(varlen(input_ids=ids, attention_mask=mask).logits, expected)


def test_a_model_built_with_it_packs_and_scores_as_padded_rows_do():
    register()
    torch.manual_seed(0)
    tok = build_tokenizer()
    padded_model = build_tiny_model(tok, "test")
    packed_model = build_tiny_model(tok, "test")
    packed_model.config._attn_implementation = NAME
    assert layout_for(packed_model) == "packed" and layout_for(padded_model) == "padded"
    samples = _samples([(5, 30), (3, 2), (7, 12), (4, 1)])
    results = {}
    for name, model, layout in (
        ("padded", padded_model, "padded"),
        ("packed", packed_model, "packed"),
    ):
        batch = layout_batch(samples, layout, 0, torch.device("cpu"))
        scored = completion_logprobs(model, batch.tokens, 0.7)
        loss = batch.per_sample(scored.logprobs).sum()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results[name] = (batch.per_sample(scored.logprobs).detach(), grads)
    torch.testing.assert_close(results["packed"][0], results["padded"][0], rtol=1e-5, atol=1e-5)
    for name, grad in results["padded"][1].items():
        torch.testing.assert_close(results["packed"][1][name], grad, rtol=1e-4, atol=1e-5)


def test_cuda_with_flash_attn_takes_flash_attention_2_and_the_rest_streamrl_varlen(monkeypatch):
    real_find_spec = varlen_module.importlib.util.find_spec

    def flash_installed(installed: bool) -> None:
        def find_spec(name: str):
            if name == "flash_attn":
                return object() if installed else None
            return real_find_spec(name)

        monkeypatch.setattr(varlen_module.importlib.util, "find_spec", find_spec)

    flash_installed(True)
    assert attention_for("cuda") == "flash_attention_2"
    assert attention_for("cpu") == NAME  # flash-attn is CUDA's alone
    flash_installed(False)
    assert attention_for("cuda") == NAME
