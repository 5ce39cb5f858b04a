"""Periodic held-out evaluation during training (``rl.eval.every``): logged and plotted.

``PeriodicEval`` is a Lightning ``Callback``: every ``every`` RL iterations it calls its
evaluator on the module (``module -> EvalResult``: a run's decodes on its generator instances once
they hold the module's ``weight_version``, ``streamrl.eval.on_generators``; a notebook's may call
``streamrl.eval.heldout.evaluate`` on ``module.policy``), logs ``eval/reward``, ``eval/pass@1``,
``eval/pass@k`` and the per-data-source ``eval/reward/<task>`` to the trainer's loggers at step =
iteration, keeps every result in ``history``, and at the end of training draws ``eval.png``
(reward and pass@1 against the iteration, one line per data source).

Examples:
    >>> # evaluator = lambda module: evaluate(module.policy, tok, heldout, score=score)
    >>> # callback = PeriodicEval(evaluator, every=10, output_dir=out)
    >>> # L.Trainer(..., callbacks=[callback]).fit(module)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L

from streamrl.errors import ConfigError
from streamrl.eval.heldout import EvalResult
from streamrl.training.timeline import trainer_span


class PeriodicEval(L.Callback):
    """Evaluates the policy on held-out rows every ``every`` iterations with the run's reward.

    Args:
        evaluator: ``module -> EvalResult``: on the run's generators (``streamrl.run`` builds
            one with ``streamrl.eval.on_generators.ServiceDecoder``), or on the module's policy
            in this process (``lambda module: evaluate(module.policy, tokenizer, heldout)``: a
            policy sharded over several trainer ranks cannot decode on one of them).
        every: evaluate after each iteration whose count of finished iterations is a multiple
            of this (the count is the module's ``weight_version``).
        output_dir: where ``eval.png`` is written at the end of training; ``None`` draws nothing.
        at_start: also evaluate the starting weights (iteration 0) before the first step.

    Raises:
        ConfigError: ``every < 1``.

    Examples:
        >>> from streamrl.eval.heldout import evaluate
        >>> from streamrl.policy.models import build_tokenizer
        >>> from streamrl.tasks import make_prompt_set
        >>> tok, rows = build_tokenizer(), make_prompt_set(4)
        >>> callback = PeriodicEval(lambda module: evaluate(module.policy, tok, rows), every=2)
        >>> callback.history
        []
    """

    def __init__(
        self,
        evaluator: Callable[[L.LightningModule], EvalResult],
        *,
        every: int,
        output_dir: str | Path | None = None,
        at_start: bool = False,
    ) -> None:
        if every < 1:
            raise ConfigError(f"PeriodicEval: every must be >= 1 (iterations), got {every}.")
        self.evaluator, self.every, self.at_start = evaluator, every, at_start
        self.output_dir = Path(output_dir) if output_dir is not None else None
        #: One dict per evaluation: ``iteration``, ``eval/wall_s`` and ``EvalResult.metrics()``.
        self.history: list[dict[str, float]] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.at_start:
            self.run(trainer, pl_module)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        if _iteration(trainer, pl_module) % self.every == 0:
            self.run(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.output_dir is not None and self.history:
            plot_eval(self.history, self.output_dir / "eval.png")

    def run(self, trainer: L.Trainer, pl_module: L.LightningModule) -> EvalResult:
        """Evaluate ``pl_module`` now, log it to the trainer's loggers and record it."""
        iteration = _iteration(trainer, pl_module)
        started = time.perf_counter()
        # A span on the run's timeline (the trainer is busy here, not idle): tagged with the
        # iteration just finished, so the chart draws it inside that iteration.
        with trainer_span(pl_module, "eval", iteration - 1, after_iterations=iteration):
            result = self.evaluator(pl_module)
        metrics = self.record(iteration, result, wall_s=time.perf_counter() - started)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=iteration)
        return result

    def record(self, iteration: int, result: EvalResult, wall_s: float = 0.0) -> dict[str, float]:
        """Add an evaluation made elsewhere (e.g. the run's own before/after evaluation) to
        ``history``, replacing one at the same iteration; returns its logged metrics."""
        metrics = {**result.metrics("eval"), "eval/wall_s": wall_s}
        self.history = [h for h in self.history if h["iteration"] != iteration]
        self.history.append({"iteration": iteration, **metrics})
        self.history.sort(key=lambda h: h["iteration"])
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return {"history": [dict(h) for h in self.history]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = [dict(h) for h in state_dict.get("history", [])]


def _iteration(trainer: L.Trainer, pl_module: L.LightningModule) -> int:
    """Finished RL iterations: the module's weight version (it survives a resume)."""
    return int(getattr(pl_module, "weight_version", trainer.global_step))


def plot_eval(history: list[dict[str, float]], path: str | Path) -> Path:
    """Draw held-out reward and pass@1 against the iteration, one line per data source plus
    the overall mean (and pass@k when sampled); returns ``path``."""
    # The Agg canvas directly, not pyplot: no global backend switch.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 3.4), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    reward_ax, pass_ax = fig.subplots(1, 2, sharex=True)
    panels = ((reward_ax, "eval/reward", "held-out reward"), (pass_ax, "eval/pass@1", "pass@1"))
    for ax, key, title in panels:
        lines = {"all": key, **_per_task(history, key)}
        if key == "eval/pass@1" and any("eval/pass@k" in h for h in history):
            lines["all, pass@k"] = "eval/pass@k"
        for label, name in lines.items():
            points = [(h["iteration"], h[name]) for h in history if name in h]
            style = {"color": "black", "linewidth": 2} if label.startswith("all") else {}
            if label == "all, pass@k":
                style["linestyle"] = "--"
            ax.plot(*zip(*points), marker="o", markersize=3, label=label, **style)
        ax.set(title=title, xlabel="iteration")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    pass_ax.set_ylim(-0.02, 1.02)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def _per_task(history: list[dict[str, float]], key: str) -> dict[str, str]:
    """``{task: metric name}`` for every ``<key>/<task>`` in the history, sorted by task."""
    prefix = key + "/"
    tasks = sorted({name[len(prefix) :] for h in history for name in h if name.startswith(prefix)})
    return {task: prefix + task for task in tasks}
