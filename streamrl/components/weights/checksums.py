"""Checksums that catch a weight sync that moved nothing.

Weight syncs fail silently in 2026's RL stacks: vLLM's NCCL path is a no-op off CUDA (vLLM PR
#57022), a LoRA adapter never delivered reads as staleness for months (verl #7495). StreamRL §6's
transfer is only as good as the weights the instance then holds, so after a version the trainer's
digest of every tensor it sent is compared with the instance's digest of what it loaded
(``verify_digests``) and of what its model holds (``verify_applied``), name by name.

Examples:
    >>> sent = {"w": tensor_digest(torch.ones(2))}
    >>> verify_digests(sent, {"w": tensor_digest(torch.ones(2))}, "instance-0")
    >>> verify_digests(sent, {"w": tensor_digest(torch.zeros(2))}, "instance-0")
    Traceback (most recent call last):
    ...
    streamrl.components.weights.checksums.WeightMismatchError: Weight sync: instance instance-0 ...
"""

from __future__ import annotations

import hashlib

import torch

__all__ = ["WeightMismatchError", "tensor_digest", "verify_applied", "verify_digests"]


def tensor_digest(tensor: torch.Tensor) -> str:
    """A checksum of a tensor's bytes (blake2b, 16 bytes): equal on both ends of a transfer
    exactly when the same values in the same dtype arrived."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return hashlib.blake2b(flat.view(torch.uint8).numpy(), digest_size=16).hexdigest()


class WeightMismatchError(RuntimeError):
    """An instance holds other weights than the trainer sent (a transfer that moved nothing)."""


def verify_digests(sent: dict[str, str], loaded: dict[str, str], instance: str) -> None:
    """Raise ``WeightMismatchError`` naming ``instance`` and the first tensor whose digest
    differs from the trainer's (or that the instance never loaded)."""
    for name, digest in sent.items():
        if loaded.get(name) != digest:
            got = "nothing" if name not in loaded else f"digest {loaded[name]}"
            raise WeightMismatchError(
                f"Weight sync: instance {instance} holds other weights than the trainer sent: "
                f"first differing tensor {name!r} (sent digest {digest}, loaded {got}). The "
                "transfer moved nothing or the wrong bytes; check the weight-transfer backend "
                "(vLLM's nccl backend is a no-op off CUDA) and that the instance applied them."
            )


def verify_applied(sent: dict[str, str], applied: dict[str, str], instance: str) -> int:
    """Compare the digests an instance's weights give (``applied_digests``) with the trainer's
    for the same names; raise ``WeightMismatchError`` at the first that differs. Returns how
    many were compared."""
    common = {name: sent[name] for name in sent if name in applied}
    if not common:
        raise WeightMismatchError(
            f"Weight sync: instance {instance} reported no checksum of a tensor the trainer sent "
            f"({len(applied)} of its own); it cannot show which weights it holds."
        )
    verify_digests(common, applied, instance)
    return len(common)
