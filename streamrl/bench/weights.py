"""``streamrl bench weights``: what moving one weight version costs, the old path beside the new,
each case in a fresh process (docs/weight_transfer.md).

For each number of generator instances and trainer ranks, ``old`` (the whole float32 state
gathered and cloned, then sent to each instance in turn, received into fresh full buffers) and
``new`` (staged once in the wire dtype, bucket by bucket, and passed down a chain of instances
that load from their own staging) push the same versions of the same model
(``streamrl.bench.weights_case``). Per case: seconds per version (median), the trainer's and the
instances' peak extra memory during the pushes, the trainer's egress per version, the model's
and the staging's bytes.
"""

from __future__ import annotations

import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from streamrl.bench.memory import GIB, run_in_fresh_process
from streamrl.bench.weights_case import WeightsCase
from streamrl.errors import ConfigError

__all__ = ["bench_weights", "weight_cases"]

PATHS = ("old", "new", "vllm", "protocol")


def weight_cases(
    model_dir: str,
    instances: list[int],
    trainer_ranks: list[int],
    paths: list[str],
    **options: Any,
) -> list[WeightsCase]:
    """Every combination, old before new at each size.

    Raises:
        ConfigError: an unknown path, or a count below 1.
    """
    if unknown := sorted(set(paths) - set(PATHS)):
        raise ConfigError(
            f"bench weights: unknown paths {unknown}; --paths takes any of {','.join(PATHS)}."
        )
    if min(instances + trainer_ranks) < 1:
        raise ConfigError("bench weights: --instances and --trainer-ranks take counts >= 1.")
    return [
        WeightsCase(path, n, r, model_dir, **options)
        for r in trainer_ranks
        for n in instances
        for path in paths
    ]


def bench_weights(cases: list[WeightsCase], timeout_s: float = 3600.0) -> dict[str, Any]:
    """Run each case in a fresh process; print a table on stderr.

    Returns:
        ``{"cases": [...], "model_dir": ..., ...}``: each case's ``path``, ``instances``,
        ``seconds_per_version``, ``trainer_peak_extra_bytes``, ``generator_peak_extra_bytes``,
        ``egress_bytes_per_version``, ``model_bytes`` (in its wire dtype), ``bucket_bytes``,
        ``staging_bytes`` and the rest (``weights_case``); a case that failed has ``error``
        (``oom: true`` when it ran out of memory).
    """
    results = []
    for case in cases:
        label = f"{case.path} instances={case.instances} trainer_ranks={case.trainer_ranks}"
        print(f"weights: {label} ...", file=sys.stderr, flush=True)
        base = {"path": case.path, "instances": case.instances}
        base["trainer_ranks"], base["oom"] = case.trainer_ranks, False
        results.append(
            run_in_fresh_process("streamrl.bench.weights_case", asdict(case), base, timeout_s)
        )
        print(f"weights: {label}: {_cells(results[-1])}", file=sys.stderr, flush=True)
    print(_table(results), file=sys.stderr)
    first = cases[0]
    return {
        "cases": results,
        "model_dir": first.model_dir,
        "versions": first.versions,
        "wire_dtype_new": first.wire_dtype,
        "bucket_bytes": first.bucket_bytes,
    }


def random_model_dir(size: str) -> str:
    """A random-weights model directory of a built-in shape, in a temporary directory."""
    from streamrl.policy.models import write_random_policy

    out = Path(tempfile.mkdtemp(prefix=f"streamrl-weights-{size}-")) / "model"
    print(f"weights: writing a random {size} model to {out} ...", file=sys.stderr, flush=True)
    return str(write_random_policy(out, size, context=256))


def _gib(value: Any) -> str:
    return "-" if value is None else f"{value / GIB:.3f}"


def _cells(r: dict[str, Any]) -> str:
    if "error" in r:
        return ("OOM: " if r.get("oom") else "failed: ") + r["error"].splitlines()[-1][:200]
    return (
        f"{r['seconds_per_version']:.2f} s/version, trainer +{_gib(r['trainer_peak_extra_bytes'])}"
        f" GiB (staging {_gib(r['staging_bytes'])}), instance +"
        f"{_gib(r['generator_peak_extra_bytes'])} GiB, egress "
        f"{_gib(r['egress_bytes_per_version'])} GiB/version (model {_gib(r['model_bytes'])} GiB "
        f"{r['wire_dtype']})" + _join_cells(r)
    )


def _join_cells(r: dict[str, Any]) -> str:
    """vLLM's protocol: a newcomer's catch-up alone against forming the shared group again."""
    if "catch_up_s" not in r:
        return ""
    return (
        f"; a newcomer: catch-up alone {r['catch_up_s']:.2f} s, group formed again "
        f"{r['formed_again_s']:.2f} s (first {r['first_formed_s'] or 0:.2f} s), that version "
        f"{r['version_with_newcomer_s']:.2f} s"
    )


def _table(results: list[dict[str, Any]]) -> str:
    head = (
        "| path | instances | trainer ranks | s/version | trainer extra GiB | staging GiB | "
        "instance extra GiB | egress GiB/version | model GiB (wire) |\n|---|---|---|---|---|---|"
        "---|---|---|"
    )
    rows = []
    for r in results:
        if "error" in r:
            rows.append(
                f"| {r['path']} | {r['instances']} | {r['trainer_ranks']} | "
                + ("OOM" if r.get("oom") else "failed")
                + " | | | | | |"
            )
            continue
        rows.append(
            f"| {r['path']} | {r['instances']} | {r['trainer_ranks']} | "
            f"{r['seconds_per_version']:.2f} | {_gib(r['trainer_peak_extra_bytes'])} | "
            f"{_gib(r['staging_bytes'])} | {_gib(r['generator_peak_extra_bytes'])} | "
            f"{_gib(r['egress_bytes_per_version'])} | {_gib(r['model_bytes'])} "
            f"({r['wire_dtype']}) |"
        )
    return "\n".join([head, *rows])
