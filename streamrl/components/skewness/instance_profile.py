"""``PTL(BS)`` measured where generation runs: by each generator instance, on its own engine.

StreamRL §5.1 fits the latency model from the backend that will run (Fig. 6-right). The trainer's
copy of the policy on the trainer's device is not that backend (another engine, dtype, device and
thread count), and at 7B profiling it on the trainer takes minutes. So each instance profiles its
own generator once it is built, before it says ready: a few batch sizes, each decoding that many
sequences at a forced length, and the largest batch once more at a long prompt (what a step's
context costs, issue 47: ``LatencyModel.fit`` over the cells; the engine's ``context_load`` says
whether a step pays for its widest row or for the tokens it holds); the service averages the
instances' models
(``StreamGenerationService.measured_latency``) and the dispatcher (Algorithm 2) and the elastic
controller plan with it. Results are cached under a key of the model's shape, the engine, the
device and the machine, so a second run starts at once.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from streamrl.components.skewness.latency import LatencyModel
from streamrl.records import Request

__all__ = ["LatencyProfile", "mean_curve", "profile_generator", "profiled_latency"]


@dataclass(frozen=True)
class LatencyProfile:
    """What an instance profiles.

    Attributes:
        batch_sizes: the batch sizes timed (those above the instance's batch limit are skipped).
        tokens: forced output length per sequence: the first step (the prefill and one token)
            is timed apart from the others.
        context: the long prompt the largest batch is timed at once more (cut to the engine's
            ``context_length``; 0: no context term).
        cache_dir: where curves are cached (``None``: not cached).
    """

    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    tokens: int = 16
    context: int = 128
    cache_dir: str | None = None

    @classmethod
    def up_to(cls, max_batch_size: int, cache_dir: str | None = None) -> LatencyProfile:
        """Powers of two up to ``max_batch_size``, and ``max_batch_size`` itself."""
        sizes = [1 << i for i in range(max_batch_size.bit_length()) if 1 << i <= max_batch_size]
        return cls(tuple(sorted({*sizes, max_batch_size})), cache_dir=cache_dir)


def profile_generator(
    generator: Any, profile: LatencyProfile, prompt_ids: Sequence[int] = (1, 2, 3, 4)
) -> LatencyModel:
    """Time ``generator`` (any ``StreamGenerator``: ``submit``, ``step``, ``idle``) decoding
    ``b`` sequences of ``profile.tokens`` tokens for each batch size ``b``, and the largest
    ``b`` once more at a prompt of ``profile.context`` tokens; the model of batch size and
    context that fits the cells (``LatencyModel.fit``)."""
    limit = getattr(generator, "max_batch_size", max(profile.batch_sizes))
    sizes = sorted({b for b in profile.batch_sizes if b <= limit}) or [1]
    cells = [(size, list(prompt_ids)) for size in sizes]
    room = getattr(generator, "context_length", profile.context + profile.tokens + 1)
    long = min(profile.context, room - profile.tokens - 1)
    if long > 2 * len(prompt_ids):
        cells.append((sizes[-1], (list(prompt_ids) * long)[:long]))
    middle = 1 + (profile.tokens - 1) / 2  # tokens a row holds past its prompt, on average
    steps, prefills = [], []
    for n, (size, prompt) in enumerate(cells):
        step_s, prefill_s = _time_cell(generator, f"profile-{n}", size, prompt, profile.tokens)
        steps.append(([len(prompt) + middle] * size, step_s))
        prefills.append((size * len(prompt), prefill_s))
    load = getattr(generator, "context_load", "widest")
    return LatencyModel.fit(steps, prefills, load=load, profiled_context=len(prompt_ids) + middle)


def _time_cell(
    generator: Any, name: str, size: int, prompt: list[int], tokens: int
) -> tuple[float, float]:
    """Seconds per decode step of ``size`` rows of ``prompt`` (after the first step, which
    admits them), and of their prefill (the first step less one decode step)."""
    generator.submit(
        Request(f"{name}-{i}", prompt, tokens, forced_length=tokens) for i in range(size)
    )
    started = time.perf_counter()
    done = len(generator.step())
    first = time.perf_counter() - started
    while done < size:
        done += len(generator.step())
    rest = time.perf_counter() - started - first
    step_s = rest / max(1, tokens - 1) if tokens > 1 else first
    return step_s, max(0.0, first - step_s)


def profiled_latency(
    generator: Any, profile: LatencyProfile, model_dir: str, engine: object, device: str
) -> tuple[LatencyModel, bool]:
    """The instance's curve, from the cache when this model shape, engine, device and machine
    were profiled before (then ``True``), else measured now and cached."""
    path = None
    if profile.cache_dir is not None:
        path = Path(profile.cache_dir) / f"latency-{_key(profile, model_dir, engine, device)}.json"
        if path.is_file():
            try:
                return LatencyModel.from_json(path), True
            except (ValueError, KeyError, TypeError):  # not a whole model: measured afresh
                pass
    model = profile_generator(generator, profile)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        model.to_json(path)
    return model, False


def mean_curve(models: Sequence[dict[str, Any]]) -> LatencyModel | None:
    """The mean of several instances' models (``LatencyModel`` fields, as they report them):
    ``PTL`` at the batch sizes all of them measured, each cost averaged; ``None`` if none."""
    points = [dict(zip(m["batch_sizes"], m["ptl_s"])) for m in models]
    sizes = sorted(set.intersection(*(set(p) for p in points))) if points else []
    if not sizes:
        return None
    costs = ("context_s", "profiled_context", "prefill_base_s", "prefill_token_s")
    return LatencyModel(
        sizes,
        [sum(p[b] for p in points) / len(points) for b in sizes],
        load=models[0].get("load", "widest"),
        **{c: sum(m.get(c, 0.0) for m in models) / len(models) for c in costs},
    )


def _key(profile: LatencyProfile, model_dir: str, engine: object, device: str) -> str:
    config = (Path(model_dir) / "config.json").read_text()
    machine = (platform.node(), os.cpu_count(), _gpu_name(device))
    shape = (profile.batch_sizes, profile.tokens, profile.context)
    what = [config, repr(engine), device, *shape, machine]
    return hashlib.sha256(json.dumps(what, default=str).encode()).hexdigest()[:16]


def _gpu_name(device: str) -> str:
    if not device.startswith("cuda"):
        return ""
    import torch

    return torch.cuda.get_device_name(torch.device(device))
