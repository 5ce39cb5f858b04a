# %% [markdown]
# # 08 · Multi-turn episodes: a tool the policy must use, and a game
#
# **What it shows.** RL on episodes instead of single completions. Each sample is an episode: a
# fresh environment is reset from a dataset row, the policy takes a turn, the environment answers
# (a tool's result, a game's new state), and so on until it is done. Two built-in tasks:
# `calculator` (products of two 3-digit numbers, which a ~1M-parameter policy cannot compute,
# with a `multiply` tool it can call) and `blackjack` (gymnasium's game as text). The tiny policy
# is warm-started on demonstrated episodes, then GRPO (one-step async) raises its held-out
# success. We also look inside one episode: which tokens the policy generated (trained on) and
# which the environment added (masked out of the loss).
#
# **Paper.** StreamRL, arXiv 2504.15930, §3 (stream generation: each episode streams to the
# trainer the moment it ends) and §5 (skewness: the long tail is made of episodes; the ranker
# learns their cost, the dispatcher spreads them). Multi-turn episodes go past the paper.
#
# **Run it.** In Jupyter or `python notebooks/08_episodes.py`; `STREAMRL_NOTEBOOK_BUDGET=small`
# for the short version, figures in `$STREAMRL_NOTEBOOK_OUT` (default `notebooks/out/`). The full
# budget is `configs/calculator.yaml` and `configs/blackjack.yaml` (docs/episodes.md has the
# measured figures and their commands).

# %%
import json

import matplotlib.pyplot as plt

from streamrl import load_config, load_policy, run_fit
from streamrl.envs.demos import demo_tokens
from streamrl.envs.tool_tasks import CalculatorEnv, calculator_demonstration, calculator_rows
from streamrl.eval.schedule import EvalSchedule
from streamrl.run.notebook import notebook_settings, repo_file

SMALL, OUT = notebook_settings()  # STREAMRL_NOTEBOOK_BUDGET=small|full, STREAMRL_NOTEBOOK_OUT
CONFIGS = repo_file("configs")  # from the repository root or notebooks/

# %% [markdown]
# ## Warm start, then RL, on both tasks
#
# `run_fit` with an `env:` section: it makes the task's rows, warm-starts the tiny policy on one
# demonstrated episode per row (cached), measures held-out success (greedy episodes), trains on
# streamed episodes, and measures again. The generator instances are spawned processes, so the
# cells that start them sit under `if __name__ == "__main__":` (always true in Jupyter).

# %%
summaries = {}
if __name__ == "__main__":
    for task in ("calculator", "blackjack"):
        config = load_config(CONFIGS / f"{task}.yaml")
        config.output_dir = str(OUT / f"08_{task}")
        if SMALL:  # a quick pass through every stage
            config.env.n_train, config.env.n_heldout = 64, 16
            config.sft.model_size, config.sft.steps = "test", 20
            config.rl.iterations, config.rl.prompts_per_iteration = 2, 4
            config.rl.eval = EvalSchedule(every=1)
        summaries[task] = run_fit(config, show_progress=not SMALL)
        keys = ("heldout_success_before", "heldout_success_after", "prefill_saved", "turns")
        print(task, json.dumps({k: summaries[task][k] for k in keys}))

# %% [markdown]
# ## Held-out success, and one episode's tokens
#
# Left: held-out success before and after RL. Right: a demonstrated calculator episode as the
# trainer sees it, one cell per token: the policy's own tokens (loss mask 1) in colour, the
# prompt and the tool's tokens grey. The tokens are appended turn by turn, never re-tokenized.

# %%
if __name__ == "__main__":
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.6), width_ratios=[1, 2])
    tasks = list(summaries)
    x = range(len(tasks))
    for shift, when in ((-0.2, "before"), (0.2, "after")):
        values = [summaries[t][f"heldout_success_{when}"] for t in tasks]
        ax1.bar(
            [i + shift for i in x],
            values,
            0.4,
            label="warm start" if when == "before" else "after RL",
        )
    ax1.set_xticks(list(x), tasks)
    ax1.set_ylabel("held-out success")
    ax1.legend()
    _, tokenizer = load_policy(summaries["calculator"]["model_dir"])
    row = calculator_rows(1, seed=5)[0]
    ids, labels = demo_tokens(row, CalculatorEnv(), calculator_demonstration(row), tokenizer)
    width = 24
    for i, label in enumerate(labels):
        color = "tab:blue" if label != -100 else "lightgrey"
        ax2.add_patch(plt.Rectangle((i % width, -(i // width)), 0.95, 0.9, color=color))
    ax2.set_xlim(0, width)
    ax2.set_ylim(-(len(ids) // width) - 1, 1)
    ax2.set_axis_off()
    ax2.set_title(f"one episode, {len(ids)} tokens: policy's (blue) vs prompt and tool (grey)")
    fig.tight_layout()
    fig.savefig(OUT / "08_episodes.png", dpi=120)
