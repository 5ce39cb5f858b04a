"""The body of one generator instance process of the stream generation service (StreamRL §3).

It loads the policy, then loops: take requests and weight updates from its inbox, run one
continuous-batching step, push every finished sample to the shared outbox at once. Messages are
plain tuples of picklable values; samples hold lists, never tensors.

Inbox:  ``("submit", [Request, ...])``, ``("update", version)``, ``("fingerprint",)``,
``("stop",)``.
Outbox: ``("ready", instance_id, pid)``, ``("sample", Sample)``, ``("updated", instance_id,
version)``, ``("fingerprint", instance_id, hex)``, ``("error", instance_id, traceback_text)``.
"""

from __future__ import annotations

import hashlib
import os
import queue
import signal
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

#: How often an idle or blocked worker checks that its parent is still alive.
POLL_S = 0.5


@dataclass
class WorkerSpec:
    """What a generator instance process needs to start (sent to it at spawn)."""

    instance_id: int
    model_dir: str
    store_port: int
    world_size: int
    generator_kwargs: dict[str, Any] = field(default_factory=dict)
    weight_version: int = 0
    timeout_s: float = 120.0


def worker_main(spec: WorkerSpec, inbox: Any, outbox: Any) -> None:
    """Run one generator instance until told to stop or its parent dies."""
    # Ctrl-C goes to the whole process group; the parent decides and stops us cleanly.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    parent = os.getppid()
    try:
        from streamrl.components.hf_generator import HFStreamGenerator
        from streamrl.components.weight_transport import WeightGroup
        from streamrl.models import load_policy

        model, _ = load_policy(spec.model_dir)
        generator = HFStreamGenerator(
            model, instance_id=spec.instance_id, weight_version=spec.weight_version,
            **spec.generator_kwargs,
        )  # fmt: skip
        outbox.put(("ready", spec.instance_id, os.getpid()))
        group = WeightGroup(
            spec.store_port, 1 + spec.instance_id, spec.world_size, timeout_s=spec.timeout_s
        )
        params = dict(model.named_parameters())
        while os.getppid() == parent:
            message = _next_message(inbox, block=generator.idle)
            if message is not None:
                kind = message[0]
                if kind == "stop":
                    return
                if kind == "submit":
                    generator.submit(message[1])
                elif kind == "fingerprint":
                    _put(outbox, ("fingerprint", spec.instance_id, fingerprint(model)), parent)
                elif kind == "update":
                    buffers = {name: torch.empty_like(p) for name, p in params.items()}
                    group.broadcast(buffers.values())
                    generator.load_weights(buffers, message[1])
                    _put(outbox, ("updated", spec.instance_id, message[1]), parent)
                continue  # drain the inbox before decoding: requests join this step's batch
            for sample in generator.step():
                _put(outbox, ("sample", sample), parent)
    except BaseException:  # report everything, including SystemExit from a broken import
        _put(outbox, ("error", spec.instance_id, traceback.format_exc()), parent)


def fingerprint(model: torch.nn.Module) -> str:
    """A hash of every parameter's bytes: equal fingerprints mean equal weights."""
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        digest.update(name.encode())
        digest.update(param.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _next_message(inbox: Any, block: bool) -> tuple | None:
    try:
        return inbox.get(timeout=POLL_S) if block else inbox.get_nowait()
    except queue.Empty:
        return None


def _put(outbox: Any, item: tuple, parent: int) -> None:
    # The outbox is bounded (back-pressure): wait while the trainer catches up, but give up
    # once the parent is gone so an orphan never blocks forever.
    while os.getppid() == parent:
        try:
            outbox.put(item, timeout=POLL_S)
            return
        except queue.Full:
            continue
