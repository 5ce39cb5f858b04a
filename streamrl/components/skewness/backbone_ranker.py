"""Backbone output-length ranker: a LoRA-tuned causal LM with a length head (StreamRL §5.2).

The paper predicts output lengths with a fine-tuned LLM (a 7B causal LM in §5.2): the model reads
the prompt, and a small head on its final hidden state scores how long the policy will answer.
This is that option, with the fast ranker's distributional head (``length_head.py``): a location
and a spread of the log length per prompt, the spread calibrated on lengths it did not learn from
(``predict_distribution``; ``predict`` is the median). It differs from the default
``LengthRanker`` (``ranker.py``) in cost, not in contract: the fast ranker is an MLP on hashed
prompt features that trains in seconds on a CPU, while this one runs a transformer forward and
backward per prompt, so it is slower by orders of magnitude and meant for GPUs, large length data
sets, or prompts whose length cue is semantic (natural-language instructions rather than the
built-in tasks' visible counts).

Only the LoRA adapters of the attention projections and the head train; the backbone stays frozen
and is *not* part of ``state_dict()``. To restore a ranker, build it again on the same backbone
(directory or model) and call ``load_state_dict``.

Example (a local model directory works the same: ``BackboneLengthRanker("path/to/model")``):
    >>> from streamrl.policy.models import build_tiny_model, build_tokenizer
    >>> tokenizer = build_tokenizer()
    >>> ranker = BackboneLengthRanker(build_tiny_model(tokenizer), tokenizer, epochs=1)
    >>> ranker.fit(["count 1 3=", "count 1 90=", "copy ab="], [5, 260, 2])
    >>> len(ranker.predict(["count 5 80="]))
    1
"""

from __future__ import annotations

