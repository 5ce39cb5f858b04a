"""A micro-batch of samples as padded tensors, the shape every forward pass of the trainer takes.

Rows are ``prompt + completion``, right-padded; prompts may differ in length, so each row's
completion starts at its own column (``starts``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from streamrl.records import Sample


@dataclass
class PaddedBatch:
    """Tensors of one micro-batch.

    Attributes:
        input_ids: ``[batch, seq]``, each row ``prompt + completion + padding``.
        attention: ``[batch, seq]``, 1 on real tokens.
        starts: ``[batch]``, where each row's completion starts.
        mask: ``[batch, width]``, 1 on the completion tokens trained on (``width``: the
            longest): not padding, and not an episode's environment tokens (``loss_mask``).
        behaviour: ``[batch, width]``, the generators' log-probs of the completion tokens.
        versions: ``[batch, width]``, the weight version of each completion token
            (``token_versions``; an episode's turns may differ).
    """

    input_ids: torch.Tensor
    attention: torch.Tensor
    starts: torch.Tensor
    mask: torch.Tensor
    behaviour: torch.Tensor
    versions: torch.Tensor

    @property
    def width(self) -> int:
        """Completion positions (the longest completion)."""
        return self.mask.shape[1]


def pad_samples(samples: list[Sample], pad_token_id: int, device: torch.device) -> PaddedBatch:
    """Pad ``samples`` into a ``PaddedBatch`` on ``device``.

    Examples:
        >>> a = Sample("a", 0, prompt_ids=[5, 6], token_ids=[7], logprobs=[-0.5],
        ...            weight_version=0, instance_id=0)
        >>> s = [a, Sample("b", 0, [5], [8, 9], [-1.0, -2.0], 0, 0)]
        >>> b = pad_samples(s, pad_token_id=0, device=torch.device("cpu"))
        >>> b.input_ids.tolist(), b.starts.tolist(), b.mask.tolist()
        ([[5, 6, 7], [5, 8, 9]], [2, 1], [[1, 0], [1, 1]])
    """
    prompt_lens = [len(s.prompt_ids) for s in samples]
    width = max(s.length for s in samples)
    seq = max(p + s.length for p, s in zip(prompt_lens, samples))
    rows = [
        s.prompt_ids + s.token_ids + [pad_token_id] * (seq - p - s.length)
        for p, s in zip(prompt_lens, samples)
    ]
    lengths = torch.tensor([s.length for s in samples], device=device)
    total = torch.tensor(prompt_lens, device=device) + lengths

    def padded(values: list[list], fill: float | int) -> torch.Tensor:
        return torch.tensor([v + [fill] * (width - len(v)) for v in values], device=device)

    return PaddedBatch(
        input_ids=torch.tensor(rows, device=device),
        attention=(torch.arange(seq, device=device) < total[:, None]).long(),
        starts=torch.tensor(prompt_lens, device=device),
        mask=padded([s.loss_mask or [1] * s.length for s in samples], 0).long(),
        behaviour=padded([s.logprobs for s in samples], 0.0),
        versions=padded([s.token_versions or [s.weight_version] * s.length for s in samples], 0),
    )
