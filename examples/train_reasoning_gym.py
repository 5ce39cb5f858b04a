"""GRPO on reasoning-gym tasks, scored by their own verifiers: configs/reasoning_gym.yaml in
Python, run by the recipe `streamrl fit` runs (streamrl/run/recipe.py).

Run: python examples/train_reasoning_gym.py [--iterations 150] [--sft-steps 1800] [--rows 4000]"""

import argparse

import streamrl as sr
from streamrl.run.reruns import fresh_output_dir

TASKS = {  # task: its reasoning-gym config; equal shares of the rows
    "spell_backward": {"min_word_len": 3, "max_word_len": 5},
    "chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2},
}

if __name__ == "__main__":  # generator and reward workers are spawned processes
    cli = argparse.ArgumentParser()
    cli.add_argument("--iterations", type=int, default=150)
    cli.add_argument("--sft-steps", type=int, default=1800)
    cli.add_argument("--rows", type=int, default=4000, help="training rows")
    cli.add_argument("--output-dir", default="runs/reasoning_gym_example")
    args = cli.parse_args()
    config = sr.load_config(  # the YAML layout, checked before any work
        {
            "model": "tiny",  # ~1M parameters, a tokenizer of the data's characters
            "output_dir": str(fresh_output_dir(args.output_dir)),
            "data": {"reasoning_gym": TASKS, "n_train": args.rows, "n_heldout": 200},
            "sft": {  # a warm start on the suite's own answers (no typos), cached
                **{"model_size": "demo", "tokenizer": "char", "steps": args.sft_steps},
                **{"lr": 2e-3, "tokens_per_batch": 2048, "demo_noise": 0.0},
            },
            "rl": {
                "algorithm": "grpo",
                "iterations": args.iterations,
                "prompts_per_iteration": 32,
                "group_size": 8,
                "module": {"mode": "async", "lr": 1e-4},  # §4.1: one-step async
                "generation": {"num_instances": 1, "temperature": 1.0, "partial_rollout": "keep"},
                "reward": "reasoning_gym",  # the task's own score_answer, in a reward worker
                "reward_pool": {"workers": 1},
                "rollouts": {"max_tokens": 16},
            },
        }
    )
    summary = sr.run_fit(config)  # held-out reward before and after, in summary.json too
    print(
        f"held-out reward {summary['heldout_reward_before']:.3f} -> "
        f"{summary['heldout_reward_after']:.3f} ({summary['iterations']} iterations)"
    )
