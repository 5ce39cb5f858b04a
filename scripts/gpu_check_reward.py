"""The GPU check's reward: a fixed hash of the completion's text, in [0, 1].

A random policy's samples all score 0 on a task reward (zero advantages: no gradient, and a weight
sync that proves nothing); this one differs across samples, so every iteration has a gradient.
"""

from __future__ import annotations

import hashlib


def varied(completion: str, row: dict) -> float:
    """A number in [0, 1] that follows the completion's text (the same text, the same reward)."""
    digest = hashlib.blake2b(completion.encode(), digest_size=2).digest()
    return int.from_bytes(digest, "big") / 0xFFFF
