"""A micro-batch as the tensors one forward pass of the trainer takes.

Two layouts of the same samples, giving each sample the same log-probs:

- **packed** (the default): every ``prompt + completion`` end to end in one row, no padding;
  ``position_ids`` restart at each sample, and the attention implementation keeps the samples
  apart by them (Hugging Face's packed-sequence masks: a block-diagonal causal mask for SDPA
  and eager attention, variable-length kernels for flash-attention). Its linear layers cost
  its real tokens; under SDPA or eager attention its attention costs their square (the mask is
  dense), so keep the token ceiling small there (``docs/pipeline.md`` measures it).
- **padded**: one right-padded row per sample with an attention mask; costs rows x longest.

Per-token tensors of the loss (mask, behaviour log-probs, weight versions) are
``[batch, width]``, as ``Algorithm.loss`` reads them; ``TrainBatch.per_sample`` lays the scored
tokens' values out the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from streamrl.policy.logprobs import TokenBatch
from streamrl.records import Sample

Layout = Literal["packed", "padded"]
LAYOUTS: tuple[str, ...] = ("packed", "padded")


def layout_for(model: torch.nn.Module) -> Layout:
    """The faster layout for ``model``'s attention implementation: ``"packed"`` under a
    variable-length attention that attends within each sample (flash-attention, or
    ``streamrl.policy.varlen_attention``: SDPA on a jagged tensor of the samples), ``"padded"``
    under SDPA or eager attention, where a packed row's dense block-diagonal mask costs the
    square of the micro-batch's tokens (measured on the CPU: a 941-token micro-batch of 16
    short samples trained 1.6x slower packed than padded; ``streamrl bench packing``)."""
    implementation = str(getattr(getattr(model, "config", None), "_attn_implementation", ""))
    return "packed" if "flash" in implementation or "varlen" in implementation else "padded"


@dataclass
class PaddedRows:
    """Padded rows of a micro-batch, for hooks that run their own forward pass (a critic).

    Attributes:
        input_ids: ``[batch, seq]``, each row ``prompt + completion + padding``.
        attention: ``[batch, seq]``, 1 on real tokens.
        starts: ``[batch]``, where each row's completion starts.
    """

    input_ids: torch.Tensor
    attention: torch.Tensor
    starts: torch.Tensor


@dataclass
class TrainBatch:
    """One micro-batch: the forward pass's input and the loss's per-token tensors.

    Attributes:
        samples: the micro-batch's samples, in row order.
        tokens: what the policy's forward pass reads and which tokens it scores: every
            completion token of every sample, sample by sample.
        sample_index: ``[tokens]``, the sample of each scored token.
        position: ``[tokens]``, its position in that sample's completion.
        mask: ``[batch, width]``, 1 on the completion tokens trained on (``width``: the
            longest completion): not padding, and not an episode's environment tokens.
        behaviour: ``[batch, width]``, the generators' log-probs of the completion tokens.
        versions: ``[batch, width]``, the weight version of each completion token.
        experts: a mixture of experts' recorded choices, ``[input tokens, layers, k]`` in the
            order of the forward's flattened input (``routed_experts``), for the trainer to
            replay; ``None`` when no sample carries them.
    """

    samples: list[Sample]
    tokens: TokenBatch
    sample_index: torch.Tensor
    position: torch.Tensor
    mask: torch.Tensor
    behaviour: torch.Tensor
    versions: torch.Tensor
    experts: torch.Tensor | None = None

    @property
    def width(self) -> int:
        """Completion positions (the longest completion)."""
        return self.mask.shape[1]

    def per_sample(self, values: torch.Tensor) -> torch.Tensor:
        """``[tokens]`` values of the scored tokens as ``[batch, width]`` (0 past each
        completion's end); differentiable."""
        out = values.new_zeros(len(self.samples), self.width)
        return out.index_put((self.sample_index, self.position), values)

    def padded(self, pad_token_id: int) -> PaddedRows:
        """The same samples as padded rows (for an algorithm's critic, ``token_values``)."""
        rows, attention, starts = _padded_rows(self.samples, pad_token_id)
        device = self.mask.device
        return PaddedRows(
            torch.tensor(rows, device=device),
            torch.tensor(attention, device=device),
            torch.tensor(starts, device=device),
        )


def sample_tokens(sample: Sample) -> int:
    """Tokens a sample puts through the forward pass: its prompt and completion."""
    return len(sample.prompt_ids) + sample.length


def layout_batch(
    samples: list[Sample], layout: Layout, pad_token_id: int, device: torch.device
) -> TrainBatch:
    """``samples`` as one packed row or as padded rows, on ``device``.

    Examples:
        >>> a = Sample("a", 0, prompt_ids=[5, 6], token_ids=[7], logprobs=[-0.5],
        ...            weight_version=0, instance_id=0)
        >>> s = [a, Sample("b", 0, [5], [8, 9], [-1.0, -2.0], 0, 0)]
        >>> b = layout_batch(s, "packed", pad_token_id=0, device=torch.device("cpu"))
        >>> b.tokens.input_ids.tolist(), b.tokens.position_ids.tolist()
        ([[5, 6, 7, 5, 8, 9]], [[0, 1, 2, 0, 1, 2]])
        >>> b.tokens.cols.tolist(), b.tokens.targets.tolist(), b.mask.tolist()
        ([1, 3, 4], [7, 8, 9], [[1, 0], [1, 1]])
        >>> layout_batch(s, "padded", 0, torch.device("cpu")).tokens.input_ids.tolist()
        [[5, 6, 7], [5, 8, 9]]
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}.")
    rows, cols, targets, sample_index, position = [], [], [], [], []
    offset = 0
    for i, s in enumerate(samples):
        start = len(s.prompt_ids)
        base = offset if layout == "packed" else 0
        rows += [0 if layout == "packed" else i] * s.length
        # The token at completion position j is predicted at position start + j - 1.
        cols += range(base + start - 1, base + start - 1 + s.length)
        targets += s.token_ids
        sample_index += [i] * s.length
        position += range(s.length)
        offset += sample_tokens(s)

    def tensor(values: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    if layout == "packed":
        ids = [t for s in samples for t in (*s.prompt_ids, *s.token_ids)]
        positions = [p for s in samples for p in range(sample_tokens(s))]
        input_ids, position_ids, attention = tensor([ids]), tensor([positions]), None
    else:
        padded, mask, _ = _padded_rows(samples, pad_token_id)
        input_ids, position_ids, attention = tensor(padded), None, tensor(mask)
    width = max(s.length for s in samples)

    def per_token(values: list[list], fill: float | int, dtype: torch.dtype) -> torch.Tensor:
        return tensor([v + [fill] * (width - len(v)) for v in values], dtype)

    return TrainBatch(
        samples=samples,
        tokens=TokenBatch(
            input_ids, position_ids, attention, tensor(rows), tensor(cols), tensor(targets)
        ),
        sample_index=tensor(sample_index),
        position=tensor(position),
        mask=per_token([s.loss_mask or [1] * s.length for s in samples], 0, torch.long),
        behaviour=per_token([s.logprobs for s in samples], 0.0, torch.float32),
        versions=per_token(
            [s.token_versions or [s.weight_version] * s.length for s in samples], 0, torch.long
        ),
        experts=routed_experts(samples, layout, device),
    )


def routed_experts(
    samples: list[Sample], layout: Layout, device: torch.device
) -> torch.Tensor | None:
    """The samples' recorded experts laid out as their tokens are (``layout_batch``):
    ``[input tokens, layers, k]``, ``-1`` for a token not recorded (padding; a sample without
    them, or whose record does not cover its tokens); ``None`` when none has any."""
    recorded = [s.routed_experts for s in samples if s.routed_experts is not None]
    if not recorded:
        return None
    per_token = recorded[0].shape[1:]
    width = max(sample_tokens(s) for s in samples) if layout == "padded" else 0
    blocks = []
    for s in samples:
        tokens = max(sample_tokens(s), width)
        block = np.full((tokens, *per_token), -1, dtype=np.int16)
        if s.routed_experts is not None and s.routed_experts.shape[0] == sample_tokens(s):
            block[: sample_tokens(s)] = s.routed_experts
        blocks.append(block)
    return torch.from_numpy(np.concatenate(blocks)).to(device)


def _padded_rows(
    samples: list[Sample], pad_token_id: int
) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """Right-padded ``prompt + completion`` rows, their attention masks and completion starts."""
    seq = max(sample_tokens(s) for s in samples)
    rows = [
        [*s.prompt_ids, *s.token_ids] + [pad_token_id] * (seq - sample_tokens(s)) for s in samples
    ]
    attention = [[1] * sample_tokens(s) + [0] * (seq - sample_tokens(s)) for s in samples]
    return rows, attention, [len(s.prompt_ids) for s in samples]
