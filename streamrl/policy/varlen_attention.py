"""Packed micro-batches attend sample by sample, through variable-length attention PyTorch provides.

A packed micro-batch lays its samples end to end in one row (``streamrl.components.training.
layout``), ``position_ids`` restarting at each sample. Under SDPA or eager attention Hugging Face
keeps the samples apart with a dense block-diagonal mask, ``tokens x tokens``: the micro-batch's
square, when its samples only need the sum of theirs. This attention reads where each sample
starts from ``position_ids`` and attends causally within each, building no mask:

- on CUDA it views the row's queries, keys and values as a nested (jagged) tensor of its
  samples (``torch.nested.nested_tensor_from_jagged``) and runs ``scaled_dot_product_attention``
  on it: PyTorch's variable-length flash or memory-efficient kernels (``cu_seqlens``);
- on the CPU, where PyTorch's jagged attention has only its math backend and that refuses
  ``is_causal`` ("Nested tensors for query / key are not supported when is_causal=True"), it
  runs ``scaled_dot_product_attention`` on each sample's slice of the row, as that backend would
  sample by sample.

With ``flash-attn`` installed on CUDA, Hugging Face's own ``flash_attention_2`` does the same
(``attention_for``).

``register()`` adds it to transformers' attention and mask registries as ``"streamrl_varlen"``;
a model built with ``attn_implementation="streamrl_varlen"`` uses it in every layer. Anything
else such a model is given (padded rows with their attention mask: a critic's pass, a
generate call) goes to transformers' own SDPA attention and mask, unchanged.

Examples:
    >>> import torch
    >>> q = torch.randn(1, 2, 5, 4)  # [batch, heads, tokens, head_dim]: samples of 3 and 2
    >>> out, _ = varlen_attention(None, q, q, q, None, position_ids=torch.tensor([[0, 1, 2, 0, 1]]))
    >>> out.shape  # [batch, tokens, heads, head_dim], as transformers' attention functions give
    torch.Size([1, 5, 2, 4])
"""

from __future__ import annotations

import importlib.util
import itertools
from typing import Any

import torch
import torch.nn.functional as F

#: The name models are built with (``attn_implementation``).
NAME = "streamrl_varlen"


def register() -> str:
    """Register ``varlen_attention`` (and no mask: it needs none) with transformers; returns
    its name. Idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, varlen_attention)
    AttentionMaskInterface.register(NAME, _no_mask)
    return NAME


def attention_for(device_type: str) -> str:
    """The attention a trainer's packed micro-batches take on ``device_type``:
    ``flash_attention_2`` on CUDA with ``flash-attn`` installed, else ``streamrl_varlen``
    (registered here)."""
    if device_type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return register()


def varlen_attention(
    module: torch.nn.Module | None,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention within each sample of one packed row.

    Args:
        module: the attention layer (unused; transformers passes it).
        query: ``[1, heads, tokens, head_dim]``.
        key / value: ``[1, kv_heads, tokens, head_dim]`` (grouped-query attention: heads is a
            multiple of kv_heads).
        attention_mask: must be ``None`` (the samples are kept apart by ``position_ids``).
        scaling: the softmax scale (``None``: ``1 / sqrt(head_dim)``).
        dropout: attention dropout (0 in training here).
        kwargs: ``position_ids`` (``[1, tokens]``, 0 where each sample starts), required.

    Returns:
        ``([1, tokens, heads, head_dim], None)``, as transformers' attention functions return.

    Several rows, a mask, or no ``position_ids`` (not a packed row) go to transformers' SDPA
    attention as they are.
    """
    position_ids = kwargs.get("position_ids")
    if query.shape[0] != 1 or attention_mask is not None or position_ids is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    tokens, heads = query.shape[2], query.shape[1]
    starts = torch.nonzero(position_ids[0] == 0).flatten()
    offsets = torch.cat([starts, starts.new_tensor([tokens])])
    if key.shape[1] != heads:  # grouped-query attention: each K/V head serves a group
        key = key.repeat_interleave(heads // key.shape[1], dim=1)
        value = value.repeat_interleave(heads // value.shape[1], dim=1)

    options = dict(dropout_p=dropout, is_causal=True, scale=scaling)
    if query.device.type != "cuda":  # sample by sample (module docstring)
        out = torch.cat(
            [
                F.scaled_dot_product_attention(
                    query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], **options
                )
                for a, b in itertools.pairwise(offsets.tolist())
            ],
            dim=2,
        )  # [1, heads, tokens, d]
        return out.transpose(1, 2), None

    def jagged(t: torch.Tensor) -> torch.Tensor:  # [1, heads, tokens, d] -> [samples, heads, j, d]
        values = t[0].transpose(0, 1)  # [tokens, heads, d]
        return torch.nested.nested_tensor_from_jagged(values, offsets).transpose(1, 2)

    out = F.scaled_dot_product_attention(jagged(query), jagged(key), jagged(value), **options)
    return out.transpose(1, 2).values().unsqueeze(0), None  # [1, tokens, heads, d]


def _no_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """The mask ``varlen_attention`` takes for a packed row: none (it reads where samples start);
    for padded rows, transformers' SDPA mask."""
    if kwargs.get("attention_mask") is None and kwargs.get("batch_size", 1) == 1:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **kwargs)
