"""Integration: build the tiny policy, run a few SFT steps, check it learned and is cached."""

from __future__ import annotations

import json
import random

import pytest
import torch

from streamrl.eval.heldout import evaluate
from streamrl.policy.models import build_tiny_model, count_parameters, load_policy
from streamrl.policy.sft import (
    SFTConfig,
    corrupt_answer,
    encode_demos,
    sft_train,
    token_budget_batches,
    warm_start,
)
from streamrl.tasks import make_prompt_set


def test_tiny_model_sizes(tokenizer):
    assert 120_000 <= count_parameters(build_tiny_model(tokenizer, "test")) <= 180_000
    assert 800_000 <= count_parameters(build_tiny_model(tokenizer, "demo")) <= 1_200_000


def test_encode_demos_masks_prompt(tokenizer):
    ids, mask, labels = encode_demos(tokenizer, ["rev ab="], ["ba"])
    assert tokenizer.decode(ids[0]) == "rev ab=ba<eos>"
    assert labels[0].tolist() == [-100] * 7 + tokenizer("ba")["input_ids"] + [
        tokenizer.eos_token_id
    ]
    assert mask[0].tolist() == [1] * 10


def test_token_budget_batches_cover_every_index_once():
    lengths = [random.Random(i).randint(3, 120) for i in range(500)]
    batches = token_budget_batches(lengths, 1024)
    assert sorted(i for b in batches for i in b) == list(range(500))
    assert all(len(b) * max(lengths[i] for i in b) <= 1024 for b in batches)


def test_corrupt_answer_changes_one_place():
    rng = random.Random(0)
    for _ in range(100):
        bad = corrupt_answer("hello", rng, "xyz")
        # "xyz" shares no letter with "hello", so a replacement always changes it.
        assert bad != "hello" and abs(len(bad) - 5) <= 1


def test_sft_loss_falls_and_parameters_change(tokenizer, tiny_model):
    demos = make_prompt_set(256, ["copy", "rev"], median_len=4, max_len=12, seed=0)
    before = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    config = SFTConfig(model_size="test", steps=60, tokens_per_batch=1024, lr=5e-3, demo_noise=0.0)
    losses = sft_train(tiny_model, tokenizer, demos, config, show_progress=False)
    assert len(losses) == 60
    # From uniform over the vocabulary (ln 52 = 3.95) to below uniform over letters (ln 26 = 3.26).
    assert sum(losses[:5]) / 5 > 3.4 and sum(losses[-10:]) / 10 < 3.1
    changed = [k for k, v in tiny_model.state_dict().items() if not torch.equal(v, before[k])]
    assert len(changed) == len(before)


def test_warm_start_is_cached_and_loadable(tmp_path):
    config = SFTConfig(model_size="test", steps=3, n_demos=64)
    first = warm_start(config, tmp_path, show_progress=False)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    second = warm_start(config, tmp_path, show_progress=False)
    assert second == first and (first / "model.safetensors").stat().st_mtime_ns == stamp
    other = warm_start(
        SFTConfig(model_size="test", steps=4, n_demos=64), tmp_path, show_progress=False
    )
    assert other != first
    model, tok = load_policy(first)
    result = evaluate(model, tok, make_prompt_set(8, seed=9), max_new_tokens=8)
    assert result.n == 8 and 0.0 <= result.accuracy <= 1.0


def test_interrupted_warm_start_resumes_where_it_stopped(tmp_path, monkeypatch):
    """Ctrl-C at step 250 of 300: the rerun starts at the last save (step 200), and ends with
    the weights and losses of a warm start that was never interrupted (threads pinned: with
    the free cores counted each step, a neighbour's load may change the float rounding)."""
    import streamrl.policy.sft as sft

    config = SFTConfig(model_size="test", steps=300, n_demos=256)
    whole = warm_start(config, tmp_path / "whole", show_progress=False, threads=1)

    encode, calls = sft.encode_demos, []

    def interrupted(*args):
        calls.append(1)
        if len(calls) == 251:
            raise KeyboardInterrupt
        return encode(*args)

    monkeypatch.setattr(sft, "encode_demos", interrupted)
    target = tmp_path / "resumed" / whole.name
    with pytest.raises(KeyboardInterrupt):
        warm_start(config, tmp_path / "resumed", show_progress=False, threads=1)
    assert not target.exists()
    assert torch.load(sft.progress_path(target), weights_only=False)["step"] == 200
    monkeypatch.setattr(sft, "encode_demos", encode)
    resumed = warm_start(config, tmp_path / "resumed", show_progress=False, threads=1)
    assert resumed == target and not sft.progress_path(target).exists()
    a, _ = load_policy(whole)
    b, _ = load_policy(resumed)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name
    meta = [json.loads((d / "sft_meta.json").read_text()) for d in (whole, resumed)]
    assert meta[0]["losses"] == meta[1]["losses"] and len(meta[1]["losses"]) == 300


def test_each_step_takes_the_free_cores_and_the_thread_count_comes_back(
    tokenizer, tiny_model, monkeypatch
):
    """A busy neighbour: the cores free before each step are what the step gets (2 threads
    spin-waiting for a descheduled one ran 10x slower: docs/benchmarks.md, bench contention)."""
    import streamrl.policy.sft as sft

    free = iter([1, 2, 1, 2])
    monkeypatch.setattr(sft, "free_cores", lambda: next(free))
    seen: list[int] = []
    encode = sft.encode_demos

    def recording(*args):
        seen.append(torch.get_num_threads())
        return encode(*args)

    monkeypatch.setattr(sft, "encode_demos", recording)
    own = torch.get_num_threads()
    demos = make_prompt_set(32, ["copy"], median_len=3, max_len=6, seed=0)
    config = SFTConfig(model_size="test", steps=4, tokens_per_batch=256)
    sft_train(tiny_model, tokenizer, demos, config, show_progress=False)
    assert seen == [1, 2, 1, 2] and torch.get_num_threads() == own
    sft_train(tiny_model, tokenizer, demos, config, show_progress=False, threads=1)
    assert seen[4:] == [1, 1, 1, 1]
