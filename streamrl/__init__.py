"""streamrl: disaggregated, streaming RL post-training of LLMs (StreamRL, arXiv 2504.15930).

The pieces, from prompts to weights: ``streamrl.tasks`` (prompt sets and rewards),
``streamrl.components`` (generator, stream generation service, dispatch, weight transport),
``streamrl.algorithms`` (GRPO), ``streamrl.rollout`` (scored groups as they stream in),
``streamrl.module`` (the LightningModule) and ``streamrl.jobs`` (the main job).
"""

__version__ = "0.1.0"
