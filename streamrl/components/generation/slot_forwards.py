"""The model's forward passes over a ``SlotCache``, one cache row per batch slot (StreamRL §5).

Continuous batching runs rows of different lengths in one forward: each row's tokens sit
left-aligned in its cache row, a per-row attention mask hides the columns it does not use, and
explicit position ids give each row its own positions. ``SlotForwards`` builds those inputs for
the four forwards ``HFStreamGenerator`` runs: a batched prefill from column 0, a prefill after an
episode's kept prefix, a decode of one token per row, and the verification of speculative
drafts (``verification.verify_batch``). Which rows run, and what they hold, is the generator's.

Examples:
    >>> from streamrl.policy.models import build_tokenizer, build_tiny_model
    >>> model = build_tiny_model(build_tokenizer(), size="test").eval()
    >>> cache = SlotCache(model.config.num_hidden_layers, slots=2)
    >>> cache.reserve(8, limit=8)
    >>> forwards = SlotForwards(model, cache, pad_token_id=0)
    >>> with torch.inference_mode():
    ...     forwards.prefill(0, [[5, 6], [5, 6, 7]])
    ...     forwards.decode([2, 3], [7, 8]).shape == (2, model.config.vocab_size)
    True
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from streamrl.components.generation.kv_cache import SlotCache
from streamrl.components.generation.verification import verify_batch


class SlotForwards:
    """Runs ``model`` on rows of ``cache``, writing each row's new keys and values in place.

    Args:
        model: a causal LM in eval mode, with SDPA or eager attention (it is given 4D masks).
        cache: the cache the forwards read and write; its capacity is the caller's to grow.
        pad_token_id: filler id of padded input positions (their outputs are never read).
    """

    def __init__(self, model: PreTrainedModel, cache: SlotCache, pad_token_id: int) -> None:
        self.model, self.cache, self.pad_token_id = model, cache, pad_token_id

    def prefill(self, start: int, columns: list[list[int]]) -> None:
        """One batched forward that writes rows ``start, start + 1, ...`` of the cache from
        column 0 with ``columns`` (each row's tokens before its next input)."""
        width = max(map(len, columns), default=0)
        if width == 0:
            return
        dev = self.model.device
        ids = torch.full((len(columns), width), self.pad_token_id, dtype=torch.long)
        for i, tokens in enumerate(columns):
            ids[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        lengths = torch.tensor([len(t) for t in columns], device=dev)
        cols = torch.arange(width, device=dev)
        # Right-padded: a query sees earlier columns that hold prompt tokens. Padding queries also
        # see themselves so no row is fully masked (NaN in half precision); they are never read.
        causal = cols[None, :] <= cols[:, None]
        allowed = causal & (
            (cols < lengths[:, None])[:, None] | torch.eye(width, dtype=torch.bool, device=dev)
        )
        self.cache.prepare(slice(start, start + len(columns)), width)
        self._forward(ids.to(dev), cols.expand(len(columns), width), allowed)

    def prefill_after(self, row: int, tokens: list[int], offset: int) -> None:
        """Prefill ``tokens`` into row ``row`` at columns ``offset, offset + 1, ...``, after the
        columns ``[0, offset)`` it holds already (alone: its new tokens start at its own
        column)."""
        if not tokens:
            return
        dev = self.model.device
        end = offset + len(tokens)
        pos = torch.arange(offset, end, device=dev)[None]  # [1, new]
        allowed = torch.arange(end, device=dev)[None, None, :] <= pos[:, :, None]
        self.cache.prepare(slice(row, row + 1), end, write_pos=pos)
        self._forward(torch.tensor([tokens], device=dev), pos, allowed)

    def decode(self, lengths: list[int], next_inputs: list[int]) -> torch.Tensor:
        """One forward of each row's next input at its column ``lengths[i]`` (rows ``0, 1,
        ...``); the logits of each, ``[batch, vocab]``."""
        dev = self.model.device
        at = torch.tensor(lengths, device=dev)
        ids = torch.tensor([[t] for t in next_inputs], device=dev)
        kv_len = max(lengths) + 1
        allowed = (torch.arange(kv_len, device=dev)[None, :] <= at[:, None])[:, None]
        self.cache.prepare(slice(0, len(lengths)), kv_len, write_pos=at)
        return self._forward(ids, at[:, None], allowed)[:, -1]

    def verify(
        self, lengths: list[int], next_inputs: list[int], drafts: list[list[int]]
    ) -> torch.Tensor:
        """One forward over every row's next input and draft (``verify_batch``); the logits of
        every position, ``[batch, 1 + longest draft, vocab]``."""
        ids, positions, columns, allowed = verify_batch(
            lengths, next_inputs, drafts, pad_token_id=self.pad_token_id, device=self.model.device
        )
        self.cache.prepare(slice(0, len(lengths)), allowed.shape[-1], write_pos=columns)
        return self._forward(ids, positions, allowed, keep=0)

    def _forward(
        self, ids: torch.Tensor, pos: torch.Tensor, allowed: torch.Tensor, keep: int = 1
    ) -> torch.Tensor:
        """One model call on the prepared cache rows; ``allowed``: ``[batch, q, kv]`` bools;
        logits of the last ``keep`` positions (0: all)."""
        dtype = self.model.dtype
        # Additive float mask, as HF builds them: accepted by both SDPA and eager attention.
        mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        mask = mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]
        # The kept positions as indices, not a count: the head then reads a contiguous copy of
        # them. A strided slice of a [batch, seq, hidden] bfloat16 tensor sends the CPU's linear
        # to a batched matmul over the weight expanded per row (at a 151,936-token vocabulary
        # and hidden 1,536: a 1.9 GB copy and 11 s per prefill, against 0.05 s).
        width = ids.shape[1]
        kept = torch.arange(width - keep, width, device=ids.device) if 0 < keep < width else keep
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            cache=self.cache,
            use_cache=True,
            logits_to_keep=kept,
        )
        if self.cache.kv is None:
            raise RuntimeError("The model ignored the KV cache (HFStreamGenerator needs HF >= 5).")
        return out.logits
