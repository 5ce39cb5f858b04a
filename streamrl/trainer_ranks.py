"""The extra trainer ranks of a sharded ``streamrl fit`` (``rl.trainer_ranks > 1``).

The process running ``fit`` is trainer rank 0: it owns the generation service and the sample
stream, and deals each micro-batch to the ranks (``ShardedStreamRLModule(share_stream=True)``).
Ranks 1..N-1 are spawned here; each loads the same policy, shards it with FSDP2 under
Lightning's ``ModelParallelStrategy`` and trains on the shares it receives. Every rank sees the
variables of an externally launched job (``MASTER_ADDR``, ``RANK``, ...), so Lightning never
re-runs the command line, which works from a notebook too. The ranks are stopped, killed if need
be, when ``fit`` ends or fails.
"""

from __future__ import annotations

import contextlib
import copy
import multiprocessing as mp
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

#: How long ranks may take to leave after rank 0 finished (they are killed afterwards).
LEAVE_TIMEOUT_S = 30.0


@contextlib.contextmanager
def trainer_ranks(
    config: Any, model_dir: Path, world: int, resume: str | None = None
) -> Iterator[None]:
    """Start ranks ``1..world-1`` and make this process rank 0 for the block.

    Args:
        config: the run's ``RunConfig`` (each rank builds the same algorithm from it).
        model_dir: the policy every rank starts from.
        world: trainer ranks in all.
        resume: the checkpoint every rank resumes from, if any.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    job = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), NODE_RANK="0")
    ctx = mp.get_context("spawn")
    ranks = []
    for rank in range(1, world):
        args = (config, str(model_dir), rank, job, resume)
        name = f"streamrl-trainer-rank-{rank}"
        ranks.append(ctx.Process(target=_rank_main, args=args, daemon=True, name=name))
    saved = {k: os.environ.get(k) for k in (*job, "RANK", "LOCAL_RANK")}
    os.environ.update(job, RANK="0", LOCAL_RANK="0")
    try:
        for process in ranks:
            process.start()
        yield
        for process in ranks:
            process.join(LEAVE_TIMEOUT_S)
    finally:
        for process in ranks:
            if process.is_alive():
                process.kill()
                process.join(5.0)
        if dist.is_initialized():  # so a later run in this process (a notebook) starts afresh
            dist.destroy_process_group()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    failed = [p.name for p in ranks if p.exitcode not in (0, None)]
    if failed:
        raise RuntimeError(f"Trainer ranks {failed} exited with an error; see their log above.")


def _rank_main(
    config: Any, model_dir: str, rank: int, job: dict[str, str], resume: str | None
) -> None:
    """Trainer rank ``rank`` > 0: the sharded module without rollouts, fed by rank 0."""
    os.environ.update(job, RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from streamrl.quiet import quiet_libraries, quiet_lightning

    quiet_libraries()  # rank 0's stderr is the run's log: the other ranks add nothing to it
    quiet_lightning()
    from streamrl.fsdp import ShardedStreamRLModule, sharded_trainer
    from streamrl.jobs import build_run_algorithm, checkpoints
    from streamrl.models import load_policy

    rl = config.rl
    policy, _ = load_policy(model_dir)
    reference = copy.deepcopy(policy) if rl.kl_coef > 0 else None
    module = ShardedStreamRLModule(
        policy.train(),
        build_run_algorithm(config, policy),
        None,
        rl.iterations,
        lr=rl.lr,
        reference=reference,
        temperature=rl.temperature,
        mode=rl.mode,
        is_cap=rl.is_cap,
        share_stream=True,
    )
    trainer = sharded_trainer(
        int(job["WORLD_SIZE"]),
        rl.iterations,
        enable_checkpointing=True,
        callbacks=[checkpoints(config)],
    )
    trainer.fit(module, ckpt_path=resume)
    # Leave at once: a normal exit tears down gloo's threads mid-receive and aborts.
    os._exit(0)
