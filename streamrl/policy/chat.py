"""Prompts into model input, generations back into assistant text.

A prompt is a plain string or a list of chat messages (``{"role": ..., "content": ...}``). With a
tokenizer that has a chat template, both are rendered by the template with the generation prompt
(the opened assistant turn), so the policy sees what a chat model expects; without one, a string
is tokenized as it is. A completion ends at the eos or end-of-turn token (``stop_token_ids``, the
ids generation stops on) or at a stop string; ``completion_text`` returns the assistant's text
before either, what a reward reads.

Examples:
    >>> from streamrl.policy.models import build_bpe_tokenizer
    >>> tok = build_bpe_tokenizer(["what is two plus two?", "four"] * 20, vocab_size=300)
    >>> print(tok.decode(render_prompt(tok, "hi", system_prompt="be brief")))
    <|im_start|>system
    be brief<|im_end|>
    <|im_start|>user
    hi<|im_end|>
    <|im_start|>assistant
    <BLANKLINE>
    >>> ids = tok("four<|im_end|>\\nmore")["input_ids"]
    >>> completion_text(tok, ids)
    'four'
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from streamrl.errors import ConfigError

#: Tokens that end a turn (or the text) in common chat templates: ChatML (Qwen), Llama 3, Gemma,
#: Phi-3, and GPT-2 style end of text.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>")


def render_prompt(
    tokenizer: PreTrainedTokenizerBase,
    prompt: str | list[dict],
    *,
    system_prompt: str | None = None,
    chat: bool | None = None,
) -> list[int]:
    """The token ids the policy gets for ``prompt``.

    Args:
        tokenizer: the policy's tokenizer.
        prompt: a string, or chat messages (``[{"role": "user", "content": ...}, ...]``).
        system_prompt: a system message put first (unless the messages start with one); needs
            the chat template.
        chat: render a string prompt with the chat template, as one user message; ``None``:
            when the tokenizer has a chat template. Chat messages always use it.

    Returns:
        The ids, a plain ``list[int]``; a rendered chat ends with the generation prompt.

    Raises:
        ConfigError: chat messages, ``chat=True`` or a ``system_prompt`` with a tokenizer that has
            no chat template, or a system prompt with ``chat=False``.
    """
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if isinstance(prompt, str):
        if not (has_template if chat is None else chat):
            if system_prompt is not None:
                raise ConfigError(
                    "system_prompt needs the chat template, but this prompt is tokenized as plain "
                    "text (chat is off or the tokenizer has no chat_template); drop the system "
                    "prompt or turn chat templating on."
                )
            return [int(i) for i in tokenizer(prompt)["input_ids"]]
        messages: list[dict] = [{"role": "user", "content": prompt}]
    else:
        messages = list(prompt)
    if not has_template:
        raise ConfigError(
            "Chat prompts need a tokenizer with a chat_template, and this one has none; pass a "
            "tokenizer with a chat_template (e.g. streamrl.policy.models.build_bpe_tokenizer, or "
            "an instruct model's) or plain-string prompts."
        )
    if system_prompt is not None and not (messages and messages[0].get("role") == "system"):
        messages.insert(0, {"role": "system", "content": system_prompt})
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return _plain_ids(rendered)


def stop_token_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The ids a completion ends on: eos, then the end-of-turn tokens of ``END_OF_TURN_TOKENS``
    that the vocabulary holds (``<|im_end|>`` for ChatML), without repeats."""
    ids = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    for token in END_OF_TURN_TOKENS:
        found = tokenizer.convert_tokens_to_ids(token)
        # An unknown token may come back as None or as the unk id: check it maps back.
        if found is None or tokenizer.convert_ids_to_tokens(found) != token:
            continue
        if int(found) not in ids:
            ids.append(int(found))
    return ids


def completion_text(
    tokenizer: PreTrainedTokenizerBase,
    token_ids: Sequence[int],
    *,
    stop_strings: Sequence[str] = (),
) -> str:
    """The assistant's text of a completion: the tokens before the first stop token
    (``stop_token_ids``), decoded without special tokens, up to the first stop string."""
    stops = set(stop_token_ids(tokenizer))
    end = next((i for i, t in enumerate(token_ids) if t in stops), len(token_ids))
    text = tokenizer.decode(list(token_ids[:end]), skip_special_tokens=True)
    cut = min((i for i in (text.find(s) for s in stop_strings if s) if i >= 0), default=len(text))
    return text[:cut]


def _plain_ids(rendered: Any) -> list[int]:
    """``apply_chat_template(tokenize=True)``'s answer as ``list[int]``: transformers 5 returns a
    ``BatchEncoding`` by default, others a list or a tensor, batched or not."""
    if isinstance(rendered, Mapping):
        rendered = rendered["input_ids"]
    if hasattr(rendered, "tolist"):
        rendered = rendered.tolist()
    if rendered and isinstance(rendered[0], list | tuple):
        (rendered,) = rendered  # one conversation in, one row out
    return [int(i) for i in rendered]
