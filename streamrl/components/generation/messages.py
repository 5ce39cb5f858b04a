"""The messages between the stream generation service and its generator instances (StreamRL
§3): one typed record per kind, in each direction.

The service puts ``ServiceMessage`` s in an instance's inbox (``worker`` matches on their type);
an instance writes ``InstanceMessage`` s to its own pipe, which the service's pool reads
(``InstancePool.next_message``) and matches on. Each is a small frozen dataclass of picklable
values: samples and requests hold lists, never tensors. ``corrupt`` names a message an instance
must refuse (the service then replaces it and requeues its requests).

Examples:
    >>> message = Updated(instance_id=1, version=4)
    >>> match message:
    ...     case Updated(version=version):
    ...         print(f"instance {message.instance_id} loaded version {version}")
    instance 1 loaded version 4
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from streamrl.records import Request, Sample

# -- the service to an instance (its inbox) ----------------------------------------------------


@dataclass(frozen=True)
class Submit:
    """Requests to generate (each admitted once its weight version has arrived)."""

    requests: list[Request]


@dataclass(frozen=True)
class Limit:
    """The most sequences to decode at once (the dispatcher's batch limit, §5.3)."""

    batch_size: int


@dataclass(frozen=True)
class Update:
    """Receive weight version ``version`` on feed ``generation`` (in the background); ``verify``:
    report its checksums once loaded (``Digests``)."""

    version: int
    generation: int
    verify: bool = False


@dataclass(frozen=True)
class Refeed:
    """Weights now come from a new feeder, feed ``generation`` (``feeding``)."""

    generation: int


@dataclass(frozen=True)
class Relay:
    """Pass each version received on to instance ``member`` (listening on ``port``; ``first``:
    the first version it takes) on feed ``generation`` (``weight_relay``, §6)."""

    member: int
    port: int
    first: int
    generation: int


@dataclass(frozen=True)
class Unrelay:
    """Stop passing weights on to instance ``member``."""

    member: int


@dataclass(frozen=True)
class AskFingerprint:
    """Send the hash of the weights held (``Fingerprinted``)."""


@dataclass(frozen=True)
class Release:
    """Let these requests go (move ``move_id``): waiting ones as they are, running ones with their
    progress (``Released``)."""

    move_id: int
    keys: list[tuple]


@dataclass(frozen=True)
class AskStatus:
    """Report each running request's progress (``Running``) for query ``query_id``."""

    query_id: int


@dataclass(frozen=True)
class Reprioritize:
    """New predicted lengths of waiting requests, by key (the LPT order, §5.3)."""

    costs: dict[tuple, int]


@dataclass(frozen=True)
class ProtocolInit:
    """vLLM's weight-transfer protocol: join the trainer's group (``protocol_feed``)."""

    generation: int
    init_info: dict[str, Any]
    shared: bool


@dataclass(frozen=True)
class ProtocolUpdate:
    """vLLM's weight-transfer protocol: receive and load version ``version``."""

    version: int
    generation: int
    update_info: dict[str, Any]
    shared: bool


@dataclass(frozen=True)
class Stop:
    """Leave now."""


#: Every message the service sends an instance.
ServiceMessage = (
    Submit
    | Limit
    | Update
    | Refeed
    | Relay
    | Unrelay
    | AskFingerprint
    | Release
    | AskStatus
    | Reprioritize
    | ProtocolInit
    | ProtocolUpdate
    | Stop
)

#: The fields that must hold an ``int`` (a version, a feed, a port...), by record.
_INTEGERS = {
    Limit: ("batch_size",),
    Update: ("version", "generation"),
    Refeed: ("generation",),
    Relay: ("member", "port", "first", "generation"),
    Unrelay: ("member",),
    Release: ("move_id",),
    AskStatus: ("query_id",),
    ProtocolInit: ("generation",),
    ProtocolUpdate: ("version", "generation"),
}


def corrupt(message: object) -> bool:
    """Whether ``message`` is not a well-formed ``ServiceMessage`` (not one of them, or a version,
    feed or port that is not an ``int``).

    Examples:
        >>> corrupt(Update(3, 1)), corrupt(Update("3", 1)), corrupt(("update", 3, 1))
        (False, True, True)
    """
    if not isinstance(message, ServiceMessage):
        return True
    names = _INTEGERS.get(type(message), ())
    return not all(
        type(getattr(message, f.name)) is int for f in fields(message) if f.name in names
    )


# -- an instance to the service (its pipe) -----------------------------------------------------


@dataclass(frozen=True)
class Ready:
    """Started: the model is loaded (and ``PTL(BS)`` measured, §5.1, when asked for)."""

    instance_id: int
    pid: int
    #: The dtype its weights travel in (the engine's: ``bfloat16``, ``float32``...).
    wire_dtype: str
    #: Its measured latency model (``LatencyModel``'s fields: ``PTL(BS)`` and what context
    #: and prefill cost), or ``None``.
    latency: dict[str, Any] | None


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
