"""Disaggregated streaming GRPO: all of StreamRL (arXiv 2504.15930) on one screen, on a CPU.

Run: python examples/train_grpo.py [--iterations 30] [--model LOCAL_HF_MODEL_DIR]"""

import argparse

import torch

import streamrl as sr

if __name__ == "__main__":  # generator instances are spawned processes: keep this guard
    cli = argparse.ArgumentParser()
    cli.add_argument("--iterations", type=int, default=30)
    cli.add_argument("--prompts", type=int, default=16, help="prompts per iteration")
    cli.add_argument("--sft-steps", type=int, default=1800, help="SFT warm start (cached)")
    cli.add_argument("--model", help="a local Hugging Face model dir instead of the tiny model")
    args = cli.parse_args()
    torch.set_num_threads(1)  # one core for the trainer, the others for the generators
    model_dir = args.model or sr.warm_start(sr.SFTConfig(steps=args.sft_steps))  # ~1M params
    policy, tokenizer = sr.load_policy(model_dir)
    latency = sr.measure_latency(policy, tokenizer, max_batch_size=32)  # batch x context, §5.1
    dispatcher = sr.SkewAwareDispatcher(latency, max_batch_size=32)  # Algorithm 2, §5.3
    algorithm = sr.GRPO(group_size=4)
    dataset = sr.make_prompt_set(512, median_len=6, max_len=48)
    prompts = sr.PromptSource(dataset, batch_size=args.prompts)
    service = sr.StreamGenerationService(  # §3: each finished sample streams to the trainer
        model_dir, 2, dispatcher=dispatcher, scheduler=sr.LPTScheduler, temperature=0.7
    )
    with service:
        rollouts = sr.RolloutStream(  # §5.2: the ranker learns the policy's own output lengths
            service,
            prompts,
            tokenizer,
            algorithm,
            reward=sr.partial_credit,
            max_tokens=64,
            context=policy.config.max_position_embeddings,
            ranker=sr.LengthRanker(),
        )
        # §4.1: one-step async; each micro-batch trains the moment its samples have streamed in
        module = sr.build_module(
            policy, rollouts=rollouts, iterations=args.iterations, mode="async"
        )
        sr.build_trainer(module).fit(module)
    rewards = [h["rollout/reward"] for h in module.history]
    print(f"reward first {rewards[0]:.3f} last {rewards[-1]:.3f} ({len(rewards)} iterations)")
