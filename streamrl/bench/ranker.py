"""``streamrl bench ranker``: recall@k and Kendall tau of the length rankers (§5.2), and the
held-out coverage of their predicted P90 and the CRPS of their length distributions (issue 34)."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import torch

from streamrl.bench.inputs import check_context
from streamrl.components.skewness.ranker import LengthRanker, word_tokenizer
from streamrl.components.skewness.ranking_metrics import (
    coverage,
    kendall_tau,
    mean_crps,
    recall_at_k,
)
from streamrl.errors import ConfigError

POLICY_MAX_TOKENS = 64  # --from-policy: the longest answer sampled


def load_length_rows(path: str | Path) -> tuple[list[str], list[list[int]], list[float] | None]:
    """``(prompts, samples, expected)`` from JSONL rows ``{"prompt": str, "lengths": [int, ...]}``
    (several sampled output lengths of the prompt) or ``{"prompt": str, "length": int}`` (one).

    ``expected`` holds each row's ``"expected"`` length where every row has one (synthetic data,
    ``streamrl.bench.length_data``), else ``None``.

    Raises:
        ConfigError: no such file, a row that is not such an object or whose lengths are not
            positive integers, or fewer than 10 rows.
    """
    if not Path(path).is_file():
        raise ConfigError(f"--data: no file at {str(path)!r}.")
    prompts, samples, expected = [], [], []
    for line_no, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompt = str(row["prompt"])
            lengths = list(row["lengths"]) if "lengths" in row else [row["length"]]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ConfigError(
                f"{path}:{line_no}: need {{'prompt': str, 'length': int}} or "
                f"{{'prompt': str, 'lengths': [int, ...]}} ({err})."
            ) from err
        for length in lengths or [None]:
            if isinstance(length, bool) or not isinstance(length, int) or length < 1:
                raise ConfigError(
                    f"{path}:{line_no}: length {length!r}; need a positive integer (output tokens)."
                )
        prompts.append(prompt)
        samples.append(lengths)
        expected.append(row.get("expected"))
    if len(prompts) < 10:
        raise ConfigError(f"{path}: {len(prompts)} rows; need at least 10 to split 80/20.")
    known = all(isinstance(e, (int, float)) and not isinstance(e, bool) for e in expected)
    return prompts, samples, [float(e) for e in expected] if known else None


def split(n: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """Seeded 80/20 split of ``range(n)``: (train, test) indices."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    cut = int(0.8 * n)
    return order[:cut], order[cut:]


def held_out_recall(
    scores: list[float] | None, samples: list[list[int]], fraction: float = 0.20
) -> float:
    """recall@``fraction`` of ``scores`` against one sampled length per prompt, averaged over
    which sample is the truth (sample ``j`` of every prompt, for ``j`` below the fewest samples).

    ``scores=None`` scores each truth by the leave-one-out mean: for truth ``j``, the mean of the
    prompt's other samples (the sampling ceiling, see ``sampling_ceiling``).
    """
    truths = min(map(len, samples))
    recalls = []
    for j in range(truths):
        truth = [lengths[j] for lengths in samples]
        loo = scores is None  # leave-one-out: the mean of the prompt's other samples
        ranked = [(sum(s) - s[j]) / (len(s) - 1) for s in samples] if loo else scores
        recalls.append(recall_at_k(ranked, truth, fraction))
    return sum(recalls) / len(recalls)


def sampling_ceiling(rows: list[dict], seed: int = 0, fraction: float = 0.20) -> float:
    """recall@``fraction`` (20%) that a perfect ranker can expect when lengths are sampled, on
    the seeded 20% test split of ``rows`` (``{"lengths": [int, ...]}``, at least two each).

    A perfect ranker knows each prompt's expected length; the truth it is scored against is one
    sampled length. Estimate: for each truth sample ``j``, rank by the mean of the prompt's
    *other* samples (an unbiased estimate of the expected length, independent of the truth),
    then average over ``j``. With few samples this mean is itself noisy, so the estimate is a
    little below the true ceiling (a ranker that pools similar prompts can beat it); where the
    expected length is known (synthetic data) ``bench_ranker`` also reports the exact one.
    """
    samples = [list(row["lengths"]) for row in rows]
    if min(map(len, samples)) < 2:
        raise ValueError("sampling_ceiling: need at least two sampled lengths per prompt.")
    _, test = split(len(samples), seed)
    return held_out_recall(None, [samples[i] for i in test], fraction)


