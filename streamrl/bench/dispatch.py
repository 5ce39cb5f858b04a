"""``streamrl bench dispatch``: generation makespan under random, skew-aware and oracle dispatch.

StreamRL §5.3 / Fig. 9. Every policy generates the same task prompts with the same forced output
lengths (the lengths file's) on the same instances:

- ``random``: each prompt to a random instance, FIFO admission (the paper's baseline);
- ``skew``: Algorithm 2 + LPT admission on *predicted* lengths, with ``D`` (the P50/P90 that
  size its pools) from an earlier iteration. The headline row uses the library's own
  ``LengthRanker`` trained on that earlier iteration; ``--predictions`` adds rows for other
  sources (``noisy``: true lengths times log-normal noise, labelled ``skew_noisy``). See
  ``streamrl.bench.predictions`` for what the skew policy may know and why;
- ``oracle``: Algorithm 2 and LPT on the batch's *true* lengths (scores and ``D``).

The skew policy's dispatcher plans on copies of the requests without their forced lengths
(``streamrl.bench.blindfolded``): it sees prompts, predictions and ``D``, never the truth.
``--simulate`` replays continuous batching with the latency model instead of running models.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from streamrl.bench.blindfolded import Blindfolded, BlindfoldedRebalancer
from streamrl.bench.dispatch_runs import (
    per_sample,
    print_instance_loads,
    prompt_id,
    requests_for,
    run_real,
)
from streamrl.bench.inputs import load_lengths, model_dir_for, tokenizer_for
from streamrl.bench.pipeline import DEFAULT_LENGTHS
from streamrl.bench.predictions import SOURCES, Batch, Predictions, batch_and_history, predict
from streamrl.bench.settings import DispatchBench
from streamrl.components.generation.speculative import TailSpeculation
from streamrl.components.skewness.adaptive import AdaptiveDispatcher
from streamrl.components.skewness.dispatch import RandomDispatcher
from streamrl.components.skewness.latency import PAPER_7B_H800_MS, LatencyModel
from streamrl.components.skewness.profiler import Profiler
from streamrl.components.skewness.ranking_metrics import kendall_tau, recall_at_k
from streamrl.components.skewness.schedulers import FIFOScheduler, LPTScheduler
from streamrl.components.skewness.skew_dispatch import SkewAwareDispatcher
from streamrl.errors import ConfigError
from streamrl.policy.models import load_policy
from streamrl.runtime.references import check_options

POLICIES = ("random", "skew", "adaptive", "oracle")
#: The label suffix of a simulated row with speculative decoding in the tail.
SPEC = "+spec"
RANDOM_DRAWS = 20  # simulated random dispatch: mean makespan over this many draws
PROFILE_PROMPT = [5, 6, 7, 8]  # the prompt PTL(BS) is measured on
PROFILE_TOKENS = 16  # decode steps timed per cell of the profile's grid


def group_lengths(lengths: list[int], group_size: int, sigma: float, seed: int) -> list[list[int]]:
    """Each prompt's ``group_size`` sample lengths: its length times a log-normal factor of
    spread ``sigma`` per sample (the first sample keeps the length itself when alone)."""
    if group_size == 1:
        return [[n] for n in lengths]
    rng = np.random.default_rng(seed)
    spread = rng.lognormal(0.0, sigma, (len(lengths), group_size))
    return [[max(1, round(n * f)) for f in row] for n, row in zip(lengths, spread)]


def _dispatcher(
    policy: str,
    latency: LatencyModel,
    settings: DispatchBench,
    d: list[int],
    predictions: Predictions | None = None,
) -> Blindfolded:
    """A policy's dispatcher; ``d`` is its length distribution ``D`` (unused by random). The
    adaptive planner gets the predictor's distributions when it has them, as in a run."""
    if policy == "random":
        return Blindfolded(RandomDispatcher(settings.seed), settings.max_batch_size)
    if policy == "adaptive":
        options = {"recent_lengths": d, **settings.adaptive}
        planner = AdaptiveDispatcher(latency, settings.max_batch_size, **options)
        dists = predictions.distributions if predictions is not None else None
        by_prompt = {prompt_id(i): dist for i, dist in enumerate(dists or [])}
        return BlindfoldedRebalancer(planner, settings.max_batch_size, by_prompt)
    skew = SkewAwareDispatcher(
        latency,
        settings.max_batch_size,
        objective=settings.objective,
        recent_lengths=d,
        tail_batch_size=settings.tail_batch_size,
    )
    return Blindfolded(skew, settings.max_batch_size)


