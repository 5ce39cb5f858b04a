"""Checks of a ``RunConfig`` that types alone cannot make: ranges, names, one data source, the
trainer ranks an algorithm allows. Each raises a ``ConfigError`` that names the key and the fix,
before any work starts (``streamrl.run.config_file.load_config`` and ``streamrl fit`` call
``check_values``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from streamrl.components.generation.clusters import LocalCluster, make_cluster
from streamrl.components.generation.engines import VLLMEngine
from streamrl.components.generation.timeouts import Timeouts
from streamrl.components.training.off_policy import OffPolicyCorrection
from streamrl.components.training.pipeline import DynamicBatchPipeline
from streamrl.errors import ConfigError, unknown_name
from streamrl.policy.model_dir import check_model_dir
from streamrl.rewards.spec import RewardSpec, check_reward_packages
from streamrl.run.config import CONSTRUCTOR_SECTIONS, DataConfig, RLConfig, RunConfig
from streamrl.run.memory_checks import check_memory
from streamrl.run.swappable import default_of, factory_and_args
from streamrl.runtime.cores import usable_cores
from streamrl.runtime.devices import Placement, resolve_placement
from streamrl.runtime.references import check_option_types, check_options, resolve
from streamrl.tasks.families import FAMILIES

#: The dtypes the trained policy may be written in (``trainer.save_dtype``).
SAVE_DTYPES = ("auto", "bfloat16", "float16", "float32")
#: Lightning loggers a run can write to, and the package each needs.
LOGGERS = {"csv": None, "tensorboard": "tensorboard", "wandb": "wandb"}


def check_output_dir(output_dir: str | Path) -> None:
    """``output_dir`` is a directory, or can be made one: no file stands at it or above it, and
    the nearest existing folder takes a new entry (a folder made and removed at once: a
    read-only filesystem, ``/proc`` or a folder of someone else's fail here, before any work).

    Raises:
        ConfigError: a file is in the way, or nothing can be written there.
    """
    path = Path(output_dir)
    for place in (path, *path.parents):
        if place.exists():
            if not place.is_dir():
                raise ConfigError(
                    f"output_dir {str(path)!r}: {str(place)!r} is a file, not a directory; "
                    "choose another output_dir (it is created if missing)."
                )
            try:
                os.rmdir(tempfile.mkdtemp(prefix=".streamrl-write-check-", dir=place))
            except OSError as err:
                raise ConfigError(
                    f"output_dir {str(path)!r}: nothing can be written in {str(place)!r} "
                    f"({err.strerror}); choose an output_dir you can write to, e.g. runs/mine."
                ) from None
            return


def check_values(config: RunConfig) -> None:
    """Check values that types alone cannot (ranges, names); raises ``ConfigError``."""
    data, sft = config.data, config.sft
    check_output_dir(config.output_dir)
    if config.model != "tiny":
        check_model_dir(config.model)
    check_data_source(data)
    if not (data.prompt_file or data.path or data.reasoning_gym):
        if not data.tasks:
            raise ConfigError(f"data.tasks is empty; choose from {sorted(FAMILIES)}.")
        for task in data.tasks:
            if task not in FAMILIES:
                raise ConfigError(f"data.tasks: {unknown_name('task', task, FAMILIES)}")
    if data.n_train < 1 or data.n_heldout < 1:
        raise ConfigError(
            f"data.n_train and data.n_heldout must be >= 1 (an empty prompt set has nothing to "
            f"train or evaluate on), got {data.n_train} and {data.n_heldout}."
        )
    if not 1 <= data.median_len <= data.max_len or data.tail < 0:
        raise ConfigError(
            "data: need 1 <= median_len <= max_len and tail >= 0, got "
            f"median_len={data.median_len}, max_len={data.max_len}, tail={data.tail}."
        )
    if sft.tokenizer not in ("bpe", "char"):
        raise ConfigError(
            f"sft.tokenizer: {unknown_name('tokenizer', sft.tokenizer, ['bpe', 'char'])}"
        )
    tiny_sizes = ["test", "demo", "moe-test", "moe"]
    if sft.model_size not in tiny_sizes:
        raise ConfigError(f"sft.model_size: {unknown_name('size', sft.model_size, tiny_sizes)}")
    if config.model == "tiny" and sft.steps == 0:
        print(
            "warning: sft.steps: 0 starts RL from the tiny policy's random weights: its samples "
            "earn no reward and RL has nothing to reinforce; give sft.steps (e.g. the default) "
            "unless that is what you study.",
            file=sys.stderr,
        )
    if config.logger not in LOGGERS:
        raise ConfigError(f"logger: {unknown_name('logger', config.logger, LOGGERS)}")
    needed = LOGGERS[config.logger]
    if needed is not None and importlib.util.find_spec(needed) is None:
        raise ConfigError(f"logger: {config.logger!r} needs {needed!r}: pip install {needed}")
    check_rl(config.rl)
    check_trainer(config)
    if config.env.name and config.rl.eval.k > 1:
        raise ConfigError(
            f"rl.eval.k: {config.rl.eval.k} would go unused: an episode run (env.name "
            f"{config.env.name!r}) evaluates one greedy episode per held-out row; remove it."
        )
    if config.env.name and config.rl.reward is not None:
        raise ConfigError(
            f"rl.reward: {config.rl.reward!r} would go unused: in an episode run (env.name "
            f"{config.env.name!r}) the environment's step rewards each episode; remove rl.reward."
        )
    if config.env.on_fault not in ("drop", "train"):
        raise ConfigError(
            f"env.on_fault: {unknown_name('choice', config.env.on_fault, ['drop', 'train'])}"
        )
    if (config.env.workers or 0) < 0 or config.env.max_restarts < 0:
        raise ConfigError(
            f"env: need workers >= 0 (0: threads of the trainer) and max_restarts >= 0, got "
            f"workers={config.env.workers}, max_restarts={config.env.max_restarts}."
        )
    if sft.steps < 0 or sft.lr <= 0 or not 0 <= sft.demo_noise <= 1 or not 0 <= sft.early_stop <= 1:
        raise ConfigError(
            "sft: need steps >= 0, lr > 0, 0 <= demo_noise <= 1 and 0 <= early_stop <= 1, got "
            f"steps={sft.steps}, lr={sft.lr}, demo_noise={sft.demo_noise}, "
            f"early_stop={sft.early_stop}."
        )
    if sft.demo_share is not None and not 0 < sft.demo_share < 1:
        raise ConfigError(
            f"sft.demo_share: need a share strictly between 0 and 1 (or null), got "
            f"{sft.demo_share}."
        )
    for task in sft.early_stop_tasks:
        if task not in FAMILIES:
            raise ConfigError(f"sft.early_stop_tasks: {unknown_name('task', task, FAMILIES)}")


def check_data_source(data: DataConfig) -> None:
    """One source of prompts, and held-out options only where they apply; ``ConfigError``."""
    sources = [k for k in ("prompt_file", "path", "reasoning_gym") if getattr(data, k)]
    if len(sources) > 1:
        raise ConfigError(
            f"data: {' and '.join(sources)} are both set; choose one source of prompts."
        )
    heldout = [k for k in ("heldout_path", "heldout_split", "heldout_fraction") if getattr(data, k)]
    if heldout and not data.path:
        raise ConfigError(f"data.{heldout[0]} applies to data.path only; set data.path too.")
    if len(heldout) > 1:
        raise ConfigError(f"data: {' and '.join(heldout)} are both set; choose one held-out set.")
    if data.heldout_fraction is not None and not 0 < data.heldout_fraction < 1:
        raise ConfigError(
            f"data.heldout_fraction must be between 0 and 1, got {data.heldout_fraction}."
        )


def placement_of(config: RunConfig) -> Placement:
    """Where ``config``'s trainer runs and which GPUs its generators take
    (``streamrl.runtime.devices.resolve_placement``); ``ConfigError`` for an impossible or
    overlapping choice, before any work."""
    trainer, rl = config.trainer, config.rl
    return resolve_placement(
        trainer.accelerator,
        trainer.devices,
        trainer.num_nodes,
        trainer.precision,
        generator_gpus_per_instance=rl.arg("generation", "gpus_per_instance"),
        generator_devices=rl.arg("generation", "gpu_ids"),
        local_generators=isinstance(make_cluster(rl.cluster), LocalCluster),
        share_trainer_gpus=trainer.share_gpus,
    )


def check_trainer(config: RunConfig) -> None:
    """The trainer section: its devices against this machine's GPUs and the generators', and
    what several trainer ranks do not support yet; ``ConfigError``."""
    trainer = config.trainer
    placement = placement_of(config)
    if trainer.logprob_chunk_tokens is not None and trainer.logprob_chunk_tokens < 1:
        raise ConfigError(
            f"trainer.logprob_chunk_tokens must be >= 1 (or null), got "
            f"{trainer.logprob_chunk_tokens}."
        )
    if trainer.sharded_checkpoints and not placement.sharded:
        raise ConfigError(
            "trainer.sharded_checkpoints writes each FSDP2 rank's shards, but this trainer is "
            "not sharded (one process, trainer.precision: 32-true); drop the option."
        )
    if trainer.reference_offload and not placement.sharded:
        raise ConfigError(
            "trainer.reference_offload keeps the reference's FSDP2 shards in host memory, but "
            "this trainer is not sharded (one process, trainer.precision: 32-true); use "
            "trainer.precision: bf16-mixed or more trainer.devices, or drop the option."
        )
    if trainer.save_dtype not in SAVE_DTYPES:
        raise ConfigError(
            f"trainer.save_dtype: {unknown_name('dtype', trainer.save_dtype, SAVE_DTYPES)}"
        )
    algorithm = config.rl.algorithm["class_path"]
    in_notebook = getattr(sys.modules["__main__"], "__file__", None) is None
    if placement.ranks > 1 and algorithm.startswith("__main__.") and in_notebook:
        raise ConfigError(
            f"rl.algorithm: {algorithm} is defined in this notebook (or interactive session), "
            f"which the {placement.ranks - 1} other trainer rank(s) cannot import: define it in "
            "a module (package.module.Name), or train on one device (trainer.devices: 1)."
        )
    check_memory(config, placement)  # each device fits the run's estimate
    cores = usable_cores()
    if placement.accelerator == "cpu" and placement.ranks_per_node > cores:
        print(
            f"warning: trainer.devices asks for {placement.ranks_per_node} CPU trainer ranks on "
            f"{cores} core(s) (beside {config.rl.arg('generation', 'num_instances')} generator "
            "processes): ranks share cores and every collective waits for a descheduled one, "
            f"so it trains slower than with trainer.devices: {cores} or fewer.",
            file=sys.stderr,
        )


def check_section(
    section: str, options: dict[str, Any], where: str | None = None, values: bool = True
) -> None:
    """The keys of ``rl.<section>``: none the run links in, none its constructor does not take
    (with a "did you mean"); with ``values``, each value of the type its constructor hints, and
    the component's own ``check_settings`` (a static method, for a class whose constructor needs
    the run's live objects: ``StreamRLModule``, ``RolloutStream``) given the section's values
    and its defaults; ``ConfigError``. A constructible section's values are checked by building
    it (``check_micro_batches``; the service in ``check_parts``)."""
    where = where or f"rl.{section}"
    class_path, linked = CONSTRUCTOR_SECTIONS[section]
    for key in options:
        if key in linked:
            raise ConfigError(
                f"{where}: {key} is linked in by the run, not set here: {linked[key]}."
            )
    owner = resolve(class_path, kind="class", builtins={}, where=where)
    check_options(owner, options, where=where)
    if not values:
        return
    check_option_types(owner, options, where=where)
    check_settings = getattr(owner, "check_settings", None)
    if check_settings is not None:
        names = inspect.signature(check_settings).parameters
        try:
            check_settings(**{n: options.get(n, default_of(owner, n)) for n in names})
        except ValueError as err:
            raise ConfigError(f"{where}: {err}") from None


def check_micro_batches(options: dict[str, Any]) -> None:
    """``rl.micro_batches``: ``DynamicBatchPipeline``'s arguments, but for the staleness bound,
    which the run links in from ``rl.module.mode``; raises ``ConfigError``."""
    check_section("micro_batches", options)
    try:
        DynamicBatchPipeline(**options)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"rl.micro_batches: {err}") from None


def check_rl(rl: RLConfig) -> None:
    """Check the RL section; raises ``ConfigError``."""
    check_section("module", rl.module)
    check_section("rollouts", rl.rollouts)
    if rl.prompts_per_iteration < 1:
        raise ConfigError(f"rl.prompts_per_iteration must be >= 1, got {rl.prompts_per_iteration}.")
    if rl.reward is not None:
        check_reward_packages(RewardSpec.from_config(rl.reward))
    check_section("generation", rl.generation)  # its values: the service's constructor
    check_micro_batches(rl.micro_batches)
    check_section("timeouts", rl.timeouts)
    try:  # a timeout <= 0 is its ConfigError
        Timeouts.for_model(0.0, rl.arg("rollouts", "max_tokens"), **rl.timeouts)
    except TypeError as err:  # one the run links in (model_bytes, max_tokens)
        message = f"rl.timeouts: {err}; give start_s, sample_s, heartbeat_s or weight_s."
        raise ConfigError(message) from None
    try:  # on this machine: NCCL needs CuPy and GPUs
        rl.weights.make_transport().check()
    except ConfigError as err:
        raise ConfigError(f"rl.weights.transport: {err}") from err
    if rl.iterations < 1:
        raise ConfigError(
            f"rl.iterations must be >= 1 (one optimizer step each), got {rl.iterations}; set "
            "rl.iterations: 1 or more (the summary's heldout_*_before is the starting policy's "
            "evaluation; to only warm-start and evaluate, call streamrl.run.prepare.ensure_policy "
            "and streamrl.run.prompt_job.heldout_evaluator)."
        )
    if rl.group_size < 1:
        raise ConfigError(f"rl.group_size must be >= 1, got {rl.group_size}.")
    check_asynchrony(rl)


def run_correction(rl: RLConfig) -> OffPolicyCorrection:
    """``rl.correction`` with its method linked in when unset: ``seq_mask`` when the
    generators quantize to FP8 (``rl.engine: {class_path: vllm, init_args: {quantization:
    fp8}}``: their log-probs are further from the trainer's), ``decoupled`` otherwise."""
    if rl.correction.method is not None:
        return rl.correction
    engine = rl.engine["init_args"]
    options = engine.get("options") or {}
    fp8 = "fp8" in (engine.get("quantization"), options.get("quantization"))
    return dataclasses.replace(rl.correction, method="seq_mask" if fp8 else "decoupled")


def run_routing_replay(rl: RLConfig) -> bool | None:
    """``rl.module.routing_replay``, or when it is unset: ``None`` (on for a mixture of experts),
    except ``False`` for vLLM generators without GPUs, whose CPU build returns no routed
    experts: its samples carry none, so the trainer's routers choose (no mismatch to measure;
    the log-prob gap is still logged).

    Raises:
        ConfigError: replay asked of vLLM generators without GPUs.
    """
    engine, _ = factory_and_args("engine", rl.engine)
    on_cpu = rl.arg("generation", "gpus_per_instance") == 0
    on_vllm_cpu = isinstance(engine, type) and issubclass(engine, VLLMEngine) and on_cpu
    replay = rl.arg("module", "routing_replay")
    if replay and on_vllm_cpu:
        raise ConfigError(
            "rl.module.routing_replay: true, but vLLM's CPU build returns no routed experts (Model "
            "Runner V2 needs a GPU): give the generators GPUs (rl.generation: "
            "{gpus_per_instance: 1}), generate with "
            "rl.engine: hf, or set rl.module.routing_replay: false."
        )
    return False if on_vllm_cpu and replay is None else replay


def check_asynchrony(rl: RLConfig) -> None:
    """``rl.generation``'s ``partial_rollout``: a known value that the mode can keep
    (``rl.module``'s check the staleness bound, ``OffPolicyCorrection`` its own)."""
    from streamrl.components.generation.partial import check_partial_rollout

    partial, mode = rl.arg("generation", "partial_rollout"), rl.arg("module", "mode")
    try:
        check_partial_rollout(partial)
    except (ValueError, ConfigError) as err:
        raise ConfigError(f"rl.generation.{err}") from err
    run_routing_replay(rl)
    if partial != "finish" and mode != "async":
        raise ConfigError(
            f"rl.generation.partial_rollout: {partial} needs rl.module.mode: async (in {mode} "
            "mode no sequence is running when new weights arrive); set rl.module: {mode: async} "
            "or partial_rollout: finish."
        )
