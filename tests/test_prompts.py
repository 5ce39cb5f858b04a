"""The prompt stream: seeded per-epoch permutations on a StatefulDataLoader, resumed exactly."""

from __future__ import annotations

import io

import datasets
import pytest
import torch

from streamrl.training.prompts import PromptSource

N = 7  # prime: batches of 3 straddle every epoch boundary


def rows(n: int = N) -> list[dict]:
    return [{"prompt_id": f"p{i}", "prompt": f"q {i}=", "answer": str(i)} for i in range(n)]


def ids(source: PromptSource, count: int) -> list[str]:
    return [source.next_row()["prompt_id"] for _ in range(count)]


def through_a_checkpoint(state: dict) -> dict:
    """What the run's checkpoint gives back (``torch.load(weights_only=True)``)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_same_seed_same_order_and_another_seed_another():
    first = ids(PromptSource(rows(), 3, seed=4), 5 * N)
    assert ids(PromptSource(rows(), 3, seed=4), 5 * N) == first
    assert ids(PromptSource(rows(), 3, seed=5), 5 * N) != first


def test_each_epoch_is_a_permutation_and_epochs_differ():
    source = PromptSource(rows(), 3, seed=0)
    dealt = [row["prompt_id"] for _ in range(5 * N // 3 + 1) for row in source.next_batch()]
    epochs = [dealt[e * N : (e + 1) * N] for e in range(5)]
    for order in epochs:  # nothing dropped, nothing repeated within an epoch
        assert sorted(order) == sorted(r["prompt_id"] for r in rows())
    assert len({tuple(order) for order in epochs}) > 1  # reshuffled every epoch
    assert source.epoch == len(dealt) // N


@pytest.mark.parametrize("taken_after", [0, 2, 3, N - 1, N, N + 1, 2 * N, 3 * N + 4])
def test_resume_continues_with_exactly_the_uninterrupted_rows(taken_after):
    uninterrupted = ids(PromptSource(rows(), 3, seed=1), taken_after + 3 * N)
    stopped = PromptSource(rows(), 3, seed=1)
    ids(stopped, taken_after)
    state = through_a_checkpoint(stopped.state_dict())
    resumed = PromptSource(rows(), 3, seed=1)
    ids(resumed, 5)  # wherever it was, the state decides where it goes on
    resumed.load_state_dict(state)
    assert resumed.epoch == stopped.epoch == max(0, taken_after - 1) // N  # old at a boundary
    # Past the epoch boundaries after the resume too: the next orders are the same.
    assert ids(resumed, 3 * N) == uninterrupted[taken_after:]
    assert ids(stopped, 3 * N) == uninterrupted[taken_after:]  # taking a state changes nothing


def test_extra_columns_pass_through_as_plain_values():
    data = datasets.Dataset.from_list(
        [{**row, "answer_len": i, "tags": ["a", "b"][: i % 3]} for i, row in enumerate(rows())]
    )
    batch = PromptSource(data, N, seed=0).next_batch()
    assert all(type(row) is dict for row in batch)
    by_id = {row["prompt_id"]: row for row in batch}
    assert by_id["p4"] == {
        "prompt_id": "p4",
        "prompt": "q 4=",
        "answer": "4",
        "answer_len": 4,
        "tags": ["a"],
    }


def test_empty_prompt_set_and_an_old_state_are_clear_errors():
    with pytest.raises(ValueError, match="prompt set is empty"):
        PromptSource([], 4)
    with pytest.raises(ValueError, match="older streamrl"):
        PromptSource(rows(), 3).load_state_dict({"epoch": 0, "position": 3})
