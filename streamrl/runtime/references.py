"""Names in a YAML config that point at code: a built-in's short name or ``package.module:Name``.

Every extension point of a run (``rl.algorithm``, ``rl.reward``, ``rl.dispatcher``,
``rl.scheduler``, ``rl.length_predictor``, ``rl.engine``) takes either the short name of a
built-in or a reference to your own class or function, e.g. ``rl.reward: my_task.rewards:score``.
The reference is imported and its signature checked when the config is loaded, before any work
starts, and a failure says what was wrong and how to fix it. Besides the installed packages, the
console script searches the current directory and each ``--config`` file's directory, in that
order (``add_search_dirs``), as ``python -m`` would find a module in the current directory.

Examples:
    >>> resolve("exact", kind="reward", builtins={"exact": len}, where="rl.reward") is len
    True
    >>> resolve("math:sqrt", kind="reward", builtins={}, where="rl.reward").__name__
    'sqrt'
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from streamrl.errors import ConfigError, unknown_name

#: The directories ``add_search_dirs`` added in this process, for messages.
_SEARCH_DIRS: list[str] = []


def add_search_dirs(dirs: Iterable[str | Path]) -> None:
    """Let ``package.module:Name`` import from ``dirs`` too, in this process and its children.

    A console script does not put the current directory on ``sys.path`` (``python -m`` does),
    so ``reward: my_rewards:fn`` beside you would not import. The directories go after the
    installed packages (a file named like one, e.g. ``datasets.py``, does not shadow it) and
    into ``PYTHONPATH``: spawned processes (generator instances, reward workers, trainer ranks)
    start with this process's ``sys.path``, and those started otherwise (Ray workers) read
    ``PYTHONPATH``.

    Args:
        dirs: directories, in the order they are searched.
    """
    for directory in dirs:
        path = str(Path(directory).resolve())
        if path in _SEARCH_DIRS:
            continue
        _SEARCH_DIRS.append(path)
        if path not in sys.path:
            sys.path.append(path)
        entries = [e for e in os.environ.get("PYTHONPATH", "").split(os.pathsep) if e]
        if path not in entries:
            os.environ["PYTHONPATH"] = os.pathsep.join([*entries, path])


def searched_dirs() -> list[str]:
    """Where a module of a reference was looked for, beside the installed packages: the
    directories ``add_search_dirs`` added, or else ``sys.path``'s own (not the interpreter's
    or its packages')."""
    if _SEARCH_DIRS:
        return list(_SEARCH_DIRS)
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix}
    return [
        entry or os.getcwd()
        for entry in sys.path
        if not any(entry.startswith(prefix) for prefix in prefixes) and "-packages" not in entry
    ]


def resolve(ref: str, *, kind: str, builtins: Mapping[str, Any], where: str) -> Any:
    """The built-in named ``ref``, or the object ``package.module:Name`` refers to.

    Args:
        ref: a key of ``builtins`` or ``"package.module:Name"`` (``Name`` may be dotted:
            ``module:Class.attribute``).
        kind: what is being looked up, for messages ("reward", "dispatcher"...).
        builtins: the built-ins by short name.
        where: the config key, for messages.

    Raises:
        ConfigError: unknown name, a module that does not import, or a missing attribute.
    """
    if ref in builtins:
        return builtins[ref]
    if ":" not in ref:
        raise ConfigError(
            f"{where}: {unknown_name(kind, ref, builtins)} Your own {kind} is given as "
            "'package.module:Name' (importable from this Python environment)."
        )
    module_name, _, attribute = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name is None or not f"{module_name}.".startswith(f"{err.name}."):
            raise _import_failed(where, module_name, ref, err) from err  # the module's import
        top = module_name.partition(".")[0]
        raise ConfigError(
            f"{where}: cannot import module {module_name!r} of {ref!r}: {err!r}. Searched the "
            f"installed packages, then {', '.join(searched_dirs()) or 'no directory'}; put "
            f"{top}.py (or the package {top}/) in one of these directories, install its package "
            "or add its directory to PYTHONPATH."
        ) from err
    except Exception as err:  # an error raised by the module's own code
        raise _import_failed(where, module_name, ref, err) from err
    found: Any = module
    for part in attribute.split("."):
        if not hasattr(found, part):
            public = [n for n in dir(found) if not n.startswith("_")]
            place = f" ({module.__file__})" if getattr(module, "__file__", None) else ""
            raise ConfigError(f"{where}: {ref!r}{place}: {unknown_name('name', part, public)}")
        found = getattr(found, part)
    return found


