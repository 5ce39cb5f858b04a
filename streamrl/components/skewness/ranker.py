"""Output-length ranker: predicts which prompts the policy will answer at length (StreamRL §5.2).

"Rankability over predictability": exact lengths are hard to predict, their order much less so.
The fast default here trains in seconds on a CPU: a small MLP on features that any prompt text
has (hashed character n-grams, the numbers it contains and their spreads, its length, and hashed
token unigrams and bigrams when given the policy's ``tokenizer`` or ``word_tokenizer``), fitted
by regression on log-length plus a pairwise ranking term, and refreshed online from finished
samples as the policy's lengths drift. Token n-grams carry word-level meaning ("step by step",
"7 disks", "matrix") that character n-grams blur on long natural-language and chat prompts.
The paper fine-tunes a 1.5B-7B LLM instead; that backbone option is for GPUs.

It is a ``streamrl.protocols.LengthPredictor``: ``RolloutStream`` hands ``learn`` the policy's
finished samples (the first call fits, later ones refresh) and consults ``predict`` once ``ready``.

Examples:
    >>> ranker = LengthRanker(seed=0)
    >>> ranker.learn(["count 1 3=", "count 1 90="], [5, 260])  # doctest: +SKIP
    >>> ranker.ready, len(ranker.predict(["count 5 80="]))  # doctest: +SKIP
    (True, 1)
"""

from __future__ import annotations

import functools
import math
import re
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from streamrl.components.skewness.online_learning import OnlineLearning, fit_afresh
from streamrl.records import Sample

if TYPE_CHECKING:
    from streamrl.components.run_context import RunContext

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_WORD = re.compile(r"\w+|[^\w\s]")
_CHAR_WIDTH = 1024 + 8  # prompt_features(): char n-gram buckets + numeric summary
TOKEN_STD_FLOOR = 1.0


