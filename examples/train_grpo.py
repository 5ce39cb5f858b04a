"""Disaggregated streaming GRPO: every StreamRL mechanism named in one config, run on a CPU by the
recipe `streamrl fit` runs (streamrl/run/recipe.py: read it to see each component built).

Run: python examples/train_grpo.py [--iterations 30] [--model LOCAL_HF_MODEL_DIR]"""

import argparse

import streamrl as sr
from streamrl.run.reruns import fresh_output_dir

if __name__ == "__main__":  # generator instances are spawned processes: keep this guard
    cli = argparse.ArgumentParser()
    cli.add_argument("--iterations", type=int, default=30)
    cli.add_argument("--prompts", type=int, default=16, help="prompts per iteration")
    cli.add_argument("--sft-steps", type=int, default=1800, help="SFT warm start (cached)")
    cli.add_argument("--heldout", type=int, default=256, help="held-out prompts, before/after")
    cli.add_argument("--model", default="tiny", help="a local Hugging Face model directory")
    cli.add_argument("--output-dir", default="runs/train_grpo")
    args = cli.parse_args()
    config = sr.load_config(  # the YAML layout (configs/demo.yaml), checked before any work
        {
            "model": args.model,  # tiny: the built-in ~1M-parameter policy, warm-started
            "output_dir": str(fresh_output_dir(args.output_dir)),  # -2, -3...: a fresh one
            "data": {"n_heldout": args.heldout},
            "sft": {"steps": args.sft_steps},
            "rl": {
                "algorithm": {"class_path": "grpo", "init_args": {"clip_eps": 0.2}},
                "iterations": args.iterations,
                "prompts_per_iteration": args.prompts,
                "group_size": 4,
                "module": {"mode": "async"},  # §4.1: one-step async, weight transfer overlapped
                # §3: each finished sample streams to the trainer the moment it completes
                "generation": {"num_instances": 2, "max_batch_size": 32, "temperature": 0.7},
                "dispatcher": "skew",  # Algorithm 2 on predicted lengths and measured PTL, §5.3
                "scheduler": "lpt",  # longest predicted first inside each instance, §5.3
                "length_predictor": "ranker",  # §5.2: learns the policy's own output lengths
                "rollouts": {"max_tokens": 64},
                "reward": "partial",
            },
        }
    )
    summary = sr.run_fit(config)  # also <output_dir>/summary.json, timeline.png, policy/
    rewards = summary["reward_per_iteration"]
    print(
        f"held-out accuracy {summary['heldout_acc_before']:.3f} -> "
        f"{summary['heldout_acc_after']:.3f}; reward first {rewards[0]:.3f} last "
        f"{rewards[-1]:.3f} ({len(rewards)} iterations)"
    )
