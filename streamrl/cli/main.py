"""The ``streamrl`` console script.

Every command prints progress on stderr and, as its last stdout line, one JSON object with its
results, so scripts and CI can read it with ``tail -n 1`` (``--print_config`` prints only YAML).

Every command reads its arguments with ``jsonargparse``, as ``LightningCLI`` does: any number of
``--config`` YAML files and an option per field, the later winning, and ``--print_config``.
``streamrl fit``'s fields are those of ``streamrl.run.config.RunConfig``, dotted by section
(``--rl.module.lr 3e-5``; ``streamrl.run.fit_args``), and its merged values then pass the same
checks as ``streamrl.run.config_file.load_config``. Every other command's options are the fields
of one dataclass, its help their descriptions (``streamrl.cli.parsing``): ``streamrl.cli.tools``
(demo, model, profile, timeline), ``streamrl.cli.bench`` and ``streamrl.cli.bench_cases``
(``streamrl bench ...``), ``streamrl.cli.sim`` (simulate, plan, ``sim validate``).
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from streamrl.cli.parsing import Command, command_parser, normalize_argv, options_from
from streamrl.errors import (
    ConfigError,
    EnvError,
    NonFiniteLossError,
    RewardError,
    TrainerRankError,
)
from streamrl.run.fit_args import (
    FitArgs,
    build_fit_parser,
    fit_version,
    parse_fit,
    print_fit_config,
)
from streamrl.runtime.quiet import quiet_libraries, quiet_lightning
from streamrl.runtime.references import add_search_dirs
from streamrl.runtime.stopping import Stopped, resume_hint, stop_on_signals
from streamrl.training.reward_signal import show_plainly

if TYPE_CHECKING:
    import jsonargparse

FIT_HELP = "train from the defaults, YAML configs and dotted overrides (--rl.module.lr 3e-5)"
#: The command groups' lines in ``streamrl --help``.
GROUP_HELP = {
    "bench": "measurements; the last stdout line is JSON",
    "sim": "simulator tools (validate against real runs)",
    "plan": "plans before a run: the GPU split (Alg. 1: resources), each GPU's memory",
    "config": "config files: migrate one of an earlier layout",
}
#: A group's command when none is named (``streamrl plan --budget 64`` is ``plan resources``).
GROUP_DEFAULT = {"plan": "resources"}
CommandTree = dict[str, "Command | CommandTree | None"]


def command_tree() -> CommandTree:
    """Every command by name, a group (``bench``, ``sim``) holding its own; ``fit`` (``None``)
    has its own parser, ``streamrl.run.fit_args.build_fit_parser``."""
    from streamrl.cli import bench, sim, tools

    return {
        "demo": tools.COMMANDS["demo"],
        "fit": None,
        "bench": bench.COMMANDS,
        "model": tools.COMMANDS["model"],
        "profile": tools.COMMANDS["profile"],
        "timeline": tools.COMMANDS["timeline"],
        **sim.COMMANDS,
        "plan": sim.PLAN_COMMANDS,
        "sim": sim.SIM_COMMANDS,
        "config": tools.CONFIG_COMMANDS,
    }


def build_parser() -> jsonargparse.ArgumentParser:
    """The ``jsonargparse`` parser of every command (``streamrl fit`` parses with its own,
    ``parse_fit``; this one lists it and shows its help)."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(
        prog="streamrl",
        description="Disaggregated, streaming RL post-training of LLMs (StreamRL).",
        default_env=False,
    )
    parser.add_argument("--version", action="version", version=f"streamrl {fit_version()}")
    _add_commands(parser, command_tree(), "streamrl")
    return parser


def _add_commands(parser: jsonargparse.ArgumentParser, tree: CommandTree, prog: str) -> None:
    from jsonargparse import ArgumentParser

    subcommands = parser.add_subcommands(required=True, dest="command")
    for name, entry in tree.items():
        if entry is None:
            subcommands.add_subcommand(name, build_fit_parser(), help=FIT_HELP)
        elif isinstance(entry, Command):
            child = command_parser(entry, f"{prog} {name}")
            subcommands.add_subcommand(name, child, help=entry.help)
        else:
            child = ArgumentParser(prog=f"{prog} {name}", default_env=False)
            subcommands.add_subcommand(name, child, help=GROUP_HELP[name])
            _add_commands(child, entry, f"{prog} {name}")  # after: jsonargparse adds in order


def parse_command(argv: Sequence[str]) -> tuple[str, Callable[[], dict]]:
    """A command other than ``fit``: its name (the first word) and its run, options bound.
    ``--help``, ``--print_config`` and a parse error exit (0, 0, 2), as ``argparse`` does."""
    entry: Command | CommandTree | None = command_tree()
    argv = list(argv)
    group = argv[0] if argv and argv[0] in GROUP_DEFAULT else None
    if group and not set(argv[1:2]) & {*entry[group], "-h", "--help"}:
        argv.insert(1, GROUP_DEFAULT[group])
    path: list[str] = []
    while isinstance(entry, dict) and len(path) < len(argv) and argv[len(path)] in entry:
        entry = entry[argv[len(path)]]
        path.append(argv[len(path)])
    rest = list(argv[len(path) :])
    if isinstance(entry, Command):
        rest = normalize_argv(rest, entry)
    values = build_parser().parse_args([*path, *rest])
    if not isinstance(entry, Command):  # parse_args exits first: a group without its command
        raise ConfigError(f"streamrl {' '.join(argv)}: name a command.")
    for name in path:
        values = values[name]
    return path[0], functools.partial(entry.run, options_from(values, entry))


def _cmd_fit(fit: FitArgs) -> dict:
    from streamrl.run.recipe import run_fit

    quiet_lightning(verbose=fit.verbose)
    # run_fit checks the values and the resume point first, once, before any work.
    return run_fit(fit.config, show_progress=not fit.no_progress, resume=fit.resume)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``streamrl`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["fit"]:
        command = "fit"
        try:
            fit = parse_fit(argv[1:])
        except ConfigError as err:
            print(f"streamrl fit: error: {err}", file=sys.stderr)
            return 2
        if fit.print_config is not None:
            print_fit_config(fit.config, fit.print_config)
            return 0
        func = functools.partial(_cmd_fit, fit)
        # Your own `module:Name` imports from here and beside each config file, as `python -m`.
        add_search_dirs([Path.cwd(), *(Path(f).parent for f in fit.config_files)])
    else:
        command, func = parse_command(argv)
        add_search_dirs([Path.cwd()])
    quiet_libraries()
    show_plainly()  # a run that cannot learn says so in one line of its own
    from streamrl.components.generation.service import GeneratorError

    try:
        with stop_on_signals():
            result = func()
    except Stopped as stop:  # SIGTERM or Ctrl-C: every child is stopped by now
        resume = resume_hint(fit.config.output_dir, argv) if command == "fit" else ""
        print(f"streamrl {command}: {stop}{resume}", file=sys.stderr)
        return stop.exit_code
    except TrainerRankError as err:  # stopped with every child: it goes on from a checkpoint
        resume = resume_hint(fit.config.output_dir, argv) if command == "fit" else ""
        print(f"streamrl {command}: stopped: {err}{resume}", file=sys.stderr)
        return 1
    except (ConfigError, FileNotFoundError) as err:  # bad input, found before any work
        print(f"streamrl {command}: error: {err}", file=sys.stderr)
        return 2
    except (RewardError, EnvError, GeneratorError, NonFiniteLossError) as err:  # cleaned up
        print(f"streamrl {command}: stopped: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"streamrl {command}: interrupted", file=sys.stderr)
        return 130
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
