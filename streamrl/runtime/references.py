"""Names in a YAML config that point at code: a built-in's short name or an import path.

Every extension point of a run (``rl.algorithm``, ``rl.reward``, ``rl.dispatcher``,
``rl.scheduler``, ``rl.length_predictor``, ``rl.engine``, ``rl.cluster``) takes either the short
name of a built-in or a reference to your own class or function, as ``package.module.Name`` (the
import path) or ``package.module:Name``, e.g. ``rl.reward: my_task.rewards:score``. A class with
arguments is given as LightningCLI gives one, ``{class_path: package.module.Name, init_args:
{...}}`` (``pick``); ``as_class_path`` writes any accepted form out that way, with the full import
path, which is how a run's config holds it and ``--print_config`` prints it.
The reference is imported and its signature checked when the config is loaded, before any work
starts (``check_options``: the names of its options; ``check_option_types``: their values against
its type hints), and a failure says what was wrong and how to fix it. Besides the installed
packages, the console script searches the current directory and each ``--config`` file's
directory, in that order (``add_search_dirs``), as ``python -m`` would find a module in the
current directory.

Examples:
    >>> resolve("exact", kind="reward", builtins={"exact": len}, where="rl.reward") is len
    True
    >>> resolve("math:sqrt", kind="reward", builtins={}, where="rl.reward").__name__
    'sqrt'
    >>> resolve("collections.OrderedDict", kind="dispatcher", builtins={}, where="rl.dispatcher")
    <class 'collections.OrderedDict'>
    >>> as_class_path({"class_path": "od", "init_args": {"x": 1}}, kind="k", builtins={"od": dict},
    ...               where="rl.k")
    {'class_path': 'builtins.dict', 'init_args': {'x': 1}}
"""

from __future__ import annotations

import collections.abc
import difflib
import importlib
import inspect
import os
import sys
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

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
    """The built-in named ``ref``, or the object ``package.module:Name`` (or the import path
    ``package.module.Name``) refers to.

    Args:
        ref: a key of ``builtins``, ``"package.module:Name"`` (``Name`` may be dotted:
            ``module:Class.attribute``) or ``"package.module.Name"``.
        kind: what is being looked up, for messages ("reward", "dispatcher"...).
        builtins: the built-ins by short name.
        where: the config key, for messages.

    Raises:
        ConfigError: unknown name, a module that does not import, or a missing attribute.
    """
    if ref in builtins:
        return builtins[ref]
    if ":" not in ref and "." in ref.strip("."):
        ref = _with_colon(ref)
    if ":" not in ref:
        raise ConfigError(
            f"{where}: {unknown_name(kind, ref, builtins)} Your own {kind} is given as "
            "'package.module.Name' or 'package.module:Name' (importable from this Python "
            "environment)."
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


def _with_colon(path: str) -> str:
    """``package.module.Name`` as ``package.module:Name``: the longest prefix that imports is the
    module (``module.Class.attribute`` works too); with none, the last dot is taken as the
    colon, so ``resolve`` reports the missing module."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name is not None and f"{module_name}.".startswith(f"{err.name}."):
                continue  # this prefix (or a package above it) is not a module: a shorter one
            break  # the module exists but one it imports does not: resolve reports it
        except Exception:
            break  # the module's own code failed: resolve reports it
        return f"{module_name}:{'.'.join(parts[cut:])}"
    head, _, tail = path.rpartition(".")
    return f"{head}:{tail}"


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
        close = difflib.get_close_matches(str(unknown[0]), list(parameters), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"{where}: {_name(factory)} takes no option(s) {unknown}{hint}; its parameters are "
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


def check_options(factory: Callable[..., Any], options: Mapping[str, Any], *, where: str) -> None:
    """Raise ``ConfigError`` for an option ``factory`` does not take (with a "did you mean" and
    its signature), as ``construct`` would, without calling it or asking for the rest."""
    try:
        names = list(inspect.signature(factory).parameters)
    except (TypeError, ValueError):  # no signature to read
        return
    construct(factory, provided=dict.fromkeys(names), options=options, where=where, call=False)


#: Hints whose values a YAML list may give.
_SEQUENCES = (list, tuple, collections.abc.Sequence, collections.abc.Iterable)


def check_option_types(
    factory: Callable[..., Any], options: Mapping[str, Any], *, where: str
) -> None:
    """Raise ``ConfigError`` for an option whose value ``factory``'s type hint refuses: a value a
    config file cannot mean (``lr: abc``, ``num_instances: 2.5``), named with the type it takes.
    Which values of a type are valid (a ``Literal``'s choices, a count >= 1) is the factory's to
    say in its own words, and so is a hint this cannot read or judge (a class of the run)."""
    for key, value in options.items():
        hint = _hint(factory, key)
        if hint is not None and not _fits(hint, value):
            raise ConfigError(f"{where}.{key} must be {_describe(hint)}, got {value!r}.")


def _hint(factory: Callable[..., Any], name: str) -> Any:
    """The type hint of ``factory``'s argument ``name``, or ``None`` where it cannot be read."""
    try:
        parameter = inspect.signature(factory).parameters.get(name)
    except (TypeError, ValueError):
        return None
    if parameter is None or parameter.annotation is inspect.Parameter.empty:
        return None
    annotation = parameter.annotation
    if isinstance(annotation, str):  # ``from __future__ import annotations``
        target = getattr(factory, "__init__", factory) if isinstance(factory, type) else factory
        module = sys.modules.get(getattr(target, "__module__", ""), None)
        try:
            annotation = eval(annotation, vars(module) if module else {})  # in its own module
        except Exception:  # a name only imported for type checking
            return None
    return annotation


def _fits(hint: Any, value: Any) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any or isinstance(hint, typing.TypeVar):
        return True
    if hint is None or hint is type(None):
        return value is None
    if origin is Literal:  # its choices are the constructor's to check
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_fits(arg, value) for arg in args)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    kind = origin or hint
    if kind in _SEQUENCES:
        return isinstance(value, (list, tuple))  # a string is one too, but never meant as one
    if kind in (dict, Mapping, collections.abc.Mapping):
        return isinstance(value, Mapping)
    if kind in (str, bool):
        return isinstance(value, kind)
    return True  # a class of the run, a callable...: the constructor judges


def _describe(hint: Any) -> str:
    if hint in (int, float, str, bool):
        return f"{'an' if hint is int else 'a'} {hint.__name__}"
    return f"of type {str(hint).replace('typing.', '').replace('collections.abc.', '')}"


def pick(
    value: str | Mapping[str, Any], *, kind: str, builtins: Mapping[str, Any], where: str
) -> tuple[Any, dict[str, Any]]:
    """``(factory, options)`` from a config value: ``"name"``, ``"package.module.Name"`` (or
    ``"package.module:Name"``), ``{class_path: ..., init_args: {option: value, ...}}``
    (LightningCLI's form); in Python, the class (or function) itself stands for its path.

    Raises:
        ConfigError: a mapping without ``class_path`` (the layout before it, ``{name: ...,
            option: value}``, is answered with its new spelling), a key beside ``class_path``
            other than ``init_args``, or a name ``resolve`` refuses.
    """
    if isinstance(value, Mapping) and "class_path" in value:
        extra = [k for k in value if k not in ("class_path", "init_args")]
        if extra:
            raise ConfigError(
                f"{where}: {unknown_name('key', str(extra[0]), ['class_path', 'init_args'])} "
                "A class's arguments go under init_args: {class_path: package.module.Name, "
                "init_args: {option: value}}."
            )
        options = value.get("init_args") or {}
        if not isinstance(options, Mapping):
            raise ConfigError(
                f"{where}: init_args must be a mapping of argument names to values, got "
                f"{options!r}."
            )
        factory = _reference(value["class_path"], kind=kind, builtins=builtins, where=where)
        return factory, dict(options)
    if isinstance(value, Mapping) and "name" in value:  # the layout before class_path
        new = yaml_flow(from_name_layout(value))
        raise ConfigError(
            f"{where}: {{name: ...}} has become {{class_path, init_args}}: write {new} "
            "(streamrl config migrate OLD.yaml rewrites a file)."
        )
    if isinstance(value, Mapping):
        raise ConfigError(
            f"{where}: a mapping needs a 'class_path' (a built-in's name or package.module.Name) "
            f"and its 'init_args', got {yaml_flow(dict(value))}."
        )
    return _reference(value, kind=kind, builtins=builtins, where=where), {}


def from_name_layout(value: Mapping[str, Any]) -> str | dict[str, Any]:
    """A part written in the layout before ``class_path`` (``{name: X, option: value}``) in
    today's: ``{class_path: X, init_args: {option: value}}``, or ``X`` alone without options.

    Examples:
        >>> from_name_layout({"name": "skew", "alpha": 0.3}), from_name_layout({"name": "lpt"})
        ({'class_path': 'skew', 'init_args': {'alpha': 0.3}}, 'lpt')
    """
    init_args = {k: v for k, v in value.items() if k != "name"}
    return {"class_path": value["name"], "init_args": init_args} if init_args else value["name"]


def yaml_flow(value: Any) -> str:
    """``value`` as one line of YAML, as a config would write it: ``{class_path: skew}``."""
    import yaml

    text = yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=10**6)
    return text.removesuffix("\n...\n").strip()  # a lone scalar ends its document


