"""Unit tests for task families, long-tailed prompt sets and rewards (hand-computed values)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from streamrl.errors import ConfigError
from streamrl.tasks import (
    FAMILIES,
    exact_match,
    get_reward,
    load_prompt_file,
    long_tail_lengths,
    make_prompt_set,
    make_splits,
    partial_credit,
)


def test_families_produce_correct_answers():
    rng = random.Random(0)
    for _ in range(50):
        prompt, answer = FAMILIES["count"].make(rng, rng.randint(1, 40))
        _, a, b = prompt.rstrip("=").split()
        assert answer == " ".join(str(i) for i in range(int(a), int(b) + 1))

        prompt, answer = FAMILIES["sort"].make(rng, rng.randint(1, 40))
        numbers = [int(x) for x in prompt.rstrip("=").split()[1:]]
        assert answer == " ".join(map(str, sorted(numbers)))

        prompt, answer = FAMILIES["rev"].make(rng, rng.randint(1, 40))
        assert answer == prompt[len("rev ") : -1][::-1]

        prompt, answer = FAMILIES["copy"].make(rng, rng.randint(1, 40))
        assert answer == prompt[len("copy ") : -1]


def test_answer_length_follows_target():
    rng = random.Random(1)
    # copy/rev hit the target exactly; count/sort reach it within one more number.
    assert len(FAMILIES["copy"].make(rng, 17)[1]) == 17
    assert len(FAMILIES["rev"].make(rng, 5)[1]) == 5
    for name in ("count", "sort"):
        for target in (1, 10, 60):
            length = len(FAMILIES[name].make(rng, target)[1])
            assert target <= length <= target + 4


def test_count_prompt_is_short_but_answer_long():
    prompt, answer = FAMILIES["count"].make(random.Random(3), 80)
    assert len(prompt) < 16 and len(answer) >= 80


def test_long_tail_knob():
    rng = random.Random(0)
    flat = long_tail_lengths(2000, rng, median_len=8, tail=0.0, max_len=96)
    assert set(flat) == {8}
    light = np.array(long_tail_lengths(4000, rng, median_len=8, tail=0.4, max_len=96))
    heavy = np.array(long_tail_lengths(4000, rng, median_len=8, tail=1.0, max_len=96))
    assert abs(np.median(heavy) - 8) <= 1
    # Lognormal: p90/median = exp(1.2816 * sigma): 1.67 for sigma 0.4, 3.6 for sigma 1.0.
    assert np.percentile(light, 90) / np.median(light) == pytest.approx(1.67, rel=0.15)
    assert np.percentile(heavy, 90) / np.median(heavy) == pytest.approx(3.6, rel=0.15)
    assert heavy.max() <= 96 and heavy.min() >= 1


def test_prompt_set_columns_unique_and_reproducible():
    a = make_prompt_set(300, seed=5)
    b = make_prompt_set(300, seed=5)
    assert a.column_names == ["prompt_id", "task", "prompt", "answer", "answer_len"]
    assert a["prompt"] == b["prompt"]
    assert len(set(a["prompt"])) == 300 and len(set(a["prompt_id"])) == 300
    assert all(n == len(ans) for n, ans in zip(a["answer_len"], a["answer"]))
    assert set(a["task"]) == set(FAMILIES)


def test_splits_share_no_prompt():
    train, heldout = make_splits(500, 100, seed=0)
    assert not set(train["prompt"]) & set(heldout["prompt"])
    assert len(heldout) == 100


def test_unknown_task_says_did_you_mean():
    with pytest.raises(ConfigError, match="did you mean 'count'"):
        make_prompt_set(10, ["cont"])


def test_exact_match():
    assert exact_match("1 2 3", "1 2 3") == 1.0
    assert exact_match("1 2 3 ", "1 2 3") == 0.0
    assert exact_match("", "a") == 0.0


def test_partial_credit_hand_computed():
    assert partial_credit("abcd", "abxd") == 0.75  # 3 of 4 positions
    assert partial_credit("ab", "abcd") == 0.5  # 2 hits over the longer length 4
    assert partial_credit("abcdef", "abc") == 0.5  # too long is penalised too: 3 / 6
    assert partial_credit("", "") == 1.0
    assert partial_credit("zzz", "abc") == 0.0
    assert get_reward("partial") is partial_credit
    with pytest.raises(ConfigError, match="did you mean 'exact'"):
        get_reward("exakt")


def test_load_prompt_file(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"prompt": "copy ab=", "answer": "ab"},
                {"prompt": "what is 2+2?", "answer": "4", "task": "math", "prompt_id": "q1"},
            ]
        )
    )
    ds = load_prompt_file(path)
    assert ds["prompt_id"] == ["p-000000", "q1"] and ds["task"] == ["custom", "math"]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match="no rows"):
        load_prompt_file(empty)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl:1"):
        load_prompt_file(bad)
