"""Greedy evaluation on held-out prompts: accuracy and the output-length distribution."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import datasets
import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from streamrl.tasks.rewards import exact_match, partial_credit


@dataclass
class EvalResult:
    """What ``evaluate`` measured.

    Attributes:
        accuracy: share of exact-match answers (greedy decoding).
        partial: mean partial-credit reward.
        accuracy_by_task: accuracy per task family.
        length_median / length_p90 / length_max: generated lengths in tokens (EOS excluded).
        length_corr: Pearson correlation between generated and reference answer lengths
            (near 1 means the policy's output length tracks the prompt).
        n: number of prompts.
    """

    accuracy: float
    partial: float
    length_median: float
    length_p90: float
    length_max: int
    length_corr: float
    n: int
    accuracy_by_task: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


@torch.inference_mode()
def generate_greedy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    max_new_tokens: int,
    batch_size: int = 64,
) -> list[list[int]]:
    """Greedy completions (token ids, EOS and padding removed) for each prompt, in order."""
    was_training = model.training
    model.eval()
    tokenizer.padding_side = "left"
    # Batching prompts of similar length wastes less padding and decode steps.
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    outputs: list[list[int]] = [[] for _ in prompts]
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        enc = tokenizer([prompts[i] for i in idx], return_tensors="pt", padding=True)
        gen = model.generate(
            **enc,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        new_tokens = gen[:, enc["input_ids"].shape[1] :]  # [batch, new]
        for row, i in zip(new_tokens.tolist(), idx):
            if tokenizer.eos_token_id in row:
                row = row[: row.index(tokenizer.eos_token_id)]
            outputs[i] = [t for t in row if t != tokenizer.pad_token_id]
    model.train(was_training)
    return outputs


def evaluate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    dataset: datasets.Dataset,
    batch_size: int = 64,
    max_new_tokens: int | None = None,
) -> EvalResult:
    """Greedy-decode every prompt and score it against its answer.

    Args:
        model / tokenizer: the policy.
        dataset: a prompt set (``prompt``, ``answer``, ``task`` columns).
        batch_size: prompts per ``generate`` call.
        max_new_tokens: decode budget; defaults to the longest answer plus 16, within context.
    """
    prompts, answers, tasks = dataset["prompt"], dataset["answer"], dataset["task"]
    if max_new_tokens is None:
        longest_prompt = max(len(tokenizer(p)["input_ids"]) for p in prompts)
        room = int(model.config.max_position_embeddings) - longest_prompt
        max_new_tokens = max(1, min(max(len(a) for a in answers) + 16, room))
    completions = generate_greedy(model, tokenizer, prompts, max_new_tokens, batch_size)
    texts = [tokenizer.decode(c) for c in completions]
    exact = np.array([exact_match(t, a) for t, a in zip(texts, answers)])
    partial = np.array([partial_credit(t, a) for t, a in zip(texts, answers)])
    lengths = np.array([len(c) for c in completions])
    ref_lengths = np.array([len(tokenizer(a)["input_ids"]) for a in answers])
    corr = float(np.corrcoef(lengths, ref_lengths)[0, 1]) if lengths.std() > 0 else 0.0
    by_task = {t: float(exact[np.array(tasks) == t].mean()) for t in sorted(set(tasks))}
    return EvalResult(
        accuracy=float(exact.mean()),
        partial=float(partial.mean()),
        length_median=float(np.median(lengths)),
        length_p90=float(np.percentile(lengths, 90)),
        length_max=int(lengths.max()),
        length_corr=corr,
        n=len(prompts),
        accuracy_by_task=by_task,
    )
