"""What the fast length ranker reads of a prompt: features any text has (StreamRL §5.2).

Hashed character 1-3-grams, the numbers the prompt contains and their spreads, its length, each
stated number (in digits or in words: ``prompt_numbers.py``) filed under the words beside it,
and, given a tokenizer (the policy's, or ``word_tokenizer``), hashed token unigrams and bigrams,
which carry word-level meaning ("step by step", "7 disks", "matrix") that character n-grams blur
on long natural-language and chat prompts.

Layout of a prompt's vector: ``CHAR_GRAMS`` character n-gram buckets, 8 numeric summaries,
``CONTEXT_BUCKETS`` number-context buckets (``PromptFeatures.text_width`` columns in all), then,
with a tokenizer, the token n-gram buckets and the log token count.
"""

from __future__ import annotations

import functools
import math
import re
import zlib
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from streamrl.components.skewness.prompt_numbers import stated_numbers, words

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_WORD = re.compile(r"\w+|[^\w\s]")
CHAR_GRAMS = 1024
CONTEXT_BUCKETS = 128


@functools.lru_cache(maxsize=65_536)
def prompt_features(
    prompt: str, buckets: int = CHAR_GRAMS, contexts: int = CONTEXT_BUCKETS
) -> np.ndarray:
    """Features of one prompt: hashed char 1-3-grams (counts, log-scaled), numeric summary and
    ``contexts`` number-context buckets (``number_contexts``; 0: none, as before issue 34).

    Cached: RL deals the same prompts again every epoch, and online refreshes re-read them.
    The returned array is shared; do not modify it.
    """
    grams = np.zeros(buckets, dtype=np.float32)
    text = f"^{prompt}$"
    for n in (1, 2, 3):
        for i in range(len(text) - n + 1):
            grams[zlib.crc32(text[i : i + n].encode()) % buckets] += 1.0
    numbers = [float(x) for x in _NUMBER.findall(prompt)][:64]
    arr = np.asarray(numbers or [0.0])
    spread = arr.max() - arr.min()
    first_two = abs(arr[1] - arr[0]) if len(arr) > 1 else 0.0
    digits = sum(len(x) for x in _NUMBER.findall(prompt))
    numeric = [
        len(prompt),
        len(prompt.split()),
        len(numbers),
        digits,
        spread,
        first_two,
        first_two * math.log10(max(arr.max(), 1.0) + 1),
        arr.mean(),
    ]
    summary = np.log1p(np.abs(numeric)).astype(np.float32)
    return np.concatenate([np.log1p(grams), summary, number_contexts(prompt, contexts)])


def number_contexts(prompt: str, buckets: int = CONTEXT_BUCKETS) -> np.ndarray:
    """Each number the prompt states (digits or words), its log filed under the word before it,
    the word after it and the two words after it (hashed into ``buckets``, summed).

    So "in under 300 words", "in under three hundred words" and "List 7 ideas" put log 300 or
    log 7 where the words that make a number a length cue ("under", "words", "list") send it,
    and "for my 3 kids" elsewhere: which contexts matter is the net's to learn.
    """
    contexts = np.zeros(buckets, dtype=np.float32)
    if not buckets:
        return contexts
    tokens = words(prompt)
    for number in stated_numbers(tokens):
        before = tokens[number.start - 1] if number.start else "^"
        after = tokens[number.end : number.end + 2]
        for key in (f"<{before}", f">{after[0] if after else '$'}", f">>{' '.join(after)}"):
            contexts[zlib.crc32(key.encode()) % buckets] += math.log1p(abs(number.value))
    return contexts


def token_features(tokens: Sequence[int], buckets: int = 2048) -> np.ndarray:
    """Features of one tokenized prompt: hashed token unigrams and bigrams (counts, log-scaled) in
    ``buckets`` buckets (half each), plus the log token count."""
    ids = np.asarray(tokens, dtype=np.uint64)  # arithmetic below wraps mod 2**64: a hash
    half = buckets // 2
    uni = (ids * np.uint64(0x9E3779B1)) % np.uint64(1_000_000_007) % np.uint64(half)
    bi = (ids[:-1] * np.uint64(0x85EBCA6B) + ids[1:] * np.uint64(0xC2B2AE35)) % np.uint64(
        1_000_000_007
    ) % np.uint64(buckets - half) + np.uint64(half)
    grams = np.bincount(np.concatenate([uni, bi]).astype(np.int64), minlength=buckets)
    grams = grams.astype(np.float32)
    return np.concatenate([np.log1p(grams), np.float32([math.log1p(len(ids))])])


def word_ids(prompt: str) -> list[int]:
    """Token ids of ``prompt`` without a tokenizer: its words and punctuation marks, hashed."""
    return [zlib.crc32(w.encode()) for w in _WORD.findall(prompt.lower())]


def word_tokenizer(prompt: str) -> dict[str, list[int]]:
    """A ``tokenizer`` for ``LengthRanker`` when the policy's is not at hand: ``word_ids``."""
    return {"input_ids": word_ids(prompt)}


class PromptFeatures:
    """The feature vectors of prompts: character, numeric and number-context features, and
    hashed token n-grams when a ``tokenizer`` is given (memoised per prompt: RL deals the same
    prompts again).

    Args:
        tokenizer: ``tokenizer(text)["input_ids"]``; ``None``: no token features.
        token_buckets: hashed token unigram + bigram buckets (with a ``tokenizer``; 0: none).
        context_buckets: number-context buckets (0: none, the layout before issue 34).
    """

    def __init__(
        self,
        tokenizer: Callable[[str], Mapping[str, list[int]]] | None = None,
        token_buckets: int = 2048,
        context_buckets: int = CONTEXT_BUCKETS,
    ) -> None:
        self.tokenizer, self.token_buckets = tokenizer, token_buckets
        self.context_buckets = context_buckets
        self._cache: dict[str, np.ndarray] = {}  # token features by prompt

    @property
    def uses_tokens(self) -> bool:
        return self.tokenizer is not None and bool(self.token_buckets)

    @property
    def text_width(self) -> int:
        """Columns before the token n-grams: char n-grams, numeric summary, number contexts."""
        return CHAR_GRAMS + 8 + self.context_buckets

    def __call__(self, prompts: Sequence[str]) -> np.ndarray:
        """``[len(prompts), width]`` features."""
        return np.stack([self._one(p) for p in prompts])

    def _one(self, prompt: str) -> np.ndarray:
        chars = prompt_features(prompt, CHAR_GRAMS, self.context_buckets)
        if not self.uses_tokens:
            return chars
        tokens = self._cache.get(prompt)
        if tokens is None:
            tokens = token_features(self.tokenizer(prompt)["input_ids"], self.token_buckets)
            if len(self._cache) >= 65_536:  # RL re-deals the same prompts: a bounded memo
                self._cache.clear()
            self._cache[prompt] = tokens
        return np.concatenate([chars, tokens])
