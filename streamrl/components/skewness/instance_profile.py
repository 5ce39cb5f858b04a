"""``PTL(BS)`` measured where generation runs: by each generator instance, on its own engine.

StreamRL §5.1 fits the latency model from the backend that will run (Fig. 6-right). The trainer's
copy of the policy on the trainer's device is not that backend (another engine, dtype, device and
thread count), and at 7B profiling it on the trainer takes minutes. So each instance profiles its
own generator once it is built, before it says ready: a few batch sizes, each decoding that many
sequences at a forced length; the service averages the instances' curves
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
        tokens: forced output length per sequence (prefill is amortised over it).
        cache_dir: where curves are cached (``None``: not cached).
    """

    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    tokens: int = 16
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
    ``b`` sequences of ``profile.tokens`` tokens for each batch size ``b``; seconds per token."""
    limit = getattr(generator, "max_batch_size", max(profile.batch_sizes))
    sizes = sorted({b for b in profile.batch_sizes if b <= limit}) or [1]
    seconds = []
    for size in sizes:
        generator.submit(
            Request(
                f"profile-{size}-{i}",
                list(prompt_ids),
                profile.tokens,
                forced_length=profile.tokens,
            )
            for i in range(size)
        )
        started, done = time.perf_counter(), 0
        while done < size:
            done += len(generator.step())
        seconds.append((time.perf_counter() - started) / profile.tokens)
    return LatencyModel(sizes, seconds)


def profiled_latency(
    generator: Any, profile: LatencyProfile, model_dir: str, engine: object, device: str
) -> tuple[LatencyModel, bool]:
    """The instance's curve, from the cache when this model shape, engine, device and machine
    were profiled before (then ``True``), else measured now and cached."""
    path = None
    if profile.cache_dir is not None:
        path = Path(profile.cache_dir) / f"latency-{_key(profile, model_dir, engine, device)}.json"
        if path.is_file():
            return LatencyModel.from_json(path), True
    model = profile_generator(generator, profile)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        model.to_json(path)
    return model, False


def mean_curve(curves: Sequence[tuple[Sequence[int], Sequence[float]]]) -> LatencyModel | None:
    """The mean of several instances' ``(batch sizes, PTL)`` curves at the batch sizes all of
    them measured; ``None`` if there are none."""
    points = [dict(zip(*curve)) for curve in curves]
    sizes = sorted(set.intersection(*(set(p) for p in points))) if points else []
    if not sizes:
        return None
    return LatencyModel(sizes, [sum(p[b] for p in points) / len(points) for b in sizes])


def _key(profile: LatencyProfile, model_dir: str, engine: object, device: str) -> str:
    config = (Path(model_dir) / "config.json").read_text()
    machine = (platform.node(), os.cpu_count(), _gpu_name(device))
    what = [config, repr(engine), device, profile.batch_sizes, profile.tokens, machine]
    return hashlib.sha256(json.dumps(what, default=str).encode()).hexdigest()[:16]


def _gpu_name(device: str) -> str:
    if not device.startswith("cuda"):
        return ""
    import torch

    return torch.cuda.get_device_name(torch.device(device))
