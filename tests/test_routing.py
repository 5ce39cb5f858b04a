"""Rollout routing replay (streamrl.policy.routing) on three MoE families of transformers:
recorded experts are the router's own, a replay uses exactly the recorded ones token by token,
a replay of the router's own choice changes nothing, and replaying a bfloat16 generator's
experts brings a float32 trainer's log-probs closer to the generator's."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn
from transformers import (
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from streamrl.policy.routing import (
    NOT_RECORDED,
    RoutingRecorder,
    RoutingReplay,
    check_replayable,
    extend_recorded,
    is_moe,
    moe_routers,
)

SHAPE = dict(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def mixtral() -> nn.Module:
    config = MixtralConfig(**SHAPE, intermediate_size=48, num_local_experts=8)
    return MixtralForCausalLM(config)


def qwen2_moe() -> nn.Module:
    config = Qwen2MoeConfig(
        **SHAPE,
        intermediate_size=48,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=48,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=False,
    )
    return Qwen2MoeForCausalLM(config)


def qwen3_moe() -> nn.Module:
    config = Qwen3MoeConfig(
        **SHAPE,
        head_dim=8,
        intermediate_size=48,
        moe_intermediate_size=24,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
    )
    return Qwen3MoeForCausalLM(config)


FAMILIES = {"mixtral": mixtral, "qwen2_moe": qwen2_moe, "qwen3_moe": qwen3_moe}


@pytest.fixture(params=sorted(FAMILIES))
def moe(request) -> nn.Module:
    torch.manual_seed(0)
    model = FAMILIES[request.param]()
    for router in moe_routers(model):  # zeros by default in some families: no choice at all
        nn.init.normal_(router.weight, std=0.5)
    return model.eval()


def tokens(batch: int = 4, length: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randint(
        0, SHAPE["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed)
    )


def logprobs(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]


def test_a_dense_model_has_no_routers_and_a_moe_one_one_per_layer(moe):
    assert is_moe(moe) and len(moe_routers(moe)) == SHAPE["num_hidden_layers"]
    from transformers import Qwen2Config, Qwen2ForCausalLM

    dense = Qwen2ForCausalLM(Qwen2Config(**SHAPE, intermediate_size=48))
    assert not is_moe(dense)
    with pytest.raises(ValueError, match="no MoE router"):
        RoutingRecorder(dense)


def test_the_recorder_keeps_each_routers_own_choice_per_token(moe):
    ids = tokens()
    with torch.no_grad(), RoutingRecorder(moe) as recorder:
        out = moe(ids, output_router_logits=True)
        experts = recorder.take()
    assert experts.dtype == torch.int16
    assert experts.shape == (ids.numel(), SHAPE["num_hidden_layers"], 2)
    for layer, logits in enumerate(out.router_logits):  # the top-2 of each layer's logits
        top = torch.topk(logits.float(), 2, dim=-1).indices
        assert torch.equal(top.sort(-1).values, experts[:, layer].long().sort(-1).values)
    assert recorder.take().shape[0] == 0  # taken: cleared


def test_replaying_the_routers_own_choice_changes_nothing(moe):
    ids = tokens()
    with torch.no_grad(), RoutingRecorder(moe) as recorder:
        plain = logprobs(moe, ids)
        experts = recorder.take()
    replay = RoutingReplay(moe)
    with torch.no_grad(), replay.replaying(experts):
        replayed = logprobs(moe, ids)
    torch.testing.assert_close(replayed, plain, rtol=1e-5, atol=1e-5)
    assert replay.take_mismatch() == (0, ids.numel())


def test_the_trainer_computes_every_token_on_the_recorded_experts(moe):
    """Experts recorded from another network (a perturbed router): under replay the routers
    use exactly those, token by token and layer by layer, and the mismatch is counted before."""
    ids = tokens()
    other = copy.deepcopy(moe)
    for router in moe_routers(other):
        router.weight.data += 0.5 * torch.randn_like(router.weight)
    with torch.no_grad(), RoutingRecorder(other) as recorder:
        other(ids)
        recorded = recorder.take()
    replay = RoutingReplay(moe)
    with torch.no_grad(), replay.replaying(recorded), RoutingRecorder(moe) as seen:
        moe(ids)  # the recorder's hooks run after the replay's: they see what was used
        used = seen.take()
    assert torch.equal(used, recorded)
    mismatched, compared = replay.take_mismatch()
    assert compared == ids.numel() and 0 < mismatched <= compared


def test_unrecorded_tokens_are_routed_by_the_router_and_not_counted(moe):
    ids = tokens(batch=2, length=10)
    with torch.no_grad(), RoutingRecorder(moe) as recorder:
        plain = logprobs(moe, ids)
        experts = recorder.take()
    experts[:10] = NOT_RECORDED  # the first sample's tokens: a prompt the engine did not return
    replay = RoutingReplay(moe)
    with torch.no_grad(), replay.replaying(experts):
        replayed = logprobs(moe, ids)
    torch.testing.assert_close(replayed, plain, rtol=1e-5, atol=1e-5)
    assert replay.take_mismatch() == (0, 10)


def test_gradients_reach_the_router_under_replay(moe):
    ids = tokens()
    with torch.no_grad(), RoutingRecorder(moe) as recorder:
        moe(ids)
        experts = recorder.take()
    moe.train()
    with RoutingReplay(moe).replaying(experts):
        logprobs(moe, ids).mean().backward()
    for router in moe_routers(moe):
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_replaying_a_bf16_generators_experts_narrows_the_logprob_gap(moe):
    """The mismatch RL suffers: the generator in bfloat16 flips near-tied choices that the
    float32 trainer makes otherwise; replaying its experts, the trainer's log-probs come closer
    to the generator's."""
    ids = tokens(batch=8, length=32)
    generator = copy.deepcopy(moe).to(torch.bfloat16)
    with torch.no_grad(), RoutingRecorder(generator) as recorder:
        behaviour = logprobs(generator, ids)
        experts = recorder.take()
    replay = RoutingReplay(moe)
    with torch.no_grad(), replay.replaying(experts, apply=False):
        free = logprobs(moe, ids)
    mismatched, _ = replay.take_mismatch()
    with torch.no_grad(), replay.replaying(experts):
        replayed = logprobs(moe, ids)
    assert mismatched > 0, "bf16 flipped no expert choice: the test shows nothing"
    gap_free = (free - behaviour).abs().mean()
    gap_replayed = (replayed - behaviour).abs().mean()
    assert gap_replayed < gap_free


