"""Progress display for long work, always on stderr so that stdout stays machine-readable.

``progress_bar`` wraps an iterable in a tqdm bar; ``IterationBar`` is the Lightning progress bar
of an RL run (Lightning's own draw on stdout); ``Stages`` prints the headings of a run's stages.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

import lightning as L
from lightning.pytorch.callbacks import ProgressBar
from tqdm.auto import tqdm

T = TypeVar("T")


def progress_bar(iterable: Iterable[T], desc: str, enabled: bool = True, **kw) -> tqdm:
    """A tqdm bar on stderr; ``enabled=False`` keeps the same interface but draws nothing.

    Redrawn at most every 0.5 s on a terminal and every 15 s into a log file or pipe, so logs
    stay readable.
    """
    interval = 0.5 if sys.stderr.isatty() else 15.0
    return tqdm(
        iterable,
        desc=desc,
        disable=not enabled,
        file=sys.stderr,
        dynamic_ncols=True,
        mininterval=interval,
        **kw,
    )


class IterationBar(ProgressBar):
    """Lightning's progress bar for RL runs: one tick per iteration, on stderr.

    Lightning's own bars (``TQDMProgressBar``, ``RichProgressBar``) draw on stdout and count
    epochs, which an RL run does not have ("Epoch 0/-2"). This one counts iterations out of
    ``max_steps`` (a resumed run starts where it was) and shows the metrics the module logs
    with ``prog_bar=True`` (reward, samples/s, wait, train and sync seconds).
    """

    def __init__(self) -> None:
        super().__init__()
        self._enabled = True
        self._bar: tqdm | None = None

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._bar = progress_bar(
            range(trainer.max_steps),
            "rl iterations",
            enabled=self._enabled,
            initial=trainer.global_step,
            total=trainer.max_steps,
        )

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        if self._bar is None:
            return
        metrics = {
            k: f"{v:.3g}" if isinstance(v, float) else v
            for k, v in self.get_metrics(trainer, pl_module).items()
            if k != "v_num"
        }
        self._bar.set_postfix(metrics, refresh=False)
        self._bar.update(trainer.global_step - self._bar.n)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._close()

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self._close()

    def _close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class Stages:
    """Numbered headings on stderr, one per stage of a run: what it does now, how long it takes.

    Args:
        names: the stages in order (their count is the ``N`` of ``[n/N]``).
        expected: per stage, how long it takes where that is known (``"about 2 min on 2 CPU
            cores"``), shown after its heading.
        enabled: ``False`` prints nothing.
    """

    def __init__(
        self,
        names: Sequence[str],
        expected: Mapping[str, str] | None = None,
        *,
        enabled: bool = True,
    ) -> None:
        self.names = list(names)
        self.expected = dict(expected or {})
        self.enabled = enabled

    def start(self, name: str, what: str) -> None:
        """Print stage ``name``'s heading: ``[n/N] what (expected length)``."""
        if not self.enabled:
            return
        number = self.names.index(name) + 1
        length = f" ({self.expected[name]})" if name in self.expected else ""
        print(f"\n[{number}/{len(self.names)}] {what}{length}", file=sys.stderr, flush=True)
