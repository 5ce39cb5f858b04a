"""``streamrl bench generate --speculative``: the long tail's time with and without speculative
decoding, on one instance, greedy (identical outputs, so the comparison is fair), one thread.

The task echoes its prompt: a tiny policy trained briefly to copy (``COPY_RECIPE``, the package's
SFT warm start, cached like the demo's) answers ``copy <letters>=`` with the letters, and the
prompts' answer lengths are long-tailed (``make_prompt_set``). Each run decodes every prompt with
continuous batching; its **tail phase** starts once no request waits and at most
``max_running`` sequences run (where speculation switches on) and ends with the last sample.
Both modes are timed in the same process, interleaved, medians over repeats.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from streamrl.bench.inputs import BUILT_IN, check_context, tokenizer_for
from streamrl.components.generation.hf_generator import HFStreamGenerator
from streamrl.components.generation.speculative import SpeculativeDecoding
from streamrl.errors import ConfigError
from streamrl.policy.models import load_policy
from streamrl.policy.sft import SFTConfig, warm_start
from streamrl.records import Request
from streamrl.tasks import make_prompt_set

#: The copying policy's warm start: copy prompts only, clean demonstrations, long-tailed lengths.
COPY_RECIPE = SFTConfig(
    tasks=("copy",),
    steps=1200,
    demo_noise=0.0,
    early_stop=0.0,
    n_demos=4096,
    median_len=12,
    tail=0.8,
    max_len=96,
)


def copy_policy(model: str):
    """``(policy, tokenizer)``: the cached copying warm start for ``"tiny"`` (trained on first
    use, a few minutes on one core), else the model directory ``model``."""
    if model == "tiny":
        return load_policy(warm_start(COPY_RECIPE))
    return load_policy(model)


def copy_requests(model: str, n_prompts: int, max_tokens: int) -> list[Request]:
    """Copy prompts with long-tailed answer lengths, checked against ``model`` before any work.

    Raises:
        ConfigError: a random-init built-in model, answers longer than the built-in policy
            learned, or a model directory whose context is shorter than the longest prompt
            plus ``max_tokens``.
    """
    longest = COPY_RECIPE.max_len
    if model in BUILT_IN and model != "tiny":
        raise ConfigError(
            f"bench generate --speculative --model {model}: a random-init model does not copy "
            "its prompt; pass 'tiny' (the copying warm start) or a model directory."
        )
    if model == "tiny" and max_tokens > longest + 1:
        raise ConfigError(
            f"bench generate --speculative: --max-tokens {max_tokens}, but the built-in copying "
            f"policy learned answers of at most {longest} letters; pass --max-tokens <= "
            f"{longest + 1}, or --model DIR."
        )
    tokenizer = tokenizer_for(model)
    # The longest answer plus its EOS fits the budget, so EOS ends every sample that copies.
    rows = make_prompt_set(
        n_prompts, ("copy",), median_len=12, tail=0.8, max_len=max_tokens - 1, seed=11
    )
    requests = [
        Request(f"p{i}", tokenizer(text)["input_ids"], max_tokens)
        for i, text in enumerate(rows["prompt"])
    ]
    if model != "tiny":
        check_context(model, max(len(r.prompt_ids) for r in requests) + max_tokens)
    return requests


def _timed_run(policy, requests: list[Request], batch: int, max_running: int, speculative):
    """One run: ``(whole_s, tail_s, tokens per request, generator)``."""
    gen = HFStreamGenerator(policy, max_batch_size=batch, greedy=True, speculative=speculative)
    gen.submit(Request(r.prompt_id, r.prompt_ids, r.max_tokens) for r in requests)
    tokens: dict[str, list[int]] = {}
    started = time.perf_counter()
    tail_started = None
    while not gen.idle:
        tokens.update((s.prompt_id, s.token_ids) for s in gen.step())
        if tail_started is None and not gen.num_waiting and gen.num_running <= max_running:
            tail_started = time.perf_counter()
    ended = time.perf_counter()
    return ended - started, ended - (tail_started or started), tokens, gen


def bench_speculative(
    model: str,
    batch_sizes: list[int],
    max_tokens: int,
    repeats: int,
    n_prompts: int,
    *,
    draft_tokens: int = 4,
    max_running: int = 4,
) -> dict:
    """Tail-phase and whole-run seconds with and without speculation, per batch size.

    Args:
        model: ``"tiny"`` (the copying warm start) or a model directory.
        batch_sizes: batch slots of the instance, one measurement each.
        max_tokens: token budget per request; answers are at most ``max_tokens - 1`` long.
        repeats: runs per mode (medians reported).
        n_prompts: prompts per run.
        draft_tokens: ``SpeculativeDecoding.draft_tokens``.
        max_running: ``SpeculativeDecoding.max_running``, also where the tail phase starts.

    Returns:
        ``{"batch": {bs: {"tail_s", "whole_s": {"plain", "speculative"}, "tail_ratio",
        "whole_ratio", "acceptance_rate", "verify_steps", "identical"}}, "settings": ...}``.

    Raises:
        ConfigError: a count below 1, ``max_tokens`` below 2, or inputs the model cannot take
            (``copy_requests``).
    """
    if max_tokens < 2 or min(n_prompts, repeats, max_running, *batch_sizes) < 1:
        raise ConfigError(
            "bench generate --speculative: need --max-tokens >= 2 and --prompts, --repeats, "
            f"--max-running and every batch size >= 1; got {max_tokens}, {n_prompts}, "
            f"{repeats}, {max_running}, {batch_sizes}."
        )
    torch.set_num_threads(1)
    settings = SpeculativeDecoding(draft_tokens=draft_tokens, max_running=max_running)
    requests = copy_requests(model, n_prompts, max_tokens)  # checked before any training
    policy, _ = copy_policy(model)
    result: dict = {"batch": {}, "settings": {"speculative": repr(settings), "prompts": n_prompts}}
    print(
        f"{'batch':>6} {'tail plain s':>13} {'tail spec s':>12} {'ratio':>6} "
        f"{'whole plain s':>14} {'whole spec s':>13} {'ratio':>6} {'accept':>7}",
        file=sys.stderr,
    )
    for batch in batch_sizes:
        runs: dict[str, list] = {"plain": [], "speculative": []}
        for _ in range(repeats):  # interleaved: a load change on the machine hits both modes
            runs["plain"].append(_timed_run(policy, requests, batch, max_running, None))
            runs["speculative"].append(_timed_run(policy, requests, batch, max_running, settings))
        row = _summary(runs)
        result["batch"][batch] = row
        tail, whole = row["tail_s"], row["whole_s"]
        print(
            f"{batch:>6} {tail['plain']:>13.3f} {tail['speculative']:>12.3f} "
            f"{row['tail_ratio']:>6.2f} {whole['plain']:>14.3f} {whole['speculative']:>13.3f} "
            f"{row['whole_ratio']:>6.2f} {row['acceptance_rate']:>7.2f}",
            file=sys.stderr,
        )
    return result


def _summary(runs: dict[str, list]) -> dict:
    """Medians of both modes, their ratios, the speculator's counters, and whether every run
    gave the same tokens."""
    med = {
        key: {mode: statistics.median(run[index] for run in runs[mode]) for mode in runs}
        for index, key in ((0, "whole_s"), (1, "tail_s"))
    }
    reference = runs["plain"][0][2]
    identical = all(run[2] == reference for mode in runs for run in runs[mode])
    speculator = runs["speculative"][-1][3].speculator
    return {
        "tail_s": {mode: round(s, 6) for mode, s in med["tail_s"].items()},
        "whole_s": {mode: round(s, 6) for mode, s in med["whole_s"].items()},
        "tail_ratio": round(med["tail_s"]["speculative"] / med["tail_s"]["plain"], 3),
        "whole_ratio": round(med["whole_s"]["speculative"] / med["whole_s"]["plain"], 3),
        "acceptance_rate": round(speculator.acceptance_rate, 3),
        "verify_steps": speculator.verify_steps,
        "identical": identical,
    }
