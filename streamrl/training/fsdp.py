"""FSDP2 trainer: the policy sharded with ``fully_shard`` across data-parallel trainer ranks.

Each rank holds a 1/N shard of every parameter, its gradients and AdamW states; a layer's full
weights exist only while that layer runs forward or backward. Under ``"bf16-mixed"`` the
gathered weights and the compute are bfloat16 over float32 shards (FSDP2's
``MixedPrecisionPolicy``, ``streamrl.components.training.sharding``); with activation
checkpointing each decoder layer is recomputed in the backward pass. A KL reference policy is
sharded the same way (only a shard per rank, in the compute dtype). Gradients are averaged
across the ranks by FSDP's reduce-scatter, so every rank must back-propagate its own share of the
iteration's samples, with the loss divided by that share. Every rank builds the policy empty and
reads only its own shards of the model directory (``streamrl.policy.model_dir``); the generators
get whole tensors one at a time (``streamrl.components.weights.staging``), and the trained policy
is written tensor by tensor (``streamrl.training.policy_save``; see docs/fsdp.md).

Lightning's ``fsdp`` strategy refuses the CPU; ``ModelParallelStrategy`` (FSDP2, DTensor) runs on
it with the gloo backend, which is how the 2-process CPU test runs it, and on GPUs with NCCL.

Examples:
    >>> import lightning as L
    >>> from streamrl.training.fsdp import ShardedStreamRLModule, fsdp_strategy
    >>> strategy = fsdp_strategy(data_parallel_size=2)
    >>> # trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=...)
    >>> # trainer.fit(ShardedStreamRLModule(policy, algorithm, rollouts, iterations=...))
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from streamrl.components.training.pipeline import MicroBatch
from streamrl.components.training.reference import FrozenCopy
from streamrl.components.training.sharding import Precision, full_state, shard_model
from streamrl.policy.lora import adapter_names
from streamrl.runtime.atomic_files import point_link_at
from streamrl.runtime.stopping import Stopped, shielded, stoppable
from streamrl.training.module import StreamRLModule

__all__ = ["ShardedStreamRLModule", "fsdp_strategy", "full_state", "shard_policy"]


def process_group_backend(accelerator: str) -> str:
    """The default process group's backend: on CUDA one group with CPU tensors and objects on
    gloo and CUDA tensors on NCCL (``"cpu:gloo,cuda:nccl"``: FSDP2's gathers and reductions run
    on NCCL, objects and host tensors on gloo), on the CPU gloo. Spawned and launched
    (torchrun, SLURM) ranks use the same.

    Examples:
        >>> process_group_backend("cuda"), process_group_backend("cpu")
        ('cpu:gloo,cuda:nccl', 'gloo')
    """
    return "cpu:gloo,cuda:nccl" if accelerator == "cuda" else "gloo"


def fsdp_strategy(
    data_parallel_size: int,
    backend: str = "gloo",
    timeout_s: float = 300.0,
    full_checkpoints: bool = True,
) -> ModelParallelStrategy:
    """Lightning's FSDP2 strategy with data parallelism only (no tensor parallelism).

    Args:
        data_parallel_size: trainer ranks that shard the policy (the Trainer's ``devices``
            times ``num_nodes``).
        backend: the process-group backend (``process_group_backend``): ``"gloo"`` on CPUs,
            ``"cpu:gloo,cuda:nccl"`` on GPUs.
        timeout_s: how long a collective waits for the other ranks before it fails, so a
            crashed rank stops the run instead of hanging it.
        full_checkpoints: checkpoints as one file with the full (gathered) weights and
            optimizer state, written by rank 0, which resume with any number of ranks; ``False``
            writes a folder of shards (faster for very large models).

    Returns:
        A ``ModelParallelStrategy`` whose device mesh has a ``"data_parallel"`` dimension of
        ``data_parallel_size`` and a ``"tensor_parallel"`` dimension of 1.
    """
    if data_parallel_size < 1:
        raise ValueError(f"data_parallel_size must be at least 1, got {data_parallel_size}.")
    return AtomicShardsStrategy(
        data_parallel_size=data_parallel_size,
        tensor_parallel_size=1,
        process_group_backend=backend,
        timeout=timedelta(seconds=timeout_s),
        save_distributed_checkpoint=not full_checkpoints,
    )


class AtomicShardsStrategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` whose sharded checkpoints are written whole or not at
    all, as ``streamrl.training.checkpointing.AtomicCheckpointIO`` writes one-file ones.

    ``last.ckpt`` is a symbolic link to a hidden folder of shards beside it. Every rank writes
    its shards into a new folder; once all are done rank 0 points the link at it in one
    ``os.replace`` (there is no moment without a whole ``last.ckpt``) and deletes the folders
    it no longer points at (those of saves killed half-way too). A rank killed while writing
    leaves the previous checkpoint as it was. A ``last.ckpt`` folder written before links were
    used is replaced the same way, once the new one is whole.
    """

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any = None
    ) -> None:
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        path = Path(self.broadcast(str(filepath)))
        folder = path.with_name(self.broadcast(f".{path.name}.{time.time_ns()}"))
        super().save_checkpoint(checkpoint, folder, storage_options)
        self.barrier()  # every rank's shards are in the new folder
        if self.global_rank == 0:
            point_link_at(path, folder)
        self.barrier()


