"""``streamrl simulate``, ``streamrl plan resources`` / ``plan memory`` and ``streamrl sim
validate``: the options and the functions that run them are ``streamrl.sim.commands``' and
``streamrl.run.memory_checks``'."""

from __future__ import annotations

from streamrl.cli.parsing import Command
from streamrl.run.memory_checks import MemoryPlanOptions, run_memory_plan
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
}

#: ``streamrl plan ...``: plans made before a run (``streamrl plan`` alone is ``plan resources``).
PLAN_COMMANDS = {
    "resources": Command(
        "split GPUs between generation and training (Alg. 1)", PlanOptions, run_plan
    ),
    "memory": Command(
        "each trainer and generator GPU's memory for a model and settings",
        MemoryPlanOptions,
        run_memory_plan,
    ),
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
