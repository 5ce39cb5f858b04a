"""Held-out evaluation: the task's reward on held-out prompts (``heldout``), the periodic callback
that runs it during a fit (``periodic``), and episode evaluation (``episodes``).

Layer 9 (``docs/architecture.md``): imports ``training`` and below.
"""
