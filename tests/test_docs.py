"""The docs build, and say what the code has.

`make docs` builds the site with warnings as errors: strict mode fails on a broken relative link
or anchor in docs/*.md and on a docstring that mkdocstrings cannot parse (for example an ``Args:``
entry naming a parameter the signature lacks), so that test guards both the pages and the API
reference generated from streamrl's docstrings.

The other tests read the pages as text and check what they count and list against the code: how
many notebooks there are, and which ``streamrl`` commands the parser has.
"""

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted(p.stem for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.py"))
#: Every page a reader meets: the README, the docs site and the notebooks' own README.
PAGES = [
    ROOT / "README.md",
    ROOT / "notebooks" / "README.md",
    *sorted((ROOT / "docs").rglob("*.md")),
]
WORDS = "two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen"
NUMBERS = {word: n for n, word in enumerate(WORDS.split(), start=2)}
#: "eight notebooks", "12 Jupyter notebooks": a count, then up to two words, then "notebooks".
#: A command table's row: its first cell starts with the command's words, then its arguments.
ROW = re.compile(r"^\| `streamrl((?: [a-z][a-z-]*)+)", re.M)
COUNT = re.compile(rf"\b({'|'.join(NUMBERS)}|[1-9][0-9]*)\s+(?:[\w-]+\s+){{0,2}}?notebooks\b", re.I)


def test_docs_build_strict(tmp_path: Path) -> None:
    pytest.importorskip("material", reason="docs tools not installed: pip install -e '.[dev]'")
    pytest.importorskip("mkdocstrings_handlers.python", reason="mkdocstrings[python] not installed")
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's notice about its own future
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file"]
    cmd += [str(ROOT / "mkdocs.yml"), "--site-dir", str(site)]
    # About 5 s on 2 cores; the timeout only turns a hang into a failure.
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"

    for page in ["index", "getting-started/index", "benchmarks/index", "architecture/index"]:
        assert (site / f"{page}.html").is_file(), f"{page}.html missing from the built site"
    # The API reference is rendered from the docstrings, not just an empty page per module.
    service = (site / "api/components/generation_service/index.html").read_text()
    assert "StreamGenerationService" in service
    assert "num_instances" in service  # a constructor argument, from its Args: section
    assert "GRPO" in (site / "api/algorithms/index.html").read_text()


def test_every_count_of_notebooks_is_the_number_on_disk() -> None:
    stated = [
        (page.relative_to(ROOT), match.group(0).replace("\n", " "), match.group(1).lower())
        for page in PAGES
        for match in COUNT.finditer(page.read_text(encoding="utf-8"))
    ]
    assert stated, "no page says how many notebooks there are; has the pattern stopped matching?"
    wrong = [
        f"{page}: '{said}'"
        for page, said, count in stated
        if NUMBERS.get(count, int(count) if count.isdigit() else None) != len(NOTEBOOKS)
    ]
    assert not wrong, f"notebooks/ holds {len(NOTEBOOKS)} notebooks, but " + "; ".join(wrong)


@pytest.mark.parametrize("page", ["docs/getting-started.md", "notebooks/README.md"])
def test_every_notebook_is_in_the_tables(page: str) -> None:
    text = (ROOT / page).read_text(encoding="utf-8")
    missing = [name for name in NOTEBOOKS if f"`{name}" not in text]
    assert not missing, f"{page} does not list the notebooks {missing}"


def _commands(parser: argparse.ArgumentParser, prefix: str = "streamrl") -> set[str]:
    """Every leaf command of ``parser``: ``streamrl demo``, ``streamrl bench pipeline``, ..."""
    subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subparsers:
        return {prefix}
    return {
        command
        for name, child in subparsers[0].choices.items()
        for command in _commands(child, f"{prefix} {name}")
    }


@pytest.mark.parametrize("page", ["README.md", "docs/getting-started.md"])
def test_command_tables_list_every_command(page: str) -> None:
    from streamrl.cli.main import build_parser

    text = (ROOT / page).read_text(encoding="utf-8")
    section = text.split("\n## Command line\n", 1)[1].split("\n## ", 1)[0]
    # Table rows that start with a command: | `streamrl bench ranker --data F` | what it does |
    listed = {"streamrl" + words for words in ROW.findall(section)}
    commands = _commands(build_parser())
    missing, unknown = sorted(commands - listed), sorted(listed - commands)
    assert not missing, f"{page}'s command table lacks {missing}"
    assert not unknown, f"{page}'s command table lists commands the CLI lacks: {unknown}"