@functools.lru_cache(maxsize=65_536)
def prompt_features(prompt: str, buckets: int = 1024) -> np.ndarray:
    """Features of one prompt: hashed char 1-3-grams (counts, log-scaled) + numeric summary.

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
    return np.concatenate([np.log1p(grams), np.log1p(np.abs(numeric)).astype(np.float32)])


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


class LengthRanker(OnlineLearning):
    """Predicts an output-length score per prompt (higher means longer); a ``LengthPredictor``.

    ``learn`` is the online entry point (``RolloutStream`` calls it); ``fit``, ``update`` and
    ``refresh`` remain for offline training and benchmarks.

    Args:
        hidden: MLP width.
        epochs: full-batch training epochs of a ``fit`` called without ``epochs``.
        lr: Adam learning rate.
        rank_weight: weight of the pairwise ranking loss next to the log-length regression.
        buffer: finished samples kept for online refresh (``learn``, ``update``).
        seed: initialisation and shuffling seed.
        learn_epochs: epochs of the fit from scratch that ``learn`` runs while not ``ready``.
        refresh_epochs: epochs of the refresh over the recent buffer that each ``learn`` runs
            once ``ready``.
        tokenizer: the policy's tokenizer (``tokenizer(text)["input_ids"]``), or
            ``word_tokenizer``: adds hashed token unigram and bigram features, which carry
            word-level meaning on natural-language and chat prompts. ``None``: character and
            numeric features only.
        token_buckets: hashed token unigram + bigram buckets (with a ``tokenizer``).
    """

    @classmethod
    def from_run(cls, run: RunContext, **options: Any) -> LengthRanker:
        """Built for a run: the run's seed, and its policy's tokenizer when it has one to give
        (§5.2 on the prompts as the policy reads them); ``options`` win."""
        return cls(**{"seed": run.seed, "tokenizer": run.tokenizer, **options})

    def __init__(
        self,
        *,
        hidden: int = 128,
        epochs: int = 600,
        lr: float = 3e-3,
        rank_weight: float = 0.5,
        buffer: int = 8192,
        seed: int = 0,
        learn_epochs: int = 100,
        refresh_epochs: int = 10,
        tokenizer: Callable[[str], Mapping[str, list[int]]] | None = None,
        token_buckets: int = 2048,
    ) -> None:
        self.hidden, self.epochs, self.lr = hidden, epochs, lr
        self.tokenizer, self.token_buckets = tokenizer, token_buckets
        self._cache: dict[str, np.ndarray] = {}  # token features by prompt
        self.rank_weight, self.seed = rank_weight, seed
        self.learn_epochs, self.refresh_epochs = learn_epochs, refresh_epochs
        self.recent: deque[tuple[str, int]] = deque(maxlen=buffer)
        self.net: torch.nn.Module | None = None
        self._mean = self._std = None
        self.train_s = 0.0

    def _prompt_features(self, prompt: str) -> np.ndarray:
        chars = prompt_features(prompt)
        if self.tokenizer is None or not self.token_buckets:
            return chars
        tokens = self._cache.get(prompt)
        if tokens is None:
            tokens = token_features(self.tokenizer(prompt)["input_ids"], self.token_buckets)
            if len(self._cache) >= 65_536:  # RL re-deals the same prompts: a bounded memo
                self._cache.clear()
            self._cache[prompt] = tokens
        return np.concatenate([chars, tokens])

    def _features(self, prompts: Sequence[str]) -> torch.Tensor:
        x = np.stack([self._prompt_features(p) for p in prompts])
        if self._mean is None:
            std = x.std(0)
            # A feature constant in training (an n-gram never seen) keeps its raw scale.
            std = np.where(std < 1e-3, 1.0, std)
            # Token n-grams: rare ones are not blown up to the scale of common ones (a few
            # hundred prompts would overfit them).
            std[_CHAR_WIDTH:] = np.maximum(std[_CHAR_WIDTH:], TOKEN_STD_FLOOR)
            self._mean, self._std = x.mean(0), std
        # Clipped: text unlike anything seen in training must not blow the MLP up.
        return torch.from_numpy(np.clip((x - self._mean) / self._std, -10, 10)).float()

    def fit(
        self, prompts: Sequence[str], lengths: Sequence[int], epochs: int | None = None
    ) -> None:
        """Train from scratch on ``(prompt, output length)`` pairs of the policy."""
        if len(prompts) != len(lengths) or len(prompts) < 2:
            raise ValueError("LengthRanker.fit: need >= 2 prompts and one length per prompt.")
        started = time.perf_counter()
        torch.manual_seed(self.seed)
        self._mean = self._std = None
        x = self._features(prompts)
        y = torch.log1p(torch.tensor(lengths, dtype=torch.float32))
        self.net = self._make_net(x.shape[1])
        self._train(x, y, epochs or self.epochs)
        self.recent.extend(zip(prompts, (int(n) for n in lengths)))
        self.train_s = time.perf_counter() - started

    def _make_net(self, width: int) -> torch.nn.Module:
        return torch.nn.Sequential(
            torch.nn.Linear(width, self.hidden),
            torch.nn.GELU(),
            torch.nn.Linear(self.hidden, self.hidden),
            torch.nn.GELU(),
            torch.nn.Linear(self.hidden, 1),
        )

    def _train(self, x: torch.Tensor, y: torch.Tensor, epochs: int) -> None:
        optimizer = torch.optim.Adam(self.net.parameters(), lr=self.lr, weight_decay=1e-4)
        generator = torch.Generator().manual_seed(self.seed)
        for _ in range(epochs):
            pred = self.net(x).squeeze(-1)  # [n]
            loss = torch.nn.functional.mse_loss(pred, y)
            # Pairwise ranking on random pairs: order matters more than the value (§5.2).
            i = torch.randint(len(y), (min(4096, len(y) * 4),), generator=generator)
            j = torch.randint(len(y), i.shape, generator=generator)
            sign = torch.sign(y[i] - y[j])
            loss = (
                loss
                + self.rank_weight
                * torch.nn.functional.softplus(-sign * (pred[i] - pred[j])).mean()
            )
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

    @torch.no_grad()
    def predict(self, prompts: Sequence[str]) -> list[float]:
        """Predicted output lengths (tokens) of ``prompts``; their order is what matters."""
        if self.net is None:
            raise RuntimeError("LengthRanker.predict: not ready; call learn() or fit() first.")
        return torch.expm1(self.net(self._features(prompts)).squeeze(-1)).clamp(min=0).tolist()

    def update(self, samples: Iterable[Sample], texts: dict[str, str], epochs: int = 30) -> None:
        """Refresh online from finished samples (policy lengths drift during RL).

        Args:
            samples: finished samples of the policy.
            texts: prompt text by ``prompt_id``.
            epochs: fine-tuning epochs over the recent buffer.
        """
        self.recent.extend((texts[s.prompt_id], s.length) for s in samples)
        self.refresh(epochs)

    def refresh(self, epochs: int = 30) -> None:
        """Fine-tune on the recent buffer (or fit from scratch if never fitted)."""
        if not self.ready:
            fit_afresh(self, list(self.recent), None)
            return
        prompts, lengths = zip(*self.recent)
        started = time.perf_counter()
        x = self._features(list(prompts))
        self._train(x, torch.log1p(torch.tensor(lengths, dtype=torch.float32)), epochs)
        self.train_s += time.perf_counter() - started

    def state_dict(self) -> dict:
        return {
            "net": None if self.net is None else self.net.state_dict(),
            # Tensors, not numpy arrays: checkpoints load with torch.load(weights_only=True).
            "mean": None if self._mean is None else torch.from_numpy(self._mean),
            "std": None if self._std is None else torch.from_numpy(self._std),
            "recent": list(self.recent),
            "hidden": self.hidden,
            # Feature width: 0 without a tokenizer (then the loading ranker uses none either).
            "token_buckets": self.token_buckets if self.tokenizer is not None else 0,
        }

    def load_state_dict(self, state: dict) -> None:
        self._mean, self._std = (
            None if state[k] is None else np.asarray(state[k]) for k in ("mean", "std")
        )
        self.hidden = state["hidden"]
        self.token_buckets = state.get("token_buckets", 0)  # saved before token features: none
        if self.token_buckets and self.tokenizer is None:
            raise ValueError(
                "LengthRanker.load_state_dict: saved with token features; pass the same "
                "tokenizer to the constructor."
            )
        self.recent.clear()
        self.recent.extend(state["recent"])
        if state["net"] is not None:
            self.net = self._make_net(len(self._mean))
            self.net.load_state_dict(state["net"])
