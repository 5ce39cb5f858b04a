"""The trained policy written as a Hugging Face model directory straight from the trainer's shards.

At the end of a run every rank takes part, tensor by tensor: each tensor's shards are cast to the
saved dtype and sent to one rank (``root``), which writes it into its safetensors file and frees
it before the next one. No rank gathers the whole model, in any dtype; the most any host holds on
top of its shards is one tensor in the saved dtype (a LoRA layer's merged weight and its two
adapters). The files are Hugging Face's layout (``model.safetensors``, or
``model-0000k-of-0000n.safetensors`` with ``model.safetensors.index.json`` past
``max_file_bytes``), so ``AutoModelForCausalLM.from_pretrained`` loads the directory, as does a
next ``streamrl fit`` (``model: <dir>``) or vLLM. A LoRA policy is saved with its adapters merged
into the base weights (``W + (alpha / r) B A``), as ``peft``'s ``merge_and_unload`` gives it.

Examples:
    >>> import tempfile
    >>> from streamrl.policy.models import build_tiny_model, build_tokenizer
    >>> model = build_tiny_model(build_tokenizer())
    >>> out = save_policy_shards(model, tempfile.mkdtemp(), dtype=torch.bfloat16)
    >>> sorted(p.name for p in out.iterdir())
    ['config.json', 'generation_config.json', 'model.safetensors']
"""

from __future__ import annotations

import copy
import json
import shutil
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from streamrl.components.weights.staging import gather_rows, row_sharded
from streamrl.errors import ConfigError
from streamrl.policy.expert_weights import checkpoint_layout, checkpoint_tensors
from streamrl.policy.logprobs import causal_lm
from streamrl.policy.lora import is_adapter
from streamrl.policy.model_dir import directory_dtype, source_dir
from streamrl.runtime.stopping import shielded

__all__ = ["DEFAULT_FILE_BYTES", "SavePolicy", "save_policy_shards"]

#: The largest safetensors file written (Hugging Face's default split is 5 GB).
DEFAULT_FILE_BYTES = 5 * 10**9
_CODES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


@dataclass
class _Saved:
    """One tensor of the saved directory: a parameter, or a LoRA layer's merged weight."""

    name: str
    weight: torch.Tensor
    adapters: list[tuple[torch.Tensor, torch.Tensor, float]]  # (A, B, scale) to merge


def save_policy_shards(
    model: torch.nn.Module,
    path: str | Path,
    *,
    dtype: torch.dtype,
    max_file_bytes: int = DEFAULT_FILE_BYTES,
    root: int = 0,
) -> Path | None:
    """Write ``model`` (sharded by FSDP2 or not, LoRA or not) to the directory ``path`` in
    ``dtype``, one tensor at a time (see the module's docstring).

    A collective when ``model`` is sharded: every rank calls it, ``root`` writes. The directory
    is written under a temporary name and renamed into place when whole, so a save cut short
    leaves no directory that looks complete.

    Args:
        model: the trained policy (a ``peft`` model is saved merged).
        path: the directory to write (replaced if it exists).
        dtype: the dtype of the saved tensors (``torch.bfloat16`` for a released model's).
        max_file_bytes: the largest safetensors file; more bytes are split across files.
        root: the rank that writes.

    Returns:
        ``path`` on ``root``; ``None`` on the other ranks.
    """
    if dtype not in _CODES:
        raise ValueError(f"save_policy_shards: dtype must be one of {list(_CODES)}, got {dtype}.")
    me = dist.get_rank() if dist.is_initialized() else 0
    lm = causal_lm(model)
    saved = list(_saved_tensors(lm))
    # A mixture of experts' fused tensors are written one per expert, as checkpoints hold them.
    layout = checkpoint_layout(str(getattr(lm.config, "model_type", "")))
    pieces = [checkpoint_tensors(s.name, tuple(s.weight.shape), layout) for s in saved]
    files = None
    path = Path(path)
    partial = path.with_name(f".{path.name}.partial")
    if me == root:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        specs = [(name, shape) for parts in pieces for name, shape, _ in parts]
        files = _SafetensorsFiles(partial, specs, dtype)
        files.plan(max_file_bytes)
    with torch.no_grad():
        for tensor, parts in zip(saved, pieces, strict=True):
            weight = _to_root(tensor.weight, dtype, me, root)
            merged = [
                (_to_root(a, a.dtype, me, root), _to_root(b, b.dtype, me, root), scale)
                for a, b, scale in tensor.adapters
            ]
            if files is not None:
                if merged:  # W + scale * B A, in float32, then the saved dtype
                    full = weight.to(torch.float32, copy=True)  # never the live weight itself
                    for a, b, scale in merged:
                        full += scale * (b.float() @ a.float())
                    weight = full.to(dtype)
                for name, _, part in parts:
                    files.write(name, weight if part is None else weight[part[0], part[1]])
            del weight, merged
    if files is None:
        return None
    files.close()
    config = copy.deepcopy(lm.config)
    config.dtype = dtype
    config.save_pretrained(partial)
    if getattr(lm, "generation_config", None) is not None:
        lm.generation_config.save_pretrained(partial)
    shutil.rmtree(path, ignore_errors=True)
    partial.rename(path)
    return path


