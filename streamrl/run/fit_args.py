"""The ``streamrl fit`` command line: ``jsonargparse`` over ``streamrl.run.config.RunConfig``.

As ``LightningCLI`` does: any number of ``--config`` YAML files and a dotted option per field
(``--rl.module.lr 3e-5``), the later winning, ``--print_config`` (``=comments``, ``=skip_null``)
to write the resolved config out, ``--version``; the merged values then pass the same checks as
``streamrl.run.config_file.load_config``, and a mistake is reported in our words (the key, a "did
you mean", the fix). Of the Lightning Trainer's arguments, ``--trainer.max_steps`` and
``--trainer.default_root_dir`` are aliases of ``--rl.iterations`` and ``--output_dir``; the others
that ours lack are refused naming the setting to use (``config_file.LIGHTNING_TRAINER_ARGS``).
"""

from __future__ import annotations

import dataclasses
import sys
import textwrap
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from streamrl.errors import ConfigError, unknown_name

if TYPE_CHECKING:
    import jsonargparse

    from streamrl.run.config import RunConfig

#: ``streamrl fit`` options of the run itself, beside the config's fields.
_FIT_RUN_OPTIONS = (
    "config",
    "print_config",
    "resume",
    "no-progress",
    "verbose",
    "no-cache",
    "help",
    "version",
)
#: The options ``streamrl fit`` had before it read dotted ones, and the Lightning Trainer's
#: arguments that name one of ours (one RL iteration is one optimizer step), kept as aliases.
_FIT_ALIASES = {
    "--output-dir": "--output_dir",
    "--gpus": "--rl.generation.gpus_per_instance",
    "--trainer.max_steps": "--rl.iterations",
    "--trainer.default_root_dir": "--output_dir",
}
VERBOSE_HELP = "also show Lightning's information lines (accelerators found, tips) on stderr"
#: What ``--print_config=FLAGS`` takes, comma-separated, as ``LightningCLI``'s.
PRINT_FLAGS = ("comments", "skip_null")


@dataclasses.dataclass
class FitArgs:
    """``streamrl fit``'s command line, parsed and checked for keys and types."""

    config: RunConfig
    resume: str | None = None
    no_progress: bool = False
    #: Lightning's own information lines (accelerators found, tips) on stderr too.
    verbose: bool = False
    #: ``None``: train; else ``--print_config``'s flags (``[]``, ``["comments"]``...).
    print_config: list[str] | None = None
    #: The ``--config`` files, in order (``package.module:Name`` also imports beside them).
    config_files: list[str] = dataclasses.field(default_factory=list)


def build_fit_parser() -> jsonargparse.ArgumentParser:
    """The ``jsonargparse`` parser of ``streamrl fit``: ``--config`` files, one dotted option per
    ``RunConfig`` field, ``--print_config`` and the run's own options."""
    from jsonargparse import ActionConfigFile, ArgumentParser

    from streamrl.run.config import RLConfig, RunConfig

    parser = ArgumentParser(
        prog="streamrl fit",
        description="Train from the defaults (the demo's run), YAML files and dotted options, "
        "e.g. streamrl fit --config configs/demo.yaml --rl.module.lr 3e-5 "
        "--data.tasks '[copy, rev]'. "
        "Options and files apply in order, the later winning. --output-dir and --gpus are "
        "aliases of --output_dir and --rl.generation.gpus_per_instance.",
        exit_on_error=False,
        print_config=None,  # ours below prints only the config, which load_config reads back
        allow_abbrev=False,
        default_env=False,
    )
    parser.add_argument(
        "--config",
        action=ActionConfigFile,
        help="YAML file of settings (any subset of --print_config's); may be given several times",
    )
    parser.add_argument(
        "--print_config",
        nargs="?",
        const="",
        metavar="FLAGS",
        help="print the resolved config as YAML and exit (keys and types are checked, values "
        "are not): streamrl fit --print_config > my.yaml; --print_config=comments adds each "
        "setting's description, --print_config=skip_null leaves out the unset (null) ones",
    )
    parser.add_argument("--version", action="version", version=f"streamrl {fit_version()}")
    parser.add_argument(
        "--resume",
        help="checkpoint to continue from, e.g. <output_dir>/checkpoints/last.ckpt, or 'auto': "
        "the output_dir's last checkpoint if it has one (a run into an output_dir that holds an "
        "earlier run's checkpoints is refused without --resume)",
    )
    parser.add_argument("--no-progress", action="store_true", help="draw no progress bars")
    parser.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    parser.add_argument(
        "--no-cache",
        action="store_true",
        help="train the tiny policy's warm start afresh, even if one made from the same rows, "
        "code and settings is cached (the same as --sft.cache false)",
    )
    swappable = _swappable_fields()
    parser.add_class_arguments(RunConfig, fail_untyped=True, skip={"rl"})
    skip = {f.name for f in swappable}
    parser.add_class_arguments(RLConfig, "rl", fail_untyped=True, skip=skip, instantiate=False)
    # A swappable part's value goes through as given (a name, or YAML of {class_path,
    # init_args}) and RLConfig resolves it: jsonargparse would take a class_path mapping for a
    # subclass spec of its own, and fail to merge a file's with an override.
    help_of = _descriptions(RLConfig)
    for field in swappable:
        parser.add_argument(f"--rl.{field.name}", default=field.default, help=help_of[field.name])
    return parser


