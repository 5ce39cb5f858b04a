"""LoRA policies: the trainer trains low-rank adapters only, and only they travel to the generators.

Why adapter-only sync matters in a disaggregated design: generation and training run on separate
resources, so every new weight version crosses the network between them (StreamRL §6, weight
transfer; in the paper's cross-datacenter setting the link is the scarce resource). With LoRA the
base weights never change: each generator loads them once from the model directory, and an update
is the adapter tensors alone, a few percent of the model's bytes (``python -m streamrl.bench.lora``
prints the sizes; docs/lora.md has the numbers). The transfer shrinks by the same factor, on the
wire and in the pause between two decode steps where an instance copies the new version in.

Trainer and generator wrap the same base model with the same ``LoRASpec``, so their adapter
parameters have identical names, shapes and order: ``adapter_weights`` of the trainer's policy is
exactly what the generator's receiver expects.

Examples:
    >>> from streamrl.policy.models import build_tokenizer, build_tiny_model
    >>> policy = apply_lora(build_tiny_model(build_tokenizer(), "test"), LoRASpec(r=4))
    >>> weights = adapter_weights(policy)
    >>> sorted({name.rsplit(".", 3)[-3] for name in weights})
    ['lora_A', 'lora_B']
    >>> sync_bytes(weights) < sync_bytes(policy) // 10
    True
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from streamrl.errors import ConfigError, unknown_name

#: The attention projections of Qwen2/Llama-style models.
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass(frozen=True)
class LoRASpec:
    """How the policy's adapters are shaped; the trainer and every generator use the same one.

    Attributes:
        r: rank of each adapter (``A``: ``[r, in]``, ``B``: ``[out, r]``).
        alpha: scaling numerator; the adapter's output is scaled by ``alpha / r``.
        dropout: dropout on the adapter's input while training (generators run in eval mode).
        target_modules: module-name suffixes that get an adapter.
    """

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ATTENTION_PROJECTIONS

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_modules", tuple(self.target_modules))
        if self.r < 1 or self.alpha <= 0 or not 0 <= self.dropout < 1 or not self.target_modules:
            raise ConfigError(
                f"LoRASpec: need r >= 1, alpha > 0, 0 <= dropout < 1 and at least one target "
                f"module; got {self}."
            )

    def to_dict(self) -> dict[str, Any]:
        """Plain values only (picklable, YAML-friendly): what a generator process receives."""
        return {**dataclasses.asdict(self), "target_modules": list(self.target_modules)}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> LoRASpec:
        """The inverse of ``to_dict``; an unknown key is a ``ConfigError``."""
        names = [f.name for f in dataclasses.fields(cls)]
        for key in values:
            if key not in names:
                raise ConfigError(f"LoRASpec: {unknown_name('field', str(key), names)}")
        return cls(**values)


def apply_lora(model: torch.nn.Module, spec: LoRASpec, seed: int = 0) -> torch.nn.Module:
    """Wrap ``model`` with LoRA adapters; afterwards only the adapter parameters require grad.

    The adapters are injected into ``model`` in place (its ``q_proj`` etc. become LoRA layers),
    and the returned ``PeftModel`` wraps it. ``B`` starts at zero, so outputs are unchanged
    until training moves it; ``A`` is drawn from ``seed`` and its name (``init_adapters``; the
    CPU RNG is left as it was), so every process that wraps the same model gets the same
    adapters, whatever device or sharding it holds them on. A model on the meta device
    (``streamrl.policy.model_dir.empty_model``) gets meta adapters, started by
    ``streamrl.policy.model_dir.materialize``.

    Args:
        model: a causal LM, e.g. from ``load_policy`` or ``build_tiny_model``.
        spec: the adapters' shape.
        seed: initialisation seed of ``A``.

    Returns:
        The ``peft.PeftModel``; call it, train it and push ``adapter_weights`` of it.

    Raises:
        ConfigError: peft is not installed, or no module matches ``spec.target_modules``.
    """
    peft = _require_peft()
    linear = sorted(
        {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    )
    missing = [t for t in spec.target_modules if t not in linear]
    if missing:
        raise ConfigError(
            f"apply_lora: no linear module named {missing} in {type(model).__name__}; "
            f"its linear modules are {linear}."
        )
    config = peft.LoraConfig(
        r=spec.r,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=list(spec.target_modules),
        bias="none",
    )
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        torch.manual_seed(seed)
        # peft asks transformers 5 a deprecated question; the warning is not ours to fix.
        warnings.filterwarnings(
            "ignore", message=".*is_gradient_checkpointing", category=FutureWarning
        )
        wrapped = peft.get_peft_model(model, config)
    if not any(p.is_meta for p in wrapped.parameters()):
        init_adapters(wrapped, seed)
    return wrapped


def init_adapters(model: torch.nn.Module, seed: int = 0) -> None:
    """Start ``model``'s LoRA adapters, if it has any: each ``A`` drawn from ``seed`` and its own
    name (Kaiming-uniform, as ``peft`` draws it), each ``B`` zero, so the adapters are the same on
    every process whatever device or sharding it built them on, and the policy starts as its
    base. A sharded adapter takes its rows of the same full tensor."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not is_adapter(name):
                continue
            full = torch.zeros(param.shape, dtype=param.dtype)
            if ".lora_A." in name:
                rng = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
                bound = 1.0 / math.sqrt(full.shape[1])  # kaiming_uniform_(a=sqrt(5)): 1/sqrt(in)
                full.uniform_(-bound, bound, generator=rng)
            _copy_full(param, full)


