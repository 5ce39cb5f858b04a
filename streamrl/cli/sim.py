"""``streamrl simulate``, ``streamrl plan`` and ``streamrl sim validate``: the options and the
functions that run them are ``streamrl.sim.commands``'."""

from __future__ import annotations

from streamrl.cli.parsing import Command
from streamrl.sim.commands import (
    PlanOptions,
    SimulateOptions,
    ValidateOptions,
    run_plan,
    run_simulate,
    run_validate,
)

COMMANDS = {
    "simulate": Command(
        "discrete-event simulation of a StreamRL run", SimulateOptions, run_simulate
    ),
    "plan": Command("split GPUs between generation and training (Alg. 1)", PlanOptions, run_plan),
}

#: ``streamrl sim ...``: simulator tools.
SIM_COMMANDS = {
    "validate": Command(
        "calibrate the simulator on one real bench pipeline run, then run and simulate other "
        "configurations and report the errors",
        ValidateOptions,
        run_validate,
    ),
}
