"""A reward called in the trainer's own process, under the reward pool's ``timeout_s``: the held-out
evaluation scores its completions here (StreamRL's reward stage, §3), and a reward that never
returns must stop the run with its name and the prompts, not hang it before RL starts.

A thread cannot be killed, so a call past its deadline is left behind (a daemon thread) and the
caller gets ``RewardError``; the reward workers of the RL stage are processes and are killed
(``RewardPool``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from streamrl.errors import RewardError

__all__ = ["with_deadline"]

Score = Callable[[Sequence[str], Sequence[dict]], list[float]]


def with_deadline(score: Score, timeout_s: float, batch: int = 16) -> Score:
    """``score`` on ``batch`` completions at a time, each batch given ``timeout_s``.

    Raises (from the returned function):
        RewardError: a batch did not return within ``timeout_s``; the message names its
            prompts and the setting to change.
    """
    if timeout_s <= 0 or batch < 1:
        raise ValueError(
            f"with_deadline: need timeout_s > 0 and batch >= 1, got {timeout_s}, {batch}."
        )

    def scored(completions: Sequence[str], rows: Sequence[dict]) -> list[float]:
        completions, rows = list(completions), list(rows)
        values: list[float] = []
        for start in range(0, len(rows), batch):
            part = slice(start, start + batch)
            values += _call(score, completions[part], rows[part], timeout_s)
        return values

    return scored


def _call(score: Score, completions: list[str], rows: list[dict], timeout_s: float) -> list[float]:
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            outcome["values"] = score(completions, rows)
        except BaseException as err:  # raised in the caller's thread below
            outcome["error"] = err

    thread = threading.Thread(target=run, daemon=True, name="reward-with-deadline")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        prompts = [str(r.get("prompt_id")) for r in rows]
        raise RewardError(
            f"A reward did not return within {timeout_s:g} s (rl.reward_pool's timeout_s) on "
            f"held-out prompt(s) {prompts}; fix the reward, or raise that timeout_s if it is slow."
        )
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["values"]  # type: ignore[return-value]
