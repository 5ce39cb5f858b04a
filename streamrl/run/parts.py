"""From a config to component objects: the YAML edge of every extension point.

``rl.algorithm``, ``rl.dispatcher``, ``rl.scheduler``, ``rl.length_predictor``, ``rl.engine``,
``rl.cluster`` and ``rl.elastic`` each hold ``{class_path, init_args}``
(``streamrl.run.swappable``: a built-in's short name or your class's import path, with its
constructor's arguments), and ``rl.reward`` a reward's name or ``package.module:function``::

    rl:
      algorithm: my_lab.algos.MyGRPO                  # an Algorithm subclass
      reward: my_lab.rewards:score                    # fn(completion, row) -> float
      dispatcher: {class_path: skew, init_args: {alpha: 0.3}}
      engine: {class_path: vllm, init_args: {options: {max_model_len: 512}}}

A component takes what it needs from the run in its ``from_run`` classmethod (a
``RunContext``: the skewness-aware dispatcher asks for the measured ``PTL(BS)``, the HF engine
for the run's LoRA adapters; an algorithm gets ``RunFacts``), so nothing here branches on a
name or reads a parameter's name. ``check_parts`` resolves and checks them all when the run
starts, before the warm start; ``RunParts.from_config`` builds them once the policy is loaded.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from streamrl.algorithms import Algorithm, RunFacts, build_algorithm
from streamrl.components.capacity.elastic import ElasticController
from streamrl.components.generation.clusters import make_cluster
from streamrl.components.generation.service import StreamGenerationService
from streamrl.components.run_context import RunContext, build_from_run
from streamrl.components.skewness.by_name import (
    build_dispatcher,
    scheduler_factory,
)
from streamrl.components.skewness.latency import LatencyModel
from streamrl.errors import ConfigError
from streamrl.policy.lora import LoRASpec
from streamrl.protocols import AdmissionScheduler, Dispatcher, GenerationEngine, LengthPredictor
from streamrl.rewards.pool import RewardPool
from streamrl.rewards.spec import RewardSpec
from streamrl.run.config import RLConfig, RunConfig
from streamrl.run.swappable import default_of, factory_and_args
from streamrl.runtime.devices import Placement
from streamrl.runtime.references import check_options, checked


@dataclass
class RunParts:
    """The component objects of a run, built from its config.

    Attributes:
        algorithm: advantages and loss.
        rewards: the task reward(s) and their weights (run by a ``RewardPool``).
        engine: builds each generator instance's engine.
        dispatcher: splits requests over instances.
        scheduler: makes each instance's admission queue.
        length_predictor: output-length predictions for dispatch and LPT, or ``None``.
        elastic: adds generator instances while training runs, or ``None``.
        lora: the policy's adapters, or ``None`` (full fine-tuning).
        latency: the ``PTL(BS)`` the dispatcher and the elastic controller share, if either
            uses one: measured by the generator instances themselves when they start
            (``StreamGenerationService(profile_latency=...)``), then filled in here in place
            (``LatencyModel.update_from``) before anything is dispatched; ``None``: unused.
    """

    algorithm: Algorithm
    rewards: list[RewardSpec]
    engine: GenerationEngine
    dispatcher: Dispatcher
    scheduler: Callable[[], AdmissionScheduler]
    length_predictor: LengthPredictor | None
    elastic: ElasticController | None
    lora: LoRASpec | None
    latency: LatencyModel | None = None

    @classmethod
    def from_config(
        cls, config: RunConfig, policy: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
    ) -> RunParts:
        """Build every part ``config`` names, giving each what it declares it needs."""
        rl = config.rl
        run = run_context(rl, config.seed, tokenizer)
        return cls(
            algorithm=build_run_algorithm(rl, policy.config.hidden_size),
            rewards=reward_specs(rl),
            engine=_engine(rl, run),
            dispatcher=build_dispatcher(rl.dispatcher, run),
            scheduler=scheduler_factory(rl.scheduler),
            length_predictor=_length_predictor(rl, run),
            elastic=_elastic(rl, run),
            lora=run.lora,
            # Asked for by a part that sizes pools or scales them; measured by the instances
            # on their own engine when they start (the run fills it in before dispatch).
            latency=run.latency_model,
        )


def run_context(
    rl: RLConfig, seed: int, tokenizer: PreTrainedTokenizerBase | None = None
) -> RunContext:
    """What this run gives the parts it builds (``from_run``).

    A character-level tokenizer (the built-in toy tasks') is not given: a ranker's token
    n-grams would repeat its character n-grams at twice the training cost.
    """
    if tokenizer is not None and _one_character_tokens(tokenizer):
        tokenizer = None
    return RunContext(
        max_batch_size=rl.arg("generation", "max_batch_size"),
        seed=seed,
        instances=rl.arg("generation", "num_instances"),
        elastic=rl.elastic is not None,
        tokenizer=tokenizer,
        lora=rl.lora,
    )


def check_parts(rl: RLConfig, placement: Placement | None = None) -> None:
    """Resolve and check every extension point of ``rl`` without loading a model (and, given
    the trainer's ``placement``, that the algorithm can train there).

    Raises:
        ConfigError: a name that is neither a built-in nor importable, a wrong signature, a
            component without its protocol's methods, or an algorithm refusing the settings.
    """
    reward_pool(rl, reward_specs(rl))  # every reward imports and can be called; pool values
    algorithm = build_run_algorithm(rl, hidden_size=1)  # the algorithm checks its own needs
    if placement is not None and placement.sharded and not algorithm.shardable:
        raise ConfigError(
            f"{type(algorithm).__name__} cannot train sharded yet (its own parameters are not "
            f"sharded by FSDP), but trainer.devices={placement.ranks_per_node} and "
            f"trainer.precision={placement.precision} train with FSDP2; use one trainer "
            "process with trainer.precision: 32-true."
        )
    run = run_context(rl, seed=0)
    engine = _engine(rl, run)
    cluster = make_cluster(rl.cluster)
    gpus = rl.arg("generation", "gpus_per_instance")
    try:  # a missing extra or absent GPUs fail here, not inside a generator process
        cluster.check(gpus)
    except ConfigError as err:
        raise ConfigError(f"rl.cluster: {err}") from err
    try:
        engine.check(cluster=cluster, gpus_per_instance=gpus)
    except ConfigError as err:
        raise ConfigError(f"rl.engine: {err}") from err
    try:  # rl.generation's values, by the service's constructor (nothing starts); before the
        # parts sized by them
        StreamGenerationService("", engine=engine, cluster=cluster, **rl.generation)
    except (TypeError, ValueError, ConfigError) as err:
        raise ConfigError(f"rl.generation: {err}") from None
    build_dispatcher(rl.dispatcher, run)
    scheduler_factory(rl.scheduler)
    _length_predictor(rl, run)
    _elastic(rl, run)


def reward_specs(rl: RLConfig) -> list[RewardSpec]:
    """The run's rewards (``rl.reward``: a name, ``package.module:function``, or a weighted
    list; ``None``: ``exact``); ``ConfigError`` on a malformed entry."""
    return RewardSpec.from_config("exact" if rl.reward is None else rl.reward)


def reward_pool(
    rl: RLConfig, specs: list[RewardSpec], output_dir: str | Path | None = None
) -> RewardPool:
    """The pool that scores samples with ``specs``: ``rl.reward_pool``'s arguments, its
    workers' pids in ``<output_dir>/reward_workers.json`` and reward faults in
    ``reward_faults.jsonl`` (no files without ``output_dir``). No process starts before
    ``start()``; ``ConfigError`` on an unknown argument or a bad value."""
    check_options(RewardPool, rl.reward_pool, where="rl.reward_pool")
    files = {}
    if output_dir is not None:
        out = Path(output_dir)
        files = dict(
            status_path=out / "reward_workers.json", faults_path=out / "reward_faults.jsonl"
        )
    try:
        return RewardPool(specs, **rl.reward_pool, **files)
    except ConfigError:  # a reward that does not resolve: its message names rl.reward
        raise
    except (TypeError, ValueError) as err:
        raise ConfigError(f"rl.reward_pool: {err}") from None


def reward_timeout_s(rl: RLConfig) -> float:
    """The most one reward call may take: ``rl.reward_pool``'s ``timeout_s``, else
    ``RewardPool``'s default (the held-out evaluation scores under it too)."""
    return float(rl.reward_pool.get("timeout_s", default_of(RewardPool, "timeout_s")))


def build_run_algorithm(rl: RLConfig, hidden_size: int) -> Algorithm:
    """The run's algorithm, as every trainer rank builds it: ``rl.algorithm``'s class and
    ``init_args`` (checked against its constructor), then ``build_algorithm``."""
    cls, options = factory_and_args("algorithm", rl.algorithm)
    facts = RunFacts(
        group_size=rl.group_size,
        max_tokens=rl.arg("rollouts", "max_tokens"),
        hidden_size=hidden_size,
        prompts_per_iteration=rl.prompts_per_iteration,
    )
    check_options(cls, options, where="rl.algorithm")
    try:
        return build_algorithm(cls, facts, **options)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"rl.algorithm: {err}") from err


