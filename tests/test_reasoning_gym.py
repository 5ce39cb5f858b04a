"""Reasoning-gym adapter (rows, mixtures, verifier reward) and SFT on dataset rows."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

pytest.importorskip("reasoning_gym")

from streamrl.errors import ConfigError
from streamrl.policy.models import build_tiny_model, build_tokenizer
from streamrl.policy.sft_rows import corrupt, encode_rows, sft_on_rows
from streamrl.tasks.reasoning_gym import reasoning_gym_dataset, reasoning_gym_reward

SPELL = {"spell_backward": {"min_word_len": 3, "max_word_len": 5}}
SUM = {"chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}}


def test_rows_follow_the_contract():
    rows = reasoning_gym_dataset(SPELL, size=6, seed=3)
    assert rows.column_names[:5] == ["prompt_id", "task", "prompt", "answer", "answer_len"]
    assert {"entry", "task_config"} <= set(rows.column_names)
    for row in rows:
        entry = json.loads(row["entry"])
        assert row["prompt"] == entry["question"] and row["answer"] == entry["answer"]
        assert row["answer_len"] == len(row["answer"]) and row["task"] == "spell_backward"
        # The answer is the question's word spelled backward.
        assert row["prompt"].rsplit(" ", 1)[-1] == row["answer"][::-1]
    assert sorted(rows["prompt_id"]) == [f"spell_backward-3-{i}" for i in range(6)]


def test_ids_and_rows_are_stable():
    first = reasoning_gym_dataset({**SPELL, **SUM}, size=8, seed=5).to_list()
    assert reasoning_gym_dataset({**SPELL, **SUM}, size=8, seed=5).to_list() == first
    assert len({r["prompt_id"] for r in first}) == 8


def test_mixture_counts_follow_weights():
    rows = reasoning_gym_dataset({**SPELL, **SUM}, size=10, seed=0, weights=[3, 1])
    # 7.5 and 2.5 rows: largest remainder gives the tie to the first task.
    assert Counter(rows["task"]) == {"spell_backward": 8, "chain_sum": 2}
    assert Counter(
        reasoning_gym_dataset(["spell_backward", "chain_sum"], size=4, seed=0)["task"]
    ) == {
        "spell_backward": 2,
        "chain_sum": 2,
    }
    with pytest.raises(ConfigError, match="weights"):
        reasoning_gym_dataset({**SPELL, **SUM}, size=4, seed=0, weights=[1])


def test_heldout_excludes_train_prompts():
    train = reasoning_gym_dataset(SUM, size=50, seed=0)
    # Entry i of seed 1 is entry i + 1 of seed 0: only exclusion keeps the sets apart.
    heldout = reasoning_gym_dataset(SUM, size=50, seed=1, exclude_prompts=set(train["prompt"]))
    assert not set(train["prompt"]) & set(heldout["prompt"])


def test_reward_scores_with_the_task_verifier():
    for row in reasoning_gym_dataset({**SPELL, **SUM}, size=6, seed=0):
        assert reasoning_gym_reward(row["answer"], row) == 1.0
        assert reasoning_gym_reward("zzqx", row) == 0.0
    # chain_sum's verifier compares numbers, so a leading "+" and zero still score 1.
    row = next(r for r in reasoning_gym_dataset(SUM, size=20, seed=0) if r["answer"][0] != "-")
    assert reasoning_gym_reward(f"+0{row['answer']}", row) == 1.0


def test_unknown_task_and_bad_config_raise_config_errors():
    with pytest.raises(ConfigError, match="did you mean 'spell_backward'"):
        reasoning_gym_dataset(["spell_backwards"], size=2, seed=0)
    with pytest.raises(ConfigError, match="size and seed"):
        reasoning_gym_dataset({"spell_backward": {"seed": 1}}, size=2, seed=0)
    with pytest.raises(ConfigError, match="bad config"):
        reasoning_gym_dataset({"spell_backward": {"no_such_option": 1}}, size=2, seed=0)
    tiny = {"count_bits": {"max_n": 3}}  # 3 distinct questions, all in the first 100 entries
    seen = reasoning_gym_dataset(tiny, size=100, seed=0)["prompt"]
    with pytest.raises(ConfigError, match="too few distinct"):
        reasoning_gym_dataset(tiny, size=1, seed=7, exclude_prompts=set(seen))


def test_encode_rows_masks_the_prompt():
    tok = build_tokenizer("abc=")
    ids, mask, labels = encode_rows(tok, [[3, 4], [5]], [[4, 1], [3, 3, 1]])
    assert ids.tolist() == [[3, 4, 4, 1], [5, 3, 3, 1]]
    assert labels.tolist() == [[-100, -100, 4, 1], [-100, 3, 3, 1]]
    assert mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 1]]


def test_sft_on_rows_lowers_the_loss_and_renders_prompts():
    rows = reasoning_gym_dataset(SPELL, size=32, seed=0).to_list()
    alphabet = sorted({c for r in rows for c in r["prompt"] + r["answer"]})
    tok = build_tokenizer("".join(alphabet))
    model = build_tiny_model(tok, size="test", seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rendered = []

    def render(tokenizer, prompt):  # a custom renderer is called once per row
        rendered.append(prompt)
        return tokenizer(prompt)["input_ids"]

    losses = sft_on_rows(
        rows,
        tokenizer=tok,
        model=model,
        steps=40,
        lr=5e-3,
        tokens_per_batch=512,
        seed=0,
        render=render,
    )
    assert len(losses) == 40 and len(rendered) == 32
    # From about uniform over the vocabulary (ln 44 = 3.8) to well below it.
    assert sum(losses[:3]) / 3 > 3.3 and sum(losses[-5:]) / 5 < 2.8
    assert all(not torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not model.training


def test_corrupt_changes_the_requested_share():
    rows = [{"prompt": "p", "answer": "hello"} for _ in range(200)]
    changed = sum(r["answer"] != "hello" for r in corrupt(rows, 0.3, seed=0, alphabet="xyz"))
    assert 40 <= changed <= 80 and rows[0]["answer"] == "hello"