def shard_policy(
    policy: torch.nn.Module, device_mesh: DeviceMesh, precision: Precision = "32-true"
) -> torch.nn.Module:
    """Shard ``policy`` in place with FSDP2: each decoder layer, then the root (one group per
    layer lets FSDP gather one layer at a time); ``precision`` ``"bf16-mixed"`` computes in
    bfloat16 over float32 shards. See ``streamrl.components.training.sharding.shard_model``.

    Raises:
        ValueError: no decoder layer was found (classes named in ``_no_split_modules``).
    """
    return shard_model(policy, device_mesh, precision=precision)


class ShardedStreamRLModule(StreamRLModule):
    """``StreamRLModule`` whose policy is sharded with FSDP2 across the trainer ranks.

    Takes ``StreamRLModule``'s arguments; run it under ``fsdp_strategy(...)``. Two ways to feed
    the ranks:

    - every rank has ``rollouts`` streaming its own share of the iteration's samples;
    - ``share_stream=True``: only rank 0 has ``rollouts`` (one generation service); it deals
      its stream in rounds of one micro-batch per rank (``DynamicBatchPipeline.rounds``: each
      under the token ceiling, the ranks' tokens balanced), so every rank runs the same number
      of forward/backward passes, which FSDP's collectives need; a rank with nothing left in
      the last round runs a two-token pass. The other ranks pass ``rollouts=None``. This is
      how ``streamrl fit`` runs several trainer ranks (``trainer.devices``).

    Args:
        share_stream: rank 0 deals its stream to the ranks (above).
        precision: ``"bf16-mixed"`` (bfloat16 compute over float32 shards) or ``"32-true"``.
        reference_offload: keep a frozen reference's shards in host memory.
        share_timeout_s: how long a rank > 0 waits for its next share (rank 0 waits for the
            generators, and evaluates; ``streamrl.training.rank_timeouts``).

    The other arguments are ``StreamRLModule``'s.

    Raises:
        ValueError: the algorithm trains parameters of its own (PPO's value head): they would
            be replicated without gradient averaging, so the ranks would drift apart.

    Examples:
        >>> import lightning as L
        >>> from streamrl.training.fsdp import ShardedStreamRLModule, fsdp_strategy
        >>> # module = ShardedStreamRLModule(policy, GRPO(group_size=4), rollouts, iterations=10)
        >>> # L.Trainer(accelerator="cpu", devices=2, strategy=fsdp_strategy(2)).fit(module)
    """

    def __init__(
        self,
        *args,
        share_stream: bool = False,
        precision: Precision = "32-true",
        reference_offload: bool = False,
        share_timeout_s: float = 900.0,
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.share_stream, self.precision = share_stream, precision
        self.reference_offload, self.share_timeout_s = reference_offload, share_timeout_s
        self._shares: dist.ProcessGroup | None = None
        self._wire_dtype: list | None = None  # [dtype], the same on every rank once known
        if self.rollouts is None and not share_stream:
            raise ValueError("ShardedStreamRLModule: rollouts=None needs share_stream=True.")
        if list(self.algorithm.trainable_parameters()):
            raise ValueError(
                f"ShardedStreamRLModule: {type(self.algorithm).__name__} has trainable "
                "parameters of its own (a value head); they are not sharded, so their gradients "
                "would not be averaged across ranks. Use a critic-free algorithm (GRPO) or "
                "StreamRLModule on one process with trainer.precision: 32-true."
            )

    def configure_model(self) -> None:
        # Lightning may call this hook more than once (e.g. fit after validate): shard once.
        if isinstance(self.policy, FSDPModule):
            return
        mesh = self.device_mesh["data_parallel"]
        shard_model(self.policy, mesh, precision=self.precision)
        if isinstance(self.reference, FrozenCopy):  # a shard per rank, like the policy
            self.reference.shard(mesh, offload=self.reference_offload)
        self.place_weights()  # sharded first: each rank reads only its own rows

    def weights_to_sync(self) -> list[tuple[str, torch.Tensor]]:
        """The sharded parameters the generators load after each step (``DTensor`` s, each
        gathered, cast and freed in turn as it is staged: a collective, every rank stages);
        a LoRA policy's adapters only."""
        names = adapter_names(self.policy) or None
        return [(n, p) for n, p in self.policy.named_parameters() if names is None or n in names]

    def weights_root(self) -> int | None:
        """Rank 0 holds the service with ``share_stream`` (the ranks send it their shards);
        otherwise every rank has a service of its own and gathers the full weights."""
        return 0 if self.share_stream else None

    def wire_dtype(self) -> torch.dtype | None:
        """The generators' dtype, which only rank 0 (the service's) knows: every rank must cast
        before the same all-gathers."""
        if self._wire_dtype is None:
            self._wire_dtype = self.trainer.strategy.broadcast([super().wire_dtype()], src=0)
        return self._wire_dtype[0]

    def on_fit_start(self) -> None:
        if self.share_stream:  # gloo carries the shares whatever backend FSDP uses
            timeout = timedelta(seconds=self.share_timeout_s)
            self._shares = dist.new_group(backend="gloo", timeout=timeout)

    def on_train_end(self) -> None:
        with shielded():  # collectives: every rank is here
            super().on_train_end()
            peaks: list = [None] * dist.get_world_size()
            dist.all_gather_object(peaks, self.peak_memory_bytes[0], group=self._shares)
            self.peak_memory_bytes = peaks

    def stop_ranks(self, stop: Stopped) -> None:
        """Rank 0, stopped: every other rank leaves its wait for a share with ``stop``.

        Rank 0 alone takes signals (``streamrl.runtime.stopping.ignore_signals`` on the others) and
        trains shielded (``train_rl``) but while it waits for samples (``stoppable`` in
        ``_train_on_shares``), when every other rank waits for its next share: none is in a
        collective (Lightning's loop runs one before each step), so all can then save the
        checkpoint together."""
        if self.share_stream and self._shares is not None and self.rollouts is not None:
            self._exchange([stop.signum] * self.trainer.world_size)

    def train_on_stream(self, iteration: int) -> float:
        if self.share_stream:
            train_s = self._train_on_shares(iteration)
        else:
            train_s = super().train_on_stream(iteration)
        # Each rank holds its share's loss; FSDP averages the ranks' gradients, so the mean of
        # their losses is the loss one process training every sample would log.
        reduce = self.trainer.strategy.reduce
        self.iteration_loss = reduce(self.iteration_loss, reduce_op="mean")
        self.entropy_sum = reduce(self.entropy_sum, reduce_op="sum")
        self.entropy_tokens = reduce(self.entropy_tokens, reduce_op="sum")
        self.gap_stats = reduce(self.gap_stats, reduce_op="sum")
        return train_s

    def _train_on_shares(self, iteration: int) -> float:
        """``share_stream``: rank 0 deals its stream to the ranks, one micro-batch per rank per
        round (``DynamicBatchPipeline.rounds``: each under the token ceiling, balanced)."""
        if self.rollouts is None:  # a rank > 0: train on what rank 0 sends, until it says done
            train_s = 0.0
            while not isinstance(share := self._exchange(None), float):
                if isinstance(share, int):  # rank 0 was stopped (``stop_ranks``)
                    raise Stopped(share)
                train_s += self.backward_micro(share[0], iteration, share[1])
            if share != 1.0:  # samples were left out: every rank rescales its gradient shard
                self.rescale_gradients(share)
            return train_s
        train_s, total = 0.0, self.rollouts.samples_per_iteration
        world = self.trainer.world_size
        groups = self.rollouts.groups(self.dispatch(iteration))
        rounds = self.pipeline.rounds(groups, self.weight_version, world)
        while True:
            with stoppable():  # waiting for samples: the other ranks wait for their share
                micro_batches = next(rounds, None)
            if micro_batches is None:
                break
            # Each rank's loss is scaled by world/total: FSDP averages the ranks' gradients, so
            # the update equals one process back-propagating every sample divided by total.
            mine = self._exchange([(m, world / total) for m in micro_batches])
            train_s += self.backward_micro(mine[0], iteration, mine[1])
            dealt = sum(len(m.samples) for m in micro_batches)
            self.samples_trained += dealt
            self.samples_in_step += dealt
            if self.trained_batches is not None:
                self.trained_batches.extend(micro_batches)
        # The iteration's stream is over: its loss's scale, once the samples left out are known.
        factor = self.left_out_factor()
        self._exchange([factor] * world)
        if factor != 1.0:
            self.rescale_gradients(factor)
        return train_s

    def _exchange(self, shares: list | None) -> tuple[MicroBatch, float] | float | int:
        """Rank 0 sends ``shares[r]`` to each rank ``r``; every rank returns its own: a
        micro-batch and its loss scale, a float (the iteration is over: the factor its gradient
        is rescaled by, ``left_out_factor``) or a signal number (rank 0 was stopped)."""
        mine: list = [None]
        dist.scatter_object_list(mine, shares, src=0, group=self._shares)
        return mine[0]
