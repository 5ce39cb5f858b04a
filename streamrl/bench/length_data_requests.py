"""Everyday requests with synthetic lengths: a second ranker data set, unlike ``length_data``.

``streamrl bench ranker --make-data FILE --data-kind requests``. The shipped set
(``length_data.py``) asks reasoning-gym questions whose length follows a reference answer. This
one tests the ranker on text it was not tuned on: natural-language requests of nine kinds, with
other length rules and another noise model. Everything is generated here from a seed and word
lists in ``request_words.py``; nothing is downloaded. SYNTHETIC PROMPTS, SYNTHETIC LENGTHS: no
policy answered them. How a row is made (``make_request_rows``):

1. The kinds are dealt in turn (``n / 9`` rows of each; the rows are shuffled at the end), and
   each row draws its prompt and its length rule (``expected``: output tokens, at
   ``TOKENS_PER_WORD`` tokens per word; ``style`` names the rule):

   - ``list``: "List seven ..." / "Give me 12 ...", the count in digits or in words ("a dozen",
     "twenty-five"), each item bare, a sentence or a short explanation: ``6 + n * per_item``.
   - ``write``: a form with its natural length (a haiku ~20 tokens, an essay ~900), alone, with
     a target ("about 300 words": the target) or with a cap ("under 50 words":
     ``min(natural, cap)``; a cap above the natural length changes nothing).
   - ``explain``: a topic of hidden difficulty (x0.6-1.7 of 220 tokens) times a manner
     ("briefly" x0.35, "in detail" x2.5, "step by step" x2, "in one sentence": 30 flat).
   - ``translate`` / ``rewrite``: proportional to a passage in the prompt (its BPE tokens times a
     per-language or per-edit factor: German x1.3, "Shorten this to half its length" x0.5).
   - ``summarise``: a passage, and "in one sentence" (30), "in N bullet points" (16 each), "in
     about N words", or nothing (a quarter of the passage).
   - ``code``: a function of hidden size (60-420 tokens) times its language and extras ("with
     docstrings and unit tests" x2.2, "and explain how it works" +150).
   - ``email``: a base of 150 times its tone ("short" x0.5, "detailed" x2), plus 14 per agenda
     point when the prompt asks for some.
   - ``multi``: 2-6 numbered sub-questions (a fact ~25, a why ~60, a comparison ~90 tokens),
     sometimes announced as "these four questions": the sum of the parts.

   About a third of the prompts carry a number that says nothing about length ("for my 3 kids",
   "in 2024", "a team of 12"), and polite words around the request; a random system message
   (or none) and the ChatML turn markers wrap it.
2. A byte-level BPE tokenizer is trained at run time on the prompts and saved next to the data
   (``<file>.tokenizer.json``), as ``length_data`` does; passages are measured in its tokens.
3. Each of ``samples`` sampled lengths is ``expected * m``, rounded, at least 1 and at most
   ``MAX_TOKENS`` (a policy's ``max_tokens`` cuts a runaway answer). The multiplier ``m`` is not
   the shipped set's log-normal of one spread: faithful kinds (translate, rewrite) have
   ``exp(N(0, 0.15))``, list and email ``exp(N(0, 0.3))``, summarise ``exp(N(0, 0.35))``; open
   kinds (write, explain, code) a heavy-tailed ``exp(0.35 t_3)`` (Student's t, 3 degrees of
   freedom) and, one sample in twenty, a runaway x2-4; ``multi`` draws each part's noise
   (``exp(N(0, 0.45))``) on its own, so the sum is steadier the more parts it has.

``expected`` is the rule's length before noise, which the bench ranks by for its oracle: the
median of the row's sampled lengths (the noise is centred in log space), except for ``multi``,
whose parts' noises add up to a sum about 10% above it.

Example:
    python -m streamrl.bench.length_data_requests requests_lengths.jsonl
"""

from __future__ import annotations

import math
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from streamrl.bench import request_words as words
from streamrl.bench.length_data import chat, train_bpe, write_rows

TOKENS_PER_WORD = 1.35
MAX_TOKENS = 4096
KINDS = ("list", "write", "explain", "translate", "rewrite", "summarise", "code", "email", "multi")
# Spread of log m per kind: log-normal ones, then the heavy-tailed open kinds (Student's t).
LOG_NORMAL = {"translate": 0.15, "rewrite": 0.15, "list": 0.3, "email": 0.3, "summarise": 0.35}
HEAVY = {"write": 0.35, "explain": 0.35, "code": 0.35}


