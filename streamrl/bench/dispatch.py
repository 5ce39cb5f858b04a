"""``streamrl bench dispatch``: generation makespan under random, skew-aware and oracle dispatch.

StreamRL §5.3 / Fig. 9. Every policy generates the same prompts with the same forced output
lengths on the same instances:

- ``random``: each prompt to a random instance, FIFO admission (the paper's baseline);
- ``skew``: Algorithm 2 on *predicted* lengths, LPT admission on the same predictions;
- ``oracle``: Algorithm 2 and LPT on the *true* lengths.

Predictions come from ``--predicted`` or are the true lengths times log-normal noise
(``--ranker-noise``, sigma; the default 0.25 gives recall@20 of about 0.86 on the default
length file, a realistic ranker: mean 0.858, sd 0.018 over 20 noise seeds).
``--simulate`` replays continuous batching with the latency model instead of running models.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from streamrl.bench import model_dir_for
from streamrl.bench.pipeline import DEFAULT_LENGTHS, load_lengths
from streamrl.components.dispatch import RandomDispatcher
from streamrl.components.generation_service import StreamGenerationService
from streamrl.components.latency import PAPER_7B_H800_MS, LatencyModel, simulate_instance
from streamrl.components.profiler import Profiler
from streamrl.components.skew_dispatch import SkewAwareDispatcher
from streamrl.errors import ConfigError
from streamrl.metrics import kendall_tau, recall_at_k
from streamrl.models import load_policy
from streamrl.records import Request

POLICIES = ("random", "skew", "oracle")
RANDOM_DRAWS = 20  # simulated random dispatch: mean makespan over this many draws
PROMPT = [5, 6, 7, 8]  # every prompt is the same 4 tokens: only the output length differs


def _requests(true: list[int], predicted: list[float]) -> list[Request]:
    return [
        Request(f"p{i}", PROMPT, n, forced_length=n, predicted_length=p)
        for i, (n, p) in enumerate(zip(true, predicted))
    ]


def _policy(name: str, latency: LatencyModel, args, true: list[int]):
    """(dispatcher, scheduler name, scores) of a policy."""
    if name == "random":
        return RandomDispatcher(args.seed), "fifo", None
    dispatcher = SkewAwareDispatcher(
        latency, args.max_batch_size, objective=args.objective, recent_lengths=true,
        tail_batch_size=args.tail_batch_size,
    )  # fmt: skip
    return dispatcher, "lpt", "true" if name == "oracle" else "predicted"


def _simulate(name, latency, args, true, predicted) -> float:
    """Replayed makespan; for ``random``, the mean over ``RANDOM_DRAWS`` dispatches (one
    random draw alone can be far from what random dispatch costs on average)."""
    dispatcher, scheduler, which = _policy(name, latency, args, true)
    scores = None if which is None else (true if which == "true" else predicted)
    draws = RANDOM_DRAWS if name == "random" else 1
    total = 0.0
    for _ in range(draws):
        parts = dispatcher.plan(_requests(true, predicted), scores, args.instances)
        limits = (
            dispatcher.batch_limits(args.instances)
            if isinstance(dispatcher, SkewAwareDispatcher)
            else [args.max_batch_size] * args.instances
        )
        makespans = []
        for part, limit in zip(parts, limits):
            if scheduler == "lpt":
                part = sorted(part, key=lambda r: -r.predicted_length)  # stable: FIFO on ties
            makespans.append(simulate_instance([r.forced_length for r in part], limit, latency))
        total += max(makespans)
    return total / draws


def _run_real(name, latency, args, true, predicted, model_dir: Path) -> float:
    dispatcher, scheduler, which = _policy(name, latency, args, true)
    scores = None if which is None else (true if which == "true" else predicted)
    with StreamGenerationService(model_dir, args.instances, max_batch_size=args.max_batch_size,
                                 dispatcher=dispatcher, scheduler=scheduler) as sgs:  # fmt: skip
        times = []
        for repeat in range(args.repeats):
            requests = _requests(true, predicted)
            for r in requests:
                r.iteration = repeat
            started = time.perf_counter()
            for _ in sgs.generate(requests, scores):
                pass
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def bench_dispatch(args) -> dict:
    """Makespan of each policy (median of repeats when real) and its ratio to random."""
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies or any(p not in POLICIES for p in policies):
        raise ConfigError(f"--policies: choose from {', '.join(POLICIES)}, got {args.policies!r}.")
    lengths = load_lengths(args.lengths or DEFAULT_LENGTHS)
    true = [lengths[i % len(lengths)] for i in range(args.prompts or len(lengths))]
    if args.predicted:
        predicted = [float(x) for x in load_lengths(args.predicted)][: len(true)]
        if len(predicted) != len(true):
            raise ConfigError(f"--predicted has {len(predicted)} lengths; need {len(true)}.")
    else:
        noise = np.random.default_rng(args.seed).lognormal(0.0, args.ranker_noise, len(true))
        predicted = (np.asarray(true) * noise).tolist()
    with tempfile.TemporaryDirectory(prefix="streamrl-dispatch-") as tmp:
        model_dir, latency = _model_and_latency(args, Path(tmp))
        makespan = {}
        for name in policies:
            run = _simulate if args.simulate else _run_real
            extra = () if args.simulate else (model_dir,)
            makespan[name] = round(run(name, latency, args, true, predicted, *extra), 4)
            print(f"{name}: makespan {makespan[name]:.3f} s", file=sys.stderr)
    result = {
        "makespan_s": makespan,
        "ratio_to_random": {p: round(v / makespan["random"], 3) for p, v in makespan.items()}
        if "random" in makespan else {},
        "recall@20": recall_at_k(predicted, true, 0.2),
        "kendall_tau": round(kendall_tau(predicted, true), 4),
        "instances": args.instances,
        "prompts": len(true),
        "mode": "simulated" if args.simulate else "real",
    }  # fmt: skip
    return result


def _model_and_latency(args, tmp: Path) -> tuple[Path | None, LatencyModel]:
    if args.latency == "paper-7b-h800":
        latency = LatencyModel.from_table_ms(PAPER_7B_H800_MS)
    elif args.latency:
        latency = LatencyModel.from_json(args.latency)
    else:
        latency = None
    if args.simulate and latency is not None:
        return None, latency
    model_dir = model_dir_for(args.model, tmp, args.seed)
    if latency is None:  # measure the backend that runs: PTL up to the batch size used
        policy, _ = load_policy(model_dir)
        sizes = [b for b in (1, 2, 4, 8, 16, 32, 64, 128) if b <= args.max_batch_size]
        latency = Profiler(policy, PROMPT, tokens=16, repeats=1).fit(sizes)
    return model_dir, latency
