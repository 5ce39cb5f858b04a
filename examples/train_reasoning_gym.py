"""GRPO on reasoning-gym tasks, scored by their own verifiers (configs/reasoning_gym.yaml as code).

Run: python examples/train_reasoning_gym.py [--iterations 150] [--sft-steps 1800] [--rows 4000]"""

import argparse

import torch

import streamrl as sr

TASKS = {
    "spell_backward": {"min_word_len": 3, "max_word_len": 5},
    "chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2},
}

if __name__ == "__main__":  # generator and reward workers are spawned processes
    cli = argparse.ArgumentParser()
    cli.add_argument("--iterations", type=int, default=150)
    cli.add_argument("--sft-steps", type=int, default=1800)
    cli.add_argument("--rows", type=int, default=4000, help="training rows")
    args = cli.parse_args()
    torch.set_num_threads(1)
    train = sr.reasoning_gym_dataset(TASKS, size=args.rows, seed=0)
    exclude = set(train["prompt"])  # held out: a far seed, and no training question
    heldout = sr.reasoning_gym_dataset(TASKS, size=200, seed=10**6, exclude_prompts=exclude)
    tokenizer = sr.data_tokenizer(train, kind="char")  # one id per character of the data
    policy = sr.build_tiny_model(tokenizer, size="demo")  # ~1M parameters
    sft = dict(steps=args.sft_steps, lr=2e-3, tokens_per_batch=2048, seed=0)
    sr.sft_on_rows(train, tokenizer=tokenizer, model=policy, **sft)  # the suite's own answers
    model_dir = sr.save_policy(policy, tokenizer, "runs/reasoning_gym_example")
    score = sr.as_batch_reward(sr.reasoning_gym_reward)  # the task's own score_answer
    before = sr.evaluate(policy, tokenizer, heldout, score=score)
    algorithm, context = sr.GRPO(group_size=8), policy.config.max_position_embeddings
    service = sr.StreamGenerationService(model_dir, 1, temperature=1.0)
    with service, sr.RewardPool([sr.RewardSpec("reasoning_gym")], workers=1) as reward:
        prompts = sr.PromptSource(train, batch_size=32)
        rollouts = sr.RolloutStream(
            service, prompts, tokenizer, algorithm, reward=reward, max_tokens=16, context=context
        )
        module = sr.build_module(
            policy, rollouts=rollouts, iterations=args.iterations, mode="async"
        )
        sr.build_trainer(module).fit(module)
    after = sr.evaluate(policy, tokenizer, heldout, score=score)
    print(
        f"held-out reward {before.reward:.3f} -> {after.reward:.3f} ({args.iterations} iterations)"
    )
