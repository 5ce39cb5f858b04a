"""Write ``notebooks/0X_*.ipynb`` from their jupytext sources ``0X_*.py`` (`make notebooks`).

The ``.py`` files are the sources; the ``.ipynb`` files are generated, without outputs, and the
same bytes every time: cell ids are numbered instead of random, and the notebook metadata is
fixed (the generic ``python3`` kernel, no kernel or jupytext version that would change from one
machine to the next). ``tests/test_notebooks.py`` regenerates each one in memory and fails when a
committed ``.ipynb`` differs from its source.

    python scripts/sync_notebooks.py           # write every .ipynb that changed
    python scripts/sync_notebooks.py --check   # exit 1, naming them, if any is out of date
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jupytext

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"

#: The notebook-level metadata of every generated notebook: Jupyter opens it with the Python 3
#: kernel of the environment it runs in; ``jupytext`` says it came from a percent script.
METADATA = {
    "jupytext": {
        "cell_metadata_filter": "-all",
        "main_language": "python",
        "notebook_metadata_filter": "-all",
    },
    "kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"},
    "language_info": {"name": "python"},
}


def sources() -> list[Path]:
    """The jupytext sources, ``notebooks/0X_*.py``, in order."""
    return sorted(NOTEBOOKS.glob("[0-9][0-9]_*.py"))


def render(source: Path) -> str:
    """The ``.ipynb`` text generated from the percent script ``source``: no outputs, fixed ids."""
    nb = jupytext.read(source, fmt="py:percent")
    for index, cell in enumerate(nb.cells):
        cell.id = f"cell-{index:02d}"
        cell.metadata = {}
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    nb.metadata = METADATA
    return jupytext.writes(nb, fmt="ipynb")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if stale")
    args = parser.parse_args(argv)
    stale = []
    for source in sources():
        target, text = source.with_suffix(".ipynb"), render(source)
        if target.is_file() and target.read_text(encoding="utf-8") == text:
            continue
        stale.append(target)
        if not args.check:
            target.write_text(text, encoding="utf-8")
            print(f"wrote {target.relative_to(NOTEBOOKS.parent)}")
    if args.check and stale:
        print("out of date (run `make notebooks`): " + ", ".join(p.name for p in stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
