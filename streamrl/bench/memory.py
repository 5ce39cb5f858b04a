"""``streamrl bench memory``: peak memory and tokens/s of one training step, the trainer's old
log-prob path beside its new one, each case in a fresh process (docs/memory.md).

- ``old``, the trainer as it was: float32 weights and compute, no activation checkpointing,
  padded rows, logits at every position over the whole vocabulary
  (``streamrl.bench.full_logprobs``).
- ``new``, the trainer as it is: a one-rank FSDP2 mesh in bf16-mixed precision, activation
  checkpointing, one packed row, the LM head only at completion positions, chunk by chunk
  (``streamrl.policy.logprobs``).

A case builds a model with random weights (a shape, or a model directory's config), creates
AdamW's state, runs one step of GRPO's loss (forward, backward, optimizer step), then the
log-prob + loss part alone: from the final hidden states (a leaf) to their gradients. Memory is
``streamrl.runtime.peak_memory``'s: peak resident set size on the CPU, peak allocated tensors on
CUDA. A case runs under a memory limit (``RLIMIT_AS`` on the CPU, a memory fraction on CUDA); one
that runs out is reported as ``oom`` with what it needed, and the other cases still run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from streamrl.errors import ConfigError
from streamrl.policy.models import SHAPES as MODEL_SHAPES

TrainPath = Literal["old", "new"]
PATHS: tuple[str, ...] = ("old", "new")
#: Shape presets (random weights, tied embeddings): Qwen2.5-0.5B's.
SHAPES: dict[str, dict[str, int]] = {"0.5b": dict(MODEL_SHAPES["0.5b"])}
#: What the log-probs are tempered by: the demo's (``StreamGenerationService``'s default).
TEMPERATURE = 0.7
#: What the default memory limit leaves to the rest of the machine.
MARGIN_BYTES = 2 * 1024**3
GIB = 1024**3
# glibc keeps the freed pages of its heap resident; with a fixed mmap threshold every tensor past
# 128 KiB is a mapping of its own, unmapped when freed, so the resident set follows the live
# tensors and one phase's peak does not depend on what an earlier phase left in the heap.
_ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
_OOM_MARKERS = ("can't allocate memory", "out of memory", "bad_alloc")


def default_intermediate(hidden: int) -> int:
    """The MLP width for ``hidden``: Qwen2.5-0.5B's ratio, 4864 / 896 = 38 / 7, rounded up to a
    multiple of 64.

    Examples:
        >>> default_intermediate(896), default_intermediate(64)
        (4864, 384)
    """
    return -(-hidden * 38 // (7 * 64)) * 64


def model_shape(preset: str = "0.5b", **overrides: int | None) -> dict[str, int]:
    """``preset``'s Qwen2 shape with some fields replaced (``None`` keeps the preset's).

    Args:
        preset: a key of ``SHAPES``.
        **overrides: ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``,
            ``num_key_value_heads``, ``vocab_size``, ``intermediate_size``; a new
            ``hidden_size`` alone also sets ``intermediate_size`` (``default_intermediate``).

    Raises:
        ConfigError: an unknown preset or field, or a shape no model has.
    """
    if preset not in SHAPES:
        raise ConfigError(f"unknown shape {preset!r}; choose one of {sorted(SHAPES)}.")
    given = {k: v for k, v in overrides.items() if v is not None}
    if unknown := sorted(set(given) - set(SHAPES[preset])):
        raise ConfigError(f"unknown shape fields {unknown}; known: {sorted(SHAPES[preset])}.")
    if "hidden_size" in given:
        given.setdefault("intermediate_size", default_intermediate(given["hidden_size"]))
    shape = {**SHAPES[preset], **given}
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    if min(shape.values()) < 1 or shape["hidden_size"] % heads or heads % kv:
        raise ConfigError(
            f"no model has the shape {shape}: every field must be >= 1, --hidden a multiple "
            "of --heads and --heads a multiple of --kv-heads (grouped-query attention)."
        )
    return shape


def default_memory_limit_bytes(device: str) -> int | None:
    """On the CPU, the machine's available memory minus ``MARGIN_BYTES`` (at least 1 GiB);
    ``None`` (no limit: the whole GPU) on CUDA or without ``/proc/meminfo``."""
    meminfo = Path("/proc/meminfo")
    if device != "cpu" or not meminfo.is_file():
        return None
    fields = dict(line.split(":", 1) for line in meminfo.read_text().splitlines())
    return max(GIB, int(fields["MemAvailable"].split()[0]) * 1024 - MARGIN_BYTES)


@dataclass(frozen=True)
class MemoryCase:
    """One case: a training path at one completion length, measured in a process of its own.

    Attributes:
        path: ``"old"`` or ``"new"`` (see the module docstring).
        seq: completion tokens per sample.
        prompt: prompt tokens per sample.
        batch: samples per step.
        shape: the random model's Qwen2 shape (``model_shape``); unused with ``model_dir``.
        model_dir: a local Hugging Face model directory; only its config is read (random
            weights).
        device: ``"cpu"`` or ``"cuda"``.
        repeats: timed steps, their median reported; with more than one, a warm-up step first.
        chunk_tokens: scored tokens per chunk of the new path's head; ``None``: its default.
        memory_limit_bytes: what the case may allocate past its start-up; ``None``: no limit.
        seed: seeds the weights and the tokens.

    Examples:
        >>> shape = model_shape(hidden_size=64, num_attention_heads=4, vocab_size=4096)
        >>> MemoryCase("new", seq=256, shape=shape).model_config["intermediate_size"]
        384
    """

    path: TrainPath
    seq: int
    prompt: int = 64
    batch: int = 1
    shape: dict[str, int] = field(default_factory=lambda: dict(SHAPES["0.5b"]))
    model_dir: str | None = None
    device: str = "cpu"
    repeats: int = 1
    chunk_tokens: int | None = None
    memory_limit_bytes: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.path not in PATHS:
            raise ConfigError(f"unknown path {self.path!r}; --paths takes any of {PATHS}.")
        counts = dict(seq=self.seq, prompt=self.prompt, batch=self.batch, repeats=self.repeats)
        if min(counts.values()) < 1 or (self.chunk_tokens or 1) < 1:
            raise ConfigError(f"{counts}, chunk_tokens={self.chunk_tokens}: each must be >= 1.")
        if self.model_dir is not None and not (Path(self.model_dir) / "config.json").is_file():
            raise FileNotFoundError(
                f"--model {self.model_dir!r} has no config.json: pass a Hugging Face model dir."
            )
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"device must be 'cpu' or 'cuda', got {self.device!r}.")

    @property
    def model_config(self) -> dict[str, Any]:
        """The model's shape: ``shape``, or those fields of ``model_dir``'s config."""
        if self.model_dir is None:
            return self.shape
        config = json.loads((Path(self.model_dir) / "config.json").read_text())
        return {k: config.get(k) for k in self.shape}

    @property
    def vocab(self) -> int:
        """The vocabulary size of the case's model."""
        return self.model_config["vocab_size"]


