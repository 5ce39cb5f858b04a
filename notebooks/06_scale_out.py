# %% [markdown]
# # 06 · Past one machine: Ray actors, a remote site, FSDP trainer ranks
#
# **What it shows.** The same generation service and training loop, grown with one setting
# each. First, generator instances as Ray actors on a (local) Ray cluster, one of them at a
# remote "cloud" site: the trainer sends one copy of the weights per version to that site and
# the site's first instance fans it out. Then two FSDP2 trainer ranks sharing the policy, fed
# micro-batch by micro-batch from one sample stream, against one rank on the same samples.
#
# **Paper.** StreamRL, arXiv 2504.15930, §3 (stream generation service on its own resources),
# §6 (weight transfer across datacenters: one transfer over the link, local fan-out).
#
# **Run it.** In Jupyter or `python notebooks/06_scale_out.py` (needs the `[ray]` extra);
# `STREAMRL_NOTEBOOK_BUDGET=small` for the short version, figures in `$STREAMRL_NOTEBOOK_OUT`
# (default `notebooks/out/`). On a real cluster set `RAY_ADDRESS` and pass a model directory
# every node can read.

# %%
import os
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import torch

from streamrl.components.generation.ray_instance import RayOptions
from streamrl.components.generation.service import StreamGenerationService
from streamrl.components.generation.worker import fingerprint
from streamrl.policy.models import build_tiny_model, build_tokenizer, load_policy, save_policy
from streamrl.records import Request
from streamrl.run.config import RunConfig
from streamrl.run.notebook import notebook_settings
from streamrl.run.recipe import run_fit

SMALL, OUT = notebook_settings()  # STREAMRL_NOTEBOOK_BUDGET=small|full, STREAMRL_NOTEBOOK_OUT
UPDATES = 2 if SMALL else 5  # weight versions pushed to the Ray-hosted service

# %% [markdown]
# ## Three Ray actors, two sites
#
# `cluster="ray"` makes every instance a Ray actor in a placement group of its own (a local
# cluster here: 2 CPUs, no dashboard, its files under a temporary folder). `sites` puts one
# instance beside the trainer ("home") and two in "cloud". Each update is announced to every
# instance, but the bytes leave the trainer only for "home" and for the cloud site's head.
# (Spawned processes import this script, hence the `__main__` guards.)

# %%
if __name__ == "__main__":
    tokenizer = build_tokenizer()
    policy = build_tiny_model(tokenizer, "test", seed=0)
    scratch = Path(tempfile.mkdtemp(prefix="streamrl-scale-"))
    model_dir = save_policy(policy, tokenizer, scratch / "policy")
    payload = sum(p.numel() * p.element_size() for p in policy.parameters())
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # one machine, loopback only
    ray = RayOptions(num_cpus=2, cpus_per_instance=0.5, temp_dir=str(scratch / "ray"))
    service = StreamGenerationService(
        model_dir,
        3,
        max_batch_size=8,
        cluster="ray",
        ray=ray,
        sites=["home", "cloud", "cloud"],
        trainer_site="home",
    )
    sent, ids = [], tokenizer("copy abc=")["input_ids"]
    with service:
        for version in range(1, UPDATES + 1):
            with torch.no_grad():
                for p in policy.parameters():
                    p.add_(0.01 * torch.randn_like(p))
            service.update(policy, version)
            requests = [
                Request(
                    f"v{version}p{i}",
                    ids,
                    max_tokens=16,
                    iteration=version,
                    forced_length=4 + 2 * i,
                )
                for i in range(6)
            ]
            samples = list(service.generate(requests))
            assert {s.weight_version for s in samples} == {version}
            sent.append(service.weight_sync.bytes_sent)
        same = set(service.fingerprints().values()) == {fingerprint(policy)}
        roles = {
            h.instance_id: (
                h.site,
                "head" if h.members else "member" if h.head is not None else "direct",
            )
            for h in service.pool.handles
        }
    print(f"instances: {roles}; every instance holds the trainer's weights: {same}")
    print(
        f"bytes sent by the trainer after {UPDATES} updates: {sent[-1]:,} "
        f"(= {sent[-1] / payload:.0f} copies of {payload:,} B; one per instance would be "
        f"{3 * UPDATES})"
    )

# %%
if __name__ == "__main__":
    versions = range(1, UPDATES + 1)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(versions, [b / 1e6 for b in sent], "o-", label="sites: one copy per site")
    ax.plot(
        versions, [3 * v * payload / 1e6 for v in versions], "s--", label="one copy per instance"
    )
    ax.set_xticks(list(versions))
    ax.set_xlabel("weight version")
    ax.set_ylabel("MB sent by the trainer (cumulative)")
    ax.set_title("Weights leaving the trainer: 1 home + 2 cloud instances")
    ax.legend()
    fig.tight_layout()
    fig.savefig(OUT / "06_weight_bytes.png", dpi=120)
    plt.show()

# %% [markdown]
# ## Two FSDP2 trainer ranks
#
# `trainer.devices: 2` spawns a second trainer process; both shard the policy with FSDP2, and
# rank 0 (this process, which owns the generation service) deals each micro-batch of the stream
# to both as it forms. One iteration on one generator gives both runs the very same samples, so
# their updates must agree to float rounding.

# %%
if __name__ == "__main__":
    trained = {}
    for ranks in (1, 2):
        config = RunConfig(output_dir=str(scratch / f"fit{ranks}"))
        config.data.n_train, config.data.n_heldout = 32, 8
        config.sft.model_size, config.sft.steps = "test", 20
        rl = config.rl
        rl.iterations, rl.prompts_per_iteration, rl.group_size = 1, 6, 2
        rl.generation, rl.rollouts = {"num_instances": 1}, {"max_tokens": 12}
        rl.reward = "partial"
        config.trainer.devices = ranks
        summary = run_fit(config, show_progress=False)
        trained[ranks] = dict(load_policy(summary["policy_dir"])[0].named_parameters())
        start = dict(load_policy(summary["model_dir"])[0].named_parameters())
    gap = {n: (trained[2][n] - trained[1][n]).abs().max().item() for n in trained[1]}
    moved = {n: (trained[1][n] - start[n]).abs().max().item() for n in trained[1]}
    print(
        f"largest difference, 2 ranks vs 1: {max(gap.values()):.1e} "
        f"(largest step of a weight: {max(moved.values()):.1e})"
    )

# %%
if __name__ == "__main__":
    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = list(gap)
    ax.semilogy(range(len(names)), [max(moved[n], 1e-12) for n in names], "o", label="step")
    ax.semilogy(
        range(len(names)), [max(gap[n], 1e-12) for n in names], "x", label="2 ranks - 1 rank"
    )
    ax.set_xlabel("parameter tensor")
    ax.set_ylabel("largest |difference| (0 drawn at 1e-12)")
    ax.set_title("FSDP2 on 2 ranks trains like 1 rank")
    ax.legend()
    fig.tight_layout()
    fig.savefig(OUT / "06_fsdp.png", dpi=120)
    plt.show()

# %% [markdown]
# ## Reading the numbers
#
# - The trainer's bytes grow by two payloads per version (home, cloud head), not three: the
#   cloud member receives from its head. With many instances per remote site, the saving on the
#   link is one copy per site instead of one per instance (`docs/weight_transfer.md`).
# - The two-rank update equals the one-rank update to about 1e-7, a thousand times below the
#   size of a step: sharding changes where the weights live, not what is learned.
# - On one CPU the second rank only adds traffic; FSDP pays when the policy does not fit one
#   device. `docs/engines.md` lists what runs where, and `scripts/gpu_check.sh` the GPU check.
