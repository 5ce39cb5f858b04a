"""``rl.save_rollouts`` and ``RolloutRecorder``: every sample the loss trained on is on disk, one
Parquet file per iteration, readable with ``datasets``, row for row what the loss saw."""

from __future__ import annotations

import json
import os
import signal

import datasets
import pyarrow as pa
import pytest
import torch
import yaml

from streamrl.cli.main import main
from streamrl.records import Sample
from streamrl.training.module import StreamRLModule
from streamrl.training.rollout_files import ParquetRollouts, TrainedSample

pytestmark = pytest.mark.timeout(600)


def load_rows(directory) -> list[dict]:
    files = sorted(str(p) for p in directory.glob("iteration-*.parquet"))
    return list(datasets.load_dataset("parquet", data_files=files, split="train"))


@pytest.fixture
def loss_saw(monkeypatch) -> list[dict]:
    """Every sample ``backward_micro`` took, as a row of the files would hold it."""
    seen: list[dict] = []
    original = StreamRLModule.backward_micro

    def spy(self, micro, iteration, scale):
        for sample, advantage in zip(micro.samples, micro.advantages):
            seen.append(
                dict(
                    iteration=iteration,
                    prompt_id=sample.prompt_id,
                    sample_index=sample.sample_index,
                    prompt_ids=list(sample.prompt_ids),
                    token_ids=list(sample.token_ids),
                    logprobs=list(sample.logprobs),
                    weight_version=sample.weight_version,
                    reward=sample.reward,
                    advantage=advantage,
                    instance_id=sample.instance_id,
                )
            )
        return original(self, micro, iteration, scale)

    monkeypatch.setattr(StreamRLModule, "backward_micro", spy)
    return seen


KEY = ("iteration", "prompt_id", "sample_index")


def by_key(rows: list[dict]) -> dict[tuple, dict]:
    return {tuple(r[k] for k in KEY): r for r in rows}


def test_fit_writes_each_iteration_as_the_loss_saw_it(fit_small, tmp_path, loss_saw):
    summary = fit_small(save_rollouts=True, reward=[{"name": "exact"}, {"name": "partial"}])
    out = tmp_path / "out" / "rollouts"
    names = sorted(p.name for p in out.iterdir())
    assert names == ["iteration-000000.parquet", "iteration-000001.parquet"]
    rows = load_rows(out)
    assert len(rows) == summary["samples_trained"] == len(loss_saw) == 16
    written = by_key(rows)
    for seen in loss_saw:
        row = written[(seen["iteration"], seen["prompt_id"], seen["sample_index"])]
        assert {k: row[k] for k in seen} == seen
        length = len(row["token_ids"])
        assert row["loss_mask"] == [1] * length  # single completions: every token trained
        assert (
            row["token_versions"] == [row["weight_version"]] * length == [row["iteration"]] * length
        )
        assert set(row["reward_parts"]) == {"exact", "partial"}
        assert row["finish_reason"] in ("eos", "length") and row["turns"] == 1

    # Resumed for one more iteration: its file joins the others, which stay as they were.
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    del loss_saw[:]
    rewards = [{"name": "exact"}, {"name": "partial"}]
    fit_small(save_rollouts=True, iterations=3, reward=rewards, args=("--resume", "auto"))
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.name in before} == before
    rows = load_rows(out)
    assert len(rows) == 24 and len(loss_saw) == 8
    written = by_key(rows)
    assert all({k: written[tuple(s[k] for k in KEY)][k] for k in s} == s for s in loss_saw)


