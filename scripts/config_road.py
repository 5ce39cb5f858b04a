"""The road of ``streamrl fit``'s config, measured: the package's functions the config passes
through on a tiny real run, in call order, by file, and the objects it ends in (issue 46).

It runs ``streamrl fit`` in this process on the test-size policy (one iteration, one generator)
under ``sys.setprofile``. A *stop* is a call of a ``streamrl`` function while the command line
and its files are read into a ``RunConfig`` (``parse_fit``), or a call its caller hands the
config, one of its own sections (``RLConfig``, ``TrainerConfig``...) or a mapping or list the
config holds (by identity: a number or string handed on is not followed). A section that holds a
component's arguments (``LoRASpec``, ``OffPolicyCorrection``, ``WeightPath``) is an object the
config builds: its construction, and each call handed it (the component taking its arguments),
is an *end* of the road, listed apart. An object's own methods (``self``, ``cls``) are neither:
it was handed to them already. A *climb back* is a stop in a module already on the call stack
below the module calling it (the road left it, and comes back). Processes the run starts
(generator instances, reward workers) receive built objects, not the config, so the trainer's
process is the whole road.

    .venv/bin/python scripts/config_road.py            # a table, then one JSON line
    .venv/bin/python scripts/config_road.py --calls    # every stop, in order
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import threading
import typing
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "streamrl"

#: Calls that are not stops: a lazy export's lookup, and code inside an expression.
NOT_STOPS = ("__getattr__", "<lambda>", "<listcomp>", "<setcomp>", "<dictcomp>", "<genexpr>")
CONSTRUCTORS = ("__init__", "__post_init__")


def config_types() -> tuple[tuple[type, ...], tuple[type, ...]]:
    """The config's own sections, and the components' arguments its sections hold."""
    from streamrl.run import config as config_module
    from streamrl.run.config_file import section_class

    own = [
        cls
        for cls in vars(config_module).values()
        if isinstance(cls, type)
        and dataclasses.is_dataclass(cls)
        and cls.__module__ == config_module.__name__
    ]
    held = {
        section_class(hint)
        for cls in own
        for hint in typing.get_type_hints(cls).values()
        if section_class(hint) is not None and section_class(hint) not in own
    }
    return tuple(own), tuple(held)


def follow(argv: list[str]) -> tuple[list[tuple[str, str, bool]], list[tuple[str, str]]]:
    """The stops, ``(file relative to streamrl/, function, climbs back)``, and the ends,
    ``(file, function)``, in call order."""
    from streamrl.cli.main import main

    own, held = config_types()
    stops: list[tuple[str, str, bool]] = []
    ends: list[tuple[str, str]] = []
    root = str(PACKAGE) + "/"
    parsing = []  # the frame of parse_fit while the command line is read
    values: set[int] = set()  # the config's mappings and lists, once read (by identity)

    def profile(frame, event, arg):
        code = frame.f_code
        if not code.co_filename.startswith(root):
            return
        if event == "return" and parsing and frame is parsing[0]:
            parsing.clear()
            values.update(_containers(arg.config))
        if event != "call" or code.co_name in NOT_STOPS or _building(frame.f_back, held, root):
            return
        if code.co_name == "parse_fit" and not parsing:
            parsing.append(frame)
        where = (code.co_filename[len(root) :], code.co_qualname)
        names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        args = [frame.f_locals.get(n) for n in names if n not in ("self", "cls")]
        if _building(frame, held, root) or any(isinstance(a, held) for a in args):
            ends.append(where)
        elif parsing or any(isinstance(a, own) or id(a) in values for a in args):
            stops.append((*where, _climbs(frame, root)))

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        code = main(argv)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    if code != 0:
        raise SystemExit(f"streamrl fit exited with {code}")
    return stops, ends


def _building(frame, held: tuple[type, ...], root: str) -> bool:
    """Whether ``frame`` or one below it, in the package, constructs a component's arguments
    object."""
    while frame is not None:
        code = frame.f_code
        in_package = code.co_filename.startswith(root)
        if (
            in_package
            and code.co_name in CONSTRUCTORS
            and isinstance(frame.f_locals.get("self"), held)
        ):
            return True
        frame = frame.f_back
    return False


def _containers(value: object) -> set[int]:
    """The ids of every mapping and list the config holds (a swappable part's ``init_args``,
    ``rl.reward_pool``...), so that one handed on is followed too; numbers and strings cannot
    be told apart from equal ones elsewhere, so they are not."""
    if dataclasses.is_dataclass(value):
        found = set()
        for field in dataclasses.fields(value):
            found |= _containers(getattr(value, field.name))
        return found
    if isinstance(value, dict):
        return {id(value)}.union(*(_containers(v) for v in value.values()))
    if isinstance(value, (list, tuple)) and value:
        return {id(value)}.union(*(_containers(v) for v in value))
    return set()


def _climbs(frame, root: str) -> bool:
    """Whether ``frame``'s file is on the stack below its caller's (another) file."""
    files = []
    caller = frame.f_back
    while caller is not None:
        if caller.f_code.co_filename.startswith(root):
            files.append(caller.f_code.co_filename)
        caller = caller.f_back
    here = frame.f_code.co_filename
    below = [f for f in files if f != here]  # the caller's file first
    return bool(below) and here in files[files.index(below[0]) :]


def road(calls: list[tuple[str, str, bool]], ends: list[tuple[str, str]] = ()) -> dict:
    """The files in first-visit order, calls per file, folders, the climbs back, and the files
    the road ends in."""
    order: list[str] = []
    per_file: dict[str, int] = {}
    climbs: list[str] = []
    for where, function, climbs_back in calls:
        per_file[where] = per_file.get(where, 0) + 1
        if where not in order:
            order.append(where)
        if climbs_back:
            climbs.append(f"{where}: {function}")
    folders = sorted({str(Path(f).parent) for f in order})
    return {
        "files": len(order),
        "folders": len(folders),
        "calls": len(calls),
        "climbs_back": len(climbs),
        "road": [{"file": f, "calls": per_file[f]} for f in order],
        "folder_list": folders,
        "ends": sorted({f"{where}: {function}" for where, function in ends}),
        "climbs": climbs,
    }


def tiny_config(out: Path) -> Path:
    """The test suite's smallest real run, written as a user writes a config file: test-size
    policy, one iteration, one generator."""
    path = out / "road.yaml"
    path.write_text(
        f"output_dir: {out / 'run'}\n"
        f"cache_dir: {out / 'cache'}\n"
        "data: {tasks: [copy], n_train: 16, n_heldout: 4, median_len: 3, max_len: 6}\n"
        "sft: {model_size: test, steps: 5}\n"
        "rl:\n"
        "  iterations: 1\n"
        "  prompts_per_iteration: 2\n"
        "  group_size: 2\n"
        "  rollouts: {max_tokens: 8}\n"
        "  generation: {num_instances: 1}\n"
    )
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", action="store_true", help="print every call, in order")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        config = tiny_config(Path(tmp))
        calls, ends = follow(["fit", "--config", str(config), "--no-progress"])
    found = road(calls, ends)
    if options.calls:
        for where, function, climbs_back in calls:
            print(f"  {where}: {function}" + (" (climbs back)" * climbs_back), file=sys.stderr)
    print("| # | file | calls |", file=sys.stderr)
    print("|---|---|---|", file=sys.stderr)
    for i, stop in enumerate(found["road"], 1):
        print(f"| {i} | `{stop['file']}` | {stop['calls']} |", file=sys.stderr)
    for end in found["ends"]:
        print(f"end: {end}", file=sys.stderr)
    for climb in found["climbs"]:
        print(f"climb back: {climb}", file=sys.stderr)
    print(json.dumps({k: v for k, v in found.items() if k != "climbs"}))


if __name__ == "__main__":
    main()
