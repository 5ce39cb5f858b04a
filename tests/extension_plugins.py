"""Parts a user writes outside the library, one per extension point.

``tests/test_extension_points.py`` uses them from YAML (``extension_plugins:Name``) and from
Python; nothing inside ``streamrl/`` knows them. Each leaves evidence that it really ran where
it is meant to run (its state in the checkpoint, a file written by the generator process).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from streamrl.algorithms import GRPO
from streamrl.components.capacity.elastic import ElasticController
from streamrl.components.generation.engines import HFEngine
from streamrl.components.run_context import RunContext
from streamrl.components.skewness.adaptive import AdaptiveDispatcher
from streamrl.protocols import AdmissionScheduler, Cluster, EngineSpec, StreamGenerator
from streamrl.records import Request


def quarter_or_half(completion: str, answer: str) -> float:
    """0.5 when the completion is as long as the answer, else 0.25: values no built-in gives."""
    return 0.5 if len(completion) == len(answer) else 0.25


class SignGRPO(GRPO):
    """GRPO with sign advantages (+1 more than ``margin`` above the group mean, -1 as far
    below, else 0); counts the groups."""

    def __init__(self, *, margin: float = 0.0, **options) -> None:
        super().__init__(**options)
        self.margin = margin
        self.groups_scored = 0

    def score_group(self, rewards: Sequence[float]) -> list[float]:
        self.groups_scored += 1
        mean = sum(rewards) / len(rewards)
        return [float((r > mean + self.margin) - (r < mean - self.margin)) for r in rewards]

    def state_dict(self) -> dict:
        return {"groups_scored": self.groups_scored, "margin": self.margin}

    def load_state_dict(self, state: dict) -> None:
        self.groups_scored = state["groups_scored"]


class LastInstanceDispatcher:
    """Every prompt to the last instance, each capped at ``cap`` running sequences."""

    def __init__(self, *, max_batch_size: int, cap: int = 4) -> None:
        self.cap = min(cap, max_batch_size)
        self.plans = 0
        self.observed = 0

    @classmethod
    def from_run(cls, run: RunContext, **options: Any) -> LastInstanceDispatcher:
        """What it takes from the run: the batch size (``options`` hold ``cap``)."""
        return cls(max_batch_size=run.max_batch_size, **options)

    def plan(
        self, requests: Sequence[Request], scores: Sequence[float] | None, instances: int
    ) -> list[list[Request]]:
        self.plans += 1
        return [[] for _ in range(instances - 1)] + [list(requests)]

    def observe(self, lengths: Iterable[int]) -> None:
        self.observed += len(list(lengths))

    def batch_limits(self, instances: int) -> list[int]:
        return [self.cap] * instances

    def state_dict(self) -> dict:
        return {"plans": self.plans, "observed": self.observed, "cap": self.cap}

    def load_state_dict(self, state: dict) -> None:
        self.plans, self.observed = state["plans"], state["observed"]


class ObservingElastic(ElasticController):
    """``rl.elastic``: the built-in controller, counting the iterations it decided on (its
    own argument ``label`` goes into its checkpointed state)."""

    def __init__(self, *args: Any, label: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.label, self.decisions = label, 0

    def observe(self, *args: Any, **kwargs: Any):
        self.decisions += 1
        return super().observe(*args, **kwargs)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "label": self.label, "decisions": self.decisions}


@dataclass(frozen=True)
class MarkingEngine:
    """The HF engine, leaving a file per instance it builds: proof it ran in the child."""

    marker_dir: str

    def check(self, *, cluster: Cluster, gpus_per_instance: int) -> None:
        HFEngine().check(cluster=cluster, gpus_per_instance=gpus_per_instance)

    def __call__(self, spec: EngineSpec, scheduler: AdmissionScheduler) -> StreamGenerator:
        Path(self.marker_dir, f"instance-{spec.instance_id}").write_text(spec.model_dir)
        return HFEngine()(spec, scheduler)


class GuessEnv:
    """A user's multi-turn environment: guess the row's word; each wrong guess is told "no".

    Its episodes take as many turns as the model needs (up to the run's ``max_turns``), and it
    counts its instances' ``close`` calls in a file, as evidence that each episode closed.
    """

    def __init__(self, log: str | None = None) -> None:
        self.log, self.tries = log, 0

    def reset(self, row):
        self.word = row["answer"]
        return f"Guess the word. Hint: {row['prompt']}"

    def step(self, action: str):
        from streamrl.records import Step

        self.tries += 1
        if action.strip() == self.word:
            return Step(None, reward=1.0, done=True)
        return Step("no", reward=0.0)

    def close(self) -> None:
        if self.log:
            with open(self.log, "a") as out:
                out.write("closed\n")


def guess_demonstration(row) -> list[str]:
    """A good episode: one wrong guess, then the word."""
    return ["maybe", row["answer"]]


class AllOnFirstInstance(AdaptiveDispatcher):
    """An adaptive planner that plans everything onto the first instance, so the others must
    take work by moves (``tests/test_moves.py``); a ``kill`` ('source' or 'target') kills that
    instance (``pids``: instance id -> pid) as the first moves go out."""

    kill: str | None = None
    pids: ClassVar[dict[int, int]] = {}

    def plan(self, requests, scores, instances):
        parts = super().plan(requests, scores, 1)
        return parts + [[] for _ in range(instances - 1)]

    def rebalance(self, loads):
        moves = super().rebalance(loads)
        if moves and self.kill is not None:
            victim = moves[0].source if self.kill == "source" else moves[0].target
            os.kill(self.pids[victim], signal.SIGKILL)
            self.kill = None
        return moves


@dataclass(frozen=True)
class AppliesNothing(HFEngine):
    """An HF engine whose instances take every weight update and apply none of it (a LoRA
    policy's adapters included): the silent no-op a checksum must catch (verl #7495)."""

    def __call__(self, spec: EngineSpec, scheduler: AdmissionScheduler) -> StreamGenerator:
        generator = super().__call__(spec, scheduler)

        def load_weights(state_dict: Any, version: int) -> None:
            generator._weight_version = int(version)  # says it loaded: nothing changed

        generator.load_weights = load_weights
        return generator
