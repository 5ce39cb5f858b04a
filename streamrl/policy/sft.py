"""SFT warm start: teach a fresh tiny policy the task format from imperfect demonstrations.

RL needs a starting policy that already answers in the right format, whose output length tracks
the prompt (so the length ranker has something to learn), and that is wrong often enough for RL to
improve it. A short supervised run on demonstrations of which a share is corrupted gives that.
The result is cached on disk, keyed by everything that shapes it, so ``make demo`` trains it once.

Examples:
    >>> from streamrl.policy.sft import SFTConfig, warm_start
    >>> path = warm_start(SFTConfig(steps=5), cache_dir="/tmp/streamrl-cache")  # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import datasets
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from streamrl.policy.models import build_tiny_model, build_tokenizer, save_policy
from streamrl.runtime.cores import free_cores
from streamrl.runtime.progress import progress_bar
from streamrl.tasks.families import FAMILIES
from streamrl.tasks.prompt_sets import make_prompt_set

#: Bump when the training recipe changes, so stale caches are not reused.
RECIPE_VERSION = 1


@dataclass
class SFTConfig:
    """The warm start's recipe. Every field is part of the cache key.

    Attributes:
        model_size: tiny model size (``"test"`` or ``"demo"``).
        steps: optimizer steps.
        tokens_per_batch: padded tokens per step (demonstrations of similar length are batched
            together, so a step holds many short ones or a few long ones).
        lr: peak AdamW learning rate (linear warm-up, cosine decay).
        demo_noise: share of demonstrations whose answer is corrupted (one character replaced,
            dropped or repeated), so the warm start is imperfect and RL has room to improve it.
        early_stop: share of demonstrations (of ``early_stop_tasks``) that stop one item early.
        early_stop_tasks: the tasks whose demonstrator has that flaw.
        n_demos: distinct demonstration prompts (drawn like the RL prompts, other seed).
        tasks: task families to demonstrate.
        median_len / tail / max_len: answer-length distribution of the demonstrations.
        seed: seeds data, initialisation and training.
    """

    model_size: str = "demo"
    steps: int = 1800
    tokens_per_batch: int = 1024
    lr: float = 1e-3
    demo_noise: float = 0.3
    early_stop: float = 0.6
    early_stop_tasks: tuple[str, ...] = ("copy", "count", "sort")
    n_demos: int = 8192
    tasks: tuple[str, ...] = tuple(FAMILIES)
    median_len: int = 6
    tail: float = 0.8
    max_len: int = 48
    seed: int = 1234

    def cache_key(self) -> str:
        blob = json.dumps({"recipe": RECIPE_VERSION, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def corrupt_answer(answer: str, rng: random.Random, alphabet: str) -> str:
    """Replace, drop or repeat one character of ``answer`` (an imperfect demonstration)."""
    i = rng.randrange(len(answer))
    kind = rng.choice(("replace", "drop", "repeat"))
    if kind == "replace":
        return answer[:i] + rng.choice(alphabet) + answer[i + 1 :]
    if kind == "drop" and len(answer) > 1:
        return answer[:i] + answer[i + 1 :]
    return answer[: i + 1] + answer[i:]


def stop_early(answer: str) -> str:
    """Drop the answer's last item: its last number if it is a list, else its last character."""
    if " " in answer:
        return answer.rsplit(" ", 1)[0]
    return answer[:-1] if len(answer) > 1 else answer


def imperfect(answer: str, task: str, rng: random.Random, config: SFTConfig, alphabet: str) -> str:
    """The demonstrator's version of ``answer``: with probability ``early_stop`` (for the tasks
    in ``early_stop_tasks``) it stops one item early, and with probability ``demo_noise`` it
    makes one typo. A systematic flaw seen in most demonstrations becomes the warm start's
    greedy answer while the right one is still sampled often: room that a verifiable reward
    lets RL reclaim, as RL from imperfect SFT does at scale."""
    if task in config.early_stop_tasks and rng.random() < config.early_stop:
        answer = stop_early(answer)
    if rng.random() < config.demo_noise:
        answer = corrupt_answer(answer, rng, alphabet)
    return answer


def token_budget_batches(lengths: list[int], tokens_per_batch: int) -> list[list[int]]:
    """Group indices of similar length into batches of at most ``tokens_per_batch`` padded tokens.

    With long-tailed lengths, a random batch almost always holds one long demonstration and
    pads everything to it; grouping by length spends the compute on real tokens instead.
    """
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    batches: list[list[int]] = [[]]
    for i in order:
        # Sorted ascending, so lengths[i] is the padded width of the batch if i joins it.
        if batches[-1] and (len(batches[-1]) + 1) * lengths[i] > tokens_per_batch:
            batches.append([])
        batches[-1].append(i)
    return batches


