"""GRPO on multi-turn episodes: a tiny policy learns to use a calculator tool (docs/episodes.md).

Run: python examples/train_tool_use.py [--iterations 60] [--sft-steps 400] [--rows 2000]"""

import argparse

import torch

import streamrl as sr

if __name__ == "__main__":  # the generator instances are spawned processes
    cli = argparse.ArgumentParser()
    cli.add_argument("--iterations", type=int, default=60)
    cli.add_argument("--sft-steps", type=int, default=400)
    cli.add_argument("--rows", type=int, default=2000, help="training rows")
    args = cli.parse_args()
    torch.set_num_threads(1)
    train, heldout = sr.calculator_rows(args.rows, seed=0), sr.calculator_rows(100, seed=99)
    env, demo = sr.CalculatorEnv, sr.calculator_demonstration  # a tool, and good episodes
    tokenizer = sr.episode_tokenizer(train, env, demo)  # a BPE learned from rendered episodes
    policy = sr.build_tiny_model(tokenizer, size="demo")  # ~1M parameters
    sft = dict(steps=args.sft_steps, lr=2e-3, tokens_per_batch=2048, seed=0, model=policy)
    sr.sft_on_episodes(train, make_env=env, demonstrate=demo, tokenizer=tokenizer, **sft)
    model_dir = sr.save_policy(policy, tokenizer, "runs/tool_use_example")
    turns = dict(max_tokens=40, context=policy.config.max_position_embeddings, max_turns=3)
    before = sr.evaluate_episodes(policy, tokenizer, env, heldout, **turns)
    algorithm = sr.GRPO(group_size=8)
    stops = sr.stop_token_ids(tokenizer)  # a turn ends at the chat template's end of turn
    with sr.StreamGenerationService(model_dir, 1, temperature=1.0, stop_token_ids=stops) as service:
        runner = sr.EpisodeRunner(service, env, tokenizer, **turns)  # env steps off the decode loop
        rollouts = sr.RolloutStream(
            service,
            sr.PromptSource(train, batch_size=16),
            tokenizer,
            algorithm,  # no reward: each episode's reward is its environment's
            max_tokens=turns["max_tokens"],
            context=turns["context"],
            sampler=runner,
        )
        module = sr.build_module(
            policy, rollouts=rollouts, iterations=args.iterations, mode="async"
        )
        sr.build_trainer(module).fit(module)
    after = sr.evaluate_episodes(policy, tokenizer, env, heldout, **turns)
    print(
        f"held-out success {before.success:.3f} -> {after.success:.3f} "
        f"(prefill saved {runner.prefill_saved:.0%}; {args.iterations} iterations)"
    )
