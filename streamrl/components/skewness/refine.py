"""A dispatch plan balanced in seconds, not tokens (issue 47; beyond StreamRL §5.3).

Algorithm 2 and LPT over instances balance *predicted tokens*. That is balancing time only when
a decode step costs the same whatever its rows hold. On the HF engine a step pays for its widest
row and a prefill pads its rows to the widest prompt, so two instances given the same tokens
can finish a second apart (on the bench's bimodal batch: 5.18 s and 6.21 s measured, each run
alone; the latency model's replay said 5.25 s and 6.25 s). ``refine_plan`` takes a plan and moves
whole units (a prompt's samples, or one request) from the instance the latency model replays
slowest to the one it replays fastest, while that shortens the slower of the two by
``MIN_GAIN``; each candidate is priced by replaying both instances
(``batching.simulate_instance``: batch size, contexts, prefills), a fraction of a millisecond
each.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from streamrl.records import Request

#: Units weighed per move: those whose predicted tokens are nearest half the gap.
CANDIDATES = 6
#: Moves per plan at most.
ROUNDS = 16
#: A move must shorten the slower instance by this share at least (planning is not free: on
#: the bench's 512 requests a replay of one instance costs about half a millisecond).
MIN_GAIN = 0.005


def refine_plan(
    parts: Sequence[list[Request]],
    replay: Callable[[int, list[Request]], float],
    *,
    together: bool = True,
    rounds: int = ROUNDS,
) -> list[list[Request]]:
    """``parts`` with units moved from the slowest instance to the fastest while the slower of
    the two finishes sooner (each move priced by ``replay``).

    Args:
        parts: each instance's requests (their ``predicted_length`` set).
        replay: predicted seconds for instance ``i`` to finish ``requests``.
        together: a prompt's samples of one iteration move together (``False``: one by one).
        rounds: moves at most.
    """
    parts = [list(part) for part in parts]
    if len(parts) < 2:
        return parts
    times = [replay(i, part) for i, part in enumerate(parts)]
    for _ in range(rounds):
        slow = max(range(len(parts)), key=times.__getitem__)
        fast = min(range(len(parts)), key=times.__getitem__)
        best = None
        for unit in _candidates(parts[slow], times[slow], times[fast], together):
            keys = {r.key for r in unit}
            rest = [r for r in parts[slow] if r.key not in keys]
            after = (replay(slow, rest), replay(fast, parts[fast] + unit))
            if max(after) < times[slow] * (1 - MIN_GAIN) and (best is None or max(after) < best[0]):
                best = (max(after), after, rest, unit)
        if best is None:
            break
        _, (times[slow], times[fast]), parts[slow], unit = best
        parts[fast] = parts[fast] + unit
    return parts


def _candidates(
    part: list[Request], slow_s: float, fast_s: float, together: bool
) -> list[list[Request]]:
    """The units of ``part`` whose predicted tokens are nearest what would even the two
    instances out (half the gap, as a share of the slow one's tokens)."""
    units: dict[object, list[Request]] = {}
    for r in part:
        units.setdefault((r.prompt_id, r.iteration) if together else r.key, []).append(r)
    tokens = {key: sum(r.predicted_length or 0.0 for r in unit) for key, unit in units.items()}
    total = sum(tokens.values())
    target = total * (slow_s - fast_s) / (2 * slow_s) if slow_s > 0 else 0.0
    nearest = sorted(units, key=lambda key: abs(tokens[key] - target))[:CANDIDATES]
    return [units[key] for key in nearest]
