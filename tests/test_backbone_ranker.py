"""The backbone length ranker (LoRA on a causal LM + length head) learns, saves and refreshes."""

from __future__ import annotations

import json
import math
import random
import sys

import pytest

from streamrl.components.skewness.backbone_ranker import BackboneLengthRanker
from streamrl.components.skewness.ranking_metrics import coverage, kendall_tau, recall_at_k
from streamrl.errors import ConfigError
from streamrl.protocols import DistributionalLengthPredictor, LengthPredictor
from streamrl.records import Sample
from streamrl.tasks import make_prompt_set

COPY_PROMPTS = [f"copy {'a' * n}=" for n in range(1, 30)]


@pytest.fixture(scope="module")
def backbone_dir(tmp_path_factory):
    from streamrl.policy.models import build_tiny_model, build_tokenizer, save_policy

    tokenizer = build_tokenizer()
    path = tmp_path_factory.mktemp("backbone") / "test-model"
    return str(save_policy(build_tiny_model(tokenizer, "test", seed=0), tokenizer, path))


def test_learns_length_order_on_held_out_prompts(backbone_dir):
    ds = make_prompt_set(600, seed=3, median_len=6, max_len=48)
    prompts, lengths = ds["prompt"], ds["answer_len"]
    ranker = BackboneLengthRanker(backbone_dir, epochs=8, seed=0)
    ranker.fit(prompts[:480], lengths[:480])
    predicted = ranker.predict(prompts[480:])
    # Random order: recall@20 0.2 and tau 0 in expectation. Measured with this setting over five
    # model/data seeds: recall@20 0.625-0.75 (24 true top items), tau 0.73-0.80; with the
    # adapters frozen (head only) recall@20 0.46-0.63 and tau 0.49-0.59, so LoRA matters.
    assert recall_at_k(predicted, lengths[480:], 0.2) >= 0.5
    assert kendall_tau(predicted, lengths[480:]) >= 0.65


def test_only_adapters_and_head_train_and_state_holds_no_backbone(backbone_dir):
    ranker = BackboneLengthRanker(backbone_dir, lora_r=4, seed=0)
    trainable = ranker.trainable_parameters()
    assert trainable and all("lora_" in n or n.startswith("head.") for n in trainable)
    frozen = {n for n, p in ranker.model.named_parameters() if not p.requires_grad}
    assert any("embed_tokens" in n for n in frozen)
    assert any("q_proj.base_layer" in n for n in frozen)
    state = ranker.state_dict()
    assert set(state["trainable"]) == set(trainable)
    saved = sum(t.numel() for t in state["trainable"].values())
    total = sum(p.numel() for p in ranker.model.parameters())
    assert saved < 0.15 * total  # r=4 adapters on 4 projections x 3 layers + a 65-weight head


def test_state_dict_round_trip_gives_identical_predictions(backbone_dir):
    ranker = BackboneLengthRanker(backbone_dir, epochs=2, seed=0)
    ranker.fit(COPY_PROMPTS, list(range(1, 30)))
    odd = ["Écris un poème de 200 mots 🙂", "", "sort 3 1 2=", "copy abc="]
    before = ranker.predict(odd)
    assert all(math.isfinite(v) and v >= 0 for v in before)
    copy = BackboneLengthRanker(backbone_dir, seed=1)  # other init: load must overwrite it all
    copy.load_state_dict(ranker.state_dict())
    assert copy.predict(odd) == before
    other = BackboneLengthRanker(backbone_dir, lora_r=4)
    with pytest.raises(ConfigError, match="saved with"):
        other.load_state_dict(ranker.state_dict())


def test_online_update_follows_drifting_lengths(backbone_dir):
    probe = ["copy a=", "copy aaaaaaaaaaaaaaaaaaaaaaaa="]
    ranker = BackboneLengthRanker(backbone_dir, epochs=10, batch_size=16, seed=0)
    ranker.fit(COPY_PROMPTS, list(range(1, 30)))  # length grows with the string
    before = ranker.predict(probe)
    assert before[1] > before[0]
    # The policy drifts: now short strings get long answers. The refresh must notice.
    texts = {f"q{n}": p for n, p in enumerate(COPY_PROMPTS)}
    samples = [Sample(f"q{n}", 0, [], [7] * (60 - 2 * n), [], 0, 0) for n in range(29)]
    for _ in range(3):  # the buffer still holds the old lengths: new ones must outnumber them
        ranker.update(samples, texts, epochs=10)
    after = ranker.predict(probe)
    assert after != before and after[0] > after[1]


def test_is_a_length_predictor_that_fits_then_refreshes(backbone_dir):
    ranker = BackboneLengthRanker(
        backbone_dir, batch_size=16, seed=0, learn_epochs=2, refresh_epochs=1
    )
    assert isinstance(ranker, LengthPredictor) and not ranker.ready
    passes = []  # (samples, epochs) of each training run
    train = ranker._train
    ranker._train = lambda prompts, lengths, epochs: (
        passes.append((len(lengths), epochs)),
        train(prompts, lengths, epochs),
    )
    ranker.learn(COPY_PROMPTS[:10], list(range(1, 11)))  # the first call fits
    assert ranker.ready and passes == [(10, 2)] and len(ranker.online.recent) == 10
    ranker.learn(COPY_PROMPTS[10:15], list(range(11, 16)))  # later ones refresh the buffer
    assert passes == [(10, 2), (15, 1)] and len(ranker.online.recent) == 15
    assert len(ranker.predict(["copy aaa="])) == 1


