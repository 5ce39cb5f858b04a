"""Weights from the trainer to generator instances over a torch.distributed group.

StreamRL §3 / §6: the trainer pushes new weights to the stream generation service after each
optimizer step. Here rank 0 is the sender (the trainer, or an instance that forwards what it
received) and the other ranks receive; every bucket is broadcast from rank 0 (gloo through host
memory on CPU, NCCL on GPUs). The group is
a standalone ``ProcessGroupGloo`` rather than the default group, so it never collides with the
group Lightning creates for a data-parallel trainer.

How a bucket crosses a link is a ``WeightTransport`` object (``streamrl.protocols``):
``GlooTransport`` (host memory, any device) or ``NcclTransport`` (GPU to GPU through CuPy); a
config names one in ``rl.weight_transport`` (``gloo``, ``bucketed``, ``nccl``, or
``package.module:Name``). Transports travel to every instance: keep them small and picklable.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, replace
from typing import Any, ClassVar, TypeVar

import torch
import torch.distributed as dist

from streamrl.components.weights.nccl import NcclCommunicator, import_nccl
from streamrl.protocols import WeightLink, WeightTransport
from streamrl.runtime.references import checked, resolve

#: Where a single-machine run's stores and groups listen: loopback only.
LOOPBACK = "127.0.0.1"
#: How long a rendezvous or a broadcast may wait for its peers before failing.
DEFAULT_TIMEOUT_S = 120.0
#: The store key holding an instance's current feed generation, or ``"closed"`` once it left.
FEED_KEY = "feed"
#: How often a rendezvous looks for its peers (and for a reason to give up).
RENDEZVOUS_POLL_S = 0.05

#: The longest the backend's own rendezvous may take once every member said it is here.
CONNECT_TIMEOUT_S = 30.0

Abandon = Callable[[], str | None]
T = TypeVar("T")


def set_feed(store: dist.Store, generation: int | None) -> None:
    """Record on an instance's store that its feed is now ``generation`` (``None``: it left):
    a member still meeting an older generation's group gives up at once (``WeightGroup``)."""
    store.set(FEED_KEY, "closed" if generation is None else str(generation))


def superseded(store: dist.Store, generation: int) -> str | None:
    """Why a group of feed ``generation`` on ``store`` will never meet, or ``None``."""
    if not store.check([FEED_KEY]):
        return None
    current = store.get(FEED_KEY).decode()
    if current == "closed":
        return "the instance left the service"
    if int(current) > generation:
        return f"the instance was fed anew (feed {current})"
    return None


def make_store(
    world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S, host: str = LOOPBACK
) -> dist.TCPStore:
    """The rendezvous store, hosted by the trainer on a free port of ``host`` only
    (``store.port``): loopback unless its members run on other machines (then the one address
    they reach it on). Given a host, ``TCPStore`` itself listens on every interface, so it is
    handed a socket bound to that one address."""
    listening = socket.create_server((host, 0), backlog=128)
    return dist.TCPStore(
        host,
        listening.getsockname()[1],
        world_size,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
        master_listen_fd=listening.detach(),  # the store owns the socket from now on
    )


def local_interfaces() -> dict[str, str]:
    """The environment that keeps a single-machine job's gloo and NCCL sockets on the loopback
    interface (torch's default group reads it), leaving out what the user set already."""
    names = [name for _, name in socket.if_nameindex() if name.startswith("lo")]
    if not names:
        return {}
    wanted = {"GLOO_SOCKET_IFNAME": names[0], "NCCL_SOCKET_IFNAME": names[0]}
    return {key: value for key, value in wanted.items() if key not in os.environ}


def is_loopback(host: str) -> bool:
    """Whether ``host`` is this machine's loopback address (a name resolving to one included)."""
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


@dataclass(frozen=True)
class GlooTransport:
    """Every bucket over gloo, through host memory: CPU tensors as they are, others by a host
    round trip. Runs everywhere."""

    needs_own_gpu: ClassVar[bool] = False
    #: The address this member's gloo pairs listen on (``None``: gloo's default, from the
    #: host name or ``GLOO_SOCKET_IFNAME``). ``WeightGroup`` sets loopback for a local group.
    bind: str | None = None

    def __str__(self) -> str:
        return "gloo"

    def check(self) -> None:
        """Nothing to check: gloo ships with torch."""

    def connect(
        self, store: dist.Store, rank: int, world_size: int, *, timeout_s: float, device: str
    ) -> WeightLink:
        # Every member is here, so the backend's own rendezvous is quick; its timeout only
        # bounds a peer that died in between (the broadcasts get the full one).
        connect = datetime.timedelta(seconds=min(timeout_s, CONNECT_TIMEOUT_S))
        if self.bind is None:
            group = dist.ProcessGroupGloo(store, rank, world_size, connect)
        else:
            options = dist.ProcessGroupGloo._Options()
            options._timeout = connect
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=self.bind)]
            group = dist.ProcessGroupGloo(store, rank, world_size, options)
        return _GlooLink(group, rank, datetime.timedelta(seconds=timeout_s))


