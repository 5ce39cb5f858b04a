"""FSDP2 trainer: 2 CPU ranks (gloo) under Lightning's ModelParallelStrategy match one process.

The trainer math only: no generator processes. A fixed set of scored groups (prompt +
completion tokens, behaviour log-probs, GRPO advantages) is streamed by a fake rollout stream
through the real ``training_step``: half the groups to each rank, all of them to the
single-process run. Two iterations, AdamW, gradient clipping.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from streamrl.algorithms import GRPO
from streamrl.algorithms.base import LossInputs
from streamrl.bench.full_logprobs import full_vocab_logprobs
from streamrl.components.weights.staging import StagedWeights, stage_parameters
from streamrl.components.weights.sync import AsyncWeightSync
from streamrl.policy.models import build_tiny_model, build_tokenizer
from streamrl.records import Sample, ScoredGroup
from streamrl.training.fsdp import ShardedStreamRLModule, fsdp_strategy, full_state, shard_policy
from streamrl.training.module import StreamRLModule
from streamrl.training.rollout import IterationStats
from streamrl.training.timeline import TraceRecorder

pytestmark = pytest.mark.timeout(180)

WORLD, ITERATIONS, GROUPS, GROUP_SIZE, LR = 2, 2, 4, 2, 1e-3
SPAWN_TIMEOUT_S = 150.0  # both ranks: imports, process group, two steps (seconds on a busy CI)


class RecordingGRPO(GRPO):
    """GRPO that records the summed per-sample loss of each iteration (one list per iteration,
    opened by ``FixedRollouts.groups``)."""

    def __init__(self) -> None:
        super().__init__(group_size=GROUP_SIZE)
        self.losses: list[list[float]] = []

    def token_loss(self, batch: LossInputs):
        from streamrl.algorithms.base import TokenLoss, reduce_token_loss

        terms = super().token_loss(batch)
        detached = TokenLoss(terms.policy.detach())  # no KL here: no auxiliary term
        per_sample = reduce_token_loss(detached, batch, self.token_norm)  # what loss() returns
        self.losses[-1].append(float(per_sample.sum()))
        return terms


class FixedService:
    """Stands in for the generation service: a real weight sync without instances; records
    the versions it is given and what the last one staged (what instances would receive)."""

    def __init__(self) -> None:
        self.versions: list[int] = []
        self.weight_sync = AsyncWeightSync(timeout_s=60)
        self.staged: dict[str, torch.Tensor] = {}

    def update(self, weights: StagedWeights, version: int) -> float:
        self.versions.append(version)
        self.weight_sync.push(weights, version)
        self.weight_sync.wait_sent(version)
        self.staged = {name: t.clone() for name, t in weights.named()}
        return 0.0

    push_weights = update

    def wait_weights(self, version: int) -> float:
        return 0.0


class FixedRollouts:
    """Streams the same scored groups every iteration, stamped with the trainer's version."""

    def __init__(self, groups: list[ScoredGroup], algorithm: RecordingGRPO) -> None:
        self._groups, self.algorithm = groups, algorithm
        self.service, self.trace, self.stats = FixedService(), TraceRecorder(), IterationStats()
        self._version = self._iteration = 0

    @property
    def samples_per_iteration(self) -> int:
        return sum(len(g.samples) for g in self._groups)

    def dispatch(self, min_weight_version: int = 0) -> int:
        self._version, self._iteration = min_weight_version, self._iteration + 1
        return self._iteration - 1

    def trained(self, iteration: int) -> None:
        """The step on ``iteration`` is done (a ``RolloutStream`` forgets its prompts then)."""

    def groups(self, iteration: int) -> Iterator[ScoredGroup]:
        self.algorithm.losses.append([])
        samples = [s for g in self._groups for s in g.samples]
        self.stats = IterationStats(samples=len(samples), tokens=sum(s.length for s in samples))
        for group in self._groups:
            yield replace(
                group, samples=[replace(s, weight_version=self._version) for s in group.samples]
            )


def _scored_groups(seed: int = 0) -> list[ScoredGroup]:
    """Prompts and completions of random tokens and lengths; behaviour log-probs are the
    initial policy's plus noise (ratios != 1, some clipped); GRPO advantages of random rewards."""
    tokenizer = build_tokenizer()
    policy = build_tiny_model(tokenizer, "test", seed=0)
    rng = torch.Generator().manual_seed(seed)
    grpo, groups = GRPO(group_size=GROUP_SIZE), []
    for g in range(GROUPS):
        samples = []
        for i in range(GROUP_SIZE):
            prompt_len, length = (int(n) for n in torch.randint(2, 9, (2,), generator=rng))
            ids = torch.randint(3, len(tokenizer), (1, prompt_len + length), generator=rng)
            with torch.no_grad():
                current = full_vocab_logprobs(
                    policy, ids, torch.ones_like(ids), torch.tensor([prompt_len]), length
                )[0]
            behaviour = current + 0.2 * torch.randn(length, generator=rng)
            prompt, completion = ids[0, :prompt_len].tolist(), ids[0, prompt_len:].tolist()
            samples.append(Sample(f"p{g}", i, prompt, completion, behaviour.tolist(), 0, 0))
        rewards = torch.rand(GROUP_SIZE, generator=rng).tolist()
        groups.append(ScoredGroup(f"p{g}", samples, rewards, grpo.score_group(rewards)))
    return groups