def bench_memory(cases: list[MemoryCase], timeout_s: float = 3600.0) -> dict[str, Any]:
    """Run each case in a fresh process, one after the other; print a table on stderr.

    Args:
        cases: what to measure (``old`` and ``new`` at one ``seq`` give a ratio).
        timeout_s: a case still running after this long is killed and reported ``timed_out``.

    Returns:
        ``{"cases": [...], "model": {...}, "ratios": {seq: {...}}, ...}``: each case's
        ``path``, ``seq``, ``vocab``, ``peak_bytes``, ``tokens_per_s`` and the rest of its
        figures (``measure_case``); ``ratios``: new over old at each ``seq`` where both ran.
    """
    results = []
    for case in cases:
        print(f"memory: {case.path} seq={case.seq} ...", file=sys.stderr, flush=True)
        results.append(run_case(case, timeout_s))
        print(f"memory: {case.path} seq={case.seq}: {_cells(results[-1])}", file=sys.stderr)
        print(f"memory: case {json.dumps(results[-1])}", file=sys.stderr, flush=True)
    print(_table(results), file=sys.stderr)
    first = cases[0]
    model = {"source": first.model_dir or "shape", **first.model_config}
    model["parameters"] = next((r["parameters"] for r in results if "parameters" in r), None)
    return {
        "cases": results,
        "model": model,
        "ratios": memory_ratios(results),
        "prompt": first.prompt,
        "batch": first.batch,
        "device": first.device,
        "temperature": TEMPERATURE,
        "memory_limit_bytes": first.memory_limit_bytes,
    }