@dataclass(frozen=True)
class NcclTransport:
    """Each bucket copied to the member's GPU and broadcast GPU to GPU through CuPy's NCCL, on
    a CUDA stream of its own, so it never waits for, or holds up, the training stream. The
    trainer and each instance need GPUs of their own (NCCL refuses two members on one)."""

    needs_own_gpu: ClassVar[bool] = True

    def __str__(self) -> str:
        return "nccl"

    def check(self) -> None:
        """CuPy and a GPU are there, or a ``ConfigError`` saying how to get them."""
        import_nccl()

    def connect(
        self, store: dist.Store, rank: int, world_size: int, *, timeout_s: float, device: str
    ) -> WeightLink:
        on = torch.device(device)
        return _NcclLink(
            NcclCommunicator.connect(store, rank, world_size), torch.cuda.Stream(on), on, rank
        )


#: Built-in transports by the name a config gives (``rl.weight_transport``); ``bucketed`` is
#: gloo's older name (every version travels in buckets either way).
TRANSPORTS: dict[str, type] = {
    "gloo": GlooTransport,
    "bucketed": GlooTransport,
    "nccl": NcclTransport,
}


def make_transport(
    value: str | WeightTransport, where: str = "weight_transport"
) -> WeightTransport:
    """The transport ``value`` names (a built-in or ``package.module:Name``, built with no
    argument), or ``value`` itself.

    Raises:
        ConfigError: an unknown name, or an object without the ``WeightTransport`` methods.
    """
    if isinstance(value, str):
        factory = resolve(value, kind="transport", builtins=TRANSPORTS, where=where)
        value = factory()
    return checked(value, WeightTransport, where)


