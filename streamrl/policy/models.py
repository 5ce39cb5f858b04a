"""Offline tiny policies: a Qwen2-architecture causal LM built from a config and a tokenizer built
at run time.

Nothing here downloads anything. Both halves save and load with the Hugging Face
``save_pretrained`` / ``from_pretrained`` API, so a real local model directory can be passed
wherever a tiny one is built (``load_policy(path)``).

Examples:
    >>> from streamrl.policy.models import build_tokenizer, build_tiny_model
    >>> tok = build_tokenizer()
    >>> model = build_tiny_model(tok, size="test")
    >>> tok.decode(tok("rev ab=")["input_ids"])
    'rev ab='
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

ModelSize = Literal["test", "demo", "moe-test", "moe", "0.5b", "1.5b", "7b"]

#: Every character the built-in tasks use. Kept small: decode cost grows with the vocabulary.
ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz =>,:+-*()[]."
_GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
#: Special tokens of ``build_bpe_tokenizer``: end of text (eos and pad), start and end of a turn.
END_OF_TEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
#: ChatML: each turn is ``<|im_start|>role\ncontent<|im_end|>\n``; the generation prompt opens
#: the assistant's turn, which the model ends with ``<|im_end|>``.
DEFAULT_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

#: Shapes of the built-in models (hidden, layers, heads, kv heads, MLP width; a vocabulary).
SHAPES: dict[str, dict[str, int]] = {
    # ~150K parameters: unit and integration tests.
    "test": dict(
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=192,
    ),
    # ~1M parameters: the demo policy.
    "demo": dict(
        hidden_size=128,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=384,
    ),
    # Mixtures of experts, Qwen3-MoE's architecture (8 experts, top-2 per token in every layer):
    # ~340K parameters (~120K active per token) for tests; ~1.7M (~0.6M active) for the demo.
    "moe-test": dict(
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=192,
        moe_intermediate_size=64,
        num_experts=8,
        num_experts_per_tok=2,
    ),
    "moe": dict(
        hidden_size=128,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=384,
        moe_intermediate_size=96,
        num_experts=8,
        num_experts_per_tok=2,
    ),
    # ~494M parameters, Qwen2.5-0.5B's shapes (random weights): GPU checks (scripts/gpu_check.sh).
    "0.5b": dict(
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
    ),
    # ~1.54B parameters, Qwen2.5-1.5B's shapes: the CPU's largest LoRA run (docs/memory.md).
    "1.5b": dict(
        hidden_size=1536,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        intermediate_size=8960,
        vocab_size=151936,
    ),
    # ~7.62B parameters, Qwen2.5-7B's shapes (untied head): memory plans (streamrl plan memory).
    "7b": dict(
        hidden_size=3584,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        intermediate_size=18944,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
}


def build_tokenizer(
    alphabet: str = ALPHABET, *, all_bytes: bool = False
) -> PreTrainedTokenizerFast:
    """Build a character-level tokenizer: one id per character, exact round trip.

    It is written as a byte-level BPE (GPT-2/Qwen2's byte alphabet, a character of several UTF-8
    bytes merged from them), the form ``Qwen2Tokenizer`` rebuilds: a saved policy loaded with
    ``AutoTokenizer`` (which picks ``Qwen2Tokenizer`` for the Qwen2 architecture) gets the same
    ids as this tokenizer.

    Args:
        alphabet: the characters to give ids to, in id order after the three special tokens.
        all_bytes: also give an id to each of the 256 bytes, so that a character outside the
            alphabet is its UTF-8 bytes (the same in any loader) rather than ``<unk>`` (which
            ``AutoTokenizer``'s loader drops).

    Returns:
        A ``PreTrainedTokenizerFast`` with ``<pad>`` (id 0), ``<eos>`` and ``<unk>``.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    if len(set(alphabet)) != len(alphabet):
        raise ValueError("build_tokenizer: the alphabet has repeated characters; pass each once.")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    vocab = {PAD: 0, EOS: 1, UNK: 2}
    merges: list[tuple[str, str]] = []
    for ch in alphabet:
        symbols = _byte_symbols(ch)
        for end in range(2, len(symbols) + 1):  # a multi-byte character: merged left to right
            merges.append((symbols[: end - 1], symbols[end - 1]))
            vocab.setdefault(symbols[:end], len(vocab))
        vocab.setdefault(symbols, len(vocab))
    for ch in alphabet:  # the bytes a merge starts from
        for symbol in _byte_symbols(ch):
            vocab.setdefault(symbol, len(vocab))
    for symbol in sorted(byte_level.alphabet()) if all_bytes else ():
        vocab.setdefault(symbol, len(vocab))
    core = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=UNK))
    core.normalizer = normalizers.NFC()  # as Qwen2Tokenizer's
    core.pre_tokenizer = byte_level
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="left",  # left padding keeps batched decoding aligned at the last position
    )


