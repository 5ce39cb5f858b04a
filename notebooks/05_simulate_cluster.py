# %% [markdown]
# # 05 · Simulate a 64-GPU cluster and plan its split
#
# **What it shows.** Disaggregation means choosing how many GPUs generate and how many train.
# We take the paper's Qwen2.5-32B setup (64 H800s, outputs up to 20K tokens, 1024 samples per
# iteration), let `ResourceAllocator` (Algorithm 1) pick the split from latency and cost
# models, look at every split it considered, then run the discrete-event simulator
# (`streamrl.sim`) on colocated, sync and one-step async runs of that cluster.
#
# Nothing here runs a model: the simulator replays continuous batching with `PTL(BS)` scaled
# from the paper's Fig. 6 and prices training from FLOPs (assumptions listed in
# `docs/simulator.md`), so it takes seconds on a laptop.
#
# **Paper.** StreamRL, arXiv 2504.15930, §4.2 (Algorithm 1, resource allocation), §7 (the 32B
# setup, Table 3, Fig. 10).
#
# **Run it.** In Jupyter or `python notebooks/05_simulate_cluster.py`;
# `STREAMRL_NOTEBOOK_BUDGET=small` for the short version, figures in `$STREAMRL_NOTEBOOK_OUT`
# (default `notebooks/out/`).

# %%
import matplotlib.pyplot as plt
import numpy as np

from streamrl.components.capacity.allocator import ResourceAllocator
from streamrl.run.notebook import notebook_settings
from streamrl.sim.engine import simulate
from streamrl.sim.hardware import H800, QWEN25, decode_latency, kv_batch_limit, trainer_cost
from streamrl.sim.presets import PAPER_BATCH, PAPER_PROMPT_TOKENS, paper_config, paper_lengths
from streamrl.training.timeline_chart import draw_timeline

SMALL, OUT = notebook_settings()  # STREAMRL_NOTEBOOK_BUDGET=small|full, STREAMRL_NOTEBOOK_OUT
ITERATIONS = 2 if SMALL else 4  # measured simulated iterations (after one warm-up)

# %% [markdown]
# ## The cluster and the workload
#
# - **Model**: Qwen2.5-32B; a generator instance spans 2 GPUs (tensor parallel), a trainer
#   unit 8 GPUs.
# - **Decode latency** `PTL(BS)`: the paper's 7B/H800 table scaled to 32B on 2 GPUs.
# - **Batch cap**: what the KV cache holds at the full context (prompt + the longest output),
#   as the paper presets reserve it: an engine that never preempts.
# - **Lengths**: 1024 outputs shaped like the paper's CodeMath set (a peak near 2.5K tokens
#   and a flat tail out to 20K).

# %%
GPUS = 64
model = QWEN25["32b"]
lengths = paper_lengths(PAPER_BATCH, max_len=20_000, seed=0)
latency = decode_latency(model, H800)
max_batch = kv_batch_limit(model, H800, PAPER_PROMPT_TOKENS + max(lengths))
cost = trainer_cost(model, H800)
print(
    f"{model.name}: generator TP {model.gen_tp}, trainer unit {model.train_unit_gpus} GPUs, "
    f"batch cap {max_batch} per instance"
)
print(
    f"PTL(1) {latency.ptl(1) * 1e3:.1f} ms, PTL({max_batch}) {latency.ptl(max_batch) * 1e3:.1f}"
    f" ms per token; lengths median {np.median(lengths):.0f}, max {max(lengths)} tokens"
)

# %% [markdown]
# ## Plan the split (Algorithm 1)
#
# In async mode an iteration lasts as long as the slower stage, `max(T_gen, T_train)`; the
# allocator enumerates every split (generator GPUs a multiple of the TP degree, trainer GPUs a
# multiple of the unit) and keeps the fastest, breaking ties towards fewer generator GPUs.

