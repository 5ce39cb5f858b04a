"""The length ranker learns the order of output lengths and handles any prompt text."""

from __future__ import annotations

import json
import math
import random
from collections import deque

import pytest

from streamrl.algorithms import GRPO
from streamrl.cli.main import main
from streamrl.components.generation.service import StreamGenerationService
from streamrl.components.skewness.ranker import LengthRanker, prompt_features
from streamrl.components.skewness.ranking_metrics import recall_at_k
from streamrl.policy.models import build_tokenizer
from streamrl.protocols import LengthPredictor
from streamrl.records import Sample
from streamrl.tasks import make_prompt_set
from streamrl.training.prompts import PromptSource
from streamrl.training.rollout import RolloutStream


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
        "p90_coverage",
        "crps",
        "train_s",
        "n_train",
        "n_test",
        "char_baseline",
        "samples",
    }
    assert result["char_baseline"]["ranker"] == "chars" and result["samples"] == 1
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


def _chat_rows(n: int, seed: int = 0) -> list[dict]:
    """Chat prompts whose length follows their words: a requested word count and a style."""
    rng = random.Random(seed)
    topics = ["rivers", "the moon", "bread", "old trains", "jazz", "glaciers", "tea"]
    styles = {"Answer briefly.": 0.5, "Explain step by step.": 3.0, "": 1.0}
    rows = []
    for _ in range(n):
        words, (style, factor) = rng.randint(5, 100), rng.choice(list(styles.items()))
        system = rng.choice(["", "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"])
        prompt = (
            f"{system}<|im_start|>user\nTell me about {rng.choice(topics)} in about {words} "
            f"words. {style}<|im_end|>\n<|im_start|>assistant\n"
        )
        expected = 4 + words * factor
        lengths = [max(1, round(expected * rng.lognormvariate(0, 0.2))) for _ in range(4)]
        rows.append({"prompt": prompt, "lengths": lengths, "expected": expected})
    return rows


def test_token_features_use_the_policy_tokenizer_on_chat_prompts():
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    from streamrl.components.skewness.ranker import token_features, word_ids

    rows = _chat_rows(400)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([r["prompt"] for r in rows], vocab_size=400, show_progress=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer)
    chat = rows[0]["prompt"]
    ids = tokenizer(chat)["input_ids"]
    assert token_features(ids, 64).shape == token_features([], 64).shape == (65,)
    assert token_features(ids, 64)[-1] == pytest.approx(math.log1p(len(ids)))
    assert not (token_features(ids, 64) == token_features(word_ids(chat), 64)).all()
    prompts = [r["prompt"] for r in rows]
    lengths = [sum(r["lengths"]) / 4 for r in rows]
    ranker = LengthRanker(epochs=150, seed=0, tokenizer=tokenizer, token_buckets=512)
    ranker.fit(prompts[:320], lengths[:320])
    # char n-grams, numeric, number contexts, token n-grams, token count
    width = 1024 + 8 + 128 + 512 + 1
    assert ranker.net[0].in_features == width
    expected = [r["expected"] for r in rows[320:]]
    assert recall_at_k(ranker.predict(prompts[320:]), expected, 0.2) >= 0.7
    # Checkpoints from before token features (no "token_buckets") load as character-only.
    old = LengthRanker(epochs=5, seed=0)
    old.fit(prompts[:20], lengths[:20])
    state = old.state_dict()
    del state["token_buckets"]
    loaded = LengthRanker(tokenizer=tokenizer)
    loaded.load_state_dict(state)
    assert loaded.predict(prompts[:3]) == old.predict(prompts[:3])


def test_lengths_rows_load_and_bench_against_the_ceiling(tmp_path, capsys):
    from streamrl.bench.ranker import load_length_rows

    rows = _chat_rows(60)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _, samples, expected = load_length_rows(data)
    assert samples == [r["lengths"] for r in rows] and expected == [r["expected"] for r in rows]
    old = tmp_path / "old.jsonl"  # the one-length format loads as one sample each
    old.write_text(
        "".join(json.dumps({"prompt": f"p{i}", "length": i + 1}) + "\n" for i in range(10))
    )
    assert load_length_rows(old) == (
        [f"p{i}" for i in range(10)],
        [[i + 1] for i in range(10)],
        None,
    )
    assert main(["bench", "ranker", "--data", str(data)]) == 0
    out = capsys.readouterr()
    result = json.loads(out.out.strip().splitlines()[-1])
    assert result["samples"] == 4 and result["n_test"] == 12
    assert 0 <= result["ceiling@20"] <= 1 and 0 <= result["oracle@20"] <= 1
    assert "ceiling (mean of other samples)" in out.err and "chars" in out.err


