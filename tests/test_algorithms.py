"""The algorithm contract, RLOO, REINFORCE++, DAPO options and PPO: hand-computed values, then
the real loop."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from streamrl.algorithms import (
    ALGORITHMS,
    DAPO,
    GRPO,
    PPO,
    RLOO,
    Algorithm,
    LossInputs,
    ReinforcePlusPlus,
    ReinforcePlusPlusBaseline,
    RunFacts,
    TokenLoss,
    build_algorithm,
)
from streamrl.algorithms.base import reduce_token_loss
from streamrl.algorithms.grpo import overlong_penalty
from streamrl.algorithms.losses import policy_token_loss
from streamrl.algorithms.ppo import clipped_value_loss, gae, terminal_rewards
from streamrl.algorithms.reinforce_pp import RunningMoments
from streamrl.errors import ConfigError
from streamrl.records import Sample

pytestmark = pytest.mark.timeout(120)


def _batch(advantages, ratios, mask, **kw) -> LossInputs:
    """A micro-batch whose current / behaviour ratios are the given numbers."""
    old = torch.log(torch.full((len(ratios), len(ratios[0])), 0.5))
    logprobs = old + torch.log(torch.tensor(ratios))
    return LossInputs(logprobs, old, torch.tensor(advantages), torch.tensor(mask), **kw)


# -- RLOO ----------------------------------------------------------------------------------------
def test_rloo_leave_one_out_advantages():
    rloo = RLOO(group_size=3)
    # Sum 1.5. Others' means: (1.5-1)/2 = 0.25, (1.5-0)/2 = 0.75, (1.5-0.5)/2 = 0.5.
    assert rloo.score_group([1.0, 0.0, 0.5]) == pytest.approx([0.75, -0.75, 0.0])
    # Sum 2: a 1 is baselined by 1/3, a 0 by 2/3.
    assert rloo.score_group([1.0, 0.0, 0.0, 1.0]) == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    with pytest.raises(ValueError, match="group_size >= 2"):
        RLOO(group_size=1)


def test_rloo_loss_is_the_shared_clipped_surrogate_with_k3_kl():
    rloo = RLOO(group_size=2, clip_eps=0.2, kl_coef=0.1)
    batch = _batch([0.75, -0.75], [[1.0, 2.0], [1.0, 1.0]], [[1, 1], [1, 0]])
    batch.ref_logprobs = batch.logprobs.detach() + torch.log(torch.tensor(2.0))
    # k3 with ref - cur = ln 2: 2 - ln 2 - 1 = 0.30685 per token, x 0.1 = 0.030685.
    # Sample 0 (A=0.75): ratios 1 and 2 (clipped to 1.2): -(0.75 + 0.9) / 2 = -0.825.
    # Sample 1 (A=-0.75): ratio 1 on its only real token: 0.75.
    kl = 0.1 * (2 - torch.log(torch.tensor(2.0)).item() - 1)
    assert rloo.loss(batch).tolist() == pytest.approx([-0.825 + kl, 0.75 + kl])
    # GRPO computes the very same loss from the same pieces.
    grpo = GRPO(group_size=2, clip_eps=0.2, kl_coef=0.1)
    assert torch.allclose(grpo.loss(batch), rloo.loss(batch))
    terms = policy_token_loss(batch, 0.2, kl_coef=0.1)
    assert torch.allclose(reduce_token_loss(terms, batch, None), rloo.loss(batch))
    # The KL term is auxiliary: the off-policy token weights do not scale it.
    terms = policy_token_loss(batch, 0.2, kl_coef=0.1)
    assert terms.auxiliary is not None and torch.allclose(terms.auxiliary, torch.full((2, 2), kl))


# -- REINFORCE++ ---------------------------------------------------------------------------------
def test_running_moments_window_and_state():
    m = RunningMoments(window=None)
    m.update([1.0, 0.0, 1.0, 1.0])  # mean 0.75, var 3/4 - 0.75^2 = 0.1875
    assert (m.mean, m.std) == pytest.approx((0.75, 0.1875**0.5))
    w = RunningMoments(window=2)  # each new value halves the weight of the older ones
    w.update([1.0])
    w.update([0.0])  # (0.5 * 1 + 1 * 0) / 1.5
    assert w.mean == pytest.approx(1 / 3)
    restored = RunningMoments(window=2)
    restored.load_state_dict(w.state_dict())
    assert (restored.mean, restored.std) == (w.mean, w.std)


def test_reinforce_pp_normalises_over_the_stream_not_the_group():
    algo = ReinforcePlusPlus(group_size=2, norm_window=None)
    # First group alone: mean 0.5, std 0.5 -> +-1.
    assert algo.score_group([1.0, 0.0]) == pytest.approx([1, -1], abs=1e-5)
    # Stream {1, 0, 1, 1}: mean 0.75, std 0.4330 -> 0.25 / 0.4330 = 0.5774 each. A group of equal
    # rewards still gets a signal (GRPO would give it 0).
    assert algo.score_group([1.0, 1.0]) == pytest.approx([0.57735] * 2, abs=1e-4)
    # Stream {1, 0, 1, 1, 0, 0}: mean 0.5, std 0.5 -> -1 each.
    assert algo.score_group([0.0, 0.0]) == pytest.approx([-1, -1], abs=1e-5)
    assert ReinforcePlusPlus().score_group([0.3]) == [0.0]  # one value: no std


def test_reinforce_pp_baseline_subtracts_group_mean_then_stream_std():
    algo = ReinforcePlusPlusBaseline(group_size=2, norm_window=None)
    # x = [0.5, -0.5]: std 0.5 -> +-1.
    assert algo.score_group([1.0, 0.0]) == pytest.approx([1, -1], abs=1e-5)
    assert algo.score_group([1.0, 1.0]) == [0.0, 0.0]  # x = [0, 0]
    # x = [0.25, -0.25]; stream {.5, -.5, 0, 0, .25, -.25}: mean 0 (each group sums to 0),
    # var 0.625 / 6 = 0.10417, std 0.32275 -> 0.25 / 0.32275 = 0.77460.
    assert algo.score_group([0.5, 0.0]) == pytest.approx([0.7746, -0.7746], abs=1e-4)
    assert algo.moments.mean == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError, match="baseline needs group_size >= 2"):
        ReinforcePlusPlusBaseline(group_size=1)
    restored = ReinforcePlusPlusBaseline(group_size=2, norm_window=None)
    restored.load_state_dict(algo.state_dict())
    assert restored.score_group([1.0, 0.0]) == algo.score_group([1.0, 0.0])


# -- DAPO options on GRPO ------------------------------------------------------------------------
def test_clip_higher_is_asymmetric():
    batch = _batch([1.0, -1.0], [[1.5], [0.5]], [[1], [1]])
    symmetric = GRPO(group_size=2, clip_eps=0.2)
    higher = GRPO(group_size=2, clip_eps=0.2, clip_eps_high=0.28)
    # A = +1, ratio 1.5: clipped at 1.2 (symmetric) or 1.28 (clip-higher): loss -1.2 / -1.28.
    # A = -1, ratio 0.5: min(-0.5, -0.8) = -0.8 either way (the lower clip is unchanged): 0.8.
    assert symmetric.loss(batch).tolist() == pytest.approx([-1.2, 0.8])
    assert higher.loss(batch).tolist() == pytest.approx([-1.28, 0.8])


def test_token_level_loss_weighs_every_token_the_same():
    batch = _batch([1.0, -1.0], [[1.0, 1.0], [1.0, 1.0]], [[1, 1], [1, 0]])
    # Ratio 1: each token's loss is -A. Sample mean: [-1, 1]; token level: sums [-2, 1] / 4.
    assert GRPO(group_size=2).loss(batch).tolist() == pytest.approx([-1.0, 1.0])
    token = GRPO(group_size=2, token_level=True, max_tokens=4)
    assert token.loss(batch).tolist() == pytest.approx([-0.5, 0.25])
    # The trainer divides the sum by N = 2 samples: (-1 - 1 + 1) / (2 * 4) = -1/8, the same
    # however the samples are split into micro-batches.
    split = [
        token.loss(_batch([a], [r], [m]))
        for a, r, m in [(1.0, [1.0, 1.0], [1, 1]), (-1.0, [1.0, 1.0], [1, 0])]
    ]
    assert float(sum(s.sum() for s in split)) / 2 == pytest.approx(-1 / 8)
    with pytest.raises(ValueError, match="need max_tokens"):
        GRPO(group_size=2, token_level=True)


def test_overlong_penalty_values_and_score_sample():
    # Budget 16, buffer 4: free up to 12 tokens, then 1/4 per token, capped at 1.
    got = [overlong_penalty(n, max_tokens=16, buffer=4) for n in (1, 12, 13, 14, 16, 20)]
    assert got == [0.0, 0.0, 0.25, 0.5, 1.0, 1.0]
    grpo = GRPO(group_size=2, max_tokens=16, overlong_buffer=4)
    sample = Sample("q", 0, [5], [7] * 14, [-0.1] * 14, 0, 0)  # 14 tokens: penalty 2/4 = 0.5
    # score_sample shapes the task reward it is given: minus the overlong penalty.
    assert grpo.score_sample(sample, 1.0) == pytest.approx(1.0 - 0.5)
    assert grpo.score_sample(sample, 0.25) == pytest.approx(0.25 - 0.5)
    short = Sample("q", 1, [5], [7] * 12, [-0.1] * 12, 0, 0)  # 12 tokens: within the free budget
    assert grpo.score_sample(short, 1.0) == 1.0
    assert GRPO(group_size=2).score_sample(sample, 1.0) == 1.0  # default off: unchanged
    assert Algorithm().score_sample(sample, 0.75) == 0.75  # the base returns the reward as is
    dapo = DAPO(group_size=2, max_tokens=16)  # buffer 16 // 5 = 3: free up to 13 tokens
    assert dapo.score_sample(sample, 1.0) == pytest.approx(1.0 - 1 / 3)
    with pytest.raises(ValueError, match="overlong_buffer must be in"):
        GRPO(group_size=2, max_tokens=16, overlong_buffer=17)


def test_keep_group_filters_zero_variance_groups():
    assert Algorithm().keep_group([1.0, 1.0])  # the default keeps everything
    assert GRPO(group_size=2).keep_group([0.0, 0.0])  # off by default
    grpo = GRPO(group_size=2, dynamic_sampling=True)
    assert not grpo.keep_group([1.0, 1.0, 1.0]) and not grpo.keep_group([0.0, 0.0])
    assert grpo.keep_group([1.0, 0.0]) and grpo.keep_group([0.5, 0.501])


def test_dapo_turns_every_option_on():
    algo = DAPO(group_size=4, max_tokens=64)
    assert isinstance(algo, GRPO)
    assert (algo.clip_eps, algo.clip_eps_high, algo.token_level) == (0.2, 0.28, True)
    assert (algo.overlong_buffer, algo.dynamic_sampling) == (12, True)  # 64 // 5
    assert algo.token_norm == 64.0 and GRPO().token_norm is None
    # The same loss as GRPO with the same options.
    batch = _batch([1.0, -1.0], [[1.5, 1.0], [0.5, 1.0]], [[1, 1], [1, 0]])
    grpo = GRPO(group_size=4, clip_eps_high=0.28, token_level=True, max_tokens=64)
    assert torch.equal(algo.loss(batch), grpo.loss(batch))


# -- PPO -----------------------------------------------------------------------------------------
def test_gae_hand_computed():
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    rewards = terminal_rewards(torch.tensor([1.0, 2.0]), mask)
    assert rewards.tolist() == [[0, 0, 1], [0, 2, 0]]
    values = torch.tensor([[0.5, 0.25, 0.5], [1.0, 0.5, 9.0]])  # 9.0 sits on padding
    advantages, returns = gae(rewards, values, mask, gamma=0.9, lam=0.5)
    # Row 0: d2 = 1 - 0.5 = 0.5; d1 = 0.9*0.5 - 0.25 = 0.2; d0 = 0.9*0.25 - 0.5 = -0.275.
    #   A2 = 0.5; A1 = 0.2 + 0.45*0.5 = 0.425; A0 = -0.275 + 0.45*0.425 = -0.08375.
    # Row 1 (length 2, V after it is 0): d1 = 2 - 0.5 = 1.5; d0 = 0.9*0.5 - 1 = -0.55;
    #   A1 = 1.5; A0 = -0.55 + 0.45*1.5 = 0.125; the padded position stays 0.
    expected = [[-0.08375, 0.425, 0.5], [0.125, 1.5, 0.0]]
    assert advantages.tolist() == [pytest.approx(row) for row in expected]
    # Returns = A + V: [0.41625, 0.675, 1.0] and [1.125, 2.0, 0].
    assert returns.tolist() == [pytest.approx(r) for r in [[0.41625, 0.675, 1], [1.125, 2, 0]]]
    # gamma = lambda = 1: Monte-Carlo, A_t = R - V_t.
    mc, _ = gae(rewards[:1], values[:1], mask[:1], gamma=1.0, lam=1.0)
    assert mc.tolist()[0] == pytest.approx([0.5, 0.75, 0.5])


def test_value_loss_clipping():
    values = torch.tensor([1.0, 0.0], requires_grad=True)
    old, returns = torch.tensor([0.5, 0.5]), torch.tensor([2.0, 2.0])
    loss = clipped_value_loss(values, old, returns, clip_eps=0.2)
    # Token 0: (1-2)^2 = 1 vs clipped V = 0.5+0.2 = 0.7: (0.7-2)^2 = 1.69 -> 0.5 * 1.69 = 0.845.
    # Token 1: (0-2)^2 = 4 vs clipped V = 0.5-0.2 = 0.3: 2.89 -> 0.5 * 4 = 2.
    assert loss.tolist() == pytest.approx([0.845, 2.0])
    loss.sum().backward()
    # The pessimistic max picks the clipped term for token 0: no gradient; token 1: V - R = -2.
    assert values.grad.tolist() == pytest.approx([0.0, -2.0])


def test_ppo_loss_hand_computed():
    ppo = PPO(hidden_size=4, gamma=1.0, lam=1.0, value_coef=0.5)
    values = torch.tensor([[0.5, 0.5]], requires_grad=True)
    batch = _batch([1.0], [[1.0, 1.0]], [[1, 1]], values=values)
    # Reward 1 on the last token; V = 0.5: A = [0.5, 0.5], returns [1, 1].
    # Per token: policy -0.5, value 0.5 * 0.5 * (0.5 - 1)^2 = 0.0625: total -0.4375.
    assert ppo.loss(batch).tolist() == pytest.approx([-0.4375])
    with pytest.raises(ValueError, match=r"needs LossInputs\.values"):
        ppo.loss(_batch([1.0], [[1.0]], [[1]]))


def test_ppo_kl_penalty_goes_into_the_token_rewards():
    ppo = PPO(hidden_size=4, kl_coef=0.5, gamma=1.0, lam=1.0, value_coef=0.0)
    batch = _batch([1.0], [[1.0, 1.0]], [[1, 1]], values=torch.zeros(1, 2))
    batch.ref_logprobs = batch.old_logprobs - torch.log(torch.tensor(2.0))  # log old - ref = ln 2
    # Token rewards: -0.5 ln 2 = -0.34657 each, plus 1 on the last: [-0.34657, 0.65343].
    # V = 0, gamma = lambda = 1: A = returns-to-go = [0.30685, 0.65343]; loss = -mean(A).
    assert ppo.loss(batch).tolist() == pytest.approx([-(0.306853 + 0.653426) / 2])


def test_ppo_value_head_on_the_policy(tiny_model):
    ppo = PPO(hidden_size=tiny_model.config.hidden_size)
    input_ids = torch.tensor([[5, 6, 7, 8, 0], [5, 6, 7, 8, 9]])
    attention = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    values = ppo.token_values(tiny_model, input_ids, attention, torch.tensor([2, 3]), width=2)
    assert values.shape == (2, 2) and values.abs().sum() == 0  # zero-initialised head
    torch.nn.init.normal_(ppo.value_head.weight)
    values = ppo.token_values(tiny_model, input_ids, attention, torch.tensor([2, 3]), width=2)
    values.sum().backward()
    assert ppo.value_head.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in tiny_model.parameters())  # train_trunk=False
    shared = PPO(hidden_size=tiny_model.config.hidden_size, train_trunk=True)
    torch.nn.init.normal_(shared.value_head.weight)
    shared.token_values(tiny_model, input_ids, attention, torch.tensor([2, 3]), 2).sum().backward()
    assert any(p.grad is not None for p in tiny_model.parameters())
    assert ppo.trainable_parameters() == [ppo.value_head.weight, ppo.value_head.bias]
    restored = PPO(hidden_size=tiny_model.config.hidden_size)
    restored.load_state_dict(ppo.state_dict())
    assert torch.equal(restored.value_head.weight, ppo.value_head.weight)


# -- Registry ------------------------------------------------------------------------------------
RUN = RunFacts(group_size=4, max_tokens=32, hidden_size=8, prompts_per_iteration=4)


def test_every_config_name_builds():
    expected = {
        "grpo": GRPO,
        "rloo": RLOO,
        "reinforce++": ReinforcePlusPlus,
        "reinforce++-baseline": ReinforcePlusPlusBaseline,
        "ppo": PPO,
        "dapo": DAPO,
    }
    assert expected == ALGORITHMS
    for name, cls in expected.items():
        assert type(build_algorithm(name, RUN)) is cls
    assert build_algorithm("dapo", RUN).dynamic_sampling
    assert build_algorithm("reinforce++-baseline", RUN).baseline
    assert not build_algorithm("reinforce++", RUN).baseline
    with pytest.raises(ConfigError, match="did you mean 'rloo'"):
        build_algorithm("rlo", RUN)


def test_from_run_gives_each_algorithm_what_it_declares():
    assert RUN.samples_per_iteration == 16
    ppo = PPO.from_run(RUN)
    assert ppo.value_head.in_features == 8 and ppo.group_size == 4  # the policy's hidden size
    dapo = DAPO.from_run(RUN)
    assert (dapo.max_tokens, dapo.token_norm, dapo.overlong_buffer) == (32, 32.0, 6)
    grpo = GRPO.from_run(RUN)  # plain GRPO needs no generation budget
    assert (grpo.max_tokens, grpo.token_norm, grpo.group_size) == (None, None, 4)
    # REINFORCE++ (and its baseline variant) normalise over about one iteration's samples.
    for cls in (ReinforcePlusPlus, ReinforcePlusPlusBaseline):
        assert cls.from_run(RUN).moments.decay == pytest.approx(1 - 1 / 16)
    # The shared facts reach every constructor; explicit options win over the run's facts.
    facts = RunFacts(group_size=2, max_tokens=8, hidden_size=4, prompts_per_iteration=1)
    for cls in ALGORITHMS.values():  # the run's group size; clip range and KL are their own
        algo = cls.from_run(facts, clip_eps=0.3, kl_coef=0.05)
        assert (algo.group_size, algo.clip_eps, algo.kl_coef) == (2, 0.3, 0.05), cls
    assert PPO.from_run(RUN, hidden_size=3, gamma=0.9).value_head.in_features == 3
    assert DAPO.from_run(RUN, max_tokens=10).max_tokens == 10
    assert GRPO.from_run(RUN, group_size=2).group_size == 2


def test_build_algorithm_takes_a_class():
    class Constant(Algorithm):
        def score_group(self, rewards):
            return [1.0] * len(rewards)

        def token_loss(self, batch: LossInputs) -> TokenLoss:
            return TokenLoss(-batch.logprobs)

    algo = build_algorithm(Constant, RUN)
    assert type(algo) is Constant and (algo.group_size, algo.clip_eps) == (4, 0.2)
    assert type(build_algorithm(PPO, RUN, gamma=0.5)) is PPO
    with pytest.raises(TypeError, match=r"not a subclass of streamrl\.algorithms\.Algorithm nor a"):
        build_algorithm(dict, RUN)  # type: ignore[arg-type]


# -- The contract the base enforces --------------------------------------------------------------
def test_a_subclass_defining_loss_fails_at_class_creation():
    with pytest.raises(TypeError, match=r"override token_loss\(\) instead.*token weights"):

        class Forgetful(GRPO):
            def loss(self, batch: LossInputs) -> torch.Tensor:  # would skip token_weights
                return super().loss(batch)

    with pytest.raises(TypeError, match="Bare defines loss"):

        class Bare(Algorithm):
            def loss(self, batch: LossInputs) -> torch.Tensor:
                return batch.logprobs.sum(1)


def test_the_base_applies_token_weights_mask_and_auxiliary_terms():
    class PlainReinforce(Algorithm):
        """Mentions neither token weights nor the mask."""

        def score_group(self, rewards):
            return list(rewards)

        def token_loss(self, batch: LossInputs) -> TokenLoss:
            policy = -batch.advantages[:, None] * batch.logprobs
            return TokenLoss(policy, auxiliary=torch.full_like(policy, 0.1))

    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -4.0, -9.0]], requires_grad=True)
    weights = torch.tensor([[1.5, 0.5, 7.0], [2.0, 9.0, 9.0]])  # padding's weights are ignored
    batch = LossInputs(
        logprobs,
        logprobs.detach(),
        advantages=torch.tensor([2.0, -1.0]),
        mask=torch.tensor([[1, 1, 0], [1, 0, 0]]),
        token_weights=weights,
    )
    algo = PlainReinforce()
    # Policy terms -A * logprob: [2, 4, (6)] and [-0.5, (-4), (-9)]; weighted: [3, 2] and [-1];
    # plus 0.1 each (auxiliary, not weighted); masked means: (3.1 + 2.1) / 2 = 2.6 and -0.9.
    loss = algo.loss(batch)
    assert loss.tolist() == pytest.approx([2.6, -0.9])
    loss.sum().backward()
    # d/dlogprob = -A * weight / real tokens; 0 on padding.
    assert logprobs.grad.tolist() == [[-1.5, -0.5, 0.0], [2.0, 0.0, 0.0]]
    # Fresh samples (no weights): [2.1, 4.1] -> 3.1 and [-0.4] -> -0.4.
    batch.token_weights = None
    assert algo.loss(batch).tolist() == pytest.approx([3.1, -0.4])
    # A token_norm divides each sample's token sum by a constant instead: 6.2 / 4, -0.4 / 4.
    algo.token_norm = 4.0
    assert algo.loss(batch).tolist() == pytest.approx([1.55, -0.1])


def test_group_size_below_the_minimum_fails_naming_the_algorithm_and_the_fix():
    for make, name in [
        (lambda: GRPO(group_size=1), "GRPO"),
        (lambda: DAPO(group_size=1, max_tokens=8), "DAPO"),
        (lambda: RLOO(group_size=1), "RLOO"),
    ]:
        with pytest.raises(ValueError, match=rf"^{name} needs group_size >= 2 .*got 1.*group_size"):
            make()
    with pytest.raises(ValueError, match="to compare samples, got 1: set group_size"):
        GRPO(group_size=1)
    assert ReinforcePlusPlus(group_size=1).group_size == 1  # its minimum is 1

    class Triplets(Algorithm):
        min_group_size = 3
        group_size_reason = "to rank three samples"

    with pytest.raises(ValueError, match=r"Triplets needs group_size >= 3 to rank three samples"):
        Triplets(group_size=2)
    with pytest.raises(ValueError, match=r"Algorithm needs group_size >= 1, got 0"):
        Algorithm(group_size=0)
    with pytest.raises(ValueError, match=r"RLOO: clip_eps .* must be > 0, got 0"):
        RLOO(group_size=2, clip_eps=0)
    with pytest.raises(ValueError, match=r"PPO: kl_coef must be >= 0"):
        PPO(hidden_size=4, kl_coef=-0.1)


def test_needs_reference_and_shardable_are_declared():
    assert not GRPO().needs_reference
    assert GRPO(kl_coef=0.1).needs_reference
    assert PPO.from_run(RUN, kl_coef=0.2).needs_reference
    assert [name for name, cls in ALGORITHMS.items() if not cls.shardable] == ["ppo"]


# -- The real loop -------------------------------------------------------------------------------
def _doc_snippet() -> str:
    doc = (Path(__file__).resolve().parents[1] / "docs" / "algorithms.md").read_text()
    section = doc.split("## Write your own algorithm", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_docs_write_your_own_snippet_runs(capsys):
    namespace: dict = {}
    exec(compile(_doc_snippet(), "docs/algorithms.md", "exec"), namespace)
    first, second = capsys.readouterr().out.splitlines()[:2]
    assert first == "[1.0, 0.0]" and second.startswith("[0.91")
    assert len(_doc_snippet().split("\n\nalgo =")[0].splitlines()) < 40


@pytest.mark.timeout(240)
def test_rloo_ppo_and_the_doc_algorithm_train_in_the_real_loop(tmp_path, tokenizer):
    from streamrl.components.generation.service import StreamGenerationService
    from streamrl.policy.models import build_tiny_model, save_policy
    from streamrl.tasks import make_prompt_set
    from streamrl.training.builders import build_trainer
    from streamrl.training.module import StreamRLModule
    from streamrl.training.prompts import PromptSource
    from streamrl.training.rollout import RolloutStream

    namespace: dict = {}
    exec(compile(_doc_snippet(), "docs/algorithms.md", "exec"), namespace)
    policy = build_tiny_model(tokenizer, "test", seed=0)
    save_policy(policy, tokenizer, tmp_path / "policy")
    prompts = make_prompt_set(32, ["copy", "count"], median_len=3, max_len=6, seed=0)
    hidden = policy.config.hidden_size

    def varied(completion: str, answer: str) -> float:
        # The untrained policy scores ~0 on the tasks. Distinct characters differ between random
        # completions (signal for RLOO) and the offset keeps rewards off 0 (with V = 0 at the
        # start, all-zero rewards would give PPO no gradient at all).
        return 0.5 + len(set(completion)) / 16

    runs = [
        RLOO(group_size=2),
        PPO(hidden_size=hidden),
        namespace["MovingAverageReinforce"](),
    ]
    # One generator process for all three runs (each spawn costs seconds of imports); each run
    # continues the weight versions of the one before.
    with StreamGenerationService(tmp_path / "policy", 1, max_batch_size=8) as sgs:
        for algorithm in runs:
            before = {k: v.clone() for k, v in policy.state_dict().items()}
            head = [p.detach().clone() for p in algorithm.trainable_parameters()]
            rollouts = RolloutStream(
                sgs,
                PromptSource(prompts, 4),
                tokenizer,
                algorithm,
                reward=varied,
                max_tokens=8,
                context=256,
            )
            # StreamRLModule's own configure_optimizers: it must hand PPO's value head to the
            # optimizer (a module overriding it here would hide a head left out).
            module = StreamRLModule(policy, algorithm, rollouts, iterations=2, lr=1e-3)
            module.weight_version = start = sgs.weight_version
            trainer = build_trainer(module, show_progress=False)
            trainer.fit(module)
            assert module.weight_version == start + 2 and len(module.history) == 2
            assert module.samples_trained == 2 * 4 * algorithm.group_size
            changed = [k for k, v in policy.state_dict().items() if not torch.equal(v, before[k])]
            assert len(changed) > len(before) // 2, type(algorithm).__name__
            optimized = {id(p) for g in trainer.optimizers[0].param_groups for p in g["params"]}
            head_ids = {id(p) for p in algorithm.trainable_parameters()}
            assert head_ids <= optimized, "the algorithm's parameters are not in the optimizer"
            for old, new in zip(head, algorithm.trainable_parameters()):
                assert not torch.equal(old, new)  # PPO's value head trained too
    assert len(runs[1].trainable_parameters()) == 2


def test_a_module_built_directly_never_drops_the_kl_term_asked_for(tokenizer):
    """``StreamRLModule(policy, GRPO(kl_coef=0.1), ...)`` without a reference would train with no
    KL penalty: refused, naming the builder that makes the reference; ``build_module`` keeps
    it and the loss then carries the KL term."""
    from streamrl.policy.models import build_tiny_model
    from streamrl.training.builders import build_module
    from streamrl.training.module import StreamRLModule

    policy = build_tiny_model(tokenizer, "test", seed=0)
    with pytest.raises(ValueError, match=r"GRPO needs a frozen reference policy.*build_module"):
        StreamRLModule(policy, GRPO(group_size=2, kl_coef=0.1), None, iterations=1)
    assert StreamRLModule(policy, GRPO(group_size=2), None, iterations=1).reference is None
    built = build_module(
        policy, GRPO(group_size=2, kl_coef=0.1), None, iterations=1, temperature=1.0
    )
    assert built.reference is not None
