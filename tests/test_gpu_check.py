"""scripts/gpu_check.sh on the lent GPU machine's image as it is, emulated here: every import of a
module outside the image's packages (scripts/gpu_image.txt) and the wheels it carries
(scripts/gpu_wheels.py's plan) is refused, in every process the script starts; the CPU switch runs
the same steps small. The verdict JSON, the deadline and what $OUT may hold are asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
packaging = pytest.importorskip("packaging.utils")

import gpu_check  # noqa: E402
from gpu_wheels import carry_plan, image_packages  # noqa: E402

pytestmark = pytest.mark.timeout(600)

BLOCKER = '''
import sys
from importlib.machinery import PathFinder

REFUSED = frozenset({refused!r})
ALLOWED_DISTRIBUTIONS = frozenset({allowed!r})


class ImageOnly:
    """The path finder, blind to what the GPU image lacks and the check does not carry."""

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.partition(".")[0] in REFUSED:
            return None  # as if not installed: find_spec says None, import raises
        return PathFinder.find_spec(name, path, target)

    @classmethod
    def find_distributions(cls, context=None):
        for dist in PathFinder.find_distributions(*([context] if context else [])):
            name = (dist.metadata["Name"] or "").lower().replace("_", "-").replace(".", "-")
            if name in ALLOWED_DISTRIBUTIONS:
                yield dist

    @classmethod
    def invalidate_caches(cls):
        PathFinder.invalidate_caches()


sys.meta_path[:] = [ImageOnly if f is PathFinder else f for f in sys.meta_path]
'''


def allowed_distributions() -> set[str]:
    """The image's distributions, the carried ones and streamrl."""
    image = image_packages()
    return set(image) | set(carry_plan(image)) | {"streamrl"}


def refused_modules() -> list[str]:
    """Top-level modules provided here only by distributions the image lacks and nobody
    carries."""
    allowed = allowed_distributions()
    return sorted(
        module
        for module, dists in packages_distributions().items()
        if not any(packaging.canonicalize_name(d) in allowed for d in dists)
    )


@pytest.fixture(scope="module")
def image_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    block = tmp_path_factory.mktemp("image")
    refused = refused_modules()
    allowed = sorted(allowed_distributions())
    (block / "sitecustomize.py").write_text(BLOCKER.format(refused=refused, allowed=allowed))
    return {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(block),
        "GPU_CHECK_DEVICE": "cpu",
    }


def test_the_emulated_image_refuses_what_it_lacks(image_env):
    refused = set(refused_modules())
    assert "ray" in refused and "mkdocs" in refused  # not on the image, not carried
    assert not {"jsonargparse", "datasets", "torch", "transformers"} & refused
    probe = "import torch, transformers, yaml; import ray"
    done = subprocess.run([sys.executable, "-c", probe], env=image_env, capture_output=True)
    assert done.returncode == 1 and b"No module named 'ray'" in done.stderr
    carried = subprocess.run([sys.executable, "-c", "import jsonargparse"], env=image_env)
    assert carried.returncode == 0  # carried as a wheel: allowed


def test_the_gpu_check_starts_on_the_image_and_gives_its_verdict(image_env, tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    env = {**image_env, "OUT": str(out), "GPU_CHECK_WORK": str(work)}
    done = subprocess.run(
        ["bash", "scripts/gpu_check.sh"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=gpu_check.DEADLINE_S + 30,
    )
    verdict = json.loads(done.stdout.strip().splitlines()[-1])  # the last stdout line
    steps = verdict["steps"]
    assert done.returncode == 0, (steps, (out / "steps.log").read_text()[-3000:])
    assert verdict["verdict"] == "PASS", (steps, (out / "steps.log").read_text()[-3000:])
    assert {name: s["verdict"] for name, s in steps.items()} == {
        "preflight": "PASS",
        "gpu-tests": "PASS",
        "model": "PASS",
        "fit": "PASS",
        "edges": "SKIP",
        "width": "PASS",
        "weights": "PASS",
        "vllm": "SKIP",
    }
    fit = steps["fit"]
    assert fit["samples_lost"] == 0 and all(g > 0 for g in fit["grad_norms"])
    assert fit["logprob_gap_max"] < gpu_check.LOGPROB_GAP_BOUND
    assert all(v["match"] and v["changed"] for v in steps["weights"]["versions"])
    assert verdict["wall_s"] < gpu_check.DEADLINE_S
    files = sorted(out.iterdir())
    assert len(files) <= 6 and all(f.stat().st_size < 64 * 1024 for f in files), files
    assert json.loads((out / "gpu_check.json").read_text()) == verdict


def test_the_steps_limits_fit_the_deadline():
    budget = sum(gpu_check.LIMITS.values()) + gpu_check.WHEELS_LIMIT_S + gpu_check.VERDICT_S
    assert budget <= gpu_check.DEADLINE_S
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    assert f"timeout -k 5 {gpu_check.WHEELS_LIMIT_S} python3 -m pip" in script
    assert f"timeout -k 5 {gpu_check.DEADLINE_S:.0f} python3 scripts/gpu_check.py" in script
