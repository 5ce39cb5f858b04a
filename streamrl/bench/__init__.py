"""Benchmarks behind ``streamrl bench ...``: medians over repeats, baseline in the same run."""

from __future__ import annotations

from pathlib import Path

#: Built-in random-init models a benchmark can name instead of a directory.
BUILT_IN = {"tiny": "demo", "qwen2-0.5b": "0.5b"}


def model_dir_for(model: str, scratch: Path, seed: int = 0) -> Path:
    """The model directory a benchmark runs: ``model`` itself, or a random-init built-in model
    saved under ``scratch``: ``"tiny"`` (the ~1M-parameter demo shape) or ``"qwen2-0.5b"``
    (Qwen2.5-0.5B's shapes, for GPU runs)."""
    if model not in BUILT_IN:
        return Path(model)
    from streamrl.models import build_tiny_model, build_tokenizer, save_policy

    tokenizer = build_tokenizer()
    context = 256 if model == "tiny" else 4096
    built = build_tiny_model(tokenizer, BUILT_IN[model], max_positions=context, seed=seed)
    return save_policy(built, tokenizer, scratch / model)
