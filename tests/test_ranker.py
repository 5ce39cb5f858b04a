"""The length ranker learns the order of output lengths and handles any prompt text."""

from __future__ import annotations

import json
import math
import random
from collections import deque

import pytest

from streamrl.algorithms import GRPO
from streamrl.cli import main
from streamrl.components.skewness.ranker import LengthRanker, prompt_features
from streamrl.metrics import recall_at_k
from streamrl.prompts import PromptSource
from streamrl.protocols import LengthPredictor
from streamrl.records import Sample
from streamrl.rollout import RolloutStream
from streamrl.tasks import make_prompt_set


def test_ranker_learns_length_order_on_held_out_prompts():
    ds = make_prompt_set(600, seed=3, median_len=6, max_len=48)
    prompts, lengths = ds["prompt"], ds["answer_len"]
    ranker = LengthRanker(epochs=200, seed=0)
    ranker.fit(prompts[:480], lengths[:480])
    predicted = ranker.predict(prompts[480:])
    # A random order gets 0.2 in expectation; a trained ranker far more.
    assert recall_at_k(predicted, lengths[480:], 0.2) >= 0.6


def test_ranker_handles_unseen_text_and_round_trips_state():
    ranker = LengthRanker(epochs=20, seed=0)
    ranker.fit(["count 1 3=", "count 1 90=", "copy ab=", "rev abcdefgh="], [5, 260, 2, 8])
    odd = ["Écris un poème de 200 mots 🙂", "", "SELECT * FROM t WHERE x > 3.5;"]
    assert all(math.isfinite(v) and v >= 0 for v in ranker.predict(odd))
    assert prompt_features("").shape == prompt_features("x" * 1000).shape
    copy = LengthRanker()
    copy.load_state_dict(ranker.state_dict())
    assert copy.predict(odd) == ranker.predict(odd)


def test_online_update_follows_drifting_lengths():
    ranker = LengthRanker(epochs=100, seed=0)
    prompts = [f"copy {'a' * n}=" for n in range(1, 30)]
    ranker.fit(prompts, list(range(1, 30)))  # length grows with the string
    before = ranker.predict(["copy a=", "copy aaaaaaaaaaaaaaaaaaaaaaaa="])
    assert before[1] > before[0]
    # The policy drifts: now short strings get long answers. The refresh must notice.
    texts = {f"q{n}": p for n, p in enumerate(prompts)}
    samples = [Sample(f"q{n}", 0, [], [7] * (60 - 2 * n), [], 0, 0) for n in range(29)]
    for _ in range(3):
        ranker.update(samples, texts, epochs=100)
    after = ranker.predict(["copy a=", "copy aaaaaaaaaaaaaaaaaaaaaaaa="])
    assert after[0] > after[1]


def test_bench_ranker_command(tmp_path, capsys):
    ds = make_prompt_set(200, seed=5)
    data = tmp_path / "d.jsonl"
    data.write_text(
        "\n".join(
            json.dumps({"prompt": p, "length": n}) for p, n in zip(ds["prompt"], ds["answer_len"])
        )
    )
    assert main(["bench", "ranker", "--data", str(data)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(result) == {
        "ranker",
        "recall@20",
        "recall@10",
        "recall@5",
        "kendall_tau",
        "train_s",
        "n_train",
        "n_test",
    }
    assert result["ranker"] == "fast" and result["n_train"] == 160 and result["n_test"] == 40
    assert all(0.0 <= result[f"recall@{k}"] <= 1.0 for k in (20, 10, 5))
    assert -1.0 <= result["kendall_tau"] <= 1.0 and result["train_s"] >= 0
    # Reference answer lengths are set by the prompt: 160 examples already order them better
    # than chance (measured: tau 0.27, recall@20 0.375 on 40 held-out prompts).
    assert result["kendall_tau"] > 0.1


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (None, "no file at"),
        (['{"prompt": "copy a=", "length": 0}'], "length 0; need a positive integer"),
        (['{"prompt": "copy a=", "length": 2.5}'], "length 2.5; need a positive integer"),
        (['{"prompt": "copy a="}'], "need {'prompt': str, 'length': int}"),
        (['{"prompt": "copy a=", "length": 3}'] * 3, "3 rows; need at least 10"),
    ],
)
def test_bench_ranker_rejects_bad_data_before_training(tmp_path, capsys, rows, message):
    data = tmp_path / "d.jsonl"
    if rows is not None:
        data.write_text("\n".join(rows))
    assert main(["bench", "ranker", "--data", str(data)]) == 2
    assert message in capsys.readouterr().err