@pytest.mark.gpu
def test_on_a_gpu_the_trainer_computes_a_bf16_generators_tokens_on_its_experts():
    """The CUDA path (``scripts/gpu_check.sh``'s gpu-tests step): the tiny Qwen3-MoE's HF
    generator on the GPU in bfloat16 records each sample's experts; the float32 trainer on the
    GPU, replaying them, routes every recorded token as recorded, and its log-probs come no
    further from the generator's than with its routers free."""
    samples, policy = _moe_samples(torch.bfloat16, device="cuda")
    policy = policy.cuda()
    replay = RoutingReplay(policy)
    gaps = {}
    for apply in (False, True):
        gap = 0.0
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.token_ids], device="cuda")
            experts = torch.from_numpy(s.routed_experts)
            with torch.no_grad(), replay.replaying(experts, apply=apply):
                with RoutingRecorder(policy) as seen:
                    trained = logprobs(policy, ids)[0, len(s.prompt_ids) - 1 :]
                used = seen.take()
            if apply:
                recorded = (experts >= 0).all(-1).all(-1)
                assert torch.equal(used[recorded].cpu(), experts[recorded].long())
            gap += (trained.cpu() - torch.tensor(s.logprobs)).abs().sum().item()
        gaps[apply] = gap
    assert gaps[True] <= gaps[False]


def test_a_sigmoid_gated_router_is_refused_by_name():
    class BiasedTopKRouter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.e_score_correction_bias = nn.Parameter(torch.zeros(4))

    model = nn.Sequential(BiasedTopKRouter())
    with pytest.raises(ValueError, match="BiasedTopKRouter gates with a sigmoid"):
        check_replayable(model)


def test_a_recording_of_another_shape_is_refused(moe):
    ids = tokens()
    replay = RoutingReplay(moe)
    wrong_layers = torch.zeros(ids.numel(), 2, 2, dtype=torch.int16)
    with pytest.raises(ValueError, match="2 layers recorded, the model has 3"):
        replay.arm(wrong_layers)
    wrong_k = torch.zeros(ids.numel(), 3, 1, dtype=torch.int16)
    replay.arm(wrong_k)
    with (
        pytest.raises(ValueError, match="routes 2 experts per token, 1 were recorded"),
        torch.no_grad(),
    ):
        moe(ids)


