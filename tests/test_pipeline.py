"""Dynamic-batch pipelining: order independence, the staleness bound, and real async overlap."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from streamrl.algorithms import GRPO
from streamrl.bench.full_logprobs import full_vocab_logprobs
from streamrl.components.generation.service import StreamGenerationService
from streamrl.components.generation.worker import fingerprint
from streamrl.components.training.pipeline import DynamicBatchPipeline, MicroBatch
from streamrl.policy.models import build_tiny_model, save_policy
from streamrl.records import Sample, ScoredGroup
from streamrl.tasks import make_prompt_set, partial_credit
from streamrl.training.builders import build_trainer
from streamrl.training.module import StreamRLModule
from streamrl.training.prompts import PromptSource
from streamrl.training.rollout import RolloutStream


def make_groups(n_groups: int, group_size: int, seed: int, version: int = 0) -> list[ScoredGroup]:
    rng = random.Random(seed)
    groups = []
    for g in range(n_groups):
        prompt = [rng.randrange(3, 40) for _ in range(rng.randint(2, 9))]
        samples = []
        for i in range(group_size):
            length = rng.randint(1, 12)
            samples.append(
                Sample(
                    f"p{g}",
                    i,
                    prompt,
                    [rng.randrange(3, 40) for _ in range(length)],
                    [-rng.random() for _ in range(length)],
                    version,
                    0,
                )
            )
        advantages = [rng.gauss(0, 1) for _ in samples]
        groups.append(ScoredGroup(f"p{g}", samples, [0.0] * group_size, advantages))
    return groups


class _NoRollouts:
    """Only what StreamRLModule.__init__ reads."""

    from streamrl.training.timeline import TraceRecorder

    trace = TraceRecorder()


def accumulated_grads(policy, groups, max_tokens: int) -> dict[str, torch.Tensor]:
    module = StreamRLModule(policy, GRPO(group_size=4), _NoRollouts(), iterations=1)
    policy.zero_grad()
    total = sum(len(g.samples) for g in groups)
    pipeline = DynamicBatchPipeline(max_tokens=max_tokens)
    for micro in pipeline.micro_batches(groups, trainer_version=0):
        (module.algorithm.loss(module.loss_inputs(micro)).sum() / total).backward()
    return {n: p.grad.clone() for n, p in policy.named_parameters()}


def test_the_module_links_in_what_the_pipeline_leaves_unset(tokenizer):
    """A pipeline given without a staleness bound or a layout takes the module's: its mode's
    bound and the layout its policy's attention trains fastest; what it was given it keeps, and
    a bound below the mode's is refused (it would drop the samples the mode trains on)."""
    from streamrl.policy.varlen_attention import register

    policy = build_tiny_model(tokenizer, "test", seed=0)  # SDPA: padded rows are faster

    def linked(mode: str, pipeline: DynamicBatchPipeline) -> tuple:
        given = (pipeline.staleness_bound, pipeline.packed)
        module = StreamRLModule(
            policy, GRPO(group_size=4), _NoRollouts(), 1, mode=mode, pipeline=pipeline
        )
        linked = module.pipeline
        assert (pipeline.staleness_bound, pipeline.packed) == given  # the one given is left as is
        assert linked.max_tokens == pipeline.max_tokens
        return linked.staleness_bound, linked.packed, module.layout

    assert linked("async", DynamicBatchPipeline(64)) == (1, False, "padded")
    assert linked("sync", DynamicBatchPipeline(64, packed=True)) == (0, True, "packed")
    policy.config._attn_implementation = register()  # attends within each packed sample
    assert linked("sync", DynamicBatchPipeline(64)) == (0, True, "packed")
    assert linked("async", DynamicBatchPipeline(64, staleness_bound=2, packed=False)) == (
        2,
        False,
        "padded",
    )
    with pytest.raises(ValueError, match="staleness_bound is 0: it would drop them"):
        linked("async", DynamicBatchPipeline(64, staleness_bound=0))
    shared = DynamicBatchPipeline(64)  # one pipeline, two modules: each links its own
    assert linked("async", shared)[0] == 1 and linked("sync", shared)[0] == 0


