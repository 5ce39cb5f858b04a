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

import numpy as np
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


#: Config fields that count a mixture of experts' routed experts, by family (Qwen-MoE and
#: OLMoE, Mixtral, DeepSeek and GLM).
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")


def is_moe_config(config: object) -> bool:
    """Whether a Hugging Face ``config`` describes a mixture of experts (without building it)."""
    return any(getattr(config, name, None) for name in EXPERT_COUNTS)


def extend_recorded(kept: np.ndarray | None, turn: np.ndarray | None) -> np.ndarray | None:
    """An episode's experts after a turn: ``turn`` (``[its prompt + generated, layers, k]``,
    its prompt the episode so far) where ``kept`` (the episode's before it) recorded nothing.

    A column recorded by an earlier turn keeps that turn's experts, the ones its tokens were
    drawn with (as vLLM's ``routed_experts_prompt_start`` skips a returned prefix); the turn
    fills what is new to it: its own tokens, the observation before them, and the earlier
    turn's last token (never fed there).
    """
    if turn is None or kept is None:
        return kept if turn is None else turn
    if kept.shape[1:] != turn.shape[1:] or len(kept) > len(turn):
        raise ValueError(
            f"routing: a turn's experts {turn.shape} do not extend the episode's {kept.shape} "
            "(another model, or a turn not prompted with the episode so far)."
        )
    merged = turn.copy()
    recorded = (kept != NOT_RECORDED).all(axis=(1, 2))
    merged[: len(kept)][recorded] = kept[recorded]
    return merged


def check_replayable(model: nn.Module) -> None:
    """A ``ValueError`` naming the router when a replay could not recompute its gate weights
    (a gate that is not a softmax over the logits, as DeepSeek-V3's biased sigmoid)."""
    for router in moe_routers(model):
        if hasattr(router, "e_score_correction_bias") or "sigmoid" in str(
            getattr(router, "score_func", getattr(router, "scoring_func", ""))
        ):
            raise ValueError(
                f"routing replay: {type(router).__name__} gates with a sigmoid, not a softmax "
                "over the chosen experts; set rl.module.routing_replay: false for this model."
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
    """Replays recorded experts in the policy's forward passes: the trainer's side.

    Its hooks stay on the routers; ``arm(experts)`` gives the next forwards the experts of
    their flattened input tokens (``[tokens, layers, k]``): each router's choice for a token is
    replaced by the recorded one (where it is not ``NOT_RECORDED``), its gate weights recomputed
    from the current logits over those experts, so gradients reach the router. They stay armed
    until ``disarm``: a recomputation in the backward pass (activation checkpointing) replays
    the same experts. A forward over another number of tokens (another layout of the batch)
    is left to the routers.

    What the routers would have chosen is compared with the recorded experts the first time
    each layer sees them after ``arm``: ``take_mismatch`` counts the recorded tokens whose
    experts differ in at least one layer. ``apply=False`` measures without replaying.
    """

    def __init__(self, model: nn.Module, *, check: bool = True) -> None:
        if check:  # off: measures only (apply=False)
            check_replayable(model)
        self.routers = moe_routers(model)
        if not self.routers:
            raise ValueError(f"{type(model).__name__} has no MoE router to replay.")
        self.compared = 0
        self.mismatched = 0
        self._experts: torch.Tensor | None = None
        self._apply = True
        self._natural: dict[int, torch.Tensor] = {}
        self._hooks = [
            router.register_forward_hook(self._hook(layer))
            for layer, router in enumerate(self.routers)
        ]

    def arm(self, experts: torch.Tensor | None, *, apply: bool = True) -> None:
        """Replay ``experts`` (``[tokens, layers, k]``) in the forwards to come; ``None``:
        nothing recorded, the routers choose."""
        if experts is not None and experts.shape[1] != len(self.routers):
            raise ValueError(
                f"routing replay: {experts.shape[1]} layers recorded, the model has "
                f"{len(self.routers)} MoE layers (another model generated these samples?)."
            )
        self._experts, self._apply, self._natural = experts, apply, {}

    def disarm(self) -> None:
        """The routers choose again."""
        self._experts, self._natural = None, {}

    @contextmanager
    def replaying(self, experts: torch.Tensor | None, *, apply: bool = True) -> Iterator[None]:
        """``arm`` for the forwards inside, then ``disarm``."""
        self.arm(experts, apply=apply)
        try:
            yield
        finally:
            self.disarm()

    def close(self) -> None:
        """Take the hooks off the routers."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def _hook(self, layer: int):
        def replay(module: nn.Module, args: tuple, output: tuple) -> tuple:
            experts = self._experts
            if experts is None or module is not self.routers[layer]:  # a copy's (reference)
                return output
            logits, scores, indices = output
            if indices.shape[0] != experts.shape[0]:  # another layout of the batch
                return output
            recorded = experts[:, layer].to(device=indices.device, dtype=indices.dtype)
            if recorded.shape != indices.shape:
                raise ValueError(
                    f"routing replay: layer {layer} routes {indices.shape[1]} experts per "
                    f"token, {recorded.shape[1]} were recorded (another model?)."
                )
            if layer not in self._natural:
                self._natural[layer] = indices.detach()
                if len(self._natural) == len(self.routers):
                    self._count(experts, torch.stack([*self._natural.values()], dim=1))
            if not self._apply:
                return output
            known = (recorded >= 0).all(dim=-1, keepdim=True)
            chosen = torch.where(known, recorded, indices)
            return logits, gate_weights(module, logits, chosen).to(scores.dtype), chosen

        return replay

    def _count(self, experts: torch.Tensor, natural: torch.Tensor) -> None:
        recorded = (experts >= 0).all(dim=-1).all(dim=-1)  # [tokens]
        theirs = torch.sort(experts.to(device=natural.device, dtype=natural.dtype), -1).values
        differs = (torch.sort(natural, dim=-1).values != theirs).any(dim=-1).any(dim=-1)
        self.compared += int(recorded.sum())
        self.mismatched += int((differs & recorded.to(differs.device)).sum())

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


def routing_metrics(stats: torch.Tensor, *, moe: bool) -> dict[str, float]:
    """What to log of ``(sum |trainer - generator| log-prob, trained tokens, tokens routed
    otherwise than recorded, tokens recorded)``: ``train/logprob_gap_mean`` (after replay, when
    on) and, for a mixture of experts, ``train/routing_mismatch_frac`` (before it)."""
    gap, tokens, mismatched, compared = (float(v) for v in stats)
    out = {"train/logprob_gap_mean": gap / tokens} if tokens else {}
    if moe and compared:
        out["train/routing_mismatch_frac"] = mismatched / compared
    return out
