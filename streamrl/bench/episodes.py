"""``streamrl bench episodes``: episodes/s with episode-aware dispatch vs round-robin.

StreamRL §5 applied to multi-turn episodes: the long tail is made of episodes, not tokens. The
workload is a mix of episodes whose number of turns is long-tailed and written in the prompt
("Play 7 rounds."), as a game's or a task's length often is; every turn generates up to
``--turn-tokens`` tokens (a random policy rarely stops early). Three policies play the same
episodes on the same instances, interleaved ``--repeats`` times (medians):

- ``round_robin``: every turn goes to the next instance in turn, FIFO admission (a turn-level
  load balancer: the prefix is prefilled again wherever a turn lands);
- ``round_robin_affinity``: episodes dealt round-robin, later turns stay on their instance
  (prefix KV reused), FIFO admission;
- ``episode_aware``: the ``LengthRanker`` predicts each episode's cost (all its tokens, learned
  from a history of other episodes), Algorithm 2 spreads and isolates the long ones, LPT admits
  them first, later turns stay on their instance unless it is overloaded.
"""

from __future__ import annotations

import contextlib
import random
import statistics
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from streamrl.bench.settings import EpisodesBench
from streamrl.components.generation.service import StreamGenerationService
from streamrl.components.skewness.dispatch import RoundRobinDispatcher
from streamrl.components.skewness.ranker import LengthRanker
from streamrl.components.skewness.ranking_metrics import recall_at_k
from streamrl.components.skewness.schedulers import FIFOScheduler, LPTScheduler
from streamrl.components.skewness.skew_dispatch import SkewAwareDispatcher
from streamrl.envs.demos import episode_tokenizer
from streamrl.envs.runner import EpisodeRunner
from streamrl.policy.chat import stop_token_ids
from streamrl.policy.models import build_tiny_model, load_policy, save_policy
from streamrl.records import Step
from streamrl.training.builders import measure_latency

POLICIES = ("round_robin", "round_robin_affinity", "episode_aware")
MAX_ROUNDS = 8  # 8 turns of 16 tokens and their observations fit the tiny policy's context
CONTEXT = 256


class Rounds:
    """An episode of as many turns as its row's ``rounds``; each observation counts them."""

    def reset(self, row: Mapping) -> str:
        self.rounds, self.done = int(row["rounds"]), 0
        return row["prompt"]

    def step(self, action: str) -> Step:
        self.done += 1
        if self.done >= self.rounds:
            return Step(None, reward=1.0, done=True)
        return Step(f"Round {self.done + 1} of {self.rounds}.")

    def close(self) -> None:
        pass


def rounds_rows(n: int, seed: int, prefix: str) -> list[dict]:
    """Rows of long-tailed episode lengths: 1-2 rounds mostly, up to 8 (log-normal)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        rounds = min(MAX_ROUNDS, max(1, round(rng.lognormvariate(0.3, 0.8))))
        topic = rng.choice(["cards", "dice", "words", "numbers", "riddles"])
        rows.append(
            {
                "prompt_id": f"{prefix}{i}",
                "prompt": f"A game of {topic}. Play {rounds} rounds.",
                "rounds": rounds,
            }
        )
    return rows


def _policy_dir(out: Path, size: str) -> Path:
    """A random policy whose BPE knows the episodes' text, the chat template's included (its
    turns and observations take few tokens, so the longest episodes fit the context)."""
    rows = rounds_rows(400, 0, "t")
    tok = episode_tokenizer(rows, Rounds, lambda row: ["ok"] * row["rounds"], vocab_size=320)
    return save_policy(build_tiny_model(tok, size, seed=0), tok, out / "policy")


@contextlib.contextmanager
def _episodes(
    model_dir: Path,
    tok,
    settings: EpisodesBench,
    seed: int,
    service: Mapping[str, Any] | None = None,
    **runner: Any,
) -> Iterator[EpisodeRunner]:
    """The bench's instances (``service``: more of their arguments) and an ``EpisodeRunner``
    playing ``Rounds`` on them (``runner``: more of its arguments)."""
    with StreamGenerationService(
        model_dir,
        settings.instances,
        max_batch_size=settings.max_batch_size,
        stop_token_ids=stop_token_ids(tok),
        seed=seed,
        temperature=1.0,  # as its figures were measured
        **(service or {}),
    ) as sgs:
        yield EpisodeRunner(
            sgs,
            Rounds,
            tok,
            max_tokens=settings.turn_tokens,
            context=CONTEXT,
            max_turns=MAX_ROUNDS,
            **runner,
        )


def _play(
    policy: str, model_dir: Path, tok, rows, scores, history, latency, settings: EpisodesBench
) -> dict:
    """One timed pass of ``rows`` under ``policy``: episodes/s and the turns' prefill."""
    aware = policy == "episode_aware"
    dispatcher = (
        SkewAwareDispatcher(latency, settings.max_batch_size, recent_lengths=history)
        if aware
        else RoundRobinDispatcher()
    )
    service = {"dispatcher": dispatcher, "scheduler": LPTScheduler if aware else FIFOScheduler}
    with _episodes(
        model_dir,
        tok,
        settings,
        settings.seed,
        service,
        rebalance_requests=settings.max_batch_size if aware else None,
        affinity=policy != "round_robin",
    ) as runner:
        firsts = [runner.start(row) for row in rows]
        started = time.perf_counter()
        runner.submit(firsts, scores if aware else None)
        episodes = [runner.next_sample() for _ in firsts]
        wall = time.perf_counter() - started
    return {
        "episodes_per_s": len(episodes) / wall,
        "wall_s": wall,
        "prefill_tokens": sum(e.prefill_tokens for e in episodes),
        "cached_tokens": sum(e.cached_tokens for e in episodes),
        "turns": sum(e.turns for e in episodes),
        "turns_moved": runner.counts["turns_moved"],
        "truncated": sum(e.finish_reason != "done" for e in episodes),
        "cost": {e.prompt_id: e.length for e in episodes},
    }


