"""What every process needs, below everything else: device assignment, stop signals and time limits,
random state, quiet logs, progress bars, peak memory, cache keys and ``module:Name`` references.

Layer 1 of the package (``docs/architecture.md``): imports only ``streamrl.errors``,
``streamrl.records`` and ``streamrl.protocols``.
"""