def _byte_symbols(text: str) -> str:
    """``text`` in the byte-level alphabet: one printable symbol per UTF-8 byte (GPT-2's)."""
    return "".join(_BYTE_SYMBOLS[b] for b in text.encode())


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte-to-symbol map: printable bytes stand for themselves, the others for the
    symbols from U+0100 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    return {
        **{b: chr(b) for b in printable},
        **{b: chr(0x100 + i) for i, b in enumerate(others)},
    }


_BYTE_SYMBOLS = _byte_alphabet()


def build_bpe_tokenizer(
    texts: Iterable[str],
    vocab_size: int = 512,
    *,
    chat_template: str | None = DEFAULT_CHAT_TEMPLATE,
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``texts`` (Qwen2's, any text round-trips).

    Training is deterministic: the same texts give the same vocabulary.

    Args:
        texts: the training corpus (e.g. a dataset's prompts and answers).
        vocab_size: the vocabulary size, special tokens and the 256 byte tokens included; a
            small corpus may stop short of it.
        chat_template: the Jinja chat template (``apply_chat_template``); ChatML by default,
            ``None`` for a tokenizer without one.

    Returns:
        A ``PreTrainedTokenizerFast`` with ``<|endoftext|>`` (id 0, eos and pad),
        ``<|im_start|>`` and ``<|im_end|>`` (ids 1 and 2), left padding.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    specials = [END_OF_TEXT, IM_START, IM_END]
    if vocab_size < len(specials) + len(byte_level.alphabet()):
        raise ValueError(
            f"build_bpe_tokenizer: vocab_size={vocab_size} is below the {len(specials)} special "
            f"and {len(byte_level.alphabet())} byte tokens every byte-level BPE holds."
        )
    core = Tokenizer(models.BPE())
    # Qwen2Tokenizer's normalizer and pre-tokenizer (words, single digits, then bytes), which
    # AutoTokenizer rebuilds for a Qwen2 model: a saved policy loads to the same ids.
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"), byte_level]
    )
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=byte_level.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=END_OF_TEXT,
        pad_token=END_OF_TEXT,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=chat_template,
        padding_side="left",  # as build_tokenizer: batched decoding aligned at the last position
    )


def build_tiny_model(
    tokenizer: PreTrainedTokenizerBase,
    size: ModelSize = "test",
    max_positions: int = 256,
    seed: int = 0,
) -> PreTrainedModel:
    """Build a randomly initialised Qwen2-architecture causal LM sized for a CPU (Qwen3-MoE's
    for the mixtures of experts, ``"moe-test"`` and ``"moe"``).

    Args:
        tokenizer: fixes the vocabulary size and the pad/eos ids.
        size: ``"test"`` (~150K parameters), ``"demo"`` (~1M parameters), ``"moe-test"``
            and ``"moe"`` (their mixture-of-experts kin, 8 experts, top-2) or ``"0.5b"``
            (Qwen2.5-0.5B's shapes, ~494M parameters, for GPU checks).
        max_positions: context length in tokens (prompt plus completion).
        seed: initialisation seed, so the same call builds the same weights.

    Returns:
        A ``Qwen2ForCausalLM`` (``Qwen3MoeForCausalLM``) in float32 with tied input/output
        embeddings. Its
        ``eos_token_id`` (config and generation config) is the tokenizer's eos, or the list
        ``[eos, end-of-turn...]`` when the tokenizer has an end-of-turn token (``<|im_end|>``:
        ``streamrl.policy.chat.stop_token_ids``), so generation stops at the end of the turn.
    """
    from streamrl.policy.chat import stop_token_ids

    if size not in SHAPES:
        raise ValueError(
            f"build_tiny_model: unknown size {size!r}; choose one of {sorted(SHAPES)}."
        )
    shape = {"vocab_size": len(tokenizer), "tie_word_embeddings": True, **SHAPES[size]}
    stops = stop_token_ids(tokenizer)
    eos = stops if len(stops) > 1 else tokenizer.eos_token_id
    config = _config_class(size)(
        max_position_embeddings=max_positions,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=eos,
        bos_token_id=tokenizer.eos_token_id,
        **shape,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = _model_class(size)(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = eos
    return model


def model_config(size: ModelSize, max_positions: int = 32768) -> PretrainedConfig:
    """The config of a built-in shape (a preset's: ``"7b"`` is Qwen2.5-7B's), without building
    a model: what ``streamrl plan memory --model 7b`` estimates from."""
    if size not in SHAPES:
        raise ValueError(f"model_config: unknown size {size!r}; choose one of {sorted(SHAPES)}.")
    return _config_class(size)(
        max_position_embeddings=max_positions, **{"tie_word_embeddings": True, **SHAPES[size]}
    )


def _config_class(size: str) -> type[PretrainedConfig]:
    """Qwen3-MoE's config for the mixtures of experts, Qwen2's for the others."""
    if "num_experts" in SHAPES[size]:
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig
    return Qwen2Config


def _model_class(size: str) -> type[PreTrainedModel]:
    """The causal LM of ``_config_class(size)``."""
    if "num_experts" in SHAPES[size]:
        from transformers import Qwen3MoeForCausalLM

        return Qwen3MoeForCausalLM
    return Qwen2ForCausalLM


def write_random_policy(
    out: str | Path,
    size: ModelSize = "0.5b",
    *,
    context: int = 2048,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """A random-init model directory of a built-in shape with a byte-level BPE tokenizer built
    here (trained on the built-in tasks' prompts and answers), for ``streamrl fit --model``,
    the benchmarks and the GPU check: the code path of a real local model, at its real shapes.

    Args:
        out: the directory to write (``save_pretrained`` layout).
        size: a built-in shape; ``"0.5b"`` is Qwen2.5-0.5B's (151,936-token vocabulary: ids
            past the tokenizer's decode to nothing), ``"1.5b"`` Qwen2.5-1.5B's.
        context: positions of the model (prompt plus completion).
        seed: initialisation seed.
        dtype: the dtype the weights are saved in (a released model's is ``torch.bfloat16``).
    """
    from streamrl.tasks import make_prompt_set

    rows = make_prompt_set(2048, seed=seed)
    tokenizer = build_bpe_tokenizer([*rows["prompt"], *rows["answer"]], vocab_size=512)
    model = build_tiny_model(tokenizer, size, max_positions=context, seed=seed)
    return save_policy(model.to(dtype), tokenizer, out)


def save_policy(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: str | Path
) -> Path:
    """Save model and tokenizer into one Hugging Face model directory."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def load_policy(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer from a local directory, never from a hub.

    Args:
        path: a directory written by ``save_pretrained`` (ours or any local HF model).
        dtype: the dtype of the loaded weights, whatever the checkpoint's: float32 for the
            trainer's master weights (``"32-true"`` and ``"bf16-mixed"`` both keep them so;
            the forward pass of ``"bf16-mixed"`` casts them to bfloat16).
        device: where the weights are read to (``read_model``).

    Returns:
        ``(model, tokenizer)``, the model in eval mode, in ``dtype``, on ``device``.

    Raises:
        FileNotFoundError: the directory or its ``config.json`` is missing.
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"No model directory at {str(path)!r} (no config.json there). Pass a directory "
            "written by save_pretrained, or use model: tiny to build one."
        )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tokenizer = load_tokenizer(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return read_model(path, dtype, device).eval(), tokenizer


def read_model(path: str | Path, dtype: torch.dtype, device: str = "cpu") -> PreTrainedModel:
    """The causal LM of a local directory in ``dtype`` on ``device``, read tensor by tensor with
    plain file reads (``streamrl.policy.model_dir``): its memory is the model's, without the
    safetensors files' mapped pages that ``from_pretrained`` holds beside it while it loads (a
    bfloat16 1.5B generator peaked at 5.3 GiB that way). A directory whose tensors are not the
    model's own names (no safetensors, or an architecture ``from_pretrained`` renames tensors
    for) is read by ``from_pretrained``."""
    from streamrl.errors import ConfigError
    from streamrl.policy.model_dir import empty_model, materialize

    model = empty_model(path, dtype)
    try:
        materialize(model, path, device)
    except ConfigError:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
        model.to(device)
    return model


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Load the tokenizer of a local model directory (exact round trip for ours)."""
    path = Path(path)
    # AutoTokenizer picks the class registered for the model type (Qwen2Tokenizer for our tiny
    # policies), which replaces the saved pre-tokenizer; a generic tokenizer.json must be loaded
    # as the generic fast tokenizer so that it round-trips exactly.
    config_file = path / "tokenizer_config.json"
    declared = (
        json.loads(config_file.read_text()).get("tokenizer_class")
        if config_file.is_file()
        else None
    )
    if declared in _GENERIC_TOKENIZER_CLASSES:
        return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def count_parameters(model: torch.nn.Module) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())
