# %% [markdown]
# # 01 · Quickstart: streamed, disaggregated GRPO on a tiny model
#
# **What it shows.** The whole StreamRL loop on a CPU: two generator processes (the stream
# generation service, StreamRL §3) decode prompts with continuous batching and push every
# finished sample to the trainer the moment it completes; the trainer back-propagates each
# prompt's group as soon as it is complete (dynamic-batch pipelining, §4.1) and a Lightning
# `Trainer` drives one optimizer step per RL iteration. At the end we plot the mean reward of
# each iteration.
#
# **Paper.** StreamRL, arXiv 2504.15930, §3 (architecture) and §4.1 (pipelining).
#
# **Run it.** In Jupyter (see `notebooks/README.md`) or as a plain script:
# `python notebooks/01_quickstart.py`. Set `STREAMRL_NOTEBOOK_BUDGET=small` for the
# half-minute version the tests run; figures go to `$STREAMRL_NOTEBOOK_OUT`
# (default `notebooks/out/`).

# %%
import matplotlib.pyplot as plt
import torch

from streamrl import (
    GRPO,
    PromptSource,
    RolloutStream,
    SFTConfig,
    StreamGenerationService,
    build_module,
    build_trainer,
    load_policy,
    make_prompt_set,
    partial_credit,
    warm_start,
)
from streamrl.run.notebook import notebook_settings

SMALL, OUT = notebook_settings()  # STREAMRL_NOTEBOOK_BUDGET=small|full, STREAMRL_NOTEBOOK_OUT
torch.set_num_threads(1)  # one core for the trainer; the generator processes take the others

# %% [markdown]
# ## The policy
#
# The built-in ~1M-parameter Qwen2-architecture model with a character tokenizer. A short
# supervised warm start teaches it the task format (cached on disk: `make demo` trains the
# full one, which this notebook reuses). Any local Hugging Face model directory works the same
# way: `model_dir = "/path/to/model"`.

# %%
sft = SFTConfig(steps=40, n_demos=1024) if SMALL else SFTConfig()  # full: the demo's warm start
model_dir = warm_start(sft, show_progress=not SMALL)
policy, tokenizer = load_policy(model_dir)
ITERATIONS, PROMPTS, GROUP = (3, 8, 4) if SMALL else (40, 16, 8)
prompts = make_prompt_set(512, ["copy", "rev", "count", "sort"], median_len=6, max_len=48)
print(prompts[0])  # one row: a prompt and its reference answer

# %% [markdown]
# ## Train
#
# `RolloutStream` turns the service's samples into scored groups (GRPO advantages);
# `build_module` makes the LightningModule that trains on them and `build_trainer` the Lightning
# `Trainer` that runs one optimizer step per iteration: the same builders `streamrl fit` uses.
#
# Generator instances are **spawned** processes, and a spawned process first imports the script
# that started it. When this notebook runs as a plain `python` script, everything that starts
# them (and what uses their results) sits under `if __name__ == "__main__":`, so a generator
# process that imports the file does not train a second time. In Jupyter the condition is
# always true.

# %%
if __name__ == "__main__":
    algorithm = GRPO(group_size=GROUP)
    with StreamGenerationService(model_dir, num_instances=2, temperature=0.7) as sgs:
        rollouts = RolloutStream(
            sgs,
            PromptSource(prompts, PROMPTS),
            tokenizer,
            algorithm,
            reward=partial_credit,
            max_tokens=64,
            context=policy.config.max_position_embeddings,
        )
        module = build_module(policy, rollouts=rollouts, iterations=ITERATIONS, lr=1e-4)
        build_trainer(module, show_progress=not SMALL).fit(module)
    rewards = [h["rollout/reward"] for h in module.history]
    print(f"reward first {rewards[0]:.3f} last {rewards[-1]:.3f} over {len(rewards)} iterations")

# %% [markdown]
# ## Reward per iteration
#
# Each point is the mean partial-credit reward of one iteration's samples. `module.history`
# holds every logged metric per iteration (throughput, trainer wait, staleness, ...).

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
