"""Tiny test policies whose greedy completions vary token to token (shared by generator tests)."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from streamrl.policy.models import build_tiny_model


def varied_model(tok: PreTrainedTokenizerBase, seed: int = 0, std: float = 0.2) -> PreTrainedModel:
    """The "test" model with weights rescaled to std ``std`` (0.2 by default).

    The default 0.02 init repeats one token whatever the context, which would hide cache and
    position bugs; at 0.2 greedy completions vary with every prefix token; at 0.1 they mix
    varied stretches with repeated ones (what speculative decoding's drafts hit and miss).
    """
    model = build_tiny_model(tok, size="test", seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    return model.eval()
