"""``streamrl plan memory`` and ``fit``'s memory refusals, with the devices faked (no GPU needed).

The estimate's terms are checked by hand on Qwen2.5-7B's shape; a config whose estimate exceeds
its GPU (or, for a one-file checkpoint of a sharded trainer, rank 0's host) is refused before any
work with one line naming the knob.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import streamrl.runtime.devices
from streamrl.cli.main import main
from streamrl.components.capacity.memory import GIB, ModelShape, lora_params, trainer_memory
from streamrl.errors import ConfigError
from streamrl.policy.lora import LoRASpec
from streamrl.policy.models import model_config
from streamrl.run.config import RunConfig
from streamrl.run.config_checks import placement_of
from streamrl.run.memory_checks import check_memory

REPO = Path(__file__).resolve().parents[1]
SEVEN_B = ModelShape.from_config(model_config("7b"))


@pytest.fixture
def devices(monkeypatch):
    """Fake the GPUs (``count`` of ``gib`` each) and the host's available memory."""

    def fake(count: int = 8, gib: float = 80.0, host_gib: float = 512.0) -> None:
        monkeypatch.setattr(streamrl.runtime.devices, "cuda_device_count", lambda: count)
        monkeypatch.setattr(streamrl.runtime.devices, "gpu_memory_bytes", lambda i: int(gib * GIB))
        monkeypatch.setattr(
            streamrl.runtime.devices, "host_memory_bytes", lambda: int(host_gib * GIB)
        )

    return fake


