"""The run's metrics in one CSV file across every start of a resumed run.

Lightning's ``CSVLogger`` starts a new ``version_N`` folder at each start (a resumed run's
metrics split across two files), or, given the same version, deletes the file it finds.
``RunCSVLogger`` keeps ``<output_dir>/logs/version_0/metrics.csv``: a resumed start's rows
follow the earlier ones, and the rows of the steps it logs again (iterations redone after a
stop) are replaced, not repeated.
"""

from __future__ import annotations

import csv
from pathlib import Path

from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment

__all__ = ["RunCSVLogger"]


class RunCSVLogger(CSVLogger):
    """``CSVLogger`` writing ``<save_dir>/logs/version_0/metrics.csv``, continued on resume."""

    def __init__(self, save_dir: str | Path) -> None:
        super().__init__(str(save_dir), name="logs", version=0)

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _ContinuedWriter(self.log_dir)
        return self._experiment


class _ContinuedWriter(ExperimentWriter):
    """Lightning's writer, keeping the rows an earlier start wrote before this start's first
    step."""

    def _check_log_dir_exists(self) -> None:  # Lightning's deletes the file
        path = Path(self.metrics_file_path)
        self._earlier: list[dict[str, str]] | None = None
        if path.is_file():
            with path.open(newline="") as f:
                self._earlier = list(csv.DictReader(f))

    def save(self) -> None:
        if self._earlier is not None and self.metrics:
            first = min(int(m["step"]) for m in self.metrics)
            kept = [row for row in self._earlier if int(float(row["step"])) < first]
            keys = {k for row in (*kept, *self.metrics) for k in row}
            self.metrics_keys = sorted(keys)
            with open(self.metrics_file_path, "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=self.metrics_keys)
                writer.writeheader()
                writer.writerows(kept)
            self._earlier = None
        super().save()
