"""Supervised warm start on demonstrated episodes, in the token layout RL trains on.

A demonstration is the model turns of a good episode (``demonstrate(row) -> [turn text, ...]``).
Each is played against a fresh environment exactly as ``EpisodeRunner`` plays the policy's turns:
the first prompt rendered once, each turn's tokens followed by the end-of-turn token, each
observation appended with ``TurnFormat``. The loss covers the turns' tokens only, so the warm
start and RL see the same sequences and train on the same positions.

Examples:
    >>> from streamrl.policy.models import build_bpe_tokenizer, build_tiny_model
    >>> from streamrl.envs import tool_tasks as calc
    >>> rows = calc.calculator_rows(4)
    >>> tok = build_bpe_tokenizer([str(calc.CalculatorEnv().reset(r)) for r in rows], 300)
    >>> turns = calc.calculator_demonstration(rows[0])
    >>> ids, labels = demo_tokens(rows[0], calc.CalculatorEnv(), turns, tok)
    >>> len(ids) == len(labels), sum(label != -100 for label in labels) > 0
    (True, True)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from streamrl.envs.contract import check_reset, check_step, short_repr
from streamrl.envs.episode import TurnFormat
from streamrl.errors import ConfigError
from streamrl.policy.chat import render_prompt
from streamrl.policy.models import build_bpe_tokenizer
from streamrl.policy.sft import Batch
from streamrl.policy.sft_rows import encode_rows, train_in_token_batches
from streamrl.protocols import Environment


def demo_tokens(
    row: Mapping[str, Any],
    env: Environment,
    turns: Sequence[str],
    tokenizer: PreTrainedTokenizerBase,
    *,
    system_prompt: str | None = None,
) -> tuple[list[int], list[int]]:
    """``(input ids, labels)`` of one demonstrated episode (labels ``-100`` off the turns).

    Raises:
        EnvError: ``reset`` or ``step`` returned what the RL episodes would refuse
            (``streamrl.envs.contract``).
        ConfigError: the environment ended the episode before the last demonstrated turn.
    """
    fmt = TurnFormat(tokenizer)
    end = fmt.end_of_turn_id()
    pid = row.get("prompt_id")
    try:
        prompt = check_reset(env, env.reset(row), pid)
        ids = render_prompt(tokenizer, prompt, system_prompt=system_prompt)
        labels = [-100] * len(ids)
        for k, text in enumerate(turns):
            turn = [*tokenizer(text, add_special_tokens=False)["input_ids"], end]
            ids, labels = ids + turn, labels + turn
            step = check_step(env, env.step(text), pid)
            if step.done:
                if k != len(turns) - 1:
                    raise ConfigError(
                        f"Demonstration of {pid!r}: the episode ended after turn {k + 1} of "
                        f"{len(turns)}; demonstrate only the turns the environment takes."
                    )
                break
            observed = fmt.observation_ids(turn, step.role, step.observation)
            ids, labels = ids + observed, labels + [-100] * len(observed)
    finally:
        env.close()
    return ids, labels


def demonstrated(
    demonstrate: Callable[[Mapping[str, Any]], Sequence[str]], row: Mapping[str, Any]
) -> list[str]:
    """``demonstrate(row)``, checked: a non-empty list (or tuple) of turn texts.

    Raises:
        ConfigError: it returned anything else (a string would play one turn per character).
    """
    turns = demonstrate(row)
    problem = None
    if not isinstance(turns, list | tuple):
        problem = f"{type(turns).__name__} {short_repr(turns)}"
    elif not turns:
        problem = "no turns"
    elif not all(isinstance(text, str) for text in turns):
        kinds = sorted({type(text).__name__ for text in turns if not isinstance(text, str)})
        problem = f"a list with {', '.join(kinds)} items {short_repr(turns)}"
    if problem is not None:
        name = getattr(demonstrate, "__qualname__", None) or repr(demonstrate)
        raise ConfigError(
            f"Demonstrations {getattr(demonstrate, '__module__', '')}:{name} returned {problem} "
            f"for prompt {row.get('prompt_id')!r}; return the model's turns, a list of strings "
            "(['turn 1', 'turn 2', ...])."
        )
    return list(turns)


def sft_on_episodes(
    rows: Iterable[Mapping[str, Any]],
    *,
    make_env: Callable[[], Environment],
    demonstrate: Callable[[Mapping[str, Any]], Sequence[str]],
    tokenizer: PreTrainedTokenizerBase,
    model: PreTrainedModel,
    steps: int,
    lr: float,
    tokens_per_batch: int,
    seed: int,
    show_progress: bool = False,
    progress_file: Path | None = None,
) -> list[float]:
    """Fine-tune ``model`` in place on one demonstrated episode per row; returns the losses.

    Args:
        rows: the task's rows.
        make_env: the run's environment factory.
        demonstrate: a good episode's model turns for a row.
        tokenizer: the policy's tokenizer.
        model: trained in place, left in eval mode.
        steps: optimizer steps (epochs repeat, reshuffled).
        lr: peak learning rate (warm-up, then cosine decay).
        tokens_per_batch: padded tokens per step (episodes of similar length batch together).
        seed: shuffles the batches.
        show_progress: draw a progress bar.
        progress_file: save the training's progress there as it goes, and resume from it
            if it is there (``streamrl.policy.sft.train_steps``).

    Raises:
        ConfigError: no rows, an episode longer than ``tokens_per_batch``, or a demonstration
            that is not a list of turn texts (``demonstrated``).
        EnvError: the environment's ``reset`` or ``step`` returned something malformed.
    """
    demos = [
        demo_tokens(row, make_env(), demonstrated(demonstrate, row), tokenizer) for row in rows
    ]
    if not demos:
        raise ConfigError("sft_on_episodes: no rows to train on.")
    lengths = [len(ids) for ids, _ in demos]

    def batch(idx: list[int]) -> Batch:
        ids, mask, _ = encode_rows(tokenizer, [demos[i][0] for i in idx], [[] for _ in idx])
        labels = ids.new_full(ids.shape, -100)
        for row, i in enumerate(idx):
            labels[row, : lengths[i]] = ids.new_tensor(demos[i][1])
        return ids, mask, labels

    return train_in_token_batches(
        model,
        batch,
        lengths,
        tokens_per_batch=tokens_per_batch,
        steps=steps,
        lr=lr,
        seed=seed,
        what="sft_on_episodes: an episode",
        show_progress=show_progress,
        progress_file=progress_file,
    )


def episode_tokenizer(
    rows: Sequence[Mapping[str, Any]],
    make_env: Callable[[], Environment],
    demonstrate: Callable[[Mapping[str, Any]], Sequence[str]],
    *,
    vocab_size: int = 512,
    sample: int = 500,
) -> PreTrainedTokenizerBase:
    """A byte-level BPE (ChatML template) learned from the first ``sample`` rows' demonstrated
    episodes, rendered as the policy will read and write them (deterministic)."""
    bootstrap = build_bpe_tokenizer(["-"], vocab_size=300)  # bytes only: renders the episodes
    texts = [
        bootstrap.decode(demo_tokens(row, make_env(), demonstrated(demonstrate, row), bootstrap)[0])
        for row in rows[:sample]
    ]
    return build_bpe_tokenizer(texts, vocab_size=vocab_size)
