"""Per-token log-probs of completions under the current policy (the trainer's side of the ratio
that PPO-style losses clip, StreamRL §4.1's trainer), without a ``[batch, seq, vocab]`` tensor.

The decoder runs once over a micro-batch (``TokenBatch``: packed into one row, or padded rows);
the LM head then runs only at the positions that predict a completion token, a chunk of tokens
at a time (``head_logprobs``). Each chunk's logits live only while that chunk is scored: the
backward pass computes them again instead of keeping them. At Qwen2.5's 151,936-token vocabulary
and 8,192 completion tokens, one ``[seq, vocab]`` float32 tensor is 5 GB; here the head's memory
is one chunk of logits (``chunk_tokens x vocab``, about 256 MB by default), whatever the length.

Under FSDP2 the head's weight (and a tied embedding) belongs to the root module, whose
parameters are gathered only inside its forward: ``enable_sharded_forward`` makes
``completion_logprobs`` such a forward (``torch.distributed.fsdp.register_fsdp_forward_method``).
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

#: The logits one chunk of the head may hold (elements): ``chunk_tokens = this // vocab``.
CHUNK_ELEMENTS = 64 * 1024 * 1024
#: The method name under which a sharded policy's log-prob forward is registered with FSDP.
_SHARDED_FORWARD = "streamrl_completion_logprobs"


@dataclass
class TokenBatch:
    """What one forward pass of the trainer reads, and which tokens it scores.

    Attributes:
        input_ids: ``[rows, seq]``: one packed row (samples end to end) or padded rows.
        position_ids: ``[rows, seq]``, restarting at 0 at each sample of a packed row (the
            attention implementation keeps the samples apart by them); ``None`` when padded.
        attention_mask: ``[rows, seq]``, 1 on real tokens of padded rows; ``None`` when packed.
        rows: ``[tokens]``, the row of the position that predicts each scored token.
        cols: ``[tokens]``, that position's column (the token before the scored one).
        targets: ``[tokens]``, the scored (completion) token ids.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor | None
    attention_mask: torch.Tensor | None
    rows: torch.Tensor
    cols: torch.Tensor
    targets: torch.Tensor


class TokenLogprobs(NamedTuple):
    """``logprobs``: ``[tokens]`` float32, with grad; ``entropy``: ``[tokens]`` of the tempered
    distribution at each scored position (no grad), or ``None`` when not asked for."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None


def completion_logprobs(
    model: torch.nn.Module,
    tokens: TokenBatch,
    temperature: float = 1.0,
    *,
    chunk_tokens: int | None = None,
    entropy: bool = False,
) -> TokenLogprobs:
    """Log-probs of ``tokens.targets`` under ``softmax(logits / temperature)``.

    Args:
        model: a Hugging Face causal LM (or a ``peft`` model wrapping one), sharded or not.
        tokens: the micro-batch (``streamrl.components.training.layout`` builds it).
        temperature: the generators' sampling temperature.
        chunk_tokens: scored tokens per chunk of the head; ``None``: ``CHUNK_ELEMENTS // vocab``.
        entropy: also return each position's entropy (a metric: no gradient flows through it).

    Returns:
        ``TokenLogprobs``, one value per scored token, in ``tokens.targets``' order.
    """
    sharded_forward = getattr(model, _SHARDED_FORWARD, None)
    if sharded_forward is not None:  # FSDP2: gathers the root's parameters around the call
        return sharded_forward(tokens, temperature, chunk_tokens, entropy)
    return _completion_logprobs(model, tokens, temperature, chunk_tokens, entropy)


def enable_sharded_forward(model: torch.nn.Module) -> None:
    """Make ``completion_logprobs(model, ...)`` a forward of the FSDP2 root ``model``: its own
    parameters (embeddings, final norm, LM head) are gathered for the call, as for ``forward``.

    Call it after ``fully_shard(model)``; on a module FSDP does not manage it changes nothing.
    """
    from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

    if not isinstance(model, FSDPModule):
        return
    setattr(model, _SHARDED_FORWARD, types.MethodType(_completion_logprobs, model))
    register_fsdp_forward_method(model, _SHARDED_FORWARD)


def _completion_logprobs(
    model: torch.nn.Module,
    tokens: TokenBatch,
    temperature: float,
    chunk_tokens: int | None,
    entropy: bool,
) -> TokenLogprobs:
    lm = causal_lm(model)
    head = output_head(lm)
    hidden = lm.get_decoder()(
        input_ids=tokens.input_ids,
        attention_mask=tokens.attention_mask,
        position_ids=tokens.position_ids,
        use_cache=False,
    ).last_hidden_state  # [rows, seq, hidden]
    picked = hidden[tokens.rows, tokens.cols]  # [tokens, hidden]
    return head_logprobs(
        picked, head.weight, head.bias, tokens.targets, temperature, chunk_tokens, entropy
    )


def causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face causal LM inside ``model`` (a ``peft`` model wraps one; its adapters
    are injected into the LM's own layers, so calling the LM applies them)."""
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model


