"""Partial rollout and bounded staleness: per-token weight versions, the three policies at a
weight update (finish first, keep the cache, recompute it), the per-token correction, and
dispatch k iterations ahead."""

from __future__ import annotations

import pytest
import torch
from varied_models import varied_model

from streamrl.algorithms import GRPO
from streamrl.components.generation.hf_generator import HFStreamGenerator
from streamrl.components.generation.partial import WeightLoader, check_partial_rollout
from streamrl.components.generation.service import StreamGenerationService
from streamrl.components.training.off_policy import OffPolicyCorrection
from streamrl.components.training.pipeline import MicroBatch
from streamrl.components.weights.staging import StagedWeights
from streamrl.errors import ConfigError
from streamrl.policy.lora import synced_weights
from streamrl.policy.models import build_tiny_model, build_tokenizer, save_policy
from streamrl.records import Request, Sample
from streamrl.training.module import StreamRLModule

torch.set_num_threads(1)

BEFORE = 3  # tokens decoded before the update


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _interrupted(tok, recompute: bool):
    """Two sequences of 8 tokens, new weights (version 1) loaded after their third token, and a
    third request admitted after the update."""
    old, new = varied_model(tok, seed=0), varied_model(tok, seed=1)
    gen = HFStreamGenerator(varied_model(tok, seed=0), max_batch_size=2, greedy=True)
    prompt = tok("rev abc=")["input_ids"]
    gen.submit([Request(f"p{i}", prompt, 8, forced_length=8) for i in range(3)])
    for _ in range(BEFORE):  # one token per running sequence per step; p2 waits for a slot
        assert gen.step() == []
    gen.load_weights(new.state_dict(), version=1)
    if recompute:
        assert gen.recompute_running() == 2 * (len(prompt) - 1 + BEFORE)
    samples = {s.prompt_id: s for s in gen.stream()}
    return samples, old, new


def _logprobs_under(model, sample: Sample) -> torch.Tensor:
    """Log-probs of a forced-length sample's tokens under ``model``, from one full forward."""
    ids = torch.tensor([sample.prompt_ids + sample.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(sample.prompt_ids) - 1 : -1]
    logits[:, model.config.eos_token_id] = float("-inf")  # forced lengths mask EOS
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(1, torch.tensor(sample.token_ids)[:, None]).squeeze(1)


@pytest.mark.parametrize("recompute", [False, True], ids=["keep", "recompute"])
def test_a_sample_interrupted_by_an_update_carries_both_versions_on_the_right_tokens(
    tok, recompute
):
    samples, old, _ = _interrupted(tok, recompute)
    for pid in ("p0", "p1"):
        sample = samples[pid]
        assert sample.token_versions == [0] * BEFORE + [1] * (8 - BEFORE)
        assert sample.weight_version == 0  # the admission version: its oldest token's
        # The tokens before the update are exactly what the old weights give.
        head = _logprobs_under(old, sample)[:BEFORE]
        assert torch.allclose(torch.tensor(sample.logprobs[:BEFORE]), head, atol=1e-4)
    assert samples["p2"].token_versions == [1] * 8 and samples["p2"].weight_version == 1


def test_recompute_continues_exactly_as_the_new_weights_would_and_keep_does_not(tok):
    recomputed, _, new = _interrupted(tok, recompute=True)
    kept, _, _ = _interrupted(tok, recompute=False)
    tail = slice(BEFORE, None)
    for pid in ("p0", "p1"):
        # Recompute: the cache is the new weights', so the rest matches a full forward of them.
        expected = _logprobs_under(new, recomputed[pid])[tail]
        assert torch.allclose(torch.tensor(recomputed[pid].logprobs[tail]), expected, atol=1e-4)
        assert recomputed[pid].prefill_tokens > kept[pid].prefill_tokens  # counted
        # Keep: the old weights' cache under the new weights is neither model's continuation.
        mixed = _logprobs_under(new, kept[pid])[tail]
        assert not torch.allclose(torch.tensor(kept[pid].logprobs[tail]), mixed, atol=1e-3)


class _FakeGenerator:
    def __init__(self) -> None:
        self.idle, self.loaded, self.recomputed = False, [], 0

    def load_weights(self, buffers, version):
        self.loaded.append(version)

    def recompute_running(self):
        self.recomputed += 1
        return 5


def _staged(version: int) -> StagedWeights:
    staged = StagedWeights.like([("w", torch.zeros(2))], pin=False)
    staged.fill([("w", torch.full((2,), float(version)))], version)
    return staged


def test_weight_loader_waits_for_idle_only_when_sequences_must_finish():
    off, keep, again = (WeightLoader(_FakeGenerator(), p) for p in ("finish", "keep", "recompute"))
    for loader in (off, keep, again):
        staged = _staged(1)
        loader.offer(1, staged)
        staged.fill([("w", torch.full((2,), 2.0))], 2)  # version 2 received into the staging
        loader.offer(2, staged)
    assert off.apply() == [] and off.generator.loaded == []  # waits: sequences still run
    off.generator.idle = True
    assert off.apply() == [1, 2] and off.generator.loaded == [2]  # the newest, both announced
    assert keep.apply() == [1, 2] and keep.generator.recomputed == 0
    assert again.apply() == [1, 2] and again.generator.recomputed == 1
    assert again.apply() == [] and again.generator.loaded == [2]  # nothing left pending


def test_weight_loader_waits_while_the_next_version_is_being_received():
    loader, staged = WeightLoader(_FakeGenerator(), "keep"), _staged(1)
    loader.offer(1, staged)
    with staged.lock:  # the receiving thread is filling the staging with version 2
        assert loader.apply() == [] and loader.generator.loaded == []
    assert loader.apply() == [1] and loader.generator.loaded == [1]


def test_unknown_policy_and_generator_without_recompute_fail_clearly():
    with pytest.raises(ConfigError, match="choose one of finish, keep, recompute"):
        check_partial_rollout("drop")
    with pytest.raises(ConfigError, match="recompute_running"):
        WeightLoader(object(), "recompute")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tok):
    path = tmp_path_factory.mktemp("policy")
    save_policy(build_tiny_model(tok, "test", seed=0), tok, path)
    return path


