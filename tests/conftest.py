"""Test-wide settings: caches in temporary directories, one torch thread, marker skips."""

from __future__ import annotations

import importlib.util
import os
import tempfile

import pytest

_CACHE_ROOT = tempfile.mkdtemp(prefix="streamrl-test-cache-")
# Point every cache at a temporary directory before the libraries are imported.
for var, sub in [("HF_HOME", "hf"), ("HF_DATASETS_CACHE", "datasets"),
                 ("STREAMRL_CACHE", "streamrl"), ("MPLCONFIGDIR", "mpl")]:  # fmt: skip
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
    from streamrl.models import build_tokenizer

    return build_tokenizer()


@pytest.fixture
def tiny_model(tokenizer):
    from streamrl.models import build_tiny_model

    return build_tiny_model(tokenizer, size="test", seed=0)
