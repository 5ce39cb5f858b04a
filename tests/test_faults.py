"""Fault injection in the live loop: each run finishes (or stops with the documented error) and
the ledger balances: every requested sample is trained exactly once or accounted for."""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import signal
from collections import Counter

import pytest
import torch

from streamrl.algorithms import GRPO, RewardError
from streamrl.components.generation.service import StreamGenerationService
from streamrl.components.generation.timeouts import Timeouts
from streamrl.errors import NonFiniteLossError
from streamrl.policy.models import build_tiny_model, save_policy
from streamrl.run.reports import ledger
from streamrl.tasks import make_prompt_set, partial_credit
from streamrl.training.builders import build_trainer
from streamrl.training.module import StreamRLModule
from streamrl.training.prompts import PromptSource
from streamrl.training.rollout import RolloutStream

pytestmark = [pytest.mark.faults, pytest.mark.timeout(300)]

ITERATIONS, PROMPTS, GROUP = 4, 4, 4


class FaultyRun(StreamRLModule):
    """Counts every sample it trains on and injects ``fault`` into generator instance 0 right
    after iteration 1's prompts are dispatched (they, and in async mode iteration 2's, are
    being generated)."""

    def loss_inputs(self, batch):
        self.trained.update(s.key for s in batch.samples)
        return super().loss_inputs(batch)

    def dispatch(self, iteration: int) -> int:
        current = super().dispatch(iteration)
        if self.fault and iteration == 1:
            fault, self.fault = self.fault, None
            service = self.rollouts.service
            if fault == "corrupt":
                service.pool.handles[0].inbox.put(("update", "not a version"))
            else:
                sig = signal.SIGKILL if fault == "kill" else signal.SIGSTOP
                os.kill(service.instances()[0].pid, sig)
        return current


def run_with_fault(tmp_path, tokenizer, fault: str | None, mode: str = "sync", reward=None):
    policy = build_tiny_model(tokenizer, "test", seed=0)
    save_policy(policy, tokenizer, tmp_path / "policy")
    prompts = make_prompt_set(64, ["copy"], median_len=3, max_len=6, seed=0)
    algorithm = GRPO(group_size=GROUP)
    sgs = StreamGenerationService(
        tmp_path / "policy", 2, max_batch_size=8, timeouts=Timeouts(heartbeat_s=4)
    )
    with sgs:
        lengths = iter([10, 10, 120, 120] * 100)
        rollouts = RolloutStream(
            sgs,
            PromptSource(prompts, PROMPTS),
            tokenizer,
            algorithm,
            reward=reward or partial_credit,
            max_tokens=64,
            context=256,
            forced_lengths=lengths,
        )
        module = FaultyRun(policy, algorithm, rollouts, ITERATIONS, lr=1e-3, mode=mode)
        module.trained, module.fault = Counter(), fault
        trainer = build_trainer(module, show_progress=False)
        trainer.fit(module)
        sgs.wait_active()
        states = [i.state for i in sgs.instances()]
    module.failures = sgs.pool.failures  # why each instance was replaced
    return module, states


@pytest.mark.parametrize(
    ("fault", "mode"), [("kill", "sync"), ("kill", "async"), ("hang", "sync"), ("corrupt", "sync")]
)
def test_a_failed_generator_is_replaced_and_nothing_is_lost(tmp_path, tokenizer, fault, mode):
    module, states = run_with_fault(tmp_path, tokenizer, fault, mode)
    books = ledger(module)
    assert books["samples_lost"] == 0
    assert books["instances_restarted"] == len(module.failures) == 1, module.failures
    assert module.failures[0].startswith("instance 0 ")
    assert books["samples_requeued"] > 0
    assert books["samples_trained"] == ITERATIONS * PROMPTS * GROUP
    assert set(module.trained.values()) == {1}  # nothing trained twice
    assert states == ["failed", "active", "active"]
    assert not [p for p in mp.active_children() if p.name.startswith("streamrl-generator")]


def test_a_reward_that_raises_stops_the_run_naming_the_prompt(tmp_path, tokenizer):
    def reward(completion: str, answer: str) -> float:
        if answer == poison:
            raise ZeroDivisionError("bad row")
        return 0.0

    rows = make_prompt_set(64, ["copy"], median_len=3, max_len=6, seed=0)
    poison = PromptSource(rows, PROMPTS).next_batch()[1]["answer"]
    with pytest.raises(
        RewardError, match=r"ZeroDivisionError\('bad row'\) on prompt\(s\) \['p\d+'\]"
    ):
        run_with_fault(tmp_path, tokenizer, None, reward=reward)
    assert not [p for p in mp.active_children() if p.name.startswith("streamrl-generator")]


def test_non_finite_loss_stops_naming_the_samples_before_the_weights_change(tmp_path, tokenizer):
    class NaNAtIterationOne(GRPO):
        def token_loss(self, batch):
            terms = super().token_loss(batch)
            if module.weight_version == 1:
                terms.policy = terms.policy * float("nan")
            return terms

    policy = build_tiny_model(tokenizer, "test", seed=0)
    save_policy(policy, tokenizer, tmp_path / "policy")
    prompts = make_prompt_set(16, ["copy"], median_len=3, max_len=6, seed=0)
    algorithm = NaNAtIterationOne(group_size=2)
    with StreamGenerationService(tmp_path / "policy", 1, max_batch_size=8) as sgs:
        rollouts = RolloutStream(
            sgs,
            PromptSource(prompts, 2),
            tokenizer,
            algorithm,
            reward=partial_credit,
            max_tokens=8,
            context=256,
        )
        module = StreamRLModule(policy, algorithm, rollouts, 3, lr=1e-3)
        trainer = build_trainer(module, show_progress=False)
        with pytest.raises(NonFiniteLossError, match=r"iteration 1 on (\d+) sample") as stopped:
            trainer.fit(module)
    # The message names every sample of the micro-batch that went non-finite, all of iteration 1.
    count = int(re.search(r"on (\d+) sample", str(stopped.value)).group(1))
    named = re.findall(r"\('(p\d+)', (\d), (\d)\)", str(stopped.value))
    assert count >= 1 and len(named) == count
    assert all(iteration == "1" for _, _, iteration in named)
    assert all(torch.isfinite(p).all() for p in policy.parameters())
    assert module.weight_version == 1
