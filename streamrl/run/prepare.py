"""Turn a ``RunConfig`` into what a run needs: prompt sets and a policy directory.

Everything that can be wrong with the input is checked here, before any training starts: the
model directory, the task names, empty prompt sets, and prompts that do not fit the context.
"""

from __future__ import annotations

import hashlib
import json
import random
import string
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import datasets
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from streamrl.errors import ConfigError
from streamrl.policy.chat import render_prompt
from streamrl.policy.models import (
    build_bpe_tokenizer,
    build_tiny_model,
    build_tokenizer,
    load_tokenizer,
)
from streamrl.policy.sft import SFTConfig, progress_path, save_cached_policy, warm_start
from streamrl.policy.sft_rows import corrupt, sft_on_rows
from streamrl.run.config import DataConfig, RunConfig, WarmStartConfig
from streamrl.runtime.cache_keys import announce_reuse, rows_digest
from streamrl.tasks.local_data import check_enough_rows, load_prompt_dataset, split_heldout
from streamrl.tasks.prompt_sets import load_prompt_file, make_splits

#: Context length of the built-in tiny policies.
TINY_CONTEXT = 256
#: Bump when the warm start on your data changes, so stale caches are not reused.
DATA_RECIPE_VERSION = 1


@dataclass
class PreparedRun:
    """Checked inputs of a run.

    Attributes:
        model_dir: the policy's Hugging Face directory (``None`` until ``ensure_policy``).
        train: the training prompt set.
        heldout: the held-out prompt set.
        context: the policy's context length in tokens.
        tokenizer: the policy's tokenizer (for the built-in tiny policy on your own data, a
            byte-level BPE trained on the training rows).
        demos: the rows the tiny policy's warm start learns from when ``sft.demo_share`` sets
            them apart from ``train``; ``None``: it learns from ``train``.
    """

    train: datasets.Dataset
    heldout: datasets.Dataset
    context: int
    tokenizer: PreTrainedTokenizerBase | None = None
    model_dir: Path | None = None
    demos: datasets.Dataset | None = None


def prepare_run(config: RunConfig) -> PreparedRun:
    """Build the prompt sets and check them against the model; no training happens here.

    Raises:
        ConfigError: missing model directory, unknown task, empty prompt set, or a prompt (with
            its answer) longer than the model's context; the message names the prompt.
    """
    data = config.data
    if data.path or data.reasoning_gym:
        train, heldout = dataset_splits(config)
        tokenizer, context = _tokenizer_and_context(config, train)
        demos = None
        if config.model == "tiny" and config.sft.demo_share is not None:
            demos, train = _set_demos_apart(train, config.sft.demo_share, config.seed)
        check_enough_rows(train, config.rl.prompts_per_iteration, repr(data.path or "train"))
        for split in (train, heldout):
            _check_fits_context(split, tokenizer, context, data)
        return PreparedRun(
            train=train, heldout=heldout, context=context, tokenizer=tokenizer, demos=demos
        )
    tokenizer, context = _tokenizer_and_context(config)
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
        _check_fits_context(split, tokenizer, context, data)
    return PreparedRun(train=train, heldout=heldout, context=context, tokenizer=tokenizer)


