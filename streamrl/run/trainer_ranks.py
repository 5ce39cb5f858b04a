"""The trainer ranks of a run: how each builds its module and trainer, and where the ranks come
from: spawned here for a sharded ``streamrl fit`` (``trainer.devices`` > 1), or started by an
external launcher (``torchrun`` on several nodes, SLURM's ``srun``; ``launched_job``).

The process running ``fit`` is trainer rank 0: it owns the generation service and the sample
stream, and deals each micro-batch to the ranks (``ShardedStreamRLModule(share_stream=True)``).
Ranks 1..N-1 are spawned here; each receives the same ``RankSetup`` (the algorithm object
included), loads the same policy, and builds its module and trainer with the public builders,
as rank 0 does. Every rank sees the variables of an externally launched job (``MASTER_ADDR``,
``RANK``, ...), so Lightning never re-runs the command line, which works from a notebook too. The
ranks are stopped, killed if need be, when ``fit`` ends or fails.

Under an external launcher every process runs ``streamrl fit`` itself: the launcher's rank 0 is
rank 0 above (it hosts the generation service), the others build the same module without the
service and train on the shares rank 0 deals them, across nodes.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import (
    ClusterEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
)
from lightning.pytorch.loggers import Logger
from transformers import PreTrainedModel

from streamrl.algorithms.base import Algorithm
from streamrl.components.capacity.elastic import ElasticController
from streamrl.components.training.pipeline import DynamicBatchPipeline
from streamrl.components.training.sharding import compute_dtype
from streamrl.components.weights.transport import LOOPBACK, local_interfaces, make_store
from streamrl.errors import ConfigError, TrainerRankError
from streamrl.policy.lora import LoRASpec, apply_lora
from streamrl.policy.model_dir import directory_bytes, empty_model
from streamrl.policy.varlen_attention import attention_for
from streamrl.run.config import RLConfig, RunConfig, TrainerConfig
from streamrl.run.config_checks import placement_of, run_correction, run_routing_replay
from streamrl.runtime.devices import Placement
from streamrl.runtime.peak_memory import RELEASE_FROM_MODEL_BYTES, release_freed_memory
from streamrl.runtime.stopping import Stopped, ignore_signals, shielded
from streamrl.training.builders import build_module, build_trainer
from streamrl.training.fsdp import process_group_backend
from streamrl.training.module import StreamRLModule
from streamrl.training.policy_save import SavePolicy
from streamrl.training.rank_timeouts import RankTimeouts
from streamrl.training.rollout import RolloutStream

#: The launch group of an externally launched job (``join_launched_job``): gloo, for the waits.
_LAUNCH_GROUP: list[dist.ProcessGroup] = []


@dataclass
class RankSetup:
    """What every trainer rank builds its module and trainer from (picklable: the extra ranks
    receive it whole, so they train exactly what rank 0 trains).

    Attributes:
        algorithm: the run's algorithm object.
        iterations: optimizer steps.
        placement: the trainer's accelerator, ranks, GPUs and precision
            (``streamrl.runtime.devices.resolve_placement``); FSDP2 when ``placement.sharded``.
        output_dir: where checkpoints go (when: ``rl.checkpoints``).
        sharded_checkpoints: checkpoints as folders of each rank's shards.
        lora: the policy's adapters (every rank wraps its policy alike), or ``None``.
        training: the run's ``rl`` and ``trainer`` sections, read by ``module`` in its one
            call of ``build_module`` and by ``trainer``.
        timeouts: how long the ranks wait for each other (``RankTimeouts``).
        save_dtype: the dtype of the trained policy every rank writes its part of at the end
            (``trainer.save_dtype``; ``SavePolicy``).
    """

    algorithm: Algorithm
    iterations: int
    placement: Placement = field(default_factory=lambda: Placement("cpu", 1, 1, (), (), "32-true"))
    output_dir: str | None = None
    sharded_checkpoints: bool = False
    lora: LoRASpec | None = None
    training: tuple[RLConfig, TrainerConfig] = field(
        default_factory=lambda: (RLConfig(), TrainerConfig())
    )
    timeouts: RankTimeouts = field(default_factory=RankTimeouts)
    save_dtype: str = "auto"

    @property
    def ranks(self) -> int:
        """Trainer ranks in all."""
        return self.placement.ranks

    @classmethod
    def from_config(
        cls,
        config: RunConfig,
        algorithm: Algorithm,
        job: ClusterEnvironment | None = None,
        model_dir: str | Path | None = None,
    ) -> RankSetup:
        """The setup of ``config``'s run (its timeouts scaled to ``model_dir``'s weights); under
        an external launcher (``job``) its world is the launcher's (``LOCAL_WORLD_SIZE`` ranks on
        each of its nodes)."""
        rl, trainer = config.rl, config.trainer
        placement = placement_of(config)
        if job is not None:
            per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            nodes = job.world_size() // per_node
            gpus = tuple(range(per_node)) if placement.accelerator == "cuda" else ()
            placement = replace(
                placement, ranks_per_node=per_node, num_nodes=nodes, trainer_gpus=gpus
            )
        return cls(
            algorithm,
            rl.iterations,
            placement=placement,
            output_dir=config.output_dir,
            sharded_checkpoints=(
                trainer.sharded_checkpoints
                if trainer.sharded_checkpoints is not None
                else placement.ranks > 1
            ),
            lora=rl.lora,
            training=(rl, trainer),
            timeouts=rank_timeouts(config, model_dir),
            save_dtype=trainer.save_dtype,
        )

    def trainable(self, policy: PreTrainedModel) -> PreTrainedModel:
        """``policy`` as this run trains it: wrapped with the run's LoRA adapters, if any (drawn
        from one seed, so every rank's adapters start the same and FSDP shards one model)."""
        return policy if self.lora is None else apply_lora(policy, self.lora)

    def empty_policy(self, model_dir: str | Path) -> PreTrainedModel:
        """The policy of ``model_dir`` as this run trains it, on the meta device: nothing is read
        until each rank, once sharded, reads its own rows (``StreamRLModule.configure_model``).
        Trained weights are float32 masters; a LoRA policy's base, which never trains, is built
        in the compute dtype (bfloat16 under ``bf16-mixed``) with float32 adapters. Its attention
        attends within each sample of a packed micro-batch (``varlen_attention.attention_for``),
        unless ``rl.micro_batches: {packed: false}``."""
        dtype = torch.float32 if self.lora is None else compute_dtype(self.placement.precision)
        packs = self.training[0].micro_batches.get("packed") is not False
        attention = attention_for(self.placement.accelerator) if packs else None
        return self.trainable(empty_model(model_dir, dtype, attention))

    def module(
        self,
        policy: PreTrainedModel,
        rollouts: RolloutStream | None,
        *,
        elastic: ElasticController | None = None,
    ) -> StreamRLModule:
        """This rank's module (``rollouts`` only on rank 0): every rank builds it here, from the
        same settings, through ``build_module``."""
        rl, trainer = self.training
        return build_module(
            policy,
            self.algorithm,
            rollouts,
            iterations=self.iterations,
            temperature=rl.arg("generation", "temperature"),
            sharded=self.placement.sharded,
            precision=self.placement.precision,
            activation_checkpointing=(
                trainer.activation_checkpointing
                if trainer.activation_checkpointing is not None
                else self.placement.accelerator == "cuda"
            ),
            reference_offload=trainer.reference_offload,
            share_timeout_s=self.timeouts.share_s,
            # The section's own arguments (routing replay as the engine allows); the rest is
            # linked in from the run.
            **{**rl.module, "routing_replay": run_routing_replay(rl)},
            pipeline=DynamicBatchPipeline(**rl.micro_batches),
            correction=run_correction(rl),
            elastic=elastic,
            logprob_chunk_tokens=trainer.logprob_chunk_tokens,
        )

    def trainer(
        self,
        module: StreamRLModule,
        *,
        logger: Logger | None = None,
        show_progress: bool = False,
        callbacks: Sequence[L.Callback] = (),
    ) -> L.Trainer:
        """This rank's Lightning trainer (logging, progress and ``callbacks`` on rank 0 only;
        on every rank, with an output directory, ``SavePolicy`` writing its part of the trained
        policy to ``<output_dir>/policy``)."""
        if self.output_dir is not None:
            saver = SavePolicy(Path(self.output_dir) / "policy", dtype=self.save_dtype)
            callbacks = [*callbacks, saver]
        return build_trainer(
            module,
            accelerator=self.placement.accelerator,
            devices=self.placement.lightning_devices(),
            num_nodes=self.placement.num_nodes,
            output_dir=self.output_dir,
            logger=logger,
            checkpoints=self.training[0].checkpoints,
            show_progress=show_progress,
            sharded_checkpoints=self.sharded_checkpoints,
            collective_timeout_s=self.timeouts.collective_s,
            callbacks=list(callbacks),
        )