def memory_ratios(results: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """New over old for each figure both paths measured, at each ``seq`` (an old step out of
    memory still has its log-prob figure, measured first)."""
    cases = {(r["path"], r["seq"]): r for r in results}
    keys = ("peak_bytes", "step_extra_bytes", "logprob_extra_bytes", "tokens_per_s")
    ratios = {}
    for seq in sorted({r["seq"] for r in results}):
        old, new = cases.get(("old", seq), {}), cases.get(("new", seq), {})
        both = [k for k in keys if old.get(k) is not None and new.get(k) is not None]
        if both:
            ratios[str(seq)] = {
                k.removesuffix("_bytes"): round(new[k] / max(old[k], 1), 4) for k in both
            }
    return ratios


def run_case(case: MemoryCase, timeout_s: float) -> dict[str, Any]:
    """Measure ``case`` in a fresh ``python -m streamrl.bench.memory_case`` process
    (``run_in_fresh_process``)."""
    result = {"path": case.path, "seq": case.seq, "vocab": case.vocab, "oom": False}
    return run_in_fresh_process("streamrl.bench.memory_case", asdict(case), result, timeout_s)


def run_in_fresh_process(
    module: str, case: dict[str, Any], result: dict[str, Any], timeout_s: float
) -> dict[str, Any]:
    """Run ``python -m module --case JSON`` and return ``result`` updated with the JSON of its
    last stdout line.

    Never raises for the case's own failure: running out of memory gives ``oom: true`` (and
    ``needed_bytes`` when the failed allocation's size is known); a process killed by a signal,
    ``killed`` (and ``oom`` for SIGKILL, the kernel OOM killer's signal); one past ``timeout_s``,
    ``timed_out``; any other failure, ``error`` with the end of its stderr. The process group is
    killed on every way out, Ctrl-C included.
    """
    command = [sys.executable, "-m", module, "--case", json.dumps(case)]
    env = {**_ALLOCATOR_ENV, **os.environ}  # the caller's own settings win
    started = time.perf_counter()
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # its own process group: killed as one
    )
    try:
        out, err = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {**result, "timed_out": True, "error": f"no result within --timeout-s {timeout_s}"}
    finally:
        if process.poll() is None:  # timed out or interrupted
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate(timeout=60)
    result["wall_s"] = round(time.perf_counter() - started, 2)
    if process.returncode < 0:
        name = signal.Signals(-process.returncode).name
        return {**result, "oom": name == "SIGKILL", "killed": name, "error": _tail(err)}
    lines = out.strip().splitlines()
    if process.returncode != 0 or not lines:
        oom = any(marker in err.lower() for marker in _OOM_MARKERS)
        return {**result, "oom": oom, "error": _tail(err) or f"exit status {process.returncode}"}
    return {**result, **json.loads(lines[-1])}


def _tail(text: str, lines: int = 8) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _cells(r: dict[str, Any]) -> str:
    def gib(key: str) -> str:
        return "-" if r.get(key) is None else f"{r[key] / GIB:.3f}"

    if r.get("oom"):
        measured = f"{gib('logprob_extra_bytes'):>19} " if "logprob_extra_bytes" in r else ""
        return (
            f"{measured}out of memory in {r.get('phase', '?')} (needed {gib('needed_bytes')} GiB)"
        )
    if "logprob_extra_bytes" not in r:
        return "failed: " + (r.get("error") or "?").splitlines()[-1]
    figures = [gib(k) for k in ("peak_bytes", "step_extra_bytes", "logprob_extra_bytes")]
    return "{:>9} {:>15} {:>19} {:>10.1f}".format(*figures, r["tokens_per_s"])


def _table(results: list[dict[str, Any]]) -> str:
    head = "path     seq   vocab  peak GiB  step extra GiB  log-prob extra GiB   tokens/s"
    rows = [f"{r['path']:<5} {r['seq']:>6} {r['vocab']:>7} {_cells(r)}" for r in results]
    return "\n".join([head, *rows])
