"""One output directory, one run: a rerun into a directory that holds an earlier run is explicit.

Lightning would write a second run's checkpoints beside the first's (``last-v1.ckpt``) and leave
``last.ckpt`` naming the old run, so resuming "the last checkpoint" would resume the wrong run.
A run into a directory with checkpoints therefore either goes on from them (``--resume auto``,
or the checkpoint's path), or is refused with what to do; ``streamrl demo`` starts over in a
fresh directory beside the old one instead (a second ``make demo`` just works).

Examples:
    >>> import tempfile
    >>> out = Path(tempfile.mkdtemp())
    >>> resolve_resume(out, "auto") is None  # nothing to go on from: a fresh run
    True
    >>> (out / "checkpoints").mkdir(); (out / "checkpoints" / "last.ckpt").write_bytes(b"")
    0
    >>> resolve_resume(out, "auto") == str(out / "checkpoints" / "last.ckpt")
    True
    >>> fresh_output_dir(out).name == out.name + "-2"
    True
"""

from __future__ import annotations

import json
from pathlib import Path

from streamrl.errors import ConfigError

__all__ = ["AUTO", "earlier_run", "finished_run", "fresh_output_dir", "resolve_resume"]

#: ``--resume auto``: go on from the output directory's last checkpoint if there is one.
AUTO = "auto"


def earlier_run(output_dir: str | Path) -> Path | None:
    """The checkpoint an earlier run left in ``output_dir`` (the newer of its ``last.ckpt`` and
    of the ``hpc_ckpt_N.ckpt`` Lightning saves on SLURM's requeue signal; else its newest
    one), or ``None``."""
    folder = Path(output_dir) / "checkpoints"
    candidates = [folder / "last.ckpt", *Path(output_dir).glob("hpc_ckpt_*.ckpt")]
    latest = [p for p in candidates if p.exists()]
    if not latest and folder.is_dir():
        latest = list(folder.glob("*.ckpt"))
    return max(latest, key=lambda p: p.stat().st_mtime, default=None)


def resolve_resume(output_dir: str | Path, resume: str | None) -> str | None:
    """The checkpoint a run into ``output_dir`` goes on from (``None``: from the start).

    Args:
        output_dir: the run's output directory.
        resume: ``--resume``: a checkpoint, ``"auto"`` (the directory's last checkpoint, if
            any: the same command line starts a run and, after a preemption, continues it), or
            ``None``.

    Raises:
        ConfigError: no checkpoint at ``resume``, or ``resume`` is ``None`` and ``output_dir``
            holds an earlier run's checkpoints.
    """
    if resume == AUTO:
        found = earlier_run(output_dir)
        return str(found) if found is not None else None
    if resume is not None:
        if not Path(resume).exists():  # a file, or a folder of shards
            raise ConfigError(f"--resume: no checkpoint at {resume!r}.")
        return resume
    found = earlier_run(output_dir)
    if found is not None:
        raise ConfigError(
            f"output_dir {str(output_dir)!r} holds an earlier run (its checkpoint {found}): go on "
            f"from it with --resume auto (run_fit(..., resume='auto') in Python), or start over "
            "in another output_dir (or remove this one)."
        )
    return None


def finished_run(output_dir: str | Path, checkpoint: str | None, iterations: int) -> dict | None:
    """The summary of a run in ``output_dir`` that already did all ``iterations`` (its
    ``summary.json``, written at its end, at least as new as ``checkpoint``), or ``None``: a
    resume then has nothing to do (and would rerun both evaluations and write a summary of
    nothing over it). With more ``iterations`` than it did, it goes on."""
    summary_path = Path(output_dir) / "summary.json"
    if checkpoint is None or not summary_path.is_file():
        return None
    if summary_path.stat().st_mtime < Path(checkpoint).stat().st_mtime:
        return None  # a checkpoint after the summary: the run went on since
    try:
        summary = json.loads(summary_path.read_text())
    except (OSError, ValueError):
        return None
    done = summary.get("iterations") if isinstance(summary, dict) else None
    return summary if isinstance(done, int) and done >= iterations else None


def fresh_output_dir(output_dir: str | Path) -> Path:
    """``output_dir`` if it holds no earlier run, else the first of ``<output_dir>-2``,
    ``-3``... that holds none."""
    path = Path(output_dir)
    candidate, n = path, 1
    while earlier_run(candidate) is not None:
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    return candidate
