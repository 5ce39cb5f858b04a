"""``streamrl bench ranker``: recall@k and Kendall tau of the length rankers (§5.2)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from streamrl.bench.inputs import check_context
from streamrl.components.skewness.ranker import LengthRanker
from streamrl.errors import ConfigError
from streamrl.metrics import kendall_tau, recall_at_k

POLICY_MAX_TOKENS = 64  # --from-policy: the longest answer sampled


def load_length_rows(path: str | Path) -> tuple[list[str], list[int]]:
    """``(prompts, lengths)`` from JSONL rows ``{"prompt": str, "length": int}``.

    Raises:
        ConfigError: no such file, a row that is not such an object or whose length is not a
            positive integer, or fewer than 10 rows.
    """
    if not Path(path).is_file():
        raise ConfigError(f"--data: no file at {str(path)!r}.")
    prompts, lengths = [], []
    for line_no, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompt, length = str(row["prompt"]), row["length"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ConfigError(
                f"{path}:{line_no}: need {{'prompt': str, 'length': int}} ({err})."
            ) from err
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ConfigError(
                f"{path}:{line_no}: length {length!r}; need a positive integer (output tokens)."
            )
        prompts.append(prompt)
        lengths.append(length)
    if len(prompts) < 10:
        raise ConfigError(f"{path}: {len(prompts)} rows; need at least 10 to split 80/20.")
    return prompts, lengths


def bench_ranker(data: str, seed: int = 0, backbone: str | None = None) -> dict:
    """Train on a seeded 80% split, score the other 20%.

    Args:
        data: JSONL rows ``{"prompt": str, "length": int}``.
        seed: split and initialisation seed.
        backbone: a local causal-LM directory: bench the ``BackboneLengthRanker`` on it (LoRA +
            length head) instead of the fast ``LengthRanker``, which then runs on the same split
            as the baseline (under ``"baseline"``).

    Returns:
        recall@20/10/5, Kendall tau and training seconds of the ranker on the held-out 20%.
    """
    torch.set_num_threads(1)
    prompts, lengths = load_length_rows(data)
    order = list(range(len(prompts)))
    random.Random(seed).shuffle(order)
    cut = int(0.8 * len(order))
    train = ([prompts[i] for i in order[:cut]], [lengths[i] for i in order[:cut]])
    test = ([prompts[i] for i in order[cut:]], [lengths[i] for i in order[cut:]])
    result = _score(LengthRanker(seed=seed), "fast", train, test)
    if backbone is not None:
        from streamrl.components.skewness.backbone_ranker import BackboneLengthRanker

        baseline = result
        result = _score(BackboneLengthRanker(backbone, seed=seed), "backbone", train, test)
        result["baseline"] = baseline
    return result


def _score(ranker, name: str, train: tuple[list, list], test: tuple[list, list]) -> dict:
    ranker.fit(*train)
    predicted, true = ranker.predict(test[0]), test[1]
    return {
        "ranker": name,
        "recall@20": round(recall_at_k(predicted, true, 0.20), 4),
        "recall@10": round(recall_at_k(predicted, true, 0.10), 4),
        "recall@5": round(recall_at_k(predicted, true, 0.05), 4),
        "kendall_tau": round(kendall_tau(predicted, true), 4),
        "train_s": round(ranker.train_s, 2),
        "n_train": len(train[0]),
        "n_test": len(true),
    }


def policy_lengths(
    model_dir: str | Path, n_prompts: int, samples: int, temperature: float = 0.7, seed: int = 0
) -> list[dict]:
    """Sample the policy ``samples`` times on ``n_prompts`` task prompts; one row per prompt with
    every sampled length (the ranker is trained and scored on the policy's own lengths)."""
    from streamrl.components.generation.service import StreamGenerationService
    from streamrl.models import load_tokenizer
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


def sampling_ceiling(rows: list[dict], seed: int = 0) -> float:
    """recall@20 of the best possible ranker when lengths are sampled: rank each test prompt by
    its mean length over the *other* samples, score against the one sample used as truth."""
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    test = order[int(0.8 * len(order)) :]
    truth = [rows[i]["lengths"][0] for i in test]
    mean_rest = [sum(rows[i]["lengths"][1:]) / max(1, len(rows[i]["lengths"]) - 1) for i in test]
    return recall_at_k(mean_rest, truth, 0.20)