def test_a_forward_of_another_layout_or_a_copy_is_left_to_the_routers(moe):
    """Armed for one layout of the batch, a forward over another number of tokens (the same
    samples padded) and a copy of the policy (a frozen reference) route by themselves; a
    recomputation of the same forward (activation checkpointing) is counted once."""
    ids = tokens()
    other = copy.deepcopy(moe)
    for router in moe_routers(other):
        router.weight.data += 0.5 * torch.randn_like(router.weight)
    with torch.no_grad(), RoutingRecorder(other) as recorder:
        other(ids)
        recorded = recorder.take()
    replay = RoutingReplay(moe)
    reference = copy.deepcopy(moe)  # copies the hooks too
    with torch.no_grad():
        plain_longer = logprobs(moe, ids[:, :-1])
        plain_reference = logprobs(reference, ids)
        with replay.replaying(recorded):
            assert torch.equal(logprobs(moe, ids[:, :-1]), plain_longer)
            assert torch.equal(logprobs(reference, ids), plain_reference)
            first = logprobs(moe, ids)
            again = logprobs(moe, ids)
    assert torch.equal(first, again)
    mismatched, compared = replay.take_mismatch()
    assert compared == ids.numel() and mismatched > 0


# ------------------------------------------------------------------ through the loop


def _moe_samples(generator_dtype: torch.dtype, n: int = 6, device: str = "cpu"):
    """Samples of the tiny Qwen3-MoE policy from the HF generator in ``generator_dtype`` on
    ``device``, and the float32 policy they came from (on the CPU)."""
    from streamrl.components.generation.hf_generator import HFStreamGenerator
    from streamrl.policy.models import build_tiny_model, build_tokenizer
    from streamrl.records import Request

    tok = build_tokenizer()
    policy = build_tiny_model(tok, "moe-test", seed=0)
    for router in moe_routers(policy):  # sharper routers: more near-ties to flip in bf16
        router.weight.data *= 4
    generator = HFStreamGenerator(
        copy.deepcopy(policy).to(device, generator_dtype),
        max_batch_size=4,
        temperature=1.0,
        seed=0,
    )
    prompts = [tok(f"copy ab{'c' * i}=")["input_ids"] for i in range(n)]
    generator.submit([Request(f"p{i}", p, 16) for i, p in enumerate(prompts)])
    return list(generator.stream()), policy


def test_the_hf_generator_records_each_samples_experts_as_the_trainer_would_choose_them():
    """The same float32 weights on both sides: every fed token's experts are recorded (the
    prompt's, by the prefill; each generated one but the last, by the decode that fed it) and
    the trainer's routers choose exactly those."""
    samples, policy = _moe_samples(torch.float32)
    replay = RoutingReplay(policy)
    for s in samples:
        experts = s.routed_experts
        assert experts.dtype == np.int16
        assert experts.shape == (len(s.prompt_ids) + s.length, 3, 2)
        assert (experts[:-1] >= 0).all() and (experts[-1] == NOT_RECORDED).all()
        ids = torch.tensor([s.prompt_ids + s.token_ids])
        with torch.no_grad(), replay.replaying(torch.from_numpy(experts), apply=False):
            policy(ids)
    mismatched, compared = replay.take_mismatch()
    assert mismatched == 0 and compared == sum(len(s.prompt_ids) + s.length - 1 for s in samples)


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_the_trainer_trains_on_the_bf16_generators_experts_token_by_token(layout):
    """StreamRLModule.loss_inputs on samples of a bfloat16 generator: with replay on, the
    policy's forward uses the recorded experts for every recorded token (a recorder on its
    routers, after the replay's hooks, sees them), whatever the layout; the mismatch it logs is
    counted before the replay; with replay off the routers choose, and it is still logged."""
    from streamrl.algorithms import GRPO
    from streamrl.components.training.layout import layout_batch
    from streamrl.components.training.pipeline import DynamicBatchPipeline, MicroBatch
    from streamrl.training.module import StreamRLModule

    samples, policy = _moe_samples(torch.bfloat16)
    expected = layout_batch(samples, layout, 0, torch.device("cpu")).experts
    recorded = expected[:, 0, 0] >= 0
    mismatches = {}
    for replay in (True, False):
        pipeline = DynamicBatchPipeline(packed=layout == "packed")
        options = dict(temperature=1.0, pipeline=pipeline, routing_replay=replay)
        module = StreamRLModule(policy, GRPO(group_size=2), None, 1, **options)
        with RoutingRecorder(policy) as seen:
            module.loss_inputs(MicroBatch(samples, [1.0] * len(samples)))
            used = seen.take()
        same = (used == expected).all(-1).all(-1)
        assert bool(same[recorded].all()) is replay
        stats = module.gap_stats.tolist()
        mismatches[replay] = stats[2] / stats[3]
        module.routing.close()
    assert mismatches[True] == mismatches[False] > 0  # measured before replay, either way


