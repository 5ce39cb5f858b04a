# %% [markdown]
# # 03 · The long tail: length ranker and skewness-aware dispatch
#
# **What it shows.** When output lengths are long-tailed, a few long samples keep generation
# running while the rest of the hardware idles ("skewness bubbles"). StreamRL attacks them in
# two steps, and this notebook measures both:
#
# 1. a **length ranker** predicts which prompts will get long answers; what matters is the
#    order, so we score it with recall@k (how many of the true top-k% longest it finds) and
#    Kendall's tau;
# 2. **skewness-aware dispatch** (Algorithm 2) sends the predicted long tail to instances of
#    its own, and **LPT** admits the longest request first into each free batch slot. We
#    compare the generation makespan of random dispatch, skew-aware dispatch on predicted
#    lengths, and an oracle that knows the true lengths, with the simulated
#    `streamrl bench dispatch --simulate` (continuous batching replayed with the paper's
#    7B/H800 per-token latency table, no model runs).
#
# **Paper.** StreamRL, arXiv 2504.15930, §5.2 (ranker, Table 4) and §5.3 (Algorithm 2, LPT,
# Fig. 9). Measured numbers: `docs/skewness.md`.
#
# **Run it.** In Jupyter or `python notebooks/03_long_tail.py`;
# `STREAMRL_NOTEBOOK_BUDGET=small` for the short version, figures in `$STREAMRL_NOTEBOOK_OUT`
# (default `notebooks/out/`).

# %%
import json

import matplotlib.pyplot as plt
import numpy as np
import torch

from streamrl.bench.dispatch import bench_dispatch
from streamrl.bench.settings import DispatchBench
from streamrl.components.skewness.ranker import LengthRanker
from streamrl.components.skewness.ranking_metrics import kendall_tau, recall_at_k
from streamrl.run.notebook import notebook_settings
from streamrl.sim.moves import simulate_generation
from streamrl.tasks import make_prompt_set

SMALL, OUT = notebook_settings()  # STREAMRL_NOTEBOOK_BUDGET=small|full, STREAMRL_NOTEBOOK_OUT
torch.set_num_threads(1)

# %% [markdown]
# ## 1. The length ranker
#
# Prompts come from the built-in task families (`copy`, `rev`, `count`, `sort`) with
# long-tailed answer lengths. Here the length to rank is the reference answer's (what a good
# policy writes); in the RL loop the ranker is refreshed on the policy's own output lengths as
# they drift, and `streamrl bench ranker --from-policy DIR` measures that case.
#
# We train on a seeded 80% of the prompts and score the held-out 20%.

# %%
prompts = make_prompt_set(1500 if SMALL else 3000, median_len=6, max_len=48, seed=0)
texts, lengths = prompts["prompt"], prompts["answer_len"]
order = np.random.default_rng(0).permutation(len(texts))
cut = int(0.8 * len(texts))
train, test = order[:cut], order[cut:]

ranker = LengthRanker(epochs=300 if SMALL else 600, seed=0)
ranker.fit([texts[i] for i in train], [lengths[i] for i in train])
predicted = ranker.predict([texts[i] for i in test])
true = [lengths[i] for i in test]

quality = {f"recall@{k}": recall_at_k(predicted, true, k / 100) for k in (20, 10, 5)}
quality["kendall_tau"] = kendall_tau(predicted, true)
print(f"trained in {ranker.train_s:.1f} s on {len(train)} prompts; on {len(test)} held out:")
print(", ".join(f"{name} {value:.3f}" for name, value in quality.items()))
for i in np.argsort(predicted)[-3:][::-1]:  # the three prompts it ranks longest
    print(f"  predicted {predicted[i]:5.1f}  true {true[i]:3d}  {texts[test[i]]!r}")

# %% [markdown]
# Predicted against true lengths: the ranker need not get a length right, only the order
# (the paper's "rankability over predictability").

# %%
fig, ax = plt.subplots(figsize=(5, 4))
ax.scatter(true, predicted, s=8, alpha=0.5)
top = max(true)
ax.plot([1, top], [1, top], color="0.5", linestyle="--", linewidth=1)
ax.set_xscale("log")
ax.set_yscale("log")
ax.set_xlabel("true answer length (tokens)")
ax.set_ylabel("predicted length")
ax.set_title(
    f"LengthRanker: recall@20 {quality['recall@20']:.2f}, tau {quality['kendall_tau']:.2f}"
)
fig.tight_layout()
fig.savefig(OUT / "03_ranker.png", dpi=120)
plt.show()

