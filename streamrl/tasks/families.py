"""Verifiable task families whose correct answer length is set by the prompt.

Each family turns a target answer length into a prompt and its exact answer. Because the answer
length is a function of the prompt, a length ranker can learn it (StreamRL §5.2); because some
families hide the length (``count 12 87=`` is short, its answer is long), it must learn more than
"long prompt, long answer".
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass
from typing import Protocol

LETTERS = string.ascii_lowercase


class TaskFamily(Protocol):
    """A task: builds a (prompt, answer) pair whose answer has about ``target_len`` characters."""

    name: str

    def make(self, rng: random.Random, target_len: int) -> tuple[str, str]: ...


@dataclass(frozen=True)
class Copy:
    """``copy abc=`` -> ``abc``."""

    name: str = "copy"

    def make(self, rng: random.Random, target_len: int) -> tuple[str, str]:
        text = "".join(rng.choice(LETTERS) for _ in range(max(1, target_len)))
        return f"copy {text}=", text


@dataclass(frozen=True)
class Reverse:
    """``rev abc=`` -> ``cba``."""

    name: str = "rev"

    def make(self, rng: random.Random, target_len: int) -> tuple[str, str]:
        text = "".join(rng.choice(LETTERS) for _ in range(max(1, target_len)))
        return f"rev {text}=", text[::-1]


@dataclass(frozen=True)
class Count:
    """``count 7 11=`` -> ``7 8 9 10 11``: a short prompt whose answer length grows with b - a."""

    name: str = "count"
    max_start: int = 99

    def make(self, rng: random.Random, target_len: int) -> tuple[str, str]:
        start = rng.randint(0, self.max_start)
        numbers = [str(start)]
        while len(" ".join(numbers)) < target_len:
            numbers.append(str(start + len(numbers)))
        stop = start + len(numbers) - 1
        return f"count {start} {stop}=", " ".join(numbers)


@dataclass(frozen=True)
class Sort:
    """``sort 42 7 19=`` -> ``7 19 42`` (numbers 0-99, repeats allowed)."""

    name: str = "sort"

    def make(self, rng: random.Random, target_len: int) -> tuple[str, str]:
        numbers = [rng.randint(0, 99)]
        while len(" ".join(map(str, numbers))) < target_len:
            numbers.append(rng.randint(0, 99))
        answer = " ".join(map(str, sorted(numbers)))
        return f"sort {' '.join(map(str, numbers))}=", answer


#: The built-in families by name.
FAMILIES: dict[str, TaskFamily] = {f.name: f for f in (Copy(), Reverse(), Count(), Sort())}