def _swappable_fields() -> list[dataclasses.Field]:
    from streamrl.run.config import RLConfig
    from streamrl.run.swappable import SWAPPABLE

    return [f for f in dataclasses.fields(RLConfig) if f.name in SWAPPABLE]


def parse_fit(argv: Sequence[str]) -> FitArgs:
    """Parse ``streamrl fit``'s arguments (without the command) into a ``RunConfig`` built by
    ``streamrl.run.config_file.from_dict``; its values are checked later, by ``check_values``.

    Raises:
        ConfigError: an unreadable file, an unknown key (with a "did you mean") or a wrong type.
    """
    from jsonargparse import ArgumentError

    from streamrl.run.config import RunConfig
    from streamrl.run.config_file import from_dict

    argv = [_fit_alias(token) for token in argv]
    _explain_fit_error(argv, files_only=True)  # a pipe, a binary file, a key given twice
    try:
        values = build_fit_parser().parse_args(argv).as_dict()
    except ArgumentError as err:
        _explain_fit_error(argv)  # our message for an unknown key or an unreadable file
        raise ConfigError(" ".join(str(err).split())) from None
    files = [str(path) for path in values.pop("config") or [] if path is not None]
    run = {name: values.pop(name) for name in ("resume", "no_progress", "verbose", "print_config")}
    if values.pop("no_cache"):
        values["sft"]["cache"] = False
    run["print_config"] = _print_flags(run["print_config"])
    rl = values["rl"] if isinstance(values.get("rl"), dict) else {}  # else from_dict refuses it
    for field in _swappable_fields():  # given on the command line: YAML text
        if isinstance(value := rl.get(field.name), str):
            rl[field.name] = _yaml_option(f"--rl.{field.name}", value)
    config = from_dict(RunConfig, values, where=" + ".join([*files, "command line"]))
    return FitArgs(config, **run, config_files=files)


def _yaml_option(option: str, text: str) -> Any:
    """An option's value as YAML (``skew``, ``null``, ``{class_path: ..., init_args: ...}``)."""
    import yaml

    from streamrl.run.config_file import read_yaml

    try:
        return read_yaml(text)
    except yaml.YAMLError as err:
        message = " ".join(str(err).split())
        raise ConfigError(f"{option} {text!r} is not valid YAML: {message}") from None


def fit_version() -> str:
    import streamrl

    return streamrl.__version__


def _print_flags(value: str | None) -> list[str] | None:
    """``--print_config``'s value: ``None`` (not given), or its known flags; ``ConfigError``."""
    if value is None:
        return None
    flags = [flag.strip() for flag in value.split(",") if flag.strip()]
    unknown = [flag for flag in flags if flag not in PRINT_FLAGS]
    if unknown:
        raise ConfigError(
            f"--print_config={value}: {unknown_name('flag', unknown[0], PRINT_FLAGS)} Give "
            "--print_config alone, or with comments and/or skip_null, e.g. "
            "--print_config=comments,skip_null."
        )
    return flags


def _fit_alias(token: str) -> str:
    name, eq, value = token.partition("=")
    return _FIT_ALIASES.get(name, name) + eq + value