@dataclass(frozen=True)
class Made:
    """A request before its lengths are drawn.

    Attributes:
        kind: one of ``KINDS``.
        style: the length rule applied (the row's ``"style"``).
        text: the user's request.
        rule: its expected length, given a token counter for passages.
        parts: ``multi`` only: each sub-answer's expected tokens (noised one by one).
    """

    kind: str
    style: str
    text: str
    rule: Callable[[Callable[[str], int]], float]
    parts: tuple[float, ...] = ()


def _count(n: int, rng: random.Random) -> str:
    """``n`` in digits or in words, as people write counts."""
    if rng.random() < 0.5:
        return str(n)
    return "a dozen" if n == 12 and rng.random() < 0.5 else words.number_words(n)


def _list(rng: random.Random) -> Made:
    n = rng.randint(3, 30)
    things, item = rng.choice(words.LIST_THINGS), rng.choice(list(words.ITEM_DETAIL))
    phrase, per_item = words.ITEM_DETAIL[item]
    head = rng.choice(("List", "Give me", "Suggest", "Name", "Come up with"))
    return Made(
        "list", item, f"{head} {_count(n, rng)} {things}{phrase}.", lambda _: 6 + n * per_item
    )


def _write(rng: random.Random) -> Made:
    form, natural = rng.choice(list(words.FORMS.items()))
    text = f"Write {form} about {rng.choice(words.TOPICS)[0]}"
    style = rng.choice(("free", "target", "cap"))
    if style == "free":
        return Made("write", style, text + ".", lambda _: natural)
    limit = rng.choice((20, 30, 50, 80, 100, 150, 200, 250, 300, 400, 500, 600, 800))
    phrases = {
        "target": ("of about {} words", "in roughly {} words", "around {} words long"),
        "cap": ("in under {} words", "in no more than {} words", "of at most {} words"),
    }[style]
    # A target sets the length; a cap only cuts a form that would run longer.
    length = limit * TOKENS_PER_WORD if style == "target" else min(natural, limit * TOKENS_PER_WORD)
    text = f"{text} {rng.choice(phrases).format(_count(limit, rng))}."
    return Made("write", style, text, lambda _: length)


def _explain(rng: random.Random) -> Made:
    topic, difficulty = rng.choice(words.TOPICS)
    manner, (phrase, factor, flat) = rng.choice(list(words.MANNERS.items()))
    text = rng.choice(("Explain {}{}.", "Can you explain {}{}?", "Tell me about {}{}."))
    expected = flat or 220 * difficulty * factor
    return Made("explain", manner, text.format(topic, phrase), lambda _: expected)


def _passage(rng: random.Random, low: int, high: int) -> str:
    target, sentences = rng.randint(low, high), []
    while sum(len(s.split()) for s in sentences) < target:
        sentences.append(words.sentence(rng))
    return " ".join(sentences)


def _translate(rng: random.Random) -> Made:
    language, factor = rng.choice(list(words.LANGUAGES.items()))
    passage = _passage(rng, 5, 160)
    text = rng.choice(("Translate into {}: {}", "Translate this to {}:\n\n{}"))
    return Made(
        "translate", language, text.format(language, passage), lambda n: 3 + factor * n(passage)
    )


def _rewrite(rng: random.Random) -> Made:
    edit, (phrase, factor) = rng.choice(list(words.EDITS.items()))
    passage = _passage(rng, 10, 160)
    return Made("rewrite", edit, f"{phrase}:\n\n{passage}", lambda n: 5 + factor * n(passage))


def _summarise(rng: random.Random) -> Made:
    passage = _passage(rng, 40, 320)
    style = rng.choice(("sentence", "bullets", "words", "free"))
    count = rng.randint(2, 9) if style == "bullets" else rng.choice((20, 40, 60, 100, 150))
    phrase, rule = {
        "sentence": (" in one sentence", lambda n: 30),
        "bullets": (f" in {_count(count, rng)} bullet points", lambda n: 4 + 16 * count),
        "words": (f" in about {_count(count, rng)} words", lambda n: count * TOKENS_PER_WORD),
        "free": ("", lambda n: 10 + 0.25 * n(passage)),
    }[style]
    return Made("summarise", style, f"Summarise the following{phrase}:\n\n{passage}", rule)


def _code(rng: random.Random) -> Made:
    task, size = rng.choice(words.CODE_TASKS)
    language, factor = rng.choice(list(words.CODE_LANGUAGES.items()))
    extra, (phrase, times, plus) = rng.choice(list(words.CODE_EXTRAS.items()))
    text = f"Write a {language} function that {task}{phrase}."
    return Made("code", extra, text, lambda _: size * factor * times + plus)


