"""Disaggregated streaming GRPO: all of StreamRL (arXiv 2504.15930) on one screen, on a CPU.

Run: python examples/train_grpo.py [--iterations 30] [--model LOCAL_HF_MODEL_DIR]"""

import argparse

import lightning as L
import torch

from streamrl.algorithms import GRPO
from streamrl.components import StreamGenerationService
from streamrl.components.skewness.profiler import Profiler
from streamrl.components.skewness.ranker import LengthRanker
from streamrl.components.skewness.skew_dispatch import SkewAwareDispatcher
from streamrl.components.training.pipeline import DynamicBatchPipeline
from streamrl.config import RunConfig
from streamrl.models import load_policy
from streamrl.module import StreamRLModule
from streamrl.rollout import PromptSource, RolloutStream
from streamrl.sft import SFTConfig, warm_start
from streamrl.tasks import make_prompt_set, partial_credit

if __name__ == "__main__":  # generator instances are spawned processes: keep this guard
    cli = argparse.ArgumentParser()
    cli.add_argument("--iterations", type=int, default=30)
    cli.add_argument("--prompts", type=int, default=16, help="prompts per iteration")
    cli.add_argument("--sft-steps", type=int, default=1800, help="SFT warm start (cached)")
    cli.add_argument("--cache", default=RunConfig().resolved_cache_dir(), help="warm starts")
    cli.add_argument("--model", help="a local Hugging Face model dir instead of the tiny model")
    args = cli.parse_args()
    torch.set_num_threads(1)  # one core for the trainer, the others for the generators
    model_dir = args.model or warm_start(SFTConfig(steps=args.sft_steps), args.cache)  # ~1M
    policy, tokenizer = load_policy(model_dir)
    latency = Profiler(policy, tokenizer("copy ab=").input_ids, 8, 1).fit([1, 8, 32])  # §5.1
    dispatcher = SkewAwareDispatcher(latency, max_batch_size=32)  # §5.3, Algorithm 2
    algorithm = GRPO(partial_credit, group_size=4)
    with StreamGenerationService(
        model_dir, 2, max_batch_size=32, dispatcher=dispatcher, scheduler="lpt", temperature=0.7
    ) as sgs:  # §3
        prompts = PromptSource(make_prompt_set(512, median_len=6, max_len=48), args.prompts)
        rollouts = RolloutStream(  # §5.2: the ranker learns the policy's own output lengths
            sgs,
            prompts,
            tokenizer,
            algorithm,
            max_tokens=64,
            context=policy.config.max_position_embeddings,
            ranker=LengthRanker(epochs=100),
        )
        pipeline = DynamicBatchPipeline(1024, staleness_bound=1)  # §4.1: train as they stream
        module = StreamRLModule(
            policy.train(),
            algorithm,
            rollouts,
            args.iterations,
            lr=1e-4,
            temperature=0.7,
            mode="async",
            pipeline=pipeline,
        )
        L.Trainer(
            max_steps=args.iterations,
            accelerator="cpu",
            logger=False,
            enable_checkpointing=False,
            enable_model_summary=False,
        ).fit(module)
    rewards = [h["rollout/reward"] for h in module.history]
    print(f"reward first {rewards[0]:.3f} last {rewards[-1]:.3f} ({len(rewards)} iterations)")
