"""How the trainer holds a model in memory: FSDP2 shards, the precision it computes in, and
activation checkpointing.

- ``shard_model``: one ``fully_shard`` group per decoder layer, then the root, so FSDP gathers
  one layer at a time. Each rank keeps a ``1/N`` shard of every parameter (its gradients and
  AdamW state too).
- ``mixed_precision``: ``"bf16-mixed"`` is FSDP2's ``MixedPrecisionPolicy``: the gathered
  parameters and the forward/backward compute in bfloat16; gradients are reduced, and the
  sharded master weights and the optimizer kept, in float32. The same policy runs on the CPU
  (gloo) and on CUDA (NCCL).
- ``enable_activation_checkpointing``: each decoder layer keeps only its input in the forward
  pass and runs again in the backward pass (non-reentrant, applied before ``fully_shard``, as
  FSDP2 expects).
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from streamrl.policy.logprobs import causal_lm, enable_sharded_forward
from streamrl.runtime.devices import PRECISIONS, Precision


def mixed_precision(precision: Precision) -> MixedPrecisionPolicy | None:
    """FSDP2's policy for ``precision``: bf16 parameters and compute, fp32 reduction (``None``
    for ``"32-true"``: everything in float32)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}.")
    if precision == "32-true":
        return None
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def compute_dtype(precision: Precision) -> torch.dtype:
    """The dtype forward and backward passes run in under ``precision``."""
    return torch.bfloat16 if precision == "bf16-mixed" else torch.float32


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a Hugging Face causal LM (or a ``peft`` model wrapping one): the
    modules whose class is named in its ``_no_split_modules``.

    Raises:
        ValueError: none found (one FSDP group for the whole model would gather every weight
            at once; pass a model that names its layers in ``_no_split_modules``).
    """
    lm = causal_lm(model)
    layer_classes = set(getattr(lm, "_no_split_modules", None) or ())
    layers = [m for m in lm.modules() if type(m).__name__ in layer_classes]
    if not layers:
        raise ValueError(
            f"found no decoder layer in {type(lm).__name__} (looked for the classes in "
            f"_no_split_modules: {sorted(layer_classes)}). Pass a Hugging Face causal LM, or "
            "shard its layers with fully_shard yourself."
        )
    return layers


def shard_model(
    model: torch.nn.Module,
    device_mesh: DeviceMesh,
    *,
    precision: Precision = "32-true",
    offload: bool = False,
) -> torch.nn.Module:
    """Shard ``model`` in place with FSDP2: each decoder layer, then the root.

    Args:
        model: a Hugging Face causal LM (or a ``peft`` model wrapping one).
        device_mesh: a 1-D mesh of the data-parallel ranks (``module.device_mesh
            ["data_parallel"]`` under ``ModelParallelStrategy``).
        precision: ``"bf16-mixed"`` computes in bfloat16 over float32 shards
            (``mixed_precision``); ``"32-true"`` in float32.
        offload: keep the shards in host memory (FSDP2's ``CPUOffloadPolicy``), copied to the
            device layer by layer; for a frozen reference policy.

    Returns:
        ``model`` itself: its parameters are now ``DTensor`` shards, names unchanged, and
        ``streamrl.policy.logprobs.completion_logprobs`` runs as one of its forwards.
    """
    options: dict = {"mesh": device_mesh, "mp_policy": mixed_precision(precision)}
    if options["mp_policy"] is None:
        del options["mp_policy"]
    if offload:
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=device_mesh.device_type == "cuda")
    for layer in decoder_layers(model):
        fully_shard(layer, **options)
    fully_shard(model, **options)
    enable_sharded_forward(model)
    return model


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder layer in the backward pass instead of keeping its activations
    (Hugging Face's per-layer checkpointing, non-reentrant). Call before ``shard_model``."""
    lm = causal_lm(model)
    if not getattr(lm, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"{type(lm).__name__} does not support activation checkpointing; set "
            "trainer.activation_checkpointing: false."
        )
    lm.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})


def full_state(model: torch.nn.Module, names: set[str] | None = None) -> dict[str, torch.Tensor]:
    """The model's full (unsharded) parameters, for the generators' weight update.

    A collective: every rank must call it, in the same order; every rank gets the full tensors
    (all-gathered shard by shard, on the parameters' device). Names and order are those of
    ``model.named_parameters()``, what ``StreamGenerationService.update`` expects; a tied
    LM head appears once, under the embedding's name, as on an unsharded model.

    Args:
        model: a model sharded by ``shard_model`` (an unsharded one is returned as is).
        names: only these parameters (a LoRA policy's adapters); ``None``: all.

    Returns:
        ``{name: tensor}``, detached plain tensors.
    """
    with torch.no_grad():
        return {
            name: (p.full_tensor() if isinstance(p, DTensor) else p).detach()
            for name, p in model.named_parameters()
            if names is None or name in names
        }


def local_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameter storage this rank holds for ``model`` (its shards when sharded)."""
    return sum(
        (p.to_local() if isinstance(p, DTensor) else p).untyped_storage().nbytes()
        for p in model.parameters()
    )
