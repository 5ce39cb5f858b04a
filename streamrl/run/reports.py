"""What a run reports (``streamrl.run.recipe``): its held-out evaluations before, during and
after RL, its RL figures, its ledger of every requested sample, and its ``summary.json``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L

from streamrl.components.generation.service import StreamGenerationService
from streamrl.eval.periodic import PeriodicEval, plot_eval
from streamrl.policy.routing import routing_metrics
from streamrl.training.module import StreamRLModule


@dataclass
class HeldoutEvals:
    """The run's held-out evaluations, on its generator instances (``streamrl.eval.
    on_generators``): before RL (the starting weights, version 0), every ``every`` iterations
    (``PeriodicEval``: logged, plotted to ``eval.png``) and after RL (the final version).

    Args:
        evaluator: ``(service, weight version) -> result`` (an ``EvalResult``, or an
            ``EpisodeEval`` for episodes), decoding on the service's instances once they hold
            that version.
        every: ``rl.eval.every`` (0: before and after only).
        output_dir: where ``eval.png`` goes.
        announce: prints a stage heading (``"before"`` / ``"after"``).

    Attributes:
        results: ``{"before": ..., "after": ...}`` once run.
        wall_s: each one's seconds, service start excluded.
    """

    evaluator: Callable[[StreamGenerationService, int], Any]
    every: int = 0
    output_dir: str | None = None
    announce: Callable[[str], None] = lambda when: None
    results: dict[str, Any] = field(default_factory=dict)
    wall_s: dict[str, float] = field(default_factory=dict)
    periodic: PeriodicEval | None = None
    #: What to change when the policy earns no reward at all before RL (RL then has nothing to
    #: reinforce: every advantage is 0), said on stderr; ``None``: nothing.
    zero_hint: str | None = None

    def run(self, when: str, service: StreamGenerationService, version: int) -> Any:
        """Evaluate ``version`` on ``service``'s instances now, as ``when``."""
        self.announce(when)
        started = time.perf_counter()
        result = self.results[when] = self.evaluator(service, version)
        self.wall_s[when] = time.perf_counter() - started
        if when == "before" and self.zero_hint and getattr(result, "reward", None) == 0:
            print(
                "warning: the policy earns no reward on any held-out prompt before RL, so RL "
                f"has little to reinforce; {self.zero_hint}",
                file=sys.stderr,
            )
        if self.periodic is not None:
            self.periodic.record(version, result, wall_s=self.wall_s[when])
        return result

    def callbacks(self, service: StreamGenerationService) -> list[L.Callback]:
        """``rl.eval.every``'s ``PeriodicEval`` on ``service`` (its history starting at the
        evaluation before RL), or none."""
        if self.every < 1:
            return []
        evaluator = functools.partial(_on_service, self.evaluator, service)
        self.periodic = PeriodicEval(evaluator, every=self.every, output_dir=self.output_dir)
        if "before" in self.results:
            self.periodic.record(0, self.results["before"], wall_s=self.wall_s["before"])
        return [self.periodic]

    def plot(self) -> None:
        """``eval.png`` with every evaluation, the last one included."""
        if self.periodic is not None and self.output_dir is not None:
            plot_eval(self.periodic.history, Path(self.output_dir) / "eval.png")


def _on_service(
    evaluator: Callable[[StreamGenerationService, int], Any],
    service: StreamGenerationService,
    module: StreamRLModule,
) -> Any:
    """``PeriodicEval``'s call: the module's version, on the run's instances."""
    return evaluator(service, module.weight_version)


