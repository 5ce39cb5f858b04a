"""Rewards that see the whole row, in every form, inline and in the worker pool."""

from __future__ import annotations

import sys
import textwrap
import time

import pytest

from streamrl.errors import ConfigError, RewardError
from streamrl.rewards.pool import RewardPool
from streamrl.rewards.spec import RewardSpec, load_rewards

ROWS = [
    {"prompt_id": "p0", "prompt": "q0", "answer": "4", "unit": "cm"},
    {"prompt_id": "p1", "prompt": "q1", "answer": "7", "unit": "kg"},
]

USER_MODULE = '''
import asyncio, math, time

def uses_row(completion, row):
    """1 when the completion names the row's own unit column."""
    return 1.0 if completion.endswith(row["unit"]) else 0.0

def by_answer(completion, answer):
    return 1.0 if completion.startswith(answer) else 0.0

def lengths(completions, rows):
    return [len(c) / 10 for c in completions]
lengths.batched = True

async def slow_async(completion, row):
    await asyncio.sleep(0.2)
    return 0.5

def hangs(completion, row):
    if row["prompt_id"] == "p1":
        time.sleep(600)
    return 1.0

def hangs_everywhere(completion, row):
    time.sleep(600)
    return 1.0

def raises(completion, row):
    if row["prompt_id"] == "p1":
        raise KeyError("no such field")
    return 1.0

def nan(completion, row):
    return math.nan if row["prompt_id"] == "p1" else 1.0

def text(completion, row):
    return "high"

def numeric_text(completion, row):
    return "0.5"

def three_args(completion, row, extra):
    return 1.0
'''


@pytest.fixture()
def user_rewards(tmp_path, monkeypatch):
    """A user's reward module, importable by path (also in spawned worker processes)."""
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rewards"
    sys.modules.pop("my_rewards", None)


def test_every_form_sees_what_it_asks_for(user_rewards):
    specs = RewardSpec.from_config(
        [
            "my_rewards:uses_row",
            {"name": "my_rewards:by_answer", "weight": 2.0},
            {"name": "my_rewards:lengths", "weight": 0.5},
            "my_rewards:slow_async",
        ]
    )
    rewards = load_rewards(specs)
    started = time.perf_counter()
    totals, parts = rewards.score(["4 cm", "7 lb"], ROWS)
    assert time.perf_counter() - started < 0.39  # the two async calls ran concurrently
    assert parts == {
        "uses_row": [1.0, 0.0],
        "by_answer": [1.0, 1.0],
        "lengths": [0.4, 0.4],
        "slow_async": [0.5, 0.5],
    }
    assert totals == pytest.approx([1 + 2 + 0.2 + 0.5, 0 + 2 + 0.2 + 0.5])


def test_pool_workers_score_like_inline(user_rewards):
    specs = RewardSpec.from_config(["my_rewards:uses_row", "my_rewards:lengths"])
    completions = [f"{i} {'cm' if i % 3 else 'kg'}" for i in range(40)]
    rows = [dict(ROWS[i % 2], prompt_id=f"p{i}") for i in range(40)]
    inline = load_rewards(specs).score(completions, rows)
    with RewardPool(specs, workers=2, timeout_s=30) as pool:
        for i, (c, r) in enumerate(zip(completions, rows)):
            pool.submit(i, c, r)
        got = {}
        deadline = time.monotonic() + 60
        while len(got) < 40 and time.monotonic() < deadline:
            got.update({s.key: s for s in pool.collect(timeout_s=1.0)})
        assert pool.pending == 0
    assert [got[i].total for i in range(40)] == pytest.approx(inline[0])
    assert [got[i].parts["uses_row"] for i in range(40)] == inline[1]["uses_row"]


@pytest.mark.parametrize("workers", [0, 1])
@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("raises", r"raised KeyError\('no such field'\) on prompt\(s\) \['p1'\]"),
        ("nan", r"returned nan for prompt 'p1'"),
        ("text", r"returned 'high' for prompt 'p0'"),
        ("numeric_text", r"returned '0.5' for prompt 'p0'.*not text"),
    ],
)
def test_bad_reward_values_name_the_prompt(user_rewards, workers, name, message):
    specs = RewardSpec.from_config(f"my_rewards:{name}")
    with RewardPool(specs, workers=workers) as pool, pytest.raises(RewardError, match=message):
        for key, row in enumerate(ROWS):
            pool.submit(key, "x", row)
        for _ in range(100):
            pool.collect(timeout_s=0.2)


@pytest.mark.parametrize(
    ("reward", "message"),
    [
        ("my_rewards:three_args", r"wrong signature"),
        ("no_such_module_xyz:score", r"cannot import module 'no_such_module_xyz'"),
        ("my_rewards:uses_rows", r"did you mean 'uses_row'"),
        ("exakt", r"did you mean 'exact'"),
        ({"name": "my_rewards:uses_row", "path": "/x"}, r"is a function and takes no options"),
        ({"weight": 1.0}, r"needs 'name'"),
        (["exact", "exact"], r"same name"),
    ],
)
def test_bad_reward_references_fail_before_work(user_rewards, reward, message):
    with pytest.raises(ConfigError, match=message):
        RewardPool(RewardSpec.from_config(reward), workers=1)


def test_pool_close_leaves_no_process(user_rewards):
    pool = RewardPool(RewardSpec.from_config("my_rewards:uses_row"), workers=2)
    pool.start()
    processes = [w.process for w in pool._pool]
    pool.close()
    assert all(not p.is_alive() for p in processes)


def test_a_reward_that_never_returns_stops_the_heldout_evaluation_with_its_prompts(
    user_rewards, tmp_path, capsys
):
    """The evaluation before RL scores in the trainer's process: a reward that hangs there is
    given rl.reward_pool's timeout_s too, and the run stops with one line naming the prompts (it
    hung forever before)."""
    import yaml

    from streamrl.cli.main import main

    config = tmp_path / "run.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "output_dir": str(tmp_path / "out"),
                "data": {"tasks": ["copy"], "n_train": 16, "n_heldout": 4, "max_len": 6},
                "sft": {"model_size": "test", "steps": 2},
                "rl": {
                    "iterations": 1,
                    "prompts_per_iteration": 2,
                    "group_size": 2,
                    "rollouts": {"max_tokens": 8},
                    "reward": f"{user_rewards}:hangs_everywhere",
                    "reward_pool": {"timeout_s": 2},
                },
            }
        )
    )
    started = time.monotonic()
    code = main(["fit", "--config", str(config), "--no-progress"])
    err = capsys.readouterr().err
    assert code != 0 and time.monotonic() - started < 120
    assert "did not return within 2 s (rl.reward_pool's timeout_s) on held-out prompt(s)" in err


def test_with_deadline_scores_in_batches_and_names_the_batch_that_hangs():
    from streamrl.rewards.deadline import with_deadline

    seen = []

    def score(completions, rows):
        seen.append(len(rows))
        if any(r["prompt_id"] == "p5" for r in rows):
            time.sleep(5)
        return [1.0] * len(rows)

    rows = [{"prompt_id": f"p{i}"} for i in range(6)]
    scored = with_deadline(score, timeout_s=0.2, batch=4)
    assert scored(["x"] * 4, rows[:4]) == [1.0] * 4
    with pytest.raises(RewardError, match=r"within 0.2 s .* \['p4', 'p5'\]"):
        scored(["x"] * 6, rows)
    assert seen == [4, 4, 2]
    with pytest.raises(KeyError):
        with_deadline(lambda c, r: r[0]["missing"], timeout_s=1)(["x"], rows[:1])
