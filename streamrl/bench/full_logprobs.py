"""The trainer's log-probs as they were before ``streamrl.policy.logprobs``: logits at every
position over the whole vocabulary (several ``[batch, seq, vocab]`` tensors, held for the backward
pass).

Kept for two readers only: ``streamrl bench memory`` measures it as the old path beside the
chunked one, and the tests compare the chunked log-probs and gradients against it.
"""

from __future__ import annotations

import torch


def full_vocab_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention: torch.Tensor,
    starts: torch.Tensor,
    width: int,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Log-probs of each row's completion tokens under ``logits / temperature``.

    Args:
        model: a Hugging Face causal LM.
        input_ids: ``[batch, seq]``, each row ``prompt + completion + padding``.
        attention: ``[batch, seq]``, the attention mask of ``input_ids``.
        starts: ``[batch]``, where each row's completion starts (its prompt length).
        width: completion positions to return (longer rows are cut, shorter ones padded).

    Returns:
        ``[batch, width]``; positions past a row's completion hold junk, mask them.
    """
    logits = model(input_ids=input_ids, attention_mask=attention).logits  # [batch, seq, vocab]
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    # The token at position t is predicted by the logits at t - 1.
    positions = starts[:, None] + torch.arange(width, device=input_ids.device)  # [batch, width]
    positions = positions.clamp(max=input_ids.shape[1] - 1)
    targets = input_ids.gather(1, positions)  # [batch, width]
    predicted_at = logprobs.gather(
        1, (positions - 1)[:, :, None].expand(-1, -1, logprobs.shape[-1])
    )
    return predicted_at.gather(-1, targets[:, :, None]).squeeze(-1)