def write_summary(summary: dict, output_dir: str | Path) -> dict:
    """Write ``summary`` to ``<output_dir>/summary.json``; returns it."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def rl_summary(module: StreamRLModule, iterations: int) -> dict:
    history = module.history
    rewards = [h["rollout/reward"] for h in history]
    rl_wall = sum(h["time/iteration_s"] for h in history)
    samples = iterations * module.rollouts.samples_per_iteration
    head = rewards[: min(3, len(rewards))]
    tail = rewards[-min(3, len(rewards)) :]
    return {
        "reward_first": sum(head) / len(head),
        "reward_last": sum(tail) / len(tail),
        "reward_per_iteration": rewards,  # this start's iterations (a resumed run: from there)
        "samples_per_s": samples / rl_wall,
        "trainer_wait_frac": sum(h["time/wait_s"] for h in history) / rl_wall,
        "rl_wall_s": rl_wall,
        "mode": module.mode,
        "algorithm": {
            "name": type(module.algorithm).__name__,
            "clip_eps": module.algorithm.clip_eps,
            "kl_coef": module.algorithm.kl_coef,
            "reference": module.reference is not None,  # a frozen policy of the KL term
        },
        "staleness_bound": module.staleness_bound,
        "partial_rollout": module.rollouts.service.partial_rollout,
        # the method, its truncation and thresholds, and whether fresh tokens were corrected too
        "correction": {**dataclasses.asdict(module.correction), **module.correction.thresholds},
        "staleness_max": max(h["train/staleness_max"] for h in history),
        "token_staleness": token_staleness(history),
        "dropped_stale": module.pipeline.dropped_stale,
        "sync_exposed_s_total": sum(h["time/sync_exposed_s"] for h in history),
        "sync_transfer_s_total": module.sync_transfer_s,
        "grad_norms": [h["train/grad_norm"] for h in history],
        "logprob_gap_max": max((h.get("train/logprob_gap", 0.0) for h in history), default=0.0),
        # over the whole run: trainer/generator log-prob gap, and the MoE routing mismatch
        **{
            k.removeprefix("train/"): v
            for k, v in routing_metrics(module.gap_totals, moe=module.routing is not None).items()
        },
        "routing_replay": module.routing_replay,
        "trainer": {
            "device": module.trained_on,
            "ranks": module.trainer.world_size,
            "precision": getattr(module, "precision", "32-true"),
            "activation_checkpointing": any(
                getattr(m, "gradient_checkpointing", False) for m in module.policy.modules()
            ),
            "peak_memory_bytes_per_rank": module.peak_memory_bytes,
        },
    }


def token_staleness(history: list[dict]) -> dict[str, float]:
    """The run's staleness histogram: trained tokens at each lag, summed over iterations."""
    lags: dict[str, float] = {}
    for row in history:
        for key, value in row.items():
            if key.startswith("train/tokens_lag_"):
                lag = key.rsplit("_", 1)[1]
                lags[lag] = lags.get(lag, 0.0) + value
    return dict(sorted(lags.items(), key=lambda item: int(item[0])))


def ledger(module: StreamRLModule) -> dict:
    """Where every requested sample went; ``samples_lost`` must be 0 (see docs/failures.md)."""
    service, rollouts = module.rollouts.service, module.rollouts
    requested = rollouts.prompts_dispatched * rollouts.algorithm.group_size
    filtered = module.pipeline.dropped_stale + rollouts.samples_filtered
    env_fault = rollouts.samples_env_fault  # episodes the environment cut, left out of the loss
    reward_fault = rollouts.samples_reward_fault  # scoring crashed/hung reward workers twice
    events = rollouts.events()  # summed over every start of a resumed run
    return {
        "prompts_dispatched": rollouts.prompts_dispatched,
        "samples_requested": requested,
        # a completion, or an episode, once (a sample redone after a resume: once)
        "samples_generated": rollouts.samples_received,
        "samples_env_fault": env_fault,
        "samples_reward_fault": reward_fault,
        "samples_trained": module.samples_trained,
        "samples_filtered": filtered,
        "samples_requeued": events["requests_requeued"],
        "samples_discarded_late": events["samples_discarded"],
        "samples_lost": requested - module.samples_trained - filtered - env_fault - reward_fault,
        "instances_restarted": events["instances_restarted"],
        "reward_workers_restarted": events["reward_workers_restarted"],
        "weight_versions_verified": service.counts["weight_versions_verified"],
        "generators_final": sum(i.state != "failed" for i in service.instances()),
    }
