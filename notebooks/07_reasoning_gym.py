# %% [markdown]
# # 07 · Your own task: RL on reasoning-gym, scored by its own verifiers
#
# **What it shows.** streamrl on a task suite nobody here wrote. reasoning-gym generates
# procedural reasoning tasks offline and ships a verifier per task (`score_answer`). We draw a
# mix of two tasks (spell a word backwards; add two small numbers), give the built-in tiny policy
# a tokenizer learned from the data, warm-start it by SFT on the suite's own answers, and let
# GRPO (one-step async) raise its held-out reward. The reward is the task's own verifier, run in
# a reward worker process; evaluation uses the same verifier, per task.
#
# Everything is the public path a user takes for their own data: `data.reasoning_gym` could as
# well be `data.path: my.jsonl` with `rl.reward: my_lab.rewards:score` (docs/own-task.md).
#
# **Paper.** StreamRL, arXiv 2504.15930, §3-§5 run unchanged on another task; the paper trains
# with a rule-based reward (§7), which a verifier is.
#
# **Run it.** In Jupyter or `python notebooks/07_reasoning_gym.py`;
# `STREAMRL_NOTEBOOK_BUDGET=small` for the short version, figures in `$STREAMRL_NOTEBOOK_OUT`
# (default `notebooks/out/`). The full budget is `configs/reasoning_gym.yaml` (9 min 47 s
# measured on 2 cores: 4 min of SFT warm start, cached afterwards, then 150 RL iterations).

# %%
import csv
import json
from pathlib import Path

import matplotlib.pyplot as plt

from streamrl import load_config, reasoning_gym_dataset, run_fit
from streamrl.eval.schedule import EvalSchedule
from streamrl.run.notebook import notebook_settings, repo_file

SMALL, OUT = notebook_settings()  # STREAMRL_NOTEBOOK_BUDGET=small|full, STREAMRL_NOTEBOOK_OUT
CONFIG = repo_file("configs/reasoning_gym.yaml")  # from the repository root or notebooks/

# %% [markdown]
# ## The tasks
#
# Each row keeps reasoning-gym's full entry (for its verifier) next to the prompt and answer.

# %%
config = load_config(CONFIG)
if __name__ == "__main__":
    for row in reasoning_gym_dataset(config.data.reasoning_gym, size=4, seed=0):
        print(f"[{row['task']}] ...{row['prompt'][-60:]!r} -> {row['answer']!r}")

# %% [markdown]
# ## Warm start, then RL
#
# `run_fit` checks every input, learns a character tokenizer from the training rows, runs the
# SFT warm start (cached), evaluates, trains, and evaluates again every `rl.eval.every`
# iterations with the task's verifier.
#
# The generator and reward workers are **spawned** processes, which first import the script that
# started them; run as a plain `python` script, the cells that start them (and what uses their
# results) sit under `if __name__ == "__main__":` (always true in Jupyter).

# %%
if __name__ == "__main__":
    config.output_dir = str(OUT / "07_run")
    if SMALL:  # a quick pass through every stage
        config.data.n_train, config.data.n_heldout, config.sft.steps = 128, 32, 30
        config.rl.iterations, config.rl.prompts_per_iteration = 3, 8
        config.rl.eval = EvalSchedule(every=1)
    summary = run_fit(config, show_progress=not SMALL)
    before, after = summary["heldout_by_task_before"], summary["heldout_by_task_after"]
    print(json.dumps({k: summary[k] for k in ("heldout_reward_before", "heldout_reward_after")}))

# %% [markdown]
# ## Held-out reward per task, and the training reward
#
# Left: the held-out mean score of each task's verifier (greedy decoding) before and after RL.
# Right: the mean reward of each iteration's samples (temperature 1).

# %%
if __name__ == "__main__":
    with next(Path(config.output_dir).rglob("metrics.csv")).open() as f:
        train_reward = [
            float(r["rollout/reward"]) for r in csv.DictReader(f) if r["rollout/reward"]
        ]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    tasks = sorted(after)
    x = range(len(tasks))
    ax1.bar([i - 0.2 for i in x], [before[t]["reward"] for t in tasks], 0.4, label="warm start")
    ax1.bar([i + 0.2 for i in x], [after[t]["reward"] for t in tasks], 0.4, label="after RL")
    ax1.set_xticks(list(x), tasks)
    ax1.set_ylabel("held-out reward (verifier)")
    ax1.legend()
    ax2.plot(train_reward)
    ax2.set_xlabel("iteration")
    ax2.set_ylabel("rollout reward")
    fig.tight_layout()
    fig.savefig(OUT / "07_reasoning_gym.png", dpi=120)
