"""Kill and resume: a run stopped mid-iteration (async, samples in flight) and resumed from its
checkpoint trains the same (prompt, iteration) pairs as an uninterrupted run, each once."""

from __future__ import annotations

import contextlib
import os
import signal
from collections import Counter
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from streamrl.algorithms import GRPO
from streamrl.components.generation.service import StreamGenerationService
from streamrl.components.training.off_policy import OffPolicyCorrection
from streamrl.policy.models import build_tiny_model, save_policy
from streamrl.run.reports import ledger
from streamrl.runtime.stopping import Stopped, stop_on_signals
from streamrl.tasks import make_prompt_set, partial_credit
from streamrl.training.builders import build_trainer
from streamrl.training.module import StreamRLModule
from streamrl.training.prompts import PromptSource
from streamrl.training.rollout import RolloutStream

pytestmark = pytest.mark.timeout(300)

ITERATIONS, PROMPTS, GROUP, CRASH_AT = 5, 4, 2, 3


class Crash(Exception):
    """Stands in for a killed trainer."""


class Recorded(StreamRLModule):
    """Commits an iteration's (prompt, iteration) pairs when its optimizer step is done, and can
    crash in the middle of iteration ``crash_at`` (after some of it has been trained), or be
    sent a SIGTERM there (``stop=True``)."""

    def __init__(self, *args, crash_at: int | None = None, stop: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.crash_at, self.stop, self.committed, self._pending = crash_at, stop, Counter(), set()

    def loss_inputs(self, batch):
        self._pending |= {(s.prompt_id, s.iteration) for s in batch.samples}
        if self.crash_at is not None and self.weight_version == self.crash_at:
            assert self.rollouts.service._outstanding, "the crash must leave samples in flight"
            if not self.stop:
                raise Crash(f"killed in iteration {self.weight_version}")
            if self.samples_in_step:  # a preemption once some of the iteration is trained
                os.kill(os.getpid(), signal.SIGTERM)
        return super().loss_inputs(batch)

    def on_train_batch_end(self, *args) -> None:
        self.committed.update(self._pending)
        self._pending = set()


def fit(
    run_dir,
    model_dir,
    tokenizer,
    policy,
    crash_at=None,
    ckpt_path=None,
    bound=1,
    partial="finish",
    stop=False,
    correction="decoupled",
) -> Recorded:
    prompts = make_prompt_set(64, ["copy"], median_len=3, max_len=6, seed=0)
    algorithm = GRPO(group_size=GROUP)
    with StreamGenerationService(model_dir, 1, max_batch_size=8, partial_rollout=partial) as sgs:
        rollouts = RolloutStream(
            sgs,
            PromptSource(prompts, PROMPTS),
            tokenizer,
            algorithm,
            reward=partial_credit,
            max_tokens=24,
            context=256,
            forced_lengths=iter([4, 24] * 1000),
        )
        module = Recorded(
            policy,
            algorithm,
            rollouts,
            ITERATIONS,
            lr=1e-3,
            mode="async",
            crash_at=crash_at,
            stop=stop,
            staleness_bound=bound,
            correction=OffPolicyCorrection(correction),
        )
        if stop:  # the run's own checkpoints: only at the end, and at a stop
            trainer = build_trainer(module, show_progress=False, output_dir=run_dir)
        else:
            checkpoints = ModelCheckpoint(run_dir / "ckpt", every_n_train_steps=1, save_last=True)
            trainer = build_trainer(
                module,
                show_progress=False,
                default_root_dir=run_dir,
                enable_checkpointing=True,
                callbacks=[checkpoints],
            )
        with contextlib.suppress(Crash, Stopped), stop_on_signals():
            trainer.fit(module, ckpt_path=ckpt_path)
    return module


@pytest.mark.parametrize(
    ("bound", "partial", "correction"),
    [(1, "finish", "decoupled"), (2, "keep", "decoupled"), (2, "keep", "seq_mask")],
    ids=["one-step", "k2-partial", "k2-partial-seq-mask"],
)
def test_async_run_killed_mid_iteration_resumes_without_loss_or_repeat(
    tmp_path, tokenizer, bound, partial, correction
):
    model_dir = save_policy(
        build_tiny_model(tokenizer, "test", seed=0), tokenizer, tmp_path / "policy"
    )

    def policy(seed: int = 0):
        return build_tiny_model(tokenizer, "test", seed=seed)

    run = dict(bound=bound, partial=partial, correction=correction)
    uninterrupted = fit(tmp_path / "a", model_dir, tokenizer, policy(), **run)
    assert uninterrupted.weight_version == ITERATIONS
    crashed = fit(tmp_path / "b", model_dir, tokenizer, policy(), crash_at=CRASH_AT, **run)
    assert crashed.weight_version == CRASH_AT
    checkpoint = torch.load(tmp_path / "b" / "ckpt" / "last.ckpt", weights_only=False)
    in_flight = checkpoint["streamrl"]["rollouts"]["in_flight"]
    assert len(in_flight) == bound  # async: the k iterations ahead were out
    resumed = fit(
        tmp_path / "b",
        model_dir,
        tokenizer,
        policy(seed=1),
        ckpt_path=tmp_path / "b" / "ckpt" / "last.ckpt",
        **run,
    )
    assert resumed.weight_version == ITERATIONS
    # The bound holds after the resume too (per token: samples may span versions).
    for module in (uninterrupted, resumed):
        assert all(h["train/staleness_max"] <= bound for h in module.history)
        lags = {int(k.rsplit("_", 1)[1]) for h in module.history for k in h if "tokens_lag" in k}
        assert max(lags) <= bound
    assert max(h["train/staleness_max"] for h in uninterrupted.history) == bound
    if correction == "seq_mask":  # every sample's gap measured, what it masked logged
        assert all("train/masked_sequences" in h for h in uninterrupted.history)
    trained = crashed.committed + resumed.committed
    assert set(trained) == set(uninterrupted.committed)  # same pairs...
    assert set(trained.values()) == {1}  # ...each trained in exactly one committed step
    assert len(trained) == ITERATIONS * PROMPTS
    # The ledger carries over: every sample of every iteration trained once in all.
    assert resumed.samples_trained == ITERATIONS * PROMPTS * GROUP
    assert same_ledger(resumed, uninterrupted)


def same_ledger(resumed: StreamRLModule, uninterrupted: StreamRLModule) -> bool:
    """The resumed run's ledger is the uninterrupted run's: what the stopped start generated
    for iterations redone is counted once (docs/failures.md, "The ledger")."""
    mine, theirs = ledger(resumed), ledger(uninterrupted)
    assert mine["samples_generated"] == ITERATIONS * PROMPTS * GROUP, mine
    return all(mine[k] == theirs[k] for k in theirs if k != "weight_versions_verified")


def test_a_preempted_run_saves_its_finished_iterations_and_resumes_with_nothing_lost_or_repeated(
    tmp_path, tokenizer
):
    """SIGTERM mid-iteration with no periodic checkpoint (``checkpoints: {every: 0}``): the stop
    writes ``last.ckpt`` holding the finished iterations and, in flight, the one under way (its
    samples partly trained, never stepped); the resumed run trains every (prompt, iteration)
    pair of the uninterrupted run exactly once."""
    model_dir = save_policy(
        build_tiny_model(tokenizer, "test", seed=0), tokenizer, tmp_path / "policy"
    )
    uninterrupted = fit(tmp_path / "a", model_dir, tokenizer, build_tiny_model(tokenizer, "test"))
    stopped = fit(
        tmp_path / "b",
        model_dir,
        tokenizer,
        build_tiny_model(tokenizer, "test"),
        CRASH_AT,
        stop=True,
    )
    assert stopped.weight_version == CRASH_AT and stopped.samples_in_step > 0  # mid-iteration
    last = tmp_path / "b" / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(last, weights_only=False)
    assert checkpoint["stopped_by"] == "SIGTERM" and checkpoint["global_step"] == CRASH_AT
    assert CRASH_AT in checkpoint["streamrl"]["rollouts"]["in_flight"]  # redone on resume
    assert checkpoint["streamrl"]["samples_trained"] == CRASH_AT * PROMPTS * GROUP
    resumed = fit(
        tmp_path / "b",
        model_dir,
        tokenizer,
        build_tiny_model(tokenizer, "test", seed=1),
        None,
        last,
    )
    assert resumed.weight_version == ITERATIONS
    trained = stopped.committed + resumed.committed
    assert set(trained) == set(uninterrupted.committed) and set(trained.values()) == {1}
    assert resumed.samples_trained == ITERATIONS * PROMPTS * GROUP
    assert same_ledger(resumed, uninterrupted)


# The resumed run writes its checkpoints to a folder of its own (Lightning notes the change).
@pytest.mark.filterwarnings("ignore:The dirpath has changed")
def test_sync_run_stopped_and_resumed_ends_with_the_uninterrupted_weights(
    tmp_path, fit_small, monkeypatch
):
    """``streamrl fit`` (sync, 1 generator): 2 iterations, then ``--resume`` from that run's
    checkpoint up to 4, against 4 iterations in one go. The resumed run starts from the
    checkpoint's weights (not the starting policy's), and ends bit for bit where the
    uninterrupted one does: same prompts, same samples (each generator reseeds its sampling for
    every weight version), same weights and AdamW states."""
    from streamrl.components.generation.worker import fingerprint
    from streamrl.policy.models import load_policy

    rl = dict(reward="partial", group_size=4, checkpoints={"every": 1})
    full = fit_small(out="full", iterations=4, **rl)
    fit_small(out="stopped", iterations=2, **rl)
    stopped = tmp_path / "stopped" / "checkpoints" / "last.ckpt"
    at_stop = torch.load(stopped, weights_only=True)
    assert at_stop["streamrl"]["weight_version"] == 2

    started_with: dict[str, torch.Tensor] = {}
    on_train_start = StreamRLModule.on_train_start

    def spy(module: StreamRLModule) -> None:  # runs once Lightning has restored the checkpoint
        started_with.update({n: p.detach().clone() for n, p in module.policy.named_parameters()})
        on_train_start(module)  # pushes the restored weights to the new generator process
        assert set(module.rollouts.service.fingerprints().values()) == {fingerprint(module.policy)}

    monkeypatch.setattr(StreamRLModule, "on_train_start", spy)
    fit_small(out="resumed", iterations=4, args=("--resume", str(stopped)), **rl)

    start = dict(load_policy(full["model_dir"])[0].named_parameters())
    assert started_with.keys() == start.keys()
    not_restored = [
        n
        for n, t in started_with.items()
        if not torch.equal(t, at_stop["state_dict"][f"policy.{n}"])
    ]
    assert not not_restored, f"the resumed run did not start from the checkpoint: {not_restored}"
    assert not all(torch.equal(started_with[n], start[n]) for n in start)  # not a fresh start

    a = torch.load(tmp_path / "full" / "checkpoints" / "last.ckpt", weights_only=True)
    b = torch.load(tmp_path / "resumed" / "checkpoints" / "last.ckpt", weights_only=True)
    assert a["global_step"] == b["global_step"] and a["streamrl"]["weight_version"] == 4
    assert a["state_dict"].keys() == b["state_dict"].keys()
    differ = [k for k in a["state_dict"] if not torch.equal(a["state_dict"][k], b["state_dict"][k])]
    assert not differ, f"resumed weights differ from the uninterrupted run's: {differ}"
    assert not all(torch.equal(b["state_dict"][f"policy.{n}"], started_with[n]) for n in start)
    adam_a, adam_b = a["optimizer_states"][0]["state"], b["optimizer_states"][0]["state"]
    assert adam_a.keys() == adam_b.keys()
    for i in adam_a:
        for key in adam_a[i]:
            assert torch.equal(adam_a[i][key], adam_b[i][key]), (i, key)
    assert _same(a["streamrl"]["prompt_source"], b["streamrl"]["prompt_source"])


def _same(a: object, b: object) -> bool:
    """Equal, tensors (the prompt loader's generator state) compared element-wise."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_a_resumed_runs_metrics_continue_in_one_file(tmp_path, fit_small):
    """Two iterations, then the same run resumed to four: one ``metrics.csv``, a row per
    iteration's step, none missing or twice (Lightning's logger would start a second file)."""
    import csv

    fit_small(out="run", iterations=2, checkpoints={"every": 1})
    fit_small(out="run", iterations=4, args=("--resume", "auto"))
    files = sorted((tmp_path / "run" / "logs").rglob("metrics.csv"))
    assert [f.relative_to(tmp_path / "run") for f in files] == [Path("logs/version_0/metrics.csv")]
    rows = list(csv.DictReader(files[0].open()))
    steps = [int(float(r["step"])) for r in rows if r.get("train/loss")]
    assert len(steps) == 4 and len(set(steps)) == 4, steps
