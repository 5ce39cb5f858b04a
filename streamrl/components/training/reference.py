"""The frozen reference policy a KL penalty measures against, held at the cost of a shard.

The builder picks one of three, from what the algorithm and the run need
(``reference_policy``):

- none at all when the algorithm needs no reference (``kl_coef == 0``);
- ``DisabledAdapters`` under LoRA: the base weights never train, so the reference is the policy
  itself with its adapters switched off, and costs no memory;
- ``FrozenCopy`` otherwise: the starting weights in the compute dtype, without gradients or
  optimizer state. A policy read from its directory shard by shard
  (``streamrl.policy.model_dir``: still on the meta device here) gets a reference built the same
  way, never a copy of the policy: an empty model in the compute dtype, sharded with FSDP2 like
  the policy (each rank holds ``1/N``) and filled from the same directory (``place``), so no
  rank holds it whole in any dtype, nor a float32 copy. By option its shards stay in host
  memory, copied to the device layer by layer (``offload``). A policy already in memory (a
  notebook's) is copied and cast.
"""

from __future__ import annotations

import copy
from typing import Protocol, runtime_checkable

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from streamrl.components.training.sharding import Precision, compute_dtype, shard_model
from streamrl.policy.logprobs import TokenBatch, causal_lm, completion_logprobs
from streamrl.policy.model_dir import empty_model, is_empty, materialize, source_dir


@runtime_checkable
class ReferencePolicy(Protocol):
    """Scores tokens under the frozen reference policy (no gradient)."""

    def logprobs(
        self, tokens: TokenBatch, temperature: float, chunk_tokens: int | None = None
    ) -> torch.Tensor:
        """``[tokens]`` log-probs of ``tokens.targets`` under the reference."""
        ...


class DisabledAdapters:
    """The reference of a LoRA policy: the same model with its adapters switched off.

    ``peft`` switches adapters off by marking them frozen for the call: under FSDP2 the
    policy's first forward must come before this one, so that FSDP sets up their gradients
    (``StreamRLModule.loss_inputs`` scores the policy first).

    Args:
        policy: the ``peft`` model being trained (its base weights are the reference's).
    """

    def __init__(self, policy: torch.nn.Module) -> None:
        self.policy = policy

    def logprobs(
        self, tokens: TokenBatch, temperature: float, chunk_tokens: int | None = None
    ) -> torch.Tensor:
        with torch.no_grad(), self.policy.disable_adapter():
            return completion_logprobs(self.policy, tokens, temperature, chunk_tokens=chunk_tokens)[
                0
            ]


class FrozenCopy:
    """A frozen copy of the policy's starting weights.

    Args:
        model: the copy (``copy.deepcopy(policy)`` before training), or an empty model of the
            policy's directory (``streamrl.policy.model_dir.empty_model``) that ``place`` fills
            from it; frozen and cast to ``dtype`` here.
        dtype: the dtype it is kept in (the run's compute dtype: it never trains, so it needs
            no float32 master).
    """

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype | None = None) -> None:
        self.model = model.eval().requires_grad_(False)
        self.offload = False  # its shards kept in host memory (``shard``)
        if dtype is not None:
            self.model.to(dtype)

    @property
    def sharded(self) -> bool:
        return isinstance(self.model, FSDPModule)

    def shard(self, device_mesh: DeviceMesh, *, offload: bool = False) -> None:
        """Shard it across ``device_mesh`` like the policy (only a shard per rank)."""
        if not self.sharded:
            shard_model(self.model, device_mesh, offload=offload)
            self.offload = offload

    def place(self, device: torch.device) -> None:
        """Put it on the trainer's ``device``: an empty model is filled from its directory, each
        rank reading only its shards (a collective when sharded); an unsharded copy is moved
        there (a sharded one already is)."""
        if is_empty(self.model):  # offloaded shards live in host memory
            materialize(self.model, source_dir(self.model), "cpu" if self.offload else device)
        elif not self.sharded:
            self.model.to(device)

    def logprobs(
        self, tokens: TokenBatch, temperature: float, chunk_tokens: int | None = None
    ) -> torch.Tensor:
        with torch.no_grad():
            out = completion_logprobs(self.model, tokens, temperature, chunk_tokens=chunk_tokens)
        if self.sharded:  # no backward will reshard it: free the gathered root parameters now
            self.model.reshard()
        return out.logprobs


def reference_policy(
    policy: torch.nn.Module, needed: bool, precision: Precision = "32-true"
) -> ReferencePolicy | None:
    """The reference a run needs: ``None`` when ``needed`` is false, the policy with adapters
    off under LoRA, else a frozen copy in ``precision``'s compute dtype: for a policy still on
    the meta device, an empty model of its directory in that dtype (filled by ``place``), else a
    copy of the policy."""
    if not needed:
        return None
    if callable(getattr(policy, "disable_adapter", None)):  # a peft model
        return DisabledAdapters(policy)
    dtype = compute_dtype(precision)
    if is_empty(policy):  # the same architecture and attention, read from the same directory
        attention = getattr(causal_lm(policy).config, "_attn_implementation", None)
        return FrozenCopy(empty_model(source_dir(policy), dtype, attention))
    return FrozenCopy(copy.deepcopy(policy), dtype)
