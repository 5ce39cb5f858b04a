"""A learned reward: a local Hugging Face sequence-classification model scores each completion.

``RewardModel`` is the built-in ``reward_model`` reward. It is constructed where the run is
configured (which checks the directory) and loads the model only on its first call, so the
same object can be pickled to a reward worker process and load there, on that process's device.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

from streamrl.errors import ConfigError

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class RewardModel:
    """Score ``prompt + completion`` with a sequence-classification model; the score is one logit.

    Any ``AutoModelForSequenceClassification`` directory works (e.g. a Bradley-Terry reward
    model with one output, or a classifier whose ``label`` logit is the reward), with its
    tokenizer saved in the same directory. A chat prompt (a list of messages) is rendered with
    the tokenizer's chat template, the completion as the assistant's turn; without a template
    the message contents are joined by newlines, then the completion appended. Nothing is
    downloaded: the directory must be local.

    Args:
        path: a local directory holding ``config.json``, the weights and the tokenizer.
        device: where the model runs in the process that calls it (``"cpu"``, ``"cuda:0"``).
        batch_size: texts per forward pass.
        max_length: tokens kept per text (the tokenizer's ``truncation_side`` says which end is
            cut); defaults to the model's ``max_position_embeddings``.
        label: which output's logit is the reward, for a model with several outputs.
        dtype: weights' dtype on load; ``None`` keeps the checkpoint's (``"bfloat16"`` on GPU
            halves memory).

    Raises:
        ConfigError: ``path`` is not a directory with a ``config.json`` and a tokenizer, its
            architecture is not a sequence classifier, or ``label`` is not one of its outputs.

    Example:
        >>> rm = RewardModel("/models/my-rm", device="cuda:0")  # doctest: +SKIP
        >>> rm(["Paris.", "Lyon."], [{"prompt": "Capital of France?"}] * 2)  # doctest: +SKIP
        [2.31, -0.87]
    """

    #: Scores a whole batch per call (see ``streamrl.rewards.spec``).
    batched = True

    def __init__(
        self,
        path: str,
        *,
        device: str = "cpu",
        batch_size: int = 16,
        max_length: int | None = None,
        label: int = 0,
        dtype: Literal["float32", "bfloat16", "float16"] | None = None,
    ) -> None:
        config = _read_config(Path(path))
        # transformers saves the label count as id2label (default two labels).
        num_labels = len(config.get("id2label") or {}) or config.get("num_labels", 2)
        if not 0 <= label < num_labels:
            raise ConfigError(
                f"RewardModel: label={label} but {path} has {num_labels} output(s); pass a "
                f"label in 0..{num_labels - 1} (a one-output reward model takes label=0)."
            )
        if batch_size < 1:
            raise ConfigError(f"RewardModel: batch_size must be at least 1, got {batch_size}.")
        self.path = str(path)
        self.device = device
        self.batch_size = batch_size
        self.max_length = max_length or config.get("max_position_embeddings")
        self.label = label
        self.dtype = dtype
        self._model: Any = None
        self._tokenizer: Any = None

    def __call__(self, completions: list[str], rows: list[dict]) -> list[float]:
        """The ``label`` logit of each ``(row["prompt"], completion)``, in input order.

        Args:
            completions: the completions to score.
            rows: their prompts' dataset rows (``row["prompt"]``: a string or chat messages).

        Returns:
            One float per completion.
        """
        import torch

        if self._model is None:
            self._load()
        ids = [self._encode(c, r) for c, r in zip(completions, rows)]
        # Longest first, so each batch pads little; scores go back to input order.
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
        scores = [0.0] * len(ids)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            input_ids, attention_mask = self._pad([ids[i] for i in chunk])
            with torch.inference_mode():
                logits = self._model(input_ids=input_ids, attention_mask=attention_mask).logits
            # logits: [batch, num_labels]
            for i, score in zip(chunk, logits[:, self.label].float().tolist()):
                scores[i] = score
        return scores

    def _render(self, completion: str, row: dict) -> tuple[str, bool]:
        """The text, and whether the tokenizer should add its special tokens (a chat template
        already wrote them)."""
        prompt = row.get("prompt", "")
        if isinstance(prompt, str):
            return prompt + completion, True
        messages = [*prompt, {"role": "assistant", "content": completion}]
        if getattr(self._tokenizer, "chat_template", None):
            return self._tokenizer.apply_chat_template(messages, tokenize=False), False
        return "\n".join(str(m["content"]) for m in prompt) + "\n" + completion, True

    def _encode(self, completion: str, row: dict) -> list[int]:
        text, add_special_tokens = self._render(completion, row)
        ids = self._tokenizer(
            text,
            add_special_tokens=add_special_tokens,
            truncation=self.max_length is not None,
            max_length=self.max_length,
        )["input_ids"]
        return ids or [self._tokenizer.pad_token_id]  # an empty text still gets a score

    def _pad(self, ids: list[list[int]]) -> tuple[Any, Any]:
        """Right-padded ``input_ids`` and ``attention_mask``, both [batch, longest]. Right
        padding keeps each text's position ids as in an unpadded pass (a decoder numbers them
        from the left edge, which matters for absolute position embeddings), so a score does
        not depend on its batchmates."""
        import torch

        longest = max(len(x) for x in ids)
        input_ids = torch.full((len(ids), longest), self._tokenizer.pad_token_id)
        attention_mask = torch.zeros((len(ids), longest), dtype=torch.long)
        for row, x in enumerate(ids):
            input_ids[row, : len(x)] = torch.tensor(x)
            attention_mask[row, : len(x)] = 1
        return input_ids.to(self.device), attention_mask.to(self.device)

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification

        from streamrl.policy.models import load_tokenizer

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        # Not AutoTokenizer directly: it would rebuild a generic tokenizer.json as the model
        # type's class (Qwen2Tokenizer), which tokenizes differently.
        tokenizer = load_tokenizer(self.path)
        if tokenizer.pad_token is None:
            if tokenizer.eos_token is None:
                raise ConfigError(
                    f"RewardModel: the tokenizer in {self.path} has neither a pad nor an eos "
                    "token, so a batch cannot be padded; set tokenizer.pad_token and save it."
                )
            tokenizer.pad_token = tokenizer.eos_token
        model = AutoModelForSequenceClassification.from_pretrained(
            self.path,
            local_files_only=True,
            dtype=getattr(torch, self.dtype) if self.dtype else "auto",
        )
        # The model finds each text's last token by the pad id: it must be the one we pad with.
        model.config.pad_token_id = tokenizer.pad_token_id
        self._model = model.to(self.device).eval()
        self._tokenizer = tokenizer

    def __getstate__(self) -> dict[str, Any]:
        # A worker loads its own copy: the pickle carries the options, not the weights.
        return {**self.__dict__, "_model": None, "_tokenizer": None}

    def __repr__(self) -> str:
        return f"RewardModel({self.path!r}, device={self.device!r}, label={self.label})"


def _read_config(path: Path) -> dict[str, Any]:
    """``path``'s ``config.json``, checked to be a sequence classifier with a tokenizer."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ConfigError(
            f"RewardModel: {path} has no config.json; pass a local directory saved with "
            "model.save_pretrained(path) (download a Hub model first, e.g. with "
            "`hf download <repo> --local-dir <path>`)."
        )
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"RewardModel: {config_file} is not readable JSON ({err}).") from err
    architectures = config.get("architectures") or []
    if not any(a.endswith("ForSequenceClassification") for a in architectures):
        raise ConfigError(
            f"RewardModel: {path} holds {architectures or 'an unnamed architecture'}, not a "
            "sequence classifier, so it has no trained reward head. Pass a reward model "
            "directory whose config.json lists a '...ForSequenceClassification' architecture "
            "(or use a rule-based reward such as 'math' or 'exact')."
        )
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        raise ConfigError(
            f"RewardModel: {path} has no tokenizer files ({', '.join(_TOKENIZER_FILES)}); save "
            "the model's tokenizer there with tokenizer.save_pretrained(path)."
        )
    return config