@pytest.mark.timeout(180)
@pytest.mark.parametrize("policy", ["finish", "keep"])
def test_an_instance_finishes_under_old_weights_only_with_policy_finish(model_dir, tok, policy):
    """Real instance: a long sample runs when version 1 is pushed."""
    prompt = tok("copy ab=")["input_ids"]
    trainer = build_tiny_model(tok, "test", seed=1)
    with StreamGenerationService(model_dir, 1, max_batch_size=2, partial_rollout=policy) as sgs:
        sgs.submit([Request("long", prompt, 200, forced_length=200), Request("short", prompt, 5)])
        first = sgs.next_sample()  # the short one: the long one is running now
        assert first.prompt_id == "short"
        sgs.push_weights(synced_weights(trainer), 1)
        sgs.wait_weights(1)
        sgs.submit([Request("after", prompt, 5)])
        samples = {s.prompt_id: s for s in (sgs.next_sample(), sgs.next_sample())}
    long = samples["long"]
    if policy == "finish":  # loaded once the instance was idle: one version per sample
        assert set(long.token_versions) == {0}
    else:  # loaded between two decode steps: the rest of the long sample is version 1's
        assert long.token_versions[0] == 0 and long.token_versions[-1] == 1
        assert long.token_versions == sorted(long.token_versions)
    assert samples["after"].token_versions == [1] * samples["after"].length


def test_each_token_is_corrected_by_its_own_version(tok):
    """A sample whose first two tokens come from version 0 and the rest from 1, trained at
    version 1: only its version-0 tokens are corrected, by the chosen method."""
    policy = build_tiny_model(tok, "test", seed=0)
    prompt = tok("copy ab=")["input_ids"]
    tokens = tok("abab")["input_ids"][:4]
    behaviour = [-3.0, -0.5, -1.0, -1.0]  # ratios to the current policy differ per token
    sample = Sample(
        "p",
        0,
        prompt,
        tokens,
        behaviour,
        weight_version=0,
        instance_id=0,
        token_versions=[0, 0, 1, 1],
    )
    results = {}
    for method in ("decoupled", "behaviour", "mask", "seq_mask"):
        module = StreamRLModule(
            policy,
            GRPO(group_size=2),
            None,
            1,
            temperature=1.0,
            mode="async",
            correction=OffPolicyCorrection(method, is_cap=2.0),
        )
        module.weight_version = 1
        results[method] = module.loss_inputs(MicroBatch([sample], [1.0]))
        assert module.token_lags == {1: 2, 0: 2}  # the staleness histogram, per token
    current = results["decoupled"].logprobs.detach()[0]
    ratio = torch.exp(current[:2] - torch.tensor(behaviour[:2]))
    decoupled = results["decoupled"]
    assert torch.allclose(decoupled.token_weights[0, :2], ratio.clamp(max=2.0))
    assert decoupled.token_weights[0, 2:].tolist() == [1.0, 1.0]
    assert torch.allclose(decoupled.old_logprobs[0, :2], current[:2])  # proximal: current
    assert decoupled.old_logprobs[0, 2:].tolist() == behaviour[2:]  # fresh tokens untouched
    assert results["behaviour"].token_weights is None
    assert results["behaviour"].old_logprobs[0].tolist() == behaviour
    kept = ((ratio <= 2.0) & (ratio >= 0.5)).float()
    assert results["mask"].token_weights[0].tolist() == [*kept.tolist(), 1.0, 1.0]
    assert kept.tolist() != [1.0, 1.0]  # the behaviour log-probs put one token out of band
    # A sequence mask takes every token, fresh ones too: the whole sample goes or stays on
    # the product of its ratios (here far below 1/3: the generator was far more sure).
    seq = results["seq_mask"]
    product = torch.exp((current - torch.tensor(behaviour)).sum())
    assert product < 1 / 3 and seq.token_weights[0].tolist() == [0.0] * 4
    assert torch.allclose(seq.old_logprobs[0], current)