def test_arrival_order_does_not_change_the_update(tokenizer):
    policy = build_tiny_model(tokenizer, "test", seed=0)
    groups = make_groups(6, 4, seed=1)
    reference = accumulated_grads(policy, groups, max_tokens=10_000)  # one micro-batch
    shuffled = groups[:]
    random.Random(7).shuffle(shuffled)
    for budget in (1, 60, 200):  # one sample per micro-batch ... a few groups per micro-batch
        grads = accumulated_grads(policy, shuffled, max_tokens=budget)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, reference[name], rtol=1e-4, atol=1e-6)


def test_mixed_prompt_lengths_give_each_sample_its_own_logprobs(tokenizer):
    policy = build_tiny_model(tokenizer, "test", seed=0).eval()
    samples = [s for g in make_groups(3, 2, seed=3) for s in g.samples]
    module = StreamRLModule(policy, GRPO(group_size=2), _NoRollouts(), iterations=1)
    with torch.no_grad():
        batched = module.loss_inputs(MicroBatch(samples, [0.0] * len(samples)))
        for row, s in enumerate(samples):
            ids = torch.tensor([s.prompt_ids + s.token_ids])
            alone = full_vocab_logprobs(
                policy, ids, torch.ones_like(ids), torch.tensor([len(s.prompt_ids)]), s.length
            )
            torch.testing.assert_close(
                batched.logprobs[row, : s.length], alone[0], atol=1e-5, rtol=1e-5
            )
            assert batched.mask[row].sum() == s.length


@settings(max_examples=60, deadline=None)
@given(
    versions=st.lists(st.integers(0, 6), min_size=1, max_size=40),
    trainer_version=st.integers(0, 6),
    bound=st.integers(0, 2),
    budget=st.integers(1, 400),
    seed=st.integers(0, 10_000),
)
def test_staleness_bound_is_never_exceeded(versions, trainer_version, bound, budget, seed):
    groups = [
        ScoredGroup(
            f"p{i}",
            [Sample(f"p{i}", 0, [3, 4], [5] * (1 + i % 7), [0.0] * (1 + i % 7), v, 0)],
            [0.0],
            [1.0],
        )
        for i, v in enumerate(versions)
    ]
    random.Random(seed).shuffle(groups)  # any arrival order
    pipeline = DynamicBatchPipeline(max_tokens=budget, staleness_bound=bound)
    trained = [s for m in pipeline.micro_batches(groups, trainer_version) for s in m.samples]
    assert all(trainer_version - s.weight_version <= bound for s in trained)
    fresh = [v for v in versions if trainer_version - v <= bound]
    assert len(trained) == len(fresh) and len({s.prompt_id for s in trained}) == len(fresh)
    assert pipeline.dropped_stale == len(versions) - len(fresh)


@pytest.mark.timeout(300)
def test_async_mode_overlaps_generation_and_training(tmp_path, tokenizer):
    policy = build_tiny_model(tokenizer, "test", seed=0)
    save_policy(policy, tokenizer, tmp_path / "policy")
    prompts = make_prompt_set(64, ["copy", "count"], median_len=6, max_len=12, seed=0)
    algorithm = GRPO(group_size=4)
    with StreamGenerationService(tmp_path / "policy", 2, max_batch_size=8) as sgs:
        rollouts = RolloutStream(
            sgs,
            PromptSource(prompts, 8),
            tokenizer,
            algorithm,
            reward=partial_credit,
            max_tokens=16,
            context=256,
        )
        pipeline = DynamicBatchPipeline(max_tokens=64, staleness_bound=1)
        module = StreamRLModule(
            policy, algorithm, rollouts, iterations=4, lr=1e-3, mode="async", pipeline=pipeline
        )
        trainer = build_trainer(module, show_progress=False)
        trainer.fit(module)
        assert module.weight_version == 4
        assert max(h["train/staleness_max"] for h in module.history) <= 1
        assert module.pipeline.dropped_stale == 0
        assert sum(h["train/staleness_mean"] for h in module.history[1:]) > 0  # really async
        # Stale samples were corrected (importance ratio to the proximal policy, logged).
        corrected = [h for h in module.history if h["train/stale_samples"] > 0]
        assert corrected and all(0 < h["train/is_ratio_mean"] < 10 for h in corrected)
        assert set(sgs.fingerprints().values()) == {fingerprint(policy)}
    spans = rollouts.trace.spans
    generate = [s for s in spans if s.name == "generate"]
    train = [s for s in spans if s.lane == "trainer" and s.name == "train"]
    # The next iteration's samples decode while this iteration's micro-batches train.
    overlapping = [
        (g, t)
        for g in generate
        for t in train
        if g.iteration == t.iteration + 1 and g.start_s < t.end_s and t.start_s < g.end_s
    ]
    assert overlapping, "no generation of iteration k+1 overlapped training of iteration k"


