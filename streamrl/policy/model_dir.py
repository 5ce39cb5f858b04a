"""A model directory read shard by shard: no process ever holds the whole model.

Every trainer rank builds the directory's architecture on the meta device (``empty_model``: no
memory, no weights read), shards it with FSDP2, then ``materialize`` allocates only its own
shards on its device and fills them from the directory's safetensors files, each rank reading
only its rows of each tensor. The reading is PyTorch's: ``torch.distributed.checkpoint.load``
with its ``HuggingFaceStorageReader``, the path torchtitan and PyTorch's own tests load Hugging
Face checkpoints into DTensors with; ``RowReader`` reads each rank's rows with plain file reads
instead of mapping the files (mapped pages count in the process's memory). An unsharded model (one
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
import math
import os
import struct
from pathlib import Path
from typing import BinaryIO

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.tensor import DTensor
from torch.futures import Future
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedModel

from streamrl.errors import ConfigError
from streamrl.policy.expert_weights import expert_views
from streamrl.policy.logprobs import causal_lm
from streamrl.policy.lora import init_adapters, is_adapter

__all__ = [
    "RowReader",
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


def empty_model(
    path: str | Path, dtype: torch.dtype, attention: str | None = None
) -> PreTrainedModel:
    """The causal LM of the directory ``path`` on the meta device: its architecture and config,
    parameters of the right shapes in ``dtype``, no memory and nothing read from its weights.

    Shard it (``streamrl.components.training.sharding.shard_model``), wrap it with LoRA
    adapters, enable activation checkpointing as for a loaded model; then ``materialize``.

    Args:
        path: a local Hugging Face model directory (``config.json`` and safetensors files).
        dtype: the dtype its parameters are built (and later read) in.
        attention: its attention implementation (``attn_implementation``: e.g.
            ``streamrl.policy.varlen_attention.NAME`` for a trainer's packed rows); ``None``:
            transformers' default.
    """
    _config_file(path)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention)
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

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ConfigError(
            f"{str(path)!r} has no .safetensors file; streamrl reads weights shard by shard from "
            "safetensors only. Convert the directory once: AutoModelForCausalLM.from_pretrained"
            "(dir).save_pretrained(dir) writes them."
        )
    saved = _saved_names(files)
    # Fused experts (transformers 5) read from a checkpoint's per-expert tensors, rows in place.
    wanted = expert_views(base_weights(model), saved)
    missing = sorted(set(wanted) - saved)
    if missing:
        raise ConfigError(
            f"{str(path)!r} lacks {len(missing)} of the model's tensors (first: {missing[:3]}); "
            f"it holds {len(saved)} others. Is it a checkpoint of this architecture "
            f"({type(causal_lm(model)).__name__}), with untied embeddings saved as such?"
        )
    sharded = any(isinstance(p, DTensor) for p in base_weights(model).values())
    dcp.load(
        wanted,
        storage_reader=RowReader(str(path)),
        no_dist=not (sharded and dist.is_initialized()),
    )


class RowReader(HuggingFaceStorageReader):
    """PyTorch's ``HuggingFaceStorageReader`` reading each request's rows with plain file reads.

    The planning (which rank reads which rows of which tensor) is PyTorch's; only the bytes'
    source differs. Its reader maps each safetensors file into the process (safetensors' lazy
    slices), and every page it touches then counts in the process's resident memory until the
    file is closed: a rank reading half of a 3 GB file held 1.5 GB of mapped pages beside the
    1.5 GB it copied out. Rows of a tensor are contiguous in the file, so a rank's rows are one
    ``readinto`` straight into its shard (cast after, when the file's dtype is not the
    parameter's); any other slice goes through safetensors.
    """

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(
                item
            )
        for file_name, items in per_file.items():
            with open(file_name, "rb", buffering=0) as f:
                header, data_start = _safetensors_header(f)
                for item in items:
                    entry = header[item.storage_index.fqn]
                    target = planner.resolve_tensor(item).detach()
                    if not _read_rows(f, data_start, entry, item, target):
                        self._read_slice(file_name, item, target)
                    planner.commit_tensor(item, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    @staticmethod
    def _read_slice(file_name: str, item: ReadItem, target: torch.Tensor) -> None:
        from safetensors import safe_open

        slices = tuple(slice(o, o + n) for o, n in zip(item.storage_offsets, item.lengths))
        with safe_open(file_name, framework="pt") as f:
            target.copy_(f.get_slice(item.storage_index.fqn)[slices])


def _safetensors_header(f: BinaryIO) -> tuple[dict, int]:
    """A safetensors file's header (name -> dtype, shape, byte offsets) and where data starts."""
    (length,) = struct.unpack("<Q", f.read(8))
    return json.loads(f.read(length)), 8 + length


def _read_rows(
    f: BinaryIO, data_start: int, entry: dict, item: ReadItem, target: torch.Tensor
) -> bool:
    """Read ``item``'s rows of a tensor into ``target`` when they are whole rows (contiguous
    bytes in the file); ``False`` for another slice."""
    shape, offsets, lengths = entry["shape"], item.storage_offsets, item.lengths
    if any(o != 0 or n != size for o, n, size in zip(offsets[1:], lengths[1:], shape[1:])):
        return False
    dtype = _FILE_DTYPES[entry["dtype"]]
    row = math.prod(shape[1:]) * torch.empty((), dtype=dtype).element_size()
    f.seek(data_start + entry["data_offsets"][0] + (offsets[0] if shape else 0) * row)
    direct = target.dtype == dtype and target.is_contiguous() and target.device.type == "cpu"
    into = target if direct else torch.empty(tuple(lengths), dtype=dtype)
    view = into.view(torch.uint8).reshape(-1).numpy()
    if f.readinto(view) != view.nbytes:
        raise ConfigError(f"{f.name}: {item.storage_index.fqn} ends before its rows (truncated?).")
    if not direct:
        target.copy_(into)
    return True


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


_FILE_DTYPES = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


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


#: The weight files a Hugging Face model directory holds (one of them).
WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin", "model.safetensors.index.json")


def check_model_dir(path: str | Path) -> None:
    """``path`` is a model directory streamrl can load: its ``config.json`` and its weights.

    Raises:
        ConfigError: what is missing, and how to get a directory that has it.
    """
    where = Path(path)
    fix = (
        "Pass a directory written by save_pretrained (config.json, model.safetensors and the "
        "tokenizer files), or model: tiny to build one."
    )
    if not where.is_dir():
        raise ConfigError(f"model: {str(path)!r} is not a directory. {fix}")
    if not (where / "config.json").is_file():
        raise ConfigError(f"model: {str(path)!r} has no config.json. {fix}")
    try:
        AutoConfig.from_pretrained(where, local_files_only=True)
    except (ValueError, OSError) as err:
        reason = str(err).strip().splitlines()[0][:200]
        raise ConfigError(
            f"model: {str(path)!r}: transformers cannot read its config.json ({reason}). {fix}"
        ) from None
    if not any(next(where.glob(pattern), None) for pattern in WEIGHT_FILES):
        raise ConfigError(
            f"model: {str(path)!r} has a config.json but no weights (no *.safetensors or "
            f"pytorch_model*.bin). {fix}"
        )


def _config_file(path: str | Path) -> Path:
    config = Path(path) / "config.json"
    if not config.is_file():
        raise FileNotFoundError(
            f"No model directory at {str(path)!r} (no config.json there). Pass a directory "
            "written by save_pretrained, or use model: tiny to build one."
        )
    return config
