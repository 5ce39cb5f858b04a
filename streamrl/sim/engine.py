"""The discrete-event simulator of a StreamRL run (§3-§5): ``simulate(config) -> SimResult``.

Events are sample finishes on generator instances (continuous batching with ``PTL(BS)``),
request releases (an instance holds an iteration's requests until the weights they need have
arrived) and the trainer becoming free. The trainer follows the real ``StreamRLModule``:

- a step starts by dispatching: ``sync`` / ``colocated`` dispatch this step's batch; ``async``
  dispatches the *next* batch, released once the previous weights arrive (one-step staleness);
- groups stream in; they are packed into length buckets and a bucket trains as soon as it holds
  ``token_budget`` padded tokens (dynamic-batch pipelining, §4.1); ``colocated`` first waits for
  every sample (time-sharing), then switches the GPUs to training;
- one optimizer step, then the weights travel (``bytes / bandwidth``): blocking in ``sync`` and
  ``colocated``, in the background in ``async``.

Every span goes to a ``TraceRecorder`` in the same JSON format as real runs, with simulated seconds
as timestamps, so ``streamrl timeline`` draws a simulated run.
"""

from __future__ import annotations

import heapq
import statistics
from dataclasses import dataclass, field

import numpy as np

from streamrl.components.skewness.dispatch import RandomDispatcher, RoundRobinDispatcher
from streamrl.components.skewness.skew_dispatch import SkewAwareDispatcher
from streamrl.records import Request
from streamrl.sim.config import SimConfig, bucket_of
from streamrl.sim.instance import SimInstance
from streamrl.timeline import Span, TraceRecorder, busy_fraction

_EPS = 1e-9


@dataclass
class SimResult:
    """What a simulated run measured (same names as ``streamrl bench pipeline``).

    Attributes:
        samples_per_s: samples per iteration over the median iteration time.
        iteration_s / gen_s / train_s: medians over the measured iterations.
        trainer_idle_frac / generator_idle_frac: idle share of the measured window.
        exposed_sync_s: median weight-transfer time the trainer was blocked on.
        cost_per_sample: GPU price x time per sample.
        per_iteration: one dict per iteration (times, instances, elastic decision).
        trace: the spans.
    """

    samples_per_s: float
    iteration_s: float
    gen_s: float
    train_s: float
    trainer_idle_frac: float
    generator_idle_frac: float
    exposed_sync_s: float
    cost_per_sample: float
    per_iteration: list[dict] = field(default_factory=list)
    trace: TraceRecorder = field(default_factory=TraceRecorder)

    def summary(self) -> dict:
        """The scalar results, rounded, as a JSON-ready dict."""
        keys = (
            "samples_per_s",
            "iteration_s",
            "gen_s",
            "train_s",
            "trainer_idle_frac",
            "generator_idle_frac",
            "exposed_sync_s",
            "cost_per_sample",
        )
        return {k: round(float(getattr(self, k)), 6) for k in keys}


class _Trainer:
    """Per-step trainer state: buckets, consumed groups, what it is doing until when."""

    def __init__(self) -> None:
        self.step = 0
        self.busy_until = 0.0
        self.state = "idle"  # idle | train | step | sync | switch | done
        self.buckets: dict[int, list[int]] = {}
        self.consumed = 0
        self.switched = False
        self.wait_from: float | None = None
        self.train_s = 0.0