import copy
import math
import random
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from streamrl.components.skewness.backbone_model import (
    ATTENTION_PROJECTIONS,
    LengthModel,
    Pooling,
    check_targets,
    load_backbone,
    require_peft,
)
from streamrl.components.skewness.length_head import (
    LogLengths,
    head_loss,
    spread,
    widen_point_head,
)
from streamrl.components.skewness.online_learning import OnlineRanker
from streamrl.errors import ConfigError
from streamrl.records import Sample

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class BackboneLengthRanker(OnlineRanker):
    """Predicts output lengths with a LoRA-tuned causal LM; a ``DistributionalLengthPredictor``
    like ``LengthRanker`` (``learn`` online; ``fit``, ``update`` and ``refresh`` as well).

    Trained as the fast ranker's head is (``length_head.head_loss``: squared error and
    likelihood of every sample's standardised log length, plus a pairwise ranking term within
    each mini-batch: order matters more than the value, §5.2), and calibrated the same way. The
    model is kept in eval mode (LoRA dropout is 0), so training and prediction are deterministic
    for a given seed.

    Args:
        backbone: a local Hugging Face causal-LM directory, or an already-built
            ``PreTrainedModel`` (its base model is wrapped with LoRA in place; pass a copy if the
            original must stay untouched).
        tokenizer: required with a model object; loaded from the directory otherwise. A tokenizer
            without a pad token gets its EOS token as pad token.
        lora_r: LoRA rank.
        lora_alpha: LoRA scaling numerator (scale = alpha / r).
        target_modules: module-name suffixes that get adapters (the attention projections).
        pooling: ``"mean"`` over real tokens or the ``"last"`` real token's hidden state.
        epochs: passes over the data of a ``fit`` called without ``epochs``.
        batch_size: prompts per optimiser step (padded to the longest in the batch).
        lr: AdamW learning rate of adapters and head.
        rank_weight: weight of the pairwise ranking loss next to the regression.
        max_prompt_tokens: prompts are truncated to this many tokens.
        buffer: finished ``(prompt, length)`` pairs kept for online refresh.
        device: where the backbone runs (``"cuda"`` is what this ranker is for).
        seed: adapter/head initialisation and shuffling seed.
        learn_epochs: passes of the fit from scratch that ``learn`` runs while not ``ready``.
        refresh_epochs: passes over the recent buffer that each ``learn`` runs once ``ready``
            (each pass is ``len(buffer) / batch_size`` steps through the backbone: lower both
            for large buffers).
        calibration_share: share of a fit's distinct prompts a first training run leaves out to
            calibrate the spread on, before the run on all of them (so a fit trains twice;
            0: never, and the spread is calibrated by later ``learn`` calls only).
        coverage: the quantile the calibration makes right (0.9: the P90).

    Raises:
        ConfigError: peft is missing, a model is given without its tokenizer, or no module of the
            backbone matches ``target_modules``.
    """

    def __init__(
        self,
        backbone: str | Path | torch.nn.Module,
        tokenizer: PreTrainedTokenizerBase | None = None,
        lora_r: int = 8,
        lora_alpha: int = 16,
        target_modules: Sequence[str] = ATTENTION_PROJECTIONS,
        pooling: Pooling = "mean",
        epochs: int = 3,
        batch_size: int = 32,
        lr: float = 3e-3,
        rank_weight: float = 0.5,
        max_prompt_tokens: int = 256,
        buffer: int = 2048,
        device: str = "cpu",
        seed: int = 0,
        *,
        learn_epochs: int = 100,
        refresh_epochs: int = 10,
        calibration_share: float = 0.2,
        coverage: float = 0.9,
    ) -> None:
        peft = require_peft()
        super().__init__(
            buffer=buffer,
            learn_epochs=learn_epochs,
            refresh_epochs=refresh_epochs,
            calibration_share=calibration_share,
            coverage=coverage,
            seed=seed,
        )
        if pooling not in ("mean", "last"):
            raise ConfigError(f"BackboneLengthRanker: pooling {pooling!r}; use 'mean' or 'last'.")
        self.config = dict(
            lora_r=lora_r,
            lora_alpha=lora_alpha,
            pooling=pooling,
            target_modules=sorted(target_modules),
        )
        self.epochs, self.batch_size, self.lr = epochs, batch_size, lr
        self.rank_weight, self.max_prompt_tokens, self.seed = rank_weight, max_prompt_tokens, seed
        self.device = torch.device(device)
        self.train_s = 0.0
        base, self.tokenizer = load_backbone(backbone, tokenizer)
        check_targets(base, target_modules)
        lora = peft.LoraConfig(
            r=lora_r,
            lora_alpha=lora_alpha,
            lora_dropout=0.0,
            target_modules=list(target_modules),
            bias="none",
        )
        with torch.random.fork_rng(devices=[]):  # CPU RNG only; CUDA untouched
            torch.manual_seed(seed)
            wrapped = peft.get_peft_model(base, lora)
            self.model = LengthModel(wrapped, base.config.hidden_size, pooling)
        #: Backbone with adapters, plus the head; trained in eval mode (no dropout anywhere).
        self.model.to(self.device).eval()
        self._initial = copy.deepcopy(self._trainable_state())
        self._log_mean, self._log_std = 0.0, 1.0
        self._fitted = False

    @property
    def net(self) -> torch.nn.Module | None:
        """The trained model, ``None`` until fitted (as ``LengthRanker.net``)."""
        return self.model if self._fitted else None

    @property
    def ready(self) -> bool:
        """Whether it has been fitted (``predict`` works)."""
        return self._fitted

    def trainable_parameters(self) -> dict[str, torch.nn.Parameter]:
        """The parameters that train: LoRA adapters and the length head."""
        return {n: p for n, p in self.model.named_parameters() if p.requires_grad}

    def fit(
        self, prompts: Sequence[str], lengths: Sequence[int], epochs: int | None = None
    ) -> None:
        """Train adapters and head from their initial values on ``(prompt, length)`` pairs (a
        prompt may come with several); ``OnlineSchedule.fit`` (a held-out share calibrates the
        spread). The log lengths are standardised on all of them."""
        logs = [math.log(max(int(n), 1)) for n in lengths]
        if len(logs) == len(prompts) >= 2:  # else OnlineSchedule.fit says what is wrong
            mean = sum(logs) / len(logs)
            std = math.sqrt(sum((v - mean) ** 2 for v in logs) / len(logs))
            self._log_mean, self._log_std = mean, max(std, 1e-3)
        self.online.fit(self, prompts, lengths, epochs)

    def train_afresh(self, prompts: list[str], targets: LogLengths, epochs: int | None) -> None:
        """``RankerModel``: adapters and head from their initial values, trained on distinct
        ``prompts``."""
        started = time.perf_counter()
        self.model.load_state_dict(self._initial, strict=False)
        self._train(prompts, targets, epochs or self.epochs)
        self._fitted = True
        self.train_s += time.perf_counter() - started

    def train_more(self, prompts: list[str], targets: LogLengths, epochs: int) -> None:
        """``RankerModel``: adapters and head trained further on distinct ``prompts``."""
        started = time.perf_counter()
        self._train(prompts, targets, epochs)
        self.train_s += time.perf_counter() - started

    def _batch(self, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        encoded = self.tokenizer(
            list(prompts),
            padding=True,
            truncation=True,
            max_length=self.max_prompt_tokens,
            return_tensors="pt",
        )
        return {
            "input_ids": encoded["input_ids"].to(self.device),  # [b, s]
            "attention_mask": encoded["attention_mask"].to(self.device),  # [b, s]
        }

    def _train(self, prompts: list[str], lengths: LogLengths, epochs: int) -> None:
        params = list(self.trainable_parameters().values())
        optimizer = torch.optim.AdamW(params, lr=self.lr, weight_decay=1e-4)
        target = lengths.standardised(self._log_mean, self._log_std)
        order = list(range(len(prompts)))
        shuffler = random.Random(self.seed)
        for _ in range(epochs):
            shuffler.shuffle(order)
            for start in range(0, len(order), self.batch_size):
                index = order[start : start + self.batch_size]
                out = self.model(**self._batch([prompts[i] for i in index]))  # [b, 2]
                # Every ordered pair of the mini-batch is ranked.
                loss = head_loss(out, target.take(index), self.rank_weight)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()

    @torch.no_grad()
    def raw(self, prompts: Sequence[str]) -> tuple[list[float], list[float]]:
        """The head's ``mu`` and uncalibrated ``sigma`` of each prompt's log length."""
        if not self._fitted:
            raise RuntimeError(
                "BackboneLengthRanker.predict: not ready; call learn() or fit() first."
            )
        # Batched by token length, so that little padding is computed.
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        mu, sigma = [0.0] * len(prompts), [0.0] * len(prompts)
        for start in range(0, len(order), self.batch_size):
            index = order[start : start + self.batch_size]
            out = self.model(**self._batch([prompts[i] for i in index])).cpu()  # [b, 2]
            locations = out[:, 0] * self._log_std + self._log_mean
            spreads = spread(out[:, 1]) * self._log_std
            for i, m, s in zip(index, locations.tolist(), spreads.tolist()):
                mu[i], sigma[i] = m, s
        return mu, sigma

    def update(self, samples: Iterable[Sample], texts: dict[str, str], epochs: int = 1) -> None:
        """Refresh online from finished samples (policy lengths drift during RL).

        Args:
            samples: finished samples of the policy.
            texts: prompt text by ``prompt_id``.
            epochs: passes over the recent buffer (each is ``len(buffer) / batch_size`` steps
                through the backbone, so far costlier than a ``LengthRanker`` epoch).
        """
        self.online.update(self, [(texts[s.prompt_id], s.length) for s in samples], epochs)

    def refresh(self, epochs: int = 1) -> None:
        """Fine-tune on the recent buffer (or fit from scratch if never fitted)."""
        self.online.refresh(self, epochs)

    def _trainable_state(self) -> dict[str, torch.Tensor]:
        names = self.trainable_parameters()
        return {n: t.detach().cpu() for n, t in self.model.state_dict().items() if n in names}

    def state_dict(self) -> dict:
        """Adapters, head, log-length statistics, config and recent buffer; no backbone weights."""
        return {
            "trainable": {n: t.clone() for n, t in self._trainable_state().items()},
            "log_mean": self._log_mean,
            "log_std": self._log_std,
            "fitted": self._fitted,
            "config": dict(self.config),
            **self.online.state_dict(),  # recent buffer, calibration
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore from ``state_dict()``; this ranker must be built on the same backbone. A state
        saved before the distributional head (no ``"calibration"``) loads its point head as the
        location, with the same spread for every prompt and no calibration until the next
        ``learn``.

        Raises:
            ConfigError: the state was saved with other settings or on another backbone.
        """
        trainable = dict(state["trainable"])
        if "calibration" not in state and trainable.get("head.weight") is not None:
            trainable["head.weight"], trainable["head.bias"] = widen_point_head(
                trainable["head.weight"], trainable["head.bias"]
            )
        shapes = {n: t.shape for n, t in self._trainable_state().items()}
        saved = {n: t.shape for n, t in trainable.items()}
        if state["config"] != self.config or saved != shapes:
            raise ConfigError(
                f"BackboneLengthRanker.load_state_dict: saved with {state['config']} and "
                f"{len(saved)} adapter/head tensors; this ranker is {self.config} with "
                f"{len(shapes)}. Build it with the saved settings on its training backbone."
            )
        self.model.load_state_dict(trainable, strict=False)
        self._log_mean, self._log_std = state["log_mean"], state["log_std"]
        self._fitted = state["fitted"]
        self.online.load_state_dict(state)
