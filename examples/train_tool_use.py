"""GRPO on multi-turn episodes: a tiny policy learns to use a calculator tool (docs/episodes.md);
configs/calculator.yaml in Python, run by the recipe `streamrl fit` runs (streamrl/run/recipe.py).

Run: python examples/train_tool_use.py [--iterations 60] [--sft-steps 800] [--rows 2000]"""

import argparse

import streamrl as sr
from streamrl.run.reruns import fresh_output_dir

if __name__ == "__main__":  # the generator instances are spawned processes
    cli = argparse.ArgumentParser()
    cli.add_argument("--iterations", type=int, default=60)
    cli.add_argument("--sft-steps", type=int, default=800)
    cli.add_argument("--rows", type=int, default=2000, help="training rows")
    cli.add_argument("--output-dir", default="runs/tool_use_example")
    args = cli.parse_args()
    config = sr.load_config(  # the YAML layout, checked before any work
        {
            "model": "tiny",  # ~1M parameters, a BPE learned from rendered episodes
            "output_dir": str(fresh_output_dir(args.output_dir)),
            # products of two 3-digit numbers and a `multiply` tool: call it, copy its result
            "env": {"name": "calculator", "max_turns": 3, "n_train": args.rows, "n_heldout": 100},
            "sft": {  # a warm start on demonstrated episodes, cached
                **{"model_size": "demo", "steps": args.sft_steps},
                **{"lr": 2e-3, "tokens_per_batch": 2048},
            },
            "rl": {
                "algorithm": "grpo",
                "iterations": args.iterations,
                "prompts_per_iteration": 16,
                "group_size": 8,
                "module": {"mode": "async", "lr": 1e-4},  # §4.1: one-step async
                "generation": {"num_instances": 1, "temperature": 1.0, "partial_rollout": "keep"},
                "reward_pool": {"workers": 0},  # each episode's reward is its environment's
                "rollouts": {"max_tokens": 40},  # per turn; env steps run off the decode loop
            },
        }
    )
    summary = sr.run_fit(config)  # held-out success before and after, in summary.json too
    print(
        f"held-out success {summary['heldout_success_before']:.3f} -> "
        f"{summary['heldout_success_after']:.3f} (prefill saved {summary['prefill_saved']:.0%}; "
        f"{summary['iterations']} iterations)"
    )