def bench_episodes(settings: EpisodesBench) -> dict:
    """Run the benchmark (module docstring); returns the JSON summary."""
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = _policy_dir(Path(tmp), settings.model_size)
        policy, tok = load_policy(model_dir)
        history = rounds_rows(settings.history, settings.seed + 1, "h")
        rows = rounds_rows(settings.episodes, settings.seed, "e")
        # The ranker learns episode cost from finished episodes of other prompts (their tokens:
        # every turn's generation and observation), as the run's online refresh does.
        ranker, history_costs = _fit_ranker(model_dir, tok, history, settings)
        scores = ranker.predict([r["prompt"] for r in rows])
        latency = measure_latency(policy, tok, settings.max_batch_size)
        runs: dict[str, list[dict]] = {p: [] for p in POLICIES}
        for _ in range(settings.repeats):
            for name in POLICIES:
                run = _play(name, model_dir, tok, rows, scores, history_costs, latency, settings)
                runs[name].append(run)
                print(f"{name}: {run['episodes_per_s']:.2f} episodes/s", flush=True)
    rates = {p: statistics.median(r["episodes_per_s"] for r in runs[p]) for p in POLICIES}
    cost = runs["round_robin"][0]["cost"]  # each episode's tokens, as played
    return {
        "bench": "episodes",
        "episodes": settings.episodes,
        "instances": settings.instances,
        "repeats": settings.repeats,
        "episodes_per_s": rates,
        "speedup_vs_round_robin": rates["episode_aware"] / rates["round_robin"],
        "prefill_saved": {
            p: statistics.median(
                r["cached_tokens"] / max(1, r["cached_tokens"] + r["prefill_tokens"])
                for r in runs[p]
            )
            for p in POLICIES
        },
        "ranker_recall_at_10pct": recall_at_k(scores, [cost[r["prompt_id"]] for r in rows], 0.1),
        "runs": [{k: v for k, v in r.items() if k != "cost"} for p in POLICIES for r in runs[p]],
    }


def _fit_ranker(
    model_dir: Path, tok, history: list[dict], settings: EpisodesBench
) -> tuple[LengthRanker, list]:
    """A ``LengthRanker`` fit on the costs of ``history``'s episodes, played once; with them."""
    with _episodes(model_dir, tok, settings, settings.seed + 7) as runner:
        firsts = [runner.start(row) for row in history]
        runner.submit(firsts)
        cost = {e.prompt_id: e.length for e in (runner.next_sample() for _ in firsts)}
    lengths = [cost[r["prompt_id"]] for r in history]
    ranker = LengthRanker(seed=settings.seed)
    ranker.learn([r["prompt"] for r in history], lengths)
    return ranker, lengths
