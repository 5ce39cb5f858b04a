"""Checkpoints a run can always resume from: written whole or not at all, and one more when the
run is stopped (SIGTERM, Ctrl-C), so a preemption loses no finished iteration.

- **Atomic files** (``AtomicCheckpointIO``): a checkpoint is written to a hidden partial file
  next to its name, flushed to disk, then renamed over the old one. A process killed mid-save
  (``kill -9``, the node's power) leaves the previous checkpoint as it was, and only a partial
  file that the next save replaces. It also streams ``torch.save`` to the file: Lightning's
  own writer first serializes the whole checkpoint into memory, a second copy of the weights
  and optimizer states (about 6 GB for a 0.5B policy with AdamW).
- **A checkpoint at the stop** (``RunCheckpoint.on_exception``): when ``streamrl.runtime.stopping``
  stops the run, the iterations finished since the last periodic checkpoint are saved to
  ``last.ckpt``; the iteration under way is abandoned (its prompts are in the checkpoint's
  in-flight state and are generated again on resume, its partial gradients are dropped), so
  the resumed run trains every sample once. The save has ``stop_deadline_s`` seconds (a scheduler
  kills a stopped job after a grace period): past it the save is abandoned and the previous
  checkpoint stays. With several trainer ranks, rank 0 alone acts on the signal
  (``streamrl.runtime.stopping.ignore_signals`` on the others), and only where every other rank
  waits for its next share of samples; it tells them (``ShardedStreamRLModule.stop_ranks``) and all
  save the checkpoint together (a collective).
"""

from __future__ import annotations

import os
import signal
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint

from streamrl.errors import ConfigError
from streamrl.runtime.atomic_files import fsync_dir
from streamrl.runtime.stopping import DeadlinePassed, Stopped, hold_signal, shielded, time_limit
from streamrl.training.fsdp import ShardedStreamRLModule
from streamrl.training.timeline import trainer_span

__all__ = ["AtomicCheckpointIO", "CheckpointSchedule", "RunCheckpoint"]


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint writer, made atomic and streamed (see the module's docstring)."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None
    ) -> None:
        if storage_options is not None:
            raise TypeError("AtomicCheckpointIO takes no storage_options.")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.partial")
        try:
            with open(partial, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(partial, path)  # the one step that makes it visible: all or nothing
            fsync_dir(path.parent)
        finally:
            partial.unlink(missing_ok=True)


@dataclass(frozen=True)
class CheckpointSchedule:
    """When a run writes its checkpoints (``rl.checkpoints``): ``<output_dir>/checkpoints/
    last.ckpt`` every ``every`` iterations, after the last one, and when the run is stopped.

    Args:
        every: iterations between checkpoints (resumable with ``streamrl fit --resume``); 0:
            only at the end, and at a stop.
        stop_deadline_s: the most seconds a stopped run (SIGTERM, Ctrl-C) spends saving its
            finished iterations (keep it under your scheduler's grace period, e.g. SLURM's
            ``KillWait``); past it the save is abandoned and the previous checkpoint stays;
            ``None``: no limit.

    Raises:
        ConfigError: ``every < 0`` or ``stop_deadline_s <= 0``.
    """

    every: int = 10
    stop_deadline_s: float | None = 60.0

    def __post_init__(self) -> None:
        if self.every < 0 or (self.stop_deadline_s is not None and not self.stop_deadline_s > 0):
            raise ConfigError(
                "CheckpointSchedule: need every >= 0 (0: only at the end) and stop_deadline_s "
                f"> 0 (or null: no limit), got every={self.every}, "
                f"stop_deadline_s={self.stop_deadline_s}."
            )

    def callback(self, output_dir: str | Path) -> RunCheckpoint:
        """The Lightning callback writing them under ``output_dir``. Under FSDP every rank
        builds it: saving is collective."""
        # A checkpoint holds the state after an iteration's optimizer step: what a resume needs.
        warnings.filterwarnings("ignore", "Using ModelCheckpoint with manual optimization")
        return RunCheckpoint(
            Path(output_dir) / "checkpoints",
            save_last=True,
            every_n_train_steps=self.every or None,
            save_top_k=1 if self.every else 0,
            enable_version_counter=False,  # one run per output directory (``reruns``): its own
            stop_deadline_s=self.stop_deadline_s,
        )


class RunCheckpoint(ModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` whose saves a stop never cuts short (``shielded``), and
    which saves ``last.ckpt`` when the run is stopped (see the module's docstring)."""

    def __init__(self, *args: Any, stop_deadline_s: float | None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stop_deadline_s = stop_deadline_s
        self._training = False
        self._stopped_by: str | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._training = True  # the checkpoint (if any) is restored: the run's state is whole
        hold_signal(signal.SIGUSR1)  # Lightning's SLURM requeue save waits for a whole step

    def on_save_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if self._stopped_by is not None:
            checkpoint["stopped_by"] = self._stopped_by

    def _save_checkpoint(self, trainer: L.Trainer, filepath: str) -> None:
        # On the run's timeline, tagged with the iteration just finished (the one saved).
        done = int(getattr(trainer.lightning_module, "weight_version", trainer.global_step))
        span = trainer_span(trainer.lightning_module, "checkpoint", done - 1, path=filepath)
        with shielded(), span:
            super()._save_checkpoint(trainer, filepath)

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        if not isinstance(exception, Stopped) or not self._training:
            return
        say = _say if trainer.is_global_zero else lambda message: None
        if trainer.world_size > 1:  # saving is a collective: rank 0 stops the others first
            if not (isinstance(pl_module, ShardedStreamRLModule) and pl_module.share_stream):
                say("no checkpoint at the stop (ranks with streams of their own)")
                return
            if trainer.is_global_zero:
                pl_module.stop_ranks(exception)
        self._stopped_by = exception.signal
        step, started = trainer.global_step, time.perf_counter()
        limit = (
            "no limit" if self.stop_deadline_s is None else f"at most {self.stop_deadline_s:g} s"
        )
        say(
            f"{exception.signal}: saving the {step} finished iterations to {self.dirpath}/"
            f"last.ckpt ({limit}, rl.checkpoints.stop_deadline_s)"
        )
        try:
            with time_limit(self.stop_deadline_s):
                self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        except DeadlinePassed:
            say(
                f"the save passed rl.checkpoints.stop_deadline_s ({self.stop_deadline_s:g} s) and "
                "was abandoned: the previous checkpoint stays as it was"
            )
            return
        say(f"checkpoint saved in {time.perf_counter() - started:.1f} s")

    # Their saves, and the decisions before them, are collectives under FSDP: a stop waits.
    def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
        with shielded():
            super().on_train_batch_end(*args, **kwargs)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        with shielded():
            super().on_train_end(trainer, pl_module)


def _say(message: str) -> None:
    print(f"streamrl: {message}", file=sys.stderr, flush=True)
