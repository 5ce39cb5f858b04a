"""Held-out evaluation with the run's own reward: mean reward, pass@1 and pass@k per data source.

Greedy decoding gives ``reward`` (the mean held-out reward under the run's scorer) and
``pass_at_1`` (the share of prompts whose greedy reward reaches ``pass_threshold``); with
``k > 1``, ``k`` sampled completions per prompt give ``pass_at_k`` (the unbiased estimator of
Chen et al. 2021, "Evaluating Large Language Models Trained on Code", §2.1, eq. 1). Without a
scorer the reward is exact match on ``row["answer"]``, so ``reward == accuracy``.

Examples:
    >>> from streamrl.policy.models import build_tiny_model, build_tokenizer
    >>> from streamrl.tasks import make_prompt_set
    >>> tok = build_tokenizer()
    >>> result = evaluate(build_tiny_model(tok, size="test"), tok, make_prompt_set(4))
    >>> result.reward == result.accuracy
    True
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from streamrl.errors import ConfigError, RewardError
from streamrl.tasks.rewards import exact_match, partial_credit

#: ``(completions, rows) -> rewards``, one float per completion (e.g. ``load_rewards(...).score``
#: reduced to its totals).
Score = Callable[[list[str], list[dict]], list[float]]


@runtime_checkable
class Decoder(Protocol):
    """Decodes token-id prompts for ``evaluate``: a model in this process (``ModelDecoder``) or
    the run's generator instances (``streamrl.eval.on_generators.ServiceDecoder``)."""

    context: int  # the policy's context length in tokens (prompt plus completion)

    def __call__(
        self, prompts: list[list[int]], max_new_tokens: int, *, greedy: bool, seed: int = 0
    ) -> list[list[int]]:
        """Each prompt's completion (ids, stop token left out), in order: greedy, or sampled
        (reproducibly from ``seed`` where the decoder can)."""
        ...


#: Decode budget when no row has a reference answer to size it from.
DEFAULT_MAX_NEW_TOKENS = 64