def test_the_7b_shape_and_its_terms_by_hand():
    # Qwen2.5-7B: 28 layers of 233,057,792 parameters, embeddings and head untied (152,064 x 3,584
    # each) and the final norm: 7,615,616,512 (the published 7.62B).
    assert SEVEN_B.layer_params == 233_057_792
    assert SEVEN_B.params == 28 * 233_057_792 + 2 * 152_064 * 3_584 + 3_584 == 7_615_616_512
    memory = trainer_memory(SEVEN_B, ranks=4, micro_batch_tokens=1000, reference=True)
    p = SEVEN_B.params
    assert (memory.weights, memory.gradients, memory.optimizer) == (4 * p // 4, p, 2 * p)
    assert memory.reference == 2 * p // 4  # bfloat16 shards
    # Per token: every layer's bfloat16 input (2 x 3,584 x 28 = 200,704 bytes) and one layer
    # recomputed, 2 x (7 x 3,584 + 3 x 512 + 4 x 18,944) = 204,800 bytes.
    assert memory.activations == 1000 * (200_704 + 204_800)
    without = trainer_memory(SEVEN_B, 4, 1000, activation_checkpointing=False)
    assert without.activations == 1000 * 28 * 204_800
    lora = trainer_memory(SEVEN_B, 4, 1000, lora_params=lora_params(SEVEN_B, 16), reference=True)
    assert lora.reference == 0 and lora.weights < memory.weights / 1.9  # a bfloat16 base
    # r x (in + out) per projection: q (3,584 + 3,584), k and v (3,584 + 512), o (3,584 + 3,584)
    assert lora_params(SEVEN_B, 16) == 16 * 28 * (2 * 7_168 + 2 * 4_096)


def test_plan_memory_prints_the_7b_presets_table(capsys):
    argv = ["plan", "memory", "--model", "7b", "--trainer-gpus", "4", "--max-tokens", "8192"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    result = json.loads(out.strip().splitlines()[-1])
    for line in ("per trainer GPU", "weights", "activations", "per generator GPU", "sequences"):
        assert line in err
    assert result["micro_batch_tokens"] == 512 + 8192
    assert result["trainer_gpu"]["total"] == sum(
        v for k, v in result["trainer_gpu"].items() if k != "total"
    )
    assert result["trainer_fits"] and result["generator_gpu"]["sequences"] > 64


def _shape_only(model: Path) -> Path:
    """A 7B model directory with its config and an empty weight file: the checks read no
    weight, but a directory without a weight file is refused (``check_model_dir``)."""
    model_config("7b").save_pretrained(model)
    (model / "model.safetensors").touch()
    return model


def _7b_config(tmp_path, **trainer) -> RunConfig:
    model = _shape_only(tmp_path / "qwen2.5-7b")
    config = RunConfig(model=str(model), output_dir=str(tmp_path / "out"))
    config.trainer.accelerator, config.trainer.devices = "cuda", [0, 1, 2, 3]
    config.rl.generation, config.rl.rollouts = {"gpus_per_instance": 1}, {"max_tokens": 8192}
    config.rl.micro_batches = {"max_tokens": 16384}
    for key, value in trainer.items():
        setattr(config.trainer, key, value)
    return config


def test_a_7b_run_that_fits_80gb_gpus_is_not_refused(devices, tmp_path):
    devices(gib=80.0)
    config = _7b_config(tmp_path)
    check_memory(config, placement_of(config))


def test_fit_refuses_a_trainer_gpu_too_small_before_any_work(devices, tmp_path, capsys):
    devices(gib=24.0)
    config = _7b_config(tmp_path)
    with pytest.raises(ConfigError, match=r"trainer: about .* GiB per GPU .* cuda:0 has 24.0 GiB"):
        check_memory(config, placement_of(config))
    # through the command line: one line, exit 2, nothing written
    path = tmp_path / "run.yaml"
    path.write_text(
        f"model: {config.model}\noutput_dir: {config.output_dir}\n"
        "rl: {generation: {gpus_per_instance: 1}, rollouts: {max_tokens: 8192},"
        " micro_batches: {max_tokens: 16384}}\n"
        "trainer: {accelerator: cuda, devices: [0, 1, 2, 3]}\n"
    )
    assert main(["fit", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "add trainer ranks (trainer.devices, now 4" in err[0], err
    assert not (tmp_path / "out").exists()


def test_the_knob_named_follows_the_largest_term(devices, tmp_path):
    devices(gib=40.0)
    config = _7b_config(tmp_path, activation_checkpointing=False)
    config.trainer.devices = [0, 1, 2, 3, 4, 5]
    config.rl.generation = {**config.rl.generation, "gpu_ids": [6, 7]}
    with pytest.raises(ConfigError, match=r"set trainer\.activation_checkpointing: true"):
        check_memory(config, placement_of(config))


def test_a_generator_gpu_that_cannot_hold_one_sequence_is_refused(devices, tmp_path):
    # 15.2 GB of bfloat16 weights and a 2 GiB reserve in 90% of 17 GiB leave no KV cache
    devices(gib=17.0)
    config = _7b_config(tmp_path, devices=[0, 1, 2, 3, 4, 5])
    config.rl.generation = {**config.rl.generation, "gpu_ids": [6, 7]}
    config.rl.lora = LoRASpec(r=8)  # a LoRA trainer fits 17 GiB
    with pytest.raises(ConfigError, match=r"generators: cuda:6 .* give each instance more GPUs"):
        check_memory(config, placement_of(config))


def test_a_one_file_checkpoint_too_big_for_rank_zeros_host_is_refused(devices, tmp_path):
    devices(gib=80.0, host_gib=64.0)  # 7.6B x 12 bytes = 85 GiB to gather
    config = _7b_config(tmp_path, sharded_checkpoints=False)
    with pytest.raises(ConfigError, match=r"about 85.1 GiB.*64.0 GiB available.*: true"):
        check_memory(config, placement_of(config))
    config.trainer.sharded_checkpoints = None  # several ranks: sharded by default
    check_memory(config, placement_of(config))


def test_the_7b_preset_needs_only_its_model_and_data_and_fits_80gb_gpus(devices, tmp_path):
    from streamrl.run.config_checks import check_values
    from streamrl.run.config_file import load_config

    model = _shape_only(tmp_path / "Qwen2.5-7B-Instruct")
    data = tmp_path / "train.jsonl"
    data.write_text("".join(f'{{"prompt": "q{i}", "answer": "{i}"}}\n' for i in range(200)))
    text = (REPO / "configs" / "qwen2.5-7b-1node.yaml").read_text()
    text = text.replace("/path/to/Qwen2.5-7B-Instruct", str(model))
    text = text.replace("/path/to/your/train.jsonl", str(data))
    path = tmp_path / "preset.yaml"
    path.write_text(text.replace("runs/qwen2.5-7b", str(tmp_path / "out")))
    devices(gib=80.0)
    config = load_config(path)
    check_values(config)  # the estimate fits: nothing refused
    placement = placement_of(config)
    assert placement.trainer_gpus == (0, 1, 2, 3) and placement.generator_gpus == (4, 5, 6, 7)
    devices(gib=40.0)
    with pytest.raises(ConfigError, match=r"trainer: about 47\.6 GiB per GPU"):
        check_values(config)
