"""An episode as the one token sequence the trainer sees, built turn by turn.

The conversation is never re-tokenized. The first prompt is rendered once; then each model turn
appends the tokens it generated (its end-of-turn token included), and each observation appends the
tokens of only what the chat template puts between that turn and the next one (``TurnFormat``).
Re-rendering the whole conversation every turn, as some frameworks do, tokenizes the model's text
again and can merge or drop the separators it actually produced; here the tokens trained on are
exactly the tokens generated and seen. A loss mask marks the policy's tokens (1) apart from the
environment's (0); log-probs and the weight version are kept per generated token.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase

from streamrl.policy.chat import stop_token_ids
from streamrl.policy.routing import NOT_RECORDED, extend_recorded
from streamrl.protocols import Environment
from streamrl.records import Request, Sample

# Stand for the texts of a turn and an observation while the template renders.
_TURN, _MARK = "\x00turn\x00", "\x00observation\x00"


class TurnFormat:
    """The text a chat template puts between the model's turn and the next one.

    Found once per role by rendering a short conversation with a marker for the observation's
    text, so it works with any template that renders a message's content verbatim (ChatML,
    Llama 3, ...). A tokenizer without a chat template appends the observation as plain text on a
    new line.

    Args:
        tokenizer: the policy's tokenizer.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.stops = set(stop_token_ids(tokenizer))
        self.chat = bool(getattr(tokenizer, "chat_template", None))
        self._pieces: dict[str, tuple[str, str, str]] = {}

    def pieces(self, role: str) -> tuple[str, str, str]:
        """``(close, before, after)``: what ends the model's turn when it did not stop on an
        end-of-turn token, and what comes before and after an observation of ``role`` (the next
        turn's generation prompt included)."""
        if role not in self._pieces:
            if not self.chat:
                self._pieces[role] = ("", "\n", "\n")
            else:
                self._pieces[role] = self._render_pieces(role)
        return self._pieces[role]

    def _render_pieces(self, role: str) -> tuple[str, str, str]:
        turn = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _TURN}]
        render = self.tokenizer.apply_chat_template
        closed = render(turn, tokenize=False)
        observed = [*turn, {"role": role, "content": _MARK}]
        full = render(observed, add_generation_prompt=True, tokenize=False)
        if not full.startswith(closed) or full.count(_MARK) != 1 or closed.count(_TURN) != 1:
            raise ValueError(
                f"The chat template does not render a {role!r} message after an assistant turn "
                "as an appended suffix; multi-turn episodes need one that does."
            )
        before, after = full[len(closed) :].split(_MARK)
        return closed.split(_TURN)[1], before, after

    def end_of_turn_id(self) -> int:
        """The token the template closes an assistant turn with (``<|im_end|>`` in ChatML; eos
        without a template): what a demonstrated turn ends with."""
        close = self.pieces("user")[0]
        ids = self.tokenizer(close, add_special_tokens=False)["input_ids"] if close else []
        return int(ids[0]) if ids else int(self.tokenizer.eos_token_id)

    def observation_ids(self, turn_ids: Sequence[int], role: str, text: str) -> list[int]:
        """The tokens to append after a model turn ``turn_ids`` for an observation ``text``."""
        close, before, after = self.pieces(role)
        if turn_ids and turn_ids[-1] in self.stops:
            # The model produced the template's end-of-turn token itself: the rest follows. (A
            # turn that stopped on another one, e.g. eos, still gets the template's closing.)
            close = close.removeprefix(self.tokenizer.decode([turn_ids[-1]]))
        text = close + before + text + after
        return [int(i) for i in self.tokenizer(text, add_special_tokens=False)["input_ids"]]


@dataclass
class Episode:
    """One episode in progress: its environment and its token sequence so far.

    Attributes:
        request: the first turn's request (its key is the episode's key; every turn reuses it).
        row: the dataset row it was reset from.
        env: its environment.
        prompt_ids: the first prompt's tokens (not trained on).
        token_ids / loss_mask / logprobs / versions: everything after the prompt, per token:
            1 for the policy's tokens, 0 for the environment's; behaviour log-probs (0.0 for the
            environment's); the weight version that produced it (an observation's: its turn's).
        rewards: each step's reward.
        routed_experts: a mixture of experts' choices over ``ids`` so far
            (``extend_recorded``), ``None`` for a dense policy.
        turns: model turns so far.
        instance_id: the instance of the last turn (it holds the prefix's KV cache).
        finish_reason: ``"done"``, or why it was cut: ``"max_turns"``, ``"context"``,
            ``"env_timeout"``.
    """

    request: Request
    row: Mapping[str, Any]
    env: Environment
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    turns: int = 0
    instance_id: int = -1
    prefill_tokens: int = 0
    cached_tokens: int = 0
    started_s: float = field(default_factory=time.time)
    finish_reason: str | None = None
    routed_experts: Any = None

    @property
    def ids(self) -> list[int]:
        """The whole sequence so far: what the next turn is prompted with."""
        return self.prompt_ids + self.token_ids

    def add_turn(self, sample: Sample) -> None:
        """Append a model turn's generated tokens (trained on)."""
        self.token_ids += sample.token_ids
        self.loss_mask += [1] * sample.length
        self.logprobs += sample.logprobs
        self.versions += sample.token_versions or [sample.weight_version] * sample.length
        self.turns += 1
        self.instance_id = sample.instance_id
        self.prefill_tokens += sample.prefill_tokens
        self.cached_tokens += sample.cached_tokens
        self.routed_experts = extend_recorded(self.routed_experts, sample.routed_experts)

    def add_observation(self, ids: Sequence[int]) -> None:
        """Append an observation's tokens (not trained on)."""
        version = self.versions[-1] if self.versions else self.request.min_weight_version
        self.token_ids += list(ids)
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [version] * len(ids)

    def to_sample(self) -> Sample:
        """The finished episode, as the trainer takes it; its reward is the sum of its steps'."""
        req = self.request
        generated = [v for v, m in zip(self.versions, self.loss_mask) if m]
        return Sample(
            prompt_id=req.prompt_id,
            sample_index=req.sample_index,
            iteration=req.iteration,
            prompt_ids=list(self.prompt_ids),
            token_ids=list(self.token_ids),
            logprobs=list(self.logprobs),
            weight_version=min(generated, default=req.min_weight_version),
            instance_id=self.instance_id,
            started_s=self.started_s,
            finished_s=time.time(),
            finish_reason=self.finish_reason or "done",
            reward=float(sum(self.rewards)),
            loss_mask=list(self.loss_mask),
            token_versions=list(self.versions),
            turns=self.turns,
            prefill_tokens=self.prefill_tokens,
            cached_tokens=self.cached_tokens,
            routed_experts=self._experts(),
        )

    def _experts(self) -> Any:
        """``routed_experts`` over the whole sequence: the last observation, never fed, is
        not recorded."""
        if self.routed_experts is None:
            return None
        out = np.full((len(self.ids), *self.routed_experts.shape[1:]), NOT_RECORDED, np.int16)
        out[: len(self.routed_experts)] = self.routed_experts
        return out
