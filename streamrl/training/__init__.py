"""The trainer side: the LightningModule (``StreamRLModule``), the rollout stream that feeds it
scored groups as they arrive (§4.1), the prompt source, FSDP, checkpoints and run state, the
rollout files and the pipeline's timeline.

Layer 8 (``docs/architecture.md``): imports components, envs and below; never ``run`` or ``cli``.
"""
