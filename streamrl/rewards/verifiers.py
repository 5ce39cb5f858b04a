"""Rule-based verifiers: rewards that check a completion's final answer against the reference.

``math_answer`` is the built-in ``math`` reward. It takes the completion's final answer (the
last ``\\boxed{...}``, else the last number) and asks math-verify
(https://github.com/huggingface/Math-Verify) whether it equals ``row["answer"]``, so ``1/2``,
``0.5`` and ``\\frac{1}{2}`` all count as the same answer.

math-verify bounds its own parse and compare steps with ``signal.alarm``, which only works in a
process's main thread; we switch that off (``parsing_timeout=None``, ``timeout_seconds=None``) so
the reward also runs in threads, and rely on the reward pool's per-call timeout instead.

Examples:
    >>> boxed_or_last_number(r"so x = \\boxed{\\frac{1}{2}}.")
    '\\\\frac{1}{2}'
    >>> math_answer(r"The answer is \\boxed{\\frac{1}{2}}", {"answer": "0.5"})
    1.0
    >>> math_answer("3 + 4 = 7, so she has 7 apples.", {"answer": "8"})
    0.0
"""

from __future__ import annotations

import functools
import logging
import re
from typing import Any

from streamrl.errors import ConfigError

_BOXED = re.compile(r"\\boxed\s*\{")
# A number as a model writes one: -12, 1,000, 3.5, .5, 3/4.
_NUMBER = re.compile(
    r"(?:(?<![\w.)\]}])-)?"  # a sign, but not the minus of "10-3" or "x-3"
    r"(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)"  # 12, 1,000, 3.5, .5
    r"(?:/\d+)?"  # 3/4
)


def boxed_or_last_number(text: str) -> str | None:
    """The final answer a completion states: its last ``\\boxed{...}``, else its last number.

    The boxed content is returned whole, nested braces included; a ``\\boxed{`` that never
    closes (a truncated completion) or an empty one does not count. A number loses its
    thousands separators.

    Args:
        text: the completion.

    Returns:
        The answer as a string, or ``None`` when the text has neither.

    Examples:
        >>> boxed_or_last_number(r"First \\boxed{1}, then \\boxed{\\frac{3}{4}}")
        '\\\\frac{3}{4}'
        >>> boxed_or_last_number("It costs 1,250 dollars, or -3/4 of 1000.")
        '1000'
        >>> boxed_or_last_number("x went from 2 to -3/4")
        '-3/4'
        >>> boxed_or_last_number("no answer here") is None
        True
    """
    for match in reversed(list(_BOXED.finditer(text))):
        content = _braced(text, match.end())
        if content is not None and content.strip():
            return content.strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def _braced(text: str, start: int) -> str | None:
    """The text from ``start`` up to the ``}`` that closes the ``{`` just before it, or ``None``
    when it never closes. ``\\{`` and ``\\}`` (a set's braces) do not count."""
    depth = 1
    i = start
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2  # skip the escaped character: \{ \} \\ or a command's first letter
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
        i += 1
    return None


def math_answer(completion: str, row: dict) -> float:
    """1.0 when the completion's final answer equals ``row["answer"]`` mathematically, else 0.0.

    The final answer is ``boxed_or_last_number(completion)``; a boxed answer is parsed as LaTeX
    (``\\frac{1}{2}``, ``\\sqrt{2}``, sets, intervals), a bare number as an expression. A
    completion with no answer, or one that does not parse, scores 0.0: garbage never raises.

    Args:
        completion: the model's completion.
        row: the prompt's dataset row; ``row["answer"]`` is the reference (``"1/2"``, ``"0.5"``,
            ``"\\frac12"``, ``"42"``, or LaTeX with ``$...$`` or ``\\boxed{}``).

    Returns:
        1.0 or 0.0.

    Raises:
        ConfigError: the row has no ``answer``, or math-verify is not installed.

    Examples:
        >>> math_answer(r"... so \\boxed{\\frac{1}{2}}", {"answer": "0.5"})
        1.0
        >>> math_answer("Subtracting, 10-3 = 7.", {"answer": "7"})
        1.0
        >>> math_answer("I think it is 6", {"answer": "7"})
        0.0
    """
    gold = _parse_gold(_reference(row))
    answer = boxed_or_last_number(completion) if isinstance(completion, str) else None
    if not gold or answer is None:
        return 0.0
    if _NUMBER.fullmatch(answer):
        pred = _parse(answer, latex=False)
    else:
        pred = _parse(_as_latex(answer), latex=True)
    if not pred:
        return 0.0
    mv = _math_verify()
    # Gold first: math-verify's comparison is not symmetric (equations, intervals).
    return 1.0 if mv.verify(list(gold), pred, timeout_seconds=None) else 0.0


def _reference(row: dict) -> str:
    answer = row.get("answer") if isinstance(row, dict) else None
    if answer is None:
        raise ConfigError(
            "math_answer needs the reference answer in row['answer'], got a row with keys "
            f"{sorted(row) if isinstance(row, dict) else type(row).__name__}; give the dataset "
            "an 'answer' column (a number or LaTeX)."
        )
    return str(answer)


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str) -> tuple[Any, ...]:
    """The reference parsed once per distinct answer (a group's completions share it)."""
    return tuple(_parse(_as_latex(gold), latex=True))


def _as_latex(text: str) -> str:
    """``text`` in math delimiters unless it already has some, so math-verify's LaTeX
    extraction finds it: ``1/2`` -> ``$1/2$``; ``\\boxed{x}`` and ``$x$`` stay as they are."""
    text = text.strip()
    if "$" in text or "\\boxed" in text or "\\(" in text or "\\[" in text:
        return text
    return f"${text}$"


def _parse(text: str, *, latex: bool) -> list[Any]:
    mv = _math_verify()
    if latex:
        configs = [mv.LatexExtractionConfig(), mv.ExprExtractionConfig()]
    else:
        configs = [mv.ExprExtractionConfig()]
    return mv.parse(text, extraction_config=configs, parsing_timeout=None)


def _math_verify() -> Any:
    try:
        import math_verify
    except ImportError as err:
        raise ConfigError(
            "The 'math' reward needs math-verify: pip install 'math-verify>=0.9'."
        ) from err
    for name in ("math_verify.grader", "math_verify.parser"):  # its other warnings still show
        logging.getLogger(name).addFilter(_our_timeout_notice)
    return math_verify


def _our_timeout_notice(record: logging.LogRecord) -> bool:
    """Drop math-verify's "Timeout is disabled" warning: we disable its signal-based timeouts on
    purpose, and the reward pool enforces its ``timeout_s`` (``rl.reward_pool``) instead."""
    return not str(record.msg).startswith("Timeout is disabled")