def _set_demos_apart(
    train: datasets.Dataset, share: float, seed: int
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """``(demos, rl_rows)``: a seeded ``share`` of ``train`` for the warm start, the rest for RL.

    Raises:
        ConfigError: either part would be empty.
    """
    order = list(range(len(train)))
    random.Random(seed).shuffle(order)
    cut = round(share * len(train))
    if not 0 < cut < len(train):
        raise ConfigError(
            f"sft.demo_share={share} of {len(train)} training rows leaves no rows for the warm "
            "start or none for RL; give more rows or another share."
        )
    return train.select(sorted(order[:cut])), train.select(sorted(order[cut:]))


def dataset_splits(config: RunConfig) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Training and held-out rows of ``data.path`` (held out by file, split or fraction) or of
    ``data.reasoning_gym`` (``n_train`` and ``n_heldout`` rows, no prompt in both)."""
    data = config.data
    if data.reasoning_gym:
        from streamrl.tasks.reasoning_gym import reasoning_gym_dataset

        train = reasoning_gym_dataset(data.reasoning_gym, size=data.n_train, seed=config.seed)
        heldout = reasoning_gym_dataset(  # a far seed, and no question of the training set
            data.reasoning_gym,
            size=data.n_heldout,
            seed=config.seed + 10**6,
            exclude_prompts=set(train["prompt"]),
        )
        return train, heldout
    columns = dict(
        prompt_column=data.prompt_column,
        answer_column=data.answer_column,
        id_column=data.id_column,
        task_column=data.task_column,
        require_prompt=not config.env.name,  # an episode's first prompt comes from reset
    )
    rows = load_prompt_dataset(data.path, split=data.split, **columns)
    if data.heldout_path or data.heldout_split:
        return split_heldout(
            rows,
            heldout_path=data.heldout_path or data.path,
            heldout_split=data.heldout_split,
            seed=config.seed,
            **columns,
        )
    return split_heldout(rows, heldout_fraction=data.heldout_fraction, seed=config.seed)


def policy_heading(config: RunConfig) -> str:
    """The run's first stage heading: the policy it starts from."""
    if config.model != "tiny":
        return f"Policy: {config.model}"
    sft = config.sft
    return (
        f"Warm start: {sft.steps} SFT steps of the tiny '{sft.model_size}' policy on imperfect "
        "demonstrations (cached after the first run; an interrupted one resumes)"
    )


def zero_reward_hint(config: RunConfig) -> str:
    """What to change when a run's policy earns no reward before RL (``HeldoutEvals``)."""
    if config.model != "tiny":
        return (
            "check the reward on a few completions (streamrl bench reward) and the prompt "
            "format (data.chat_template, data.system_prompt), or warm-start the model first."
        )
    if config.data.path or config.data.prompt_file:
        return (
            "the tiny policy's warm start learned too little of your task: try sft.tokenizer: "
            "char (one id per character: copying and reversing text), more training rows, or "
            "more sft.steps (docs/own-task.md)."
        )
    return "give the warm start more sft.steps (or sft.model_size: demo)."


def ensure_policy(config: RunConfig, run: PreparedRun, show_progress: bool = True) -> Path:
    """The policy directory: the user's model, or the warm-started tiny policy (cached)."""
    if config.model != "tiny":
        run.model_dir = Path(config.model)
        return run.model_dir
    if config.data.path or config.data.reasoning_gym:
        run.model_dir = warm_start_on_data(config, run, show_progress=show_progress)
        return run.model_dir
    sft = SFTConfig(
        model_size=config.sft.model_size,
        steps=config.sft.steps,
        lr=config.sft.lr,
        tokens_per_batch=config.sft.tokens_per_batch,
        demo_noise=config.sft.demo_noise,
        early_stop=config.sft.early_stop,
        early_stop_tasks=tuple(config.sft.early_stop_tasks),
        tasks=tuple(config.data.tasks),
        median_len=config.data.median_len,
        tail=config.data.tail,
        max_len=config.data.max_len,
    )
    run.model_dir = warm_start(
        sft, config.resolved_cache_dir(), show_progress=show_progress, force=not config.sft.cache
    )
    return run.model_dir


def warm_start_on_data(config: RunConfig, run: PreparedRun, *, show_progress: bool) -> Path:
    """The tiny policy warm-started by SFT on your training rows, or on the share of them that
    ``sft.demo_share`` sets apart from RL's (cached by the recipe).

    A ``sft.demo_noise`` share of the demonstrated answers carries one typo (an imperfect
    demonstrator, as the built-in warm start has), so the policy starts imperfect and a
    verifiable reward has something to improve. The BPE tokenizer is ``data_tokenizer``'s.
    """
    sft, data = config.sft, config.data
    demos = run.demos if run.demos is not None else run.train
    parts = {  # the tokenizer is learned from the training rows: they count too
        "demonstrations": rows_digest(demos),
        "training rows": rows_digest(run.train),
    }

    def train(options: dict) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, list]:
        tokenizer = run.tokenizer
        model = build_tiny_model(tokenizer, size=sft.model_size, max_positions=TINY_CONTEXT)
        losses = sft_on_rows(
            corrupt(demos, sft.demo_noise, seed=config.seed),
            tokenizer=tokenizer,
            model=model,
            render=lambda tok, prompt: render_prompt(
                tok, prompt, system_prompt=data.system_prompt, chat=data.chat_template
            ),
            **options,
        )
        return model, tokenizer, losses

    recipe = {"recipe": DATA_RECIPE_VERSION, "data": asdict(data)}
    return cached_warm_start(config, "sft-data", recipe, parts, train, show_progress)


