"""``LatencyModel`` of batch size and context (issue 47): its fit recovers a known cost function
from synthetic timings, and a ``PTL(BS)`` table of before the context term still loads."""

from __future__ import annotations

import json
import random

import pytest

from streamrl.components.skewness.latency import LatencyModel

SIZES = (1, 2, 4, 8, 16, 32)


def known_ptl(batch: int) -> float:
    """A step's cost at the profiled context: a fixed part and a part per row."""
    return 0.003 + 0.00012 * batch


def timed_steps(load: str, context_s: float, profiled: int, noise: float, seed: int = 0):
    """Steps over a grid of batch sizes and contexts (rows of unequal length for ``total``),
    timed by the known function with a relative noise of at most ``noise``."""
    draw = random.Random(seed)
    steps = []
    for batch in SIZES:
        for widest in (profiled, 64, 160, 320, 480):
            if load == "widest":
                contexts = [widest] + [draw.randint(profiled, widest) for _ in range(batch - 1)]
                paid = batch * widest
            else:
                contexts = [draw.randint(profiled, widest) for _ in range(batch)]
                paid = sum(contexts)
            seconds = known_ptl(batch) + context_s * (paid - batch * profiled)
            steps.append((contexts, seconds * (1 + draw.uniform(-noise, noise))))
    return steps


@pytest.mark.parametrize("load", ["widest", "total"])
def test_the_fit_recovers_a_known_cost_of_batch_size_and_context(load):
    steps = timed_steps(load, context_s=4e-7, profiled=16, noise=0.01)
    prefills = [(t, 0.002 + 2.5e-5 * t) for t in (8, 32, 128, 400, 800)]
    model = LatencyModel.fit(steps, prefills, load=load, profiled_context=16)
    assert model.load == load and model.batch_sizes == list(SIZES)
    assert model.context_s == pytest.approx(4e-7, rel=0.03)
    for batch, ptl in zip(SIZES, model.ptl_s, strict=True):
        assert ptl == pytest.approx(known_ptl(batch), rel=0.03)
    assert model.prefill_base_s == pytest.approx(0.002, rel=1e-6)
    assert model.prefill_token_s == pytest.approx(2.5e-5, rel=1e-6)
    # Every timed step is priced within its noise and a little more.
    worst = max(abs(model.step_s(c) - s) / s for c, s in steps)
    assert worst < 0.03


def test_the_statistic_matters_widest_row_against_cached_tokens():
    """One long row among short ones: the slot cache pays for it on every row, paged attention
    only for its own tokens."""
    slot = LatencyModel([4], [0.01], context_s=1e-5, load="widest", profiled_context=10)
    paged = LatencyModel([4], [0.01], context_s=1e-5, load="total", profiled_context=10)
    contexts = [10, 10, 10, 410]
    assert slot.step_s(contexts) == pytest.approx(0.01 + 1e-5 * (4 * 410 - 40))
    assert paged.step_s(contexts) == pytest.approx(0.01 + 1e-5 * 400)
    assert slot.step_s([10] * 4) == paged.step_s([10] * 4) == pytest.approx(0.01)


def test_a_load_that_does_not_slow_steps_fits_ptl_alone():
    steps = timed_steps("widest", context_s=0.0, profiled=16, noise=0.0)
    steps = [(c, s - 1e-9 * len(c) * max(c)) for c, s in steps]  # faster with context: noise
    model = LatencyModel.fit(steps)
    assert model.context_s == 0.0 and model.profiled_context == 16
    assert model.ptl_s[0] == pytest.approx(known_ptl(1), rel=0.01)


def test_a_ptl_table_of_before_loads_and_prices_every_step_at_ptl(tmp_path):
    path = tmp_path / "latency.json"
    path.write_text(json.dumps({"batch_sizes": [1, 4], "ptl_s": [0.01, 0.016]}))
    model = LatencyModel.from_json(path)
    assert model.context_s == 0.0 and model.prefill_s([100]) == 0.0
    assert model.step_s([5, 900, 7, 12]) == model.ptl(4) == 0.016
    fitted = LatencyModel.fit(timed_steps("total", 3e-7, 16, 0.0), load="total")
    again = LatencyModel.from_json(fitted.to_json(tmp_path / "fitted.json"))
    assert again == fitted  # the context term travels with the table


def test_update_from_takes_the_context_term_too():
    held = LatencyModel([1], [1.0])
    held.update_from(LatencyModel([1, 2], [0.1, 0.2], context_s=1e-6, load="total"))
    assert (held.batch_sizes, held.context_s, held.load) == ([1, 2], 1e-6, "total")


def test_bad_models_and_fits_are_refused():
    with pytest.raises(ValueError, match="load is 'widest' or 'total'"):
        LatencyModel([1], [0.01], load="paged")
    with pytest.raises(ValueError, match="cannot be negative"):
        LatencyModel([1], [0.01], context_s=-1.0)
    with pytest.raises(ValueError, match="at least one timed step"):
        LatencyModel.fit([])
