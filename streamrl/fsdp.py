"""FSDP2 trainer: the policy sharded with ``fully_shard`` across data-parallel trainer ranks.

Each rank holds a 1/N shard of every parameter, its gradients and AdamW states; a layer's full
weights exist only while that layer runs forward or backward. Gradients are averaged across the
ranks by FSDP's reduce-scatter, so every rank must back-propagate its own share of the
iteration's samples, with the loss divided by that share (``samples_per_iteration`` of its
stream). The generators need whole tensors: ``full_state`` gathers them (see docs/fsdp.md).

Lightning's ``fsdp`` strategy refuses the CPU; ``ModelParallelStrategy`` (FSDP2, DTensor) runs on
it with the gloo backend, which is how the 2-process CPU test runs it.

Examples:
    >>> import lightning as L
    >>> from streamrl.fsdp import ShardedStreamRLModule, fsdp_strategy
    >>> strategy = fsdp_strategy(data_parallel_size=2)
    >>> # trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=...)
    >>> # trainer.fit(ShardedStreamRLModule(policy, algorithm, rollouts, iterations=...))
"""

from __future__ import annotations

from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from streamrl.components.training.pipeline import MicroBatch
from streamrl.module import StreamRLModule

#: How long a trainer rank > 0 waits for its next share: rank 0 may wait that long for samples.
SHARE_TIMEOUT_S = 900.0


def fsdp_strategy(
    data_parallel_size: int,
    backend: Literal["gloo", "nccl"] = "gloo",
    timeout_s: float = 300.0,
    full_checkpoints: bool = True,
) -> ModelParallelStrategy:
    """Lightning's FSDP2 strategy with data parallelism only (no tensor parallelism).

    Args:
        data_parallel_size: trainer ranks that shard the policy (the Trainer's ``devices``
            times ``num_nodes``).
        backend: the process-group backend: ``"gloo"`` on CPUs, ``"nccl"`` on GPUs.
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
    return ModelParallelStrategy(
        data_parallel_size=data_parallel_size,
        tensor_parallel_size=1,
        process_group_backend=backend,
        timeout=timedelta(seconds=timeout_s),
        save_distributed_checkpoint=not full_checkpoints,
    )


def shard_policy(policy: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
    """Shard ``policy`` in place with FSDP2: each decoder layer, then the root.

    One ``fully_shard`` per decoder layer lets FSDP gather one layer at a time (and free it after
    its forward), as the FSDP2 docs recommend; the root call takes the remaining parameters
    (embeddings, final norm, a tied LM head) as one more group.

    Args:
        policy: a Hugging Face causal LM; its decoder layers are the modules whose class is
            named in ``policy._no_split_modules`` (``Qwen2DecoderLayer`` for our tiny models).
        device_mesh: a 1-D mesh of the data-parallel ranks (``module.device_mesh
            ["data_parallel"]`` under ``ModelParallelStrategy``).

    Returns:
        ``policy`` itself: its parameters are now ``DTensor`` shards, names unchanged.

    Raises:
        ValueError: no decoder layer was found (one group for the whole model would gather
            every weight at once; pass a model that names its layers in ``_no_split_modules``).
    """
    layer_classes = set(getattr(policy, "_no_split_modules", None) or ())
    layers = [m for m in policy.modules() if type(m).__name__ in layer_classes]
    if not layers:
        raise ValueError(
            f"shard_policy: found no decoder layer in {type(policy).__name__} (looked for the "
            f"classes in _no_split_modules: {sorted(layer_classes)}). Pass a Hugging Face causal "
            "LM, or shard its layers with fully_shard yourself."
        )
    for layer in layers:
        fully_shard(layer, mesh=device_mesh)
    fully_shard(policy, mesh=device_mesh)
    return policy


def full_state(policy: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The policy's full (unsharded) parameters, for the generators' weight update.

    A collective: every rank must call it, in the same order; every rank gets the full tensors
    (all-gathered shard by shard, on the parameters' device). Names and order are those of
    ``policy.named_parameters()``, what ``StreamGenerationService.update`` expects; a tied
    LM head appears once, under the embedding's name, as on an unsharded policy.

    Args:
        policy: a policy sharded by ``shard_policy`` (an unsharded one is returned as is).

    Returns:
        ``{name: tensor}``, detached plain tensors.
    """
    with torch.no_grad():
        return {
            name: (p.full_tensor() if isinstance(p, DTensor) else p).detach()
            for name, p in policy.named_parameters()
        }