def trainer_device(placement: Placement) -> str:
    """The device trainer rank 0 holds, which the weights leave from: its GPU (the first of
    ``trainer.devices``), or the CPU."""
    if placement.accelerator == "cuda" and placement.trainer_gpus:
        return f"cuda:{placement.trainer_gpus[0]}"
    return "cpu"


def pin_threads(placement: Placement, model_dir: str | Path) -> None:
    """On the CPU: one torch thread (the generators need the other cores), and for a model past
    ``RELEASE_FROM_MODEL_BYTES`` freed memory returned at once (``release_freed_memory``)."""
    if placement.accelerator == "cpu":
        torch.set_num_threads(1)
        if directory_bytes(model_dir) >= RELEASE_FROM_MODEL_BYTES:
            release_freed_memory()


@contextlib.contextmanager
def trainer_ranks(setup: RankSetup, model_dir: Path, resume: str | None = None) -> Iterator[None]:
    """Start ranks ``1..setup.ranks-1`` and make this process rank 0 for the block.

    Args:
        setup: how each rank builds its module and trainer.
        model_dir: the policy every rank starts from.
        resume: the checkpoint every rank resumes from, if any.
    """
    # The ranks' rendezvous, hosted here on loopback only (torch's own, from MASTER_ADDR, would
    # listen on every interface): each rank joins it as a client, as under torchelastic's agent.
    store = make_store(setup.ranks)
    job = dict(
        MASTER_ADDR=LOOPBACK,
        MASTER_PORT=str(store.port),
        WORLD_SIZE=str(setup.ranks),
        NODE_RANK="0",
        TORCHELASTIC_USE_AGENT_STORE="True",
        **local_interfaces(),
    )
    ctx = mp.get_context("spawn")
    ranks = []
    for rank in range(1, setup.ranks):
        args = (setup, str(model_dir), rank, job, resume)
        name = f"streamrl-trainer-rank-{rank}"
        ranks.append(ctx.Process(target=_rank_main, args=args, daemon=True, name=name))
    saved = {k: os.environ.get(k) for k in (*job, "RANK", "LOCAL_RANK")}
    os.environ.update(job, RANK="0", LOCAL_RANK="0")
    try:
        for process in ranks:
            process.start()
        if setup.output_dir is not None:  # which process is which rank (for `kill`, a chaos run)
            pids = {rank: p.pid for rank, p in enumerate(ranks, start=1)}
            Path(setup.output_dir, "trainer_ranks.json").write_text(json.dumps(pids))
        try:
            yield
        except Exception as err:  # a collective that lost a rank fails: say which rank, how
            dead = _dead_ranks(ranks)
            if dead:
                raise TrainerRankError(f"{dead}; the run stopped") from err
            raise
        for process in ranks:  # they leave once their last collective is done
            process.join(setup.timeouts.collective_s)
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
    dead = _dead_ranks(ranks)
    if dead:
        raise TrainerRankError(f"{dead}; see its log above.")


