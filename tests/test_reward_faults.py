"""Reward workers are replaced like generator instances: user code that segfaults, hangs or is
killed takes down a worker, not the run (docs/failures.md, "A reward worker fails")."""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import time

import pytest

from streamrl.errors import RewardError
from streamrl.rewards.pool import RewardPool
from streamrl.rewards.spec import RewardSpec, load_rewards

CRASHING_MODULE = '''
import os, signal, time

def fragile(completion, row):
    """Segfaults on "crash", hangs on "hang", else the completion's length."""
    if completion == "crash":
        os.kill(os.getpid(), signal.SIGSEGV)
    if completion == "hang":
        time.sleep(600)
    return float(len(completion))

def slow(completion, row):
    time.sleep(0.2)
    return float(len(completion))

def always_crashes(completion, row):
    os.kill(os.getpid(), signal.SIGSEGV)
'''


@pytest.fixture()
def fragile_rewards(tmp_path, monkeypatch):
    (tmp_path / "fragile_rewards.py").write_text(textwrap.dedent(CRASHING_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "fragile_rewards"
    sys.modules.pop("fragile_rewards", None)


def collect_all(pool: RewardPool, n: int, timeout_s: float = 90.0) -> dict:
    got, deadline = {}, time.monotonic() + timeout_s
    while len(got) < n and time.monotonic() < deadline:
        got.update({s.key: s for s in pool.collect(timeout_s=0.5)})
    assert len(got) == n, f"only {len(got)} of {n} came back in {timeout_s}s"
    return got


def test_a_completion_that_segfaults_and_one_that_hangs_are_faults_and_the_rest_is_scored(
    fragile_rewards, tmp_path
):
    completions = ["a", "bb", "crash", "ccc", "hang", "dddd", "e", "ff"]
    rows = [{"prompt_id": f"p{i}", "prompt": f"q{i}"} for i in range(len(completions))]
    faults = tmp_path / "reward_faults.jsonl"
    with RewardPool(
        RewardSpec.from_config("fragile_rewards:fragile"),
        workers=2,
        timeout_s=2.0,
        faults_path=faults,
        status_path=tmp_path / "workers.json",
    ) as pool:
        for i, (c, r) in enumerate(zip(completions, rows)):
            pool.submit(i, c, r)
        got = collect_all(pool, len(completions))
        assert pool.pending == 0
        # each bad completion took down two workers: in a batch (maybe the same), then alone
        assert pool.restarts in (3, 4) and pool.faults == 2
        assert all(w.process.is_alive() for w in pool._pool)
    assert {i for i, s in got.items() if s.fault} == {2, 4}
    assert "killed or hung a reward worker twice" in got[2].fault
    assert "did not return within 2s" in got[4].fault
    for i, c in enumerate(completions):  # nothing else lost, each scored as inline scores it
        if c not in ("crash", "hang"):
            assert got[i].total == float(len(c)) and got[i].fault is None
    written = [json.loads(line) for line in faults.read_text().splitlines()]
    assert sorted((w["prompt_id"], w["completion"]) for w in written) == [
        ("p2", "crash"),
        ("p4", "hang"),
    ]
    assert written[0]["row"]["prompt"] in ("q2", "q4")


def test_a_worker_killed_from_outside_is_replaced_and_nothing_is_lost_or_faulted(
    fragile_rewards, tmp_path
):
    status = tmp_path / "workers.json"
    specs = RewardSpec.from_config("fragile_rewards:slow")
    with RewardPool(specs, workers=1, timeout_s=30, status_path=status, max_batch=2) as pool:
        for i in range(10):
            pool.submit(i, "x" * i, {"prompt_id": f"p{i}"})
        first = json.loads(status.read_text())["0"]
        time.sleep(0.5)  # mid-batch
        os.kill(first, signal.SIGKILL)
        got = collect_all(pool, 10)
        assert json.loads(status.read_text())["0"] != first  # the replacement's pid
        assert pool.restarts == 1 and pool.faults == 0
    assert [got[i].total for i in range(10)] == load_rewards(specs).score(
        ["x" * i for i in range(10)], [{}] * 10
    )[0]


def test_past_max_restarts_the_run_stops_naming_the_prompts_and_the_setting(fragile_rewards):
    specs = RewardSpec.from_config("fragile_rewards:always_crashes")
    with RewardPool(specs, workers=1, max_restarts=2) as pool:
        for i in range(3):
            pool.submit(i, "x", {"prompt_id": f"p{i}"})
        with pytest.raises(RewardError, match=r"died .*prompt\(s\) \['p\d'.*max_restarts=2"):
            collect_all(pool, 3)


FIT_REWARD = '''
import multiprocessing, os, signal, time

MARKS = {marks!r}

def fragile(completion, row):
    """In a reward worker: segfaults on the first (prompt, completion) it sees, hangs on the
    first of another prompt (each every time they come again); else exact match."""
    if multiprocessing.current_process().name.startswith("streamrl-reward"):
        key = row["prompt_id"] + "\\n" + completion
        for name in ("crash", "hang"):
            path = os.path.join(MARKS, name)
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                os.write(fd, key.encode())
                os.close(fd)
            except FileExistsError:
                pass
            claimed = open(path).read()
            if claimed == key and name == "crash":
                os.kill(os.getpid(), signal.SIGSEGV)
            if claimed == key:
                time.sleep(600)
            if claimed.split("\\n")[0] == row["prompt_id"]:
                break
    return 1.0 if completion.strip() == str(row["answer"]).strip() else 0.0
'''


def test_a_run_whose_reward_segfaults_on_one_completion_and_hangs_on_another_finishes(
    tmp_path, monkeypatch, capsys
):
    """Both completions are reward faults (counted, written for the user, left out of the
    loss); every other sample is trained; nothing is lost."""
    import yaml

    from streamrl.cli.main import main

    (tmp_path / "marks").mkdir()
    (tmp_path / "fragile_fit.py").write_text(FIT_REWARD.format(marks=str(tmp_path / "marks")))
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "out"
    rl = {"iterations": 2, "prompts_per_iteration": 4, "group_size": 2}
    rl |= {"generation": {"num_instances": 1}, "rollouts": {"max_tokens": 12}}
    rl |= {"reward": "fragile_fit:fragile", "reward_pool": {"timeout_s": 3.0}}
    data = {"tasks": ["copy"], "n_train": 32, "n_heldout": 4, "median_len": 3, "max_len": 6}
    config = {"output_dir": str(out), "data": data, "sft": {"steps": 5}, "rl": rl}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    try:
        assert main(["fit", "--config", str(tmp_path / "run.yaml"), "--no-progress"]) == 0
    finally:
        sys.modules.pop("fragile_fit", None)
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    faults = [json.loads(line) for line in (out / "reward_faults.jsonl").read_text().splitlines()]
    crash, hang = ((tmp_path / "marks" / n).read_text().split("\n") for n in ("crash", "hang"))
    assert {(f["prompt_id"], f["completion"]) for f in faults} == {tuple(crash), tuple(hang)}
    assert summary["samples_reward_fault"] == len(faults) >= 2
    assert summary["reward_workers_restarted"] >= 3
    assert summary["samples_lost"] == 0
    # a group left with one sample is refilled by a new prompt (GRPO's min_group_size is 2)
    requested = summary["samples_requested"]
    assert summary["samples_trained"] + summary["samples_filtered"] + len(faults) == requested