def test_ceiling_ranks_by_the_mean_of_the_other_samples():
    from streamrl.bench.ranker import held_out_recall

    # 10 prompts, top 20% = 2. p1 is noisy (90 or 10); the others are steady.
    samples = [[100, 100], [90, 10], [50, 60]] + [[1, 2]] * 7
    # Truth = sample 0: top {p0, p1}; the other sample ranks {p0, p2}: 0.5. Truth = sample 1:
    # top {p0, p2}; the other sample ranks {p0, p1}: 0.5.
    assert held_out_recall(None, samples) == 0.5
    # Ranking by the expected lengths {p0, p2} gets 0.5 on truth 0 and 1.0 on truth 1.
    expected = [100, 50, 55] + [1.5] * 7
    assert held_out_recall(expected, samples) == 0.75


def test_chat_length_data_is_documented_synthetic_rows():
    pytest.importorskip("reasoning_gym")
    from streamrl.bench.length_data import STYLES, TASKS, make_length_rows

    rows, tokenizer = make_length_rows(per_task=2, samples=3, vocab_size=300)
    assert len(rows) == 2 * len(TASKS) and {r["task"] for r in rows} == set(TASKS)
    for row in rows:
        assert "<|im_start|>user\n" in row["prompt"]
        assert row["prompt"].endswith("<|im_start|>assistant\n") and row["style"] in STYLES
        assert len(row["lengths"]) == 3 and all(n >= 1 for n in row["lengths"])
    assert tokenizer.encode(rows[0]["prompt"]).ids


def test_bench_ranker_from_policy_samples_the_policy(tmp_path, capsys, tokenizer):
    from streamrl.policy.models import build_tiny_model, save_policy

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
    assert not ranker.ready and trained == [] and len(ranker.online.recent) == 1
    ranker.learn(["count 1 90=", "copy ab="], [260, 2])  # fits on all three
    assert ranker.ready and trained == [(3, 7)] and len(ranker.online.recent) == 3
    ranker.learn(["rev abcdefgh="], [8])  # refreshes over the recent buffer
    assert trained == [(3, 7), (4, 3)] and len(ranker.online.recent) == 4
    assert len(ranker.predict(["count 5 80="])) == 1
    with pytest.raises(ValueError, match="2 prompts but 1 lengths"):
        ranker.learn(["a", "b"], [1])
    fresh = LengthRanker(epochs=5, seed=0)
    fresh.online.recent.extend([("count 1 3=", 5), ("count 1 90=", 260)])
    fresh.refresh()  # fits on the buffer without adding it twice
    assert fresh.ready and len(fresh.online.recent) == 2


class _FakeDispatcher:
    def __init__(self) -> None:
        self.observed: list[list[int]] = []

    def observe(self, lengths) -> None:
        self.observed.append(list(lengths))


class _FakeService:
    """In-process stand-in for the generation service: a prompt's samples are as long as it.
    As a ``Sampler`` it starts groups as the real service does."""

    scores_samples = False
    start_group = StreamGenerationService.start_group
    left_out = StreamGenerationService.left_out

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
        build_tokenizer(),  # one token per character
        GRPO(group_size=2),
        reward=lambda completion, answer: float(len(completion) % 2),
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


def test_the_run_s_ranker_reads_prompts_in_the_policy_s_tokens():
    """``rl.length_predictor: ranker`` gets the policy's tokenizer from the run: its features
    include the policy's token n-grams (a predictor that takes no tokenizer is built without:
    its ``from_run`` picks only the seed)."""
    from streamrl.policy.models import build_bpe_tokenizer, build_tiny_model
    from streamrl.run.config import RunConfig
    from streamrl.run.parts import RunParts

    prompts = ["copy abc=", "rev abcdefgh=", "count 1 9=", "Spell backward: word"] * 4
    tokenizer = build_bpe_tokenizer(prompts * 8, vocab_size=300)
    policy = build_tiny_model(tokenizer, size="test")
    config = RunConfig()
    config.rl.generation = {"num_instances": 1}  # no latency profile needed to build the parts
    ranker = RunParts.from_config(config, policy, tokenizer).length_predictor
    assert isinstance(ranker, LengthRanker) and ranker.tokenizer is tokenizer
    ranker.online.learn_epochs = 5
    ranker.fit(prompts, [3, 8, 20, 4] * 4)
    assert ranker.net[0].in_features == 1024 + 8 + 128 + ranker.token_buckets + 1
    # A character-level tokenizer's tokens would only repeat the character n-grams: not given.
    chars = build_tokenizer()
    policy = build_tiny_model(chars, size="test")
    assert RunParts.from_config(config, policy, chars).length_predictor.tokenizer is None
    config.rl.length_predictor = "test_ranker:_NoTokenizerPredictor"
    assert RunParts.from_config(config, policy, tokenizer).length_predictor.seed == 0


class _NoTokenizerPredictor:
    """A length predictor that takes the run's seed (in ``from_run``) but no tokenizer."""

    ready = False

    def __init__(self, seed: int) -> None:
        self.seed = seed

    @classmethod
    def from_run(cls, run, **options):
        return cls(run.seed, **options)

    def predict(self, prompts):
        return [0.0] * len(prompts)

    def learn(self, prompts, lengths):
        pass

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass
