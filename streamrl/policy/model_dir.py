"""A model directory read shard by shard: no process ever holds the whole model.

Every trainer rank builds the directory's architecture on the meta device (``empty_model``: no
memory, no weights read), shards it with FSDP2, then ``materialize`` allocates only its own
shards on its device and fills them from the directory's safetensors files, each rank reading
only its rows of each tensor. The reading is PyTorch's: ``torch.distributed.checkpoint.load``
with its ``HuggingFaceStorageReader`` (lazy safetensors slices), the path torchtitan and
PyTorch's own tests load Hugging Face checkpoints into DTensors with. An unsharded model (one
rank) goes through the same call and reads every row.

Tensors take the dtype their parameter was built in, whatever the file's: a trainable policy is
built in float32 (its master weights), frozen weights (a KL reference, a LoRA policy's base) in
the compute dtype (``streamrl.components.training.reference``). Tied embeddings are read once;
a ``peft`` model reads its base weights under their plain names and starts its adapters from
``init_adapters``.

Examples:
    >>> import tempfile
    >>> from streamrl.policy.models import build_tiny_model, build_tokenizer, save_policy
    >>> tok = build_tokenizer()
    >>> path = save_policy(build_tiny_model(tok), tok, tempfile.mkdtemp())
    >>> model = empty_model(path, torch.float32)
    >>> next(model.parameters()).device.type
    'meta'
    >>> materialize(model, path, "cpu")
    >>> next(model.parameters()).device.type
    'cpu'
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedModel

from streamrl.errors import ConfigError
from streamrl.policy.logprobs import causal_lm
from streamrl.policy.lora import init_adapters, is_adapter

__all__ = [
    "directory_bytes",
    "directory_dtype",
    "empty_model",
    "is_empty",
    "materialize",
    "read_weights",
    "source_dir",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def directory_dtype(path: str | Path) -> torch.dtype:
    """The dtype a model directory's weights are saved in (``config.json``'s ``dtype``, or
    ``torch_dtype`` in older files); float32 when it says none.

    Raises:
        FileNotFoundError: no ``config.json`` in ``path``.
    """
    config = json.loads(_config_file(path).read_text())
    declared = config.get("dtype") or config.get("torch_dtype")
    return _DTYPES.get(str(declared).removeprefix("torch."), torch.float32)


def directory_bytes(path: str | Path) -> int:
    """Bytes of a model directory's safetensors files (0 when it has none yet): the size its
    timeouts and memory estimates scale with."""
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


def empty_model(path: str | Path, dtype: torch.dtype) -> PreTrainedModel:
    """The causal LM of the directory ``path`` on the meta device: its architecture and config,
    parameters of the right shapes in ``dtype``, no memory and nothing read from its weights.

    Shard it (``streamrl.components.training.sharding.shard_model``), wrap it with LoRA
    adapters, enable activation checkpointing as for a loaded model; then ``materialize``.

    Args:
        path: a local Hugging Face model directory (``config.json`` and safetensors files).
        dtype: the dtype its parameters are built (and later read) in.
    """
    _config_file(path)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if Path(path, "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path, local_files_only=True)
    return model.eval()


def source_dir(model: torch.nn.Module) -> Path:
    """The directory ``model`` was built from (``empty_model`` or ``from_pretrained``: Hugging
    Face's ``name_or_path``), which ``materialize`` reads.

    Raises:
        ConfigError: ``model`` names no local model directory (it was built from a config).
    """
    path = Path(str(getattr(causal_lm(model).config, "_name_or_path", "") or "."))
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"{type(causal_lm(model)).__name__} names no model directory to read its weights "
            f"from (name_or_path {str(path)!r}); build it with streamrl.policy.model_dir."
            "empty_model(dir, dtype)."
        )
    return path


def is_empty(model: torch.nn.Module) -> bool:
    """Whether ``model``'s parameters are still on the meta device (built by ``empty_model``,
    not yet ``materialize`` d)."""
    return any(p.is_meta for p in model.parameters())


def materialize(
    model: torch.nn.Module, path: str | Path, device: str | torch.device, *, seed: int = 0
) -> None:
    """Allocate ``model``'s parameters on ``device`` (only this rank's shards when it is sharded)
    and fill them: its weights from the directory ``path`` (``read_weights``), its
    non-persistent buffers (rotary frequencies) computed again, its LoRA adapters, if any, from
    ``seed`` (``init_adapters``).

    A collective when ``model`` is sharded: every rank calls it.
    """
    tied = _shared_parameters(model)
    model.to_empty(device=device)
    for owners in tied:  # to_empty gives each owner a tensor of its own: tie them again
        module, name = owners[0]
        for other, other_name in owners[1:]:
            other._parameters[other_name] = module._parameters[name]
    _compute_buffers(causal_lm(model))
    init_adapters(model, seed)
    read_weights(model, path)


def read_weights(model: torch.nn.Module, path: str | Path) -> None:
    """Copy the directory's weights into ``model``'s parameters in place, in their dtype; each
    rank reads only the rows of its shards (``torch.distributed.checkpoint.load`` with
    ``HuggingFaceStorageReader``). LoRA adapters are left as they are.

    Raises:
        ConfigError: the directory has no safetensors file, or lacks a tensor the model has.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ConfigError(
            f"{str(path)!r} has no .safetensors file; streamrl reads weights shard by shard from "
            "safetensors only. Convert the directory once: AutoModelForCausalLM.from_pretrained"
            "(dir).save_pretrained(dir) writes them."
        )
    wanted = base_weights(model)
    saved = _saved_names(files)
    missing = sorted(set(wanted) - saved)
    if missing:
        raise ConfigError(
            f"{str(path)!r} lacks {len(missing)} of the model's tensors (first: {missing[:3]}); "
            f"it holds {len(saved)} others. Is it a checkpoint of this architecture "
            f"({type(causal_lm(model)).__name__}), with untied embeddings saved as such?"
        )
    sharded = any(isinstance(p, DTensor) for p in wanted.values())
    dcp.load(
        wanted,
        storage_reader=HuggingFaceStorageReader(str(path)),
        no_dist=not (sharded and dist.is_initialized()),
    )