def encode_demos(
    tokenizer: PreTrainedTokenizerBase, prompts: list[str], answers: list[str]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``(input_ids, attention_mask, labels)``; loss only on answer + EOS tokens."""
    rows, labels = [], []
    for prompt, answer in zip(prompts, answers):
        p = tokenizer(prompt)["input_ids"]
        a = [*tokenizer(answer)["input_ids"], tokenizer.eos_token_id]
        rows.append(p + a)
        labels.append([-100] * len(p) + a)
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])  # [batch, seq]
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])  # [batch, seq]
    target = torch.tensor([lab + [-100] * (width - len(lab)) for lab in labels])  # [batch, seq]
    return input_ids, mask, target


def sft_train(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    demos: datasets.Dataset,
    config: SFTConfig,
    show_progress: bool = True,
    progress_file: Path | None = None,
    threads: int | None = None,
) -> list[float]:
    """Train ``model`` in place on ``demos`` (``prompt``/``answer`` columns); returns the losses.

    Each step takes a batch of demonstrations of similar length and makes each imperfect the
    way ``imperfect`` describes. ``progress_file``, ``threads``: see ``train_steps``.
    """
    rng = random.Random(config.seed)
    torch.manual_seed(config.seed)
    alphabet = "".join(sorted(set("".join(demos["answer"])))) or "a"
    prompts, answers, tasks = demos["prompt"], demos["answer"], demos["task"]
    batches = token_budget_batches(
        [len(p) + len(a) + 1 for p, a in zip(prompts, answers)], config.tokens_per_batch
    )

    def batch(idx: list[int]) -> Batch:
        batch_answers = [imperfect(answers[i], tasks[i], rng, config, alphabet) for i in idx]
        return encode_demos(tokenizer, [prompts[i] for i in idx], batch_answers)

    return train_steps(
        model,
        batch,
        batches,
        steps=config.steps,
        lr=config.lr,
        rng=rng,
        show_progress=show_progress,
        progress_file=progress_file,
        threads=threads,
    )


Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # input ids, attention mask, labels


def train_steps(
    model: PreTrainedModel,
    make_batch: Callable[[list[int]], Batch],
    batches: list[list[int]],
    *,
    steps: int,
    lr: float,
    rng: random.Random,
    show_progress: bool = False,
    progress_file: Path | None = None,
    save_every: int = 100,
    threads: int | None = None,
) -> list[float]:
    """The SFT loop every warm start shares: ``steps`` AdamW steps over ``batches`` (lists of
    example indices, reshuffled with ``rng`` each epoch), each encoded by ``make_batch``; linear
    warm-up over the first 5% of steps then cosine decay, gradient norm clipped at 1. Returns
    the loss of every step and leaves ``model`` in eval mode.

    With ``progress_file``, the loop's whole state (weights, optimizer, schedule, random
    states, batch order, losses) is saved there every ``save_every`` steps, and a loop started
    with that file present resumes from it: an interrupted warm start (Ctrl-C, a killed
    process) goes on where it was, and ends with the weights an uninterrupted one gives. The
    caller deletes the file once the result is saved (``save_cached_policy`` does).

    ``threads``: the intra-op threads of every step; ``None``: the cores no other process is
    running on right now, counted before each step (``free_cores``: a busy neighbour costs a
    fair share, not a 10x collapse of spin-waiting OpenMP threads), so the float rounding of a
    warm start, not its recipe, depends on the machine's load; give a number to pin it."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(steps))
    losses: list[float] = []
    loop = _Loop(model, optimizer, scheduler, rng, batches, losses)
    first = loop.resume(progress_file) if progress_file is not None else 0
    model.train()
    bar = progress_bar(
        range(first, steps), "warm start (SFT)", enabled=show_progress, initial=first, total=steps
    )
    own_threads = torch.get_num_threads()
    try:
        for step in bar:
            torch.set_num_threads(threads or free_cores())
            _step(loop, make_batch, step)
            bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
            if progress_file is not None and (step + 1) % save_every == 0 and step + 1 < steps:
                loop.save(progress_file, step + 1)
    finally:
        torch.set_num_threads(own_threads)
    model.eval()
    return losses


def _step(loop: _Loop, make_batch: Callable[[list[int]], Batch], step: int) -> None:
    """One optimizer step of ``train_steps``."""
    model, optimizer, rng, batches = loop.model, loop.optimizer, loop.rng, loop.batches
    if step % len(batches) == 0:
        rng.shuffle(batches)
    input_ids, mask, labels = make_batch(batches[step % len(batches)])
    loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    loop.scheduler.step()
    loop.losses.append(loss.item())