def test_a_stop_after_an_iterations_step_still_writes_its_file(fit_small, tmp_path, monkeypatch):
    """SIGTERM while iteration 1's weights go out (its optimizer step done): the stop's
    checkpoint counts iteration 1 as trained, so its file must be on disk too, and the resumed
    run writes only the iteration after it (``scripts/chaos.py`` once found one missing)."""
    sync_weights, stops = StreamRLModule.sync_weights, []

    def stopped_in_sync(self, iteration):
        if iteration == 1 and not stops:  # the first run only
            stops.append(iteration)
            os.kill(os.getpid(), signal.SIGTERM)  # raised in this frame: the step is done
        return sync_weights(self, iteration)

    monkeypatch.setattr(StreamRLModule, "sync_weights", stopped_in_sync)
    fit_small(save_rollouts=True, iterations=3, exit_code=128 + signal.SIGTERM)
    out = tmp_path / "out"
    checkpoint = torch.load(out / "checkpoints" / "last.ckpt", weights_only=False)
    assert checkpoint["stopped_by"] == "SIGTERM" and checkpoint["global_step"] == 2
    names = sorted(p.name for p in (out / "rollouts").iterdir())
    assert names == ["iteration-000000.parquet", "iteration-000001.parquet"]
    assert len(load_rows(out / "rollouts")) == checkpoint["streamrl"]["samples_trained"] == 16

    summary = fit_small(save_rollouts=True, iterations=3, args=("--resume", "auto"))
    rows = load_rows(out / "rollouts")
    assert len(rows) == summary["samples_trained"] == 24
    assert len({(r["iteration"], r["prompt_id"], r["sample_index"]) for r in rows}) == 24


def test_without_the_setting_nothing_is_written(fit_small, tmp_path):
    fit_small()
    assert not (tmp_path / "out" / "rollouts").exists()