def _simulate(
    simulator: Callable[..., Any],
    dispatcher: Blindfolded,
    scores,
    latency,
    settings: DispatchBench,
    prompt_ids,
    true,
    speculation: TailSpeculation | None = None,
) -> tuple[float, int]:
    """Simulated makespan and requests moved (``streamrl.sim.moves``); random dispatch (no
    scores: FIFO) averages ``RANDOM_DRAWS`` draws (one draw alone can be far from what random
    dispatch costs on average)."""
    draws = RANDOM_DRAWS if scores is None else 1
    total, moved = 0.0, 0
    for _ in range(draws):
        result = simulator(
            dispatcher,
            requests_for(prompt_ids, true),
            per_sample(scores, true),
            settings.instances,
            latency,
            settings.max_batch_size,
            scheduler=FIFOScheduler if scores is None else LPTScheduler,
            speculation=speculation,
        )
        total, moved = total + result.makespan_s, moved + result.requests_moved
    return total / draws, moved // draws


def _rows(settings: DispatchBench) -> list[tuple[str, str, str | None]]:
    """``(label, policy, predictions source)`` per row: the first source is the headline
    ``skew`` row, the others ``skew_<source>``."""
    policies = [p.strip() for p in settings.policies.split(",") if p.strip()]
    if not policies or any(p not in POLICIES for p in policies):
        raise ConfigError(
            f"--policies: choose from {', '.join(POLICIES)}, got {settings.policies!r}."
        )
    sources = _sources(settings)
    rows = []
    for policy in policies:
        if policy == "adaptive":  # the headline predictions, as a distribution's median
            rows.append((policy, policy, sources[0]))
            continue
        if policy != "skew":
            rows.append((policy, policy, None))
            continue
        rows += [("skew" if i == 0 else f"skew_{s}", "skew", s) for i, s in enumerate(sources)]
    if settings.tail_speedup is not None:  # the same plans, with speculation in the tail
        if not settings.simulate:
            raise ConfigError(
                "--tail_speedup models speculative decoding in simulated runs (--simulate); "
                "real runs measure it: streamrl bench generate --speculative."
            )
        rows += [(label + SPEC, p, s) for label, p, s in rows if p in ("skew", "adaptive")]
    return rows


def _sources(settings: DispatchBench) -> list[str]:
    chosen = settings.predictions or ("file" if settings.predicted else "ranker,noisy")
    sources = [s.strip() for s in chosen.split(",") if s.strip()]
    if not sources or any(s not in SOURCES for s in sources):
        raise ConfigError(f"--predictions: choose from {', '.join(SOURCES)}, got {chosen!r}.")
    if ("file" in sources) != bool(settings.predicted):
        raise ConfigError("--predictions file and --predicted PATH go together; pass both.")
    return sources


