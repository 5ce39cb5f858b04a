"""The jobs behind ``streamrl fit`` and ``streamrl demo``: plain functions a notebook can call."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from streamrl.config import RunConfig
from streamrl.evaluation import evaluate
from streamrl.models import load_policy
from streamrl.prepare import ensure_policy, prepare_run


def run_fit(config: RunConfig, show_progress: bool = True) -> dict:
    """Check the inputs, warm-start the policy (cached) and evaluate it on held-out prompts.

    Returns:
        The run's summary (also written to ``<output_dir>/summary.json``): held-out greedy
        accuracy and the output-length distribution of the starting policy.
    """
    started = time.perf_counter()
    torch.manual_seed(config.seed)
    run = prepare_run(config)  # every input check happens here, before any training
    model_dir = ensure_policy(config, run, show_progress=show_progress)
    model, tokenizer = load_policy(model_dir)
    before = evaluate(model, tokenizer, run.heldout)
    summary = {
        "model_dir": str(model_dir),
        "n_train": len(run.train),
        "n_heldout": len(run.heldout),
        "heldout_acc_before": before.accuracy,
        "heldout_partial_before": before.partial,
        "length_median": before.length_median,
        "length_p90": before.length_p90,
        "length_max": before.length_max,
        "length_corr": before.length_corr,
        "accuracy_by_task": before.accuracy_by_task,
        "wall_s": time.perf_counter() - started,
    }
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
