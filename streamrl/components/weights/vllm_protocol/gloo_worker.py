"""The worker's side of ``streamrl_gloo``, vLLM's weight-transfer protocol over gloo: what runs in
vLLM's worker processes (StreamRL §6). Registered in vLLM's ``WeightTransferEngineFactory``
(``register_backends``); ``applied_digests`` reads back what a model holds after an update."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from streamrl.components.weights.checksums import tensor_digest
from streamrl.components.weights.nccl import DEFAULT_BUCKET_BYTES, TensorSpec, plan_buckets
from streamrl.components.weights.transport import DEFAULT_TIMEOUT_S, WeightGroup
from streamrl.policy.expert_weights import as_checkpoint

__all__ = [
    "GLOO_BACKEND",
    "GlooInitInfo",
    "GlooUpdateInfo",
    "GlooWeightTransferEngine",
    "applied_digests",
    "reprocess_cpu_layouts",
]

#: Our CPU backend's name in vLLM's factories.
GLOO_BACKEND = "streamrl_gloo"


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """What an instance's workers need to join the group (from the trainer, at init)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S
    generation: int = 1  # the feed on the trainer's store this group belongs to (``feeding``)
    attempt: int = 0  # the group formed again within that feed (``WeightGroup``)


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """One version's tensors, in broadcast order (the trainer's names, the wire dtype)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    digests: bool = False  # the workers digest what they load (``verify_digests``)

    def specs(self) -> list[TensorSpec]:
        return [
            TensorSpec(n, tuple(s), getattr(torch, d))
            for n, d, s in zip(self.names, self.dtype_names, self.shapes)
        ]


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """Worker side of ``streamrl_gloo``: receives each bucket of a version over a gloo group
    and loads it through vLLM's layerwise reload, as vLLM's NCCL engine does.

    Attributes:
        loaded_digests: ``tensor_digest`` of every tensor loaded in the last update that asked
            for digests, by the trainer's name.
    """

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: WeightGroup | None = None
        self.bucket_bytes = DEFAULT_BUCKET_BYTES
        self.loaded_digests: dict[str, str] = {}

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        rank = init_info.rank_offset + self.parallel_config.rank
        self.bucket_bytes = init_info.bucket_bytes
        self.group = WeightGroup(
            init_info.master_port,
            rank,
            init_info.world_size,
            timeout_s=init_info.timeout_s,
            host=init_info.master_address,
            device="cpu",
            generation=init_info.generation,
            attempt=init_info.attempt,
        )

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises without one.
        try:
            self.receive_weights(self.parse_update_info(update_info))
        except BaseException:
            # A broadcast cut short leaves layers half loaded on vLLM's meta tensors: close
            # the reload (the old weights where nothing came), so the version sent again
            # starts from a model that runs. Not a model to sample from: the caller waits.
            with contextlib.suppress(Exception):  # the broadcast's error is the one to tell
                self.finish_weight_update()
            raise
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("streamrl_gloo: update_weights before init_weight_transfer_engine.")
        specs = update_info.specs()
        self.loaded_digests = {}
        for bucket in plan_buckets(specs, self.bucket_bytes):
            # A fresh buffer per bucket: the layerwise reload keeps the views of a layer's
            # tensors until the layer is complete.
            flat = torch.empty(bucket.numel, dtype=bucket.dtype)
            self.group.broadcast([flat])
            named = [
                (specs[s.index].name, flat[s.offset : s.offset + s.numel].view(s.shape))
                for s in bucket.slots
            ]
            if update_info.digests:
                self.loaded_digests.update((n, tensor_digest(t)) for n, t in named)
            # A mixture of experts' fused tensors, as the checkpoints the loader reads.
            model_type = self.model_config.hf_config.model_type
            self.model.load_weights(as_checkpoint(named, model_type))

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        reprocess_cpu_layouts(self.model)

    def shutdown(self) -> None:
        self.group = None


def applied_digests(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, str]:
    """``tensor_digest`` of the weights a vLLM model holds now, under the trainer's names and
    in the wire ``dtype`` (the engine's: vLLM's CPU build keeps biases in float32, an exact
    upcast): a fused projection (``qkv_proj``, ``gate_up_proj``) split back into its parts by
    its ``output_sizes``, through the model's ``packed_modules_mapping``. Parameters a kernel
    repacked away (a linear layer's weight on the CPU build) and tensor-parallel shards have
    no digest here; the others show whether an update was applied, not just received."""
    packed = getattr(model, "packed_modules_mapping", {}) or {}
    modules = dict(model.named_modules())
    digests: dict[str, str] = {}
    for name, param in model.named_parameters():
        if param.numel() == 0:
            continue
        owner, _, leaf = name.rpartition(".")
        module, _, fused = owner.rpartition(".")
        layer = modules.get(owner)
        if getattr(layer, "tp_size", 1) != 1:
            continue
        parts = packed.get(fused)
        sizes = getattr(layer, "output_sizes", None)
        vocab = getattr(layer, "org_vocab_size", None)  # an embedding padded past the vocab
        if parts and sizes and len(parts) == len(sizes) and sum(sizes) == param.shape[0]:
            for part, piece in zip(parts, torch.split(param.detach().to(dtype), list(sizes))):
                digests[f"{module}.{part}.{leaf}"] = tensor_digest(piece)
        else:
            held = param.detach().to(dtype)
            digests[name] = tensor_digest(held[:vocab] if vocab is not None else held)
    return digests


def reprocess_cpu_layouts(model: torch.nn.Module) -> None:
    """Re-run the post-load processing that vLLM 0.32's CPU build does once, at start, after an
    in-place reload:

    - LM heads: a tied head gets no tensor of its own, so it would keep its CPU-packed copy of
      the old embedding (stale logits);
    - a mixture of experts' kernels: the CPU experts prepack ``w13``/``w2`` into their grouped
      GEMM layout on the first post-load pass only (``UnquantizedFusedMoEMethod._setup_kernel``
      copies a reload's weights in unpacked), so the kernel would read the new weights in the
      wrong layout (other experts' outputs, other greedy tokens).

    Raises:
        RuntimeError: a CPU mixture of experts whose intermediate size vLLM pads (its padding
            is not redone on a reload).
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
    from vllm.platforms import current_platform

    cpu_experts: type | tuple[type, ...] = ()  # on CUDA its layerwise reload redoes the layout
    if current_platform.is_cpu():
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

        cpu_experts = CPUUnquantizedExperts
    for module in model.modules():
        if isinstance(module, ParallelLMHead):
            module.quant_method.process_weights_after_loading(module)
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, cpu_experts):
            config = experts.moe_config
            if experts._padded_intermediate_size(config) != config.intermediate_size_per_partition:
                raise RuntimeError(
                    "vLLM's CPU build pads this mixture of experts' intermediate size "
                    f"({config.intermediate_size_per_partition}); its weights cannot be "
                    "reloaded in place there (vLLM 0.32). Generate on the HF engine."
                )
            experts.process_weights_after_loading(module)
