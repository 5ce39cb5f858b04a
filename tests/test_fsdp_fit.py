"""`streamrl fit` with two FSDP2 trainer ranks against the same run on one rank: the ranks spawned
by `streamrl fit` itself (`trainer.devices: 2`), or started by an external launcher (`torchrun
--nnodes 2`, two "nodes" on this machine, each running `streamrl fit`). Either way rank 0 hosts
the one generation service and deals each micro-batch of its stream to both ranks.

Every run goes through the CLI in a subprocess (a run of two ranks sets up torch.distributed in
its process). Three iterations, one generator, sync mode: both runs train on the very same
samples, so every iteration's loss and gradient norm, and the trained weights, must agree up to
float rounding. Over several steps a wrong scale of the ranks' gradients shows in the gradient
norm and the loss (one AdamW step alone would hide it: AdamW is nearly scale-invariant).
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from streamrl.policy.models import load_policy

pytestmark = pytest.mark.timeout(700)  # the module fixture runs three fits

ITERATIONS, PROMPTS, GROUP = 3, 6, 4
SAMPLES = PROMPTS * GROUP  # per iteration


def _fit(root: Path, ranks: int, iterations: int, *extra: str, name: str = "") -> dict:
    config = _config(root, name or f"ranks{ranks}", iterations, ranks)
    command = [sys.executable, "-m", "streamrl.cli.main", "fit", "--config", str(config)]
    result = subprocess.run(
        [*command, "--no-progress", *extra], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _config(root: Path, name: str, iterations: int, ranks: int) -> Path:
    out = root / name
    config = root / f"{name}.yaml"
    config.write_text(
        f"output_dir: {out}\n"
        "data: {tasks: [copy, count], n_train: 32, n_heldout: 8, median_len: 3, max_len: 6}\n"
        "sft: {model_size: test, steps: 20}\n"
        f"rl: {{iterations: {iterations}, prompts_per_iteration: {PROMPTS}, group_size: {GROUP},"
        " generation: {num_instances: 1}, rollouts: {max_tokens: 12},"
        " micro_batches: {max_tokens: 64},"
        " checkpoints: {every: 1},"
        # A KL term: on-policy GRPO's loss is 0 (group-normalised advantages), the KL's is not
        # once the policy has moved, and it gives every iteration a gradient.
        " reward: partial, module: {lr: 0.001},"
        " algorithm: {class_path: grpo, init_args: {kl_coef: 0.1}}}\n"
        f"trainer: {{devices: {ranks}}}\n"
    )
    return config


def _torchrun_nodes(root: Path, name: str, iterations: int, *extra: str) -> list:
    """``torchrun --nnodes 2 --nproc_per_node 1``: two "nodes" on this machine, each a
    launcher of its own in its own session, rendezvous on a free port; node 0's rank hosts the
    service."""
    config = _config(root, name, iterations, ranks=1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [
        subprocess.Popen(
            [
                *(sys.executable, "-m", "torch.distributed.run", "--nnodes", "2"),
                *("--nproc_per_node", "1", "--node_rank", str(node)),
                *("--master_addr", "127.0.0.1", "--master_port", str(port)),
                *(
                    "-m",
                    "streamrl.cli.main",
                    "fit",
                    "--config",
                    str(config),
                    "--no-progress",
                    *extra,
                ),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for node in (0, 1)
    ]


def _fit_torchrun(root: Path, iterations: int, name: str = "torchrun", *extra: str) -> dict:
    """The run under ``torchrun`` (``_torchrun_nodes``), to its end."""
    nodes = _torchrun_nodes(root, name, iterations, *extra)
    try:
        outputs = [node.communicate(timeout=300) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    for node, (_, err) in zip(nodes, outputs):
        assert node.returncode == 0, err[-3000:]
    other = json.loads(outputs[1][0].strip().splitlines()[-1])
    assert other == {"trainer_rank": 1, "output_dir": str(root / name)}
    return json.loads(outputs[0][0].strip().splitlines()[-1])


def _per_iteration(summary: dict, metric: str) -> list[float]:
    """One metric per iteration, from the run's CSV log (the newest version: a resumed run
    writes its iterations to a log of its own)."""
    logs = sorted(Path(summary["output_dir"], "logs").glob("version_*/metrics.csv"))
    rows = list(csv.DictReader(logs[-1].open()))
    return [float(row[metric]) for row in rows if row.get(metric)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("fsdp_fit")
    return {
        1: _fit(root, 1, ITERATIONS),
        2: _fit(root, 2, ITERATIONS),
        "torchrun": _fit_torchrun(root, ITERATIONS),
    }


@pytest.mark.parametrize("launch", [2, "torchrun"])
def test_two_fsdp_trainer_ranks_train_like_one(runs, launch):
    """Two ranks spawned by ``streamrl fit`` itself, or started by ``torchrun`` as two nodes."""
    one, two = runs[1], runs[launch]
    for summary in (one, two):
        assert summary["samples_trained"] == ITERATIONS * SAMPLES
        assert summary["samples_lost"] == 0
    # The same samples at every iteration (the weights agree to float rounding) ...
    assert _per_iteration(two, "rollout/reward") == _per_iteration(one, "rollout/reward")
    assert all(g > 0 for g in _per_iteration(one, "train/grad_norm"))
    assert all(loss > 1e-3 for loss in _per_iteration(one, "train/loss")[1:])  # the KL term
    # ... so the same loss and gradient norm at every iteration. Measured: loss within 2e-9
    # (5e-7 relative; iteration 0's, 0 up to rounding, within 5e-9), gradient norm within
    # 1.5e-7 relative. A rank scale off by the world size is off by 2x.
    for metric in ("train/loss", "train/grad_norm"):
        a, b = _per_iteration(one, metric), _per_iteration(two, metric)
        assert len(a) == len(b) == ITERATIONS, metric
        assert b == pytest.approx(a, rel=1e-5, abs=1e-7), f"{metric}: 1 rank {a}, 2 ranks {b}"
    start = dict(load_policy(one["model_dir"])[0].named_parameters())
    a = dict(load_policy(one["policy_dir"])[0].named_parameters())
    b = dict(load_policy(two["policy_dir"])[0].named_parameters())
    assert list(a) == list(b)
    # Measured: within 1e-5 after 3 steps of lr 1e-3 (AdamW's step on a gradient near 0 turns
    # rounding into a visible difference).
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=5e-5, rtol=0)
    assert all(not torch.equal(a[n], start[n]) for n in a)  # every tensor moved


def test_two_fsdp_ranks_checkpoint_and_resume(tmp_path, runs):
    """Every rank saves (a collective), rank 0 writes one file (asked for: several ranks write
    sharded checkpoints by default); a resumed run of 2 ranks loads it on both, trains only the
    iterations left and ends where the uninterrupted run did."""
    one_file = ("--trainer.sharded_checkpoints", "false")
    first = _fit(tmp_path, 2, 2, *one_file, name="run")
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert last.is_file() and first["samples_trained"] == 2 * SAMPLES
    state = torch.load(last, weights_only=True, map_location="cpu")
    assert state["streamrl"]["weight_version"] == 2
    trained = dict(load_policy(first["policy_dir"])[0].named_parameters())
    saved = state["state_dict"]
    for name, tensor in trained.items():  # the file holds the full, gathered weights
        torch.testing.assert_close(saved[f"policy.{name}"], tensor, atol=1e-6, rtol=0)
    resumed = _fit(tmp_path, 2, 3, *one_file, "--resume", str(last), name="run")
    assert resumed["samples_trained"] == 3 * SAMPLES and resumed["samples_lost"] == 0
    after = dict(load_policy(resumed["policy_dir"])[0].named_parameters())
    assert any(not torch.equal(after[n], trained[n]) for n in after)  # the third step ran
    # Bit for bit: the same samples (generators reseed their sampling per weight version), the
    # same gathered weights and AdamW states restored on both ranks.
    uninterrupted = dict(load_policy(runs[2]["policy_dir"])[0].named_parameters())
    differ = [n for n in after if not torch.equal(after[n], uninterrupted[n])]
    assert not differ, f"resumed 2-rank weights differ from the uninterrupted run's: {differ}"


def test_two_ranks_train_lora_adapters_in_bf16_mixed(tmp_path):
    """LoRA under FSDP2 on two ranks, bf16-mixed, every layer checkpointed, a KL term against
    the adapter-free reference: only the adapters train, and only they reach the generators."""
    options = ("--rl.lora.r", "4", "--trainer.precision", "bf16-mixed")
    summary = _fit(tmp_path, 2, 2, *options, "--trainer.activation_checkpointing", "true")
    assert summary["samples_trained"] == 2 * SAMPLES and summary["samples_lost"] == 0
    trainer = summary["trainer"]
    assert trainer["ranks"] == 2 and trainer["precision"] == "bf16-mixed"
    assert trainer["activation_checkpointing"] and len(trainer["peak_memory_bytes_per_rank"]) == 2
    # The KL term against the adapter-free reference gives every step after the first a
    # gradient, whatever the rewards (LoRA's B starts at 0: at step 1 the KL is 0 too).
    assert all(norm > 1e-5 for norm in _per_iteration(summary, "train/grad_norm")[1:])
    # The base never trains: it is held in the compute dtype (bfloat16), so the saved policy
    # (float32, the tiny policy directory's dtype) is the start rounded to bfloat16, except
    # where the adapters were merged in.
    start = {
        n: p.to(torch.bfloat16).float()
        for n, p in load_policy(summary["model_dir"])[0].named_parameters()
    }
    merged = dict(load_policy(summary["policy_dir"])[0].named_parameters())  # adapters merged
    moved = {n for n in start if not torch.equal(start[n], merged[n])}
    assert moved and all(n.rsplit(".", 2)[-2].endswith("_proj") for n in moved)
    assert all("self_attn" in n for n in moved)  # the adapted attention projections only


def test_sharded_checkpoints_resume_like_the_uninterrupted_run(tmp_path, runs):
    """``trainer.sharded_checkpoints``: each rank writes its own shards (no full copy gathered on
    rank 0); a resumed run of 2 ranks ends bit for bit where the uninterrupted one did."""
    sharded = ("--trainer.sharded_checkpoints", "true")
    first = _fit(tmp_path, 2, 2, *sharded, name="run")
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert last.is_dir() and first["samples_trained"] == 2 * SAMPLES
    assert len(list(last.glob("*.distcp"))) == 2  # one file of shards per rank
    default = Path(runs[2]["output_dir"], "checkpoints", "last.ckpt")
    assert default.is_dir()  # several ranks write sharded checkpoints unless told otherwise
    resumed = _fit(tmp_path, 2, 3, *sharded, "--resume", str(last), name="run")
    assert resumed["samples_trained"] == 3 * SAMPLES and resumed["samples_lost"] == 0
    after = dict(load_policy(resumed["policy_dir"])[0].named_parameters())
    uninterrupted = dict(load_policy(runs[2]["policy_dir"])[0].named_parameters())
    differ = [n for n in after if not torch.equal(after[n], uninterrupted[n])]
    assert not differ, f"resumed from shards, the weights differ: {differ}"


def test_a_run_killed_while_its_ranks_write_a_checkpoint_keeps_the_previous_one_whole(
    tmp_path, runs
):
    """kill -9 to the whole run (2 ranks, sharded checkpoints every iteration) while the ranks
    write a checkpoint's shards: ``last.ckpt`` (a link) still points at the previous checkpoint,
    whole; the run resumed from it ends bit for bit where the uninterrupted run did, and the
    half-written folder is cleared by its next save."""
    config = _config(tmp_path, "midsave", ITERATIONS, ranks=2)
    command = [sys.executable, "-m", "streamrl.cli.main", "fit", "--config", str(config)]
    last = tmp_path / "midsave" / "checkpoints" / "last.ckpt"
    proc = subprocess.Popen(
        [*command, "--no-progress"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    caught = None
    try:
        deadline = time.monotonic() + 300
        while caught is None and proc.poll() is None and time.monotonic() < deadline:
            if last.is_symlink():  # a checkpoint is whole: wait for the next one's shards
                before = os.readlink(last)
                writing = [f for f in last.parent.glob(".last.ckpt.[0-9]*") if f.name != before]
                if writing:
                    os.killpg(proc.pid, signal.SIGKILL)
                    caught = (before, writing[0].name)
            time.sleep(0.001)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    assert caught is not None, "no save was caught in progress"
    before, half_written = caught
    # The link moves in one step once every rank's shards are in: the kill came before it.
    assert os.readlink(last) == before and (last.parent / half_written).is_dir()
    assert (last / "meta.pt").is_file() and len(list(last.glob("*.distcp"))) == 2
    resumed = _fit(tmp_path, 2, ITERATIONS, "--resume", "auto", name="midsave")
    assert resumed["samples_trained"] == ITERATIONS * SAMPLES and resumed["samples_lost"] == 0
    after = dict(load_policy(resumed["policy_dir"])[0].named_parameters())
    uninterrupted = dict(load_policy(runs[2]["policy_dir"])[0].named_parameters())
    assert not [n for n in after if not torch.equal(after[n], uninterrupted[n])]
    assert [f.name for f in last.parent.glob(".last.ckpt.*")] == [os.readlink(last)]


@pytest.mark.parametrize("fault", ["kill -9 rank 1", "SIGTERM to the group"])
def test_a_killed_trainer_rank_stops_the_run_which_resumes_where_it_was(tmp_path, runs, fault):
    """SIGKILL to trainer rank 1 mid-run, or SIGTERM to the whole run (a scheduler's stop):
    rank 0 stops within a bounded time with one line that names the cause and the command that
    goes on, no process of the run is left, and the run resumed from its last checkpoint ends
    bit for bit where the uninterrupted run did."""
    config = _config(tmp_path, "killed", ITERATIONS, ranks=2)
    command = [sys.executable, "-m", "streamrl.cli.main", "fit", "--config", str(config)]
    one_file = ("--trainer.sharded_checkpoints", "false")  # its stop record is read below
    run = subprocess.Popen(
        [*command, "--no-progress", *one_file],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    out_dir = tmp_path / "killed"
    try:
        deadline = time.monotonic() + 300
        while not (out_dir / "checkpoints" / "last.ckpt").is_file() and run.poll() is None:
            assert time.monotonic() < deadline, "no checkpoint was written"
            time.sleep(0.1)
        if fault == "kill -9 rank 1":
            rank_1 = json.loads((out_dir / "trainer_ranks.json").read_text())["1"]
            os.kill(rank_1, signal.SIGKILL)
        else:
            os.killpg(run.pid, signal.SIGTERM)
        killed = time.monotonic()
        _, err = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    stop_line = {
        "kill -9 rank 1": "streamrl fit: stopped: trainer rank 1 died (killed by SIGKILL)",
        "SIGTERM to the group": "streamrl fit: stopped by SIGTERM",
    }[fault]
    assert run.returncode == (1 if fault == "kill -9 rank 1" else 143), err[-3000:]
    assert time.monotonic() - killed < 60
    assert stop_line in err, err[-3000:]
    assert "Traceback" not in err and "--resume" in err
    checkpoint = torch.load(out_dir / "checkpoints" / "last.ckpt", weights_only=True)
    if fault == "SIGTERM to the group":  # both ranks saved the finished iterations together
        assert checkpoint["stopped_by"] == "SIGTERM", err[-3000:]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # every generator, reward worker and rank with it
        try:
            os.killpg(run.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        pytest.fail("a process of the run outlived it")
    resumed = _fit(tmp_path, 2, ITERATIONS, *one_file, "--resume", "auto", name="killed")
    assert resumed["samples_trained"] == ITERATIONS * SAMPLES and resumed["samples_lost"] == 0
    after = dict(load_policy(resumed["policy_dir"])[0].named_parameters())
    uninterrupted = dict(load_policy(runs[2]["policy_dir"])[0].named_parameters())
    assert not [n for n in after if not torch.equal(after[n], uninterrupted[n])]


def test_rank_zero_writes_every_ranks_share_of_the_rollouts(tmp_path):
    summary = _fit(tmp_path, 2, 2, "--rl.save_rollouts", "true")
    files = sorted(Path(summary["output_dir"], "rollouts").glob("iteration-*.parquet"))
    rows = [row for f in files for row in pq.read_table(f).to_pylist()]
    assert [f.name for f in files] == ["iteration-000000.parquet", "iteration-000001.parquet"]
    # Micro-batches of 64 tokens: both ranks trained several; every one of them is written once.
    keys = {(r["iteration"], r["prompt_id"], r["sample_index"]) for r in rows}
    assert len(rows) == len(keys) == summary["samples_trained"] == 2 * SAMPLES


def test_a_torchrun_job_stopped_by_sigterm_saves_on_both_ranks_and_resumes(tmp_path, runs):
    """SIGTERM to both torchrun launchers' process groups (a scheduler stopping the job): rank
    0 acts on it, rank 1 (which ignores it) saves the checkpoint with it (each rank its shards:
    several ranks write sharded checkpoints by default), both leave; the job rerun with
    ``--resume auto`` ends bit for bit where the uninterrupted torchrun job did."""
    nodes = _torchrun_nodes(tmp_path, "torchrun", ITERATIONS)
    last = tmp_path / "torchrun" / "checkpoints" / "last.ckpt"
    try:
        deadline = time.monotonic() + 300
        while not (last / "meta.pt").is_file() and all(n.poll() is None for n in nodes):
            assert time.monotonic() < deadline, "no checkpoint was written"
            time.sleep(0.1)
        for node in nodes:
            os.killpg(node.pid, signal.SIGTERM)
        stopped = time.monotonic()
        errors = [node.communicate(timeout=120)[1] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
    assert time.monotonic() - stopped < 90
    assert all(node.returncode != 0 for node in nodes)  # never a success
    assert "stopped by SIGTERM" in errors[0], errors[0][-3000:]
    assert len(list(last.glob("*.distcp"))) == 2  # each rank wrote its own shards
    meta = torch.load(last / "meta.pt", weights_only=True)
    assert meta["stopped_by"] == "SIGTERM", errors[0][-3000:]
    resumed = _fit_torchrun(tmp_path, ITERATIONS, "torchrun", "--resume", "auto")
    assert resumed["samples_trained"] == ITERATIONS * SAMPLES and resumed["samples_lost"] == 0
    after = dict(load_policy(resumed["policy_dir"])[0].named_parameters())
    uninterrupted = dict(load_policy(runs["torchrun"]["policy_dir"])[0].named_parameters())
    assert not [n for n in after if not torch.equal(after[n], uninterrupted[n])]


def test_an_episode_run_trains_on_two_ranks(tmp_path):
    """Multi-turn episodes (the calculator tool) on two FSDP2 ranks: the same job body as a
    single-turn run; rank 0's ``EpisodeRunner`` streams the episodes, each micro-batch (loss
    masks over the environment's tokens included) is dealt to both ranks, and every episode is
    trained once, none lost."""
    config = tmp_path / "episodes.yaml"
    config.write_text(
        f"output_dir: {tmp_path / 'out'}\n"
        "env: {name: calculator, max_turns: 2, n_train: 16, n_heldout: 4}\n"
        "sft: {model_size: test, steps: 10, tokens_per_batch: 1024}\n"
        "rl: {iterations: 2, prompts_per_iteration: 2, group_size: 2,"
        " generation: {num_instances: 1, max_batch_size: 8},"
        " rollouts: {max_tokens: 16}, micro_batches: {max_tokens: 64},"
        " save_rollouts: true}\n"
        "trainer: {devices: 2}\n"
    )
    command = [sys.executable, "-m", "streamrl.cli.main", "fit", "--config", str(config)]
    result = subprocess.run(
        [*command, "--no-progress"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert (
        summary["trainer"]["ranks"] == 2
        and len(summary["trainer"]["peak_memory_bytes_per_rank"]) == 2
    )
    assert summary["samples_trained"] == summary["samples_generated"] == 2 * 2 * 2
    assert summary["samples_lost"] == 0 and summary["episode_counts"]["episodes_finished"] == 8
    # Rank 0 writes every rank's share of the trained episodes, each once.
    files = sorted(Path(summary["output_dir"], "rollouts").glob("iteration-*.parquet"))
    rows = [row for f in files for row in pq.read_table(f).to_pylist()]
    keys = {(r["iteration"], r["prompt_id"], r["sample_index"]) for r in rows}
    assert len(rows) == len(keys) == 8
    assert all(torch.isfinite(torch.tensor(_per_iteration(summary, "train/loss"))))
