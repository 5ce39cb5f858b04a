"""Skewness (StreamRL §5): predict the long tail, isolate it, admit it first.

``ranker`` (and ``backbone_ranker``) predict output lengths (§5.2); ``latency`` and ``profiler``
give the per-token latency ``PTL(BS)`` the dispatcher plans with (§5.1); ``skew_dispatch`` is
Algorithm 2 (§5.3) and ``dispatch`` the baselines; ``schedulers`` order admission (LPT).
"""
