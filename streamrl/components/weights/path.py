"""How a weight version travels from the trainer to the generator instances (StreamRL §4.1: the
transfer overlapped with generation; §6: one copy per site): the transport each instance's group
moves tensors with, the buckets a version is cut into, the fan-out of the chain the instances pass
it along, vLLM's own weight-transfer protocol, and which versions every instance verifies.

A run's ``rl.weights`` section holds ``WeightPath``'s arguments; in Python,
``StreamGenerationService(model_dir, 2, weights=WeightPath(transport="nccl", fanout=2))``.

Examples:
    >>> WeightPath(bucket_mb=64).bucket_bytes
    67108864
    >>> WeightPath(transport="ncl")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    streamrl.errors.ConfigError: WeightPath: transport: Unknown transport 'ncl' (did you mean...
"""

from __future__ import annotations

from dataclasses import dataclass

from streamrl.components.weights.transport import WeightTransport, make_transport
from streamrl.errors import ConfigError

__all__ = ["WeightPath"]


@dataclass(frozen=True)
class WeightPath:
    """The road of every weight version to the instances (module docstring).

    Attributes:
        transport: how each instance's weight group moves tensors: ``"gloo"`` (host memory,
            the default; ``"bucketed"`` is its older name), ``"nccl"`` (GPU to GPU through
            CuPy), your ``package.module:Name``, or in Python a ``WeightTransport`` object
            (``streamrl.components.weights.transport``).
        bucket_mb: the largest bucket a version travels in, in MiB (``plan_buckets``): one
            buffer of that size is filled and sent while the next fills.
        fanout: instances each instance passes a version on to (1: a chain; 2: a binary
            tree); the trainer feeds one instance per site whatever the number.
        protocol: vLLM instances take each version through vLLM's weight-transfer protocol
            (its four calls, ``streamrl.components.generation.protocol_feed``; partial rollout
            ``keep`` or ``recompute``), fed by the trainer, without a host staging of their own.
        verify_every: which versions every instance checks against the trainer's checksums
            once loaded: ``None`` the first only, 0 none, N the first and every N-th; a
            mismatch stops the run naming the instance and the tensor.
    """

    transport: str | WeightTransport = "gloo"
    bucket_mb: float = 256.0
    fanout: int = 1
    protocol: bool = False
    verify_every: int | None = None

    def __post_init__(self) -> None:
        if not self.bucket_mb > 0 or self.fanout < 1 or (self.verify_every or 0) < 0:
            raise ConfigError(
                "WeightPath: need bucket_mb > 0, fanout >= 1 and verify_every null (the first "
                f"version), 0 (none) or N >= 1; got bucket_mb={float(self.bucket_mb)}, "
                f"fanout={self.fanout}, verify_every={self.verify_every}."
            )
        make_transport(self.transport, where="WeightPath: transport")  # an unknown name fails

    @property
    def bucket_bytes(self) -> int:
        """``bucket_mb`` in bytes."""
        return int(self.bucket_mb * 2**20)

    def make_transport(self) -> WeightTransport:
        """The transport object (a name is built with no argument)."""
        return make_transport(self.transport, where="transport")