class _Run:
    def __init__(self, config: SimConfig) -> None:
        self.c, self.trace = config, TraceRecorder(max_spans=2_000_000)
        self.steps = config.warmup + config.iterations
        self.colocated = config.mode == "colocated"
        gen = config.generators
        slowdown = gen.colocated_slowdown if self.colocated else gen.slowdown
        self.slowdown = slowdown
        self.instances = [self._instance(i) for i in range(gen.instances)]
        self.active = gen.instances
        self.rng = np.random.default_rng(config.seed)
        self.dispatcher = self._dispatcher()
        self.events: list[tuple[float, int, str, object]] = []
        self.seq = 0
        self.arrival = {0: 0.0}  # weight version -> when the generators have it
        self.partial: dict[tuple[int, str], int] = {}
        self.ready: dict[int, list[int]] = {}  # batch -> lengths of its complete groups
        self.batch_info: dict[int, dict] = {}
        self.iters: list[dict] = []
        self.t = _Trainer()
        cost = config.colocated_cost if self.colocated and config.colocated_cost else None
        self.cost = cost or config.trainer.cost
        budget = config.colocated_token_budget if self.colocated else None
        self.budget = budget or config.trainer.token_budget

    def _instance(self, index: int) -> SimInstance:
        gen = self.c.generators
        return SimInstance(
            index,
            gen.latency,
            gen.max_batch_size,
            self.c.admission == "lpt",
            self.slowdown,
            gen.prefill_s,
        )

    def _dispatcher(self):
        if self.c.dispatch == "random":
            return RandomDispatcher(self.c.seed)
        if self.c.dispatch == "round-robin":
            return RoundRobinDispatcher()
        gen = self.c.generators
        return SkewAwareDispatcher(gen.latency, gen.max_batch_size)

    # -- events ------------------------------------------------------------------------------
    def push(self, at: float, kind: str, data: object = None) -> None:
        heapq.heappush(self.events, (at, self.seq, kind, data))
        self.seq += 1

    def run(self) -> None:
        self.start_step(0.0)
        while self.t.state != "done":
            t_inst = min(inst.next_finish_s() for inst in self.instances)
            t_event = self.events[0][0] if self.events else float("inf")
            now = min(t_inst, t_event)
            if now == float("inf"):
                raise RuntimeError("Simulation stalled: no event left before the run ended.")
            for inst in self.instances:
                for running, at in inst.advance(now):
                    self.finished(inst, running, at)
            while self.events and self.events[0][0] <= now + _EPS:
                _, _, kind, data = heapq.heappop(self.events)
                if kind == "release":
                    index, requests = data
                    self.instances[index].release(requests, now)
                elif kind == "step":
                    self.start_step(now)
            self.poll(now)

    # -- generation side ---------------------------------------------------------------------
    def dispatch(self, batch: int, release_s: float) -> None:
        w = self.c.workload
        lengths = w.lengths(batch)
        noise = self.rng.lognormal(0.0, w.ranker_noise, len(lengths)) if w.ranker_noise else 1.0
        predicted = (np.asarray(lengths, dtype=float) * noise).tolist()
        requests = [
            Request(
                f"b{batch}p{j}",
                [0],
                n,
                s,
                forced_length=n,
                predicted_length=p,
                min_weight_version=max(0, batch - (self.c.mode == "async")),
                iteration=batch,
            )
            for j, (n, p) in enumerate(zip(lengths, predicted))
            for s in range(w.group_size)
        ]
        scores = [r.predicted_length for r in requests]
        if isinstance(self.dispatcher, SkewAwareDispatcher) and not self.dispatcher.recent:
            self.dispatcher.observe(int(p) for p in predicted)  # D from predictions at first
        parts = self.dispatcher.plan(requests, scores, self.active)
        while len(self.instances) < self.active:  # elastic scale-out: a fresh instance
            new = self._instance(len(self.instances))
            new.now = release_s
            self.instances.append(new)
        for index, part in enumerate(parts):
            if part:
                self.push(release_s, "release", (index, part))
        self.batch_info[batch] = {
            "release_s": release_s,
            "last_s": release_s,
            "lengths": lengths,
            "instances": self.active,
        }

    def finished(self, inst: SimInstance, running, at: float) -> None:
        r = running.request
        meta = {
            "prompt_id": r.prompt_id,
            "sample_index": r.sample_index,
            "length": r.max_tokens,
            "weight_version": r.min_weight_version,
        }
        lane = f"generator-{inst.instance_id}"
        self.trace.add(Span(lane, "generate", running.admitted_s, at, r.iteration, meta))
        info = self.batch_info[r.iteration]
        info["last_s"] = max(info["last_s"], at)
        info["first_s"] = min(info.get("first_s", at), running.admitted_s)
        key = (r.iteration, r.prompt_id)
        self.partial[key] = self.partial.get(key, 0) + 1
        if self.partial[key] == self.c.workload.group_size:  # the group is complete
            del self.partial[key]
            self.ready.setdefault(r.iteration, []).append(r.max_tokens)

    # -- trainer side --------------------------------------------------------------------------
    def start_step(self, now: float) -> None:
        b = self.t.step
        self.iters.append({"iteration": b, "start_s": now})
        mode, release = self.c.mode, now
        if self.colocated and self.c.switch_s > 0:  # the GPUs go back to generation
            self.span("colocated-switch", now, now + self.c.switch_s, b)
            release = now + self.c.switch_s
        if mode != "async":
            self.dispatch(b, max(release, self.arrival[b]))
        else:
            if b == 0:
                self.dispatch(0, now)
            if b + 1 < self.steps:  # batch b+1 needs weights b: at most one version stale
                self.dispatch(b + 1, max(now, self.arrival[b]))
        self.t.state, self.t.busy_until, self.t.consumed = "idle", now, 0
        self.t.switched, self.t.train_s, self.t.buckets = False, 0.0, {}

    def poll(self, now: float) -> None:
        t = self.t
        while t.state not in ("done",) and t.busy_until <= now + _EPS:
            if t.state == "sync":
                return self.end_step(now)
            started = self.next_work(now)
            if started is None:
                if t.wait_from is None:
                    t.wait_from = now
                return
            if t.wait_from is not None and now > t.wait_from:
                self.span("wait", t.wait_from, now, t.step)
            t.wait_from = None
            if t.busy_until > now + _EPS:
                self.push(t.busy_until, "trainer")
                return

    def next_work(self, now: float) -> str | None:
        """Start the trainer's next piece of work at ``now``; ``None`` if it must wait."""
        t, c, b = self.t, self.c, self.t.step
        prompts = c.workload.prompts
        ready = self.ready.setdefault(b, [])
        if self.colocated and t.consumed + len(ready) < prompts:
            return None  # time-sharing: every sample first
        if self.colocated and not t.switched and c.switch_s > 0:
            t.switched = True
            return self.busy("colocated-switch", now, c.switch_s)
        while ready:
            length = ready.pop(0)
            t.consumed += 1
            t.buckets.setdefault(bucket_of(c.workload.prompt_tokens, length), []).extend(
                [length] * c.workload.group_size
            )
            full = [k for k, rows in t.buckets.items() if self.tokens(rows) >= self.budget]
            if full:
                return self.train(now, t.buckets.pop(full[0]))
        if t.consumed < prompts:
            return None
        if t.buckets:
            return self.train(now, t.buckets.pop(min(t.buckets)))
        if t.state == "train":
            t.train_s += self.cost.step_s
            return self.busy("step", now, self.cost.step_s)
        if t.state == "step":
            return self.sync(now)
        return None

    def tokens(self, rows: list[int]) -> int:
        return len(rows) * (self.c.workload.prompt_tokens + max(rows))

    def train(self, now: float, rows: list[int]) -> str:
        seconds = self.cost.microbatch_s(self.tokens(rows), self.c.trainer.units)
        self.t.train_s += seconds
        return self.busy("train", now, seconds, samples=len(rows))

    def busy(self, name: str, now: float, seconds: float, **meta) -> str:
        self.span(name, now, now + seconds, self.t.step, **meta)
        self.t.state = "train" if name == "colocated-switch" else name
        self.t.busy_until = now + seconds
        return name

    def sync(self, now: float) -> str:
        b, transfer = self.t.step, self.c.weight_transfer_s
        self.arrival[b + 1] = now + transfer
        if self.c.mode == "async":  # the push returns at once; the transfer runs alongside
            self.trace.add(Span("weights", "sync-bg", now, now + transfer, b))
            self.iters[-1]["exposed_sync_s"] = 0.0
            return self.busy("sync", now, 0.0)
        self.iters[-1]["exposed_sync_s"] = transfer
        return self.busy("sync", now, transfer)

    def end_step(self, now: float) -> None:
        info, it = self.batch_info[self.t.step], self.iters[-1]
        # From the first admission: in async mode a batch may wait behind the previous one.
        gen_s = info["last_s"] - max(info["release_s"], info.get("first_s", info["release_s"]))
        it.update(
            end_s=now,
            iteration_s=now - it["start_s"],
            train_s=self.t.train_s,
            gen_s=gen_s,
            instances=info["instances"],
        )
        if self.c.elastic is not None:
            per_sample = [n for n in info["lengths"] for _ in range(self.c.workload.group_size)]
            d = self.c.elastic.observe(it["gen_s"], it["train_s"], info["instances"], per_sample)
            it.update(action=d.action, delta_s=d.delta_s, delta_prime_s=d.delta_prime_s)
            self.active = d.instances
        if isinstance(self.dispatcher, SkewAwareDispatcher):
            self.dispatcher.observe(info["lengths"])  # the recent length distribution D
        self.t.step += 1
        if self.t.step >= self.steps:
            self.t.state = "done"
            return
        self.push(now + self.c.iteration_overhead_s, "step")  # the training loop's own time
        self.t.state, self.t.busy_until = "between-steps", float("inf")

    def span(self, name: str, start: float, end: float, iteration: int, **meta) -> None:
        self.trace.add(Span("trainer", name, start, end, iteration, meta))


