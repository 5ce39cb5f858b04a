"""What each iteration trained on, handed to a sink after its optimizer step; Parquet on disk.

``RolloutRecorder`` is a Lightning callback: after every iteration it passes the samples that
went through that iteration's loss (each with its advantage) to a ``RolloutSink``, any callable
``sink(iteration, trained)``. ``ParquetRollouts`` is the sink ``rl.save_rollouts: true`` uses:
one file per iteration, ``<output_dir>/rollouts/iteration-000007.parquet``, written on a
background thread so the loop does not wait for the disk.

What is written is what was trained, exactly: the micro-batches the module back-propagated
(``StreamRLModule.trained_batches``; with FSDP, rank 0 holds every rank's share). Groups an
algorithm filtered out (dynamic sampling) and samples dropped for staleness never reach the loss,
so they are not written. A resumed run writes its iterations on; an iteration run again after a
resume overwrites its file.

Examples:
    >>> import datasets  # doctest: +SKIP
    >>> rows = datasets.load_dataset(  # doctest: +SKIP
    ...     "parquet", data_files="runs/demo/rollouts/*.parquet", split="train")
    >>> rows[0]["token_ids"], rows[0]["advantage"]  # doctest: +SKIP
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import lightning as L
import pyarrow as pa
import pyarrow.parquet as pq

from streamrl.records import Sample

#: An iteration's file under the rollouts directory.
FILE_NAME = "iteration-{:06d}.parquet"
#: Each column's Arrow type (``reward_parts``, a struct of the run's reward labels, is inferred),
#: so that every file of a run has the same schema.
COLUMN_TYPES: dict[str, pa.DataType] = {
    "iteration": pa.int64(),
    "prompt_id": pa.string(),
    "sample_index": pa.int64(),
    "prompt_ids": pa.list_(pa.int64()),
    "token_ids": pa.list_(pa.int64()),
    "loss_mask": pa.list_(pa.int8()),
    "token_versions": pa.list_(pa.int64()),
    "logprobs": pa.list_(pa.float64()),
    "weight_version": pa.int64(),
    "reward": pa.float64(),
    "advantage": pa.float64(),
    "finish_reason": pa.string(),
    "instance_id": pa.int64(),
    "turns": pa.int64(),
}


@dataclass
class TrainedSample:
    """One sample as its iteration's loss took it.

    Attributes:
        sample: the sample (an episode in a multi-turn run), reward and reward parts filled in.
        advantage: the advantage the loss weighted it by.
    """

    sample: Sample
    advantage: float


class RolloutSink(Protocol):
    """Receives each iteration's trained samples, in the main process, after its optimizer step.

    Any callable ``sink(iteration, trained)`` is one; a sink with a ``close()`` method has it
    called when training ends or fails, and one with ``flush()`` before each checkpoint.
    """

    def __call__(self, iteration: int, trained: list[TrainedSample]) -> None: ...


def rollout_columns(iteration: int, trained: Sequence[TrainedSample]) -> dict[str, list]:
    """The columns of an iteration's rows, one row per trained sample (per-token lists expanded:
    a ``None`` loss mask is all 1, ``None`` token versions all the sample's weight version)."""
    samples = [t.sample for t in trained]
    parts = [s.reward_parts or None for s in samples]
    return {
        "iteration": [iteration] * len(samples),
        "prompt_id": [s.prompt_id for s in samples],
        "sample_index": [s.sample_index for s in samples],
        "prompt_ids": [list(s.prompt_ids) for s in samples],
        "token_ids": [list(s.token_ids) for s in samples],
        "loss_mask": [list(s.loss_mask or [1] * s.length) for s in samples],
        "token_versions": [
            list(s.token_versions or [s.weight_version] * s.length) for s in samples
        ],
        "logprobs": [list(s.logprobs) for s in samples],
        "weight_version": [s.weight_version for s in samples],
        "reward": [s.reward for s in samples],
        "reward_parts": parts if any(parts) else [None] * len(samples),
        "advantage": [float(t.advantage) for t in trained],
        "finish_reason": [s.finish_reason for s in samples],
        "instance_id": [s.instance_id for s in samples],
        "turns": [s.turns for s in samples],
    }


