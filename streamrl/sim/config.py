"""What a simulated StreamRL run is made of: hardware pools, workload, mode (StreamRL §3-§5).

Plain dataclasses, no behaviour beyond validation and two derived numbers (weight transfer time
and the micro-batch bucket of a sample); ``streamrl.sim.engine`` runs them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from streamrl.components.capacity.allocator import TrainerCostModel
from streamrl.components.capacity.elastic import ElasticController
from streamrl.components.generation.partial import PARTIAL_ROLLOUT
from streamrl.components.run_context import RunContext
from streamrl.components.skewness.by_name import ComponentName, build_dispatcher, scheduler_factory
from streamrl.components.skewness.latency import LatencyModel
from streamrl.components.training.staleness import staleness_bound_of
from streamrl.components.weights.broadcast_tree import plan_broadcast, plan_time_s
from streamrl.protocols import AdmissionScheduler, Dispatcher

SimMode = Literal["colocated", "sync", "async"]
MODES: tuple[str, ...] = ("colocated", "sync", "async")


@dataclass
class GeneratorPool:
    """The stream generation service's hardware (§3): identical instances.

    Attributes:
        latency: ``PTL(BS)`` of one instance.
        instances: instances at the start of the run.
        max_batch_size: batch slots per instance (count and KV-cache bound).
        gpus_per_instance: GPUs (or CPU cores) one instance occupies (its TP degree).
        price_per_gpu_s: cost of one GPU for one second, in any currency unit.
        slowdown: multiplies ``PTL`` in the disaggregated modes, where the trainer computes at
            the same time (on a 2-core CPU; 1.0 on separate GPUs).
        colocated_slowdown: the same in colocated mode (instances share the cores with each
            other and with the process that receives the samples).
        prefill_s: one prefill pass, paid each time an instance admits samples (and the fixed
            part of a re-prefill).
        prefill_s_per_token: seconds per padded token of a re-prefill of the running samples
            (partial rollout ``"recompute"``), times ``slowdown``; admission passes pay
            ``prefill_s`` alone.
    """

    latency: LatencyModel
    instances: int
    max_batch_size: int
    gpus_per_instance: int = 1
    price_per_gpu_s: float = 1.0
    slowdown: float = 1.0
    colocated_slowdown: float = 1.0
    prefill_s: float = 0.0
    prefill_s_per_token: float = 0.0


@dataclass
class TrainerPool:
    """The trainer's hardware (§3) and its micro-batching (§4.1).

    Attributes:
        cost: per-token cost and data-parallel scaling (``TrainerCostModel``).
        units: trainer units (``cost.unit_gpus`` GPUs each).
        token_budget: padded tokens per micro-batch.
        price_per_gpu_s: cost of one GPU for one second.
    """

    cost: TrainerCostModel
    units: int
    token_budget: int
    price_per_gpu_s: float = 1.0

    @property
    def gpus(self) -> int:
        return self.units * self.cost.unit_gpus


@dataclass
class Workload:
    """One iteration's prompts and their output lengths.

    Attributes:
        lengths: ``lengths(iteration)`` gives one output length per prompt of that iteration
            (forced lengths, the paper's throughput protocol §7; a prompt's samples share it).
        prompts: prompts per iteration.
        group_size: samples per prompt (GRPO groups; 1 for the paper's PPO).
        prompt_tokens: prompt length, counted in training tokens (prefill is not simulated).
        ranker_noise: sigma of the log-normal noise on true lengths that gives the ranker's
            predictions for skew dispatch and LPT (0: oracle).
    """

    lengths: Callable[[int], list[int]]
    prompts: int
    group_size: int = 1
    prompt_tokens: int = 0
    ranker_noise: float = 0.25

    @property
    def samples(self) -> int:
        return self.prompts * self.group_size


@dataclass
class SimConfig:
    """A simulated run.

    Attributes:
        generators / trainer: the two pools (in colocated mode both describe the same GPUs,
            used one phase after the other, and are priced once, as the larger of the two).
        workload: prompts and lengths.
        mode: ``"colocated"``, ``"sync"`` (dynamic-batch pipelining) or ``"async"`` (bounded
            staleness, weight transfer in the background).
        staleness_bound: async only: iterations dispatched ahead of the one training, k >= 1;
            iteration ``j`` needs weights >= ``j - k`` (``None``: 1 in async, 0 otherwise, as
            the real ``StreamRLModule``; ``staleness`` is the value in force).
        partial_rollout: what an instance does with running samples when new weights arrive:
            ``"finish"`` (finish them first), ``"keep"`` (go on under the new weights) or
            ``"recompute"`` (re-prefill them, then go on); not ``"finish"`` only in async mode.
        dispatch: which instance gets each request, as a run's ``rl.dispatcher`` says it
            (``"skew"``: Algorithm 2; ``"round_robin"``, ``"random"``; ``package.module.Name``
            or ``{class_path: ..., init_args: {...}}`` for your own class, built by its ``from_run``
            with this simulation's ``RunContext``, the preset's ``PTL(BS)`` in it), or a
            ``Dispatcher`` object (used as it is, its state carried from one simulation to the
            next).
        admission: each instance's admission queue, as a run's ``rl.scheduler`` says it
            (``"lpt"``, ``"fifo"``, your own), or a callable that makes one.
        iterations / warmup: measured iterations after unmeasured ones.
        weight_bytes / link_gbps / sync_latency_s: the weight transfer, ``bytes / bandwidth``
            plus a fixed latency (loading, resharding).
        sites / trainer_site / trainer_ranks / local_gbps: with ``sites`` (site -> instance
            ids), the transfer is the network-aware broadcast plan of §6 instead
            (``broadcast_tree.plan_time_s``): ``link_gbps`` across sites, ``local_gbps`` inside.
        switch_s: colocated only: seconds to switch the GPUs between the stages, paid twice per
            iteration (generation -> training -> generation).
        colocated_cost: the trainer's cost model in colocated mode when it differs (e.g. two CPU
            threads instead of one); ``None`` keeps ``trainer.cost``.
        colocated_token_budget: micro-batch budget in colocated mode; ``None`` keeps the pool's.
        iteration_overhead_s: fixed per-iteration time of the training loop (logging, Python).
        elastic: adds / removes generator instances between iterations (§4.2), or ``None``.
        seed: dispatch and ranker-noise seed.
        cores: the cores the generator instances and the trainer share (a CPU machine, one
            compute thread each): while more of them compute than there are cores, each runs
            ``computing / cores`` times slower (processor sharing). 0 (the default): each has
            its own device, as on GPUs.
    """

    generators: GeneratorPool
    trainer: TrainerPool
    workload: Workload
    mode: SimMode = "sync"
    staleness_bound: int | None = None
    partial_rollout: str = "finish"
    dispatch: ComponentName | Dispatcher = "round_robin"
    admission: ComponentName | Callable[[], AdmissionScheduler] = "fifo"
    iterations: int = 6
    warmup: int = 1
    weight_bytes: float = 0.0
    link_gbps: float = 100.0
    sync_latency_s: float = 0.0
    switch_s: float = 0.0
    colocated_cost: TrainerCostModel | None = None
    colocated_token_budget: int | None = None
    iteration_overhead_s: float = 0.0
    elastic: ElasticController | None = None
    seed: int = 0
    labels: dict = field(default_factory=dict)
    sites: dict[str, list[int]] | None = None
    trainer_site: str = ""
    trainer_ranks: int = 1
    local_gbps: float = 200.0
    cores: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}.")
        staleness_bound_of(self.mode, self.staleness_bound)  # ValueError if it cannot hold
        if self.partial_rollout not in PARTIAL_ROLLOUT:
            raise ValueError(
                f"partial_rollout must be one of {PARTIAL_ROLLOUT}, got {self.partial_rollout!r}."
            )
        if self.partial_rollout != "finish" and self.mode != "async":
            raise ValueError(
                f"partial_rollout={self.partial_rollout!r} needs mode async (in {self.mode} "
                "mode no weights arrive while samples run)."
            )
        self.make_dispatcher()  # a name resolves and builds
        self.make_queue()  # one queue made and checked
        if self.iterations < 1 or self.warmup < 0:
            raise ValueError("Need iterations >= 1 and warmup >= 0.")
        if self.link_gbps <= 0 or self.local_gbps <= 0:
            raise ValueError(f"Bandwidths must be > 0, got {self.link_gbps=}, {self.local_gbps=}.")
        if self.sites is not None:  # a bad site map fails here, not mid-run
            plan_broadcast(self.sites, self.trainer_site, self.trainer_ranks)

    def make_dispatcher(self) -> Dispatcher:
        """The dispatcher of one simulation: ``dispatch`` built afresh for this run (as a real
        run builds it, with the preset's ``PTL(BS)``), or the object given."""
        if isinstance(self.dispatch, Dispatcher):
            return self.dispatch
        gen = self.generators
        run = RunContext(
            max_batch_size=gen.max_batch_size,
            seed=self.seed,
            instances=gen.instances,
            elastic=self.elastic is not None,
            latency_model=gen.latency,
        )
        return build_dispatcher(self.dispatch, run, where="dispatch")

    def make_queue(self) -> AdmissionScheduler:
        """A new admission queue for one instance."""
        if callable(self.admission):
            return self.admission()
        return scheduler_factory(self.admission, where="admission")()

    @property
    def staleness(self) -> int:
        """The staleness bound in force: ``staleness_bound``, or the mode's default."""
        return staleness_bound_of(self.mode, self.staleness_bound)

    @property
    def weight_transfer_s(self) -> float:
        """Seconds to move the weights: ``bytes x 8 / (Gbit/s x 1e9)`` (or the broadcast plan's
        time when ``sites`` is set) plus the fixed latency."""
        if self.sites is not None:
            plan = plan_broadcast(self.sites, self.trainer_site, self.trainer_ranks)
            transfer_s = plan_time_s(plan, self.weight_bytes, self.local_gbps, self.link_gbps)
            return transfer_s + self.sync_latency_s
        return self.weight_bytes * 8 / (self.link_gbps * 1e9) + self.sync_latency_s


def bucket_of(prompt_tokens: int, length: int) -> int:
    """The micro-batch bucket of a sample: powers of two of prompt + completion, as in
    ``DynamicBatchPipeline`` (so a long sample never pads a batch of short ones)."""
    return (prompt_tokens + length - 1).bit_length()
