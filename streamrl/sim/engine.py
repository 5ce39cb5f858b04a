"""The discrete-event simulator of a StreamRL run (§3-§5): ``simulate(config) -> SimResult``.

Events are sample finishes on generator instances (continuous batching with ``PTL(BS)``),
request releases, weight arrivals (each instance loads them as its partial-rollout policy says
and holds an iteration's requests until it has loaded the weights they need,
``streamrl.sim.instance``) and the trainer becoming free. The trainer follows the real
``StreamRLModule``:

- a step starts by dispatching: ``sync`` / ``colocated`` dispatch this step's batch; ``async``
  with staleness bound k makes sure iterations ``t .. t + k`` are dispatched, iteration ``j``
  needing weights >= ``j - k`` (one-step staleness for k = 1);
- groups stream in; they are packed into length buckets and a bucket trains as soon as it holds
  ``token_budget`` padded tokens (dynamic-batch pipelining, §4.1); ``colocated`` first waits for
  every sample (time-sharing), then switches the GPUs to training;
- one optimizer step, then the weights travel (``bytes / bandwidth``): blocking in ``sync`` and
  ``colocated``, in the background in ``async``.

Each trained token's staleness (trainer version minus the version that drew it) is counted, as
the real run's ``train/token_staleness_mean``.

Every span goes to a ``TraceRecorder`` in the same JSON format as real runs, with simulated seconds
as timestamps, so ``streamrl timeline`` draws a simulated run.
"""

from __future__ import annotations

import heapq

import numpy as np

from streamrl.records import Request
from streamrl.sim.config import SimConfig, bucket_of
from streamrl.sim.instance import SimInstance
from streamrl.sim.result import SimResult, lag_stats, summarize
from streamrl.training.timeline import Span, TraceRecorder

__all__ = ["SimResult", "simulate"]

_EPS = 1e-9


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
        self.dispatcher = config.make_dispatcher()
        self.lengths_seen = False  # the dispatcher has observed lengths (predicted at first)
        self.events: list[tuple[float, int, str, object]] = []
        self.seq = 0
        self.latest = 0  # the newest weight version that has reached the generators
        self.dispatched = -1  # the last iteration dispatched
        self.lags: dict[int, dict[int, int]] = {}  # iteration -> {token staleness: tokens}
        self.partial: dict[tuple[int, str], int] = {}
        self.ready: dict[int, list[int]] = {}  # batch -> lengths of its complete groups
        self.batch_info: dict[int, dict] = {}
        self.iters: list[dict] = []
        self.t = _Trainer()
        cost = config.colocated_cost if self.colocated and config.colocated_cost else None
        self.cost = cost or config.trainer.cost
        budget = config.colocated_token_budget if self.colocated else None
        self.budget = budget or config.trainer.token_budget

    def _instance(self, index: int, version: int = 0) -> SimInstance:
        gen = self.c.generators
        return SimInstance(
            index,
            gen.latency,
            gen.max_batch_size,
            self.c.make_queue(),
            self.slowdown,
            gen.prefill_s,
            partial_rollout=self.c.partial_rollout,
            prefill_s_per_token=gen.prefill_s_per_token,
            prompt_tokens=self.c.workload.prompt_tokens,
            version=version,
        )

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
                elif kind == "weights":  # a version reaches every instance
                    self.latest = max(self.latest, data)
                    for inst in self.instances:
                        inst.offer(data, now)
                elif kind == "step":
                    self.start_step(now)
            self.poll(now)
            self.share_cores(now)

    # -- shared cores (a CPU machine) ------------------------------------------------------------
    def decoding(self) -> int:
        """Instances decoding or prefilling now."""
        return sum(1 for inst in self.instances if inst.running)

    def computing(self, now: float) -> int:
        """Processes computing at ``now``: the instances decoding or prefilling, and the trainer
        on a micro-batch or its optimizer step."""
        trainer = self.t.state in ("train", "step") and self.t.busy_until > now + _EPS
        return self.decoding() + trainer

    def share(self, computing: int) -> float:
        """How many times slower each computing process runs (``SimConfig.cores``)."""
        return max(1.0, computing / self.c.cores) if self.c.cores else 1.0

    def share_cores(self, now: float) -> None:
        """Set every instance's step cost for what computes from ``now`` on (the instances have
        decoded up to ``now`` at the old rate)."""
        if self.c.cores:
            slowdown = self.slowdown * self.share(self.computing(now))
            for inst in self.instances:
                inst.slowdown = slowdown

    # -- generation side ---------------------------------------------------------------------
    def dispatch(self, batch: int, release_s: float, min_version: int) -> None:
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
                min_weight_version=min_version,
                iteration=batch,
            )
            for j, (n, p) in enumerate(zip(lengths, predicted))
            for s in range(w.group_size)
        ]
        scores = [r.predicted_length for r in requests]
        if not self.lengths_seen:  # Algorithm 2's D from the predictions at first
            self.dispatcher.observe([int(p) for p in predicted])
            self.lengths_seen = True
        parts = self.dispatcher.plan(requests, scores, self.active)
        while len(self.instances) < self.active:  # elastic scale-out: a fresh instance
            new = self._instance(len(self.instances), self.latest)
            new.now = release_s
            self.instances.append(new)
        for index, part in enumerate(parts):
            if part:
                self.push(release_s, "release", (index, part))
        self.dispatched = batch
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
            "weight_version": running.version,
            "token_versions": sorted(running.tokens.items()),
        }
        lags = self.lags.setdefault(r.iteration, {})
        for version, tokens in running.tokens.items():  # trained at step r.iteration
            lags[r.iteration - version] = lags.get(r.iteration - version, 0) + tokens
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
            self.dispatch(b, release, b)
        else:  # iterations b .. b + k; iteration j needs weights j - k: at most k stale
            k = self.c.staleness
            while self.dispatched < min(b + k, self.steps - 1):
                j = self.dispatched + 1
                self.dispatch(j, now, max(0, j - k))
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
        if not self.colocated:  # beside the decoding instances (colocated: they wait)
            seconds *= self.share(self.decoding() + 1)
        self.t.train_s += seconds
        return self.busy("train", now, seconds, samples=len(rows))

    def busy(self, name: str, now: float, seconds: float, **meta) -> str:
        self.span(name, now, now + seconds, self.t.step, **meta)
        self.t.state = "train" if name == "colocated-switch" else name
        self.t.busy_until = now + seconds
        return name

    def sync(self, now: float) -> str:
        b, transfer = self.t.step, self.c.weight_transfer_s
        self.push(now + transfer, "weights", b + 1)
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
            **lag_stats(self.lags.get(self.t.step, {})),
        )
        if self.c.elastic is not None:
            per_sample = [n for n in info["lengths"] for _ in range(self.c.workload.group_size)]
            d = self.c.elastic.observe(it["gen_s"], it["train_s"], info["instances"], per_sample)
            it.update(action=d.action, delta_s=d.delta_s, delta_prime_s=d.delta_prime_s)
            self.active = d.instances
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
    return summarize(config, run.iters, run.trace, run.instances)