@dataclass
class EvalResult:
    """What ``evaluate`` measured.

    Attributes:
        accuracy: share of exact-match answers (greedy decoding), whatever the scorer.
        partial: mean partial-credit reward against ``answer``.
        length_median / length_p90 / length_max: generated lengths in tokens (EOS excluded).
        length_corr: Pearson correlation between generated and reference answer lengths
            (near 1 means the policy's output length tracks the prompt).
        n: number of prompts.
        accuracy_by_task: accuracy per data source (``task`` column).
        reward: mean greedy reward under the scorer (exact match when none was given).
        pass_at_1: share of prompts whose greedy reward is >= the pass threshold.
        by_task: per data source: ``reward``, ``pass_at_1``, ``n`` (and, with ``k > 1``,
            ``pass_at_k`` and ``sampled_reward``).
        k: samples per prompt (1: greedy only).
        pass_at_k: share of prompts with at least one of ``k`` samples passing (``k > 1``).
        sampled_reward: mean reward over the samples (``k > 1``).
        sampled_pass_at_1: share of samples that pass, an estimate of sampled pass@1 (``k > 1``).
        completions / rewards: the greedy completion texts and their rewards, in row order.
        samples / sample_rewards: per row, its ``k`` sampled texts and their rewards (``k > 1``).
        weight_versions: the policy versions whose tokens were evaluated, when it decoded on
            the run's generators (``streamrl.eval.on_generators``); empty for a model.
    """

    accuracy: float
    partial: float
    length_median: float
    length_p90: float
    length_max: int
    length_corr: float
    n: int
    accuracy_by_task: dict[str, float] = field(default_factory=dict)
    reward: float = 0.0
    pass_at_1: float = 0.0
    by_task: dict[str, dict[str, float]] = field(default_factory=dict)
    k: int = 1
    pass_at_k: float | None = None
    sampled_reward: float | None = None
    sampled_pass_at_1: float | None = None
    completions: list[str] = field(default_factory=list, repr=False)
    rewards: list[float] = field(default_factory=list, repr=False)
    samples: list[list[str]] = field(default_factory=list, repr=False)
    sample_rewards: list[list[float]] = field(default_factory=list, repr=False)
    weight_versions: list[int] = field(default_factory=list)

    def as_dict(self) -> dict:
        """The aggregate numbers (per-row completions and rewards left out), JSON-ready."""
        per_row = ("completions", "rewards", "samples", "sample_rewards")
        return {key: v for key, v in asdict(self).items() if key not in per_row}

    def metrics(self, prefix: str = "eval") -> dict[str, float]:
        """Flat ``prefix/metric`` numbers for a logger: ``eval/reward``, ``eval/pass@1``,
        ``eval/pass@k`` (``k > 1``), ``eval/accuracy`` and ``eval/reward/<task>`` etc."""
        out = {f"{prefix}/reward": self.reward, f"{prefix}/pass@1": self.pass_at_1}
        if self.pass_at_k is not None:
            out[f"{prefix}/pass@k"] = self.pass_at_k
            out[f"{prefix}/sampled_reward"] = float(self.sampled_reward)
        out[f"{prefix}/accuracy"] = self.accuracy
        for task, scores in self.by_task.items():
            out[f"{prefix}/reward/{task}"] = scores["reward"]
            out[f"{prefix}/pass@1/{task}"] = scores["pass_at_1"]
            if "pass_at_k" in scores:
                out[f"{prefix}/pass@k/{task}"] = scores["pass_at_k"]
        return out


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` pass: ``1 - C(n-c, k) / C(n, k)``
    (Chen et al. 2021, eq. 1). With ``n == k`` it is 1 when any sample passes, else 0.

    Examples:
        >>> pass_at_k(4, 0, 4), pass_at_k(4, 1, 4), pass_at_k(4, 2, 1)
        (0.0, 1.0, 0.5)
    """
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@torch.inference_mode()
def generate_completions(
    model: PreTrainedModel,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    eos_token_ids: list[int],
    pad_token_id: int,
    batch_size: int = 64,
    temperature: float | None = None,
) -> list[list[int]]:
    """Completions (token ids; stop token and padding removed) for token-id prompts, in order.

    Prompts are left-padded by hand, so any renderer's ids (a chat template's) work. The model is
    put in eval mode and left in the mode it was in.

    Args:
        model: a causal LM.
        prompts: prompt token ids, one list per prompt.
        max_new_tokens: decode budget per completion.
        eos_token_ids: ids that end a completion.
        pad_token_id: id used for left padding.
        batch_size: prompts per ``generate`` call.
        temperature: ``None`` decodes greedily; a number samples from the tempered distribution
            (no top-k / top-p truncation). Seed the RNG first for reproducible samples.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    sampling = {"do_sample": False}
    if temperature is not None:
        sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    # Batching prompts of similar length wastes less padding and decode steps.
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    outputs: list[list[int]] = [[] for _ in prompts]
    stop = set(eos_token_ids)
    try:
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            width = max(len(prompts[i]) for i in idx)
            ids = [[pad_token_id] * (width - len(prompts[i])) + prompts[i] for i in idx]
            mask = [[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in idx]
            gen = model.generate(
                input_ids=torch.tensor(ids, device=device),  # [batch, width]
                attention_mask=torch.tensor(mask, device=device),
                max_new_tokens=max_new_tokens,
                pad_token_id=pad_token_id,
                eos_token_id=list(eos_token_ids),
                **sampling,
            )
            for row, i in zip(gen[:, width:].tolist(), idx):  # [batch, new]
                end = next((j for j, t in enumerate(row) if t in stop), len(row))
                outputs[i] = [t for t in row[:end] if t != pad_token_id]
    finally:
        model.train(was_training)
    return outputs


class ModelDecoder:
    """A ``Decoder`` on a model in this process (``generate_completions``): a notebook's policy,
    a tiny one. Its samples are seeded (the caller's RNG state is left as it was).

    Args:
        model: a causal LM.
        eos_token_ids: ids that end a completion.
        pad_token_id: id used for left padding.
        batch_size: prompts per ``generate`` call.
        temperature: the sampling temperature of non-greedy completions.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        eos_token_ids: list[int],
        pad_token_id: int,
        batch_size: int = 64,
        temperature: float = 1.0,
    ) -> None:
        self.model, self.temperature = model, temperature
        self.context = int(model.config.max_position_embeddings)
        self.options = dict(
            eos_token_ids=eos_token_ids, pad_token_id=pad_token_id, batch_size=batch_size
        )

    def __call__(
        self, prompts: list[list[int]], max_new_tokens: int, *, greedy: bool, seed: int = 0
    ) -> list[list[int]]:
        if greedy:
            return generate_completions(self.model, prompts, max_new_tokens, **self.options)
        device = next(self.model.parameters()).device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            return generate_completions(
                self.model, prompts, max_new_tokens, temperature=self.temperature, **self.options
            )


def evaluate(
    model: PreTrainedModel | Decoder,
    tokenizer: PreTrainedTokenizerBase,
    dataset: Iterable[Mapping],
    batch_size: int = 64,
    max_new_tokens: int | None = None,
    *,
    score: Score | None = None,
    encode: Callable[[dict], list[int]] | None = None,
    decode: Callable[[list[int]], str] | None = None,
    eos_token_ids: list[int] | None = None,
    k: int = 1,
    temperature: float = 1.0,
    seed: int = 0,
    pass_threshold: float = 1.0,
) -> EvalResult:
    """Greedy-decode every held-out prompt and score it with the run's reward (and, with
    ``k > 1``, sample ``k`` completions per prompt for pass@k).

    Args:
        model: the policy (decoded in this process), or a ``Decoder``: a run evaluates on its
            generator instances (``streamrl.eval.on_generators.ServiceDecoder``).
        tokenizer: the policy's tokenizer.
        dataset: rows (a ``datasets.Dataset`` or dicts) with ``prompt_id``, ``prompt``, ``task``
            (the data source) and, for the default scorer, ``answer``.
        batch_size: prompts per ``generate`` call (a model's).
        max_new_tokens: decode budget (a run passes ``rl.eval``'s); ``None``: the
            longest answer (in tokens) plus 16, or ``DEFAULT_MAX_NEW_TOKENS`` when no row has
            an answer, within the context window.
        score: ``(completions, rows) -> rewards``; default exact match on ``row["answer"]``.
        encode: row -> prompt token ids; default ``tokenizer(row["prompt"])`` (a list of chat
            messages goes through the tokenizer's chat template).
        decode: completion ids -> text; default ``tokenizer.decode(ids, skip_special_tokens=True)``.
        eos_token_ids: ids that end a completion; default ``[tokenizer.eos_token_id]``.
        k: samples per prompt for pass@k; 1 decodes greedily only.
        temperature: sampling temperature of the ``k`` samples (a model's; a decoder samples
            at its own: the generators at the run's temperature).
        seed: seeds the samples of a model (the caller's RNG state is left as it was).
        pass_threshold: a completion passes when its reward is >= this.

    Raises:
        ConfigError: an empty dataset, ``k < 1`` or a chat prompt without a chat template.
        RewardError: ``score`` returned the wrong number of rewards or a non-finite one; the
            message names the prompt.
    """
    rows = [dict(row) for row in dataset]
    if not rows:
        raise ConfigError("evaluate got no rows: pass a non-empty held-out set.")
    if k < 1:
        raise ConfigError(f"k (samples per prompt for pass@k) must be >= 1, got {k}.")
    encode = encode or _default_encode(tokenizer)
    decode = decode or (lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
    score = score or _exact_scores
    eos = list(eos_token_ids) if eos_token_ids is not None else [tokenizer.eos_token_id]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    prompts = [list(encode(row)) for row in rows]
    answers = [row.get("answer") or "" for row in rows]
    ref_lengths = np.array([len(tokenizer(a, add_special_tokens=False).input_ids) for a in answers])
    if isinstance(model, torch.nn.Module):
        model = ModelDecoder(
            model,
            eos_token_ids=eos,
            pad_token_id=pad,
            batch_size=batch_size,
            temperature=temperature,
        )
    if max_new_tokens is None:
        want = int(ref_lengths.max()) + 16 if ref_lengths.max() > 0 else DEFAULT_MAX_NEW_TOKENS
        room = model.context - max(len(p) for p in prompts)
        max_new_tokens = max(1, min(want, room))
    ids = model(prompts, max_new_tokens, greedy=True, seed=seed)
    texts = [decode(c) for c in ids]
    rewards = _checked(score(texts, rows), rows, "greedy")
    lengths = [len(c) for c in ids]
    result = _greedy_result(rows, texts, rewards, lengths, ref_lengths, pass_threshold)
    if k > 1:
        repeated = [p for p in prompts for _ in range(k)]
        sampled = model(repeated, max_new_tokens, greedy=False, seed=seed)
        sample_texts = [decode(c) for c in sampled]
        sample_rows = [row for row in rows for _ in range(k)]
        flat = _checked(score(sample_texts, sample_rows), sample_rows, "sampled")
        _add_samples(result, rows, sample_texts, flat, k, pass_threshold)
    return result


def _greedy_result(
    rows: list[dict],
    texts: list[str],
    rewards: list[float],
    lengths: list[int],
    ref_lengths: np.ndarray,
    threshold: float,
) -> EvalResult:
    answers = [row.get("answer") or "" for row in rows]
    tasks = np.array([row.get("task", "all") for row in rows])
    exact = np.array([exact_match(t, a) for t, a in zip(texts, answers)])
    partial = np.array([partial_credit(t, a) for t, a in zip(texts, answers)])
    reward, lengths = np.array(rewards), np.array(lengths)
    spread = lengths.std() > 0 and ref_lengths.std() > 0
    corr = float(np.corrcoef(lengths, ref_lengths)[0, 1]) if spread else 0.0
    by_task = {}
    for task in sorted(set(tasks.tolist())):
        mine = tasks == task
        by_task[task] = {
            "reward": float(reward[mine].mean()),
            "pass_at_1": float((reward[mine] >= threshold).mean()),
            "n": int(mine.sum()),
        }
    return EvalResult(
        accuracy=float(exact.mean()),
        partial=float(partial.mean()),
        length_median=float(np.median(lengths)),
        length_p90=float(np.percentile(lengths, 90)),
        length_max=int(lengths.max()),
        length_corr=corr,
        n=len(rows),
        accuracy_by_task={t: float(exact[tasks == t].mean()) for t in by_task},
        reward=float(reward.mean()),
        pass_at_1=float((reward >= threshold).mean()),
        by_task=by_task,
        completions=texts,
        rewards=list(rewards),
    )


def _add_samples(
    result: EvalResult,
    rows: list[dict],
    texts: list[str],
    flat: list[float],
    k: int,
    threshold: float,
) -> None:
    """Fill in the sampled numbers: ``flat`` holds each row's ``k`` rewards in a row."""
    per_row = np.array(flat).reshape(len(rows), k)  # [prompts, k]
    passed = (per_row >= threshold).sum(axis=1)  # [prompts]
    solved = np.array([pass_at_k(k, int(c), k) for c in passed])
    tasks = np.array([row.get("task", "all") for row in rows])
    result.k = k
    result.pass_at_k = float(solved.mean())
    result.sampled_reward = float(per_row.mean())
    result.sampled_pass_at_1 = float((per_row >= threshold).mean())
    result.samples = [texts[i * k : (i + 1) * k] for i in range(len(rows))]
    result.sample_rewards = per_row.tolist()
    for task, scores in result.by_task.items():
        mine = tasks == task
        scores["pass_at_k"] = float(solved[mine].mean())
        scores["sampled_reward"] = float(per_row[mine].mean())


def _exact_scores(completions: list[str], rows: list[dict]) -> list[float]:
    return [exact_match(c, row.get("answer") or "") for c, row in zip(completions, rows)]


def _default_encode(tokenizer: PreTrainedTokenizerBase) -> Callable[[dict], list[int]]:
    def encode(row: dict) -> list[int]:
        prompt = row["prompt"]
        if isinstance(prompt, str):
            return tokenizer(prompt)["input_ids"]
        if getattr(tokenizer, "chat_template", None) is None:
            raise ConfigError(
                f"Row {row.get('prompt_id')!r} has a chat prompt (a list of messages) but the "
                "tokenizer has no chat template: pass encode= (row -> prompt token ids)."
            )
        return tokenizer.apply_chat_template(
            prompt, add_generation_prompt=True, tokenize=True, return_dict=False
        )

    return encode


def _checked(rewards: list[float], rows: list[dict], what: str) -> list[float]:
    """The scorer's rewards as floats, or a ``RewardError`` naming the first bad prompt."""
    rewards = list(rewards)
    if len(rewards) != len(rows):
        raise RewardError(
            f"The evaluation scorer returned {len(rewards)} rewards for {len(rows)} {what} "
            f"completions (first prompt_id {rows[0].get('prompt_id')!r}); it must return one "
            "float per completion, in order."
        )
    for reward, row in zip(rewards, rows):
        if not isinstance(reward, numbers.Real) or not math.isfinite(reward):
            raise RewardError(
                f"The evaluation scorer returned {reward!r} for prompt_id "
                f"{row.get('prompt_id')!r} ({what} completion); a reward must be a finite number."
            )
    return [float(r) for r in rewards]
