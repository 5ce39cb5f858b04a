"""Benchmarks behind ``streamrl bench ...``: medians over repeats, baseline in the same run."""

from __future__ import annotations

from pathlib import Path


def model_dir_for(model: str, scratch: Path, seed: int = 0) -> Path:
    """The model directory a benchmark runs: ``model`` itself, or for ``"tiny"`` the ~1M-parameter
    random-init demo model saved under ``scratch``."""
    if model != "tiny":
        return Path(model)
    from streamrl.models import build_tiny_model, build_tokenizer, save_policy

    tokenizer = build_tokenizer()
    return save_policy(build_tiny_model(tokenizer, "demo", seed=seed), tokenizer, scratch / "tiny")