class ShardedStreamRLModule(StreamRLModule):
    """``StreamRLModule`` whose policy is sharded with FSDP2 across the trainer ranks.

    Takes ``StreamRLModule``'s arguments; run it under ``fsdp_strategy(...)``. Two ways to feed
    the ranks:

    - every rank has ``rollouts`` streaming its own share of the iteration's samples;
    - ``share_stream=True``: only rank 0 has ``rollouts`` (one generation service); it splits
      each micro-batch of its stream across the ranks as it forms (``split_micro_batch``), so
      every rank runs the same number of forward/backward passes, which FSDP's collectives
      need. The other ranks pass ``rollouts=None``. This is how ``streamrl fit`` runs
      ``rl.trainer_ranks > 1``.

    Raises:
        ValueError: the algorithm trains parameters of its own (PPO's value head): they would
            be replicated without gradient averaging, so the ranks would drift apart.

    Examples:
        >>> import lightning as L
        >>> from streamrl.fsdp import ShardedStreamRLModule, fsdp_strategy
        >>> # module = ShardedStreamRLModule(policy, GRPO(group_size=4), rollouts, iterations=10)
        >>> # L.Trainer(accelerator="cpu", devices=2, strategy=fsdp_strategy(2)).fit(module)
    """

    def __init__(self, *args, share_stream: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.share_stream = share_stream
        self._shares: dist.ProcessGroup | None = None
        #: Rank 0's full weights after the last step (gathered at the end of ``fit``).
        self.final_weights: dict[str, torch.Tensor] | None = None
        if self.rollouts is None and not share_stream:
            raise ValueError("ShardedStreamRLModule: rollouts=None needs share_stream=True.")
        if list(self.algorithm.trainable_parameters()):
            raise ValueError(
                f"ShardedStreamRLModule: {type(self.algorithm).__name__} has trainable "
                "parameters of its own (a value head); they are not sharded, so their gradients "
                "would not be averaged across ranks. Use a critic-free algorithm (GRPO) or "
                "StreamRLModule on one process."
            )

    def configure_model(self) -> None:
        # Lightning may call this hook more than once (e.g. fit after validate): shard once.
        if not isinstance(self.policy, FSDPModule):
            shard_policy(self.policy, self.device_mesh["data_parallel"])

    def weights_to_sync(self) -> dict[str, torch.Tensor]:
        """The full weights the generators load after each step (a collective: all ranks)."""
        return full_state(self.policy)

    def on_fit_start(self) -> None:
        if self.share_stream:  # gloo carries the shares whatever backend FSDP uses
            timeout = timedelta(seconds=SHARE_TIMEOUT_S)
            self._shares = dist.new_group(backend="gloo", timeout=timeout)

    def on_train_end(self) -> None:
        self.final_weights = full_state(self.policy)  # a collective: every rank is here
        super().on_train_end()

    def train_on_stream(self, iteration: int) -> float:
        if self.share_stream:
            train_s = self._train_on_shares(iteration)
        else:
            train_s = super().train_on_stream(iteration)
        # Each rank holds its share's loss; FSDP averages the ranks' gradients, so the mean of
        # their losses is the loss one process training every sample would log.
        self.iteration_loss = self.trainer.strategy.reduce(self.iteration_loss, reduce_op="mean")
        return train_s

    def _train_on_shares(self, iteration: int) -> float:
        """``share_stream``: rank 0 deals each micro-batch of its stream to every rank."""
        if self.rollouts is None:  # a rank > 0: train on what rank 0 sends, until it says done
            train_s = 0.0
            while (share := self._exchange(None)) is not None:
                train_s += self.backward_micro(share[0], iteration, share[1])
            return train_s
        train_s, total = 0.0, self.rollouts.samples_per_iteration
        world = self.trainer.world_size
        groups = self.rollouts.groups(self.dispatch(iteration))
        for micro in self.pipeline.micro_batches(groups, self.weight_version):
            # Each rank's loss is scaled by world/total: FSDP averages the ranks' gradients, so
            # the update equals one process back-propagating every sample divided by total.
            shares = [
                (part, world / total if real else 0.0)
                for part, real in split_micro_batch(micro, world)
            ]
            mine = self._exchange(shares)
            train_s += self.backward_micro(mine[0], iteration, mine[1])
            self.samples_trained += len(micro.samples)
        self._exchange([None] * world)  # the iteration's stream is over
        return train_s

    def _exchange(self, shares: list | None) -> tuple[MicroBatch, float] | None:
        """Rank 0 sends ``shares[r]`` to each rank ``r``; every rank returns its own."""
        mine: list = [None]
        dist.scatter_object_list(mine, shares, src=0, group=self._shares)
        return mine[0]


def split_micro_batch(micro: MicroBatch, world: int) -> list[tuple[MicroBatch, bool]]:
    """``micro`` dealt to ``world`` ranks, longest samples first, round-robin (similar padded
    tokens per rank). A rank left without a sample gets a copy of the first one, flagged
    ``False``: it still runs forward and backward (FSDP's collectives need every rank), with its
    loss scaled by 0.

    Examples:
        >>> from streamrl.records import Sample
        >>> s = [Sample(f"p{n}", 0, [1], [2] * n, [0.0] * n, 0, 0) for n in (3, 1, 2)]
        >>> [[x.length for x in part.samples] for part, _ in split_micro_batch(
        ...     MicroBatch(s, [1.0, 2.0, 3.0]), 2)]
        [[3, 1], [2]]
    """
    order = sorted(range(len(micro.samples)), key=lambda i: -micro.samples[i].length)
    parts: list[tuple[MicroBatch, bool]] = []
    for rank in range(world):
        picked = order[rank::world]
        if picked:
            samples = [micro.samples[i] for i in picked]
            parts.append((MicroBatch(samples, [micro.advantages[i] for i in picked]), True))
        else:
            parts.append((MicroBatch(micro.samples[:1], micro.advantages[:1]), False))
    return parts
