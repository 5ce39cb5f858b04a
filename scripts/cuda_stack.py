"""One CUDA stack: resolve streamrl's GPU extras the way a CUDA machine would (from PyPI, nothing
installed) and fail when torch, vLLM and the CUDA packages they pull in ask for different CUDA
major versions. A CI step (.ci/run, `make check-cuda-stack`).

    python scripts/cuda_stack.py                  # resolves '.[vllm,gpu]', prints the matrix
    python scripts/cuda_stack.py --report R.json  # reads a report pip wrote before

Runs `pip install --dry-run --ignore-installed --report` with this machine's pip configuration
left out (`--isolated`: here it prefers the CPU build of torch) against PyPI, then reads each
resolved package's CUDA major: a `-cuNN` or `cupy-cudaNNx` name, the version of the CUDA runtime
and toolkit packages, torch's `+cuNNN` local version. Prints one JSON object; exit code 1 when the
majors differ.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: CUDA packages whose major says nothing of the stack, with the reason.
IGNORED = {
    "nvidia-cutlass-dsl-libs-cu12": "nvidia-cutlass-dsl 4.8 requires its CUDA 12 libraries "
    "whatever the CUDA; its [cu13] extra, which vLLM asks for, adds the CUDA 13 ones",
}
#: Packages whose own version is the CUDA version.
VERSIONED = ("nvidia-cuda-runtime", "cuda-toolkit", "cuda-bindings", "cuda-python")


def cuda_major(name: str, version: str) -> int | None:
    """The CUDA major a resolved package belongs to, or None if it is not CUDA-specific.

    Examples:
        >>> cuda_major("nvidia-nccl-cu13", "2.29.7"), cuda_major("cupy-cuda12x", "14.2.0")
        (13, 12)
        >>> cuda_major("nvidia-cuda-runtime", "13.0.96"), cuda_major("torch", "2.13.0+cu126")
        (13, 12)
        >>> cuda_major("numpy", "2.5.2") is None
        True
    """
    name = name.lower().replace("_", "-")
    if found := re.search(r"-cu(\d+)$", name):
        return int(found.group(1))
    if found := re.fullmatch(r"cupy-cuda(\d+)x", name):
        return int(found.group(1))
    if name in VERSIONED:
        return int(version.split(".")[0])
    if found := re.search(r"\+cu(\d+?)(\d)$", version):  # +cu126: 12.6, +cu130: 13.0
        return int(found.group(1))
    return None


def matrix(report: dict) -> dict:
    """``{"majors": {major: [package==version...]}, "ignored": [...], "ok": bool}``."""
    majors: dict[int, list[str]] = {}
    ignored = []
    for item in report["install"]:
        name, version = item["metadata"]["name"], item["metadata"]["version"]
        major = cuda_major(name, version)
        if major is None:
            continue
        if name.lower() in IGNORED:
            ignored.append(f"{name}=={version}")
            continue
        majors.setdefault(major, []).append(f"{name}=={version}")
    key = {
        n: item["metadata"]["version"]
        for item in report["install"]
        for n in [item["metadata"]["name"].lower()]
        if n in ("torch", "vllm", "cupy-cuda13x", "cupy-cuda12x")
    }
    return {
        "packages": key,
        "majors": {str(k): sorted(v) for k, v in sorted(majors.items())},
        "ignored": ignored,
        "ok": len(majors) == 1,
    }


def resolve(extras: str) -> dict:
    """pip's report of installing ``.[extras]`` on a CUDA machine, installing nothing."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--isolated",
                "--dry-run",
                "--ignore-installed",
                "--quiet",
                "--index-url",
                "https://pypi.org/simple",
                "--report",
                str(report),
                f".[{extras}]",
            ],
            check=True,
            cwd=ROOT,
        )
        return json.loads(report.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--extras", default="vllm,gpu")
    parser.add_argument("--report", help="a pip report to read instead of resolving")
    args = parser.parse_args()
    report = json.loads(Path(args.report).read_text()) if args.report else resolve(args.extras)
    found = matrix(report)
    print(json.dumps(found))
    if not found["ok"]:
        print(f"CUDA majors differ: {found['majors']}", file=sys.stderr)
    return 0 if found["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
