"""What may take weights through vLLM's protocol (``protocol_feed``): vLLM instances, loading
between two steps; anything else is refused before an instance starts. And an instance's side
(``ProtocolReceiver``): an update cut short in a shared broadcast is awaited again."""

from __future__ import annotations

import time

import pytest

from streamrl.components.generation.engines import HFEngine, VLLMEngine
from streamrl.components.generation.messages import (
    ProtocolInit,
    ProtocolUpdate,
    Updated,
    WeightsLost,
)
from streamrl.components.generation.protocol_feed import check_weight_protocol
from streamrl.components.generation.protocol_receiver import ProtocolReceiver
from streamrl.components.generation.service import StreamGenerationService
from streamrl.components.weights.path import WeightPath
from streamrl.errors import ConfigError


def test_vllm_instances_loading_between_steps_may_use_the_protocol():
    check_weight_protocol(VLLMEngine(), "keep")
    check_weight_protocol(VLLMEngine(), "recompute")


def test_finish_keeps_the_host_staging():
    with pytest.raises(ConfigError, match="partial_rollout: keep"):
        check_weight_protocol(VLLMEngine(), "finish")


def test_hf_instances_are_refused_before_any_process_starts(tmp_path):
    with pytest.raises(ConfigError, match="needs vLLM instances"):
        check_weight_protocol(HFEngine(), "keep")
    with pytest.raises(ConfigError, match="needs vLLM instances"):
        StreamGenerationService(
            tmp_path, 1, weights=WeightPath(protocol=True), partial_rollout="keep"
        )


class FlakyGenerator:
    """vLLM's four calls on an instance whose first update is cut short (a peer of its shared
    broadcast died)."""

    def __init__(self) -> None:
        self.cut, self.loaded = True, []

    def init_weight_transfer_engine(self, init_info) -> None:  # type: ignore[no-untyped-def]
        pass

    def start_weight_update(self) -> None:
        pass

    def update_weights(self, update_info) -> None:  # type: ignore[no-untyped-def]
        if self.cut:
            self.cut = False
            raise RuntimeError("Connection closed by peer")

    def finish_weight_update(self, weight_version=None) -> None:  # type: ignore[no-untyped-def]
        self.loaded.append(int(weight_version))


def test_an_update_cut_short_in_a_shared_broadcast_is_awaited_again_not_reported():
    receiver = ProtocolReceiver(FlakyGenerator(), instance_id=3, policy="keep")
    assert receiver.handle(ProtocolInit(1, {"timeout_s": 10.0}, True)) is None
    assert receiver.handle(ProtocolUpdate(2, 1, {}, True)) is None  # no report: it waits
    assert receiver.waiting is not None and receiver.waiting[0] == 2
    assert receiver.overdue() is None  # not yet: three timeouts
    assert receiver.handle(ProtocolInit(1, {"timeout_s": 10.0}, False)) is None  # its own group
    assert receiver.handle(ProtocolUpdate(2, 1, {}, False)) == Updated(instance_id=3, version=2)
    assert receiver.waiting is None and receiver.generator.loaded == [2]


def test_a_version_not_sent_again_in_time_is_reported_lost():
    receiver = ProtocolReceiver(FlakyGenerator(), instance_id=3, policy="keep")
    receiver.handle(ProtocolInit(4, {"timeout_s": 0.01}, True))
    receiver.handle(ProtocolUpdate(7, 4, {}, True))
    time.sleep(0.05)
    lost = receiver.overdue()
    assert isinstance(lost, WeightsLost)
    assert (lost.instance_id, lost.version, lost.generation) == (3, 7, 4)
    assert "Connection closed by peer" in lost.reason and "not sent again" in lost.reason
    assert receiver.waiting is None


def test_an_update_cut_short_on_its_own_group_is_reported_at_once():
    receiver = ProtocolReceiver(FlakyGenerator(), instance_id=3, policy="keep")
    lost = receiver.handle(ProtocolUpdate(7, 4, {}, False))
    assert isinstance(lost, WeightsLost)
    assert (lost.instance_id, lost.version, lost.generation) == (3, 7, 4)
