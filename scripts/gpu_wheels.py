"""The wheels a lent GPU machine needs to run streamrl, derived from the project's dependencies
minus what its image holds (scripts/gpu_image.txt). The machine has no network, so they travel
with the device tool's `carry` (.whl/ is ignored by git).

    python scripts/gpu_wheels.py            # plan, then download into .whl/ (Python 3.12 wheels)
    python scripts/gpu_wheels.py --plan     # print the plan only

Walks the requirements of the installed `streamrl` (plus the HF engine's transformers) in this
project's .venv: a requirement the image satisfies stays the image's (its own dependencies are
its business); any other is carried at the version this .venv runs, and its requirements are
walked in turn. Writes .whl/carry.json: each carried distribution, its version, its wheel and the
top-level modules it provides (tests/test_gpu_check.py allows exactly those beside the image's).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
IMAGE = ROOT / "scripts" / "gpu_image.txt"
WHEELS = ROOT / ".whl"
#: What streamrl needs beyond its base requirements on a GPU check: the HF engine's transformers.
EXTRA_ROOTS = ("transformers>=5.20",)
#: The image's interpreter and platform, for markers and wheel tags.
PYTHON = "3.12"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "any")


def image_packages(path: Path = IMAGE) -> dict[str, Version | None]:
    """``{canonical name: version or None (version not known)}`` of the image."""
    packages: dict[str, Version | None] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("python=="):
            continue
        name, _, version = line.partition("==")
        packages[canonicalize_name(name)] = Version(version) if version else None
    return packages


def carry_plan(image: dict[str, Version | None]) -> dict[str, str]:
    """``{distribution: version}`` to carry: the closure of streamrl's requirements the image
    does not satisfy, at this environment's installed versions."""
    environment = {
        **default_environment(),
        "python_version": PYTHON,
        "python_full_version": f"{PYTHON}.3",
        "sys_platform": "linux",
        "platform_system": "Linux",
    }
    roots = [Requirement(r) for r in metadata.requires("streamrl") or []]
    todo = [(r, "") for r in roots] + [(Requirement(r), "") for r in EXTRA_ROOTS]
    carry: dict[str, str] = {}
    seen: set[tuple[str, frozenset]] = set()
    while todo:
        requirement, extra = todo.pop()
        if requirement.marker is not None and not requirement.marker.evaluate(
            {**environment, "extra": extra}
        ):
            continue
        name = canonicalize_name(requirement.name)
        if name in image and (image[name] is None or image[name] in requirement.specifier):
            continue  # the image's: satisfied
        installed = metadata.version(requirement.name)
        if installed not in requirement.specifier:
            raise SystemExit(f"{requirement} is not satisfied here either ({installed})")
        key = (name, frozenset(requirement.extras))
        if key in seen:
            continue
        seen.add(key)
        carry[name] = installed
        for sub in metadata.requires(requirement.name) or []:
            sub_requirement = Requirement(sub)
            extras = requirement.extras or {""}
            todo += [(sub_requirement, e) for e in extras]
    return dict(sorted(carry.items()))


def top_level_modules(distribution: str) -> list[str]:
    """The importable top-level names a distribution installs (from its RECORD)."""
    names = set()
    for file in metadata.distribution(distribution).files or []:
        top = file.parts[0]
        if top.endswith((".dist-info", ".data")) or top == "..":
            continue
        names.add(top.removesuffix(".py").split(".")[0])
    return sorted(n for n in names if n.isidentifier())


def download(plan: dict[str, str]) -> list[dict]:
    """Python 3.12 wheels of ``plan`` into .whl/ (emptied first)."""
    WHEELS.mkdir(exist_ok=True)
    for old in WHEELS.glob("*.whl"):
        old.unlink()
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            PYTHON,
            "--implementation",
            "cp",
            *platforms,
            "-d",
            str(WHEELS),
            *[f"{name}=={version}" for name, version in plan.items()],
        ],
        check=True,
    )
    wheels = {canonicalize_name(w.name.split("-")[0]): w.name for w in WHEELS.glob("*.whl")}
    missing = sorted(set(plan) - set(wheels))
    if missing:
        raise SystemExit(f"no Python {PYTHON} wheel downloaded for {missing}")
    return [
        {"name": n, "version": v, "wheel": wheels[n], "modules": top_level_modules(n)}
        for n, v in plan.items()
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", action="store_true", help="print the plan, download nothing")
    args = parser.parse_args()
    plan = carry_plan(image_packages())
    print(json.dumps(plan))
    if args.plan:
        return
    carried = download(plan)
    (WHEELS / "carry.json").write_text(json.dumps(carried, indent=1))
    size = sum(w.stat().st_size for w in WHEELS.glob("*.whl"))
    print(f"{len(carried)} wheels, {size / 2**20:.1f} MiB in {WHEELS}")


if __name__ == "__main__":
    main()
