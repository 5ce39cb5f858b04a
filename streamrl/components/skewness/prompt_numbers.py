"""The numbers a prompt states, in digits or in English words, and the words around each.

A count is a length cue whether it is written "7", "seven" or "a dozen", and what it counts is in
the words next to it ("7 bullet points" sets a length, "my 3 kids" does not). The fast ranker's
features (``ranker_features.py``) read both from here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_ONES = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen"
)
_DECADES = "twenty thirty forty fifty sixty seventy eighty ninety"
_UNITS = {word: value for value, word in enumerate(_ONES.split())}
_TENS = {word: 10 * value for value, word in enumerate(_DECADES.split(), start=2)}
_TOKEN = re.compile(r"\d+(?:\.\d+)?|[a-z]+|[^\sa-z\d]")


@dataclass(frozen=True)
class StatedNumber:
    """A number in a text's words (``words(text)``).

    Attributes:
        value: what it says (``"twenty-five"``: 25.0).
        start: index of its first word.
        end: index past its last word.
    """

    value: float
    start: int
    end: int


def words(text: str) -> list[str]:
    """The lower-cased words, numbers and marks of ``text``, in order."""
    return _TOKEN.findall(text.lower())


def stated_numbers(tokens: list[str]) -> list[StatedNumber]:
    """Every number in ``tokens`` (``words(text)``): digits, and number words up to the
    thousands ("three hundred and twenty", "twenty-five", "a dozen" as 12).

    Examples:
        >>> [n.value for n in stated_numbers(words("List twenty-five ideas for my 3 kids"))]
        [25.0, 3.0]
        >>> stated_numbers(words("in under three hundred and twenty words"))
        [StatedNumber(value=320.0, start=2, end=6)]
    """
    found, i = [], 0
    while i < len(tokens):
        if tokens[i][0].isdigit():
            found.append(StatedNumber(float(tokens[i]), i, i + 1))
            i += 1
        elif _is_number_word(tokens[i]):
            value, end = _read_words(tokens, i)
            found.append(StatedNumber(float(value), i, end))
            i = end
        else:
            i += 1
    return found


def _is_number_word(token: str) -> bool:
    return token in _UNITS or token in _TENS or token == "dozen"


def _goes_on(below_hundred: int, unit: int) -> bool:
    """Whether a unit word continues a number ("twenty" + "seven"), not starts one ("twenty"
    then "twelve", "seven" then "eight")."""
    return below_hundred == 0 or (below_hundred >= 20 and below_hundred % 10 == 0 and unit < 10)


def _read_words(tokens: list[str], i: int) -> tuple[int, int]:
    """The value of the number words from ``tokens[i]`` on, and the index past them."""
    total = current = 0
    while i < len(tokens):
        token, below_hundred = tokens[i], current % 100
        if token in _TENS and below_hundred == 0:  # "twenty", "three hundred and twenty"
            current += _TENS[token]
        elif token in _UNITS and _goes_on(below_hundred, _UNITS[token]):
            current += _UNITS[token]
        elif token == "dozen":
            current = (current or 1) * 12
        elif token == "hundred" and current:
            current *= 100
        elif token == "thousand" and (current or total):
            total, current = total + current * 1000, 0
        elif token in ("-", "and") and i + 1 < len(tokens) and _is_number_word(tokens[i + 1]):
            pass  # "twenty-five", "three hundred and twenty": one number goes on
        else:
            break
        i += 1
    return total + current, i
