"""The sampling settings every stream generator checks at construction (StreamRL §3)."""

from __future__ import annotations


def sampling_temperature(temperature: float, greedy: bool) -> float:
    """The softmax temperature a generator samples at: ``temperature``, or 1 when ``greedy``
    (then it takes the argmax, and log-probs are of the untempered distribution).

    Raises:
        ValueError: ``temperature`` is not above 0 and ``greedy`` is False.
    """
    if not greedy and temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}; or pass greedy=True.")
    return 1.0 if greedy else float(temperature)
