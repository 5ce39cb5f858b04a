"""Sampling in every stream generator (StreamRL §3): the temperature it checks at construction,
and the log-probs it samples from and reports."""

from __future__ import annotations

import torch


def sampling_temperature(temperature: float, greedy: bool) -> float:
    """The softmax temperature a generator samples at: ``temperature``, or 1 when ``greedy``
    (then it takes the argmax, and log-probs are of the untempered distribution).

    Raises:
        ValueError: ``temperature`` is not above 0 and ``greedy`` is False.
    """
    if not greedy and temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}; or pass greedy=True.")
    return 1.0 if greedy else float(temperature)


def token_log_probs(
    logits: torch.Tensor, forced_rows: list[int], eos: list[int], temperature: float
) -> torch.Tensor:
    """The log-probs a generator samples from and reports: ``log_softmax(logits / temperature)``
    in float32, with EOS masked out of the rows of forced-length requests (they must neither
    stop nor emit an EOS mid-sequence).

    Args:
        logits: ``[batch, vocab]`` or ``[batch, positions, vocab]``.
        forced_rows: batch rows of forced-length requests.
        eos: the stop token ids.
        temperature: the softmax temperature (1 when greedy).
    """
    logits = logits.float()
    if forced_rows and eos:
        rows = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
        rows[forced_rows] = True
        tokens = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
        tokens[eos] = True
        shape = (-1,) + (1,) * (logits.dim() - 1)
        logits = logits.masked_fill(rows.view(shape) & tokens, float("-inf"))
    return torch.log_softmax(logits / temperature, dim=-1)
