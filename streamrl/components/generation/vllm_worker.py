"""What runs inside vLLM's worker processes: new weights loaded from the instance's staging.

StreamRL §6: a generator instance receives each weight version into a host staging
(``StagedWeights``). With vLLM's engine core in a process of its own, and one worker process per
tensor-parallel rank, the staging is a set of shared files (``StagedWeights(shared=True)``): each
worker maps them once (``streamrl_attach``), and for every version loads the model from those
views through vLLM's own layerwise reload (``streamrl_load``), each rank keeping its shard. No
bytes of the weights cross vLLM's RPC: only the order to load.

``StagingLoader`` is vLLM's ``worker_extension_cls``: its methods join the worker's and are called
through ``collective_rpc`` on every rank (``VLLMStreamGenerator``).
"""

from __future__ import annotations

from typing import Any

import torch

from streamrl.components.weights.staging import map_file
from streamrl.components.weights.vllm_protocol import (
    applied_digests,
    register_backends,
    reprocess_cpu_layouts,
)
from streamrl.policy.expert_weights import as_checkpoint

# vLLM resolves this module in every worker process before it loads the model, so the weight
# transfer backend of ours is known wherever vLLM builds its engine.
register_backends()

#: The extension, as vLLM's ``worker_extension_cls`` names it.
EXTENSION = f"{__name__}.StagingLoader"


class StagingLoader:
    """Mixed into vLLM's worker (``self`` is the worker: ``reload_weights``, ``get_model``)."""

    def streamrl_attach(self, buckets: list, tensors: list) -> int:
        """Map the staging's files: ``buckets`` is ``[(path, dtype name, numel)]``, ``tensors``
        ``[(name, bucket, offset, shape)]`` in load order. Returns the bytes mapped."""
        flat = [map_file(path, numel, getattr(torch, dtype)) for path, dtype, numel in buckets]
        views = [
            (name, flat[b][offset : offset + _numel(shape)].view(tuple(shape)))
            for name, b, offset, shape in tensors
        ]
        # A mixture of experts' fused tensors, as the checkpoints vLLM's loader reads.
        self._streamrl_views = as_checkpoint(views, self.model_config.hf_config.model_type)
        return sum(t.numel() * t.element_size() for t in flat)

    def streamrl_load(self) -> None:
        """Load the model from the mapped staging (the whole version is there)."""
        views = getattr(self, "_streamrl_views", None)
        if views is None:
            raise RuntimeError("streamrl_load before streamrl_attach: no staging mapped.")
        # vLLM's layerwise in-place reload: checkpoint-format tensors through the model's own
        # load_weights (each rank takes its shard), then each layer's post-load processing.
        self.reload_weights(weights_iterator=iter(views), is_checkpoint_format=True)
        reprocess_cpu_layouts(self.get_model())

    def streamrl_loaded_digests(self) -> dict[str, str]:
        """The digests of what the weight-transfer engine loaded last (``vllm_protocol``)."""
        return dict(getattr(self.weight_transfer_engine, "loaded_digests", {}))

    def streamrl_applied_digests(self) -> dict[str, str]:
        """The digests of the weights the model holds now, by the trainer's names."""
        return applied_digests(self.get_model(), self.vllm_config.model_config.dtype)


def _numel(shape: Any) -> int:
    count = 1
    for size in shape:
        count *= int(size)
    return count
