"""The second ranker data set (everyday requests): seeded, well-formed, unlike the shipped one."""

from __future__ import annotations

import json
import math
import re

import pytest

from streamrl.bench.length_data_requests import (
    HEAVY,
    KINDS,
    LOG_NORMAL,
    MAX_TOKENS,
    make_request_rows,
)
from streamrl.bench.request_words import ITEM_DETAIL, number_words
from streamrl.cli.main import main


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return make_request_rows(n=900, samples=8, seed=3, vocab_size=500)[0]


def test_number_words_as_people_write_counts():
    assert [number_words(n) for n in (0, 7, 19, 25, 40, 300, 320)] == [
        "zero",
        "seven",
        "nineteen",
        "twenty-five",
        "forty",
        "three hundred",
        "three hundred and twenty",
    ]
    with pytest.raises(ValueError, match="outside 0-999"):
        number_words(1000)


def test_rows_are_seeded_and_well_formed(rows):
    again = make_request_rows(n=900, samples=8, seed=3, vocab_size=500)[0]
    assert again == rows
    assert make_request_rows(n=900, samples=8, seed=4, vocab_size=500)[0] != rows
    assert {r["task"] for r in rows} == set(KINDS)
    assert all(sum(r["task"] == kind for r in rows) == 100 for kind in KINDS)
    for row in rows:
        assert set(row) == {"prompt", "lengths", "expected", "task", "style"}
        assert "<|im_start|>user\n" in row["prompt"]
        assert row["prompt"].endswith("<|im_start|>assistant\n")
        assert len(row["lengths"]) == 8 and row["expected"] > 0
        assert all(isinstance(n, int) and 1 <= n <= MAX_TOKENS for n in row["lengths"])
        json.dumps(row)  # a JSONL row
    with pytest.raises(ValueError, match="n >= 1"):
        make_request_rows(n=0)


def test_a_list_s_length_follows_its_count_in_digits_or_in_words(rows):
    counts = {number_words(n): n for n in range(3, 31)} | {"a dozen": 12}
    counts |= {str(n): n for n in range(3, 31)}
    pattern = re.compile(
        r"(?:List|list|Give me|give me|Suggest|suggest|Name|name|Come up with|"
        r"come up with) (a dozen|[\w-]+) "
    )
    spelled = 0
    for row in (r for r in rows if r["task"] == "list"):
        count = counts[pattern.search(row["prompt"]).group(1)]
        spelled += not pattern.search(row["prompt"]).group(1).isdigit()
        assert row["expected"] == 6 + count * ITEM_DETAIL[row["style"]][1]
    assert 20 < spelled < 80  # about half the counts are written in words


def test_open_requests_have_heavier_tails_than_faithful_ones(rows):
    def excess_kurtosis(kind: str) -> float:
        z = [
            math.log(n / r["expected"])
            for r in rows
            if r["task"] == kind and r["expected"] >= 30  # rounding blurs the shortest
            for n in r["lengths"]
        ]
        mean = sum(z) / len(z)
        var = sum((v - mean) ** 2 for v in z) / len(z)
        return sum((v - mean) ** 4 for v in z) / len(z) / var**2 - 3

    # Log-normal noise has excess kurtosis 0 (measured -0.01 to 0.25 on this seed); Student's t
    # with 3 degrees of freedom and runaway answers far more (measured 2.8 to 10.3).
    assert all(abs(excess_kurtosis(kind)) < 0.5 for kind in LOG_NORMAL)
    assert all(excess_kurtosis(kind) > 2.0 for kind in HEAVY)


def test_unlike_the_shipped_set(rows):
    pytest.importorskip("reasoning_gym")
    from streamrl.bench.length_data import TASKS, make_length_rows

    shipped, _ = make_length_rows(per_task=4, samples=2, vocab_size=300)
    assert not {r["task"] for r in rows} & set(TASKS)
    assert not {r["prompt"] for r in rows} & {r["prompt"] for r in shipped}

    def user_turn(prompt: str) -> str:
        return prompt.split("<|im_start|>user\n")[1].split("<|im_end|>")[0]

    questions = {user_turn(r["prompt"]).split("\n\n")[0] for r in shipped}
    assert not any(q in user_turn(r["prompt"]) for r in rows for q in questions)


def test_bench_makes_the_requests_set_from_the_command_line(tmp_path, capsys, monkeypatch):
    import streamrl.bench.length_data_requests as requests

    made = requests.write_request_data

    def small(path, seed=0):  # the command's set, at a size a test can train on
        return made(path, seed, n=90, samples=3, vocab_size=400)

    monkeypatch.setattr(requests, "write_request_data", small)
    data = tmp_path / "requests.jsonl"
    argv = ["bench", "ranker", "--make-data", str(data), "--data-kind", "requests"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    assert len(rows) == 90 and {r["task"] for r in rows} == set(KINDS)
    assert data.with_suffix(".tokenizer.json").is_file()
    assert result["n_train"] == 72 and result["n_test"] == 18 and result["samples"] == 3
    assert 0 <= result["p90_coverage"] <= 1 and result["crps"] > 0
    assert 0 <= result["ceiling@20"] <= 1 and 0 <= result["oracle@20"] <= 1
