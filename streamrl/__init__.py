"""streamrl: disaggregated, streaming RL post-training of LLMs (StreamRL, arXiv 2504.15930).

The main names are importable from here (loaded on first use, so the command line starts fast):

- the generation side: ``StreamGenerationService`` (§3), ``HFEngine``, ``LengthRanker``
  (§5.2), ``SkewAwareDispatcher`` (§5.3, Algorithm 2), ``LPTScheduler``, ``FIFOScheduler``;
- the trainer side: ``PromptSource``, ``RolloutStream`` (scored groups as they stream in, §4.1),
  the algorithms (``GRPO``, ``DAPO``, ``RLOO``, ``ReinforcePlusPlus``, ``PPO``, ``Algorithm``),
  the micro-batches they train on (``DynamicBatchPipeline``, §4.1) and the correction of tokens
  the policy did not sample (``OffPolicyCorrection``);
- the builders every run goes through: ``build_module``, ``build_trainer``, ``make_logger``,
  ``measure_latency`` (``streamrl.training.builders``), and ``RunParts`` for a config's objects;
- a policy to start from and to save: ``load_policy``, ``save_policy``,
  ``warm_start``/``SFTConfig``, the built-in tasks ``make_prompt_set`` and their rewards
  ``exact_match``, ``partial_credit`` (a ``RolloutStream``'s ``reward``);
- your own task: ``load_prompt_dataset``/``split_heldout`` (local files), the reasoning-gym
  suite (``reasoning_gym_dataset``, ``reasoning_gym_reward``), rewards of any form run in a
  ``RewardPool`` (``RewardSpec``, ``as_batch_reward``, ``math_answer``, ``RewardModel``), chat
  formats (``render_prompt``, ``completion_text``, ``build_bpe_tokenizer``), a warm start on
  rows (``build_tiny_model``, ``data_tokenizer``, ``sft_on_rows``) and held-out evaluation with
  the task's reward (``evaluate``, ``PeriodicEval``);
- the main job: ``RunConfig``, ``load_config``, ``run_fit``.

Every other public name lives in its module (``streamrl.components``, ``streamrl.protocols``...).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

#: Public name -> the module that defines it.
_EXPORTS = {
    "StreamGenerationService": "streamrl.components.generation.service",
    "HFEngine": "streamrl.components.generation.engines",
    "LengthRanker": "streamrl.components.skewness.ranker",
    "SkewAwareDispatcher": "streamrl.components.skewness.skew_dispatch",
    "LPTScheduler": "streamrl.components.skewness.schedulers",
    "FIFOScheduler": "streamrl.components.skewness.schedulers",
    "PromptSource": "streamrl.training.prompts",
    "RolloutStream": "streamrl.training.rollout",
    "StreamRLModule": "streamrl.training.module",
    "OffPolicyCorrection": "streamrl.components.training.off_policy",
    "DynamicBatchPipeline": "streamrl.components.training.pipeline",
    "Algorithm": "streamrl.algorithms",
    "GRPO": "streamrl.algorithms",
    "DAPO": "streamrl.algorithms",
    "RLOO": "streamrl.algorithms",
    "PPO": "streamrl.algorithms",
    "ReinforcePlusPlus": "streamrl.algorithms",
    "build_module": "streamrl.training.builders",
    "build_trainer": "streamrl.training.builders",
    "make_logger": "streamrl.training.builders",
    "measure_latency": "streamrl.training.builders",
    "RunParts": "streamrl.run.parts",
    "load_policy": "streamrl.policy.models",
    "save_policy": "streamrl.policy.models",
    "warm_start": "streamrl.policy.sft",
    "SFTConfig": "streamrl.policy.sft",
    "make_prompt_set": "streamrl.tasks",
    "exact_match": "streamrl.tasks",
    "partial_credit": "streamrl.tasks",
    "load_prompt_dataset": "streamrl.tasks.local_data",
    "split_heldout": "streamrl.tasks.local_data",
    "reasoning_gym_dataset": "streamrl.tasks.reasoning_gym",
    "reasoning_gym_reward": "streamrl.tasks.reasoning_gym",
    "RewardPool": "streamrl.rewards.pool",
    "RewardSpec": "streamrl.rewards.spec",
    "as_batch_reward": "streamrl.rewards.spec",
    "math_answer": "streamrl.rewards.verifiers",
    "RewardModel": "streamrl.rewards.reward_model",
    "render_prompt": "streamrl.policy.chat",
    "completion_text": "streamrl.policy.chat",
    "build_bpe_tokenizer": "streamrl.policy.models",
    "build_tiny_model": "streamrl.policy.models",
    "data_tokenizer": "streamrl.run.prepare",
    "sft_on_rows": "streamrl.policy.sft_rows",
    "evaluate": "streamrl.eval.heldout",
    "PeriodicEval": "streamrl.eval.periodic",
    "RunConfig": "streamrl.run.config",
    "load_config": "streamrl.run.config_file",
    "run_fit": "streamrl.run.recipe",
    "Step": "streamrl.records",
    "Environment": "streamrl.protocols",
    "ToolEnvironment": "streamrl.envs.tools",
    "tool_schema": "streamrl.envs.tools",
    "format_call": "streamrl.envs.tools",
    "EpisodeRunner": "streamrl.envs.runner",
    "evaluate_episodes": "streamrl.eval.episodes",
    "sft_on_episodes": "streamrl.envs.demos",
    "episode_tokenizer": "streamrl.envs.demos",
    "stop_token_ids": "streamrl.policy.chat",
    "CalculatorEnv": "streamrl.envs.tool_tasks",
    "calculator_rows": "streamrl.envs.tool_tasks",
    "calculator_demonstration": "streamrl.envs.tool_tasks",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'streamrl' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
