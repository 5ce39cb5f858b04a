"""Kill and resume: a run stopped mid-iteration (async, samples in flight) and resumed from its
checkpoint trains the same (prompt, iteration) pairs as an uninterrupted run, each once."""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from streamrl.algorithms import GRPO
from streamrl.components.generation_service import StreamGenerationService
from streamrl.models import build_tiny_model, save_policy
from streamrl.module import StreamRLModule, rl_trainer
from streamrl.rollout import PromptSource, RolloutStream
from streamrl.tasks import make_prompt_set, partial_credit

pytestmark = pytest.mark.timeout(300)

ITERATIONS, PROMPTS, GROUP, CRASH_AT = 5, 4, 2, 3


class Crash(Exception):
    """Stands in for a killed trainer."""


class Recorded(StreamRLModule):
    """Commits an iteration's (prompt, iteration) pairs when its optimizer step is done, and can
    crash in the middle of iteration ``crash_at`` (after some of it has been trained)."""

    def __init__(self, *args, crash_at: int | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.crash_at, self.committed, self._pending = crash_at, Counter(), set()

    def loss_inputs(self, batch):
        self._pending |= {(s.prompt_id, s.iteration) for s in batch.samples}
        if self.crash_at is not None and self.weight_version == self.crash_at:
            assert self.rollouts.service._outstanding, "the crash must leave samples in flight"
            raise Crash(f"killed in iteration {self.weight_version}")
        return super().loss_inputs(batch)

    def on_train_batch_end(self, *args) -> None:
        self.committed.update(self._pending)
        self._pending = set()


def fit(run_dir, model_dir, tokenizer, policy, crash_at=None, ckpt_path=None) -> Recorded:
    prompts = make_prompt_set(64, ["copy"], median_len=3, max_len=6, seed=0)
    algorithm = GRPO(partial_credit, group_size=GROUP)
    with StreamGenerationService(model_dir, 1, max_batch_size=8) as sgs:
        rollouts = RolloutStream(sgs, PromptSource(prompts, PROMPTS), tokenizer, algorithm, 24,
                                 256, forced_lengths=iter([4, 24] * 1000))  # fmt: skip
        module = Recorded(policy, algorithm, rollouts, ITERATIONS, lr=1e-3, mode="async",
                          crash_at=crash_at)  # fmt: skip
        checkpoints = ModelCheckpoint(run_dir / "ckpt", every_n_train_steps=1, save_last=True)
        trainer = rl_trainer(ITERATIONS, default_root_dir=run_dir, enable_checkpointing=True,
                             callbacks=[checkpoints])  # fmt: skip
        with contextlib.suppress(Crash):
            trainer.fit(module, ckpt_path=ckpt_path)
    return module


def test_async_run_killed_mid_iteration_resumes_without_loss_or_repeat(tmp_path, tokenizer):
    model_dir = save_policy(build_tiny_model(tokenizer, "test", seed=0), tokenizer,
                            tmp_path / "policy")  # fmt: skip

    def policy(seed: int = 0):
        return build_tiny_model(tokenizer, "test", seed=seed)

    uninterrupted = fit(tmp_path / "a", model_dir, tokenizer, policy())
    assert uninterrupted.weight_version == ITERATIONS
    crashed = fit(tmp_path / "b", model_dir, tokenizer, policy(), crash_at=CRASH_AT)
    assert crashed.weight_version == CRASH_AT
    checkpoint = torch.load(tmp_path / "b" / "ckpt" / "last.ckpt", weights_only=False)
    assert checkpoint["streamrl"]["rollouts"]["in_flight"]  # async: the next iteration was out
    resumed = fit(tmp_path / "b", model_dir, tokenizer, policy(seed=1),
                  ckpt_path=tmp_path / "b" / "ckpt" / "last.ckpt")  # fmt: skip
    assert resumed.weight_version == ITERATIONS
    trained = crashed.committed + resumed.committed
    assert set(trained) == set(uninterrupted.committed)  # same pairs...
    assert set(trained.values()) == {1}  # ...each trained in exactly one committed step
    assert len(trained) == ITERATIONS * PROMPTS
    # The ledger carries over: every sample of every iteration trained once in all.
    assert resumed.samples_trained == ITERATIONS * PROMPTS * GROUP
