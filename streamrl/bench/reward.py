"""``streamrl bench reward``: samples/s with rewards in a worker pool vs computed in the trainer.

The same disaggregated run (``bench pipeline``'s protocol: forced long-tailed lengths, one
generator instance, the trainer on the other core) is repeated with the reward computed inline
(``--workers 0``) and in 1, 2... reward worker processes, interleaved, medians reported. A slow
verifier (the default is ``math``, math-verify's symbolic check) scored inline stalls the trainer
between backward passes; in the pool it overlaps training.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

from streamrl.bench.inputs import load_lengths, model_dir_for, tokenizer_for
from streamrl.bench.pipeline import DEFAULT_LENGTHS, _prompt_set, run_mode
from streamrl.bench.settings import RewardBench
from streamrl.errors import ConfigError


def bench_reward(settings: RewardBench) -> dict:
    """Run ``settings.mode`` once per worker count per repeat; report medians and the ratio of each
    pool to inline scoring."""
    try:
        counts = [int(w) for w in settings.workers.split(",") if w.strip()]
    except ValueError as err:
        raise ConfigError(
            f"--workers: comma-separated integers, got {settings.workers!r}."
        ) from err
    if not counts or min(counts) < 0:
        raise ConfigError(f"--workers: need counts >= 0 (0 = inline), got {settings.workers!r}.")
    lengths = load_lengths(settings.lengths or DEFAULT_LENGTHS)
    tokenizer = tokenizer_for(settings.model)
    prompt_set = _prompt_set(settings.pipeline(), lengths)
    longest_prompt = max(len(tokenizer(row["prompt"])["input_ids"]) for row in prompt_set)
    runs: dict[int, list[dict]] = {w: [] for w in counts}
    with tempfile.TemporaryDirectory(prefix="streamrl-bench-") as tmp:
        model_dir = model_dir_for(
            settings.model, Path(tmp), settings.seed, context=longest_prompt + max(lengths)
        )
        for repeat in range(settings.repeats):
            for workers in counts:  # interleaved: drift on the machine hits every setting
                run = settings.pipeline()
                result = run_mode(settings.mode, model_dir, lengths, run, settings.reward, workers)
                runs[workers].append(result)
                rate = result["samples_per_s"]
                print(
                    f"[{repeat + 1}/{settings.repeats}] workers={workers}: {rate:.1f} samples/s",
                    file=sys.stderr,
                )
    table = {
        f"workers={w}": {
            "samples_per_s": round(statistics.median(r["samples_per_s"] for r in rs), 3),
            "runs": [round(r["samples_per_s"], 3) for r in rs],
            "trainer_idle_frac": round(statistics.median(r["trainer_idle_frac"] for r in rs), 3),
        }
        for w, rs in runs.items()
    }
    result = {"reward": settings.reward, "mode": settings.mode, "settings": table}
    if 0 in runs:
        base = table["workers=0"]["samples_per_s"]
        result["ratio_to_inline"] = {
            k: round(v["samples_per_s"] / base, 3) for k, v in table.items()
        }
    for name, row in table.items():
        ratio = result.get("ratio_to_inline", {}).get(name)
        print(
            f"{name:<12} {row['samples_per_s']:>8.1f} samples/s  runs {row['runs']}  x{ratio}",
            file=sys.stderr,
        )
    return result
