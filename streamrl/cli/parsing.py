"""Every ``streamrl`` command but ``fit`` on ``jsonargparse``, as ``fit`` is: a command's options
are the fields of one typed dataclass, its help their descriptions (the ``Attributes:`` of the
class docstring); ``--config FILE`` reads any of them from YAML and ``--print_config`` writes them
out, the later option winning.

Spellings kept from the ``argparse`` days: ``--gen-gpus`` is ``--gen_gpus`` (a dash in an option's
name is read as an underscore), a yes/no option alone (``--no-skew``) means ``true``, and a
command may take a positional (``streamrl timeline TRACE``) and short options (``-o``).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import jsonargparse

_BOOLEAN_VALUES = {"true", "false", "yes", "no", "1", "0", "null"}


@dataclasses.dataclass(frozen=True)
class Command:
    """One leaf command: the dataclass of its options and the function that runs it.

    Attributes:
        help: one line for ``streamrl --help``'s list of commands.
        options: a dataclass; one option per field.
        run: takes an ``options`` instance and returns the JSON-ready result.
        positional: the field a bare argument sets (``streamrl timeline TRACE``), if any.
        short: short options and the field each spells, e.g. ``{"-o": "output"}``.
    """

    help: str
    options: type
    run: Callable[[Any], dict]
    positional: str | None = None
    short: dict[str, str] = dataclasses.field(default_factory=dict)


def command_parser(command: Command, prog: str) -> jsonargparse.ArgumentParser:
    """``command``'s parser: ``--config`` files, ``--print_config`` and one option per field."""
    from jsonargparse import ActionConfigFile, ArgumentParser

    parser = ArgumentParser(prog=prog, description=command.help, default_env=False)
    parser.add_argument(
        "--config",
        action=ActionConfigFile,
        help="YAML file of options (any subset of --print_config's); may be given several times",
    )
    parser.add_class_arguments(command.options, fail_untyped=True)
    return parser


def normalize_argv(argv: Sequence[str], command: Command) -> list[str]:
    """``argv`` in ``jsonargparse``'s spelling: ``--gen-gpus 2`` -> ``--gen_gpus 2``, a bare
    ``--no-skew`` -> ``--no_skew true``, ``-o F`` -> ``--output F``, ``TRACE`` -> ``--trace
    TRACE``."""
    flags = _boolean_fields(command.options)
    out: list[str] = []
    tokens = list(argv)
    while tokens:
        token = tokens.pop(0)
        if token in command.short:
            token = "--" + command.short[token]
        if not token.startswith("--"):
            out += [f"--{command.positional}", token] if command.positional else [token]
            continue
        name, eq, value = token[2:].partition("=")
        name = name.replace("-", "_")
        out.append(f"--{name}{eq}{value}")
        if eq:
            continue
        if name in flags and (not tokens or tokens[0].lower() not in _BOOLEAN_VALUES):
            out.append("true")
        elif tokens and name not in ("help", "print_config"):
            out.append(tokens.pop(0))  # the option's value, even one that starts with "-"
    return out


def options_from(values: Any, command: Command) -> Any:
    """The ``command.options`` instance from its parsed ``jsonargparse`` namespace."""
    names = [field.name for field in dataclasses.fields(command.options)]
    return command.options(**{name: values[name] for name in names})


def _boolean_fields(cls: type) -> set[str]:
    hints = typing.get_type_hints(cls)
    return {name for name, hint in hints.items() if hint is bool}
