"""``streamrl demo``, ``model``, ``profile`` and ``timeline``: each a dataclass of options and
the function that runs it (``streamrl.cli.parsing.Command``)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from streamrl.cli.parsing import Command
from streamrl.errors import ConfigError
from streamrl.runtime.quiet import quiet_lightning


@dataclass
class DemoOptions:
    """Run the main job on the embedded default (CPU, tiny model).

    Attributes:
        size: full: the demo of docs/demo.md (about 4 min after the install); small: the same
            job shrunk to about 2 min.
        output_dir: where logs and metrics go (a new directory beside it if it holds a run).
        no_progress: draw no progress bars.
        verbose: also show Lightning's information lines (accelerators found, tips) on stderr,
            as streamrl fit --verbose does.
    """

    size: Literal["full", "small"] = "full"
    output_dir: str = "runs/demo"
    no_progress: bool = False
    verbose: bool = False


def demo(options: DemoOptions) -> dict:
    from streamrl.run.demo import run_demo

    quiet_lightning(verbose=options.verbose)
    return run_demo(options.size, options.output_dir, show_progress=not options.no_progress)


@dataclass
class ModelOptions:
    """Write a random-init model directory of a built-in shape (e.g. 0.5b).

    Attributes:
        out: the directory to write.
        size: the built-in shape (0.5b, 1.5b: Qwen2.5's; moe-test, moe: tiny Qwen3-MoE ones).
        context: positions (prompt + output).
        seed: the weights' seed.
        dtype: the dtype the weights are saved in (a released model's is bfloat16).
    """

    out: str
    size: Literal["test", "demo", "moe-test", "moe", "0.5b", "1.5b"] = "0.5b"
    context: int = 2048
    seed: int = 0
    dtype: Literal["float32", "bfloat16"] = "float32"


def model(options: ModelOptions) -> dict:
    import torch

    from streamrl.policy.model_dir import directory_bytes, empty_model
    from streamrl.policy.models import count_parameters, load_tokenizer, write_random_policy

    path = write_random_policy(
        options.out,
        options.size,
        context=options.context,
        seed=options.seed,
        dtype=getattr(torch, options.dtype),
    )
    policy = empty_model(path, torch.float32)  # the shape only: nothing read
    return {
        "model_dir": str(path),
        "parameters": count_parameters(policy),
        "vocab": policy.config.vocab_size,
        "tokenizer_ids": len(load_tokenizer(path)),
        "dtype": options.dtype,
        "bytes": directory_bytes(path),
    }


@dataclass
class ProfileOptions:
    """Measure the latency model of the HF engine: a decode step's cost by batch size and by
    the context its rows hold, and a prefill's by its tokens.

    Attributes:
        model: 'tiny' (~1M params, random) or a model dir.
        batch_sizes: comma-separated batch sizes.
        contexts: comma-separated prompt lengths in tokens (each row's context); one length
            measures PTL(BS) alone.
        tokens: decode steps timed per run (after a one-token run that times the prefill).
        repeats: runs per grid cell (median).
        output: where to save the latency model (-o).
    """

    model: str = "tiny"
    batch_sizes: str = "1,2,4,8,16,32,64"
    contexts: str = "16,64,160,320"
    tokens: int = 32
    repeats: int = 3
    output: str = "profile.json"


def profile(options: ProfileOptions) -> dict:
    from statistics import median

    from streamrl.bench.generate import load_model
    from streamrl.components.skewness.profiler import Profiler

    sizes = [int(b) for b in options.batch_sizes.split(",")]
    contexts = [int(c) for c in options.contexts.split(",")]
    policy, tokenizer = load_model(options.model, context=max(contexts) + options.tokens + 1)
    prompt = tokenizer("copy abcdefgh=")["input_ids"]
    profiler = Profiler(policy, prompt, tokens=options.tokens, repeats=options.repeats)
    fitted, cells = profiler.fit_grid(sizes, contexts, load="widest")  # a slot cache's rows
    errors = [abs(c["model_s"] - c["step_s"]) / c["step_s"] for c in cells if c["step_s"] > 0]
    errors = errors or [0.0]  # no step measurable: nothing to compare
    header = f"{'batch':>6} {'context':>8} {'step ms':>9} {'model ms':>9} {'prefill ms':>11}"
    print(header, file=sys.stderr)
    for cell in cells:
        print(
            f"{cell['batch']:>6} {cell['context']:>8} {cell['step_s'] * 1e3:>9.2f} "
            f"{cell['model_s'] * 1e3:>9.2f} {cell['prefill_s'] * 1e3:>11.2f}",
            file=sys.stderr,
        )
    print(
        f"fit: {fitted.context_s * 1e6:.4f} us per row-token of context beyond "
        f"{fitted.profiled_context:.0f}; step error median {median(errors):.1%}, "
        f"max {max(errors):.1%}",
        file=sys.stderr,
    )
    path = fitted.to_json(options.output)
    return {
        "batch_sizes": fitted.batch_sizes,
        "ptl_ms": [round(p * 1000, 3) for p in fitted.ptl_s],
        "context_us_per_token": round(fitted.context_s * 1e6, 5),
        "prefill_ms": {
            "base": round(fitted.prefill_base_s * 1e3, 3),
            "per_token": round(fitted.prefill_token_s * 1e3, 5),
        },
        "fit_error": {"median": round(median(errors), 4), "max": round(max(errors), 4)},
        "grid": cells,
        "output": str(path),
    }


@dataclass
class TimelineOptions:
    """Draw a pipeline timeline (Gantt chart PNG) from a trace JSON.

    Attributes:
        trace: trace JSON written by TraceRecorder (also the first bare argument).
        output: PNG path (-o; default: TRACE with a .png suffix).
        title: chart title (default: the trace's name).
    """

    trace: str
    output: str | None = None
    title: str | None = None


def timeline(options: TimelineOptions) -> dict:
    """Load the trace, draw it; returns the PNG path, span count and busy fractions."""
    from streamrl.training.timeline import busy_fraction, lane_order, load_trace
    from streamrl.training.timeline_chart import draw_timeline

    spans = load_trace(options.trace)
    if not spans:
        raise ConfigError(f"{options.trace} holds no spans: nothing to draw.")
    output = options.output or Path(options.trace).with_suffix(".png")
    title = Path(options.trace).name if options.title is None else options.title
    path = draw_timeline(spans, output, title)
    lanes = sorted({s.lane for s in spans}, key=lane_order)
    return {
        "png": str(path),
        "spans": len(spans),
        "lanes": {lane: round(busy_fraction(spans, lane), 4) for lane in lanes},
    }


@dataclass
class MigrateOptions:
    """Rewrite a config of an earlier layout in today's (``{name: ...}`` parts as
    ``class_path`` + ``init_args``, moved keys in their new place).

    Attributes:
        file: the YAML file to migrate (it is not changed).
        out: where to write the result; ``None``: ``<name>.migrated.yaml`` beside it.
    """

    file: str
    out: str | None = None


def migrate(options: MigrateOptions) -> dict:
    from streamrl.run.config_migrate import migrate_file

    result = migrate_file(options.file, options.out)
    for change in result["changes"] or ["nothing to change: the file is in today's layout"]:
        print(f"  {change}", file=sys.stderr)
    print(f"wrote {result['written']}", file=sys.stderr)
    return result


COMMANDS = {
    "demo": Command(
        "run the main job on the embedded default (CPU, tiny model)", DemoOptions, demo
    ),
    "model": Command(
        "write a random-init model directory of a built-in shape (e.g. 0.5b)",
        ModelOptions,
        model,
    ),
    "profile": Command(
        "measure PTL(BS), the per-token decode latency",
        ProfileOptions,
        profile,
        short={"-o": "output"},
    ),
    "timeline": Command(
        "draw a pipeline timeline (Gantt chart PNG) from a trace JSON",
        TimelineOptions,
        timeline,
        positional="trace",
        short={"-o": "output"},
    ),
}

#: ``streamrl config ...``: tools for config files.
CONFIG_COMMANDS = {
    "migrate": Command(
        "rewrite a config of an earlier layout in today's (class_path + init_args)",
        MigrateOptions,
        migrate,
        positional="file",
        short={"-o": "out"},
    ),
}