def _explain_fit_error(argv: Sequence[str], files_only: bool = False) -> None:
    """Raise our ``ConfigError`` for the unknown key (in a file, a YAML string or an option) or
    the unreadable file behind a failed parse; return if none is found. ``files_only``: only
    the config files and YAML values (before the parse: jsonargparse reads a file given twice
    silently, and a binary one with a traceback)."""
    for i, token in enumerate(argv):
        if token == "--":
            break
        if not token.startswith("--"):
            continue
        name, eq, value = token[2:].partition("=")
        if not eq:
            value = argv[i + 1] if i + 1 < len(argv) else ""
        if (section := _section_named(name)) is not None:  # --config / --rl / --rl.lora YAML
            _check_config_value(f"--{name}", value, section)
        elif not files_only:
            _check_option(name)


def _section_named(name: str) -> type | None:
    """The config section (or component's arguments) an option names: ``config`` the whole
    ``RunConfig``, ``rl`` its ``RLConfig``, ``rl.lora`` a ``LoRASpec``; ``None``: a setting."""
    from streamrl.run.config import RunConfig
    from streamrl.run.config_file import section_class

    section: Any = RunConfig
    for part in [] if name == "config" else name.split("."):
        section = section_class(typing.get_type_hints(section).get(part))
        if section is None:
            return None
    return section


def _check_option(name: str) -> None:
    """``--name`` (e.g. ``rl.module.lr``) must name a field (or a run option); ``ConfigError``."""
    from streamrl.run.config import CONSTRUCTOR_SECTIONS, RLConfig, RunConfig, TrainerConfig
    from streamrl.run.config_checks import check_section
    from streamrl.run.config_file import (
        LIGHTNING_TRAINER_ARGS,
        MOVED_KEYS,
        lightning_trainer_arg,
        section_class,
    )

    cls: Any = RunConfig
    parts = name.removesuffix("+").split(".")  # --data.tasks+ copy appends to a list
    for depth, part in enumerate(parts):
        if cls is RLConfig and part in CONSTRUCTOR_SECTIONS and depth == len(parts) - 2:
            # --rl.timeouts.start_s: a key of the section (its value is checked with the rest)
            check_section(part, {parts[-1]: None}, where=f"--rl.{part}", values=False)
            return
        hints = typing.get_type_hints(cls)
        if part in MOVED_KEYS.get(cls, {}):
            raise ConfigError(f"--{name} has moved: set {MOVED_KEYS[cls][part]} instead.")
        if cls is TrainerConfig and part in LIGHTNING_TRAINER_ARGS:
            raise ConfigError(lightning_trainer_arg(f"--{name}", part))
        known = [*hints, *(_FIT_RUN_OPTIONS if depth == 0 else ())]
        if part not in known or (depth < len(parts) - 1 and not section_class(hints.get(part))):
            prefix = "--" + "".join(f"{p}." for p in parts[:depth])
            message = unknown_name("option", f"--{name}", [prefix + k for k in known])
            raise ConfigError(f"command line: {message}")
        cls = section_class(hints.get(part))


def _check_config_value(option: str, value: str, cls: type) -> None:
    """A ``--config`` (or ``--rl``) value: a YAML file or string of known keys; ``ConfigError``."""
    import yaml

    from streamrl.run.config_file import DuplicateKeyError, read_config_text, read_yaml

    try:
        exists = Path(value).exists()
    except OSError:  # e.g. a YAML string too long for a file name
        exists = False
    is_file = exists and Path(value).is_file()
    if exists:
        read_config_text(Path(value))  # a pipe or a binary file: a clear error
    try:
        data = read_yaml(Path(value).read_text() if is_file else value)
    except yaml.YAMLError as err:
        if is_file:
            raise ConfigError(f"Config file {value!r} is not valid YAML: {err}") from err
        if isinstance(err, DuplicateKeyError):
            raise ConfigError(f"{option} {value!r}: {err.problem}.") from None
        return
    if isinstance(data, dict):
        _check_keys(cls, data, value if is_file else option)
    elif is_file and data is None:  # jsonargparse reads no empty file
        raise ConfigError(
            f"Config file {value!r} is empty: give it some keys or leave out {option}."
        )
    elif is_file:
        raise ConfigError(f"Config file {value!r} must hold a mapping of keys to values.")
    elif option == "--config":
        raise ConfigError(
            f"Config file {value!r} does not exist. Pass --config with a YAML file, e.g. "
            "configs/demo.yaml."
        )


