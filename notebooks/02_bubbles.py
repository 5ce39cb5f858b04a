# %% [markdown]
# # 02 · Pipeline bubbles: colocated vs disaggregated sync vs one-step async
#
# **What it shows.** The same generator and trainer code run three ways on the same cores, and
# a timeline of each run:
#
# - **colocated** (the baseline): every sample of an iteration is generated first, then the
#   trainer trains on all cores; each stage idles while the other runs;
# - **sync** (disaggregated, streamed): one generator core, one trainer core; the trainer
#   back-propagates micro-batches as samples stream in (dynamic-batch pipelining);
# - **async** (one-step asynchronous): iteration k+1 is generated while iteration k trains, and
#   the weight broadcast runs in the background, so the trainer hardly ever waits.
#
# Lengths are forced from a long-tailed file (the paper's throughput protocol), so every mode
# decodes exactly the same tokens. This is `streamrl bench pipeline` in a few cells
# (measurements on a quiet machine: `docs/pipeline.md`).
#
# **Paper.** StreamRL, arXiv 2504.15930, §4.1 (pipeline bubbles), Fig. 4 and Table 3.
#
# **Run it.** In Jupyter or `python notebooks/02_bubbles.py`;
# `STREAMRL_NOTEBOOK_BUDGET=small` for the short version, figures in `$STREAMRL_NOTEBOOK_OUT`
# (default `notebooks/out/`).

# %%
import tempfile
from pathlib import Path

import matplotlib.image as mpimg
import matplotlib.pyplot as plt

from streamrl.bench import model_dir_for
from streamrl.bench.pipeline import DEFAULT_LENGTHS, load_lengths, run_mode
from streamrl.bench.settings import PipelineBench
from streamrl.run.notebook import notebook_settings
from streamrl.training.timeline_chart import draw_timeline

SMALL, OUT = notebook_settings()  # STREAMRL_NOTEBOOK_BUDGET=small|full, STREAMRL_NOTEBOOK_OUT
MODES = ("colocated", "sync", "async")

# %% [markdown]
# ## The settings of each run
#
# `run_mode` takes `PipelineBench`, the settings `streamrl bench pipeline` reads from its command
# line; these are its defaults, shortened.
# Colocated gets two generator instances and a two-thread trainer (its best configuration on
# two cores); sync and async get one generator instance and a one-thread trainer.

# %%
settings = PipelineBench(
    batch=8 if SMALL else 16,  # prompts per iteration
    group_size=4,  # samples per prompt
    warmup=0 if SMALL else 1,  # unmeasured iterations
    iterations=2 if SMALL else 6,  # measured iterations
    max_batch_size=64,
    generators=1,  # sync / async: generator instances (one core each)
    colocated_generators=2,
    max_tokens_per_micro_batch=256,  # every mode: small micro-batches, training starts early
    seed=0,
)
# The shipped long-tailed lengths (median 22.5, p90 75, max 200 tokens); the short run caps
# them so that it stays short.
lengths = load_lengths(DEFAULT_LENGTHS)
if SMALL:
    lengths = [min(n, 64) for n in lengths]

# %% [markdown]
# ## Run the three modes
#
# Each `run_mode` starts its own generator processes (spawned: when this runs as a script, the
# cells that start them sit under `if __name__ == "__main__":`, because a spawned process
# imports the script that started it) and trains the random-init ~1M-parameter tiny model.

# %%
if __name__ == "__main__":
    results = {}
    with tempfile.TemporaryDirectory(prefix="streamrl-bubbles-") as tmp:
        model_dir = model_dir_for("tiny", Path(tmp))
        for mode in MODES:
            results[mode] = run_mode(mode, model_dir, lengths, settings)
            row = results[mode]
            print(
                f"{mode:<10} {row['samples_per_s']:6.1f} samples/s   trainer idle "
                f"{row['trainer_idle_frac']:5.1%}   generator idle "
                f"{row['generator_idle_frac']:5.1%}"
            )

# %% [markdown]
# ## Timelines
#
# One PNG per mode from `draw_timeline` (the same picture every `streamrl fit` run writes):
# generator lanes on top, darker where more samples decode at once; the trainer below (grey:
# waiting for samples, orange: micro-batches, purple: weight sync). Then the three together.

# %%
if __name__ == "__main__":
    paths = {}
    for mode in MODES:
        spans, rate = results[mode]["_trace"].spans, results[mode]["samples_per_s"]
        title = f"{mode}: {rate:.0f} samples/s"
        paths[mode] = draw_timeline(spans, OUT / f"02_timeline_{mode}.png", title=title)
    fig, axes = plt.subplots(3, 1, figsize=(12, 11))  # one above the other, same width
    for ax, mode in zip(axes, MODES):
        ax.imshow(mpimg.imread(paths[mode]))
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(OUT / "02_bubbles.png", dpi=120)
    plt.show()
    print(f"figures: {', '.join(str(p) for p in paths.values())}, {OUT / '02_bubbles.png'}")

# %% [markdown]
# ## Reading the numbers
#
# Colocated leaves both stages idle half the time. Sync overlaps training with the stream but
# still waits for the long tail of each iteration; async hides it behind the next iteration's
# generation. On two busy cores a short run is noisy: `streamrl bench pipeline` takes medians
# over repeats.

# %%
if __name__ == "__main__":
    base = results["colocated"]["samples_per_s"]
    for mode in MODES:
        print(f"{mode:<10} speed-up over colocated {results[mode]['samples_per_s'] / base:.2f}x")
