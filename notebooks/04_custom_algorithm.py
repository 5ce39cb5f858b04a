# %% [markdown]
# # 04 · Write your own algorithm: REINFORCE with a moving-average baseline
#
# **What it shows.** An RL algorithm in streamrl is a small class whose hooks follow RL timing:
# `score_sample` when a sample's reward arrives (to shape it), `score_group` when a prompt's
# last sample arrives (advantages), `token_loss` when the trainer reaches a micro-batch. We write
# REINFORCE (Williams 1992) whose baseline is an exponential moving average of past rewards,
# check it by hand, and train the tiny model with it in the real streamed loop for a few
# iterations.
#
# Because groups are scored the moment they complete, an algorithm sees the stream in arrival
# order: a running baseline is natural here, whereas whole-batch statistics would reintroduce
# the batch barrier that streaming removes.
#
# **Paper.** StreamRL, arXiv 2504.15930, §4.1 (groups scored and trained as they stream in);
# the paper trains PPO (§7), and the algorithm is a plug-in of the framework. The hook table is
# in `docs/algorithms.md`.
#
# **Run it.** In Jupyter or `python notebooks/04_custom_algorithm.py`;
# `STREAMRL_NOTEBOOK_BUDGET=small` for the short version, figures in `$STREAMRL_NOTEBOOK_OUT`
# (default `notebooks/out/`).

# %%
import math
from collections.abc import Sequence
from pathlib import Path

import matplotlib.pyplot as plt
import torch

from streamrl import load_config, run_fit
from streamrl.algorithms import Algorithm, LossInputs, TokenLoss
from streamrl.run.notebook import notebook_settings
from streamrl.run.reruns import fresh_output_dir

SMALL, OUT = notebook_settings()  # STREAMRL_NOTEBOOK_BUDGET=small|full, STREAMRL_NOTEBOOK_OUT

# %% [markdown]
# ## The algorithm
#
# Two hooks and the running state:
#
# - `score_group`: advantage = reward - baseline, where the baseline has seen only earlier
#   groups (so it does not depend on the sample it judges); then the baseline moves towards
#   this group's mean reward;
# - `token_loss`: the policy gradient `-A * log pi(token)`, per token. That is all it returns:
#   the base's `loss` (which no algorithm overrides) masks the padding, averages over each
#   sample's tokens and, in one-step async mode, multiplies by the truncated importance weights
#   of stale samples (`batch.token_weights`), so no algorithm can forget them.
#
# `state_dict` / `load_state_dict` put the baseline (and its history, for the plot) into
# Lightning checkpoints, so a resumed run continues with it. `score_sample` is inherited: the
# task reward, computed by the run's reward functions (here `partial`, `rl.reward`), unchanged.
# The base's constructor stores and checks `group_size` (and `clip_eps`, `kl_coef`, unused
# here).


# %%
class MovingAverageReinforce(Algorithm):
    """REINFORCE whose baseline is an exponential moving average of group mean rewards.

    Args:
        group_size: samples per prompt.
        decay: how much of the old baseline each group keeps (0.9: about 10 groups' memory).
    """

    def __init__(self, *, group_size: int = 4, decay: float = 0.9) -> None:
        super().__init__(group_size=group_size)
        self.decay = decay
        self.baseline = 0.0
        self.baselines: list[float] = []  # the baseline after each group, for the plot

    def score_group(self, rewards: Sequence[float]) -> list[float]:
        advantages = [r - self.baseline for r in rewards]
        mean = sum(rewards) / len(rewards)
        self.baseline = self.decay * self.baseline + (1 - self.decay) * mean
        self.baselines.append(self.baseline)
        return advantages

    def token_loss(self, batch: LossInputs) -> TokenLoss:
        return TokenLoss(policy=-batch.advantages[:, None] * batch.logprobs)  # [batch, seq]

    def state_dict(self) -> dict:
        return {"baseline": self.baseline, "baselines": list(self.baselines)}

    def load_state_dict(self, state: dict) -> None:
        self.baseline = float(state["baseline"])
        self.baselines = list(state.get("baselines", []))


# %% [markdown]
# ## Checked by hand
#
# With `decay = 0.5`: the first group `[1, 0]` meets a baseline of 0, so its advantages are the
# rewards; the baseline becomes `0.5 * 0 + 0.5 * 0.5 = 0.25`, and the same rewards again get
# `[0.75, -0.25]`. For the loss, one sample with advantage 1 whose two tokens each had
# probability 0.5 costs `-(log 0.5 + log 0.5) / 2 = 0.693`; a padded third token changes nothing.
# Had the sample been stale with token weights `[1.5, 0.5]`, the base would make it
# `-(1.5 log 0.5 + 0.5 log 0.5) / 2 = 0.693` too, with the first token's gradient 3x the second's.

