"""Config loading and the checks that run before any work starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from streamrl.config import RunConfig, load_config
from streamrl.errors import ConfigError
from streamrl.prepare import prepare_run

REPO = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_demo_yaml_is_the_demo_default():
    assert load_config(REPO / "configs" / "demo.yaml") == RunConfig()


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_invalid_yaml(tmp_path):
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "data: [unclosed"))


def test_unknown_key_did_you_mean(tmp_path):
    with pytest.raises(ConfigError, match="Unknown key 'sed' \\(did you mean 'seed'\\?\\)"):
        load_config(write(tmp_path, "sed: 3\n"))
    with pytest.raises(ConfigError, match=r"data: Unknown key 'n_trian'.*'n_train'"):
        load_config(write(tmp_path, "data:\n  n_trian: 3\n"))


def test_wrong_type(tmp_path):
    with pytest.raises(ConfigError, match=r"seed must be of type int"):
        load_config(write(tmp_path, "seed: three\n"))
    assert load_config(write(tmp_path, "data:\n  tail: 1\n")).data.tail == 1.0


def test_unknown_task(tmp_path):
    with pytest.raises(ConfigError, match="Unknown task 'sorted' \\(did you mean 'sort'\\?\\)"):
        load_config(write(tmp_path, "data:\n  tasks: [copy, sorted]\n"))


def test_empty_prompt_set(tmp_path):
    with pytest.raises(ConfigError, match="empty prompt set"):
        load_config(write(tmp_path, "data:\n  n_train: 0\n"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    config = RunConfig()
    config.data.prompt_file = str(empty)
    with pytest.raises(ConfigError, match="no rows"):
        prepare_run(config)


def test_missing_model_directory(tmp_path):
    config = RunConfig(model=str(tmp_path / "no-model"))
    with pytest.raises(ConfigError, match="neither 'tiny' nor a model directory"):
        prepare_run(config)


def test_prompt_longer_than_context(tmp_path):
    rows = [{"prompt": "copy ab=", "answer": "ab"}] * 3
    rows.append({"prompt_id": "too-long", "prompt": "copy " + "a" * 300 + "=", "answer": "a"})
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(r if "prompt_id" in r else {**r, "prompt_id": f"q{i}"})
                              for i, r in enumerate(rows)))  # fmt: skip
    config = RunConfig()
    config.data.prompt_file = str(path)
    config.data.n_heldout = 1
    with pytest.raises(ConfigError, match="Prompt 'too-long' needs 306 prompt"):
        prepare_run(config)
