# %% [markdown]
# # 01 · Quickstart: streamed, disaggregated GRPO on a tiny model
#
# **What it shows.** The whole StreamRL loop on a CPU, through the same recipe as `streamrl fit`:
# two generator processes (the stream generation service, StreamRL §3) decode prompts with
# continuous batching and push every finished sample to the trainer the moment it completes;
# the trainer back-propagates each prompt's group as soon as it is complete (dynamic-batch
# pipelining, §4.1) and a Lightning `Trainer` drives one optimizer step per RL iteration. At the
# end we plot the mean reward of each iteration.
#
# **Paper.** StreamRL, arXiv 2504.15930, §3 (architecture) and §4.1 (pipelining).
#
# **Run it.** In Jupyter (see `notebooks/README.md`) or as a plain script:
# `python notebooks/01_quickstart.py`. Set `STREAMRL_NOTEBOOK_BUDGET=small` for the
# half-minute version the tests run; figures go to `$STREAMRL_NOTEBOOK_OUT`
# (default `notebooks/out/`).

# %%
import matplotlib.pyplot as plt

from streamrl import load_config, run_fit
from streamrl.run.notebook import notebook_settings
from streamrl.run.reruns import fresh_output_dir

SMALL, OUT = notebook_settings()  # STREAMRL_NOTEBOOK_BUDGET=small|full, STREAMRL_NOTEBOOK_OUT

# %% [markdown]
# ## The run, as a config
#
# One mapping in the layout of `configs/demo.yaml`: each section holds one component's
# constructor arguments (`rl.generation`: the `StreamGenerationService`; `rl.module`: the
# `StreamRLModule`), each swappable part is a short name or `{class_path, init_args}`.
# `load_config` checks every key and value before any work (a misspelled key fails with a
# suggestion). The policy is the built-in ~1M-parameter Qwen2-architecture model; a short
# supervised warm start teaches it the task format (cached on disk: `make demo` trains the full
# one, which the full version reuses). Any local Hugging Face model directory works the same
# way: `"model": "/path/to/model"`.

# %%
ITERATIONS, PROMPTS, GROUP = (3, 8, 4) if SMALL else (40, 16, 8)
if __name__ == "__main__":  # a spawned generator process imports this file
    config = load_config(
        {
            "model": "tiny",
            "output_dir": str(fresh_output_dir(OUT / "01_run")),  # a new folder per run
            "data": {"n_heldout": 16} if SMALL else {},  # held-out prompts, before and after RL
            "sft": {"steps": 40} if SMALL else {},  # full: the demo's warm start
            "rl": {
                "algorithm": "grpo",
                "iterations": ITERATIONS,
                "prompts_per_iteration": PROMPTS,
                "group_size": GROUP,
                "generation": {"num_instances": 2, "temperature": 0.7},  # §3
                "module": {"mode": "sync", "lr": 1e-4},  # §4.1: each group trains as it streams in
                "rollouts": {"max_tokens": 64},
                "reward": "partial",
            },
        }
    )
    print(config.rl.algorithm)  # each part as the run holds it: its full import path

# %% [markdown]
# ## Train
#
# `run_fit` is the recipe `streamrl fit` runs (`streamrl/run/recipe.py`, readable top to
# bottom): it warm-starts the policy, starts the generation service, evaluates the starting
# policy on held-out prompts, lets a Lightning `Trainer` drive the RL iterations on the streamed
# samples (`RolloutStream` scores each prompt's group, GRPO advantages; `StreamRLModule` trains
# it), evaluates again, and writes the trained policy, a timeline and `summary.json` to the
# output directory.
#
# Generator instances are **spawned** processes, and a spawned process first imports the script
# that started it. When this notebook runs as a plain `python` script, everything that starts
# them (and what uses their results) sits under `if __name__ == "__main__":`, so a generator
# process that imports the file does not train a second time. In Jupyter the condition is
# always true.

# %%
if __name__ == "__main__":
    summary = run_fit(config, show_progress=not SMALL)
    rewards = summary["reward_per_iteration"]
    print(f"reward first {rewards[0]:.3f} last {rewards[-1]:.3f} over {len(rewards)} iterations")
    print(
        f"held-out accuracy {summary['heldout_acc_before']:.3f} -> "
        f"{summary['heldout_acc_after']:.3f}; {summary['samples_per_s']:.1f} samples/s"
    )

# %% [markdown]
# ## Reward per iteration
#
# Each point is the mean partial-credit reward of one iteration's samples. The summary holds the
# run's other figures (throughput, trainer wait, staleness, where every sample went); the
# output directory's `metrics.csv` every logged metric per iteration.

# %%
if __name__ == "__main__":
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(len(rewards)), rewards, marker="o")
    ax.set_xlabel("iteration")
    ax.set_ylabel("mean reward")
    ax.set_title(f"GRPO on the tiny model ({PROMPTS} prompts x {GROUP} samples per iteration)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(OUT / "01_reward.png", dpi=120)
    plt.show()  # inline in Jupyter; nothing to show when run as a script
    print(f"figure: {OUT / '01_reward.png'}")
