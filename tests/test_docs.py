"""The docs site builds with warnings as errors (`make docs`).

Strict mode fails on a broken relative link or anchor in docs/*.md and on a docstring that
mkdocstrings cannot parse (for example an ``Args:`` entry naming a parameter the signature lacks),
so this test guards both the pages and the API reference generated from streamrl's docstrings.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("material", reason="docs tools not installed: pip install -e '.[dev]'")
pytest.importorskip("mkdocstrings_handlers.python", reason="mkdocstrings[python] not installed")

ROOT = Path(__file__).resolve().parents[1]


def test_docs_build_strict(tmp_path: Path) -> None:
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