def output_head(lm: torch.nn.Module) -> torch.nn.Linear:
    """The LM head as a plain linear layer; ``ValueError`` for heads the chunked path would
    compute wrongly (logit soft-capping or scaling after the head, an adapter on the head)."""
    config = getattr(lm, "config", None)
    for transform in ("final_logit_softcapping", "logit_scale"):
        if getattr(config, transform, None) not in (None, 1, 1.0):
            raise ValueError(
                f"{type(lm).__name__} applies {transform}={getattr(config, transform)} after "
                "its LM head, which streamrl's chunked log-probs do not model yet; use a model "
                "whose logits are the head's output (Qwen2, Llama, Mistral...)."
            )
    head = lm.get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        raise ValueError(
            f"{type(lm).__name__}'s output embedding is a {type(head).__name__}, not a plain "
            "Linear (an adapter on lm_head?): streamrl computes the head chunk by chunk from "
            "its weight. Leave lm_head out of LoRA's target modules."
        )
    return head


def default_chunk_tokens(vocab: int) -> int:
    """Scored tokens per chunk of the head: ``CHUNK_ELEMENTS`` logits (at least 16 tokens)."""
    return max(16, CHUNK_ELEMENTS // max(1, vocab))


def head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
    entropy: bool = False,
) -> TokenLogprobs:
    """``log_softmax(hidden @ weight.T + bias) / temperature)[targets]``, chunk by chunk.

    Args:
        hidden: ``[tokens, hidden]``, the final hidden states at the predicting positions.
        weight: ``[vocab, hidden]``, the LM head's weight.
        bias: ``[vocab]`` or ``None``.
        targets: ``[tokens]``, the token ids to score.
        temperature: logits are divided by it.
        chunk_tokens: tokens per chunk (``default_chunk_tokens(vocab)`` when ``None``).
        entropy: also compute each position's entropy (no grad).

    Returns:
        ``TokenLogprobs`` (float32).
    """
    chunk = chunk_tokens or default_chunk_tokens(weight.shape[0])
    logprobs, ent = _ChunkedHead.apply(hidden, weight, bias, targets, temperature, chunk, entropy)
    return TokenLogprobs(logprobs, ent if entropy else None)


class _ChunkedHead(torch.autograd.Function):
    """The head and its log-softmax, chunk by chunk; the backward recomputes each chunk.

    For a scored token with logits ``z`` (tempered ``z / T``) and target ``y``,
    ``d logp_y / d z = (onehot(y) - softmax(z / T)) / T``; the per-token log-sum-exp is the only
    thing kept from the forward (``[tokens]`` floats).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk, with_entropy):
        n = hidden.shape[0]
        logprobs = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(logprobs)
        entropy = torch.empty_like(logprobs) if with_entropy else logprobs.new_empty(0)
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            logits = _tempered_logits(hidden[s:e], weight, bias, temperature)  # [chunk, vocab]
            lse[s:e] = torch.logsumexp(logits, dim=-1)
            logprobs[s:e] = logits.gather(1, targets[s:e, None]).squeeze(1) - lse[s:e]
            if with_entropy:  # H = lse - sum(p * z)
                probs = (logits - lse[s:e, None]).exp_()
                entropy[s:e] = lse[s:e] - (probs * logits).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        del grad_entropy  # a metric: nothing flows through it
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        temperature, chunk = ctx.temperature, ctx.chunk
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        # Accumulated over chunks in float32, cast once (a bf16 sum would round per chunk); only
        # when the head trains: a frozen one (a LoRA base) would hold vocab x hidden floats for
        # nothing (0.9 GB at Qwen2.5-1.5B's shape).
        f32 = dict(dtype=torch.float32, device=weight.device)
        grad_weight = torch.zeros(weight.shape, **f32) if need_weight else None
        grad_bias = torch.zeros(weight.shape[0], **f32) if need_bias else None
        for s in range(0, hidden.shape[0], chunk):
            e = min(hidden.shape[0], s + chunk)
            go = grad_logprobs[s:e, None].float()  # [chunk, 1]
            logits = _tempered_logits(hidden[s:e], weight, bias, temperature)
            grad = logits.sub_(lse[s:e, None]).exp_().mul_(-go)  # -softmax x upstream grad
            grad.scatter_add_(1, targets[s:e, None], go)  # + onehot(target) x upstream grad
            if temperature != 1.0:
                grad.div_(temperature)  # [chunk, vocab] float32: d loss / d raw logits
            if need_weight:  # in place: no [vocab, hidden] temporary per chunk
                grad_weight.addmm_(grad.t(), hidden[s:e].float())
            if need_bias and bias is not None:
                grad_bias += grad.sum(0)
            if need_hidden:
                grad_hidden[s:e] = grad.to(hidden.dtype) @ weight
        return (
            grad_hidden,
            grad_weight.to(weight.dtype) if need_weight else None,
            grad_bias.to(bias.dtype) if need_bias and bias is not None else None,
            None,
            None,
            None,
            None,
        )


def _tempered_logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float
) -> torch.Tensor:
    logits = F.linear(hidden, weight, bias).float()  # [chunk, vocab]
    return logits.div_(temperature) if temperature != 1.0 else logits
