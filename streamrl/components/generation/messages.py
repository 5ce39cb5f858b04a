"""What a generator instance tells the service (StreamRL §3): one typed record per kind of message.

An instance process (``worker``) writes these to its own pipe; the service's pool reads them
(``InstancePool.next_message``) and matches on their type. Each is a small frozen dataclass of
picklable values: samples and requests hold lists, never tensors.

Examples:
    >>> message = Updated(instance_id=1, version=4)
    >>> match message:
    ...     case Updated(version=version):
    ...         print(f"instance {message.instance_id} loaded version {version}")
    instance 1 loaded version 4
"""

from __future__ import annotations

from dataclasses import dataclass

from streamrl.records import Request, Sample


@dataclass(frozen=True)
class Ready:
    """Started: the model is loaded (and ``PTL(BS)`` measured, §5.1, when asked for)."""

    instance_id: int
    pid: int
    #: The dtype its weights travel in (the engine's: ``bfloat16``, ``float32``...).
    wire_dtype: str
    #: Its measured ``PTL(BS)`` as ``(batch sizes, seconds per token)``, or ``None``.
    latency: tuple[list[int], list[float]] | None


@dataclass(frozen=True)
class Finished:
    """A finished sample, pushed the moment it is done (§3's stream)."""

    sample: Sample

    @property
    def instance_id(self) -> int:
        return self.sample.instance_id


@dataclass(frozen=True)
class Heartbeat:
    """Alive (sent every ``heartbeat_s`` while it runs)."""

    instance_id: int


@dataclass(frozen=True)
class Updated:
    """Weight version ``version`` is loaded: requests bound to it may be admitted."""

    instance_id: int
    version: int


@dataclass(frozen=True)
class Digests:
    """The checksums of version ``version`` as loaded, by the trainer's tensor names (sent
    before ``Updated`` for a version the service checks)."""

    instance_id: int
    version: int
    digests: dict[str, str]


@dataclass(frozen=True)
class WeightsLost:
    """Version ``version`` did not arrive (broadcast ``generation``): the service decides whose
    fault it is, this instance's or its feeder's."""

    instance_id: int
    version: int
    generation: int
    reason: str


@dataclass(frozen=True)
class Fingerprinted:
    """The hash of the weights held, as asked (``StreamGenerationService.fingerprints``)."""

    instance_id: int
    digest: str


@dataclass(frozen=True)
class Released:
    """Requests that left this instance for another (move ``move_id``; running ones with their
    progress)."""

    instance_id: int
    move_id: int
    requests: list[Request]


@dataclass(frozen=True)
class Running:
    """The answer to status query ``query_id``: each running request's key and tokens generated,
    or ``None`` when its generator cannot move requests."""

    instance_id: int
    query_id: int
    running: list[tuple[tuple, int]] | None


@dataclass(frozen=True)
class Crashed:
    """It failed; ``traceback`` says where. It exits after sending this."""

    instance_id: int
    traceback: str


#: Every message an instance sends.
InstanceMessage = (
    Ready
    | Finished
    | Heartbeat
    | Updated
    | Digests
    | WeightsLost
    | Fingerprinted
    | Released
    | Running
    | Crashed
)