def base_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s parameters under the names its Hugging Face checkpoint gives them: a
    ``peft`` model's base weights without the wrapper's ``base_layer``, no adapter, a tied
    LM head once (under the embedding's name)."""
    return {
        name.replace(".base_layer.", "."): param
        for name, param in causal_lm(model).named_parameters()
        if not is_adapter(name)
    }


def _shared_parameters(model: torch.nn.Module) -> list[list[tuple[torch.nn.Module, str]]]:
    """The parameters more than one module holds (tied embeddings), each as its owners."""
    owners: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                owners.setdefault(id(param), []).append((module, name))
    return [found for found in owners.values() if len(found) > 1]


def _compute_buffers(lm: torch.nn.Module) -> None:
    """Compute the non-persistent buffers (rotary frequencies) that ``to_empty`` left
    uninitialised, as ``from_pretrained`` does after its own meta-device build: by the model's
    ``_init_weights`` for each module that owns one."""
    init = getattr(lm, "_init_weights", None)
    with torch.no_grad():
        for module in lm.modules():
            if module._non_persistent_buffers_set and callable(init):
                init(module)


def _saved_names(files: list[Path]) -> set[str]:
    from safetensors import safe_open

    names: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            names.update(f.keys())
    return names


def _config_file(path: str | Path) -> Path:
    config = Path(path) / "config.json"
    if not config.is_file():
        raise FileNotFoundError(
            f"No model directory at {str(path)!r} (no config.json there). Pass a directory "
            "written by save_pretrained, or use model: tiny to build one."
        )
    return config
