"""``streamrl demo``: the main job on the embedded default, in two sizes.

``full`` is ``RunConfig()`` as it is (docs/demo.md has its figures); ``small`` is the same job,
shrunk to about two minutes: two of the four task families (``copy``, ``rev``), a shorter warm
start, fewer held-out prompts, half the iterations of half the prompts.
Each stage's heading says how long it takes on an idle 2-core machine (measured; the commands
are in docs/demo.md).
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field

from streamrl.run.config import RunConfig
from streamrl.run.recipe import run_fit
from streamrl.run.reruns import fresh_output_dir
from streamrl.run.stages import RunStages


@dataclass(frozen=True)
class DemoSize:
    """One size of the demo.

    Attributes:
        sft / data / rl: fields replaced in ``RunConfig()``'s sections.
        expected: each stage's length on an idle 2-core machine (``RunStages.NAMES``).
    """

    sft: dict = field(default_factory=dict)
    data: dict = field(default_factory=dict)
    rl: dict = field(default_factory=dict)
    expected: dict[str, str] = field(default_factory=dict)

    def config(self, output_dir: str) -> RunConfig:
        default = RunConfig()
        return dataclasses.replace(
            default,
            output_dir=output_dir,
            sft=dataclasses.replace(default.sft, **self.sft),
            data=dataclasses.replace(default.data, **self.data),
            rl=dataclasses.replace(default.rl, **self.rl),
        )


DEMO_SIZES = {
    "full": DemoSize(
        expected={
            "policy": "about 2.5 min on 2 CPU cores the first time, then cached",
            "evaluation before": "a few seconds",
            "rl": "about 1.5 min",
            "evaluation after": "a few seconds",
        }
    ),
    "small": DemoSize(
        sft={"steps": 1000},
        data={"tasks": ["copy", "rev"], "n_heldout": 128},
        rl={"iterations": 30, "prompts_per_iteration": 16},
        expected={
            "policy": "about 1.5 min on 2 CPU cores the first time, then cached",
            "evaluation before": "a few seconds",
            "rl": "about 30 s",
            "evaluation after": "a few seconds",
        },
    ),
}


def run_demo(size: str = "full", output_dir: str = "runs/demo", show_progress: bool = True) -> dict:
    """Run the demo of ``size`` (``DEMO_SIZES``) in a fresh directory beside ``output_dir``
    (``runs/demo``, then ``runs/demo-2``, ...); returns its summary (``run_fit``)."""
    demo = DEMO_SIZES[size]
    config = demo.config(str(fresh_output_dir(output_dir)))
    print(f"streamrl demo ({size}): writing to {config.output_dir}", file=sys.stderr, flush=True)
    return run_fit(config, show_progress=show_progress, stages=RunStages(demo.expected))
