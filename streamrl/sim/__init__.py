"""Discrete-event simulation of StreamRL runs (generation, streaming, training, weights).

``simulate(SimConfig) -> SimResult`` (``engine``); presets from the paper and this machine
(``presets``); the Table 3 ablation (``ablation``); ``streamrl simulate`` / ``streamrl plan``
(``cli``). See docs/simulator.md.
"""