def _check_keys(cls: type, data: dict, where: str) -> None:
    """Every key of ``data`` names a field of dataclass ``cls``, as in ``from_dict``."""
    from streamrl.run.config import TrainerConfig
    from streamrl.run.config_file import (
        LIGHTNING_TRAINER_ARGS,
        MOVED_KEYS,
        lightning_trainer_arg,
        moved_key,
        section_class,
    )

    hints = typing.get_type_hints(cls)
    for key, value in data.items():
        if key in MOVED_KEYS.get(cls, {}):
            raise ConfigError(moved_key(where, cls, key))
        if cls is TrainerConfig and key in LIGHTNING_TRAINER_ARGS:
            raise ConfigError(lightning_trainer_arg(f"{where}: {key}", key))
        if key not in hints:
            raise ConfigError(f"{where}: {unknown_name('key', str(key), list(hints))}")
        if section_class(hints[key]) and isinstance(value, dict):
            _check_keys(section_class(hints[key]), value, f"{where}: {key}")


def print_fit_config(config: RunConfig, flags: Sequence[str] = ()) -> None:
    """``--print_config``: the whole config as YAML, which ``load_config`` reads back.

    Args:
        config: the resolved config.
        flags: ``"comments"``: each setting's description (from its docstring) above it;
            ``"skip_null"``: leave out the settings that are ``null``.
    """
    sys.stdout.write("".join(_yaml_lines(config, 0, "comments" in flags, "skip_null" in flags)))


def _yaml_lines(section: Any, indent: int, comments: bool, skip_null: bool) -> list[str]:
    """``section`` (a config dataclass) as YAML lines, one setting at a time."""
    import yaml

    from streamrl.run.config import CONSTRUCTOR_SECTIONS

    pad, lines = " " * indent, []
    described = _descriptions(type(section)) if comments else {}
    for field in dataclasses.fields(section):
        value = getattr(section, field.name)
        if value is None and skip_null:
            continue
        for line in textwrap.wrap(described.get(field.name, ""), 98 - indent):
            lines.append(f"{pad}# {line}\n")
        arguments = ""
        if comments and isinstance(value, dict) and "class_path" in value:
            arguments = "init_args: " + _arguments_of(value["class_path"])
        elif comments and field.name in CONSTRUCTOR_SECTIONS:
            class_path, linked = CONSTRUCTOR_SECTIONS[field.name]
            arguments = "its keys: " + _arguments_of(class_path, tuple(linked))
        if arguments:
            for line in textwrap.wrap(arguments, 98 - indent):
                lines.append(f"{pad}# {line}\n")
        if dataclasses.is_dataclass(value):
            lines.append(f"{pad}{field.name}:\n")
            lines.extend(_yaml_lines(value, indent + 2, comments, skip_null))
            continue
        # As one dump of the whole config: a scalar in block style, innermost lists in flow.
        flow = None if isinstance(value, (list, tuple, dict)) else False
        text = yaml.safe_dump({field.name: value}, sort_keys=False, default_flow_style=flow)
        lines.extend(pad + line + "\n" for line in text.splitlines())
    return lines


def _arguments_of(class_path: str, linked: tuple[str, ...] = ()) -> str:
    """What ``init_args`` may hold for ``class_path``: its constructor's parameters, but for
    those the run ``linked`` in."""
    import inspect

    from streamrl.runtime.references import resolve

    factory = resolve(class_path, kind="class", builtins={}, where="print_config")
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # no signature to read
        return ""
    shown = [
        p.name if p.default is p.empty else f"{p.name}={p.default!r}"
        for p in parameters
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in linked
    ]
    note = " (from_run links in what the run knows)" if hasattr(factory, "from_run") else ""
    if linked:
        note = f"; the run links in {', '.join(linked)}"
    return f"{factory.__qualname__}({', '.join(shown)}){note}"


def _descriptions(cls: type) -> dict[str, str]:
    """Each field's description from the ``Attributes:`` of ``cls``'s docstring, on one line
    (``n_train / n_heldout:`` describes both)."""
    import docstring_parser

    out = {}
    for param in docstring_parser.parse(cls.__doc__ or "").params:
        text = " ".join((param.description or "").replace("``", "").split())
        for name in param.arg_name.split("/"):
            out[name.strip()] = text
    return out
