"""`streamrl fit` with `rl.trainer_ranks: 2`: FSDP2 over two trainer processes, rank 0 dealing
each micro-batch of one generation service's stream to both, against the same run on one rank.

Both runs go through the CLI in subprocesses (a run of two ranks sets up torch.distributed in
its process). One iteration, one generator: both runs train on the very same samples, so the
trained weights must agree up to float rounding.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from streamrl.models import load_policy

pytestmark = pytest.mark.timeout(400)


def _fit(tmp_path, ranks: int, iterations: int = 1, *extra: str, name: str = "") -> dict:
    out = tmp_path / (name or f"ranks{ranks}")
    config = tmp_path / f"{out.name}.yaml"
    config.write_text(
        f"output_dir: {out}\n"
        "data: {tasks: [copy, count], n_train: 32, n_heldout: 8, median_len: 3, max_len: 6}\n"
        "sft: {model_size: test, steps: 20}\n"
        f"rl: {{iterations: {iterations}, prompts_per_iteration: 6, group_size: 2, generators: 1,"
        f" max_tokens: 12, token_budget: 64, checkpoint_every: 1, reward: partial,"
        f" trainer_ranks: {ranks}}}\n"
    )
    command = [sys.executable, "-m", "streamrl.cli", "fit", "--config", str(config)]
    result = subprocess.run([*command, "--no-progress", *extra], capture_output=True, text=True,
                            timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_two_fsdp_trainer_ranks_train_like_one(tmp_path):
    one, two = _fit(tmp_path, 1), _fit(tmp_path, 2)
    for summary in (one, two):
        assert summary["samples_trained"] == 12 and summary["samples_lost"] == 0
    assert two["reward_first"] == pytest.approx(one["reward_first"])  # the same samples
    assert one["reward_first"] > 0  # some advantages are not 0: the update is not empty
    start = dict(load_policy(one["model_dir"])[0].named_parameters())
    a = dict(load_policy(one["policy_dir"])[0].named_parameters())
    b = dict(load_policy(two["policy_dir"])[0].named_parameters())
    assert list(a) == list(b)
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-5, rtol=0)
    assert all(not torch.equal(a[n], start[n]) for n in a)  # every tensor moved


def test_two_fsdp_ranks_checkpoint_and_resume(tmp_path):
    """Every rank saves (a collective), rank 0 writes one file; a resumed run of 2 ranks loads
    it on both and trains only the iterations left."""
    first = _fit(tmp_path, 2, 2, name="run")
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert last.is_file() and first["samples_trained"] == 2 * 12
    state = torch.load(last, weights_only=True, map_location="cpu")
    assert state["streamrl"]["weight_version"] == 2
    trained = dict(load_policy(first["policy_dir"])[0].named_parameters())
    saved = state["state_dict"]
    for name, tensor in trained.items():  # the file holds the full, gathered weights
        torch.testing.assert_close(saved[f"policy.{name}"], tensor, atol=1e-6, rtol=0)
    resumed = _fit(tmp_path, 2, 3, "--resume", str(last), name="run")
    assert resumed["samples_trained"] == 3 * 12 and resumed["samples_lost"] == 0
    after = dict(load_policy(resumed["policy_dir"])[0].named_parameters())
    assert any(not torch.equal(after[n], trained[n]) for n in after)  # the third step ran
