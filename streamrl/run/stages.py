"""The headings a run prints as it goes: policy, evaluation, RL, evaluation, files written.

``streamrl fit`` and ``streamrl demo`` take minutes before their one JSON line; each stage says
what it does and, where known, how long it takes, on stderr (``streamrl.runtime.progress.Stages``).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from streamrl.runtime.progress import Stages

#: What each file of ``<output_dir>`` holds, in the order the list shows them.
OUTPUTS = {
    "summary.json": "the run's figures (also the JSON line on stdout)",
    "policy": "the trained policy, a Hugging Face model directory",
    "logs": "metrics per iteration (metrics.csv, or your logger's files)",
    "timeline.png": "what each generator and the trainer did, and when (trace.json: the data)",
    "eval.png": "held-out figures during training",
    "checkpoints": "Lightning checkpoints: --resume auto goes on from the last",
    "rollouts": "the trained samples, one Parquet file per iteration",
}


class RunStages(Stages):
    """The five stages of a run, ``[1/5]`` to ``[5/5]``; ``expected``: ``Stages``'."""

    NAMES = ("policy", "evaluation before", "rl", "evaluation after", "files")

    def __init__(self, expected: Mapping[str, str] | None = None) -> None:
        super().__init__(self.NAMES, expected)

    def evaluation(self, when: str, count: int, unit: str = "prompts") -> None:
        """``when``: ``"before"`` or ``"after"`` RL; ``count`` held-out ``unit``."""
        self.start(f"evaluation {when}", f"Held-out evaluation {when} RL: {count} {unit}")

    def result(self, summary: Mapping[str, Any]) -> None:
        """The run's result in one line a person reads (the JSON line follows on stdout)."""
        print(result_line(summary), file=sys.stderr)

    def files(self, output_dir: str | Path) -> None:
        out = Path(output_dir)
        self.start("files", f"Files written to {out}")
        for name, what in OUTPUTS.items():
            if (out / name).exists():
                print(f"  {name:<14} {what}", file=sys.stderr)


def result_line(summary: Mapping[str, Any]) -> str:
    """``Result: held-out reward 0.31 -> 0.58 (pass@1 25% -> 50%), 16 samples trained at 32.1
    samples/s; files in runs/x`` from a run's summary (what it has of it)."""
    parts = []
    before, after = summary.get("heldout_reward_before"), summary.get("heldout_reward_after")
    if before is not None and after is not None:
        parts.append(f"held-out reward {before:.3f} -> {after:.3f}")
        for key, name in (("pass1", "pass@1"), ("success", "success")):
            first, last = summary.get(f"heldout_{key}_before"), summary.get(f"heldout_{key}_after")
            if first is not None and last is not None:
                parts[-1] += f" ({name} {first:.0%} -> {last:.0%})"
    trained, rate = summary.get("samples_trained"), summary.get("samples_per_s")
    if trained is not None:
        parts.append(f"{trained} samples trained" + (f" at {rate:.1f} samples/s" if rate else ""))
    if summary.get("output_dir"):
        parts.append(f"files in {summary['output_dir']}")
    return "Result: " + (", ".join(parts) if parts else "no figures (see the JSON line)")