def bench_dispatch(settings: DispatchBench, simulator: Callable[..., Any] | None = None) -> dict:
    """Makespan of each row (median of repeats when real) and its ratio to random.

    Args:
        settings: the bench's settings (the command line's options).
        simulator: replays a batch on simulated instances, for ``settings.simulate``:
            ``streamrl.sim.moves.simulate_generation`` (what ``streamrl bench dispatch
            --simulate`` passes; the simulator is a layer above the benches).

    Raises:
        ConfigError: bad settings, or ``simulate`` without a ``simulator``.
    """
    if settings.simulate and simulator is None:
        raise ConfigError(
            "bench_dispatch(simulate=True) needs simulator=streamrl.sim.moves."
            "simulate_generation (streamrl bench dispatch --simulate passes it)."
        )
    torch.set_num_threads(1)  # the ranker trains beside the generators' cores, as they would
    rows = _rows(settings)
    _check_adaptive(settings.adaptive)
    table = load_lengths(settings.lengths or DEFAULT_LENGTHS)
    n = settings.prompts or len(table)
    history = settings.history or 2 * n
    if n < 1 or history < 2 or settings.instances < 1 or settings.repeats < 1:
        raise ConfigError(
            "--prompts, --instances and --repeats must be >= 1 and --history >= 2; got "
            f"{n}, {settings.instances}, {settings.repeats}, {history}."
        )
    batch, earlier = batch_and_history(table, n, history, settings.sample_sigma, settings.seed)
    g, sigma = settings.group_size, settings.group_sigma
    true = group_lengths(batch.lengths, g, sigma, settings.seed + 3)
    seen = [x for row in group_lengths(earlier.lengths, g, sigma, settings.seed + 4) for x in row]
    with tempfile.TemporaryDirectory(prefix="streamrl-dispatch-") as tmp:
        prompt_ids, model_dir, latency = _setup(settings, batch, true, Path(tmp))
        by_source = {
            source: predict(
                source,
                batch,
                earlier,
                ranker_noise=settings.ranker_noise,
                seed=settings.seed,
                predicted_file=settings.predicted,
            )
            for source in {source for _, _, source in rows if source is not None}
        }
        predictions = {label: by_source[source] for label, _, source in rows if source}
        plans = {}
        for label, policy, _ in rows:
            d = [x for row in true for x in row] if policy == "oracle" else seen
            scores = _scores(policy, true, predictions.get(label))
            plans[label] = (
                _dispatcher(policy, latency, settings, d, predictions.get(label)),
                scores,
            )
        moves, loads = {}, {}
        if settings.simulate:
            tail = None
            if settings.tail_speedup is not None:
                tail = TailSpeculation(settings.tail_max_running, settings.tail_speedup)
            simulated = {
                label: _simulate(
                    simulator,
                    dispatcher,
                    scores,
                    latency,
                    settings,
                    prompt_ids,
                    true,
                    tail if label.endswith(SPEC) else None,
                )
                for label, (dispatcher, scores) in plans.items()
            }
            makespan = {label: m for label, (m, _) in simulated.items()}
            moves = {label: n for label, (_, n) in simulated.items()}
        else:
            makespan, moves, loads = run_real(plans, settings, prompt_ids, true, model_dir)
        makespan = {label: round(v, 4) for label, v in makespan.items()}
    result = _result(settings, batch, true, earlier, predictions, makespan, latency, prompt_ids)
    if moves:
        result["requests_moved"] = moves
    if not settings.simulate:
        result["instance_loads"] = loads
    _print_table(result)
    return result


def _check_adaptive(options: dict[str, Any]) -> None:
    """``--adaptive``'s arguments, refused before any work unless ``AdaptiveDispatcher`` takes
    each and the bench does not set it itself."""
    check_options(AdaptiveDispatcher, options, where="--adaptive")
    if linked := sorted(set(options) & {"latency", "max_batch_size", "recent_lengths"}):
        raise ConfigError(
            f"--adaptive: {linked} are the bench's to set (its latency model, --max_batch_size "
            "and the earlier iteration's lengths); give the planner's other arguments."
        )


def _scores(
    policy: str, true: list[list[int]], predictions: Predictions | None
) -> list[float] | None:
    """Per prompt (the skew and adaptive policies: predicted), per sample (the oracle: true)."""
    if policy == "random":
        return None
    if policy == "oracle":
        return [float(n) for row in true for n in row]
    return predictions.lengths


def _setup(
    settings: DispatchBench, batch: Batch, true: list[list[int]], tmp: Path
) -> tuple[list[list[int]], Path | None, LatencyModel]:
    """Prompt token ids, the model directory (real runs; built with the context the prompts and
    lengths need, or refused before any work) and the latency model."""
    latency = None
    if settings.latency == "paper-7b-h800":
        latency = LatencyModel.from_table_ms(PAPER_7B_H800_MS)
    elif settings.latency:
        latency = LatencyModel.from_json(settings.latency)
    tokenizer = tokenizer_for(settings.model)  # the prompts' widths count in either mode
    prompt_ids = [tokenizer(p)["input_ids"] for p in batch.prompts]
    if settings.simulate and latency is not None:
        return prompt_ids, None, latency
    needed = 0 if settings.simulate else max(len(p) + max(n) for p, n in zip(prompt_ids, true))
    model_dir = model_dir_for(settings.model, tmp, settings.seed, context=needed)
    if latency is None:  # measure the backend that runs, at the batch sizes and contexts used
        policy, _ = load_policy(model_dir)
        sizes = [b for b in (1, 4, 16, 64, 128) if b < settings.max_batch_size]
        contexts = [c for c in (16, 64, 160, 320) if c + PROFILE_TOKENS < needed] or [16]
        profiler = Profiler(policy, PROFILE_PROMPT, tokens=PROFILE_TOKENS, repeats=1)
        latency, _ = profiler.fit_grid([*sizes, settings.max_batch_size], contexts, "widest")
    return prompt_ids, model_dir, latency


