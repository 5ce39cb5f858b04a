"""A run from its config: the config and its checks, config -> parts, the warm start, the recipe
(the job, top to bottom) and its reports, trainer ranks, reruns and the demo.

Layer 10 (``docs/architecture.md``): imports everything but ``bench``, ``sim`` and ``cli``.
"""
