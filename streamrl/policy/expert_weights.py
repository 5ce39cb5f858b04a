"""Mixture-of-experts weights as a checkpoint holds them and as the model does.

transformers 5 holds the experts of a sparse block fused, one 3-D parameter per projection
(``experts.gate_up_proj``: ``[experts, 2 x intermediate, hidden]``, gate rows first;
``experts.down_proj``: ``[experts, hidden, intermediate]``), and converts to and from the
per-expert tensors that checkpoints on the Hub hold (Qwen2-/Qwen3-MoE's ``experts.{e}.gate_proj
.weight``, ``up_proj``, ``down_proj``; Mixtral's ``block_sparse_moe.experts.{e}.w1``, ``w3``,
``w2``) inside ``from_pretrained``. streamrl reads weights shard by shard itself
(``model_dir.read_weights``), so it maps each fused parameter to views of the rows its rank
holds, one per expert and projection: each rank reads only its own experts' tensors, into place;
and it writes the trained policy in the checkpoints' layout (``checkpoint_tensors``), which
transformers and vLLM both load.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

#: The fused parameters, by their names' ends.
GATE_UP, DOWN = ".experts.gate_up_proj", ".experts.down_proj"

#: Per-expert checkpoint names of each family (``{p}``: the block's prefix, ``{e}``: expert):
#: (gate, up, down).
LAYOUTS: dict[str, tuple[str, str, str]] = {
    "qwen2_moe": (
        "{p}.experts.{e}.gate_proj.weight",
        "{p}.experts.{e}.up_proj.weight",
        "{p}.experts.{e}.down_proj.weight",
    ),
    "mixtral": (
        "{q}.experts.{e}.w1.weight",
        "{q}.experts.{e}.w3.weight",
        "{q}.experts.{e}.w2.weight",
    ),
}


def is_fused_expert(name: str) -> bool:
    """Whether ``name`` is a fused expert parameter (``GATE_UP`` or ``DOWN``)."""
    return name.endswith((GATE_UP, DOWN))


def expert_views(wanted: dict[str, torch.Tensor], saved: set[str]) -> dict[str, torch.Tensor]:
    """``wanted`` with each fused expert parameter the checkpoint lacks replaced by views of
    its local rows under the checkpoint's per-expert names (the layout the ``saved`` names
    follow), a Mixtral block's other weights under its checkpoint name; the others as they
    are. Filling the views fills the parameter."""
    out: dict[str, torch.Tensor] = {}
    for name, param in wanted.items():
        if name in saved:
            out[name] = param
            continue
        if not is_fused_expert(name):  # Mixtral's checkpoints name the block (its router)
            legacy = name.replace(".mlp.", ".block_sparse_moe.")  # block_sparse_moe
            out[legacy if legacy in saved else name] = param
            continue
        layout = _layout_of(name, saved)
        if layout is None:  # reported as missing by the caller, with the others
            out[name] = param
            continue
        out.update(_views(name, param, layout))
    return out


def _layout_of(name: str, saved: set[str]) -> tuple[str, str, str] | None:
    """The per-expert names of the family whose first expert the checkpoint holds."""
    prefix, q = _prefixes(name)
    for names in LAYOUTS.values():
        if names[2].format(p=prefix, q=q, e=0) in saved:
            return names
    return None


def _prefixes(name: str) -> tuple[str, str]:
    """The block's prefix in transformers 5's names and in Mixtral's checkpoint names."""
    prefix = name.rsplit(".experts.", 1)[0]
    return prefix, prefix.replace(".mlp", ".block_sparse_moe")


def _views(name: str, param: torch.Tensor, layout: tuple[str, str, str]) -> dict[str, torch.Tensor]:
    prefix, q = _prefixes(name)
    local, first = _local_rows(param)
    gate, up, down = layout
    views: dict[str, torch.Tensor] = {}
    for row in range(local.shape[0]):
        e = first + row
        if name.endswith(GATE_UP):
            half = local.shape[1] // 2
            views[gate.format(p=prefix, q=q, e=e)] = local[row, :half]
            views[up.format(p=prefix, q=q, e=e)] = local[row, half:]
        else:
            views[down.format(p=prefix, q=q, e=e)] = local[row]
    return views


def _local_rows(param: torch.Tensor) -> tuple[torch.Tensor, int]:
    """This rank's rows of ``param`` (experts are sharded on dim 0) and the first's index."""
    if not isinstance(param, DTensor):
        return param.data, 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(
        param.shape, param.device_mesh, param.placements
    )
    if any(o for o in offset[1:]):
        raise ValueError(
            f"expert weights: a shard of {tuple(param.shape)} split past the expert dimension "
            f"(offset {offset}); streamrl shards experts on dim 0 only."
        )
    return param._local_tensor, int(offset[0])


def checkpoint_layout(model_type: str) -> tuple[str, str, str] | None:
    """The per-expert names checkpoints of ``model_type`` hold (``LAYOUTS``), as transformers
    maps the family (Qwen3-MoE, OLMoE... to Qwen2-MoE's); ``None`` for a dense model or an
    unknown family (its fused tensors are saved as they are)."""
    try:  # transformers' own family table (private, so looked up defensively)
        from transformers.conversion_mapping import _MODEL_TO_CONVERSION_PATTERN as families
    except ImportError:
        families = {}
    return LAYOUTS.get(families.get(model_type, model_type))


def checkpoint_tensors(
    name: str, shape: tuple[int, ...], layout: tuple[str, str, str] | None
) -> list[tuple[str, tuple[int, ...], tuple[int, slice] | None]]:
    """What a checkpoint holds of the model's tensor ``name``: ``(name, shape, part)``, where
    ``part`` is ``(expert, rows)`` of a fused expert parameter, ``None`` for the whole tensor
    (under Mixtral's block name where the family has one)."""
    if layout is None:
        return [(name, shape, None)]
    prefix, q = _prefixes(name)
    if not is_fused_expert(name):
        mixtral = layout is LAYOUTS["mixtral"] and ".mlp." in name
        return [(name.replace(".mlp.", ".block_sparse_moe.") if mixtral else name, shape, None)]
    gate, up, down = layout
    experts, rows, cols = shape
    out: list[tuple[str, tuple[int, ...], tuple[int, slice] | None]] = []
    for e in range(experts):
        if name.endswith(GATE_UP):
            half = rows // 2
            out.append((gate.format(p=prefix, q=q, e=e), (half, cols), (e, slice(0, half))))
            out.append((up.format(p=prefix, q=q, e=e), (half, cols), (e, slice(half, rows))))
        else:
            out.append((down.format(p=prefix, q=q, e=e), (rows, cols), (e, slice(0, rows))))
    return out


def as_checkpoint(
    named: list[tuple[str, torch.Tensor]], model_type: str
) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs of the trainer's (fused experts) as a checkpoint of
    ``model_type`` names them, each expert's part a view of the fused tensor (no copy): what
    an engine's checkpoint loader (vLLM's ``load_weights``) takes."""
    layout = checkpoint_layout(model_type)
    if layout is None:
        return named
    return [
        (piece, tensor if part is None else tensor[part[0], part[1]])
        for name, tensor in named
        for piece, _, part in checkpoint_tensors(name, tuple(tensor.shape), layout)
    ]
