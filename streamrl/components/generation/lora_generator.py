"""``HFStreamGenerator`` on a LoRA policy: updates carry only the adapters (StreamRL §3's weight
push, shrunk to what changes), merged into the base weights while decoding."""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedModel

from streamrl.components.generation.hf_generator import HFStreamGenerator, WeightMap
from streamrl.policy.lora import MergedLoRA, adapter_weights


class LoRAStreamGenerator(HFStreamGenerator):
    """``HFStreamGenerator`` on a model wrapped by ``streamrl.policy.lora.apply_lora``: updates
    carry only the adapter tensors, and the adapters stay merged into the base weights while
    decoding (``MergedLoRA``: base-model speed between two loads).

    Args:
        model: the LoRA-wrapped model (the trainer's ``LoRASpec``); merged on construction.
        **settings: as for ``HFStreamGenerator``.
    """

    def __init__(self, model: PreTrainedModel, **settings: Any) -> None:
        super().__init__(model, **settings)
        self.merged = MergedLoRA(self.model)

    def weight_templates(self) -> dict[str, torch.Tensor]:
        """The adapter tensors, with the trainer's names and order (``adapter_weights``)."""
        return adapter_weights(self.model)

    def load_weights(self, state_dict: WeightMap, version: int) -> None:
        """Load new adapters into the unmerged model, then merge them again."""
        with self.merged.unmerged():
            super().load_weights(state_dict, version)

    def fingerprint(self) -> str:
        """The hash of the unmerged weights: comparable with the trainer's LoRA policy."""
        with self.merged.unmerged():
            return super().fingerprint()
