"""A run's memory, checked before any work: ``streamrl plan memory`` and ``fit``'s refusals.

``streamrl plan memory`` prints the estimate of ``streamrl.components.capacity.memory`` for a
model (a directory, or a built-in shape such as ``7b``) term by term: per trainer GPU and per
generator GPU, with the KV cache's capacity in sequences. ``streamrl fit`` checks the same
estimate against its devices (``check_memory``) and refuses, in one line naming the knob to
change, a config that cannot fit: a trainer GPU, a generator GPU, or rank 0's host memory for a
one-file checkpoint of a sharded trainer (which gathers the whole model and its AdamW state
there).

Examples:
    >>> result = run_memory_plan(MemoryPlanOptions(model="7b", trainer_gpus=4, max_tokens=8192))
    >>> result["trainer_gpu"]["total"] > 0 and result["generator_gpu"]["sequences"] > 0
    True
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from transformers import AutoConfig, PretrainedConfig

from streamrl.components.capacity.memory import (
    GIB,
    ModelShape,
    TrainerMemory,
    generator_memory,
    lora_params,
    trainer_knob,
    trainer_memory,
)
from streamrl.components.training.pipeline import DynamicBatchPipeline
from streamrl.errors import ConfigError
from streamrl.policy.models import SHAPES, model_config
from streamrl.run.config import RunConfig
from streamrl.run.swappable import default_of, init_arg
from streamrl.runtime import devices
from streamrl.runtime.devices import Placement

#: The GPU an estimate is printed for when this machine has none (an 80 GB H100/H800).
DEFAULT_GPU_GIB = 80.0
#: Prompt tokens a sequence is assumed to hold besides its response, when not given.
DEFAULT_PROMPT_TOKENS = 512


@dataclass
class MemoryPlanOptions:
    """Estimate each GPU's memory for a run: per trainer GPU (weights, gradients, AdamW state,
    reference, gathered layers, activations, log-prob chunks) and per generator GPU (weights, and
    the KV cache's capacity in sequences of prompt plus max_tokens).

    Attributes:
        model: a local model directory (its config.json is read), or a built-in shape: 0.5b,
            1.5b or 7b (Qwen2.5's).
        trainer_gpus: trainer ranks sharding the policy (FSDP2).
        max_tokens: a response's budget (rl.rollouts.max_tokens).
        prompt_tokens: a prompt's tokens.
        micro_batch_tokens: tokens of one forward/backward pass
            (rl.micro_batches' max_tokens); null: one whole sample.
        lora_r: LoRA rank (rl.lora.r); 0: full fine-tuning.
        kl: a KL reference (the algorithm's kl_coef > 0).
        activation_checkpointing: each decoder layer recomputed in the backward pass.
        gpu_memory_gib: the GPUs' memory; null: this machine's first GPU, or 80.
        generator_tp: GPUs per generator instance (``rl.generation``'s ``gpus_per_instance``).
    """

    model: str = "7b"
    trainer_gpus: int = 1
    max_tokens: int = 8192
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS
    micro_batch_tokens: int | None = None
    lora_r: int = 0
    kl: bool = False
    activation_checkpointing: bool = True
    gpu_memory_gib: float | None = None
    generator_tp: int = 1


def run_memory_plan(options: MemoryPlanOptions) -> dict:
    """Print the estimate per trainer GPU and per generator GPU; return it (bytes)."""
    if options.trainer_gpus < 1 or options.generator_tp < 1 or options.max_tokens < 1:
        raise ConfigError("plan memory: trainer_gpus, generator_tp and max_tokens must be >= 1.")
    shape = ModelShape.from_config(_model_config(options.model))
    sequence = options.prompt_tokens + options.max_tokens
    micro = max(options.micro_batch_tokens or sequence, sequence)
    trainer = trainer_memory(
        shape,
        options.trainer_gpus,
        micro,
        lora_params=lora_params(shape, options.lora_r),
        reference=options.kl,
        activation_checkpointing=options.activation_checkpointing,
    )
    gpu_bytes = int((options.gpu_memory_gib or _this_gpu_gib()) * GIB)
    generator = generator_memory(shape, gpu_bytes, sequence, options.generator_tp)
    _print_plan(options, shape, trainer, generator, gpu_bytes, micro)
    return {
        "model": options.model,
        "parameters": shape.params,
        "gpu_bytes": gpu_bytes,
        "micro_batch_tokens": micro,
        "trainer_gpu": trainer.rows(),
        "activation_bytes_per_token": trainer.activations // micro,
        "trainer_fits": trainer.total <= gpu_bytes,
        "generator_gpu": asdict(generator),
    }


def check_memory(config: RunConfig, placement: Placement) -> None:
    """Refuse, before any work, a run whose estimate exceeds a device: a trainer GPU, a
    generator GPU, or rank 0's host memory for a one-file checkpoint of a sharded trainer.

    Raises:
        ConfigError: one line: the estimate, the device, the knob to change.
    """
    model = _directory_config(config.model)
    if model is None:  # the built-in tiny policy: a few MB
        return
    shape, rl, trainer = ModelShape.from_config(model), config.rl, config.trainer
    adapters = lora_params(shape, rl.lora.r if rl.lora else 0)
    sharded_checkpoints = trainer.sharded_checkpoints
    if sharded_checkpoints is None:
        sharded_checkpoints = placement.ranks > 1
    if placement.sharded and not sharded_checkpoints:
        gathered = 12 * (adapters or shape.params) + (2 * shape.params if adapters else 0)
        host = devices.host_memory_bytes()
        if gathered > host:
            raise ConfigError(
                f"trainer.sharded_checkpoints: false gathers the whole model and its AdamW state "
                f"on rank 0's host for each checkpoint, about {gathered / GIB:.1f} GiB, but this "
                f"machine has {host / GIB:.1f} GiB available; set trainer.sharded_checkpoints: "
                "true (each rank writes its own shards)."
            )
    if placement.accelerator != "cuda":
        return
    sequence = _sequence_tokens(config, model)
    ceiling = rl.micro_batches.get("max_tokens", default_of(DynamicBatchPipeline, "max_tokens"))
    activation_checkpointing = trainer.activation_checkpointing is not False
    estimate = trainer_memory(
        shape,
        placement.ranks,
        max(ceiling, sequence),
        lora_params=adapters,
        reference=(init_arg("algorithm", rl.algorithm, "kl_coef") or 0) > 0,
        activation_checkpointing=activation_checkpointing,
    )
    smallest = min(placement.trainer_gpus, key=devices.gpu_memory_bytes)
    device = devices.gpu_memory_bytes(smallest)
    if estimate.total > device:
        knob = trainer_knob(estimate, placement.ranks, activation_checkpointing)
        raise ConfigError(
            f"trainer: about {estimate.total / GIB:.1f} GiB per GPU ({_terms(estimate)}) but "
            f"cuda:{smallest} has {device / GIB:.1f} GiB; {knob} "
            f"(streamrl plan memory --model {config.model} shows each term)."
        )
    tensor_parallel = rl.arg("generation", "gpus_per_instance")
    if tensor_parallel > 0 and placement.generator_gpus:
        gpu = min(placement.generator_gpus, key=devices.gpu_memory_bytes)
        gpu_bytes = devices.gpu_memory_bytes(gpu)
        generator = generator_memory(shape, gpu_bytes, sequence, tensor_parallel)
        if generator.sequences < 1:
            raise ConfigError(
                f"generators: cuda:{gpu} ({gpu_bytes / GIB:.1f} GiB) holds "
                f"{generator.weights / GIB:.1f} GiB of weights and no sequence of {sequence} "
                "tokens besides; give each instance more GPUs (rl.generation: {gpus_per_instance: "
                "N}) or lower rl.rollouts.max_tokens."
            )


def _terms(estimate: TrainerMemory) -> str:
    rows = {k: v for k, v in estimate.rows().items() if k != "total" and v}
    return ", ".join(f"{k} {v / GIB:.1f}" for k, v in rows.items())


def _model_config(model: str) -> PretrainedConfig:
    if model in SHAPES:
        return model_config(model)
    found = _directory_config(model)
    if found is None:
        raise ConfigError(
            f"plan memory: {model!r} is neither a model directory (with a config.json) nor a "
            f"built-in shape ({', '.join(sorted(SHAPES))})."
        )
    return found


def _directory_config(model: str) -> PretrainedConfig | None:
    if model == "tiny" or not (Path(model) / "config.json").is_file():
        return None
    return AutoConfig.from_pretrained(model, local_files_only=True)


def _sequence_tokens(config: RunConfig, model: PretrainedConfig) -> int:
    """Tokens of the longest sample: a prompt and ``rl.rollouts.max_tokens``, within the
    context."""
    longest = DEFAULT_PROMPT_TOKENS + config.rl.arg("rollouts", "max_tokens")
    return min(longest, int(getattr(model, "max_position_embeddings", longest)))


def _this_gpu_gib() -> float:
    return devices.gpu_memory_bytes(0) / GIB if devices.cuda_device_count() else DEFAULT_GPU_GIB


def _print_plan(
    options: MemoryPlanOptions,
    shape: ModelShape,
    trainer: TrainerMemory,
    generator,
    gpu_bytes: int,
    micro: int,
) -> None:
    out = sys.stderr
    print(
        f"{options.model}: {shape.params / 1e9:.2f}B parameters, {options.trainer_gpus} trainer "
        f"GPU(s), micro-batches of {micro} tokens, GPUs of {gpu_bytes / GIB:.0f} GiB",
        file=out,
    )
    print(f"{'per trainer GPU':<28}{'GiB':>8}", file=out)
    for name, value in trainer.rows().items():
        print(f"  {name:<26}{value / GIB:>8.2f}", file=out)
    verdict = "fits" if trainer.total <= gpu_bytes else "does NOT fit"
    print(f"  {'(' + verdict + ')':<26}", file=out)
    print(f"  activations per token: {trainer.activations / micro / 1024:.0f} KiB", file=out)
    print(f"{'per generator GPU':<28}{'GiB':>8}", file=out)
    print(f"  {'weights':<26}{generator.weights / GIB:>8.2f}", file=out)
    print(f"  {'KV cache free':<26}{generator.free_for_kv / GIB:>8.2f}", file=out)
    print(
        f"  KV per token {generator.kv_per_token / 1024:.0f} KiB: {generator.sequences} sequences "
        f"of {options.prompt_tokens + options.max_tokens} tokens at once",
        file=out,
    )