def test_sampling_ceiling_is_perfect_when_lengths_do_not_vary():
    from streamrl.bench.ranker import sampling_ceiling

    rows = [{"prompt": f"p{i}", "length": i, "lengths": [i] * 4} for i in range(50)]
    assert sampling_ceiling(rows) == 1.0


def test_bench_ranker_from_policy_samples_the_policy(tmp_path, capsys, tokenizer):
    from streamrl.models import build_tiny_model, save_policy

    save_policy(build_tiny_model(tokenizer, "test", seed=0), tokenizer, tmp_path / "m")
    argv = [
        "bench",
        "ranker",
        "--from-policy",
        str(tmp_path / "m"),
        "--prompts",
        "30",
        "--samples",
        "3",
        "--write-data",
        str(tmp_path / "d.jsonl"),
    ]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = [json.loads(line) for line in (tmp_path / "d.jsonl").read_text().splitlines()]
    assert len(rows) == 30 and all(len(r["lengths"]) == 3 for r in rows)
    assert 0.0 <= result["ceiling@20"] <= 1.0 and result["n_test"] == 6


def test_ranker_learns_free_text_prompts_unlike_the_task_templates():
    # Natural-language prompts with no task template: the output length follows a number in the
    # text (a word count) or the length of a passage to translate.
    rng = random.Random(0)
    topics = ["rivers", "the moon", "bread", "old trains", "jazz", "glaciers", "tea"]
    prompts, lengths = [], []
    for _ in range(600):
        if rng.random() < 0.5:
            n = rng.randint(3, 120)
            prompts.append(f"Please write about {rng.choice(topics)} in roughly {n} words.")
            lengths.append(int(n * 1.3 + rng.randint(0, 5)))
        else:
            passage = " ".join(rng.choice(topics) for _ in range(rng.randint(1, 40)))
            prompts.append(f"Translate into French: {passage}")
            lengths.append(int(len(passage) * 0.4) + rng.randint(0, 3))
    ranker = LengthRanker(epochs=200, seed=0)
    ranker.fit(prompts[:480], lengths[:480])
    assert recall_at_k(ranker.predict(prompts[480:]), lengths[480:], 0.2) >= 0.6


def test_learn_fits_first_then_refreshes_with_the_constructor_epochs():
    ranker = LengthRanker(seed=0, learn_epochs=7, refresh_epochs=3)
    assert isinstance(ranker, LengthPredictor) and not ranker.ready
    trained = []  # (samples, epochs) of each training run
    train = ranker._train
    ranker._train = lambda x, y, epochs: (trained.append((len(y), epochs)), train(x, y, epochs))
    ranker.learn(["count 1 3="], [5])  # one sample cannot be fitted: kept for the next call
    assert not ranker.ready and trained == [] and len(ranker.recent) == 1
    ranker.learn(["count 1 90=", "copy ab="], [260, 2])  # fits on all three
    assert ranker.ready and trained == [(3, 7)] and len(ranker.recent) == 3
    ranker.learn(["rev abcdefgh="], [8])  # refreshes over the recent buffer
    assert trained == [(3, 7), (4, 3)] and len(ranker.recent) == 4
    assert len(ranker.predict(["count 5 80="])) == 1
    with pytest.raises(ValueError, match="2 prompts but 1 lengths"):
        ranker.learn(["a", "b"], [1])
    fresh = LengthRanker(epochs=5, seed=0)
    fresh.recent.extend([("count 1 3=", 5), ("count 1 90=", 260)])
    fresh.refresh()  # fits on the buffer without adding it twice
    assert fresh.ready and len(fresh.recent) == 2


