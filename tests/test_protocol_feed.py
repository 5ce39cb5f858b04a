"""What may take weights through vLLM's protocol (``protocol_feed``): vLLM instances, loading
between two steps; anything else is refused before an instance starts."""

from __future__ import annotations

import pytest

from streamrl.components.generation.engines import HFEngine, VLLMEngine
from streamrl.components.generation.protocol_feed import check_weight_protocol
from streamrl.components.generation.service import StreamGenerationService
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
        StreamGenerationService(tmp_path, 1, weight_protocol=True, partial_rollout="keep")