class ParquetRollouts:
    """A ``RolloutSink`` writing one Parquet file per iteration into ``directory``.

    Files are written on one background thread (atomically: a temporary file, then renamed),
    in order; a failed write is raised on the next call, ``flush()`` or ``close()``. An
    iteration that trained nothing has no file.

    Args:
        directory: where ``iteration-000007.parquet`` and the others go (created).

    Examples:
        >>> import tempfile
        >>> sink = ParquetRollouts(tempfile.mkdtemp())
        >>> sink(0, [])  # an iteration that trained nothing has no file
        >>> sink.close()
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-files")
        self._pending: list[Future] = []

    def path(self, iteration: int) -> Path:
        """The file of ``iteration``."""
        return self.directory / FILE_NAME.format(iteration)

    def __call__(self, iteration: int, trained: list[TrainedSample]) -> None:
        self._raise_failed(wait=False)
        self._pending.append(self._writer.submit(self._write, iteration, list(trained)))

    def flush(self) -> None:
        """Wait until every submitted iteration is on disk."""
        self._raise_failed(wait=True)

    def close(self) -> None:
        """Flush, then stop the writer thread (a second call does nothing)."""
        try:
            self.flush()
        finally:
            self._writer.shutdown(wait=True)

    def _write(self, iteration: int, trained: list[TrainedSample]) -> None:
        path = self.path(iteration)
        if not trained:  # no file (datasets cannot read an empty one); a redone one's goes
            path.unlink(missing_ok=True)
            return
        columns = rollout_columns(iteration, trained)
        table = pa.table({k: pa.array(v, type=COLUMN_TYPES.get(k)) for k, v in columns.items()})
        partial = path.with_suffix(".parquet.tmp")
        pq.write_table(table, partial)
        os.replace(partial, path)  # a redone iteration (after a resume) replaces its file

    def _raise_failed(self, wait: bool) -> None:
        pending, self._pending = self._pending, []
        for future in pending:
            if wait or future.done():
                future.result()  # raises the write's error
            else:
                self._pending.append(future)


class RolloutRecorder(L.Callback):
    """Hands each iteration's trained samples to ``sink`` after the iteration's optimizer step.

    Only the rank holding the stream records (rank 0; with FSDP's ``share_stream`` it deals, and
    so holds, every rank's micro-batches). The sink is flushed before each checkpoint, so a
    checkpoint never runs ahead of the files, and closed when training ends or fails.

    Args:
        sink: a ``RolloutSink``: ``ParquetRollouts(dir)`` or any ``fn(iteration, trained)``.

    Examples:
        >>> seen = []
        >>> recorder = RolloutRecorder(lambda it, trained: seen.append((it, len(trained))))
        >>> # build_trainer(module, callbacks=[recorder]).fit(module)
    """

    def __init__(self, sink: RolloutSink) -> None:
        self.sink = sink

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        if pl_module.rollouts is not None:
            pl_module.trained_batches = []  # from now on the module keeps what it trains

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._hand_over(pl_module)

    def _hand_over(self, pl_module: Any) -> None:
        """Give the sink the iteration whose optimizer step is done (``settled_batches``), if
        it has not had it yet; an iteration cut short before its step is never written."""
        settled = getattr(pl_module, "settled_batches", None)
        if settled is None:
            return
        pl_module.settled_batches = None
        iteration, batches = settled
        trained = [
            TrainedSample(sample, advantage)
            for micro in batches
            for sample, advantage in zip(micro.samples, micro.advantages)
        ]
        self.sink(iteration, trained)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: Any, checkpoint: dict) -> None:
        flush = getattr(self.sink, "flush", None)
        if flush is not None:
            flush()

    def on_train_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        self._close()

    def on_exception(self, trainer: L.Trainer, pl_module: Any, exception: BaseException) -> None:
        try:
            # A stop after the step and before this iteration's end: the stop's checkpoint
            # counts that iteration as trained, so its file is written too.
            self._hand_over(pl_module)
            self._close()
        except Exception as error:  # the run's own error is the one to raise
            print(f"streamrl: rollout files not all written: {error!r}", file=sys.stderr)

    def _close(self) -> None:
        close = getattr(self.sink, "close", None)
        if close is not None:
            close()
