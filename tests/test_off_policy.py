"""Off-policy correction of stale samples (async mode), hand-computed."""

from __future__ import annotations

import math

import torch

from streamrl.algorithms import GRPO
from streamrl.algorithms.base import LossInputs
from streamrl.components.training.off_policy import correct_stale


def test_stale_rows_get_proximal_old_logprobs_and_truncated_weights():
    current = torch.log(torch.tensor([[0.5, 0.4], [0.3, 0.6]])).requires_grad_()
    behaviour = torch.log(torch.tensor([[0.25, 0.4], [0.3, 0.1]]))
    mask = torch.tensor([[1, 1], [1, 0]])
    fix = correct_stale(current, behaviour, mask, torch.tensor([True, False]), cap=1.5)
    # Row 0 is stale: ratios pi_prox / pi_behaviour = 2.0 (truncated to 1.5) and 1.0.
    assert fix.weights.tolist() == [[1.5, 1.0], [1.0, 1.0]]
    assert torch.equal(fix.old_logprobs[0], current.detach()[0])  # proximal: current, detached
    assert torch.equal(fix.old_logprobs[1], behaviour[1])  # fresh row untouched
    assert math.isclose(fix.ratio_mean, 1.5) and math.isclose(fix.ratio_max, 2.0)
    assert fix.truncated_frac == 0.5 and fix.stale_samples == 1
    fresh = correct_stale(current, behaviour, mask, torch.tensor([False, False]), cap=1.5)
    assert fresh.weights is None and fresh.old_logprobs is behaviour


def test_weights_scale_the_surrogate_and_its_gradient():
    logprobs = torch.zeros(1, 2, requires_grad=True)
    fix = correct_stale(
        logprobs,
        torch.log(torch.tensor([[0.5, 2.0]])),
        torch.ones(1, 2),
        torch.tensor([True]),
        cap=1.5,
    )
    batch = LossInputs(
        logprobs, fix.old_logprobs, torch.tensor([1.0]), torch.ones(1, 2), token_weights=fix.weights
    )
    loss = GRPO(group_size=2, clip_eps=0.2).loss(batch)  # the base applies them
    # Ratio to the proximal policy is 1 (value), so the loss is -A x weight, averaged: weights
    # min(2, 1.5) = 1.5 and 0.5 -> -(1.5 + 0.5) / 2 = -1.0; d/dlogprob = -weight / 2.
    assert loss.item() == -1.0
    loss.backward()
    assert logprobs.grad.tolist() == [[-0.75, -0.25]]


