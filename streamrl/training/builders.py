"""The public way to put a run together from component objects.

``streamrl fit``, the notebooks, the examples and every FSDP trainer rank assemble a run with
these same functions; nothing else in the library builds a module or a trainer. The generation
side needs no builder: ``StreamGenerationService`` and ``RolloutStream`` take their component
objects directly.

Examples:
    A run in a notebook (``streamrl.run.parts.RunParts`` builds the same objects from a config)::

        policy, tokenizer = load_policy(model_dir)
        algorithm = GRPO(group_size=4)
        dispatcher = SkewAwareDispatcher(measure_latency(policy, tokenizer), max_batch_size=32)
        with StreamGenerationService(model_dir, 2, dispatcher=dispatcher) as service:
            rollouts = RolloutStream(service, PromptSource(prompts, 16), tokenizer, algorithm,
                                     reward=partial_credit, max_tokens=64, context=128,
                                     ranker=LengthRanker())
            module = build_module(policy, rollouts=rollouts, iterations=30, mode="async")
            build_trainer(module).fit(module)
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import lightning as L
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.loggers import Logger, TensorBoardLogger, WandbLogger
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from streamrl.algorithms.base import Algorithm
from streamrl.components.skewness.latency import LatencyModel
from streamrl.components.skewness.profiler import Profiler
from streamrl.components.training.reference import reference_policy
from streamrl.components.training.sharding import Precision, enable_activation_checkpointing
from streamrl.runtime.progress import IterationBar
from streamrl.training.checkpointing import AtomicCheckpointIO, CheckpointSchedule
from streamrl.training.fsdp import ShardedStreamRLModule, fsdp_strategy, process_group_backend
from streamrl.training.module import StreamRLModule
from streamrl.training.rollout import RolloutStream
from streamrl.training.run_logger import RunCSVLogger

LoggerName = Literal["csv", "tensorboard", "wandb"]


def measure_latency(
    policy: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    max_batch_size: int = 64,
    *,
    prompt: str = "copy abcdefgh=",
    tokens: int = 16,
    contexts: Sequence[int] = (64, 160),
) -> LatencyModel:
    """The decode latency of batch size and context, measured on ``policy`` now (§5.1: never
    assumed; issue 47): each batch size at ``prompt``, and at prompts of ``contexts`` tokens
    where the model's context holds them, a step paying for its widest row as the HF engine
    does (``Profiler.fit_grid``). Algorithm 2 and the elastic controller plan with it."""
    sizes = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b <= max_batch_size]
    prompt_ids = tokenizer(prompt)["input_ids"]
    room = policy.config.max_position_embeddings - tokens - 1
    widths = sorted({len(prompt_ids), *(c for c in contexts if c <= room)})
    profiler = Profiler(policy.eval(), prompt_ids, tokens=tokens, repeats=1)
    return profiler.fit_grid(sizes, widths, "widest")[0]


def build_module(
    policy: PreTrainedModel,
    algorithm: Algorithm | None = None,
    rollouts: RolloutStream | None = None,
    *,
    iterations: int,
    temperature: float | None = None,
    sharded: bool = False,
    precision: Precision = "32-true",
    activation_checkpointing: bool = False,
    reference_offload: bool = False,
    share_timeout_s: float = 900.0,
    **module_args: Any,
) -> StreamRLModule:
    """The LightningModule of a run.

    What the algorithm declares is honoured here: a reference policy when
    ``algorithm.needs_reference`` (the policy with its adapters off under LoRA, else a frozen
    copy in the compute dtype, sharded with the policy).

    Args:
        policy: the causal LM to train (its float32 master weights).
        algorithm: scores samples and computes the loss: the rollout stream's, given once
            (``None``: ``rollouts.algorithm``; another object is refused). FSDP ranks > 0,
            without a stream, pass it.
        rollouts: the sample stream; ``None`` on FSDP ranks > 0, which receive their share
            from rank 0.
        iterations: optimizer steps (one per RL iteration).
        temperature: the generators' sampling temperature; by default the service's (given
            once); required without ``rollouts``.
        sharded: FSDP2 over the trainer ranks (``streamrl.training.fsdp``); rank 0 deals its stream
            to the ranks. ``precision="bf16-mixed"`` is always sharded (one rank is fine).
        precision: ``"bf16-mixed"`` (bfloat16 compute over float32 FSDP2 shards, float32
            gradient reduction) or ``"32-true"``.
        activation_checkpointing: recompute each decoder layer in the backward pass.
        reference_offload: keep a sharded reference's shards in host memory.
        share_timeout_s: sharded: how long a rank > 0 waits for its next share of samples.
        module_args: ``StreamRLModule``'s own keyword arguments, passed on as they are (its
            docstring describes each, and holds each default): ``mode`` (``"sync"``,
            ``"async"``: one-step asynchronous, §4.1; ``"colocated"``), ``lr``,
            ``max_grad_norm``, ``staleness_bound``, ``pipeline``, ``correction``,
            ``routing_replay``, ``elastic``, ``logprob_chunk_tokens``, ``trace``.

    A policy on the meta device (``streamrl.policy.model_dir.empty_model``) is read from its
    directory once placed (``StreamRLModule.configure_model``: each rank its own shards), and
    its reference is built the same way, never copied.
    """
    if algorithm is None:
        if rollouts is None:
            raise ValueError(
                "build_module: pass the rollout stream (its algorithm scores and trains) or, "
                "on a trainer rank without one, the algorithm."
            )
        algorithm = rollouts.algorithm
    if rollouts is not None:
        service_temperature = rollouts.service.temperature
        if temperature is not None and temperature != service_temperature:
            raise ValueError(
                f"temperature={temperature} but the generation service samples at "
                f"{service_temperature}: the trainer must score tokens under the distribution "
                "they were sampled from; leave temperature unset to use the service's."
            )
        temperature = service_temperature
    elif temperature is None:
        raise ValueError("build_module: without rollouts, pass the generators' temperature.")
    sharded = sharded or precision == "bf16-mixed"  # the mixed-precision policy is FSDP2's
    if sharded and not algorithm.shardable:
        raise ValueError(
            f"{type(algorithm).__name__} cannot train sharded yet (its own parameters are not "
            "sharded by FSDP), and bf16-mixed training is sharded: train it on one rank with "
            "precision '32-true'."
        )
    reference = reference_policy(policy, algorithm.needs_reference, precision)
    if activation_checkpointing:  # before fully_shard, as FSDP2 expects
        enable_activation_checkpointing(policy)
    options: dict[str, Any] = dict(reference=reference, temperature=temperature, **module_args)
    if sharded:
        return ShardedStreamRLModule(
            policy.train(),
            algorithm,
            rollouts,
            iterations,
            share_stream=True,
            precision=precision,
            reference_offload=reference_offload,
            share_timeout_s=share_timeout_s,
            **options,
        )
    if reference_offload:
        raise ValueError("reference_offload keeps FSDP2 shards in host memory: pass sharded=True.")
    return StreamRLModule(policy.train(), algorithm, rollouts, iterations, **options)


def build_trainer(
    module: StreamRLModule,
    *,
    accelerator: Literal["cpu", "cuda"] = "cpu",
    devices: int | list[int] = 1,
    num_nodes: int = 1,
    output_dir: str | Path | None = None,
    logger: Logger | None = None,
    checkpoints: CheckpointSchedule | None = None,
    show_progress: bool = True,
    sharded_checkpoints: bool = False,
    collective_timeout_s: float = 300.0,
    **trainer_options: Any,
) -> L.Trainer:
    """The Lightning ``Trainer`` that runs ``module``'s iterations (one step each).

    A sharded module (``build_module(..., sharded=True)`` or ``precision="bf16-mixed"``) runs
    under Lightning's ``ModelParallelStrategy``: FSDP2 over gloo on the CPU, NCCL on CUDA.

    Args:
        module: from ``build_module``; its ``iterations`` are the trainer's steps.
        accelerator: ``"cpu"`` or ``"cuda"`` (``streamrl.runtime.devices.resolve_placement``
            resolves ``"auto"`` and checks the GPUs).
        devices: trainer processes of this node on the CPU; on CUDA their number or the GPU
            indices (``[0, 1, 2, 3]``), one rank per GPU. Every rank builds the same trainer.
        num_nodes: machines the ranks run on (under an external launcher: ``torchrun``, SLURM).
        output_dir: where checkpoints go (``<output_dir>/checkpoints``); ``None`` saves none.
        logger: a Lightning logger (``make_logger``); ``None`` logs nothing.
        checkpoints: when checkpoints are written under ``output_dir``
            (``CheckpointSchedule``: every N iterations, at the end, and within a deadline when
            the run is stopped by SIGTERM or Ctrl-C under ``streamrl.runtime.stopping.
            stop_on_signals``); ``None``: its defaults.
        show_progress: draw a progress bar of the iterations on stderr (``IterationBar``,
            unless ``callbacks`` bring a ``ProgressBar`` of their own).
        sharded_checkpoints: a sharded module's checkpoints are folders of each rank's shards
            (no full copy on rank 0); ``False``: one file with the gathered state.
        collective_timeout_s: how long a collective of the ranks waits for the others
            (``streamrl.training.rank_timeouts``).
        trainer_options: any other ``lightning.Trainer`` argument (``callbacks=[...]``, added
            to the checkpoint callback...); it wins over the settings above.
    """
    settings: dict[str, Any] = dict(
        max_steps=module.iterations,
        max_epochs=-1,
        accelerator="gpu" if accelerator == "cuda" else accelerator,
        devices=devices,
        num_nodes=num_nodes,
        logger=logger if logger is not None else False,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=show_progress,
        enable_model_summary=False,
    )
    if output_dir is not None:
        settings.update(
            default_root_dir=str(output_dir),
            enable_checkpointing=True,
            callbacks=[(checkpoints or CheckpointSchedule()).callback(output_dir)],
            plugins=[AtomicCheckpointIO()],  # a save killed midway leaves the last one whole
        )
    if isinstance(module, ShardedStreamRLModule):
        ranks = (len(devices) if isinstance(devices, list) else devices) * num_nodes
        strategy = fsdp_strategy(
            ranks,
            backend=process_group_backend(accelerator),
            timeout_s=collective_timeout_s,
            full_checkpoints=not sharded_checkpoints,
        )
        settings.update(strategy=strategy)
    # Your callbacks join the checkpoint callback rather than replace it.
    callbacks = [*settings.pop("callbacks", []), *trainer_options.pop("callbacks", [])]
    if show_progress and not any(isinstance(c, ProgressBar) for c in callbacks):
        callbacks.append(IterationBar())  # on stderr, counting iterations; yours wins
    return L.Trainer(**{**settings, **trainer_options}, callbacks=callbacks)


def make_logger(kind: LoggerName, output_dir: str | Path) -> Logger:
    """A Lightning logger writing under ``output_dir``; metrics are named ``stage/metric``."""
    if kind == "tensorboard":
        return TensorBoardLogger(str(output_dir), name="logs")
    if kind == "wandb":
        return WandbLogger(project="streamrl", save_dir=str(output_dir), offline=True)
    return RunCSVLogger(output_dir)  # one metrics.csv across a resumed run's starts