def test_a_tiny_moe_policy_trains_through_fit_with_2_ranks_and_a_bf16_generator(fit_small):
    """The built-in tiny mixture of experts, warm-started, through ``streamrl fit``: 2
    generators in bfloat16, 2 FSDP ranks in bf16-mixed, routing replay on by default, stopped
    after 2 iterations and resumed to 3; the summary carries the routing mismatch and the
    log-prob gap."""
    run = dict(
        model_size="moe-test",
        generation={"num_instances": 2},
        engine={"class_path": "hf", "init_args": {"dtype": "bfloat16"}},
        trainer={"devices": 2, "precision": "bf16-mixed"},
        checkpoints={"every": 1},
    )
    fit_small(**run)
    # Resumed from its checkpoint to a third iteration: the sharded experts come back.
    summary = fit_small(**{**run, "iterations": 3}, args=("--resume", "auto"))
    assert summary["iterations"] == 3
    assert summary["routing_replay"] is True
    assert 0.0 <= summary["routing_mismatch_frac"] < 0.5
    assert 0.0 < summary["logprob_gap_mean"] < 1.0
    assert summary["trainer"]["ranks"] == 2


def test_an_episodes_turns_extend_its_experts_the_earliest_record_standing():
    """``extend_recorded``: a turn fills the columns the episode has not recorded (its own
    tokens, the observation, the earlier turn's last token); a column an earlier turn recorded
    keeps that turn's experts even where the turn recomputed it otherwise."""
    first = np.full((5, 1, 2), NOT_RECORDED, dtype=np.int16)
    first[:4] = [[[0, 1]], [[2, 3]], [[4, 5]], [[6, 7]]]  # prompt 3 + 2 generated, last unfed
    turn = np.full((8, 1, 2), NOT_RECORDED, dtype=np.int16)
    turn[1:7] = 1  # recomputed its prompt (the episode so far) otherwise; the last unfed
    merged = extend_recorded(first, turn)
    np.testing.assert_array_equal(merged[:4], first[:4])
    assert (merged[4:7] == 1).all() and (merged[7] == NOT_RECORDED).all()
    assert extend_recorded(None, turn) is turn and extend_recorded(first, None) is first
    with pytest.raises(ValueError, match="do not extend the episode's"):
        extend_recorded(turn, first)


def test_a_mixtral_directory_trains_through_fit_with_2_ranks_and_a_bf16_generator(
    fit_small, tmp_path
):
    """A Mixtral (the other family of sparse blocks), as a local Hugging Face directory of
    random weights saved per expert under Mixtral's checkpoint names: 2 bfloat16 generators, 2
    FSDP ranks in bf16-mixed, routing replay on by default, the trained policy saved and
    loaded back with transformers."""
    from transformers import AutoModelForCausalLM

    from streamrl.policy.models import build_tokenizer, save_policy

    tok = build_tokenizer()
    config = MixtralConfig(
        **{**SHAPE, "vocab_size": len(tok), "max_position_embeddings": 256},
        intermediate_size=48,
        num_local_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    model_dir = save_policy(MixtralForCausalLM(config), tok, tmp_path / "mixtral")
    summary = fit_small(
        generation={"num_instances": 2},
        engine={"class_path": "hf", "init_args": {"dtype": "bfloat16"}},
        trainer={"devices": 2, "precision": "bf16-mixed"},
        args=("--model", str(model_dir)),
    )
    assert summary["routing_replay"] is True and summary["trainer"]["ranks"] == 2
    assert 0.0 <= summary["routing_mismatch_frac"] < 0.5
    trained = AutoModelForCausalLM.from_pretrained(summary["policy_dir"])
    assert type(trained).__name__ == "MixtralForCausalLM"
    assert any(".block_sparse_moe.experts.0.w1." in n for n in _saved_names(summary))


def _saved_names(summary: dict) -> set[str]:
    """The tensor names in a run's saved policy's safetensors files."""
    from pathlib import Path

    from safetensors import safe_open

    names: set[str] = set()
    for path in Path(summary["policy_dir"]).glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            names |= set(f.keys())
    return names
