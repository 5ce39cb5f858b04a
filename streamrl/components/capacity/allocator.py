"""Stage balancing before training starts: StreamRL §4.2, Algorithm 1.

Generation and training run on separate GPUs, so their split decides which stage is the
bottleneck. ``ResourceAllocator`` predicts each stage's time with the profiler-based model ``P``
(the paper's term) and searches the splits:

- ``T_gen`` (``predict_generation_s``): the skewness-aware dispatch plan of Algorithm 2 over the
  generator instances, each replayed with continuous batching and ``PTL(BS)`` (Eq. 1), or Eq. 2
  per pool (``method="eq2"``, the paper's closed form);
- ``T_train`` (``TrainerCostModel``): seconds per padded token on one trainer unit, divided by a
  data-parallel speed-up over the units.

Single datacenter: every split of ``n`` GPUs in valid unit sizes, minimising
``max(T_gen, T_train)`` (one-step async) or the sync critical path (samples stream into the
trainer as they finish, then the weights travel). Cross-datacenter: each stage has its own pool;
the faster stage is shrunk until its time just covers the slower one, and the rest is released.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Literal

import numpy as np

from streamrl.components.skewness.batching import decode_schedule
from streamrl.components.skewness.latency import LatencyModel
from streamrl.components.skewness.skew_dispatch import SkewAwareDispatcher

Mode = Literal["async", "sync"]
Method = Literal["replay", "eq2"]


@dataclass(frozen=True)
class TrainerCostModel:
    """Training time of one RL iteration as a function of tokens and trainer units (P_train).

    A unit is the trainer's smallest parallel group (TP x PP GPUs, or one CPU core); more units
    add data parallelism with ``speedup(u) = 1 + (u - 1) x dp_efficiency``.

    Attributes:
        s_per_token: seconds per padded token (prompt + completion) on one unit, all passes of
            the iteration included (e.g. actor and critic forward/backward, reference forward).
        microbatch_overhead_s: fixed seconds per micro-batch (kernel launches, Python).
        step_s: optimizer step per iteration.
        unit_gpus: GPUs per unit.
        dp_efficiency: marginal efficiency of each extra unit, in ``(0, 1]``.

    Examples:
        >>> cost = TrainerCostModel(s_per_token=0.001, unit_gpus=8, dp_efficiency=0.5)
        >>> cost.train_s(tokens=3000, units=3)  # 3 s on one unit, speed-up 1 + 2 x 0.5 = 2
        1.5
    """

    s_per_token: float
    microbatch_overhead_s: float = 0.0
    step_s: float = 0.0
    unit_gpus: int = 1
    dp_efficiency: float = 1.0

    def __post_init__(self) -> None:
        if self.s_per_token <= 0 or self.unit_gpus < 1 or not 0 < self.dp_efficiency <= 1:
            raise ValueError(
                "TrainerCostModel: need s_per_token > 0, unit_gpus >= 1 and dp_efficiency in "
                f"(0, 1]; got {self.s_per_token}, {self.unit_gpus}, {self.dp_efficiency}."
            )

    def speedup(self, units: int) -> float:
        """Data-parallel speed-up of ``units`` units over one."""
        return 1.0 + (units - 1) * self.dp_efficiency

    def microbatch_s(self, tokens: float, units: int = 1) -> float:
        """Seconds of one micro-batch of ``tokens`` padded tokens."""
        return self.microbatch_overhead_s + tokens * self.s_per_token / self.speedup(units)

    def train_s(self, tokens: float, units: int = 1, microbatches: int = 0) -> float:
        """Seconds to train an iteration of ``tokens`` tokens, optimizer step included."""
        work = tokens * self.s_per_token / self.speedup(units)
        return work + microbatches * self.microbatch_overhead_s + self.step_s


def _skew_parts(
    lengths: Sequence[float],
    instances: int,
    latency: LatencyModel,
    max_batch_size: int,
    alpha: float,
    prompt_tokens: float = 0.0,
) -> list[list[float]]:
    """Algorithm 2's pools on the true lengths, spread by LPT, each instance in LPT order (the
    requests hold ``prompt_tokens``-token prompts, which a model of context prices)."""
    from streamrl.records import Request

    dispatcher = SkewAwareDispatcher(latency, max_batch_size, alpha=alpha, recent_lengths=lengths)
    prompt = [0] * max(1, round(prompt_tokens))
    requests = [Request(f"p{i}", prompt, int(n)) for i, n in enumerate(lengths)]
    parts = dispatcher.plan(requests, [float(n) for n in lengths], instances)
    return [sorted((float(r.predicted_length) for r in part), reverse=True) for part in parts]


def predict_generation_s(
    latency: LatencyModel,
    lengths: Sequence[float],
    instances: int,
    max_batch_size: int,
    method: Method = "replay",
    alpha: float = 0.2,
    prompt_tokens: float = 0.0,
) -> float:
    """Predicted generation makespan of one iteration on ``instances`` instances (P_gen).

    Args:
        latency: the step costs of one instance (``PTL(BS)``, or of batch size and context).
        lengths: output lengths of the iteration's samples (true, or a recent sample of them).
        instances: generator instances.
        max_batch_size: batch slots per instance.
        method: ``"replay"`` (Algorithm 2's plan replayed with continuous batching, which sees
            the long tail) or ``"eq2"`` (Eq. 2 per pool with the pool's mean length).
        alpha: long-tail share of Algorithm 2.
        prompt_tokens: the mean prompt: every sample's context starts there, and its prefill
            is paid (issue 47; nothing changes for a ``PTL(BS)`` table).
    """
    if instances < 1:
        raise ValueError(f"instances must be >= 1, got {instances}.")
    if not len(lengths):
        return 0.0
    if method == "eq2":
        ordered = sorted(lengths, reverse=True)
        dispatcher = SkewAwareDispatcher(
            latency, max_batch_size, alpha=alpha, recent_lengths=lengths
        )
        dispatcher.prompt_tokens = prompt_tokens  # what its plan() takes from the requests
        split = dispatcher.split(len(ordered), instances)
        n_tail = round(alpha * len(ordered)) if split[0] else 0
        pools = ((ordered[:n_tail], split[0]), (ordered[n_tail:], split[1]))
        return max(
            latency.instance_latency(
                math.ceil(len(p) / n), float(np.mean(p)), max_batch_size, prompt_tokens
            )
            for p, n in pools
            if p and n
        )
    parts = _skew_parts(lengths, instances, latency, max_batch_size, alpha, prompt_tokens)
    return max(
        (max(_finish_times(p, max_batch_size, latency, prompt_tokens)) for p in parts if p),
        default=0.0,
    )


def _finish_times(
    lengths: Sequence[float], max_batch_size: int, latency: LatencyModel, prompt_tokens: float
) -> list[float]:
    """When each sample of one instance's part finishes, replayed from ``prompt_tokens``."""
    contexts = [prompt_tokens] * len(lengths)
    schedule = decode_schedule(lengths, max_batch_size, latency, contexts=contexts)
    return [end for _, end in schedule]


def sync_critical_path_s(
    finish_s: Sequence[float], tokens: Sequence[float], cost: TrainerCostModel, units: int
) -> float:
    """Iteration time of synchronous RL with dynamic-batch pipelining (§4.1, Fig. 5b).

    The trainer takes samples in finish order and trains each as soon as it has arrived and the
    previous one is done (a fluid micro-batching model); the optimizer step closes the iteration.
    """
    done = 0.0
    for finished, n in sorted(zip(finish_s, tokens)):
        done = max(done, finished) + n * cost.s_per_token / cost.speedup(units)
    return done + cost.step_s


@dataclass
class AllocationPlan:
    """A GPU split and its predicted stage times (the output of Algorithm 1).

    Attributes:
        gen_gpus / train_gpus: GPUs given to each stage.
        gen_instances / train_units: the same, in instances and trainer units.
        gen_s / train_s: predicted stage times per iteration.
        iteration_s: the objective (async: ``max``; sync: critical path plus weight transfer).
        released_gpus: budget left unused (cross-datacenter shrinking).
        alternatives: the runner-up splits, best first.
    """

    gen_gpus: int
    train_gpus: int
    gen_instances: int
    train_units: int
    gen_s: float
    train_s: float
    iteration_s: float
    released_gpus: int = 0
    alternatives: list[AllocationPlan] = field(default_factory=list)

    def to_dict(self) -> dict:
        """A JSON-ready dict (alternatives without their own alternatives)."""
        data = asdict(self)
        data["alternatives"] = [
            {k: v for k, v in asdict(a).items() if k != "alternatives"} for a in self.alternatives
        ]
        return data


class ResourceAllocator:
    """Algorithm 1: the split of GPUs between generation and training.

    Args:
        latency: ``PTL(BS)`` of one generator instance (``gen_tp`` GPUs).
        trainer: the trainer's cost model; its ``unit_gpus`` is the training unit size.
        gen_tp: GPUs per generator instance.
        max_batch_size: batch slots per generator instance.
        mode: ``"async"`` (iteration = ``max(T_gen, T_train)``) or ``"sync"`` (critical path of
            dynamic-batch pipelining, weight transfer included).
        weight_sync_s: weight transfer time, on the critical path in sync mode only.
        method: how ``T_gen`` is predicted (see ``predict_generation_s``).
        alternatives: how many runner-up splits a plan lists.

    Examples:
        >>> from streamrl.components.skewness.latency import LatencyModel
        >>> alloc = ResourceAllocator(LatencyModel([1], [0.01]), TrainerCostModel(1e-4),
        ...                           max_batch_size=2)
        >>> plan = alloc.plan(budget_gpus=4, lengths=[100] * 8)
        >>> # 8 samples, 2 slots: 4 rounds of 1 s on 1 instance, 2 rounds on 2 or 3 (a tie,
        >>> # broken towards fewer generator GPUs); training 0.08 s on one GPU.
        >>> plan.gen_gpus, plan.train_gpus, plan.iteration_s
        (2, 2, 2.0)
    """

    def __init__(
        self,
        latency: LatencyModel,
        trainer: TrainerCostModel,
        gen_tp: int = 1,
        max_batch_size: int = 256,
        mode: Mode = "async",
        weight_sync_s: float = 0.0,
        method: Method = "replay",
        alternatives: int = 3,
    ) -> None:
        if mode not in ("async", "sync"):
            raise ValueError(f"mode must be 'async' or 'sync', got {mode!r}.")
        if gen_tp < 1:
            raise ValueError(f"gen_tp must be >= 1, got {gen_tp}.")
        self.latency, self.trainer, self.gen_tp = latency, trainer, gen_tp
        self.max_batch_size, self.mode, self.weight_sync_s = max_batch_size, mode, weight_sync_s
        self.method, self.alternatives = method, alternatives

    def evaluate(
        self, gen_gpus: int, train_gpus: int, lengths: Sequence[float], prompt_tokens: float = 0
    ) -> AllocationPlan:
        """Predicted stage and iteration times of one split."""
        instances, units = gen_gpus // self.gen_tp, train_gpus // self.trainer.unit_gpus
        tokens = [prompt_tokens + n for n in lengths]
        train_s = self.trainer.train_s(sum(tokens), units)
        if self.mode == "async":
            batch = self.max_batch_size
            gen_s = predict_generation_s(
                self.latency, lengths, instances, batch, self.method, prompt_tokens=prompt_tokens
            )
            iteration_s = max(gen_s, train_s)
        else:
            finish = self._finish_times(lengths, instances, prompt_tokens)
            gen_s = max(finish)
            iteration_s = sync_critical_path_s(finish, tokens, self.trainer, units)
            iteration_s += self.weight_sync_s
        return AllocationPlan(gen_gpus, train_gpus, instances, units, gen_s, train_s, iteration_s)

    def _finish_times(
        self, lengths: Sequence[float], instances: int, prompt_tokens: float
    ) -> list[float]:
        batch, latency = self.max_batch_size, self.latency
        parts = _skew_parts(lengths, instances, latency, batch, 0.2, prompt_tokens)
        return [end for p in parts for end in _finish_times(p, batch, latency, prompt_tokens)]

    def plan(
        self, budget_gpus: int, lengths: Sequence[float], prompt_tokens: float = 0
    ) -> AllocationPlan:
        """Single datacenter: the best split of ``budget_gpus`` (Algorithm 1, first half).

        Raises:
            ValueError: the budget cannot hold one generator instance and one trainer unit.
        """
        unit = self.trainer.unit_gpus
        if budget_gpus < self.gen_tp + unit:
            raise ValueError(
                f"A budget of {budget_gpus} GPUs cannot hold one generator instance "
                f"({self.gen_tp}) and one trainer unit ({unit})."
            )
        plans = [
            self.evaluate(x, y, lengths, prompt_tokens)
            for x in range(self.gen_tp, budget_gpus, self.gen_tp)
            for y in [(budget_gpus - x) // unit * unit]
            if y >= unit
        ]
        return self._best(plans)

    def plan_cross(
        self, gen_budget: int, train_budget: int, lengths: Sequence[float], prompt_tokens: float = 0
    ) -> AllocationPlan:
        """Cross-datacenter (Algorithm 1, second half): shrink the faster stage to the slower.

        Each stage is confined to its own pool; the faster one keeps the fewest GPUs whose time
        still does not exceed the slower stage's (so no new bottleneck appears, §5.2 note), and
        the rest is reported as ``released_gpus``.
        """
        full = self.evaluate(gen_budget, train_budget, lengths, prompt_tokens)
        if full.gen_s <= full.train_s:  # shrink generation
            sizes = range(self.gen_tp, gen_budget + 1, self.gen_tp)
            plans = [self.evaluate(x, train_budget, lengths, prompt_tokens) for x in sizes]
            fits = [p for p in plans if p.gen_s <= full.train_s]
            best = min(fits, key=lambda p: p.gen_gpus)
            best.released_gpus = gen_budget - best.gen_gpus
        else:  # shrink training
            unit = self.trainer.unit_gpus
            sizes = range(unit, train_budget + 1, unit)
            plans = [self.evaluate(gen_budget, y, lengths, prompt_tokens) for y in sizes]
            fits = [p for p in plans if p.train_s <= full.gen_s]
            best = min(fits, key=lambda p: p.train_gpus)
            best.released_gpus = train_budget - best.train_gpus
        others = sorted((p for p in plans if p is not best), key=lambda p: p.iteration_s)
        best.alternatives = others[: self.alternatives]
        return best

    def _best(self, plans: list[AllocationPlan]) -> AllocationPlan:
        # Ties go to fewer generator GPUs (the cheaper stage to grow later, §4.2 elastic).
        ranked = sorted(plans, key=lambda p: (round(p.iteration_s, 9), p.gen_gpus))
        best = ranked[0]
        best.alternatives = ranked[1 : 1 + self.alternatives]
        return best