def _saved_tensors(lm: torch.nn.Module) -> Iterator[_Saved]:
    """The directory's tensors in ``lm``'s parameter order, under their Hugging Face names: a
    tied LM head once, a LoRA layer's base weight with the adapters to merge into it."""
    for name, param in lm.named_parameters():
        if is_adapter(name):
            continue
        adapters = []
        if ".base_layer." in name and name.endswith(".weight"):
            layer = lm.get_submodule(name.rsplit(".base_layer.", 1)[0])
            adapters = [
                (layer.lora_A[a].weight, layer.lora_B[a].weight, float(layer.scaling[a]))
                for a in layer.active_adapters
                if a in layer.lora_A
            ]
        yield _Saved(name.replace(".base_layer.", "."), param, adapters)


def _to_root(tensor: torch.Tensor, dtype: torch.dtype, me: int, root: int) -> torch.Tensor | None:
    """``tensor`` whole, in ``dtype``, in host memory on ``root`` (``None`` elsewhere): a shard
    is cast first, then its rows sent to ``root`` (``gather_rows``)."""
    if not isinstance(tensor, DTensor):
        return tensor.detach().to("cpu", dtype) if me == root else None
    wire = tensor.to(dtype) if tensor.dtype != dtype else tensor
    if row_sharded(wire):
        into = torch.empty(wire.shape, dtype=dtype) if me == root else None
        gather_rows(wire, into, root)
        return into
    full = wire.full_tensor()
    return full.cpu() if me == root else None


class _SafetensorsFiles:
    """Safetensors files written one tensor at a time, in a planned order: every file's header
    (names, dtypes, shapes, byte offsets) is known before its first tensor arrives."""

    def __init__(
        self, folder: Path, specs: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype
    ) -> None:
        self.folder, self.specs, self.dtype = folder, specs, dtype
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self.groups: list[list[int]] = []
        self._next, self._file, self._open = 0, None, -1

    def plan(self, max_file_bytes: int) -> None:
        """Split the tensors, in order, into files of at most ``max_file_bytes`` (a larger
        tensor gets a file of its own)."""
        size = 0
        for index, (_, shape) in enumerate(self.specs):
            nbytes = self._nbytes(shape)
            if not self.groups or (size + nbytes > max_file_bytes and size > 0):
                self.groups.append([])
                size = 0
            self.groups[-1].append(index)
            size += nbytes

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append tensor ``name``, the next one of the plan, to its file."""
        index = self._next
        expected = self.specs[index]
        if (name, tuple(tensor.shape)) != expected:
            raise ValueError(f"Saving {name} {tuple(tensor.shape)}, but the plan has {expected}.")
        group = next(g for g, members in enumerate(self.groups) if index in members)
        if group != self._open:
            self._start(group)
        data = tensor.contiguous().view(torch.uint8).reshape(-1).numpy()
        self._file.write(memoryview(data))
        self._next += 1

    def close(self) -> None:
        """Close the last file; write the index when there are several."""
        if self._file is not None:
            self._file.close()
        if self._next != len(self.specs):
            raise ValueError(f"Saved {self._next} of {len(self.specs)} tensors.")
        if len(self.groups) > 1:
            weight_map = {
                self.specs[i][0]: self._file_name(g)
                for g, members in enumerate(self.groups)
                for i in members
            }
            total = sum(self._nbytes(shape) for _, shape in self.specs)
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))

    def _start(self, group: int) -> None:
        if self._file is not None:
            self._file.close()
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for index in self.groups[group]:
            name, shape = self.specs[index]
            end = offset + self._nbytes(shape)
            header[name] = {
                "dtype": _CODES[self.dtype],
                "shape": list(shape),
                "data_offsets": [offset, end],
            }
            offset = end
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
        self._file = open(self.folder / self._file_name(group), "wb")  # noqa: SIM115 (closed by _start or close)
        self._file.write(struct.pack("<Q", len(encoded)) + encoded)
        self._open = group

    def _file_name(self, group: int) -> str:
        if len(self.groups) == 1:
            return "model.safetensors"
        return f"model-{group + 1:05d}-of-{len(self.groups):05d}.safetensors"

    def _nbytes(self, shape: tuple[int, ...]) -> int:
        numel = 1
        for size in shape:
            numel *= size
        return numel * self.itemsize


class SavePolicy(L.Callback):
    """At the end of ``fit`` every rank writes its part of the trained policy to ``path``
    (``save_policy_shards``: a collective; rank 0 writes the files). Give it to every rank's
    trainer (``streamrl.run.trainer_ranks.RankSetup.trainer`` does).

    Args:
        path: the model directory to write (the tokenizer is the caller's to add).
        dtype: ``"auto"`` (the dtype of the directory the policy was read from: bfloat16 for a
            released model), ``"bfloat16"``, ``"float16"`` or ``"float32"``.
        max_file_bytes: the largest safetensors file.
    """

    def __init__(
        self, path: str | Path, dtype: str = "auto", max_file_bytes: int = DEFAULT_FILE_BYTES
    ) -> None:
        if dtype != "auto" and getattr(torch, dtype, None) not in _CODES:
            raise ConfigError(
                f"trainer.save_dtype {dtype!r}: choose auto (the model directory's), bfloat16, "
                "float16 or float32."
            )
        self.path, self.dtype, self.max_file_bytes = Path(path), dtype, max_file_bytes
        #: The directory written (on the writing rank, once ``fit`` is over).
        self.saved: Path | None = None

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        policy = pl_module.policy
        dtype = getattr(torch, self.dtype, None) or directory_dtype(source_dir(policy))
        with shielded():  # a collective: a stop waits until every rank has written its part
            self.saved = save_policy_shards(
                policy, self.path, dtype=dtype, max_file_bytes=self.max_file_bytes
            )
