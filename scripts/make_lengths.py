"""Write ``streamrl/data/lengths_bimodal.json``: a second long-tailed length file, shaped unlike
the shipped ``lengths_longtail.json`` (one log-normal, median 23, max 200).

512 output lengths of a reasoning-style policy: 70% direct answers (log-normal, median 24,
sigma 0.5) and 30% worked solutions whose lengths follow a log-t with 3 degrees of freedom
(median 110, scale 0.6): heavier-tailed than a log-normal, so a few samples run far past the
rest. Capped at 400 tokens (a generation budget), at least 2. Seeded: the file is the same on
every machine.

    python scripts/make_lengths.py
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parents[1] / "streamrl" / "data" / "lengths_bimodal.json"


def bimodal_lengths(n: int = 512, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    worked = rng.random(n) < 0.3
    direct = rng.lognormal(np.log(24), 0.5, n)
    solutions = np.exp(np.log(110) + 0.6 * rng.standard_t(3, n))
    lengths = np.where(worked, solutions, direct)
    return [int(x) for x in np.clip(np.round(lengths), 2, 400)]


if __name__ == "__main__":
    lengths = bimodal_lengths()
    OUT.write_text(json.dumps(lengths) + "\n")
    q = np.percentile(lengths, [50, 90, 99])
    print(
        f"wrote {OUT}: {len(lengths)} lengths, median {q[0]:.0f}, p90 {q[1]:.0f}, "
        f"p99 {q[2]:.0f}, max {max(lengths)}"
    )
