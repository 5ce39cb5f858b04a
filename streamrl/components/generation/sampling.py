"""Sampling in every stream generator (StreamRL §3): the temperature it checks at construction,
and the log-probs it samples from and reports; for ``HFStreamGenerator``, the tokens it draws
from them and the seed of its random stream under each weight version."""

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


def draw_tokens(
    logp: torch.Tensor, *, greedy: bool | list[bool], rng: torch.Generator
) -> tuple[list[int], list[float]]:
    """One token per row of ``logp`` (``[batch, vocab]``, from ``token_log_probs``), and its
    log-prob: the argmax when ``greedy`` (a bool for every row, or one per row), else a draw
    from ``rng`` (only the sampled rows draw: greedy rows take none of its random stream)."""
    greedy_rows = [greedy] * logp.shape[0] if isinstance(greedy, bool) else list(greedy)
    tokens = logp.argmax(dim=-1)  # [batch]
    sampled = [i for i, g in enumerate(greedy_rows) if not g]
    if sampled:
        rows = torch.tensor(sampled, device=logp.device)
        draws = torch.multinomial(logp[rows].exp(), 1, generator=rng).squeeze(1)
        tokens = tokens.index_copy(0, rows, draws)
    chosen = logp.gather(1, tokens[:, None]).squeeze(1)
    return tokens.tolist(), chosen.tolist()


def version_seed(seed: int, version: int) -> int:
    """The sampling seed of weight ``version`` (distinct across versions and instance seeds):
    reseeding with it when a version loads makes what a version samples independent of what
    earlier versions sampled, so a resumed run samples as the uninterrupted one."""
    return seed * 1_000_003 + version