def _lengths_groups(lengths: list[int], group_size: int = 2) -> list[ScoredGroup]:
    """Groups of one-token prompts whose completions have ``lengths`` (in order)."""
    groups = []
    for g in range(0, len(lengths), group_size):
        samples = [
            Sample(f"p{g}", i, [3], [5] * n, [0.0] * n, 0, 0)
            for i, n in enumerate(lengths[g : g + group_size])
        ]
        groups.append(ScoredGroup(f"p{g}", samples, [0.0] * len(samples), [1.0] * len(samples)))
    return groups


@settings(max_examples=80, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 300), min_size=1, max_size=40),
    ceiling=st.integers(1, 400),
    packed=st.booleans(),
    min_samples=st.integers(1, 8),
)
def test_no_micro_batch_exceeds_its_token_ceiling(lengths, ceiling, packed, min_samples):
    pipeline = DynamicBatchPipeline(ceiling, min_samples=min_samples, packed=packed)
    micro_batches = list(pipeline.micro_batches(_lengths_groups(lengths), trainer_version=0))
    for micro in micro_batches:
        assert micro.samples
        # Over the ceiling only as a single sample longer than it (it trains alone).
        assert pipeline.cost(micro) <= ceiling or len(micro.samples) == 1
    trained = sorted(len(s.token_ids) for m in micro_batches for s in m.samples)
    assert trained == sorted(lengths)  # every sample exactly once


@settings(max_examples=80, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 300), min_size=1, max_size=40),
    ceiling=st.integers(1, 400),
    ranks=st.integers(1, 4),
)
def test_rounds_give_every_rank_a_micro_batch_under_the_ceiling(lengths, ceiling, ranks):
    pipeline = DynamicBatchPipeline(ceiling)
    rounds = list(pipeline.rounds(_lengths_groups(lengths), 0, ranks))
    for micro_batches in rounds:
        assert len(micro_batches) == ranks
        for micro in micro_batches:
            assert micro.tokens <= ceiling or len(micro.samples) == 1
    trained = sorted(len(s.token_ids) for r in rounds for m in r for s in m.samples)
    assert trained == sorted(lengths)


def test_the_last_round_balances_the_ranks_tokens():
    # Nothing fills a micro-batch of 10,000 tokens: everything is dealt when the stream ends,
    # longest first to the rank with the fewest tokens.
    pipeline = DynamicBatchPipeline(10_000)
    lengths = [900, 100, 800, 200, 500, 500, 300, 700]
    (only,) = pipeline.rounds(_lengths_groups(lengths), 0, ranks=2)
    tokens = [m.tokens for m in only]
    assert sum(tokens) == sum(n + 1 for n in lengths)
    assert max(tokens) - min(tokens) <= 100  # 2,004 / 2,004 here; a deal in order: 2,404 / 1,604
    # Fewer samples than ranks: a rank gets an empty micro-batch (a two-token pass), not a copy.
    rounds = list(pipeline.rounds(_lengths_groups([40]), 0, ranks=3))
    assert [len(m.samples) for m in rounds[0]] == [1, 0, 0]
