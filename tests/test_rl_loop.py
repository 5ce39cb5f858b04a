"""End to end: GRPO on samples streamed from 2 generator processes, driven by Lightning."""

from __future__ import annotations

import math

import pytest
import torch

from streamrl.algorithms import GRPO, RewardError
from streamrl.algorithms.base import LossInputs
from streamrl.components.generation_service import StreamGenerationService
from streamrl.components.generator_worker import fingerprint
from streamrl.models import build_tiny_model, save_policy
from streamrl.module import StreamRLModule, rl_trainer
from streamrl.rollout import PromptSource, RolloutStream
from streamrl.tasks import make_prompt_set, partial_credit

pytestmark = pytest.mark.timeout(300)


def test_grpo_advantages_hand_computed():
    grpo = GRPO(partial_credit, group_size=4)
    # rewards 1, 0, 0, 1: mean 0.5, population std 0.5 -> advantages +-1
    assert grpo.score_group([1.0, 0.0, 0.0, 1.0]) == pytest.approx([1, -1, -1, 1], abs=1e-5)
    assert grpo.score_group([0.3, 0.3, 0.3, 0.3]) == [0.0] * 4
    with pytest.raises(ValueError, match="group_size >= 2"):
        GRPO(partial_credit, group_size=1)


def test_grpo_clipped_loss_hand_computed():
    grpo = GRPO(partial_credit, group_size=2, clip_eps=0.2)
    logprobs = torch.log(torch.tensor([[0.5, 0.6], [0.5, 0.5]]))
    old = torch.log(torch.tensor([[0.25, 0.6], [0.5, 0.25]]))
    batch = LossInputs(logprobs, old, torch.tensor([1.0, -1.0]), torch.tensor([[1, 1], [1, 0]]))
    # Sample 0 (A=+1): ratios 2.0 (clipped to 1.2) and 1.0 -> mean of -1.2, -1.0 = -1.1.
    # Sample 1 (A=-1): ratio 1.0 on its only real token -> +1.0 (the padded ratio 2.0 is masked).
    assert grpo.loss(batch).tolist() == pytest.approx([-1.1, 1.0])


def test_reward_errors_name_the_prompt():
    from streamrl.records import Sample

    sample = Sample("q7", 2, [5], [6], [-0.1], 0, 1)
    with pytest.raises(RewardError, match=r"prompt 'q7' .*sample 2, instance 1.*ZeroDivisionError"):
        GRPO(lambda c, a: 1 / 0, 2).score_sample(sample, "x", "y")
    with pytest.raises(RewardError, match="returned nan for prompt 'q7'"):
        GRPO(lambda c, a: math.nan, 2).score_sample(sample, "x", "y")


def test_grpo_iterations_with_two_generator_processes(tmp_path, tokenizer):
    policy = build_tiny_model(tokenizer, "test", seed=0)
    save_policy(policy, tokenizer, tmp_path / "policy")
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    prompts = make_prompt_set(32, ["copy", "count"], median_len=3, max_len=6, seed=0)
    algorithm = GRPO(partial_credit, group_size=4)
    with StreamGenerationService(tmp_path / "policy", 2, max_batch_size=8) as sgs:
        rollouts = RolloutStream(sgs, PromptSource(prompts, 4), tokenizer, algorithm, 12, 256)
        module = StreamRLModule(policy, algorithm, rollouts, iterations=3, lr=1e-3)
        trainer = rl_trainer(3)
        trainer.fit(module)
        assert trainer.global_step == 3 and module.weight_version == 3
        assert len(module.history) == 3
        assert all(h["rollout/tokens"] > 0 for h in module.history)
        changed = [k for k, v in policy.state_dict().items() if not torch.equal(v, before[k])]
        assert len(changed) > len(before) // 2
        # Generators hold exactly the trainer's weights after update().
        assert set(sgs.fingerprints().values()) == {fingerprint(policy)}
        assert [i.weight_version for i in sgs.instances()] == [3, 3]
        # 3 iterations x 4 prompts: the source dealt 12 prompts, each exactly once per epoch.
        assert rollouts.prompts.state_dict() == {"epoch": 0, "position": 12}


def test_ranker_dispatch_and_lpt_wired_into_the_loop(tmp_path, tokenizer):
    from streamrl.components.latency import LatencyModel
    from streamrl.components.ranker import LengthRanker
    from streamrl.components.skew_dispatch import SkewAwareDispatcher

    policy = build_tiny_model(tokenizer, "test", seed=0)
    save_policy(policy, tokenizer, tmp_path / "policy")
    prompts = make_prompt_set(64, ["copy", "count"], median_len=4, max_len=16, seed=0)
    algorithm = GRPO(partial_credit, group_size=2)
    # "sum" always isolates a tail pool once prompts are scored (what this test checks).
    latency = LatencyModel([1, 8], [0.001, 0.002])
    dispatcher = SkewAwareDispatcher(latency, max_batch_size=8, objective="sum")
    ranker = LengthRanker(epochs=50, seed=0)
    with StreamGenerationService(tmp_path / "policy", 2, max_batch_size=8, dispatcher=dispatcher,
                                 scheduler="lpt") as sgs:  # fmt: skip
        rollouts = RolloutStream(sgs, PromptSource(prompts, 10), tokenizer, algorithm, 16, 256,
                                 ranker=ranker, ranker_refresh_every=1)  # fmt: skip
        module = StreamRLModule(policy, algorithm, rollouts, iterations=3, lr=1e-3)
        trainer = rl_trainer(3)
        trainer.fit(module)
    # Refreshed from the policy's samples right after the next dispatch: iterations 0 and 1
    # (the last iteration's samples wait for a dispatch that never comes).
    assert ranker.net is not None and len(ranker.recent) == 2 * 10 * 2
    assert len(dispatcher.recent) == 2 * 10 * 2  # the length distribution D follows the policy
    n_long, n_regular = dispatcher.last_split
    assert n_long >= 1 and n_long + n_regular == 2  # once scored, a tail pool is isolated
    checkpoint: dict = {}
    module.on_save_checkpoint(checkpoint)
    assert checkpoint["streamrl"]["length_ranker"]["recent"]


def test_dynamic_sampling_refills_filtered_groups_and_the_ledger_balances(tmp_path, tokenizer):
    from streamrl.jobs import ledger

    policy = build_tiny_model(tokenizer, "test", seed=0)
    save_policy(policy, tokenizer, tmp_path / "policy")
    prompts = make_prompt_set(64, ["copy"], median_len=3, max_len=6, seed=0)

    def parity(completion: str, answer: str) -> float:  # varies at random between samples
        return float(len(completion) % 2)

    algorithm = GRPO(parity, group_size=2, dynamic_sampling=True)
    with StreamGenerationService(tmp_path / "policy", 1, max_batch_size=8) as sgs:
        rollouts = RolloutStream(sgs, PromptSource(prompts, 4), tokenizer, algorithm, 12, 256)
        module = StreamRLModule(policy, algorithm, rollouts, iterations=3, lr=1e-3)
        trainer = rl_trainer(3)
        trainer.fit(module)
    books = ledger(module)
    # Two samples agree half the time: some groups were filtered and replaced from the stream.
    assert books["samples_filtered"] > 0 and books["prompts_dispatched"] > 3 * 4
    assert books["samples_lost"] == 0
    assert books["samples_trained"] + books["samples_filtered"] == books["samples_requested"]