def _import_failed(where: str, module_name: str, ref: str, err: Exception) -> ConfigError:
    return ConfigError(
        f"{where}: cannot import module {module_name!r} of {ref!r}: {err!r}. Fix the error in "
        "the module (or one it imports), or install the package it needs."
    )


def check_callable(obj: Any, *, positional: int, where: str, what: str) -> None:
    """Raise ``ConfigError`` unless ``obj`` can be called with ``positional`` arguments.

    Args:
        obj: the function or class.
        positional: how many positional arguments the library will pass.
        where: the config key, for messages.
        what: the call it must accept, e.g. ``"fn(completion, answer) -> float"``.
    """
    if not callable(obj):
        raise ConfigError(f"{where}: {obj!r} is not callable; it must be {what}.")
    try:
        inspect.signature(obj).bind(*range(positional))
    except TypeError as err:
        raise ConfigError(
            f"{where}: {_name(obj)} has the wrong signature {_signature(obj)}: it must be "
            f"{what} ({err})."
        ) from err
    except ValueError:  # a builtin without a signature: trust it
        return


def construct(
    factory: Callable[..., Any],
    *,
    provided: Mapping[str, Any],
    options: Mapping[str, Any],
    where: str,
    call: bool = True,
) -> Any:
    """Call ``factory`` with ``options`` (and those of ``provided`` its signature takes),
    checking first that they bind, so a mistake is named with the factory's signature.

    Args:
        factory: a class or function.
        provided: arguments given for the parameters of these names only (a caller that
            fills some itself passes them here to have them counted as given).
        options: the user's own keyword arguments (the config's ``*_options``).
        where: the config key, for messages.
        call: ``False`` only checks that the call would bind (returns ``None``).

    Raises:
        ConfigError: a required parameter nobody provides, or an option it does not take.
    """
    if not callable(factory):
        raise ConfigError(f"{where}: {factory!r} is not a class or function.")
    try:
        parameters = inspect.signature(factory).parameters
    except ValueError:  # no signature to read: only the user's options
        return factory(**options) if call else None
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    unknown = [k for k in options if k not in parameters and not takes_any]
    if unknown:
        raise ConfigError(
            f"{where}: {_name(factory)} takes no option(s) {unknown}; its parameters are "
            f"{_signature(factory)}."
        )
    kwargs = {k: v for k, v in provided.items() if k in parameters and k not in options}
    kwargs.update(options)
    missing = [
        name
        for name, p in parameters.items()
        if p.default is inspect.Parameter.empty
        and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        and name not in kwargs
    ]
    if missing:
        raise ConfigError(
            f"{where}: {_name(factory)} needs {missing}, which the run does not provide (it "
            f"provides {sorted(provided)}); give a default or pass them in the options."
        )
    return factory(**kwargs) if call else None


def pick(
    value: str | Mapping[str, Any], *, kind: str, builtins: Mapping[str, Any], where: str
) -> tuple[Any, dict[str, Any]]:
    """``(factory, options)`` from a config value: ``"name"``, ``"package.module:Name"`` or
    ``{name: ..., option: value, ...}``.

    Raises:
        ConfigError: a mapping without ``name``, or a name ``resolve`` refuses.
    """
    if isinstance(value, Mapping):
        if "name" not in value:
            raise ConfigError(
                f"{where}: a mapping needs a 'name' (a built-in or package.module:Name) next "
                f"to its options, got {dict(value)!r}."
            )
        options = {k: v for k, v in value.items() if k != "name"}
        return resolve(value["name"], kind=kind, builtins=builtins, where=where), options
    if not isinstance(value, str):
        raise ConfigError(
            f"{where}: expected a built-in's name, 'package.module:Name' or a mapping with a "
            f"'name', got {value!r}."
        )
    return resolve(value, kind=kind, builtins=builtins, where=where), {}


def checked(obj: Any, protocol: type, where: str) -> Any:
    """``obj`` if it has every method of ``protocol`` (a runtime-checkable Protocol), else a
    ``ConfigError`` naming the methods it lacks."""
    if not isinstance(obj, protocol):
        needed = sorted(
            n for n in dir(protocol) if not n.startswith("_") or n in ("__call__", "__len__")
        )
        missing = [n for n in needed if not hasattr(obj, n)]
        raise ConfigError(
            f"{where}: {type(obj).__qualname__} is not a {protocol.__name__}: it lacks "
            f"{missing or needed} (see streamrl.protocols.{protocol.__name__})."
        )
    return obj


def _name(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', repr(obj))}"


def _signature(obj: Any) -> str:
    try:
        return str(inspect.signature(obj))
    except ValueError:
        return "(...)"