def test_the_engine_gap_correction_treats_fresh_tokens_as_off_policy(tok):
    """Generators in bfloat16 (or vLLM's kernels) give log-probs the trainer's float32 policy
    does not: with the correction on, even fresh tokens take PPO's ratio against the trainer's
    own log-probs and a truncated IS weight trainer/generator; off, the generator's log-probs
    are the old policy as they are; by default on unless both sides compute in float32."""
    policy = build_tiny_model(tok, "test", seed=0)
    tokens = tok("abab")["input_ids"][:4]
    behaviour = [-3.0, -0.5, -1.0, -1.0]
    sample = Sample("p", 0, tok("copy ab=")["input_ids"], tokens, behaviour, 1, 0)
    results = {}
    for on in (True, False):
        module = StreamRLModule(
            policy,
            GRPO(group_size=2),
            None,
            1,
            temperature=1.0,
            correction=OffPolicyCorrection(engine_gap=on),
        )
        module.weight_version = 1  # the sample is fresh
        results[on] = module.loss_inputs(MicroBatch([sample], [1.0]))
    current = results[True].logprobs.detach()[0]
    ratio = torch.exp(current - torch.tensor(behaviour))
    assert torch.allclose(results[True].old_logprobs[0], current)
    assert torch.allclose(results[True].token_weights[0], ratio.clamp(max=2.0))
    assert results[False].old_logprobs[0].tolist() == behaviour
    assert results[False].token_weights is None
    default = StreamRLModule(policy, GRPO(group_size=2), None, 1, temperature=1.0)
    default.on_train_start()  # no generators: the trainer's float32 on both sides
    assert default.correction.engine_gap is False


class _Dispatches:
    """Stands in for a RolloutStream: records each iteration's ``min_weight_version``."""

    def __init__(self, start: int = 0) -> None:
        self.start, self.floors = start, []

    def dispatch(self, min_weight_version: int = 0) -> int:
        self.floors.append(min_weight_version)
        return self.start + len(self.floors) - 1


@pytest.mark.parametrize("bound", [1, 2, 3])
def test_async_dispatches_k_ahead_and_admits_iteration_j_at_version_j_minus_k(tok, bound):
    module = StreamRLModule(
        build_tiny_model(tok, "test"),
        GRPO(group_size=2),
        None,
        6,
        temperature=1.0,
        mode="async",
        staleness_bound=bound,
    )
    module.rollouts = _Dispatches()
    for step in range(6):
        assert module.dispatch(step) == step
        dispatched = len(module.rollouts.floors)
        assert dispatched == min(step + bound + 1, 6)  # k ahead, never past the run
    assert module.rollouts.floors == [max(0, j - bound) for j in range(6)]
    # A resumed run starts with nothing ahead and sends the same window again.
    module._window.ahead, module.rollouts = [], _Dispatches(start=3)
    assert module.dispatch(3) == 3
    assert module.rollouts.floors == [max(0, j - bound) for j in range(3, min(4 + bound, 6))]


@pytest.mark.parametrize(
    ("mode", "bound", "message"),
    [("async", 0, "at least one iteration ahead"), ("sync", 2, "only async mode")],
)
def test_a_bound_the_mode_cannot_keep_is_refused(tok, mode, bound, message):
    with pytest.raises(ValueError, match=message):
        StreamRLModule(
            build_tiny_model(tok, "test"),
            GRPO(group_size=2),
            None,
            2,
            temperature=1.0,
            mode=mode,
            staleness_bound=bound,
        )


@pytest.mark.parametrize(
    ("rl", "message"),
    [
        ({"generation": {"partial_rollout": "keep"}}, "needs rl.module.mode: async"),
        (
            {"module": {"mode": "async"}, "generation": {"partial_rollout": "drop"}},
            r"rl.generation.partial_rollout: 'drop' is not a policy",
        ),
        ({"module": {"mode": "async", "staleness_bound": 0}}, "rl.module: staleness_bound=0"),
        ({"module": {"mode": "colocated", "staleness_bound": 1}}, "only async mode"),
        ({"module": {"mode": "asnyc"}}, r"rl.module: Unknown mode 'asnyc' \(did you mean 'async'"),
        ({"module": {"lr": "3e-5"}}, r"rl.module.lr must be a float, got '3e-5'"),
        ({"module": {"max_grad_norm": 0.0}}, r"rl.module: max_grad_norm must be > 0"),
        ({"module": {"temperature": 1.0}}, r"rl.module: temperature is linked in .*generation"),
    ],
)
def test_config_checks_name_the_key_and_the_fix(rl, message):
    from streamrl.run.config import RLConfig
    from streamrl.run.config_checks import check_rl

    with pytest.raises(ConfigError, match=message):
        check_rl(RLConfig(**rl))
    fine = RLConfig(
        module={"mode": "async", "staleness_bound": 2}, generation={"partial_rollout": "recompute"}
    )
    check_rl(fine)