# %% [markdown]
# ## 2. Dispatch policies
#
# `bench_dispatch` is the function behind `streamrl bench dispatch`; its settings,
# `DispatchBench`, are the command line's. With `simulate=True` it replays continuous batching
# with a latency model instead of running generators (the simulator's `simulate_generation`):
#
# - `random`: each prompt to a random instance, FIFO admission (the baseline; mean of 20 draws);
# - `skew`: Algorithm 2 + LPT on the lengths **our `LengthRanker` predicts** from each prompt's
#   text, trained on an earlier draw (never on the batch it dispatches); the P50/P90 that size
#   the tail pool come from that earlier draw too;
# - `skew_noisy`: the same on a stand-in, the true lengths times log-normal noise of sigma 0.25;
# - `oracle`: the same on the true lengths: the only policy that sees them.
#
# Lengths come from the shipped long-tailed file (512 prompts, median 22.5, max 200 tokens).
# Dispatch pays when an instance holds more than a batch's worth of work, so we also try more
# prompts per iteration.


# %%
def dispatch(instances: int, prompts: int | None = None, **overrides) -> dict:
    """Simulated makespans of random / skew / oracle dispatch (``bench dispatch --simulate``)."""
    settings = {
        "predictions": "ranker,noisy",  # the headline skew row, then the noisy stand-in
        "simulate": True,
        "latency": "paper-7b-h800",
        "prompts": prompts,
        "instances": instances,
        "repeats": 1,
    }
    chosen = DispatchBench(**{**settings, **overrides})
    return bench_dispatch(chosen, simulator=simulate_generation)


settings = [(2, None), (8, None)] if SMALL else [(2, None), (8, None), (8, 4096), (32, 4096)]
makespans = {}
for instances, count in settings:
    label = f"{instances} inst., {count or 512} prompts"
    result = dispatch(instances, count)
    makespans[label] = result["makespan_s"]
    ratio = result["ratio_to_random"]
    print(
        f"{label:<24} skew/random {ratio['skew']:.3f} (noisy stand-in {ratio['skew_noisy']:.3f})"
        f"  oracle/random {ratio['oracle']:.3f}"
    )

# %% [markdown]
# The two halves together: dispatch the held-out task prompts by **our ranker's** predictions
# (not noise). Their answers are short (median 6 tokens), so there is less tail to remove.

# %%
true_file, predicted_file = OUT / "03_true_lengths.json", OUT / "03_predicted_lengths.json"
true_file.write_text(json.dumps(true))
predicted_file.write_text(json.dumps([max(1, round(p)) for p in predicted]))
result = dispatch(
    2,
    None,
    lengths=str(true_file),
    predicted=str(predicted_file),
    predictions="file",
    max_batch_size=8,
)
makespans[f"2 inst., {len(true)} task prompts, our ranker"] = result["makespan_s"]
print(f"our ranker: makespan s {result['makespan_s']}, recall@20 {result['recall@20']:.3f}")

# %% [markdown]
# Makespan of each policy relative to random dispatch (lower is better).

# %%
labels = list(makespans)
policies = ("random", "skew", "oracle")
x = np.arange(len(labels))
fig, ax = plt.subplots(figsize=(1.9 * len(labels) + 2, 4))
for j, policy in enumerate(policies):
    ratios = [makespans[label][policy] / makespans[label]["random"] for label in labels]
    bars = ax.bar(x + (j - 1) * 0.27, ratios, width=0.27, label=policy)
    ax.bar_label(bars, fmt="%.2f", fontsize=7)
ax.set_xticks(x, [label.replace(", ", "\n") for label in labels], fontsize=8)
ax.set_ylabel("generation makespan / random")
ax.set_ylim(0, 1.3)
ax.legend(ncol=3, loc="upper center")
ax.set_title("Skewness-aware dispatch + LPT vs random (simulated, paper 7B/H800 PTL)")
fig.tight_layout()
fig.savefig(OUT / "03_dispatch.png", dpi=120)
plt.show()
print(f"figures: {OUT / '03_ranker.png'}, {OUT / '03_dispatch.png'}")
