"""A tool task whose answers need the tool: products of two 3-digit numbers with a calculator.

A ~1M-parameter policy cannot multiply 3-digit numbers in its head, so the reward measures how
well it learned to *use* the tool: copy the two factors into a ``multiply`` call, then copy the
result into its answer. Every row's numbers are drawn from a seed, so nothing can be memorised.

Examples:
    >>> rows = calculator_rows(2, seed=0)
    >>> rows[0]["prompt"], rows[0]["answer"] == str(rows[0]["a"] * rows[0]["b"])
    ('What is 964 * 494?', True)
    >>> env = CalculatorEnv()
    >>> _ = env.reset(rows[0])
    >>> env.step(format_call("multiply", {"a": 964, "b": 494})).observation
    '476216'
    >>> env.step("476216").reward, env.step("476217").reward
    (1.0, 0.8333333333333334)
"""

from __future__ import annotations

import random
from collections.abc import Mapping

from streamrl.envs.tools import ToolEnvironment, format_call
from streamrl.tasks.rewards import partial_credit


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor.
        b: the second factor.
    """
    return int(a) * int(b)


class CalculatorEnv(ToolEnvironment):
    """The calculator task's environment: the ``multiply`` tool; the answer gets partial credit
    (the share of digits right, ``partial_credit``), so a reward of 1 is an exact answer."""

    def __init__(self, tool_timeout_s: float = 5.0) -> None:
        super().__init__([multiply], reward=partial_credit, tool_timeout_s=tool_timeout_s)


def calculator_rows(n: int, seed: int = 0, prefix: str = "calc") -> list[dict]:
    """``n`` rows ``{prompt_id, prompt, answer, a, b}`` with seeded 3-digit factors."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        rows.append(
            {
                "prompt_id": f"{prefix}-{seed}-{i}",
                "prompt": f"What is {a} * {b}?",
                "answer": str(a * b),
                "a": a,
                "b": b,
            }
        )
    return rows


def calculator_demonstration(row: Mapping) -> list[str]:
    """The model turns of a perfect episode: the call, then the answer (for SFT)."""
    return [format_call("multiply", {"a": row["a"], "b": row["b"]}), row["answer"]]