def fit_on_ranks(
    setup: RankSetup,
    trainer: Callable[[], L.Trainer],
    module: StreamRLModule,
    model_dir: Path,
    resume: str | None,
    launched: bool,
) -> None:
    """Fit ``module`` on rank 0 with the Lightning trainer ``trainer()`` makes, every other rank
    following: a launcher's ranks (``launched``, torchrun or SLURM, each in
    ``streamrl.run.recipe``'s ``follow_rank_zero``), the ranks ``trainer_ranks`` spawns for
    ``trainer.devices`` > 1, or none. Several ranks: a stop lands only where they can all
    follow (``fsdp.stop_ranks``)."""
    ranks_follow = shielded() if setup.ranks > 1 else contextlib.nullcontext()
    if launched:  # the other ranks wait for the service up to here
        wait_for_rank_zero(setup.timeouts.prepare_s)
        with ranks_follow:
            trainer().fit(module, ckpt_path=resume)
        dist.destroy_process_group()
    elif setup.ranks > 1:  # the others start here
        # The Trainer is made once this process is rank 0 (LOCAL_RANK set), as on the other
        # ranks: Lightning then launches no processes of its own, and does not refuse the
        # strategy in a Jupyter kernel (where it refuses any that would launch them).
        with trainer_ranks(setup, model_dir, resume), ranks_follow:
            trainer().fit(module, ckpt_path=resume)
    else:
        try:
            trainer().fit(module, ckpt_path=resume)
        finally:
            if setup.placement.sharded and dist.is_initialized():  # one FSDP2 rank
                dist.destroy_process_group()  # a later run in this process starts afresh


def _dead_ranks(ranks: Sequence[mp.process.BaseProcess]) -> str:
    """Which of ``ranks`` (rank 1 first) ended with an error, and how; ``""`` if none."""
    for process in ranks:
        process.join(1.0)  # a rank dying now is seen, not guessed
    dead = [
        f"trainer rank {rank} died ({_how(p.exitcode)})"
        for rank, p in enumerate(ranks, start=1)
        if p.exitcode not in (0, None)
    ]
    return ", ".join(dead)