def simulate(config: SimConfig) -> SimResult:
    """Run ``config``; medians over its measured iterations (after ``warmup``)."""
    run = _Run(config)
    run.run()
    measured = run.iters[config.warmup :]
    start, end = measured[0]["start_s"], measured[-1]["end_s"]
    spans = run.trace.spans
    lanes = sorted({s.lane for s in spans if s.lane.startswith("generator-")})
    gen_busy = [busy_fraction(spans, lane, start, end) for lane in lanes]
    samples = config.workload.samples
    iteration_s = statistics.median(it["iteration_s"] for it in measured)
    return SimResult(
        samples_per_s=samples / iteration_s,
        iteration_s=iteration_s,
        gen_s=statistics.median(it["gen_s"] for it in measured),
        train_s=statistics.median(it["train_s"] for it in measured),
        trainer_idle_frac=1.0 - busy_fraction(spans, "trainer", start, end),
        generator_idle_frac=1.0 - statistics.mean(gen_busy) if gen_busy else 1.0,
        exposed_sync_s=statistics.median(it["exposed_sync_s"] for it in measured),
        cost_per_sample=_cost(config, measured) / (samples * len(measured)),
        per_iteration=run.iters,
        trace=run.trace,
    )


def _cost(config: SimConfig, measured: list[dict]) -> float:
    gen, trainer = config.generators, config.trainer
    total = 0.0
    for it in measured:
        gen_price = it["instances"] * gen.gpus_per_instance * gen.price_per_gpu_s
        train_price = trainer.gpus * trainer.price_per_gpu_s
        if config.mode == "colocated":  # the same GPUs do both stages
            price = max(gen_price, train_price)
        else:
            price = gen_price + train_price
        total += price * (it["end_s"] - it["start_s"])
    return total