class _CharTokenizer:
    """One token per character (what RolloutStream needs of a tokenizer)."""

    def __call__(self, text: str) -> dict:
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(map(chr, ids))


class _FakeDispatcher:
    def __init__(self) -> None:
        self.observed: list[list[int]] = []

    def observe(self, lengths) -> None:
        self.observed.append(list(lengths))


class _FakeService:
    """In-process stand-in for the generation service: a prompt's samples are as long as it."""

    def __init__(self) -> None:
        self.dispatcher = _FakeDispatcher()
        self.submitted: list[tuple[list, list[float] | None]] = []  # (requests, scores)
        self._done: deque[Sample] = deque()

    def submit(self, requests, scores=None) -> None:
        self.submitted.append((list(requests), scores))
        for r in requests:
            tokens = list(r.prompt_ids[: r.max_tokens])
            logprobs = [0.0] * len(tokens)
            sample = Sample(r.prompt_id, r.sample_index, r.prompt_ids, tokens, logprobs, 0, 0)
            sample.iteration = r.iteration
            self._done.append(sample)

    def next_sample(self) -> Sample:
        return self._done.popleft()


class _MeanPredictor:
    """A custom length predictor: no base class, just the protocol's methods."""

    def __init__(self) -> None:
        self.learned: list[tuple[list[str], list[int]]] = []
        self.asked: list[list[str]] = []
        self._mean: float | None = None

    @property
    def ready(self) -> bool:
        return self._mean is not None

    def predict(self, prompts):
        self.asked.append(list(prompts))
        return [self._mean + len(p) for p in prompts]

    def learn(self, prompts, lengths) -> None:
        self.learned.append((list(prompts), list(lengths)))
        self._mean = sum(lengths) / len(lengths)

    def state_dict(self) -> dict:
        return {"mean": self._mean}

    def load_state_dict(self, state: dict) -> None:
        self._mean = state["mean"]


def test_any_length_predictor_plugs_into_the_rollout_stream():
    predictor = _MeanPredictor()
    assert isinstance(predictor, LengthPredictor)
    rows = [{"prompt_id": f"p{i}", "prompt": "x" * (i + 1), "answer": ""} for i in range(6)]
    service = _FakeService()
    stream = RolloutStream(
        service,
        PromptSource(rows, 3, seed=0),
        _CharTokenizer(),
        GRPO(lambda completion, answer: float(len(completion) % 2), group_size=2),
        max_tokens=16,
        context=64,
        ranker=predictor,
        ranker_refresh_every=2,
    )
    lengths = []  # of the samples delivered in iterations 0 and 1
    for _ in range(2):
        for group in stream.iteration():
            lengths += [(s.prompt_id, s.length) for s in group.samples]
    assert predictor.learned == [] and [scores for _, scores in service.submitted] == [None] * 2
    # The refresh runs right after the next dispatch, which is not scored yet.
    list(stream.iteration())
    assert service.submitted[2][1] is None and len(predictor.learned) == 1
    prompts, learned = predictor.learned[0]
    texts = {row["prompt_id"]: row["prompt"] for row in rows}
    assert sorted(zip(prompts, learned)) == sorted((texts[p], n) for p, n in lengths)
    assert service.dispatcher.observed == [learned]  # the dispatcher's D: the same lengths
    # From then on every dispatch is scored by the predictor, one score per request.
    list(stream.iteration())
    requests, scores = service.submitted[3]
    assert predictor.asked and len(requests) == 3 * 2
    mean = sum(learned) / len(learned)
    assert scores == [mean + len(texts[r.prompt_id]) for r in requests]
