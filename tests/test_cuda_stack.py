"""scripts/cuda_stack.py: the CUDA major of each resolved package, and a stack that mixes majors
refused (the CI step resolves the real extras; here, reports written by hand)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from cuda_stack import cuda_major, matrix


def _report(*packages: tuple[str, str]) -> dict:
    return {"install": [{"metadata": {"name": n, "version": v}} for n, v in packages]}


def test_one_major_passes_and_names_what_it_read():
    found = matrix(
        _report(
            ("torch", "2.13.0"),
            ("nvidia-nccl-cu13", "2.29.7"),
            ("cupy-cuda13x", "14.2.0"),
            ("nvidia-cutlass-dsl-libs-cu12", "4.8.0"),  # ignored, with its reason
            ("numpy", "2.5.2"),
        )
    )
    assert found["ok"] and list(found["majors"]) == ["13"]
    assert found["ignored"] == ["nvidia-cutlass-dsl-libs-cu12==4.8.0"]


def test_cupy_for_cuda_12_beside_torch_for_cuda_13_is_refused():
    found = matrix(_report(("nvidia-cuda-runtime", "13.0.96"), ("cupy-cuda12x", "14.2.0")))
    assert not found["ok"]
    assert found["majors"] == {
        "12": ["cupy-cuda12x==14.2.0"],
        "13": ["nvidia-cuda-runtime==13.0.96"],
    }


def test_torchs_local_version_says_its_cuda():
    assert cuda_major("torch", "2.11.0+cu130") == 13
    assert cuda_major("torch", "2.13.0+cpu") is None