def _fit(groups: list[ScoredGroup], sharded: bool) -> dict:
    """Run ``ITERATIONS`` real training steps on ``groups``; returns losses, grad norms, the
    weights that would be pushed, and how many parameter elements this rank holds."""
    policy = build_tiny_model(build_tokenizer(), "test", seed=0)
    algorithm = RecordingGRPO()
    rollouts = FixedRollouts(groups, algorithm)
    module_class = ShardedStreamRLModule if sharded else StreamRLModule
    module = module_class(policy, algorithm, rollouts, iterations=ITERATIONS, lr=LR)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=WORLD if sharded else 1,
        max_steps=ITERATIONS,
        max_epochs=-1,
        strategy=fsdp_strategy(WORLD, timeout_s=60) if sharded else "auto",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module)
    exact = None
    if sharded:  # the wire dtype's staging, collectives as in a run, on both ranks
        named, bf16, rank = module.weights_to_sync(), torch.bfloat16, dist.get_rank()
        to_root = StagedWeights.like(named, bf16)  # every rank's rows sent to rank 0's
        stage_parameters(named, to_root if rank == 0 else None, 9, bf16, root=0)
        everywhere = StagedWeights.like(named, bf16)  # all-gathered on every rank
        stage_parameters(named, everywhere, 9, bf16, root=None)
        full = full_state(policy)
        staged = [everywhere, to_root] if rank == 0 else [everywhere]
        exact = all(torch.equal(t, full[n].to(bf16)) for s in staged for n, t in s.named())
    held = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in policy.parameters())
    return {
        "losses": [sum(parts) for parts in algorithm.losses],  # summed over this rank's samples
        "grad_norms": [h["train/grad_norm"] for h in module.history],
        "weights": rollouts.service.staged,  # the last version as it left the trainer
        "single_weights": None if sharded else full_state(policy),
        "bf16_exact": exact,
        "versions": rollouts.service.versions,
        "held": held,
        "total": sum(p.numel() for p in policy.parameters()),
    }


def _rank_main(rank: int, port: int, groups: list[ScoredGroup], out_dir: str) -> None:
    """One trainer rank; Lightning sees the variables of an externally launched process."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(WORLD),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
    )
    torch.set_num_threads(1)
    torch.save(_fit(groups[rank::WORLD], sharded=True), Path(out_dir) / f"rank{rank}.pt")


def _spawn_ranks(groups: list[ScoredGroup], out_dir: Path) -> list[dict]:
    """Both ranks in spawned processes; a failure or a hang past the deadline kills them."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.spawn(_rank_main, args=(port, groups, str(out_dir)), nprocs=WORLD, join=False)
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    try:
        while not context.join(timeout=1.0):  # raises as soon as a rank fails
            if time.monotonic() > deadline:
                raise TimeoutError(f"FSDP ranks still running after {SPAWN_TIMEOUT_S} s.")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join(5)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def test_fsdp_two_ranks_match_one_process(tmp_path):
    groups = _scored_groups()
    ranks = _spawn_ranks(groups, tmp_path)
    single = _fit(groups, sharded=False)
    n = GROUPS * GROUP_SIZE
    # Each rank held about half of every parameter, and pushed after each step.
    assert all(r["held"] < 0.6 * r["total"] for r in ranks)
    assert all(r["versions"] == [1, 2] for r in ranks) and single["versions"] == [1, 2]
    # The iteration loss: per-rank sums over half the samples add up to the whole batch's.
    for it in range(ITERATIONS):
        sharded_loss = sum(r["losses"][it] for r in ranks) / n
        assert sharded_loss == pytest.approx(single["losses"][it] / n, abs=1e-6)
    # The pre-clipping gradient norm is global (same on both ranks, same as one process):
    # it catches a summed instead of averaged reduction, which AdamW's first step would hide.
    for r in ranks:
        assert r["grad_norms"] == pytest.approx(single["grad_norms"], rel=1e-5)
    # Updated full weights, gathered and staged on every rank, match the single-process ones;
    # a bfloat16 staging holds exactly the gathered weights cast to bfloat16 (streamed
    # tensor by tensor, cast before the all-gather); one process stages its weights as they are.
    before = full_state(build_tiny_model(build_tokenizer(), "test", seed=0))
    assert all(r["bf16_exact"] for r in ranks)
    for name, tensor in single["single_weights"].items():
        assert torch.equal(single["weights"][name], tensor)
    for r in ranks:
        assert list(r["weights"]) == list(single["weights"])
        for name, tensor in single["weights"].items():
            torch.testing.assert_close(r["weights"][name], tensor, atol=1e-5, rtol=0)
    moved = [k for k, t in single["weights"].items() if not torch.equal(t, before[k])]
    assert len(moved) == len(before)


def test_shard_policy_refuses_a_model_without_layers():
    mesh = object()  # never reached: the check comes first
    with pytest.raises(ValueError, match="found no decoder layer"):
        shard_policy(torch.nn.Linear(2, 2), mesh)  # type: ignore[arg-type]