class _Loop:
    """What ``train_steps`` needs to go on exactly where it stopped."""

    def __init__(
        self,
        model: PreTrainedModel,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        rng: random.Random,
        batches: list[list[int]],
        losses: list[float],
    ) -> None:
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.rng, self.batches, self.losses = rng, batches, losses

    def save(self, path: Path, step: int) -> None:
        """Write the state after ``step`` steps: a partial file renamed over the last one."""
        state = {
            "step": step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": self.rng.getstate(),
            "torch_rng": torch.get_rng_state(),
            "batches": self.batches,
            "losses": self.losses,
        }
        partial = path.with_name(path.name + ".partial")
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, partial)
        partial.replace(path)

    def resume(self, path: Path) -> int:
        """Load ``path`` if it is there; returns the number of steps already done (0 if none)."""
        if not path.is_file():
            return 0
        state = torch.load(path, weights_only=False)  # our own file, written by ``save``
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.rng.setstate(state["rng"])
        torch.set_rng_state(state["torch_rng"])
        self.batches[:] = state["batches"]
        self.losses[:] = state["losses"]
        print(
            f"warm start: resuming at step {state['step']} (saved in {path})",
            file=sys.stderr,
            flush=True,
        )
        return state["step"]


def progress_path(target: Path) -> Path:
    """Where the warm start cached as ``target`` keeps its progress while it trains."""
    return target.with_name(target.name + ".progress.pt")


def warmup_cosine(steps: int) -> Callable[[int], float]:
    """LR factor: linear warm-up over the first 5% of ``steps``, then cosine decay to 0."""
    warmup = max(1, steps // 20)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    return factor


def default_cache_dir() -> Path:
    """Where warm starts are cached: ``$STREAMRL_CACHE``, else ``~/.cache/streamrl``."""
    return Path(os.environ.get("STREAMRL_CACHE", Path.home() / ".cache" / "streamrl"))


def warm_start(
    config: SFTConfig,
    cache_dir: str | Path | None = None,
    *,
    show_progress: bool = True,
    force: bool = False,
    threads: int | None = None,
) -> Path:
    """Return the directory of the warm-started policy, training it only if not cached.

    Args:
        config: the recipe; its hash names the cache entry.
        cache_dir: where cached policies live (one sub-directory per recipe); by default
            ``default_cache_dir()``.
        show_progress: draw a progress bar while training.
        force: retrain even when a cached policy exists.
        threads: each step's threads (``train_steps``); ``None``: the free cores.

    Returns:
        A Hugging Face model directory (``load_policy`` reads it) with ``sft_meta.json`` beside
        the weights: the recipe, the loss curve and the training time.
    """
    cache_dir = default_cache_dir() if cache_dir is None else cache_dir
    target = Path(cache_dir) / f"sft-{config.model_size}-{config.cache_key()}"
    if (target / "sft_meta.json").is_file() and not force:
        print(f"warm start: reusing {target} (cached for this recipe)", file=sys.stderr)
        return target
    tokenizer, model, demos = warm_start_inputs(config)
    started = time.perf_counter()
    losses = sft_train(
        model, tokenizer, demos, config, show_progress, progress_path(target), threads
    )
    train_s = time.perf_counter() - started
    meta = {"config": asdict(config), "losses": losses, "train_s": train_s}
    return save_cached_policy(model, tokenizer, target, meta)


def warm_start_inputs(
    config: SFTConfig,
) -> tuple[PreTrainedTokenizerBase, PreTrainedModel, datasets.Dataset]:
    """What ``warm_start`` trains: the tokenizer, the tiny policy at its initialisation, and
    the demonstrations of ``config``."""
    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer, size=config.model_size, seed=config.seed)  # type: ignore[arg-type]
    demos = make_prompt_set(
        config.n_demos,
        config.tasks,
        median_len=config.median_len,
        tail=config.tail,
        max_len=config.max_len,
        seed=config.seed,
        id_prefix="demo-",
    )
    return tokenizer, model, demos


def save_cached_policy(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, target: Path, meta: dict
) -> Path:
    """Save a warm-started policy with ``sft_meta.json`` as the cache entry ``target``.

    Written beside it and renamed last, so that an interrupted run never leaves a half-written
    cache entry (``sft_meta.json`` marks a complete one). The training's progress file
    (``progress_path``) goes once the entry is complete."""
    partial = target.with_name(target.name + ".partial")
    save_policy(model, tokenizer, partial)
    (partial / "sft_meta.json").write_text(json.dumps(meta))
    if target.exists():
        shutil.rmtree(target)
    partial.rename(target)
    progress_path(target).unlink(missing_ok=True)
    return target