class _GlooLink:
    def __init__(self, group: Any, rank: int, timeout: datetime.timedelta) -> None:
        self.group, self.rank, self.timeout = group, rank, timeout

    def broadcast(self, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        options.timeout = self.timeout
        # gloo needs contiguous CPU tensors; others take a host round trip here.
        buffer = tensor.detach()
        on_host = buffer.is_cuda or not buffer.is_contiguous()
        if on_host:
            buffer = buffer.cpu().contiguous()
        self.group.broadcast([buffer], options).wait()
        if on_host and self.rank != 0:
            tensor.copy_(buffer)


class _NcclLink:
    def __init__(
        self, nccl: NcclCommunicator, stream: Any, device: torch.device, rank: int
    ) -> None:
        self.nccl, self.stream, self.device, self.rank = nccl, stream, device, rank

    def broadcast(self, tensor: torch.Tensor) -> None:
        with torch.no_grad(), torch.cuda.stream(self.stream):
            flat = tensor.detach().reshape(-1)
            on_device = flat.to(self.device, non_blocking=True).contiguous()
            self.nccl.broadcast(on_device, root=0)  # on this stream; waits for it
            if self.rank != 0 and on_device.data_ptr() != flat.data_ptr():
                flat.copy_(on_device)
                self.stream.synchronize()


class WeightGroup:
    """One member of a weight broadcast group: rank 0 sends, the others receive.

    What travels is a list of flat buffers, the buckets of a ``StagedWeights`` (one collective
    call per bucket); any list of tensors works the same way.

    Args:
        port: the rendezvous store's port (``make_store(...).port`` on the trainer).
        rank: 0 for the sender (the trainer, or the instance feeding this one), 1.. for
            receivers.
        world_size: the members.
        store: the sender passes the store it hosts; members connect to ``port``.
        timeout_s: rendezvous and per-broadcast timeout; a silent peer raises instead of hanging.
        host: the store's address as members reach it (loopback by default; a Ray actor on
            another node needs the trainer node's IP).
        transport: how a bucket crosses (``GlooTransport``, ``NcclTransport``, yours), or
            its name (``"gloo"``, ``"bucketed"``, ``"nccl"``).
        device: where a member's NCCL copy of a bucket lives (its GPU).
        abandon: asked while the members gather, returns why to give up now (a peer process
            gone) or ``None``. A member also gives up once the store says its feed moved on
            (``set_feed``), so a dead peer costs a poll, not the whole timeout.
        generation: which feed of the store this is: a member fed anew connects again on the
            same store under a new generation.
        attempt: a group formed again within one feed (the same members, vLLM's protocol
            after a shared broadcast: ``protocol_feed``) meets under keys of its own.
    """

    def __init__(
        self,
        port: int,
        rank: int,
        world_size: int,
        store: dist.Store | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        host: str = "127.0.0.1",
        transport: str | WeightTransport = "gloo",
        device: str = "cuda",
        generation: int = 1,
        abandon: Abandon | None = None,
        attempt: int = 0,
    ) -> None:
        timeout = datetime.timedelta(seconds=timeout_s)
        if store is None:
            store = dist.TCPStore(host, port, world_size, False, timeout=timeout)
        self.rank, self.world_size = rank, world_size
        self.transport = make_transport(transport)
        # A group whose store is on loopback is local: its gloo pairs listen there only.
        where = getattr(store, "host", host) if store is not None else host
        if isinstance(self.transport, GlooTransport) and is_loopback(where):
            self.transport = replace(self.transport, bind=LOOPBACK)
        name = f"weights-{generation}" + (f".{attempt}" if attempt else "")
        prefix = dist.PrefixStore(name, store)

        def give_up() -> str | None:
            return superseded(store, generation) or (abandon() if abandon is not None else None)

        _gather(prefix, rank, world_size, generation, timeout_s, give_up)

        def connect() -> WeightLink:
            return self.transport.connect(
                prefix, rank, world_size, timeout_s=timeout_s, device=device
            )

        # gloo's pair connect, held by a peer that died once its address was out, retries past
        # the group's timeout (150 s measured): waited for on a thread, given up on ``abandon``.
        if abandon is not None and isinstance(self.transport, GlooTransport):
            self._link = finish_unless(connect, abandon, f"weight group (feed {generation})")
        else:
            self._link = connect()

    def broadcast(self, tensors: Iterable[torch.Tensor]) -> int:
        """Broadcast ``tensors`` in place from rank 0 (send there, receive elsewhere), one
        collective call each.

        Every member passes tensors of the same shapes and dtypes in the same order. Returns
        the bytes moved.
        """
        moved = 0
        for tensor in tensors:
            self._link.broadcast(tensor)
            moved += tensor.numel() * tensor.element_size()
        return moved


def _gather(
    prefix: dist.Store,
    rank: int,
    world_size: int,
    generation: int,
    timeout_s: float,
    give_up: Abandon,
) -> None:
    """Wait until every member of the group is here, giving up as soon as one never will.

    The backends' own rendezvous waits out its whole timeout for a peer that died before
    joining; this one polls, so the group is only built once all members are present.

    Raises:
        ConnectionAbortedError: ``give_up`` gave a reason (the feed moved on, a peer is gone).
        TimeoutError: a member did not come within ``timeout_s``.
    """
    prefix.set(f"present-{rank}", "1")
    others = [f"present-{r}" for r in range(world_size) if r != rank]
    deadline = time.monotonic() + timeout_s
    while True:  # asked at least once: a retry finds the keys of an attempt long given up
        reason = give_up()
        if reason is not None:
            raise ConnectionAbortedError(f"weight group (feed {generation}): {reason}")
        if prefix.check(others):
            return
        if time.monotonic() > deadline:
            missing = [k.removeprefix("present-") for k in others if not prefix.check([k])]
            raise TimeoutError(
                f"weight group (feed {generation}): rank(s) {', '.join(missing)} did not join "
                f"within {timeout_s:g} s."
            )
        time.sleep(RENDEZVOUS_POLL_S)


def finish_unless(work: Callable[[], T], give_up: Abandon, what: str) -> T:
    """``work()`` run on a thread of its own and waited for, asking ``give_up`` every
    ``RENDEZVOUS_POLL_S``; once it gives a reason this returns by raising, and the work is left
    to end on its own (its result dropped). For a backend's connect, whose retries ignore the
    timeouts given to it.

    Raises:
        ConnectionAbortedError: ``give_up`` gave a reason first (``what: reason``).
    """
    done: Future = Future()

    def run() -> None:
        try:
            done.set_result(work())
        except BaseException as err:  # raised on the waiting thread
            done.set_exception(err)

    threading.Thread(target=run, daemon=True, name=f"streamrl-{what}").start()
    while True:
        try:
            return done.result(timeout=RENDEZVOUS_POLL_S)
        except FutureTimeout:
            reason = give_up()
            if reason is not None:
                raise ConnectionAbortedError(f"{what}: {reason}") from None


class LazyGroup:
    """A sender's ``WeightGroup`` connected on first use (``connect``, or the first
    ``broadcast``), on whichever thread gets there: a member fed anew opens its side only once
    its receiving thread reaches the new feed."""

    def __init__(self, connect: Callable[[], WeightGroup]) -> None:
        self._connect, self._group = connect, None

    def connect(self) -> WeightGroup:
        if self._group is None:
            self._group = self._connect()
        return self._group

    def broadcast(self, tensors: Iterable[torch.Tensor]) -> int:
        return self.connect().broadcast(tensors)
