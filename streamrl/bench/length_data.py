"""Chat prompts with synthetic lengths (``streamrl bench ranker --make-data``).

SYNTHETIC LENGTHS, REAL PROMPTS. The prompts are real natural-language questions from
``reasoning_gym`` (many tasks: puzzles, word problems, matrices, ciphers, sorting, logic), put
in a chat format. The "output lengths" are NOT sampled from any policy; they are made up from
each question's reference answer, as follows (``make_length_rows``):

1. A byte-level BPE tokenizer (``tokenizers``, vocabulary ``vocab_size``) is trained at run time
   on the questions and answers; it stands in for the policy's tokenizer and is saved next to the
   data (``<file>.tokenizer.json``) so a ranker can use the same tokens.
2. Each prompt gets a random system message (none, or one of several that say nothing about
   length) and a random answer style appended to the user turn, which sets its expected length
   from ``a`` = tokens of the reference answer and ``q`` = tokens of the question:

   - no instruction:                                   ``expected = 8 + 2 a``
   - "Answer with only the final answer.":             ``expected = 2 + a``
   - "Think step by step, then give the final answer.": ``expected = 16 + 2 a + q / 2``

3. Each of ``samples`` sampled lengths is ``max(1, round(expected * m))`` with an independent
   log-normal multiplier ``m = exp(N(-s^2/2, s^2))`` (mean 1, ``s = noise``): the sampling noise of
   a policy, which no ranker can predict.

So lengths depend on the prompt's content (the task, the size of its grid, list or puzzle, the
instruction) in a learnable but not trivial way, have a long tail (Tower of Hanoi, Game of Life
grids, anagram groups), and are noisy per sample. Rows are ``{"prompt", "lengths", "expected",
"task", "style"}``; ``expected`` lets the bench compute the exact ceiling of this synthetic set.

Example:
    python -m streamrl.bench.length_data chat_lengths.jsonl
"""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import ByteLevelBPETokenizer

# Diverse tasks, from one-token answers to answers of hundreds of tokens.
TASKS = (
    "basic_arithmetic",
    "word_sorting",
    "spell_backward",
    "letter_counting",
    "number_sorting",
    "caesar_cipher",
    "sentence_reordering",
    "rotate_matrix",
    "spiral_matrix",
    "game_of_life",
    "manipulate_matrix",
    "tower_of_hanoi",
    "gsm_symbolic",
    "prime_factorization",
    "word_sequence_reversal",
    "group_anagrams",
    "family_relationships",
    "polynomial_multiplication",
    "binary_matrix",
    "pool_matrix",
    "string_manipulation",
    "knights_knaves",
    "number_filtering",
    "letter_jumble",
)
SYSTEMS = (
    None,
    "You are a helpful assistant.",
    "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
    "You are a careful assistant who solves puzzles and answers questions accurately.",
)
# (instruction appended to the user turn, expected length from answer and question tokens)
STYLES = {
    "plain": ("", lambda a, q: 8 + 2 * a),
    "concise": ("\n\nAnswer with only the final answer.", lambda a, q: 2 + a),
    "steps": (
        "\n\nThink step by step, then give the final answer.",
        lambda a, q: 16 + 2 * a + q / 2,
    ),
}


def chat(system: str | None, user: str) -> str:
    """A ChatML prompt, ready for the assistant's turn."""
    head = f"<|im_start|>system\n{system}<|im_end|>\n" if system else ""
    return f"{head}<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def train_bpe(texts: list[str], vocab_size: int):
    """A byte-level BPE tokenizer (``tokenizers``) trained on ``texts``, with the ChatML turn
    markers as special tokens: the stand-in for a policy's tokenizer."""
    from tokenizers import ByteLevelBPETokenizer

    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train_from_iterator(
        texts,
        vocab_size=vocab_size,
        special_tokens=["<|im_start|>", "<|im_end|>"],
        show_progress=False,
    )
    return tokenizer


def make_length_rows(
    per_task: int = 125,
    samples: int = 8,
    noise: float = 0.5,
    seed: int = 0,
    vocab_size: int = 4096,
):
    """``(rows, tokenizer)``: ``per_task`` prompts of each of ``TASKS`` with ``samples`` synthetic
    lengths each (see the module docstring for exactly how), and the trained BPE tokenizer."""
    import reasoning_gym

    items = []
    for t, task in enumerate(TASKS):
        for entry in reasoning_gym.create_dataset(task, size=per_task, seed=seed * 1000 + t):
            items.append((task, entry["question"], str(entry["answer"])))
    tokenizer = train_bpe([text for _, q, a in items for text in (q, a)], vocab_size)
    rng = random.Random(seed)
    rows = []
    for task, question, answer in items:
        style = rng.choice(list(STYLES))
        suffix, expected_of = STYLES[style]
        a, q = len(tokenizer.encode(answer).ids), len(tokenizer.encode(question).ids)
        expected = expected_of(a, q)
        lengths = [
            max(1, round(expected * math.exp(rng.gauss(-(noise**2) / 2, noise))))
            for _ in range(samples)
        ]
        prompt = chat(rng.choice(SYSTEMS), question + suffix)
        rows.append(
            {
                "prompt": prompt,
                "lengths": lengths,
                "expected": expected,
                "task": task,
                "style": style,
            }
        )
    rng.shuffle(rows)
    return rows, tokenizer


def write_length_data(path: str | Path, seed: int = 0, **kwargs) -> Path:
    """Write ``make_length_rows`` to ``path`` (JSONL) and its tokenizer to
    ``<path>.tokenizer.json``; returns the tokenizer's path."""
    return write_rows(path, *make_length_rows(seed=seed, **kwargs))


def write_rows(path: str | Path, rows: list[dict], tokenizer: ByteLevelBPETokenizer) -> Path:
    """Write a ranker data set's ``rows`` to ``path`` (JSONL) and its ``tokenizer`` to
    ``<path>.tokenizer.json``; returns the tokenizer's path."""
    Path(path).write_text("".join(json.dumps(row) + "\n" for row in rows))
    tokenizer_path = Path(path).with_suffix(".tokenizer.json")
    tokenizer.save(str(tokenizer_path))
    return tokenizer_path


if __name__ == "__main__":
    write_length_data(sys.argv[1] if len(sys.argv) > 1 else "chat_lengths.jsonl")
