"""Rollout routing replay (R3) for mixture-of-experts policies.

A mixture-of-experts layer sends each token to the top-k experts of its router's logits. The
generator's numerics (bfloat16, other kernels, other batch shapes) flip near-tied choices, so the
trainer would compute the log-probability of another network than the one that sampled: the
mismatch grows with the number of MoE layers and destabilises RL (verl, slime, prime-rl, SkyRL,
NeMo-RL ship the fix). The generator **records** the experts it chose for every token and
layer (``RoutingRecorder``); the trainer's forward **replays** them (``RoutingReplay``): those
experts, with gate weights from the current router over them, so the router still learns.

Both work on the routers of transformers' sparse blocks, found by class (``*TopKRouter``, one per
MoE layer: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, GPT-OSS...), each returning ``(logits,
scores, indices)`` over the flattened tokens of its input. Their gate weights are the softmax of
the logits over the chosen experts (renormalised, or not: ``norm_topk_prob``), which is what a
replay recomputes; a router whose gate is another function (a sigmoid with a bias, DeepSeek-V3's)
is refused by name rather than replayed wrongly.

Recorded experts are ``int16`` ``[tokens, layers, k]``; ``-1`` marks a token not recorded (a
prompt token the engine did not return), which the router chooses for itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

#: Where a token's experts were not recorded: its router chooses.
NOT_RECORDED = -1


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The model's MoE routers, one per MoE layer, in layer order (empty for a dense model)."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


def is_moe(model: nn.Module) -> bool:
    """Whether ``model`` routes tokens to experts (has a transformers ``*TopKRouter``)."""
    return bool(moe_routers(model))


def check_replayable(model: nn.Module) -> None:
    """A ``ValueError`` naming the router when a replay could not recompute its gate weights
    (a gate that is not a softmax over the logits, as DeepSeek-V3's biased sigmoid)."""
    for router in moe_routers(model):
        if hasattr(router, "e_score_correction_bias") or "sigmoid" in str(
            getattr(router, "score_func", getattr(router, "scoring_func", ""))
        ):
            raise ValueError(
                f"routing replay: {type(router).__name__} gates with a sigmoid, not a softmax "
                "over the chosen experts; set rl.routing_replay: false for this model."
            )


class RoutingRecorder:
    """Records the experts each router chose, forward by forward: the generator's side.

    Use as a context manager around the forward passes; ``take()`` returns what the last ones
    chose, ``[tokens, layers, k]`` (int16) in the order of the flattened input tokens, and
    clears it.

    Example:
        >>> with RoutingRecorder(model) as recorder:  # doctest: +SKIP
        ...     model(input_ids)
        ...     experts = recorder.take()  # [batch * seq, layers, k]
    """

    def __init__(self, model: nn.Module) -> None:
        self.routers = moe_routers(model)
        if not self.routers:
            raise ValueError(f"{type(model).__name__} has no MoE router to record.")
        self._chosen: list[list[torch.Tensor]] = [[] for _ in self.routers]
        self._hooks: list[Any] = []

    def __enter__(self) -> RoutingRecorder:
        for layer, router in enumerate(self.routers):
            self._hooks.append(router.register_forward_hook(self._hook(layer)))
        return self

    def __exit__(self, *exc: object) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def _hook(self, layer: int):
        def record(module: nn.Module, args: tuple, output: tuple) -> None:
            self._chosen[layer].append(output[2].detach().to(torch.int16))

        return record

    def take(self) -> torch.Tensor:
        """The experts chosen since the last ``take``: ``[tokens, layers, k]``, int16."""
        if not self._chosen[0]:  # no forward since
            k = int(getattr(self.routers[0], "top_k", 0))
            return torch.empty((0, len(self.routers), k), dtype=torch.int16)
        per_layer = [torch.cat(chunks) for chunks in self._chosen]
        self._chosen = [[] for _ in self.routers]
        return torch.stack(per_layer, dim=1)


class RoutingReplay:
    """Replays recorded experts in a forward pass: the trainer's side.

    Within ``replaying(experts)``, each router's choice for a token is replaced by the recorded
    one (where it is not ``NOT_RECORDED``), its gate weights recomputed from the current logits
    over those experts, so gradients reach the router. What the routers would have chosen is
    compared with the recorded experts first: ``mismatched`` / ``compared`` count the recorded
    tokens whose experts differ in at least one layer.
    """

    def __init__(self, model: nn.Module) -> None:
        check_replayable(model)
        self.routers = moe_routers(model)
        if not self.routers:
            raise ValueError(f"{type(model).__name__} has no MoE router to replay.")
        self.compared = 0
        self.mismatched = 0

    @contextmanager
    def replaying(self, experts: torch.Tensor | None, *, apply: bool = True) -> Iterator[None]:
        """Forward passes inside see ``experts`` (``[tokens, layers, k]``, the flattened input
        tokens of one forward) in place of the routers' choices; ``apply=False`` only measures
        the mismatch. ``None``: nothing recorded, the routers choose."""
        if experts is None:
            yield
            return
        if experts.shape[1] != len(self.routers):
            raise ValueError(
                f"routing replay: {experts.shape[1]} layers recorded, the model has "
                f"{len(self.routers)} MoE layers (another model generated these samples?)."
            )
        natural: list[torch.Tensor] = []
        hooks = [
            router.register_forward_hook(self._hook(layer, experts, natural, apply))
            for layer, router in enumerate(self.routers)
        ]
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()
        if len(natural) == len(self.routers):
            self._count(experts, torch.stack(natural, dim=1))

    def _hook(self, layer: int, experts: torch.Tensor, natural: list, apply: bool):
        def replay(module: nn.Module, args: tuple, output: tuple) -> tuple:
            logits, scores, indices = output
            recorded = experts[:, layer].to(device=indices.device, dtype=indices.dtype)
            if recorded.shape != indices.shape:
                raise ValueError(
                    f"routing replay: layer {layer} routed {tuple(indices.shape)} tokens x "
                    f"experts, {tuple(recorded.shape)} were recorded for this forward."
                )
            natural.append(indices.detach())
            if not apply:
                return output
            known = (recorded >= 0).all(dim=-1, keepdim=True)
            chosen = torch.where(known, recorded, indices)
            return logits, gate_weights(module, logits, chosen).to(scores.dtype), chosen

        return replay

    def _count(self, experts: torch.Tensor, natural: torch.Tensor) -> None:
        recorded = (experts >= 0).all(dim=-1).all(dim=-1)  # [tokens]
        same = (
            torch.sort(natural.to(experts.device), dim=-1).values
            == torch.sort(experts.to(natural.dtype), dim=-1).values
        )
        differs = ~same.all(dim=-1).all(dim=-1)
        self.compared += int(recorded.sum())
        self.mismatched += int((differs & recorded).sum())

    def take_mismatch(self) -> tuple[int, int]:
        """``(mismatched, compared)`` tokens since the last call, and resets them."""
        counts = (self.mismatched, self.compared)
        self.mismatched = self.compared = 0
        return counts


def gate_weights(router: nn.Module, logits: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """The router's gate weights for ``chosen`` experts: the softmax of its logits, taken over
    the chosen ones when it renormalises (``norm_topk_prob``, Mixtral always), else over all."""
    logits = logits.float()
    if getattr(router, "norm_topk_prob", True):
        return torch.softmax(logits.gather(-1, chosen.long()), dim=-1)
    return torch.softmax(logits, dim=-1).gather(-1, chosen.long())