def cached_warm_start(
    config: RunConfig,
    name: str,
    recipe: dict,
    parts: dict[str, str],
    train: Callable[[dict], tuple[PreTrainedModel, PreTrainedTokenizerBase, list]],
    show_progress: bool = True,
) -> Path:
    """The tiny policy warm-started by ``train(options) -> (model, tokenizer, losses)``, cached
    under ``<cache>/<name>-<size>-<hash>``: the hash of ``recipe``, the ``sft`` settings, the
    seed and ``parts`` (digests of the rows and code it learns from, named when the cache is
    reused). Every warm start of the tiny policy (your rows, episodes) goes here; ``options``
    are the SFT loop's keyword arguments every warm start shares (steps, lr, token budget,
    seed, progress bar and file).
    """
    sft = config.sft
    recipe = {**recipe, "sft": settings(sft), "seed": config.seed, **parts}
    target = recipe_dir(config, f"{name}-{sft.model_size}", recipe)
    if sft.cache and (target / "sft_meta.json").is_file():
        announce_reuse(target, parts)
        return target
    started = time.perf_counter()
    model, tokenizer, losses = train(
        dict(
            steps=sft.steps,
            lr=sft.lr,
            tokens_per_batch=sft.tokens_per_batch,
            seed=config.seed,
            show_progress=show_progress,
            progress_file=progress_path(target),
        )
    )
    meta = {"recipe": recipe, "losses": losses, "train_s": time.perf_counter() - started}
    return save_cached_policy(model, tokenizer, target, meta)


def settings(sft: WarmStartConfig) -> dict:
    """The warm start's settings as its cache key sees them (whether to use the cache is not
    one)."""
    return {k: v for k, v in asdict(sft).items() if k != "cache"}


def recipe_dir(config: RunConfig, name: str, recipe: dict) -> Path:
    """Where a warm start of ``recipe`` is cached: ``<cache>/<name>-<hash of the recipe>``."""
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]
    return config.resolved_cache_dir() / f"{name}-{key}"


def _tokenizer_and_context(
    config: RunConfig, train: datasets.Dataset | None = None
) -> tuple[PreTrainedTokenizerBase, int]:
    if config.model == "tiny" and train is not None:  # your data: a tokenizer learned from it
        _check_budgets(config, TINY_CONTEXT)
        return data_tokenizer(train, kind=config.sft.tokenizer), TINY_CONTEXT
    if config.model == "tiny":
        _check_budgets(config, TINY_CONTEXT)
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
    _check_budgets(config, context)
    return load_tokenizer(path), context


def _check_budgets(config: RunConfig, context: int) -> None:
    """The token budgets leave room for a prompt in the model's context (a sample never gets
    more than the context less its prompt: a larger budget was silently cut)."""
    rl = config.rl
    for name, budget in (
        ("rl.rollouts.max_tokens", rl.arg("rollouts", "max_tokens")),
        ("rl.eval.max_tokens", rl.eval.max_tokens),
    ):
        if budget is not None and budget >= context:
            raise ConfigError(
                f"{name}: {budget} new tokens do not fit the model's context of {context} tokens "
                f"with a prompt; set {name} below {context} (less the longest prompt's tokens)."
            )


def data_tokenizer(
    train: datasets.Dataset, *, kind: str = "bpe", vocab_size: int = 1024
) -> PreTrainedTokenizerBase:
    """The tiny policy's tokenizer for your data, learned from the training prompts and answers
    (deterministic, so every rank gets the same): a byte-level BPE with a chat template, or
    (``kind="char"``) one id per character of the training text and of printable ASCII, and
    one per byte (a character the data lacks is its UTF-8 bytes). Either loads with
    ``AutoTokenizer`` from the saved policy to the same ids."""
    texts = [_flat_text(p) for p in train["prompt"]] + list(train["answer"])
    if kind == "char":
        seen = set("".join(texts)) | set(string.printable)
        return build_tokenizer("".join(sorted(seen - {"\x0b", "\x0c", "\r"})), all_bytes=True)
    return build_bpe_tokenizer(texts, vocab_size=vocab_size)


def _flat_text(prompt: str | list[dict]) -> str:
    return prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)


def _check_fits_context(
    split: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, context: int, data: DataConfig
) -> None:
    """Each prompt, as the generators get it (chat-templated, with the system prompt), plus its
    answer and the end-of-turn token fits the context."""
    for row in split:
        ids = render_prompt(
            tokenizer, row["prompt"], system_prompt=data.system_prompt, chat=data.chat_template
        )
        answer_len = len(tokenizer(row["answer"], add_special_tokens=False)["input_ids"]) + 1
        if len(ids) + answer_len > context:
            raise ConfigError(
                f"Prompt {row['prompt_id']!r} needs {len(ids)} prompt tokens (after the chat "
                f"template) + {answer_len} answer tokens, more than the model's context of "
                f"{context}. Shorten it, drop it from the dataset, lower data.max_len, or use a "
                "model with a longer context."
            )