def as_class_path(
    value: str | Mapping[str, Any],
    *,
    kind: str,
    builtins: Mapping[str, Any],
    where: str,
    main_ok: bool = False,
) -> dict[str, Any]:
    """``value`` (any form ``pick`` takes) as ``{class_path: <full import path>, init_args:
    {...}}``: one spelling per part, which ``pick`` reads back to the same class and arguments.

    Args:
        main_ok: accept a class of ``__main__`` (your script's or notebook's), for a part only
            the process that runs the recipe builds; ``__main__.Name`` then names it.

    Raises:
        ConfigError: what ``pick`` raises, or a class that cannot be imported by its path (one
            defined inside a function, or in ``__main__`` unless ``main_ok``): give it from an
            importable module.
    """
    factory, options = pick(value, kind=kind, builtins=builtins, where=where)
    path = class_path_of(factory)
    if "<locals>" in path or (path.startswith("__main__.") and not main_ok):
        raise ConfigError(
            f"{where}: {path} cannot be imported by another process: define it in a module "
            "(package.module.Name) that the run can import."
        )
    return {"class_path": path, "init_args": options}


def class_path_of(obj: Any) -> str:
    """The import path of class or function ``obj``: ``package.module.Name``."""
    return f"{obj.__module__}.{obj.__qualname__}"


def _reference(ref: Any, *, kind: str, builtins: Mapping[str, Any], where: str) -> Any:
    if isinstance(ref, type) or inspect.isfunction(ref):  # given in Python: the object itself
        return ref
    if not isinstance(ref, str):
        raise ConfigError(
            f"{where}: expected a built-in's name, 'package.module.Name' or "
            f"{{class_path: ..., init_args: {{...}}}}, got {ref!r}."
        )
    return resolve(ref, kind=kind, builtins=builtins, where=where)


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