def test_missing_peft_says_how_to_install(backbone_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # what an environment without peft sees
    with pytest.raises(ConfigError, match=r"pip install 'streamrl\[peft\]'"):
        BackboneLengthRanker(backbone_dir)


def test_bad_inputs_fail_at_construction(backbone_dir, tmp_path, tokenizer):
    with pytest.raises(ConfigError, match="target_modules"):
        BackboneLengthRanker(backbone_dir, target_modules=["c_attn"])
    with pytest.raises(ConfigError, match="no model directory"):
        BackboneLengthRanker(tmp_path / "missing")
    from streamrl.policy.models import build_tiny_model

    with pytest.raises(ConfigError, match="tokenizer"):
        BackboneLengthRanker(build_tiny_model(tokenizer, "test"))
    ranker = BackboneLengthRanker(build_tiny_model(tokenizer, "test"), tokenizer)
    with pytest.raises(RuntimeError, match="not ready"):
        ranker.predict(["copy a="])


def test_bench_ranker_trains_the_backbone_next_to_the_fast_baseline(backbone_dir, tmp_path):
    from streamrl.bench.ranker import bench_ranker

    ds = make_prompt_set(60, seed=5)
    data = tmp_path / "d.jsonl"
    data.write_text(
        "\n".join(
            json.dumps({"prompt": p, "length": n}) for p, n in zip(ds["prompt"], ds["answer_len"])
        )
    )
    result = bench_ranker(str(data), backbone=backbone_dir)
    assert result["ranker"] == "backbone" and result["baseline"]["ranker"] == "fast"
    assert result["n_train"] == 48 and result["n_test"] == 12
    assert 0.0 <= result["recall@20"] <= 1.0


def _noisy_rows(n: int, seed: int) -> list[tuple[str, list[int], str]]:
    """``copy`` and ``rev`` prompts, 5 tokens per letter: ``copy`` lengths barely vary, ``rev``
    ones by a log-normal of spread 0.8."""
    rng, rows = random.Random(seed), []
    for _ in range(n):
        task, letters = rng.choice(["copy", "rev"]), rng.randint(1, 20)
        noise = 0.05 if task == "copy" else 0.8
        prompt = f"{task} {''.join(rng.choice('abcdefgh') for _ in range(letters))}="
        lengths = [max(1, round(5 * letters * math.exp(rng.gauss(0, noise)))) for _ in range(4)]
        rows.append((prompt, lengths, task))
    return rows


def test_predicts_a_calibrated_spread_wider_where_lengths_vary_more(tokenizer):
    from streamrl.policy.models import build_tiny_model

    model = build_tiny_model(tokenizer, "test", seed=0)
    ranker = BackboneLengthRanker(model, tokenizer, epochs=5, batch_size=16, seed=0)
    assert isinstance(ranker, DistributionalLengthPredictor)
    train, test = _noisy_rows(150, seed=0), _noisy_rows(80, seed=1)
    ranker.fit([p for p, ls, _ in train for _ in ls], [n for _, ls, _ in train for n in ls])
    distinct = len({p for p, _, _ in train})
    assert len(ranker.online.calibration.residuals) == 4 * int(0.2 * distinct)  # the held-out slice
    predicted = ranker.predict_distribution([p for p, _, _ in test])
    spread = {
        task: sum(d.sigma for d, row in zip(predicted, test) if row[2] == task)
        / sum(row[2] == task for row in test)
        for task in ("copy", "rev")
    }
    assert spread["rev"] > 2 * spread["copy"]  # measured 1.01 vs 0.17
    covered = coverage(
        [d for d, (_, ls, _) in zip(predicted, test) for _ in ls],
        [n for _, ls, _ in test for n in ls],
    )
    assert 0.8 <= covered <= 0.97  # measured 0.944
    assert ranker.predict([p for p, _, _ in test]) == pytest.approx([d.median for d in predicted])


def test_distribution_round_trips_and_old_point_states_load(backbone_dir):
    ranker = BackboneLengthRanker(backbone_dir, epochs=2, seed=0)
    rows = _noisy_rows(60, seed=2)
    ranker.fit([p for p, ls, _ in rows for _ in ls], [n for _, ls, _ in rows for n in ls])
    probe = [p for p, _, _ in _noisy_rows(10, seed=3)]
    copy = BackboneLengthRanker(backbone_dir, seed=1)
    copy.load_state_dict(ranker.state_dict())
    assert copy.predict_distribution(probe) == ranker.predict_distribution(probe)
    assert copy.online.calibration.scale == ranker.online.calibration.scale != 1.0
    # Saved before issue 34: a one-output head and no calibration. It loads as the location.
    old = ranker.state_dict()
    old["trainable"] = {
        n: t[:1] if n.startswith("head.") else t for n, t in old["trainable"].items()
    }
    del old["calibration"]
    loaded = BackboneLengthRanker(backbone_dir, seed=1)
    loaded.load_state_dict(old)
    mu, _ = ranker.raw(probe)
    assert loaded.predict(probe) == pytest.approx([math.exp(m) for m in mu])
    assert len({d.sigma for d in loaded.predict_distribution(probe)}) == 1
    assert loaded.online.calibration.scale == 1.0
