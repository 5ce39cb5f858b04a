"""Output-length ranker: predicts which prompts the policy will answer at length (StreamRL §5.2).

"Rankability over predictability": exact lengths are hard to predict, their order much less so.
The fast default here trains in seconds on a CPU: a small MLP on features that any prompt text
has (``ranker_features.py``: hashed character n-grams, the numbers it contains, its length, and
hashed token n-grams when given the policy's ``tokenizer`` or ``word_tokenizer``). Its head
predicts each prompt's log length as a distribution, a location and a spread (``length_head.py``:
Gaussian likelihood of every finished sample plus a pairwise ranking term on the location), and
the spread is calibrated on lengths it did not learn from, so the predicted P90 covers about 90%
of what the policy does. It is refreshed online from finished samples as the lengths drift. The
paper fine-tunes a 1.5B-7B LLM instead; that backbone option (``backbone_ranker.py``) is for GPUs.

It is a ``streamrl.protocols.DistributionalLengthPredictor``: ``RolloutStream`` hands ``learn``
the policy's finished samples (the first call fits, later ones refresh) and consults ``predict``
(the median length: the paper's ranking) once ``ready``; planners that weigh the tail read
``predict_distribution``.

Examples:
    >>> ranker = LengthRanker(seed=0)
    >>> ranker.learn(["count 1 3=", "count 1 90="], [5, 260])  # doctest: +SKIP
    >>> ranker.ready, len(ranker.predict(["count 5 80="]))  # doctest: +SKIP
    (True, 1)
    >>> ranker.predict_distribution(["count 5 80="])[0].quantile(0.9)  # doctest: +SKIP
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from streamrl.components.skewness.length_head import (
    LogLengths,
    spread,
)
from streamrl.components.skewness.online_learning import OnlineRanker
from streamrl.components.skewness.ranker_features import (
    CHAR_GRAMS,
    CONTEXT_BUCKETS,
    PromptFeatures,
    prompt_features,
    token_features,
    word_ids,
    word_tokenizer,
)
from streamrl.components.skewness.ranker_net import (
    load_mlp,
    location,
    make_linear,
    make_mlp,
    train_models,
)
from streamrl.records import Sample

if TYPE_CHECKING:
    from streamrl.components.run_context import RunContext

__all__ = [
    "LengthRanker",
    "prompt_features",
    "token_features",
    "word_ids",
    "word_tokenizer",
]

#: Smallest scale of a hashed n-gram feature: rare n-grams are not blown up to the scale of
#: common ones (a few hundred prompts would overfit them; a passage's n-grams are noise).
NGRAM_STD_FLOOR = 1.0


class LengthRanker(OnlineRanker):
    """Predicts each prompt's output length as a distribution (higher location: longer); a
    ``DistributionalLengthPredictor``.

    ``learn`` is the online entry point (``RolloutStream`` calls it); ``fit``, ``update`` and
    ``refresh`` remain for offline training and benchmarks. When it trains and on what is its
    ``online`` schedule (``OnlineSchedule``: the recent buffer, the epochs, the calibration).
    Samples of the same prompt (a group's ``G``) are read as one row: their spread is what the
    head's ``sigma`` learns.

    Args:
        hidden: MLP width.
        epochs: full-batch training epochs of a ``fit`` called without ``epochs``.
        lr: Adam learning rate.
        rank_weight: weight of the pairwise ranking loss next to the length likelihood.
        buffer: finished samples kept for online refresh (``learn``, ``update``).
        seed: initialisation, shuffling and calibration-split seed.
        learn_epochs: epochs of the fit from scratch that ``learn`` runs while not ``ready``.
        refresh_epochs: epochs of the refresh over the recent buffer that each ``learn`` runs
            once ``ready``.
        tokenizer: the policy's tokenizer (``tokenizer(text)["input_ids"]``), or
            ``word_tokenizer``: adds hashed token unigram and bigram features, which carry
            word-level meaning on natural-language and chat prompts. ``None``: character and
            numeric features only.
        token_buckets: hashed token unigram + bigram buckets (with a ``tokenizer``).
        context_buckets: buckets of the numbers the prompt states, filed under the words beside
            them (``ranker_features.number_contexts``; 0: none).
        calibration_share: share of a fit's distinct prompts a first net is trained without, to
            calibrate the spread on (no such net below ``length_head.MIN_CALIBRATION_PROMPTS``
            held-out prompts; 0: never); later ``learn`` calls calibrate on each new batch
            before learning it.
        coverage: the quantile the calibration makes right (0.9: the P90).
        linear_l2: ridge penalty of the linear model whose location is averaged with the
            MLP's (``ranker_net.py``).

    Raises:
        ValueError: ``calibration_share`` outside [0, 1) or ``coverage`` outside (0.5, 1).
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
        context_buckets: int = CONTEXT_BUCKETS,
        calibration_share: float = 0.2,
        coverage: float = 0.9,
        linear_l2: float = 10.0,
    ) -> None:
        super().__init__(
            buffer=buffer,
            learn_epochs=learn_epochs,
            refresh_epochs=refresh_epochs,
            calibration_share=calibration_share,
            coverage=coverage,
            seed=seed,
        )
        self.hidden, self.epochs, self.lr = hidden, epochs, lr
        self.features = PromptFeatures(tokenizer, token_buckets, context_buckets)
        self.rank_weight, self.seed = rank_weight, seed
        self.linear_l2 = linear_l2
        self.net: torch.nn.Module | None = None
        self.linear: torch.nn.Linear | None = None
        self._mean = self._std = None
        self.train_s = 0.0

    @property
    def ready(self) -> bool:
        """Whether it has been fitted (``predict`` works)."""
        return self.net is not None

    @property
    def tokenizer(self) -> Callable[[str], Mapping[str, list[int]]] | None:
        return self.features.tokenizer

    @property
    def token_buckets(self) -> int:
        return self.features.token_buckets

    def _standardised(self, prompts: Sequence[str]) -> torch.Tensor:
        x = self.features(prompts)
        if self._mean is None:
            std = x.std(0)
            # A feature constant in training (an n-gram never seen) keeps its raw scale.
            std = np.where(std < 1e-3, 1.0, std)
            for grams in (slice(0, CHAR_GRAMS), slice(self.features.text_width, None)):
                std[grams] = np.maximum(std[grams], NGRAM_STD_FLOOR)
            self._mean, self._std = x.mean(0), std
        # Clipped: text unlike anything seen in training must not blow the MLP up.
        return torch.from_numpy(np.clip((x - self._mean) / self._std, -10, 10)).float()

    def fit(
        self, prompts: Sequence[str], lengths: Sequence[int], epochs: int | None = None
    ) -> None:
        """Train from scratch on ``(prompt, output length)`` pairs of the policy (a prompt may
        come with several); ``OnlineSchedule.fit`` (a held-out share calibrates the spread)."""
        self.online.fit(self, prompts, lengths, epochs)

    def train_afresh(self, prompts: list[str], targets: LogLengths, epochs: int | None) -> None:
        """``RankerModel``: new models, trained on distinct ``prompts`` (``epochs`` or the
        constructor's)."""
        started = time.perf_counter()
        self._fit_net(prompts, targets, epochs or self.epochs)
        self.train_s += time.perf_counter() - started

    def train_more(self, prompts: list[str], targets: LogLengths, epochs: int) -> None:
        """``RankerModel``: the models trained further on distinct ``prompts``."""
        started = time.perf_counter()
        self._train(self._standardised(prompts), targets, epochs)
        self.train_s += time.perf_counter() - started

    def _fit_net(self, prompts: list[str], targets: LogLengths, epochs: int) -> None:
        """New models, their features standardised on ``prompts``, trained on them."""
        torch.manual_seed(self.seed)
        self._mean = self._std = None
        x = self._standardised(prompts)
        self.net = make_mlp(x.shape[1], self.hidden)
        self.linear = make_linear(x.shape[1], targets)
        self._train(x, targets, epochs)

    def _train(self, x: torch.Tensor, y: LogLengths, epochs: int) -> None:
        if self.linear is None:  # loaded from a state saved before the linear model
            self.linear = make_linear(x.shape[1], y)
        train_models(
            self.net,
            self.linear,
            x,
            y,
            epochs,
            lr=self.lr,
            rank_weight=self.rank_weight,
            l2=self.linear_l2,
            seed=self.seed,
        )

    @torch.no_grad()
    def raw(self, prompts: Sequence[str]) -> tuple[list[float], list[float]]:
        """The ``mu`` and uncalibrated ``sigma`` of each prompt's log length."""
        if self.net is None:
            raise RuntimeError("LengthRanker.predict: not ready; call learn() or fit() first.")
        x = self._standardised(prompts)
        out = self.net(x)  # [n, 2]
        return location(out, self.linear, x).tolist(), spread(out[:, 1]).tolist()

    def update(self, samples: Iterable[Sample], texts: dict[str, str], epochs: int = 30) -> None:
        """Refresh online from finished samples (policy lengths drift during RL); they calibrate
        the spread first.

        Args:
            samples: finished samples of the policy.
            texts: prompt text by ``prompt_id``.
            epochs: fine-tuning epochs over the recent buffer.
        """
        self.online.update(self, [(texts[s.prompt_id], s.length) for s in samples], epochs)

    def refresh(self, epochs: int = 30) -> None:
        """Fine-tune on the recent buffer (or fit from scratch if never fitted)."""
        self.online.refresh(self, epochs)

    def state_dict(self) -> dict:
        return {
            "net": None if self.net is None else self.net.state_dict(),
            # Tensors, not numpy arrays: checkpoints load with torch.load(weights_only=True).
            "mean": None if self._mean is None else torch.from_numpy(self._mean),
            "std": None if self._std is None else torch.from_numpy(self._std),
            **self.online.state_dict(),  # recent buffer, calibration
            "hidden": self.hidden,
            # Feature width: 0 without a tokenizer (then the loading ranker uses none either).
            "token_buckets": self.token_buckets if self.tokenizer is not None else 0,
            "context_buckets": self.features.context_buckets,
            "linear": None if self.linear is None else self.linear.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore from ``state_dict()``. A state saved before issue 34 loads with the features it
        was trained on (no number contexts), its point head as the location, the same spread
        for every prompt and no calibration until the next ``learn``.

        Raises:
            ValueError: the state has token features and this ranker no tokenizer.
        """
        mean, std = (None if state[k] is None else np.asarray(state[k]) for k in ("mean", "std"))
        token_buckets = state.get("token_buckets", 0)  # saved before token features: none
        if token_buckets and self.tokenizer is None:
            raise ValueError(
                "LengthRanker.load_state_dict: saved with token features; pass the same "
                "tokenizer to the constructor."
            )
        self._mean, self._std, self.hidden = mean, std, state["hidden"]
        self.features.token_buckets = token_buckets
        self.features.context_buckets = state.get("context_buckets", 0)  # saved before them
        self.online.load_state_dict(state)
        if state["net"] is not None:
            self.net = load_mlp(state["net"], len(self._mean), self.hidden)
        self.linear = None
        if state.get("linear") is not None:
            self.linear = torch.nn.Linear(len(self._mean), 1)
            self.linear.load_state_dict(state["linear"])
