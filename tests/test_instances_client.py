"""InstancesClient: vLLM's four weight-sync calls on several instances, each with a timeout and
its own rank offset; a stuck or failing instance is named, never waited on forever."""

from __future__ import annotations

import threading
import time

import pytest

from streamrl.components.weights.instances_client import InstancesClient


class _Stuck:
    def __init__(self) -> None:
        self.release = threading.Event()

    def init_weight_transfer_engine(self, init_info):  # type: ignore[no-untyped-def]
        self.release.wait(30)

    start_weight_update = update_weights = finish_weight_update = init_weight_transfer_engine


class _Fails(_Stuck):
    def start_weight_update(self):  # type: ignore[no-untyped-def]
        raise ConnectionResetError("the instance's process is gone")


def test_a_stuck_or_failing_instance_fails_the_call_with_its_name_never_hangs():
    stuck = _Stuck()
    client = InstancesClient({"fine": _Fails(), "stuck-one": stuck}, timeout_s=0.5)
    stuck.release.set()
    with pytest.raises(RuntimeError, match="instance fine failed start_weight_update"):
        client.start_weight_update()
    stuck.release.clear()
    client = InstancesClient({"stuck-one": stuck}, timeout_s=0.5)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="instance stuck-one did not finish update_weights"):
        client.update_weights({})
    assert time.monotonic() - started < 5
    stuck.release.set()


def test_each_instance_gets_its_own_rank_offset():
    seen: dict[str, dict] = {}

    class Records(_Stuck):
        def __init__(self, name: str) -> None:
            super().__init__()
            self.name = name

        def init_weight_transfer_engine(self, init_info):  # type: ignore[no-untyped-def]
            seen[self.name] = init_info

    client = InstancesClient(
        {n: Records(n) for n in ("a", "b", "c")}, ranks={"a": 2, "c": 4}, timeout_s=5
    )
    client.init_weight_transfer_engine({"rank_offset": 1, "world_size": client.world_size})
    assert {n: i["rank_offset"] for n, i in seen.items()} == {"a": 1, "b": 3, "c": 4}
    assert client.world_size == 8
