"""Weights (StreamRL §4.1, §6): moving a new policy version from the trainer to the generators.

``sync`` overlaps the transfer with training (one-step async); ``transport`` is one weight group
(gloo, bucketed), ``nccl`` its GPU-to-GPU variant; ``relay`` and ``broadcast_tree`` send one copy
per remote site and fan it out there.
"""
