"""The package's layers (``docs/architecture.md``): imports go one way, from a higher folder to a
lower one, so a config followed from the command line to the components never climbs back up.

Every ``import``/``from ... import`` is read from the source, those inside functions and under
``TYPE_CHECKING`` included. ``streamrl/__init__.py`` is the public surface and names everything
lazily; it is the one module left out.
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import streamrl

PACKAGE = Path(streamrl.__file__).parent

#: Lowest first. A module may import its own folder and the folders before it, never one after.
LAYERS: tuple[str, ...] = (
    "",  # the top-level modules: errors, records, protocols
    "runtime",
    "tasks",
    "algorithms",
    "policy",
    "rewards",
    "components",
    "envs",
    "training",
    "eval",
    "run",
    "bench",
    "sim",
    "cli",
)

#: The top level keeps only the public surface.
TOP_LEVEL = {"__init__.py", "errors.py", "records.py", "protocols.py"}


def folder(module: str, package: Path) -> str:
    """``streamrl.training.module`` -> ``training``; ``streamrl.records`` -> ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and (package / parts[1]).is_dir() else ""


def module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, root: Path) -> set[str]:
    """The ``streamrl`` modules a file imports (absolute; relative imports resolved)."""
    found: set[str] = set()
    package = module_name(path, root).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "streamrl"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] == "streamrl":
                found.add(base)
    return found


def upward_imports(package: Path = PACKAGE) -> list[str]:
    """Each import of a higher layer's module, as ``file (its layer) imports module (layer)``."""
    rank = {name: i for i, name in enumerate(LAYERS)}
    wrong = []
    for path in sorted(package.rglob("*.py")):
        if path == package / "__init__.py":
            continue
        here = folder(module_name(path, package), package)
        for target in sorted(imported(path, package)):
            there = folder(target, package)
            if target != "streamrl" and rank[there] > rank[here]:
                wrong.append(
                    f"{path.relative_to(package.parent)} ({here or 'top'}) imports "
                    f"{target} ({there})"
                )
    return wrong


def test_every_folder_has_a_layer():
    folders = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert folders == set(LAYERS) - {""}


def test_no_module_imports_a_higher_layer():
    assert upward_imports() == []


def test_the_top_level_keeps_only_the_public_surface():
    assert {p.name for p in PACKAGE.glob("*.py")} == TOP_LEVEL


def test_the_check_sees_an_upward_import(tmp_path):
    """Broken on purpose, in a copy: a component that imports the job body inside a function."""
    copy = tmp_path / "streamrl"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", "data"))
    (copy / "components" / "probe.py").write_text(
        "def f():\n    from streamrl.run.recipe import run_fit\n"
    )
    assert upward_imports(copy) == [
        "streamrl/components/probe.py (components) imports streamrl.run.recipe (run)"
    ]