def _quality(predictions: Predictions, true: list[int]) -> dict:
    return {
        "source": predictions.source,
        "recall@20": round(recall_at_k(predictions.lengths, true, 0.2), 4),
        "kendall_tau": round(kendall_tau(predictions.lengths, true), 4),
        **predictions.info,
    }


def _result(
    settings: DispatchBench,
    batch: Batch,
    true: list[list[int]],
    earlier: Batch,
    predictions: dict,
    makespan: dict,
    latency,
    prompt_ids: list[list[int]],
) -> dict:
    quality = {label: _quality(p, batch.lengths) for label, p in predictions.items()}
    base, skew = makespan.get("random"), makespan.get("skew")
    every_sample = [n for row in true for n in row]
    prompts = [len(ids) for ids, row in zip(prompt_ids, true) for _ in row]
    longest_s, work_s = latency.makespan_floor(
        every_sample, settings.instances, settings.max_batch_size, prompts
    )
    result = {
        "makespan_s": makespan,
        "ratio_to_random": {k: round(v / base, 3) for k, v in makespan.items()} if base else {},
        # Against the paper's Algorithm 2 + LPT (issue 34's targets are ratios to it).
        "ratio_to_skew": {k: round(v / skew, 3) for k, v in makespan.items()} if skew else {},
        "predictions": quality,
        "history": {
            "samples": len(earlier.lengths),
            "p50": float(np.percentile(earlier.lengths, 50)),
            "p90": float(np.percentile(earlier.lengths, 90)),
        },
        # The latency model's floor: no plan finishes sooner (LatencyModel.makespan_floor).
        "longest_sample_s": round(longest_s, 4),
        "work_s": round(work_s, 4),
        "makespan_floor_s": round(max(longest_s, work_s), 4),
        "context_us_per_token": round(latency.context_s * 1e6, 4),
        "context_load": latency.load,
        "instances": settings.instances,
        "prompts": len(batch.lengths),
        "group_size": settings.group_size,
        "mode": "simulated" if settings.simulate else "real",
    }
    if "skew" in quality:  # the headline predictions
        result["recall@20"] = quality["skew"]["recall@20"]
        result["kendall_tau"] = quality["skew"]["kendall_tau"]
    return result


def _print_table(result: dict) -> None:
    print(
        f"{'row':<14}{'predictions':<16}{'recall@20':>10}{'makespan s':>12}{'/ random':>10}"
        f"{'/ skew':>8}",
        file=sys.stderr,
    )
    for label, seconds in result["makespan_s"].items():
        quality = result["predictions"].get(label)
        source = quality["source"] if quality else ("true lengths" if label == "oracle" else "-")
        if quality and quality["source"] == "noisy":
            source = f"noisy s={quality['sigma']}"
        recall = f"{quality['recall@20']:.3f}" if quality else "-"
        ratios = [result[key].get(label) for key in ("ratio_to_random", "ratio_to_skew")]
        to_random, to_skew = (f"{r:.3f}" if r is not None else "-" for r in ratios)
        print(
            f"{label:<14}{source:<16}{recall:>10}{seconds:>12.3f}{to_random:>10}{to_skew:>8}",
            file=sys.stderr,
        )
    floor = result["makespan_floor_s"]
    print(
        f"{'floor':<14}{'no plan beats':<16}{'-':>10}{floor:>12.3f}  (longest sample "
        f"{result['longest_sample_s']:.3f} s, every token at the best rate "
        f"{result['work_s']:.3f} s)",
        file=sys.stderr,
    )
    print_instance_loads(result.get("instance_loads", {}))
