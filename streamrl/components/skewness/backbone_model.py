"""The backbone ranker's model: a causal LM's body with LoRA adapters and a length head (§5.2).

``BackboneLengthRanker`` (``backbone_ranker.py``) trains it; this module builds it: loads the
backbone (a local directory or a model object) without its LM head, checks that the adapters
have modules to go on, and pools the final hidden state into the two-output length head.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

from streamrl.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Pooling = Literal["mean", "last"]

#: Attention projections of Llama/Qwen/Mistral-style models; other architectures name theirs.
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


class LengthModel(torch.nn.Module):
    """Frozen backbone + LoRA adapters, pooled final hidden state, linear head of two outputs
    (location and raw spread of the standardised log length)."""

    def __init__(self, backbone: torch.nn.Module, hidden: int, pooling: Pooling) -> None:
        super().__init__()
        self.backbone, self.pooling = backbone, pooling
        self.head = torch.nn.Linear(hidden, 2)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        states = self.backbone(input_ids=input_ids, attention_mask=attention_mask)[0]  # [b, s, h]
        mask = attention_mask.unsqueeze(-1).to(states.dtype)  # [b, s, 1]
        if self.pooling == "mean":
            pooled = (states * mask).sum(1) / mask.sum(1).clamp(min=1)  # [b, h]
        else:  # the last real token, wherever the padding side put it
            positions = torch.arange(states.shape[1], device=states.device)
            last = (attention_mask * positions).argmax(-1)  # [b]
            pooled = states[torch.arange(len(states), device=states.device), last]  # [b, h]
        return self.head(pooled.float())  # [b, 2]


def require_peft():
    try:
        import peft
    except ImportError as err:
        raise ConfigError(
            "BackboneLengthRanker needs peft, which is not installed. "
            "Install it with: pip install 'streamrl[peft]'"
        ) from err
    return peft


def load_backbone(
    backbone: str | Path | torch.nn.Module, tokenizer: PreTrainedTokenizerBase | None
) -> tuple[torch.nn.Module, PreTrainedTokenizerBase]:
    """The base transformer (no LM head: only hidden states are needed) and its tokenizer."""
    if isinstance(backbone, torch.nn.Module):
        if tokenizer is None:
            raise ConfigError(
                "BackboneLengthRanker: a model object needs its tokenizer; pass tokenizer=..."
            )
        # A causal LM's base_model is its transformer body (a base model returns itself).
        base = getattr(backbone, "base_model", backbone)
    else:
        from transformers import AutoModel

        from streamrl.policy.models import load_tokenizer

        path = Path(backbone)
        if not (path / "config.json").is_file():
            raise ConfigError(
                f"BackboneLengthRanker: no model directory at {str(path)!r} (no config.json "
                "there). Pass a local Hugging Face causal-LM directory."
            )
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        tokenizer = tokenizer or load_tokenizer(path)
        base = AutoModel.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    for param in base.parameters():
        param.requires_grad_(False)
    return base, tokenizer


def check_targets(model: torch.nn.Module, targets: Sequence[str]) -> None:
    names = [name for name, _ in model.named_modules()]
    if not any(name.split(".")[-1] in targets for name in names):
        raise ConfigError(
            f"BackboneLengthRanker: no module of the backbone is named one of {list(targets)}. "
            "Pass target_modules with its attention projection names (e.g. ['c_attn'] for GPT-2)."
        )
