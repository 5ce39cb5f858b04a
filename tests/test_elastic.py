"""ElasticController (StreamRL §4.2): delta vs delta', bounds, hysteresis, no oscillation."""

from __future__ import annotations

import pytest

from streamrl.components.capacity.elastic import ElasticController
from streamrl.components.skewness.latency import LatencyModel

# 10 ms per step at any batch size, 1 slot per instance: 10 equal samples of 100 tokens take
# ceil(10 / N) rounds of 1 s on N instances (nothing to isolate: the dispatcher balances).
CONST = LatencyModel([1], [0.01])
WORK = [100] * 10


def model_gen_s(ctl: ElasticController, n: int) -> float:
    return ctl.predicted_gen_s(n, WORK)


def test_delta_prime_is_the_models_relative_saving():
    ctl = ElasticController(CONST, max_batch_size=1)
    assert [model_gen_s(ctl, n) for n in (1, 2, 3, 4, 5)] == pytest.approx([10, 5, 4, 3, 2])
    # Measured T_gen 20 s (twice the model): delta' = 20 x (1 - 5/10) = 10 s.
    assert ctl.delta_prime_s(20.0, 1, WORK) == pytest.approx(10.0)


def test_adds_only_when_delta_exceeds_delta_prime():
    # T_gen 10 s on 1 instance: one more saves delta' = 10 x (1 - 5/10) = 5 s.
    ctl = ElasticController(CONST, max_batch_size=1)
    add = ctl.observe(t_gen_s=10.0, t_train_s=4.0, instances=1, lengths=WORK)
    assert (add.action, add.instances, add.delta_prime_s) == ("add", 2, pytest.approx(5.0))
    keep = ctl.observe(t_gen_s=10.0, t_train_s=6.0, instances=1, lengths=WORK)  # 4 < 5
    assert (keep.action, keep.instances, keep.delta_s) == ("keep", 1, pytest.approx(4.0))
    # threshold 0.5: add as soon as it shrinks |delta| (4 > 0.5 x 5).
    eager = ElasticController(CONST, max_batch_size=1, threshold=0.5)
    assert eager.observe(10.0, 6.0, 1, WORK).action == "add"


def test_respects_max_instances_and_step():
    ctl = ElasticController(CONST, max_batch_size=1, step=2, max_instances=4)
    # 2 -> 4 instances: 5 -> 3 rounds, delta' = 10 x 0.4 = 4 s < delta 9 s.
    assert ctl.observe(10.0, 1.0, 2, WORK).instances == 4
    assert ctl.observe(10.0, 1.0, 4, WORK).action == "keep"  # 6 > max


def test_never_scales_in_by_default():
    ctl = ElasticController(CONST, max_batch_size=1)
    assert ctl.observe(1.0, 100.0, 5, WORK).action == "keep"


def test_scale_in_with_patience_and_cooldown():
    ctl = ElasticController(CONST, max_batch_size=1, scale_in=True, patience=2, cooldown=1)
    # 5 -> 4 instances: 2 -> 3 rounds, so removing one adds 2 x (3/2 - 1) = 1 s of
    # generation; training lags by 8 s: remove, once it has held for 2 iterations.
    first = ctl.observe(2.0, 10.0, 5, WORK)
    assert first.action == "keep" and first.reason == "waiting for patience"
    second = ctl.observe(2.0, 10.0, 5, WORK)
    assert (second.action, second.instances) == ("remove", 4)
    assert ctl.observe(2.0, 10.0, 4, WORK).reason == "cooling down after a change"


def test_no_oscillation_in_closed_loop():
    # Closed loop on the latency model: T_gen(N) = model rounds, T_train constant 4.5 s, with
    # +-0.6 s of alternating measurement noise. It must settle and never flip back and forth.
    ctl = ElasticController(CONST, max_batch_size=1, scale_in=True, patience=2, cooldown=1)
    instances, history = 1, []
    for i in range(30):
        noise = 0.6 if i % 2 else -0.6
        t_gen = model_gen_s(ctl, instances) + noise
        decision = ctl.observe(t_gen, 4.5, instances, WORK)
        history.append(decision.action)
        instances = decision.instances
    changes = [a for a in history if a != "keep"]
    assert "remove" not in changes  # adding never overshoots into a removal
    assert history[-10:] == ["keep"] * 10  # settled
    assert model_gen_s(ctl, instances) <= 4.5 + 0.6


def test_validation_and_state_round_trip():
    with pytest.raises(ValueError, match="min_instances"):
        ElasticController(CONST, 1, min_instances=3, max_instances=2)
    ctl = ElasticController(CONST, 1, patience=3)
    ctl.observe(10.0, 1.0, 1, WORK)
    clone = ElasticController(CONST, 1, patience=3)
    clone.load_state_dict(ctl.state_dict())
    assert clone.state_dict() == {"add": 1, "remove": 0, "cooling": 0}


def test_min_saving_stops_adding_instances_that_cannot_help():
    from streamrl.components.capacity.elastic import ElasticController
    from streamrl.components.skewness.latency import LatencyModel

    # Four 1000-token samples dominate: a third instance only lowers their batch from 4 to 2
    # (PTL 10.48 -> 10.16 ms): 0.5% of T_gen, while generation lags training by 15 s.
    lengths = [1000] * 4 + [10] * 60
    latency = LatencyModel([1, 64], [0.01, 0.02])
    bare = ElasticController(latency, max_batch_size=64)
    guarded = ElasticController(latency, max_batch_size=64, min_saving=0.05)
    first = bare.observe(t_gen_s=20.0, t_train_s=5.0, instances=2, lengths=lengths)
    assert first.action == "add" and 0 < first.delta_prime_s < 0.05 * 20.0
    assert guarded.observe(20.0, 5.0, instances=2, lengths=lengths).action == "keep"