# %%
allocator = ResourceAllocator(latency, cost, model.gen_tp, max_batch, mode="async")
plan = allocator.plan(GPUS, lengths, PAPER_PROMPT_TOKENS)
even = allocator.evaluate(GPUS // 2, GPUS // 2, lengths, PAPER_PROMPT_TOKENS)
print(f"{'':<12}{'gen GPUs':>9}{'train GPUs':>11}{'T_gen s':>9}{'T_train s':>10}{'iter s':>8}")
rows = [("plan", plan), ("even split", even)]
rows += [(f"runner-up {i + 1}", alt) for i, alt in enumerate(plan.alternatives)]
for name, p in rows:
    print(
        f"{name:<12}{p.gen_gpus:>9}{p.train_gpus:>11}{p.gen_s:>9.1f}{p.train_s:>10.1f}"
        f"{p.iteration_s:>8.1f}"
    )
print(
    f"predicted speed-up of the plan over the even split: "
    f"{even.iteration_s / plan.iteration_s:.2f}x"
)

# Every split it weighed, for the plot below.
sweep = [
    allocator.evaluate(
        x, (GPUS - x) // cost.unit_gpus * cost.unit_gpus, lengths, PAPER_PROMPT_TOKENS
    )
    for x in range(model.gen_tp, GPUS, model.gen_tp)
    if GPUS - x >= cost.unit_gpus
]

# %% [markdown]
# ## Simulate the cluster
#
# The same 64 GPUs three ways (the paper's Table 3 rows): colocated (every GPU does both
# stages, one after the other), disaggregated sync (split by the allocator's sync objective)
# and one-step async (the plan above). Skew-aware dispatch and LPT are on in all three.

# %%
results, configs = {}, {}
for mode in ("colocated", "sync", "async"):
    if mode == "async":  # the split planned above
        gen, train = plan.gen_gpus, plan.train_gpus
        configs[mode] = paper_config("paper-32b-20k", mode, gen, train, iterations=ITERATIONS)
    else:  # colocated uses all 64 for both; sync asks the allocator with its own objective
        configs[mode] = paper_config("paper-32b-20k", mode, iterations=ITERATIONS)
    results[mode] = simulate(configs[mode])
base = results["colocated"].samples_per_s
for mode, r in results.items():
    labels = configs[mode].labels
    print(
        f"{mode:<10} GPUs gen/train {labels['gen_gpus']:>2}/{labels['train_gpus']:<2}  "
        f"{r.samples_per_s:5.2f} samples/s ({r.samples_per_s / base:.2f}x)  iteration "
        f"{r.iteration_s:6.1f} s  trainer idle {r.trainer_idle_frac:5.1%}  generator idle "
        f"{r.generator_idle_frac:5.1%}"
    )

# %% [markdown]
# Async's generator idle share is inflated by the end of the run: its last iteration was
# generated during the one before, and nothing is left to generate while it trains.
#
# ## Plot
#
# Left: predicted stage times of every split; the plan sits where generation and training
# balance. Right: simulated throughput of the three modes.

# %%
fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
gen_gpus = [p.gen_gpus for p in sweep]
left.plot(gen_gpus, [p.gen_s for p in sweep], label="T_gen (generation)")
left.plot(gen_gpus, [p.train_s for p in sweep], label="T_train (training)")
left.plot(gen_gpus, [p.iteration_s for p in sweep], "k--", label="iteration = max")
left.axvline(plan.gen_gpus, color="0.5", linewidth=1)
left.annotate(
    f"plan {plan.gen_gpus}/{plan.train_gpus}",
    (plan.gen_gpus, plan.iteration_s),
    xytext=(6, 12),
    textcoords="offset points",
)
left.set_xlabel(f"generator GPUs (trainer gets the rest of {GPUS})")
left.set_ylabel("seconds per iteration (predicted)")
left.set_ylim(0, 3 * plan.iteration_s)
left.legend()
left.set_title("Algorithm 1 on Qwen2.5-32B, 20K outputs")
modes = list(results)
bars = right.bar(modes, [results[m].samples_per_s for m in modes], color=["0.6", "C0", "C2"])
right.bar_label(bars, labels=[f"{results[m].samples_per_s / base:.2f}x" for m in modes])
right.set_ylabel("samples/s (simulated)")
right.set_title(f"{GPUS} H800s: colocated vs disaggregated")
fig.tight_layout()
fig.savefig(OUT / "05_cluster.png", dpi=120)
plt.show()

# The async run's simulated timeline, drawn by the same code as a real run's.
draw_timeline(
    results["async"].trace.spans,
    OUT / "05_timeline_async.png",
    title=f"simulated async, {plan.gen_gpus}/{plan.train_gpus} GPUs",
)
print(f"figures: {OUT / '05_cluster.png'}, {OUT / '05_timeline_async.png'}")