def _engine(rl: RLConfig, run: RunContext) -> GenerationEngine:
    factory, options = factory_and_args("engine", rl.engine)
    if run.lora is not None and inspect.getattr_static(factory, "from_run", None) is None:
        raise ConfigError(
            f"rl.engine: {factory.__qualname__} takes no LoRA adapters (rl.lora): an engine "
            "that can carries them from its from_run(run, **options) (run.lora); use the 'hf' "
            "engine or rl.lora: null."
        )
    engine = build_from_run(factory, run, options, where="rl.engine")
    return checked(engine, GenerationEngine, "rl.engine")


def _length_predictor(rl: RLConfig, run: RunContext) -> LengthPredictor | None:
    """The run's length predictor; the ranker reads your prompts in the policy's own tokens
    (§5.2 on real prompts) when the run gives its tokenizer (``run_context``)."""
    if rl.length_predictor is None:
        return None
    factory, options = factory_and_args("length_predictor", rl.length_predictor)
    predictor = build_from_run(factory, run, options, where="rl.length_predictor")
    return checked(predictor, LengthPredictor, "rl.length_predictor")


def _elastic(rl: RLConfig, run: RunContext) -> ElasticController | None:
    """The run's elastic controller (§4.2), its ``PTL(BS)`` measured by the instances when they
    start; ``None``: a fixed number of instances."""
    if rl.elastic is None:
        return None
    factory, options = factory_and_args("elastic", rl.elastic)
    try:
        return build_from_run(factory, run, options, where="rl.elastic")
    except (TypeError, ValueError) as err:  # its own checks (a ConfigError is a ValueError)
        message = str(err)
        raise ConfigError(message if message.startswith("rl.") else f"rl.elastic: {err}") from None


def _one_character_tokens(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether every token but the special ones decodes to one character (at most: a byte of a
    character of several bytes decodes to a replacement character)."""
    special = set(tokenizer.all_special_ids)
    return all(len(tokenizer.decode([i])) <= 1 for i in range(len(tokenizer)) if i not in special)
