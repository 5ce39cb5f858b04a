"""Elastic generation: add a generator instance when generation lags training (StreamRL §4.2).

Output lengths grow during RL, so generation time grows faster than training time and a balance
set before training drifts (§2, Fig. 2 right). Each iteration the controller compares
``delta = T_gen - T_train`` (measured) with ``delta'``, the generation time one more step of
instances would save, and scales out when ``delta`` exceeds ``threshold x delta'``. ``delta'`` is
predicted from the latency model (Algorithm 2's plan, replayed with ``PTL(BS)``) as a *ratio*,
``T_gen x (1 - P(N + step) / P(N))``, so a model that is off by a constant factor still gives
the right threshold. The paper only scales out; scale-in (``scale_in=True``) is the mirror test
(remove when ``T_train - T_gen`` exceeds the time one step fewer would add), and ``patience`` /
``cooldown`` keep the controller from oscillating. Pure decision logic: no processes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from streamrl.components.capacity.allocator import Method, predict_generation_s
from streamrl.components.skewness.latency import LatencyModel
from streamrl.errors import ConfigError

if TYPE_CHECKING:
    from streamrl.components.run_context import RunContext

Action = Literal["add", "remove", "keep"]


@dataclass(frozen=True)
class ElasticDecision:
    """What to do before the next iteration.

    Attributes:
        action: ``"add"``, ``"remove"`` or ``"keep"``.
        instances: generator instances to run next iteration.
        delta_s: measured ``T_gen - T_train``.
        delta_prime_s: predicted generation time saved by ``step`` more instances.
        reason: a short human-readable why.
    """

    action: Action
    instances: int
    delta_s: float
    delta_prime_s: float
    reason: str


class ElasticController:
    """Decides, iteration by iteration, whether to add or remove generator instances.

    Args:
        latency: ``PTL(BS)`` of one instance.
        max_batch_size: batch slots per instance.
        step: instances added or removed at a time (a "DP unit": e.g. 8 for one 8-GPU node of
            TP=1 instances, Fig. 11).
        min_instances: lower bound on the instance count.
        max_instances: upper bound on the instance count.
        threshold: scale out when ``delta > threshold x delta'``; 1.0 never makes training the
            bottleneck by adding; 0.5 adds whenever that shrinks ``|delta|`` (closer to Fig. 11).
        scale_in: also remove instances when training lags by more than one step would cost.
        patience: consecutive iterations a condition must hold before acting.
        cooldown: iterations ignored after a change (their timings mix old and new pools).
        method: how the latency model predicts ``T_gen`` (``predict_generation_s``).
        min_saving: add only when one more step would save at least this share of ``T_gen``
            (0, the paper's rule, adds whenever ``delta > delta'``; when generation is bound by
            its longest sample, ``delta'`` stays tiny and the bare rule adds instances that
            cannot help).

    Examples:
        >>> from streamrl.components.skewness.latency import LatencyModel
        >>> ctl = ElasticController(LatencyModel([1], [0.01]), max_batch_size=1)
        >>> d = ctl.observe(t_gen_s=10.0, t_train_s=4.0, instances=2, lengths=[100] * 4)
        >>> d.action, d.instances, d.delta_prime_s  # 2 rounds -> 2 rounds on 3: no gain
        ('keep', 2, 0.0)
        >>> ctl.observe(10.0, 4.0, instances=3, lengths=[100] * 4).action  # 2 -> 1 round
        'add'
    """

    def __init__(
        self,
        latency: LatencyModel,
        max_batch_size: int,
        *,
        step: int = 1,
        min_instances: int = 1,
        max_instances: int = 1 << 30,
        threshold: float = 1.0,
        scale_in: bool = False,
        patience: int = 1,
        cooldown: int = 0,
        method: Method = "replay",
        min_saving: float = 0.0,
    ) -> None:
        if not 0 <= min_saving < 1:
            raise ValueError(f"ElasticController: min_saving must be in [0, 1), got {min_saving}.")
        if step < 1 or min_instances < 1 or max_instances < min_instances:
            raise ValueError(
                "ElasticController: need step >= 1 and 1 <= min_instances <= max_instances; got "
                f"step={step}, min={min_instances}, max={max_instances}."
            )
        if threshold <= 0 or patience < 1 or cooldown < 0:
            raise ValueError("ElasticController: need threshold > 0, patience >= 1, cooldown >= 0.")
        self.latency, self.max_batch_size, self.step = latency, max_batch_size, step
        self.min_instances, self.max_instances = min_instances, max_instances
        self.threshold, self.scale_in = threshold, scale_in
        self.patience, self.cooldown, self.method = patience, cooldown, method
        self.min_saving = min_saving
        self._add_streak = self._remove_streak = self._cooling = 0

    @classmethod
    def from_run(cls, run: RunContext, **options: Any) -> ElasticController:
        """A run's controller (``rl.elastic``): the instances' measured ``PTL(BS)`` and batch
        slots linked in, the rest ``options``; ``ConfigError`` when ``max_instances`` is below
        the instances the run starts with."""
        most = options.get("max_instances")
        if most is not None and most < run.instances:
            raise ConfigError(
                f"ElasticController: max_instances={most} is below the {run.instances} generator "
                "instances the run starts with (rl.generation.num_instances); raise it or start "
                "fewer."
            )
        return cls(run.latency(), run.max_batch_size, **options)

    def predicted_gen_s(
        self, instances: int, lengths: Sequence[float], prompt_tokens: float = 0.0
    ) -> float:
        """The latency model's generation makespan on ``instances`` instances, every context
        starting at the mean prompt ``prompt_tokens``."""
        return predict_generation_s(
            self.latency,
            lengths,
            instances,
            self.max_batch_size,
            self.method,
            prompt_tokens=prompt_tokens,
        )

    def delta_prime_s(
        self, t_gen_s: float, instances: int, lengths: Sequence[float], prompt_tokens: float = 0.0
    ) -> float:
        """``delta'``: measured ``T_gen`` times the predicted relative saving of ``step`` more."""
        now = self.predicted_gen_s(instances, lengths, prompt_tokens)
        more = self.predicted_gen_s(instances + self.step, lengths, prompt_tokens)
        return t_gen_s * max(0.0, 1.0 - more / now) if now > 0 else 0.0

    def _delta_double_prime_s(
        self, t_gen_s: float, instances: int, lengths: Sequence[float], prompt_tokens: float
    ) -> float:
        # The generation time ``step`` fewer instances would add.
        now = self.predicted_gen_s(instances, lengths, prompt_tokens)
        fewer = self.predicted_gen_s(instances - self.step, lengths, prompt_tokens)
        return t_gen_s * max(0.0, fewer / now - 1.0) if now > 0 else float("inf")

    def observe(
        self,
        t_gen_s: float,
        t_train_s: float,
        instances: int,
        lengths: Sequence[float],
        prompt_tokens: float = 0.0,
    ) -> ElasticDecision:
        """Decide after one iteration.

        Args:
            t_gen_s: the iteration's measured generation time.
            t_train_s: the iteration's measured training time.
            instances: generator instances that ran it.
            lengths: output lengths of its samples (the workload the next one resembles).
            prompt_tokens: their mean prompt (a latency model of context prices it).

        Returns:
            The decision; ``instances`` is the count to run next.
        """
        delta = t_gen_s - t_train_s
        prime = self.delta_prime_s(t_gen_s, instances, lengths, prompt_tokens)
        if self._cooling > 0:
            self._cooling -= 1
            return ElasticDecision("keep", instances, delta, prime, "cooling down after a change")
        can_add = instances + self.step <= self.max_instances
        worth_it = prime > 0 and prime >= self.min_saving * t_gen_s  # tail-bound: adding is waste
        want_add = can_add and worth_it and delta > self.threshold * prime
        self._add_streak = self._add_streak + 1 if want_add else 0
        want_remove = False
        if self.scale_in and instances - self.step >= self.min_instances and delta < 0:
            fewer_s = self._delta_double_prime_s(t_gen_s, instances, lengths, prompt_tokens)
            want_remove = -delta > fewer_s
        self._remove_streak = self._remove_streak + 1 if want_remove else 0
        if self._add_streak >= self.patience:
            return self._change(
                "add",
                instances + self.step,
                delta,
                prime,
                f"delta {delta:.3g} s > {self.threshold:g} x delta' {prime:.3g} s",
            )
        if self._remove_streak >= self.patience:
            return self._change(
                "remove",
                instances - self.step,
                delta,
                prime,
                "training lags by more than one step fewer would cost",
            )
        why = "waiting for patience" if (want_add or want_remove) else "stages balanced"
        return ElasticDecision("keep", instances, delta, prime, why)

    def _change(
        self, action: Action, instances: int, delta: float, prime: float, reason: str
    ) -> ElasticDecision:
        self._add_streak = self._remove_streak = 0
        self._cooling = self.cooldown
        return ElasticDecision(action, instances, delta, prime, reason)

    def state_dict(self) -> dict:
        return {"add": self._add_streak, "remove": self._remove_streak, "cooling": self._cooling}

    def load_state_dict(self, state: dict) -> None:
        self._add_streak, self._remove_streak = int(state["add"]), int(state["remove"])
        self._cooling = int(state["cooling"])
