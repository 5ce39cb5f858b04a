"""A Hugging Face model's weights, in and out, in place: ``copy_into`` (what a weight update
does on the HF engine, checked before anything is copied) and ``fingerprint`` (a hash that is
equal exactly when the weights are: the service compares each instance's with the trainer's).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import numpy as np
import torch

__all__ = ["WeightMap", "copy_into", "fingerprint"]

#: Parameter/buffer name -> new value, as a torch tensor or a numpy array.
WeightMap = Mapping[str, torch.Tensor | np.ndarray]


def copy_into(model: torch.nn.Module, state_dict: WeightMap) -> None:
    """Copy ``state_dict`` into ``model``'s tensors in place (their storage is kept).

    Keys are the model's ``state_dict`` names; a subset is allowed. Names and shapes are checked
    for every entry before anything is copied, so a bad entry leaves the model untouched.

    Raises:
        ValueError: a name the model does not have, or a shape it does not expect.
    """
    targets = model.state_dict(keep_vars=True)
    sources = {}
    for name, value in state_dict.items():
        if name not in targets:
            raise ValueError(f"load_weights: {name!r} is not a tensor of the model.")
        src = value if isinstance(value, torch.Tensor) else torch.from_numpy(np.array(value))
        if tuple(src.shape) != tuple(targets[name].shape):
            raise ValueError(
                f"load_weights: {name!r} has shape {tuple(src.shape)}, the model expects "
                f"{tuple(targets[name].shape)}."
            )
        sources[name] = src
    with torch.no_grad():
        for name, src in sources.items():
            targets[name].copy_(src)  # copy_ converts dtype/device and keeps the storage


def fingerprint(model: torch.nn.Module) -> str:
    """A hash of every parameter's bytes: equal fingerprints mean equal weights."""
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        digest.update(name.encode())
        raw = param.detach().cpu().contiguous().reshape(-1).view(torch.uint8)  # bf16 too
        digest.update(raw.numpy().tobytes())
    return digest.hexdigest()
