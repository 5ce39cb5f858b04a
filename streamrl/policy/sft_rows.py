"""Supervised warm start on any prompt dataset: learn ``prompt -> answer <eos>`` from its rows.

``streamrl.policy.sft`` warm-starts on the built-in toy tasks with a demonstrator that errs on
purpose; this is the same training step for rows of any prompt set (a reasoning-gym mix, a local
file), with the prompt rendered by any ``render(tokenizer, prompt) -> token ids`` (plain
tokenization by default; ``streamrl.policy.chat.render_prompt`` for a chat template). The loss
covers the answer and EOS tokens only. To leave RL room to improve, pass imperfect answers in the
rows (see ``corrupt``).

Examples:
    >>> from streamrl.policy.models import build_tiny_model, build_tokenizer
    >>> tok = build_tokenizer()
    >>> model = build_tiny_model(tok, size="test")
    >>> rows = [{"prompt": "rev ab=", "answer": "ba"}] * 8
    >>> losses = sft_on_rows(rows, tokenizer=tok, model=model, steps=3, lr=1e-3,
    ...                      tokens_per_batch=64, seed=0)
    >>> len(losses)
    3
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from streamrl.errors import ConfigError
from streamrl.policy.sft import Batch, token_budget_batches, train_steps

#: ``render(tokenizer, prompt) -> prompt token ids``.
Render = Callable[[PreTrainedTokenizerBase, Any], list[int]]


def plain_render(tokenizer: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    """The prompt's own tokens, no template."""
    return tokenizer(prompt, add_special_tokens=False)["input_ids"]


def encode_rows(
    tokenizer: PreTrainedTokenizerBase, prompts: list[list[int]], answers: list[list[int]]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``(input_ids, attention_mask, labels)`` from token ids; labels only on
    the answer tokens (``answers`` already end with EOS)."""
    rows = [p + a for p, a in zip(prompts, answers)]
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    fill = [width - len(r) for r in rows]
    input_ids = torch.tensor([r + [pad] * f for r, f in zip(rows, fill)])  # [batch, seq]
    mask = torch.tensor([[1] * len(r) + [0] * f for r, f in zip(rows, fill)])  # [batch, seq]
    labels = torch.tensor(
        [[-100] * len(p) + a + [-100] * f for p, a, f in zip(prompts, answers, fill)]
    )  # [batch, seq]
    return input_ids, mask, labels


def sft_on_rows(
    rows: Iterable[Mapping[str, Any]],
    *,
    tokenizer: PreTrainedTokenizerBase,
    model: PreTrainedModel,
    steps: int,
    lr: float,
    tokens_per_batch: int,
    seed: int,
    render: Render | None = None,
    show_progress: bool = False,
    progress_file: Path | None = None,
) -> list[float]:
    """Fine-tune ``model`` in place on the rows' ``prompt -> answer <eos>`` demonstrations.

    Batches group rows of similar length up to ``tokens_per_batch`` padded tokens
    (``streamrl.policy.sft.token_budget_batches``); AdamW with linear warm-up over the first 5% of
    steps, then cosine decay; gradient norm clipped at 1.

    Args:
        rows: mappings with ``prompt`` and ``answer`` (a ``datasets.Dataset`` works).
        tokenizer: encodes answers (and prompts, unless ``render`` does).
        model: a causal LM, trained in place and left in eval mode.
        steps: optimizer steps (epochs repeat, reshuffled).
        lr: peak learning rate.
        tokens_per_batch: padded tokens per step.
        seed: shuffles the batches.
        render: ``render(tokenizer, prompt) -> ids``; default ``plain_render``.
        show_progress: draw a progress bar.
        progress_file: save the training's progress there as it goes, and resume from it
            if it is there (``streamrl.policy.sft.train_steps``).

    Returns:
        The loss of every step (mean over the step's answer tokens).

    Raises:
        ValueError: no rows, or (``ConfigError``) a demonstration longer than
            ``tokens_per_batch``.
    """
    render = render or plain_render
    eos = tokenizer.eos_token_id
    prompts, answers = [], []
    for row in rows:
        prompts.append(list(render(tokenizer, row["prompt"])))
        answers.append([*tokenizer(str(row["answer"]), add_special_tokens=False)["input_ids"], eos])
    if not prompts:
        raise ValueError("sft_on_rows: no rows to train on.")

    def batch(idx: list[int]) -> Batch:
        return encode_rows(tokenizer, [prompts[i] for i in idx], [answers[i] for i in idx])

    return train_in_token_batches(
        model,
        batch,
        [len(p) + len(a) for p, a in zip(prompts, answers)],
        tokens_per_batch=tokens_per_batch,
        steps=steps,
        lr=lr,
        seed=seed,
        what="sft_on_rows: a demonstration",
        show_progress=show_progress,
        progress_file=progress_file,
    )


def train_in_token_batches(
    model: PreTrainedModel,
    make_batch: Callable[[list[int]], Batch],
    lengths: list[int],
    *,
    tokens_per_batch: int,
    steps: int,
    lr: float,
    seed: int,
    what: str,
    show_progress: bool = False,
    progress_file: Path | None = None,
) -> list[float]:
    """``train_steps`` over examples of ``lengths`` tokens, grouped by ``token_budget_batches``
    and shuffled from ``seed``: the warm start on your rows and on episodes alike.

    Args:
        what: the caller and its kind of example, for the error (``"sft_on_rows: a
            demonstration"``).

    Raises:
        ConfigError: an example is longer than ``tokens_per_batch``.
    """
    if max(lengths) > tokens_per_batch:
        raise ConfigError(
            f"{what} has {max(lengths)} tokens, more than tokens_per_batch={tokens_per_batch}; "
            "raise tokens_per_batch."
        )
    return train_steps(
        model,
        make_batch,
        token_budget_batches(lengths, tokens_per_batch),
        steps=steps,
        lr=lr,
        rng=random.Random(seed),
        show_progress=show_progress,
        progress_file=progress_file,
    )


def corrupt(
    rows: Iterable[Mapping[str, Any]], share: float, seed: int, alphabet: str | None = None
) -> list[dict]:
    """Copies of ``rows`` where a ``share`` of the answers has one typo (``streamrl.policy.sft``'s
    ``corrupt_answer``): an imperfect demonstrator, so the warm start is wrong often enough for
    a verifiable reward to improve it. Document it wherever a result depends on it."""
    from streamrl.policy.sft import corrupt_answer

    rows = [dict(r) for r in rows]
    rng = random.Random(seed)
    alphabet = alphabet or "".join(sorted({c for r in rows for c in str(r["answer"])})) or "a"
    for row in rows:
        if str(row["answer"]) and rng.random() < share:
            row["answer"] = corrupt_answer(str(row["answer"]), rng, alphabet)
    return rows
