"""The policy: models built from configs or loaded from a directory, tokenizers and chat formats,
LoRA, token log-probs, and supervised warm starts.

Layer 4 (``docs/architecture.md``): imports ``runtime``, ``tasks`` and the top-level modules.
"""