def _gap(log_ratios: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(current, behaviour)`` whose per-token log-ratios are ``log_ratios`` (behaviour -1)."""
    behaviour = torch.full((len(log_ratios), len(log_ratios[0])), -1.0)
    return behaviour + torch.tensor(log_ratios), behaviour


def _mask(method: str, log_ratios, mask=None, advantages=None, **thresholds):
    current, behaviour = _gap(log_ratios)
    mask = torch.ones_like(current) if mask is None else torch.tensor(mask)
    every = torch.ones(len(log_ratios), dtype=torch.bool)  # the masks correct every sample
    adv = None if advantages is None else torch.tensor(advantages)
    return correct_stale(
        current, behaviour, mask, every, 2.0, method, advantages=adv, thresholds=thresholds
    )


def test_seq_mask_leaves_out_a_sequence_whose_ratio_product_leaves_1_3_to_3():
    """TRL's cap 3.0, both ways: the product of the token ratios, not each token, decides;
    padding is not counted."""
    fix = _mask(
        "seq_mask",
        [
            [0.5, 0.5, 0.2, 0.0],  # product e^1.2 = 3.3 > 3: out, though each token is < 1.7
            [1.0, -0.5, 0.5, 0.0],  # e^1.0 = 2.7: kept, though one token's ratio is e
            [-0.6, -0.6, 0.0, 0.0],  # e^-1.2 = 0.30 < 1/3: out
            [0.6, 0.6, 9.0, 9.0],  # e^1.2, but the last two tokens are padding: kept
        ],
        mask=[[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1], [1, 0, 0, 0]],
    )
    assert fix.weights.tolist() == [[0.0] * 4, [1.0] * 4, [0.0] * 4, [1.0] * 4]
    assert fix.masked_sequences == 2 and fix.masked_tokens == 8
    wider = _mask("seq_mask", [[0.5, 0.5, 0.2, 0.0]], high=4.0)  # a threshold of your own
    assert wider.weights.tolist() == [[1.0] * 4] and wider.masked_sequences == 0


def test_geo_mask_leaves_out_a_sequence_whose_geometric_mean_ratio_leaves_0_99_to_1_01():
    fix = _mask(
        "geo_mask",
        [
            [0.005, 0.005, 0.005, 0.005],  # geometric mean e^0.005 = 1.005: kept
            [0.04, 0.0, 0.0, 0.0],  # e^0.01 = 1.01005 > 1.01: out
            [0.03, -0.03, 0.03, -0.03],  # 1.0 on the mean, though every token is off: kept
            [-0.03, -0.02, 0.0, 0.0],  # e^-0.0125 = 0.988 < 0.99: out
        ],
    )
    assert fix.weights[:, 0].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert fix.masked_sequences == 2


def test_opsm_leaves_out_only_negative_samples_that_drifted_beyond_delta():
    """DeepSeek-V3.2's rule: advantage < 0 and mean log(pi_behaviour / pi_prox) > 1e-4."""
    drifted, close, favoured = [-0.01] * 3, [-0.00005] * 3, [0.01] * 3
    fix = _mask(
        "opsm",
        [drifted, drifted, close, favoured],
        advantages=[-1.0, 1.0, -1.0, -1.0],
    )
    # out: the negative sample whose generator put more mass on its tokens than the trainer
    # does; a positive one is learned from, a small drift or a trainer that favours it too.
    assert fix.weights[:, 0].tolist() == [0.0, 1.0, 1.0, 1.0]
    assert fix.masked_sequences == 1 and fix.masked_tokens == 3


def test_icepop_masks_tokens_outside_0_5_to_5():
    fix = _mask("icepop", [[math.log(0.4), 0.0, math.log(6.0), math.log(4.9)]])
    assert fix.weights.tolist() == [[0.0, 1.0, 0.0, 1.0]]
    assert fix.masked_tokens == 2 and fix.masked_sequences == 0


def test_a_correction_is_named_with_its_thresholds_or_refused_in_one_line():
    import pytest

    from streamrl.components.training.off_policy import OffPolicyCorrection
    from streamrl.errors import ConfigError

    assert OffPolicyCorrection("icepop").thresholds == {"low": 0.5, "high": 5.0}
    assert OffPolicyCorrection("opsm", delta=0.01).thresholds == {"delta": 0.01}
    assert OffPolicyCorrection().name == "decoupled" and OffPolicyCorrection().thresholds == {}
    assert OffPolicyCorrection("seq_mask").every_token
    assert (
        not OffPolicyCorrection().every_token and OffPolicyCorrection(engine_gap=True).every_token
    )
    with pytest.raises(ConfigError, match="choose decoupled, behaviour, mask, seq_mask"):
        OffPolicyCorrection("seq-mask")
    with pytest.raises(ConfigError, match="'seq_mask' takes no delta; its thresholds: low, high"):
        OffPolicyCorrection("seq_mask", delta=3.0)
    with pytest.raises(ConfigError, match="must hold 1"):
        OffPolicyCorrection("icepop", low=1.5)
    with pytest.raises(ConfigError, match="'decoupled' takes no low; its thresholds: none"):
        OffPolicyCorrection(low=0.5)
    with pytest.raises(ConfigError, match="is_cap must be >= 1"):
        OffPolicyCorrection(is_cap=0.5)


def test_the_correction_is_one_section_of_the_config_and_its_old_keys_say_where(tmp_path):
    """``rl.correction`` holds ``OffPolicyCorrection``'s arguments: read from a file and from
    the command line, checked by the class before work; the flat keys it replaced, and its old
    spellings, are refused naming the new place, and ``config migrate`` rewrites them."""
    import pytest

    from streamrl.components.training.off_policy import OffPolicyCorrection
    from streamrl.errors import ConfigError
    from streamrl.run.config_file import load_config
    from streamrl.run.config_migrate import migrate
    from streamrl.run.fit_args import parse_fit

    def config(text: str):
        path = tmp_path / "run.yaml"
        path.write_text(text)
        return load_config(path)

    run = config("rl:\n  correction: {method: icepop, high: 4.0, is_cap: 3.0}\n")
    assert run.rl.correction == OffPolicyCorrection("icepop", is_cap=3.0, high=4.0)
    assert config("rl: {}\n").rl.correction == OffPolicyCorrection()
    refusals = {
        "rl:\n  is_cap: 3.0\n": "rl.correction.is_cap",
        "rl:\n  correct_engine_gap: true\n": "rl.correction.engine_gap",
        "rl:\n  correction: icepop\n": "mapping of OffPolicyCorrection's arguments",
        "rl:\n  correction: {name: icepop}\n": "name has moved: set method",
        "rl:\n  correction: {method: icepop, hihg: 4.0}\n": "did you mean 'high'",
        "rl:\n  correction: {method: tis}\n": "'tis' is not one",
    }
    for text, message in refusals.items():
        with pytest.raises(ConfigError, match=message):
            config(text)
    options = parse_fit(["--rl.correction.method", "seq_mask", "--rl.correction.low", "0.25"])
    assert options.config.rl.correction == OffPolicyCorrection("seq_mask", low=0.25)
    old = {"rl": {"correction": {"name": "geo_mask", "low": 0.995}, "correct_engine_gap": True}}
    assert migrate(old)[0] == {
        "rl": {"correction": {"method": "geo_mask", "low": 0.995, "engine_gap": True}}
    }
    assert migrate({"rl": {"correction": None, "is_cap": 3.0}})[0] == {
        "rl": {"correction": {"is_cap": 3.0}}
    }