def test_episode_runs_write_episodes_with_their_loss_mask(tmp_path, capsys, loss_saw):
    rows = tmp_path / "words.jsonl"
    words = ["apple", "river", "stone", "cloud", "green", "light"] * 2
    rows.write_text("".join(json.dumps({"prompt": w[:2], "answer": w}) + "\n" for w in words))
    config = tmp_path / "run.yaml"
    body = {
        "output_dir": str(tmp_path / "out"),
        "data": {"path": str(rows), "heldout_fraction": 0.25},
        "env": {  # each wrong guess is answered "no", up to 3 turns
            "name": "extension_plugins:GuessEnv",
            "demonstrations": "extension_plugins:guess_demonstration",
            "max_turns": 3,
        },
        "sft": {"model_size": "test", "steps": 10, "tokens_per_batch": 1024},
        "rl": {
            "iterations": 2,
            "prompts_per_iteration": 2,
            "group_size": 2,
            "generation": {"num_instances": 1, "max_batch_size": 8},
            "rollouts": {"max_tokens": 24},
            "save_rollouts": True,
        },
    }
    config.write_text(yaml.safe_dump(body))
    assert main(["fit", "--config", str(config), "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = load_rows(tmp_path / "out" / "rollouts")
    assert len(rows) == summary["samples_trained"] == len(loss_saw) == 8
    written = by_key(rows)
    for seen in loss_saw:
        row = written[(seen["iteration"], seen["prompt_id"], seen["sample_index"])]
        assert {k: row[k] for k in seen} == seen
        assert len(row["loss_mask"]) == len(row["token_versions"]) == len(row["token_ids"])
        assert row["reward_parts"] is None  # an episode's reward is its environment's
    # An episode past its first turn holds the environment's replies, which are not trained.
    multi = [r for r in rows if r["turns"] > 1]
    assert multi and all(0 in r["loss_mask"] for r in multi)
    assert sum(r["turns"] for r in rows) == summary["turns"]


def sample(pid: str, tokens: list, mask: list[int] | None = None) -> Sample:
    n = len(tokens)
    return Sample(pid, 0, [1, 2], tokens, [-0.5] * n, 3, 1, reward=1.0, loss_mask=mask)


def test_a_redone_iteration_replaces_its_file_and_a_failed_write_is_raised(tmp_path):
    sink = ParquetRollouts(tmp_path)
    sink(0, [TrainedSample(sample("a", [5, 6], mask=[1, 0]), 0.5)])
    sink(1, [TrainedSample(sample("x", [5]), 0.0)])
    sink(0, [TrainedSample(sample("b", [7]), -0.5)])  # iterations 0 and 1 again (a resume)
    sink(1, [])  # this time nothing trained: no file
    sink.flush()
    assert not sink.path(1).exists()
    rows = load_rows(tmp_path)
    assert [(r["iteration"], r["prompt_id"], r["loss_mask"], r["advantage"]) for r in rows] == [
        (0, "b", [1], -0.5)
    ]
    assert rows[0]["token_versions"] == [3] and rows[0]["reward_parts"] is None
    sink(2, [TrainedSample(sample("c", ["not a token id"]), 0.0)])
    with pytest.raises(pa.ArrowInvalid):
        sink.close()
    assert not sink.path(2).exists()


def test_a_python_hook_gets_each_iteration_without_the_filtered_groups(
    tmp_path, tokenizer, loss_saw
):
    from streamrl.algorithms import GRPO
    from streamrl.components.generation.service import StreamGenerationService
    from streamrl.policy.models import build_tiny_model, save_policy
    from streamrl.run.reports import ledger
    from streamrl.tasks import make_prompt_set
    from streamrl.training.builders import build_trainer
    from streamrl.training.prompts import PromptSource
    from streamrl.training.rollout import RolloutStream
    from streamrl.training.rollout_files import RolloutRecorder

    policy = build_tiny_model(tokenizer, "test", seed=0)
    save_policy(policy, tokenizer, tmp_path / "policy")
    prompts = make_prompt_set(64, ["copy"], median_len=3, max_len=6, seed=0)

    def parity(completion: str, answer: str) -> float:  # two samples agree half the time
        return float(len(completion) % 2)

    hooked: list[tuple[int, TrainedSample]] = []
    recorder = RolloutRecorder(lambda it, trained: hooked.extend((it, t) for t in trained))
    algorithm = GRPO(group_size=2, dynamic_sampling=True)
    with StreamGenerationService(tmp_path / "policy", 1, max_batch_size=8) as sgs:
        rollouts = RolloutStream(
            sgs,
            PromptSource(prompts, 4),
            tokenizer,
            algorithm,
            reward=parity,
            max_tokens=12,
            context=256,
            # Room for every refill: with the default cap (8 a iteration) a run falls short of
            # four kept groups in about one iteration of fourteen, and trains one group fewer.
            max_refills=64,
        )
        module = StreamRLModule(policy, algorithm, rollouts, iterations=3, lr=1e-3)
        build_trainer(module, show_progress=False, callbacks=[recorder]).fit(module)
    books = ledger(module)
    assert books["samples_filtered"] > 0  # groups whose two rewards agreed were not trained
    assert len(hooked) == books["samples_trained"] == len(loss_saw) == 3 * 4 * 2
    got = [(it, t.sample.prompt_id, t.sample.sample_index, t.advantage) for it, t in hooked]
    want = [(s["iteration"], s["prompt_id"], s["sample_index"], s["advantage"]) for s in loss_saw]
    assert sorted(got) == sorted(want)
    rewards: dict[tuple, list] = {}
    for it, t in hooked:
        rewards.setdefault((it, t.sample.prompt_id), []).append(t.sample.reward)
    assert all(len(set(r)) == 2 for r in rewards.values())  # only the groups kept


def test_a_failing_run_closes_its_sink_and_keeps_its_own_error(tmp_path, capsys):
    from types import SimpleNamespace

    from streamrl.components.training.pipeline import MicroBatch
    from streamrl.training.rollout_files import RolloutRecorder

    class Sink:
        def __init__(self) -> None:
            self.calls: list = []

        def __call__(self, iteration, trained):
            self.calls.append((iteration, [(t.sample.prompt_id, t.advantage) for t in trained]))

        def close(self) -> None:
            self.calls.append("closed")

    sink = Sink()
    recorder = RolloutRecorder(sink)
    module = SimpleNamespace(rollouts=object(), trained_batches=None, settled_batches=None)
    recorder.on_train_start(None, module)
    module.trained_batches.append(MicroBatch([sample("a", [5])], [0.25]))
    module.settled_batches = (4, module.trained_batches)  # iteration 4 stepped
    module.trained_batches = [MicroBatch([sample("b", [6])], [0.5])]  # 5: cut short
    recorder.on_train_batch_end(None, module, None, 0, 0)
    recorder.on_exception(None, module, RuntimeError("the run failed"))
    assert sink.calls == [(4, [("a", 0.25)]), "closed"]
    # A write that fails while the run fails is reported, not raised over the run's own error.
    files = ParquetRollouts(tmp_path)
    files(9, [TrainedSample(sample("c", ["not a token id"]), 0.0)])
    RolloutRecorder(files).on_exception(None, module, RuntimeError("the run failed"))
    assert "rollout files not all written" in capsys.readouterr().err
