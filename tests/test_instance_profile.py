"""PTL(BS) measured where generation runs (StreamRL §5.1): each instance profiles its own engine
at start, the service averages the curves, and a second run reads them from the cache."""

from __future__ import annotations

import json

import pytest

from streamrl.components.generation.hf_generator import HFStreamGenerator
from streamrl.components.generation.service import StreamGenerationService
from streamrl.components.skewness.instance_profile import LatencyProfile, profiled_latency
from streamrl.components.skewness.latency import LatencyModel
from streamrl.policy.models import build_tiny_model, save_policy

pytestmark = pytest.mark.timeout(300)


def test_the_profile_times_the_generator_and_is_cached_by_shape_engine_and_device(
    tmp_path, tokenizer
):
    model = build_tiny_model(tokenizer, "test", seed=0)
    model_dir = save_policy(model, tokenizer, tmp_path / "policy")
    generator = HFStreamGenerator(model, max_batch_size=4, greedy=True)
    profile = LatencyProfile((1, 2, 4, 8), tokens=6, cache_dir=str(tmp_path / "cache"))
    first, cached = profiled_latency(generator, profile, str(model_dir), "hf", "cpu")
    assert not cached and first.batch_sizes == [1, 2, 4]  # 8 is past the instance's limit
    assert all(s > 0 for s in first.ptl_s) and generator.idle
    assert first.prefill_token_s > 0  # the long prompt's prefill costs more than the short
    again, cached = profiled_latency(generator, profile, str(model_dir), "hf", "cpu")
    assert cached and again == first
    _, cached = profiled_latency(generator, profile, str(model_dir), "vllm", "cpu")
    assert not cached  # another engine is profiled on its own
    assert len(list((tmp_path / "cache").glob("latency-*.json"))) == 2
    assert json.loads(next((tmp_path / "cache").glob("latency-*.json")).read_text())
    # An entry that is not a whole model (a writer of before its writes were atomic left two
    # instances' JSON in one file) is a miss: measured again and replaced, never a failed start.
    for path in (tmp_path / "cache").glob("latency-*.json"):
        path.write_text(path.read_text() + "\n}")
    for engine in ("hf", "vllm"):
        _, cached = profiled_latency(generator, profile, str(model_dir), engine, "cpu")
        assert not cached  # measured again
    assert all(json.loads(p.read_text()) for p in (tmp_path / "cache").glob("latency-*.json"))
    assert not list((tmp_path / "cache").glob(".*partial"))  # each write renamed into place


def test_writers_racing_to_one_cache_entry_leave_a_whole_model(tmp_path):
    # Generator instances of one run profile at once and cache under the same key.
    import multiprocessing as mp

    path = tmp_path / "latency-same.json"
    ctx = mp.get_context("spawn")
    writers = [ctx.Process(target=_write_models, args=(path, seed)) for seed in range(4)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(60)
    assert all(w.exitcode == 0 for w in writers)
    model = LatencyModel.from_json(path)  # whole: one writer's model, not two interleaved
    assert model.batch_sizes == [1, 2, 4, 8, 16, 32]


def _write_models(path, seed: int) -> None:
    sizes = [1, 2, 4, 8, 16, 32]
    for n in range(1000):  # each writer's files of another length: an interleaving shows
        ptl = [round(0.001 * (i + 1) + 1e-9 * n, 4 + seed) for i in range(len(sizes))]
        LatencyModel(sizes, ptl).to_json(path)


def test_instances_report_their_latency_and_the_service_averages_it(tmp_path, tokenizer):
    model_dir = save_policy(build_tiny_model(tokenizer, "test", seed=0), tokenizer, tmp_path / "p")
    profile = LatencyProfile.up_to(4)
    assert profile.batch_sizes == (1, 2, 4)
    with StreamGenerationService(model_dir, 2, max_batch_size=4, profile_latency=profile) as sgs:
        curves = [h.latency for h in sgs.pool.handles]
        measured = sgs.measured_latency()
    assert all(c is not None and list(c["batch_sizes"]) == [1, 2, 4] for c in curves)
    assert measured.batch_sizes == [1, 2, 4]
    for i in range(3):
        assert measured.ptl_s[i] == pytest.approx(
            (curves[0]["ptl_s"][i] + curves[1]["ptl_s"][i]) / 2
        )
    # The largest batch timed once more at a long prompt: what context costs, and the engine's
    # statistic (the HF slot cache pays for the widest row).
    assert measured.load == "widest" and measured.context_s >= 0
    assert measured.context_s == pytest.approx(
        (curves[0]["context_s"] + curves[1]["context_s"]) / 2
    )
    with StreamGenerationService(model_dir, 1, max_batch_size=4) as sgs:
        assert sgs.pool.handles[0].latency is None and sgs.measured_latency() is None