def bench_ranker(data: str, seed: int = 0, backbone: str | None = None, tokenizer=None) -> dict:
    """Train on a seeded 80% split of the prompts, score the other 20%.

    The rankers train on every sampled length of each training prompt (as ``learn`` gets a
    group's samples in a run: their spread is what the predicted distribution learns) and are
    scored against one sampled length per test prompt, averaged over which sample
    (``held_out_recall``): the same truth as the sampling ceiling. Their predicted P90 is scored
    against every sampled length of the test prompts.

    Args:
        data: JSONL rows ``{"prompt": str, "lengths": [int, ...]}`` or ``{"prompt": str,
            "length": int}``.
        seed: split and initialisation seed.
        backbone: a local causal-LM directory: bench the ``BackboneLengthRanker`` on it (LoRA +
            length head) instead of the fast ``LengthRanker``, which then runs on the same split
            as the baseline (under ``"baseline"``).
        tokenizer: the policy's tokenizer, the path of a ``tokenizer.json`` or a model
            directory, or ``"words"`` (``word_tokenizer``): the fast ranker's token features
            use its tokens; ``None``: words.

    Returns:
        recall@20/10/5, Kendall tau, P90 coverage (``"p90_coverage"``: the share of sampled
        lengths at or below the predicted P90; target 0.8-0.97), mean CRPS of the log lengths
        and training seconds of the ranker on the held-out 20%;
        ``"char_baseline"``: the same for the ranker with character features only; with two or
        more samples per prompt, ``"ceiling@20"`` (``sampling_ceiling``), and where the data
        carries expected lengths, ``"oracle@20"``: recall@20 of ranking by them.
    """
    torch.set_num_threads(1)
    prompts, samples, expected = load_length_rows(data)
    if tokenizer is None or tokenizer == "words":
        tokenizer = word_tokenizer
    elif isinstance(tokenizer, (str, Path)):
        tokenizer = _load_tokenizer(tokenizer)
    train_rows, test_rows = split(len(prompts), seed)
    # Every sample of a prompt, as in a run; rows that repeat a prompt add to its samples.
    train = (
        [prompts[i] for i in train_rows for _ in samples[i]],
        [n for i in train_rows for n in samples[i]],
    )
    test_samples = [samples[i] for i in test_rows]
    test = ([prompts[i] for i in test_rows], test_samples)
    result = _score(
        LengthRanker(seed=seed, tokenizer=tokenizer), "fast", train, test, len(train_rows)
    )
    result["char_baseline"] = _score(LengthRanker(seed=seed), "chars", train, test, len(train_rows))
    if backbone is not None:
        from streamrl.components.skewness.backbone_ranker import BackboneLengthRanker

        baseline = result
        result = _score(
            BackboneLengthRanker(backbone, seed=seed), "backbone", train, test, len(train_rows)
        )
        result["baseline"] = baseline
    result["samples"] = min(map(len, test_samples))
    if result["samples"] >= 2:
        result["ceiling@20"] = round(held_out_recall(None, test_samples), 4)
    if expected is not None:
        oracle = [expected[i] for i in split(len(prompts), seed)[1]]
        result["oracle@20"] = round(held_out_recall(oracle, test_samples), 4)
    _print_table(result)
    return result


def _load_tokenizer(path: str | Path):
    if Path(path).is_file():  # a tokenizer.json, e.g. written by streamrl.bench.length_data
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast(tokenizer_file=str(path))
    from streamrl.policy.models import load_tokenizer

    return load_tokenizer(path)


def _score(
    ranker, name: str, train: tuple[list, list], test: tuple[list, list], train_rows: int
) -> dict:
    ranker.fit(*train)
    predicted, samples = ranker.predict(test[0]), test[1]
    distributions = ranker.predict_distribution(test[0])
    every = [(d, n) for d, lengths in zip(distributions, samples) for n in lengths]
    mean = [sum(s) / len(s) for s in samples]
    return {
        "ranker": name,
        "recall@20": round(held_out_recall(predicted, samples, 0.20), 4),
        "recall@10": round(held_out_recall(predicted, samples, 0.10), 4),
        "recall@5": round(held_out_recall(predicted, samples, 0.05), 4),
        "kendall_tau": round(kendall_tau(predicted, mean), 4),
        "p90_coverage": round(coverage(*zip(*every), q=0.9), 4),
        "crps": round(mean_crps(*zip(*every)), 4),
        "train_s": round(ranker.train_s, 2),
        "n_train": train_rows,
        "n_test": len(samples),
    }


def _print_table(result: dict) -> None:
    rows = [result, *(result[k] for k in ("char_baseline", "baseline") if k in result)]
    print(
        f"{'ranker':<10} {'recall@20':>9} {'@10':>6} {'@5':>6} {'tau':>6} {'P90 cov':>8} "
        f"{'CRPS':>6} {'train s':>8}",
        file=sys.stderr,
    )
    for row in rows:
        print(
            f"{row['ranker']:<10} {row['recall@20']:>9.3f} {row['recall@10']:>6.3f} "
            f"{row['recall@5']:>6.3f} {row['kendall_tau']:>6.3f} {row['p90_coverage']:>8.3f} "
            f"{row['crps']:>6.3f} {row['train_s']:>8.1f}",
            file=sys.stderr,
        )
    for key, label in (("ceiling@20", "ceiling (mean of other samples)"), ("oracle@20", "oracle")):
        if key in result:
            print(f"{label:<32} recall@20 {result[key]:.3f}", file=sys.stderr)


def policy_lengths(
    model_dir: str | Path, n_prompts: int, samples: int, temperature: float = 0.7, seed: int = 0
) -> list[dict]:
    """Sample the policy ``samples`` times on ``n_prompts`` task prompts; one row per prompt with
    every sampled length (the ranker is trained and scored on the policy's own lengths)."""
    from streamrl.components.generation.service import StreamGenerationService
    from streamrl.policy.models import load_tokenizer
    from streamrl.records import Request
    from streamrl.tasks import make_prompt_set

    check_context(model_dir, 0)  # a model directory, or a clear error before any work
    tokenizer = load_tokenizer(model_dir)
    prompts = make_prompt_set(n_prompts, seed=seed + 17, median_len=6, max_len=48)["prompt"]
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    check_context(model_dir, max(map(len, ids)) + POLICY_MAX_TOKENS)
    requests = [
        Request(f"p{i}", ids[i], POLICY_MAX_TOKENS, s)
        for i in range(len(prompts))
        for s in range(samples)
    ]
    lengths: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    with StreamGenerationService(model_dir, 2, temperature=temperature, seed=seed) as sgs:
        for sample in sgs.generate(requests):
            lengths[int(sample.prompt_id[1:])].append(sample.length)
    return [
        {"prompt": p, "length": lengths[i][0], "lengths": lengths[i]} for i, p in enumerate(prompts)
    ]