def _email(rng: random.Random) -> Made:
    tone, factor = rng.choice(list(words.TONES.items()))
    text = (
        f"Draft {tone} email to {rng.choice(words.RECIPIENTS)} about {rng.choice(words.SUBJECTS)}"
    )
    points = rng.randint(2, 8) if rng.random() < 0.4 else 0
    if points:
        text += f", with {_count(points, rng)} agenda points"
    return Made("email", tone.split()[-1], text + ".", lambda _: 150 * factor + 14 * points)


def _multi(rng: random.Random) -> Made:
    questions = [rng.choice(words.QUESTIONS) for _ in range(rng.randint(2, 6))]
    announced = f" {_count(len(questions), rng)}" if rng.random() < 0.5 else ""
    lines = [f"Answer these{announced} questions:"]
    for i, (question, _) in enumerate(questions, start=1):
        lines.append(f"{i}. {question.format(*rng.sample(words.NOUNS, 2))}")
    parts = tuple(float(size) for _, size in questions)
    return Made("multi", f"{len(parts)} parts", "\n".join(lines), lambda _: 5 + sum(parts), parts)


MAKERS: dict[str, Callable[[random.Random], Made]] = {
    "list": _list,
    "write": _write,
    "explain": _explain,
    "translate": _translate,
    "rewrite": _rewrite,
    "summarise": _summarise,
    "code": _code,
    "email": _email,
    "multi": _multi,
}


def _dress(text: str, rng: random.Random) -> str:
    """Polite words and, a third of the time, a number that says nothing about length."""
    if rng.random() < 0.35:
        text = f"{text} {rng.choice(words.DISTRACTORS).format(rng.choice((2, 3, 4, 5, 12, 2024)))}"
    if rng.random() < 0.4:
        text = f"{rng.choice(words.OPENERS)} {text[0].lower()}{text[1:]}"
    return text


def _sample(made: Made, expected: float, rng: random.Random) -> int:
    """One sampled length: ``expected`` times the kind's noise (see the module docstring)."""
    if made.parts:  # each part's noise on its own: steadier the more parts
        length = 5 + sum(size * math.exp(rng.gauss(0.0, 0.45)) for size in made.parts)
    elif made.kind in LOG_NORMAL:
        length = expected * math.exp(rng.gauss(0.0, LOG_NORMAL[made.kind]))
    else:  # Student's t with 3 degrees of freedom, and now and then a runaway answer
        t = rng.gauss(0.0, 1.0) / math.sqrt(sum(rng.gauss(0.0, 1.0) ** 2 for _ in range(3)) / 3)
        runaway = rng.uniform(2.0, 4.0) if rng.random() < 0.05 else 1.0
        length = expected * math.exp(HEAVY[made.kind] * t) * runaway
    return min(MAX_TOKENS, max(1, round(length)))


def make_request_rows(
    n: int = 3000, samples: int = 8, seed: int = 0, vocab_size: int = 4096
) -> tuple[list[dict], object]:
    """``(rows, tokenizer)``: ``n`` requests, kinds drawn evenly, with ``samples`` synthetic
    lengths each (the module docstring says exactly how), and the trained BPE tokenizer.

    Raises:
        ValueError: ``n`` or ``samples`` below 1.
    """
    if n < 1 or samples < 1:
        raise ValueError(f"make_request_rows: need n >= 1 and samples >= 1, got {n}, {samples}.")
    rng = random.Random(seed)
    made = [MAKERS[KINDS[i % len(KINDS)]](rng) for i in range(n)]
    prompts = [chat(rng.choice(words.SYSTEMS), _dress(m.text, rng)) for m in made]
    tokenizer = train_bpe(prompts, vocab_size)
    rows = []
    for m, prompt in zip(made, prompts):
        expected = m.rule(lambda text: len(tokenizer.encode(text).ids))
        lengths = [_sample(m, expected, rng) for _ in range(samples)]
        row = {"prompt": prompt, "lengths": lengths, "expected": round(expected, 2)}
        rows.append({**row, "task": m.kind, "style": m.style})
    rng.shuffle(rows)
    return rows, tokenizer


def write_request_data(path: str | Path, seed: int = 0, **kwargs) -> Path:
    """Write ``make_request_rows`` to ``path`` (JSONL) and its tokenizer to
    ``<path>.tokenizer.json``; returns the tokenizer's path."""
    return write_rows(path, *make_request_rows(seed=seed, **kwargs))


if __name__ == "__main__":
    write_request_data(sys.argv[1] if len(sys.argv) > 1 else "requests_lengths.jsonl")