# %%
check = MovingAverageReinforce(group_size=2, decay=0.5)
assert check.score_group([1.0, 0.0]) == [1.0, 0.0]
assert check.score_group([1.0, 0.0]) == [0.75, -0.25]
half = math.log(0.5)
batch = LossInputs(
    logprobs=torch.tensor([[half, half, -9.0]], requires_grad=True),  # [batch=1, seq=3]
    old_logprobs=torch.tensor([[half, half, 0.0]]),
    advantages=torch.tensor([1.0]),
    mask=torch.tensor([[1, 1, 0]]),
)
loss = check.loss(batch)
assert abs(loss.item() - 0.6931) < 1e-4
loss.sum().backward()  # the gradient reaches the log-probs of real tokens only
print("hand checks pass; d loss / d logprobs =", batch.logprobs.grad.tolist())
batch.logprobs.grad = None
batch.token_weights = torch.tensor([[1.5, 0.5, 4.0]])  # as the async trainer would set them
check.loss(batch).sum().backward()  # token_loss never saw the weights; the base applied them
assert torch.allclose(batch.logprobs.grad, torch.tensor([[-0.75, -0.25, 0.0]]))

# %% [markdown]
# ## Train with it
#
# Exactly the quickstart's run with `MovingAverageReinforce` where GRPO was: `rl.algorithm`
# takes the class itself as its `class_path` and its own constructor arguments as `init_args`
# (`group_size` is linked in from `rl.group_size` by `Algorithm.from_run`). The service, the
# rollout stream and the LightningModule do not change, and scoring and loss come from this one
# object. A class of the notebook (or script) is built in this process only; with several
# trainer ranks, put it in a module and give its import path, `package.module.Name`, as a YAML
# config would. (Generator instances are spawned processes; under `python`, the cells that start
# them sit under `if __name__ == "__main__":` because a spawned process imports the script that
# started it.)

# %%
ITERATIONS, PROMPTS = (3, 8) if SMALL else (30, 16)
if __name__ == "__main__":  # a spawned generator process imports this file
    config = load_config(
        {
            "model": "tiny",
            "output_dir": str(fresh_output_dir(OUT / "04_run")),
            "data": {"n_heldout": 16} if SMALL else {},
            "sft": {"steps": 40} if SMALL else {},  # full: the demo's warm start
            "rl": {
                "algorithm": {"class_path": MovingAverageReinforce, "init_args": {"decay": 0.9}},
                "iterations": ITERATIONS,
                "prompts_per_iteration": PROMPTS,
                "group_size": 4,
                "generation": {"num_instances": 2, "temperature": 0.7},
                "module": {"lr": 1e-4},
                "rollouts": {"max_tokens": 64},
                "reward": "partial",
            },
        }
    )
    print(config.rl.algorithm)
    summary = run_fit(config, show_progress=not SMALL)
    rewards = summary["reward_per_iteration"]
    # The algorithm's state_dict went into the run's checkpoint, as a resumed run reads it.
    checkpoint = torch.load(Path(config.output_dir, "checkpoints", "last.ckpt"), weights_only=False)
    state = checkpoint["streamrl"]["algorithm"]
    print(
        f"{summary['algorithm']['name']}: reward first {rewards[0]:.3f} last {rewards[-1]:.3f}; "
        f"baseline now {state['baseline']:.3f} after {len(state['baselines'])} groups"
    )

# %% [markdown]
# The baseline trails the reward: it starts at 0 and follows the groups' mean rewards as they
# stream in (one point per group on the right, one per iteration on the left).

# %%
if __name__ == "__main__":
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
    left.plot(rewards, marker="o")
    left.set_xlabel("iteration")
    left.set_ylabel("mean reward")
    left.set_title("MovingAverageReinforce: reward per iteration")
    right.plot(state["baselines"])
    right.set_xlabel("group (in arrival order)")
    right.set_ylabel("baseline")
    right.set_title("the moving-average baseline")
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(OUT / "04_custom_algorithm.png", dpi=120)
    plt.show()
    print(f"figure: {OUT / '04_custom_algorithm.png'}")