def _copy_full(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy ``full`` into ``param``: its rows of it when ``param`` is a shard (no
    communication: every rank holds ``full``)."""
    if isinstance(param, DTensor):
        mine = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(mine.to_local())
    else:
        param.copy_(full)


def adapter_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The LoRA tensors of ``model`` (live parameters, not copies), in registration order.

    Names are the wrapped model's parameter names, e.g.
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight``: identical on
    the trainer and on a generator that wrapped the same base model with the same ``LoRASpec``.

    Raises:
        ConfigError: ``model`` has no LoRA parameters (wrap it with ``apply_lora`` first).
    """
    weights = {name: p for name, p in model.named_parameters() if is_adapter(name)}
    if not weights:
        raise ConfigError(
            f"adapter_weights: {type(model).__name__} has no LoRA parameters; wrap the policy "
            "with streamrl.policy.lora.apply_lora first."
        )
    return weights


def adapter_names(model: torch.nn.Module) -> set[str]:
    """Names of ``model``'s LoRA parameters (empty when it has none)."""
    return {name for name, _ in model.named_parameters() if is_adapter(name)}


def synced_weights(policy: torch.nn.Module) -> torch.nn.Module | dict[str, torch.Tensor]:
    """What one weight update of ``policy`` carries, for ``StreamGenerationService.update`` /
    ``push_weights``: the adapters of a LoRA policy (its generators hold the base weights
    already), otherwise the whole policy."""
    if any(is_adapter(name) for name, _ in policy.named_parameters()):
        return adapter_weights(policy)
    return policy


def sync_bytes(weights: torch.nn.Module | Mapping[str, torch.Tensor]) -> int:
    """Bytes one weight update moves per generator instance (what ``AsyncWeightSync.push``
    broadcasts for the same argument: a module's ``named_parameters`` or a mapping)."""
    tensors = weights.parameters() if isinstance(weights, torch.nn.Module) else weights.values()
    return sum(t.numel() * t.element_size() for t in tensors)


class MergedLoRA:
    """Keeps the adapters folded into the base weights while a generator decodes.

    Merged, a LoRA layer is one matmul again instead of three (15-25% more tokens/s on
    the tiny demo model, docs/lora.md). ``unmerged()`` restores the base weights from a copy
    made here, bit for bit: merging and unmerging arithmetically would drift by rounding with
    every weight version. The copy costs the memory of the targeted base weights.

    Args:
        model: a model wrapped by ``apply_lora``; merged on construction.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        from peft.tuners.tuners_utils import BaseTunerLayer

        self.model = model
        layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
        self._base = [
            (m.get_base_layer().weight, m.get_base_layer().weight.detach().clone()) for m in layers
        ]
        self.model.merge_adapter()

    @contextlib.contextmanager
    def unmerged(self) -> Iterator[torch.nn.Module]:
        """Base weights and adapters apart inside the block (load new adapters, hash); merged
        again, with the adapters then current, on leaving it."""
        self.model.unmerge_adapter()  # peft's bookkeeping; the exact values come from the copy
        with torch.no_grad():
            for live, original in self._base:
                live.copy_(original)
        try:
            yield self.model
        finally:
            self.model.merge_adapter()


def is_adapter(name: str) -> bool:
    """Whether the parameter ``name`` belongs to a LoRA adapter (``lora_A``, ``lora_B``)."""
    return any(part.startswith("lora_") for part in name.split("."))


def _require_peft() -> Any:
    try:
        import peft
    except ImportError as err:
        raise ConfigError(
            "LoRA policies need peft, which is not installed. "
            "Install it with: pip install 'streamrl[peft]'"
        ) from err
    return peft
