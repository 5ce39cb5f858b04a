"""A run whose rewards never vary says so: once, after its first iterations, naming the causes."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest

from streamrl.algorithms import GRPO
from streamrl.policy.models import build_tiny_model
from streamrl.training.module import StreamRLModule
from streamrl.training.reward_signal import (
    CHECKED_ITERATIONS,
    NoLearningSignalWarning,
    RewardSpreadCheck,
    show_plainly,
)
from streamrl.training.rollout import IterationStats
from streamrl.training.timeline import TraceRecorder


def observed(check: RewardSpreadCheck, iterations: list[list[float]]) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for rewards in iterations:
            check.observe(rewards)
    return [str(w.message) for w in caught if w.category is NoLearningSignalWarning]


def test_equal_rewards_in_each_first_iteration_warn_once_naming_the_causes():
    # Each iteration flat, though not at the same value: still no advantage anywhere.
    said = observed(RewardSpreadCheck(), [[0.0] * 8, [0.0] * 8, [1.0] * 8, [0.0] * 8, [0.0] * 8])
    assert len(said) == 1
    assert "first 3 iterations every reward was equal (to 0, 0, 1)" in said[0]
    for cause in ("format", "rl.rollouts.max_tokens", "returns a constant", "warm start"):
        assert cause in said[0]


@pytest.mark.parametrize(
    "iterations",
    [
        [[0.0, 1.0, 0.0, 0.0]] + [[0.0] * 4] * 4,  # a signal first: the later flat ones are fine
        [[0.0] * 4, [0.0] * 4, [0.0, 0.5, 0.0, 0.0]],  # a signal by the third iteration
        [[0.0] * 4, [0.0] * 4],  # too few iterations to tell
    ],
)
def test_varied_rewards_do_not_warn(iterations):
    assert observed(RewardSpreadCheck(), iterations) == []


class _Rollouts:
    """What ``StreamRLModule.log_iteration`` reads of a rollout stream."""

    def __init__(self) -> None:
        self.trace = TraceRecorder()
        self.stats = IterationStats()
        self.service = SimpleNamespace(weight_sync=SimpleNamespace(transfer_s=0.0))


@pytest.mark.parametrize(("rewards", "warns"), [([0.0] * 4, True), ([0.0, 1.0, 1.0, 0.0], False)])
def test_the_module_checks_each_iterations_rewards(tokenizer, rewards, warns):
    rollouts = _Rollouts()
    module = StreamRLModule(build_tiny_model(tokenizer, "test"), GRPO(group_size=2), rollouts, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for iteration in range(CHECKED_ITERATIONS):
            rollouts.stats = IterationStats(samples=len(rewards), rewards=list(rewards))
            module.log_iteration(iteration, wall_s=1.0, train_s=0.5, sync_s=0.1)
    said = [w for w in caught if w.category is NoLearningSignalWarning]
    assert len(said) == int(warns)


def test_the_console_script_shows_the_warning_as_a_line_of_its_own(capsys, monkeypatch):
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)  # restored afterwards
    show_plainly()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        check = RewardSpreadCheck(iterations=1)
        check.observe([1.0, 1.0])
    err = capsys.readouterr().err
    assert err.startswith("\nstreamrl: warning: within each of the first 1 iterations")
    assert "reward_signal.py" not in err and "NoLearningSignalWarning" not in err
