"""Turn a ``RunConfig`` into what a run needs: prompt sets and a policy directory.

Everything that can be wrong with the input is checked here, before any training starts: the
model directory, the task names, empty prompt sets, and prompts that do not fit the context.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import datasets
from transformers import PreTrainedTokenizerBase

from streamrl.config import RunConfig
from streamrl.errors import ConfigError
from streamrl.models import build_tokenizer, load_tokenizer
from streamrl.sft import SFTConfig, warm_start
from streamrl.tasks.prompt_sets import load_prompt_file, make_splits

#: Context length of the built-in tiny policies.
TINY_CONTEXT = 256


@dataclass
class PreparedRun:
    """Checked inputs of a run.

    Attributes:
        model_dir: the policy's Hugging Face directory (``None`` until ``ensure_policy``).
        train: the training prompt set.
        heldout: the held-out prompt set.
        context: the policy's context length in tokens.
    """

    train: datasets.Dataset
    heldout: datasets.Dataset
    context: int
    model_dir: Path | None = None


def prepare_run(config: RunConfig) -> PreparedRun:
    """Build the prompt sets and check them against the model; no training happens here.

    Raises:
        ConfigError: missing model directory, unknown task, empty prompt set, or a prompt (with
            its answer) longer than the model's context; the message names the prompt.
    """
    tokenizer, context = _tokenizer_and_context(config)
    data = config.data
    if data.prompt_file:
        rows = load_prompt_file(data.prompt_file).shuffle(seed=config.seed)
        n_heldout = min(data.n_heldout, max(1, len(rows) // 5))
        if len(rows) < 2:
            raise ConfigError(
                f"{data.prompt_file}: {len(rows)} row(s); need at least 2 (training and held-out)."
            )
        heldout, train = rows.select(range(n_heldout)), rows.select(range(n_heldout, len(rows)))
    else:
        train, heldout = make_splits(
            data.n_train,
            data.n_heldout,
            data.tasks,
            seed=config.seed,
            median_len=data.median_len,
            tail=data.tail,
            max_len=data.max_len,
        )
    for split in (train, heldout):
        _check_fits_context(split, tokenizer, context)
    return PreparedRun(train=train, heldout=heldout, context=context)


def ensure_policy(config: RunConfig, run: PreparedRun, show_progress: bool = True) -> Path:
    """The policy directory: the user's model, or the warm-started tiny policy (cached)."""
    if config.model != "tiny":
        run.model_dir = Path(config.model)
        return run.model_dir
    sft = SFTConfig(
        model_size=config.sft.model_size,
        steps=config.sft.steps,
        lr=config.sft.lr,
        demo_noise=config.sft.demo_noise,
        early_stop=config.sft.early_stop,
        early_stop_tasks=tuple(config.sft.early_stop_tasks),
        tasks=tuple(config.data.tasks),
        median_len=config.data.median_len,
        tail=config.data.tail,
        max_len=config.data.max_len,
    )
    run.model_dir = warm_start(sft, config.resolved_cache_dir(), show_progress=show_progress)
    return run.model_dir


def _tokenizer_and_context(config: RunConfig) -> tuple[PreTrainedTokenizerBase, int]:
    if config.model == "tiny":
        return build_tokenizer(), TINY_CONTEXT
    path = Path(config.model)
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"model: {config.model!r} is neither 'tiny' nor a model directory (no config.json "
            "there). Pass a local directory written by save_pretrained, or model: tiny."
        )
    model_config = json.loads((path / "config.json").read_text())
    context = int(model_config.get("max_position_embeddings", 0))
    if context <= 0:
        raise ConfigError(f"{path}/config.json has no max_position_embeddings; cannot check fit.")
    return load_tokenizer(path), context


def _check_fits_context(
    split: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, context: int
) -> None:
    for row in split:
        prompt_len = len(tokenizer(row["prompt"])["input_ids"])
        answer_len = len(tokenizer(row["answer"])["input_ids"]) + 1  # + EOS
        if prompt_len + answer_len > context:
            raise ConfigError(
                f"Prompt {row['prompt_id']!r} needs {prompt_len} prompt + {answer_len} answer "
                f"tokens, more than the model's context of {context}. Shorten it, lower "
                "data.max_len, or use a model with a longer context."
            )
