"""Backbone output-length ranker: a LoRA-tuned causal LM with a length head (StreamRL §5.2).

The paper predicts output lengths with a fine-tuned LLM (a 7B causal LM in §5.2): the model reads
the prompt, and a small head on its final hidden state scores how long the policy will answer.
This is that option. It differs from the default ``LengthRanker`` (``ranker.py``) in cost, not in
contract: the fast ranker is an MLP on hashed prompt features that trains in seconds on a CPU,
while this one runs a transformer forward and backward per prompt, so it is slower by orders of
magnitude and meant for GPUs, large length data sets, or prompts whose length cue is semantic
(natural-language instructions rather than the built-in tasks' visible counts).

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
import os
import random
import time
from collections import deque
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

from streamrl.components.skewness.online_learning import OnlineLearning, fit_afresh
from streamrl.errors import ConfigError
from streamrl.records import Sample

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Pooling = Literal["mean", "last"]

#: Attention projections of Llama/Qwen/Mistral-style models; other architectures name theirs.
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


class _LengthModel(torch.nn.Module):
    """Frozen backbone + LoRA adapters, pooled final hidden state, linear head."""

    def __init__(self, backbone: torch.nn.Module, hidden: int, pooling: Pooling) -> None:
        super().__init__()
        self.backbone, self.pooling = backbone, pooling
        self.head = torch.nn.Linear(hidden, 1)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        states = self.backbone(input_ids=input_ids, attention_mask=attention_mask)[0]  # [b, s, h]
        mask = attention_mask.unsqueeze(-1).to(states.dtype)  # [b, s, 1]
        if self.pooling == "mean":
            pooled = (states * mask).sum(1) / mask.sum(1).clamp(min=1)  # [b, h]
        else:  # the last real token, wherever the padding side put it
            positions = torch.arange(states.shape[1], device=states.device)
            last = (attention_mask * positions).argmax(-1)  # [b]
            pooled = states[torch.arange(len(states), device=states.device), last]  # [b, h]
        return self.head(pooled.float()).squeeze(-1)  # [b]


def _require_peft():
    try:
        import peft
    except ImportError as err:
        raise ConfigError(
            "BackboneLengthRanker needs peft, which is not installed. "
            "Install it with: pip install 'streamrl[peft]'"
        ) from err
    return peft


class BackboneLengthRanker(OnlineLearning):
    """Predicts output lengths with a LoRA-tuned causal LM; a ``LengthPredictor`` like
    ``LengthRanker`` (``learn`` online; ``fit``, ``update`` and ``refresh`` as well).

    Trained by regression on the standardised log-length plus a pairwise ranking term within each
    mini-batch: order matters more than the value (§5.2). The model is kept in eval mode (LoRA
    dropout is 0), so training and prediction are deterministic for a given seed.

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
    ) -> None:
        peft = _require_peft()
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
        self.learn_epochs, self.refresh_epochs = learn_epochs, refresh_epochs
        self.device = torch.device(device)
        self.recent: deque[tuple[str, int]] = deque(maxlen=buffer)
        self.train_s = 0.0
        base, self.tokenizer = _load_backbone(backbone, tokenizer)
        _check_targets(base, target_modules)
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
            self.model = _LengthModel(wrapped, base.config.hidden_size, pooling)
        #: Backbone with adapters, plus the head; trained in eval mode (no dropout anywhere).
        self.model.to(self.device).eval()
        self._initial = copy.deepcopy(self._trainable_state())
        self._log_mean, self._log_std = 0.0, 1.0
        self._fitted = False

    @property
    def net(self) -> torch.nn.Module | None:
        """The trained model, ``None`` until fitted (as ``LengthRanker.net``)."""
        return self.model if self._fitted else None

    def trainable_parameters(self) -> dict[str, torch.nn.Parameter]:
        """The parameters that train: LoRA adapters and the length head."""
        return {n: p for n, p in self.model.named_parameters() if p.requires_grad}

    def fit(
        self, prompts: Sequence[str], lengths: Sequence[int], epochs: int | None = None
    ) -> None:
        """Train adapters and head from their initial values on ``(prompt, length)`` pairs."""
        if len(prompts) != len(lengths) or len(prompts) < 2:
            raise ValueError(
                "BackboneLengthRanker.fit: need >= 2 prompts and one length per prompt."
            )
        started = time.perf_counter()
        self.model.load_state_dict(self._initial, strict=False)
        logs = [math.log1p(n) for n in lengths]
        mean = sum(logs) / len(logs)
        std = math.sqrt(sum((v - mean) ** 2 for v in logs) / len(logs))
        self._log_mean, self._log_std = mean, max(std, 1e-3)
        self._train(list(prompts), list(lengths), epochs or self.epochs)
        self._fitted = True
        self.recent.extend(zip(prompts, (int(n) for n in lengths)))
        self.train_s = time.perf_counter() - started

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

    def _train(self, prompts: list[str], lengths: list[int], epochs: int) -> None:
        params = list(self.trainable_parameters().values())
        optimizer = torch.optim.AdamW(params, lr=self.lr, weight_decay=1e-4)
        target = (torch.log1p(torch.tensor(lengths, dtype=torch.float32)) - self._log_mean) / (
            self._log_std
        )
        order = list(range(len(prompts)))
        shuffler = random.Random(self.seed)
        for _ in range(epochs):
            shuffler.shuffle(order)
            for start in range(0, len(order), self.batch_size):
                index = order[start : start + self.batch_size]
                pred = self.model(**self._batch([prompts[i] for i in index]))  # [b]
                loss = self._loss(pred, target[index].to(self.device))
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()

    def _loss(self, pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """MSE on standardised log-length + logistic loss on every ordered pair in the batch."""
        sign = torch.sign(y[:, None] - y[None, :])  # [b, b]; ties and the diagonal give 0
        margin = pred[:, None] - pred[None, :]  # [b, b]
        pairs = sign != 0
        rank = torch.nn.functional.softplus(-sign * margin)[pairs].mean() if pairs.any() else 0.0
        return torch.nn.functional.mse_loss(pred, y) + self.rank_weight * rank

    @torch.no_grad()
    def predict(self, prompts: Sequence[str]) -> list[float]:
        """Predicted output lengths (tokens) of ``prompts``; their order is what matters."""
        if not self._fitted:
            raise RuntimeError(
                "BackboneLengthRanker.predict: not ready; call learn() or fit() first."
            )
        # Batched by token length, so that little padding is computed.
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        scores = [0.0] * len(prompts)
        for start in range(0, len(order), self.batch_size):
            index = order[start : start + self.batch_size]
            pred = self.model(**self._batch([prompts[i] for i in index])).cpu()
            lengths = torch.expm1(pred * self._log_std + self._log_mean).clamp(min=0)
            for i, value in zip(index, lengths.tolist()):
                scores[i] = value
        return scores

    def update(self, samples: Iterable[Sample], texts: dict[str, str], epochs: int = 1) -> None:
        """Refresh online from finished samples (policy lengths drift during RL).

        Args:
            samples: finished samples of the policy.
            texts: prompt text by ``prompt_id``.
            epochs: passes over the recent buffer (each is ``len(buffer) / batch_size`` steps
                through the backbone, so far costlier than a ``LengthRanker`` epoch).
        """
        self.recent.extend((texts[s.prompt_id], s.length) for s in samples)
        self.refresh(epochs)

    def refresh(self, epochs: int = 1) -> None:
        """Fine-tune on the recent buffer (or fit from scratch if never fitted)."""
        if not self._fitted:
            fit_afresh(self, list(self.recent), None)
            return
        prompts, lengths = zip(*self.recent)
        started = time.perf_counter()
        self._train(list(prompts), list(lengths), epochs)
        self.train_s += time.perf_counter() - started

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
            "recent": list(self.recent),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore from ``state_dict()``; this ranker must be built on the same backbone.

        Raises:
            ConfigError: the state was saved with other settings or on another backbone.
        """
        shapes = {n: t.shape for n, t in self._trainable_state().items()}
        saved = {n: t.shape for n, t in state["trainable"].items()}
        if state["config"] != self.config or saved != shapes:
            raise ConfigError(
                f"BackboneLengthRanker.load_state_dict: saved with {state['config']} and "
                f"{len(saved)} adapter/head tensors; this ranker is {self.config} with "
                f"{len(shapes)}. Build it with the saved settings on its training backbone."
            )
        self.model.load_state_dict(state["trainable"], strict=False)
        self._log_mean, self._log_std = state["log_mean"], state["log_std"]
        self._fitted = state["fitted"]
        self.recent.clear()
        self.recent.extend(state["recent"])


def _load_backbone(
    backbone: str | Path | torch.nn.Module, tokenizer: PreTrainedTokenizerBase | None
) -> tuple[torch.nn.Module, PreTrainedTokenizerBase]:
    """The base transformer (no LM head: only hidden states are needed) and its tokenizer."""
    if isinstance(backbone, torch.nn.Module):
        if tokenizer is None:
            raise ConfigError(
                "BackboneLengthRanker: a model object needs its tokenizer; pass tokenizer=..."
            )
        # A causal LM's base_model is its transformer body (a base model returns itself).
        base = getattr(backbone, "base_model", backbone)
    else:
        from transformers import AutoModel

        from streamrl.policy.models import load_tokenizer

        path = Path(backbone)
        if not (path / "config.json").is_file():
            raise ConfigError(
                f"BackboneLengthRanker: no model directory at {str(path)!r} (no config.json "
                "there). Pass a local Hugging Face causal-LM directory."
            )
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        tokenizer = tokenizer or load_tokenizer(path)
        base = AutoModel.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    for param in base.parameters():
        param.requires_grad_(False)
    return base, tokenizer


def _check_targets(model: torch.nn.Module, targets: Sequence[str]) -> None:
    names = [name for name, _ in model.named_modules()]
    if not any(name.split(".")[-1] in targets for name in names):
        raise ConfigError(
            f"BackboneLengthRanker: no module of the backbone is named one of {list(targets)}. "
            "Pass target_modules with its attention projection names (e.g. ['c_attn'] for GPT-2)."
        )
