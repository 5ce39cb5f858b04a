"""Test-wide settings: caches in temporary directories, one torch thread, marker skips."""

from __future__ import annotations

import importlib.util
import os
import tempfile

import pytest

_CACHE_ROOT = tempfile.mkdtemp(prefix="streamrl-test-cache-")
# Point every cache at a temporary directory before the libraries are imported.
for var, sub in [
    ("HF_HOME", "hf"),
    ("HF_DATASETS_CACHE", "datasets"),
    ("STREAMRL_CACHE", "streamrl"),
    ("MPLCONFIGDIR", "mpl"),
]:
    os.environ[var] = os.path.join(_CACHE_ROOT, sub)
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import torch  # noqa: E402

torch.set_num_threads(1)


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def pytest_collection_modifyitems(config, items):
    skips = {
        "gpu": (not torch.cuda.is_available(), "needs a CUDA GPU"),
        "ray": (not _has("ray"), "needs ray: pip install -e '.[ray]'"),
        "vllm": (not _has("vllm"), "needs vllm: make test-vllm"),
    }
    for item in items:
        for marker, (skip, why) in skips.items():
            if skip and marker in item.keywords:
                item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture(scope="session")
def tokenizer():
    from streamrl.policy.models import build_tokenizer

    return build_tokenizer()


@pytest.fixture
def tiny_model(tokenizer):
    from streamrl.policy.models import build_tiny_model

    return build_tiny_model(tokenizer, size="test", seed=0)


@pytest.fixture
def fit_small(tmp_path, capsys):
    """``streamrl fit`` in this process on a tiny run (2 iterations x 4 prompts x 2 samples,
    output in ``tmp_path/<out>``, default ``out``); keyword arguments change the ``rl`` section,
    ``generation`` merges into one instance (``{num_instances: 1}``), ``model_size`` the
    warm-started policy, ``trainer`` the ``trainer`` section, ``args`` are
    more command-line arguments (e.g.
    ``["--resume", path]``), ``exit_code`` the code it must return. Returns the run's JSON
    summary (``{}`` for a run that stops), after checking every requested sample was trained."""
    import json

    import yaml

    from streamrl.cli.main import main

    def run(
        model_size: str = "test",
        tasks: tuple[str, ...] = ("copy", "count"),
        out: str = "out",
        args: tuple[str, ...] = (),
        trainer: dict | None = None,
        exit_code: int = 0,
        **rl,
    ) -> dict:
        config = tmp_path / f"{out}.yaml"
        rl = {
            "iterations": 2,
            "prompts_per_iteration": 4,
            "group_size": 2,
            "rollouts": {"max_tokens": 12},
            **rl,
            "generation": {"num_instances": 1, **rl.get("generation", {})},
        }
        config.write_text(
            yaml.safe_dump(
                {
                    "output_dir": str(tmp_path / out),
                    "data": {
                        "tasks": list(tasks),
                        "n_train": 32,
                        "n_heldout": 8,
                        "median_len": 3,
                        "max_len": 6,
                    },
                    "sft": {"model_size": model_size, "steps": 20},
                    "rl": rl,
                    "trainer": trainer or {},
                }
            )
        )
        assert main(["fit", "--config", str(config), "--no-progress", *args]) == exit_code
        if exit_code:  # stopped: no summary
            return {}
        summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        requested = rl["iterations"] * rl["prompts_per_iteration"] * rl["group_size"]
        assert summary["samples_trained"] == requested and summary["samples_lost"] == 0
        return summary

    return run