def _how(exitcode: int) -> str:
    if exitcode < 0:
        return f"killed by {signal.Signals(-exitcode).name}"
    return f"exit code {exitcode}"


def _rank_main(
    setup: RankSetup, model_dir: str, rank: int, job: dict[str, str], resume: str | None
) -> None:
    """Trainer rank ``rank`` > 0: the sharded module without rollouts, fed by rank 0."""
    os.environ.update(job, RANK=str(rank), LOCAL_RANK=str(rank))
    pin_threads(setup.placement, model_dir)
    from streamrl.runtime.quiet import quiet_libraries, quiet_lightning

    quiet_libraries()  # rank 0's stderr is the run's log: the other ranks add nothing to it
    quiet_lightning()
    _leave_with(os.getppid())
    ignore_signals()  # a signal to the group is rank 0's to act on: it stops this rank
    module = setup.module(setup.empty_policy(model_dir), None)  # it reads its own shards
    with contextlib.suppress(Stopped):  # rank 0 was stopped: this rank saved with it
        setup.trainer(module).fit(module, ckpt_path=resume)
    # Leave at once: a normal exit tears down gloo's threads mid-receive and aborts.
    os._exit(0)


def _leave_with(parent: int) -> None:
    """Exit at once when ``parent`` (rank 0) is gone, however it ended: a rank must not wait
    out its collective timeout as an orphan."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="streamrl-parent-watch", daemon=True).start()


def launched_job() -> ClusterEnvironment | None:
    """The environment of an external launcher (``torchrun``, SLURM) that started this process
    as one of several trainer ranks; ``None`` when this process is the whole trainer (it may
    then spawn ranks itself, ``trainer_ranks``)."""
    for environment in (TorchElasticEnvironment, SLURMEnvironment):
        if environment.detect():
            job = environment()
            if job.world_size() > 1:
                return job
    return None


def check_launched(config: RunConfig, world: int) -> None:
    """Under an external launcher the trainer ranks are the launcher's; ``ConfigError`` if the
    config asks for another number (it would spawn ranks of its own on top)."""
    devices = config.trainer.devices
    asked = len(devices) if isinstance(devices, list) else (devices or 1)
    asked *= config.trainer.num_nodes
    if asked not in (1, world):
        raise ConfigError(
            f"The launcher started {world} trainer ranks but trainer.devices x "
            f"trainer.num_nodes is {asked}; leave them unset or ask for {world} (under torchrun "
            "or SLURM the launcher's processes are the ranks)."
        )


def join_launched_job(
    job: ClusterEnvironment, placement: Placement, timeouts: RankTimeouts
) -> None:
    """Join the launcher's default process group (``process_group_backend``, the same as a
    spawned run's) and a gloo group for the waits (``wait_for_rank_zero``), so rank 0 can
    prepare the policy while the others wait; Lightning then trains in the default group."""
    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", job.main_address)
    os.environ.setdefault("MASTER_PORT", str(job.main_port))
    dist.init_process_group(
        process_group_backend(placement.accelerator),
        rank=job.global_rank(),
        world_size=job.world_size(),
        timeout=timedelta(seconds=timeouts.collective_s),
    )
    _LAUNCH_GROUP[:] = [
        dist.new_group(backend="gloo", timeout=timedelta(seconds=timeouts.prepare_s))
    ]


def wait_for_rank_zero(timeout_s: float) -> None:
    """Every launched rank meets here, waiting up to ``timeout_s`` (``trainer.prepare_timeout_s``):
    rank 0 once its policy is ready (the others then build it: they find rank 0's warm start in
    the cache, or a ``model`` directory), and again once its generators run and the first
    evaluation is done (the others then start training with it)."""
    group = _LAUNCH_GROUP[0] if _LAUNCH_GROUP else None
    dist.monitored_barrier(group, timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)


def rank_timeouts(config: RunConfig, model_dir: str | Path | None = None) -> RankTimeouts:
    """``config``'s ``trainer.*_timeout_s``, each one left unset scaled to the weights of
    ``model_dir`` (or of ``model``, when it is a directory already; a policy still to be warm
    started is small)."""
    where = model_dir if model_dir is not None else config.model
    weights = directory_bytes(where) if where != "tiny" and Path(where).is_dir() else 0
    trainer = config.trainer
    return RankTimeouts.for_model(
        weights,
        config.rl.arg("rollouts", "max_tokens"),
        collective_s=trainer.collective_timeout_s,
        prepare_s=trainer.prepare_timeout_s,
        share_s=trainer.share_timeout_s,
    )
