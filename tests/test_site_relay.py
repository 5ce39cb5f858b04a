"""Weights along chains, one copy per site (StreamRL §6): the trainer sends each version to one
instance per site, which passes each bucket on to the next instance of its site. Real processes
and groups: one instance at the trainer's site, two (then three) at a "cloud" site.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from streamrl.components.generation.hf_generator import fingerprint
from streamrl.components.generation.service import StreamGenerationService
from streamrl.components.generation.timeouts import Timeouts
from streamrl.components.weights.path import WeightPath
from streamrl.policy.models import build_tiny_model, save_policy
from streamrl.records import Request

pytestmark = pytest.mark.timeout(240)


def _nudge(policy: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.01)


def test_remote_site_gets_one_copy_and_its_instances_pass_it_on(tmp_path, tokenizer):
    policy = build_tiny_model(tokenizer, "test", seed=0)
    model_dir = save_policy(policy, tokenizer, tmp_path / "policy")
    payload = sum(p.numel() * p.element_size() for p in policy.parameters())
    sites = ["home", "cloud", "cloud"]
    with StreamGenerationService(
        model_dir, 3, max_batch_size=4, sites=sites, trainer_site="home"
    ) as sgs:
        # The first instances join in id order: instance 1 heads the cloud chain, 2 follows.
        home, head, member = sgs.pool.handles
        assert home.head is None and head.head is None and member.head == head.instance_id
        assert head.members == {member.instance_id} and not member.members
        _nudge(policy)
        sgs.update(policy, version=1)
        assert set(sgs.fingerprints().values()) == {fingerprint(policy)}
        # The trainer sent two copies (home instance, cloud head), not three.
        assert sgs.weight_sync.bytes_sent == 2 * payload

        # A newcomer at the cloud site hangs on the chain's tail and catches up through it.
        new = sgs.add_instance(wait=True, site="cloud")
        assert sgs.pool.handles[new].head == member.instance_id
        assert sgs.fingerprints()[new] == fingerprint(policy)
        _nudge(policy)
        sgs.update(policy, version=2)
        assert set(sgs.fingerprints().values()) == {fingerprint(policy)}
        assert sgs.weight_sync.bytes_sent == 4 * payload
        assert [i.weight_version for i in sgs.instances()] == [2, 2, 2, 2]

        # The tail killed: replaced at its site, on the chain again, nothing lost.
        os.kill(sgs.pool.handles[new].proc.pid, signal.SIGKILL)
        ids = tokenizer("copy ab=")["input_ids"]
        reqs = [Request(f"p{i}", ids, max_tokens=8, iteration=2, forced_length=6) for i in range(8)]
        got = list(sgs.generate(reqs))
        assert sorted(s.key for s in got) == sorted(r.key for r in reqs)
        sgs.wait_active()
        replacement = sgs.pool.handles[-1]
        assert replacement.site == "cloud" and replacement.head == member.instance_id
        assert sgs.fingerprints()[replacement.instance_id] == fingerprint(policy)
        assert member.members == {replacement.instance_id}

        # The head killed: only it is replaced; the trainer feeds the next one, whose chain
        # goes on (re-fed at a version boundary, not replaced); the newcomer joins its tail.
        os.kill(head.proc.pid, signal.SIGKILL)
        done = list(
            sgs.generate(
                [
                    Request(f"q{i}", ids, max_tokens=8, iteration=3, forced_length=4)
                    for i in range(4)
                ]
            )
        )
        assert len(done) == 4
        sgs.wait_active()
        cloud = [h for h in sgs.pool.handles if h.site == "cloud" and h.state == "active"]
        assert [h.instance_id for h in cloud] == [member.instance_id, replacement.instance_id, 5]
        assert [h.head for h in cloud] == [None, member.instance_id, replacement.instance_id]
        assert sgs.counts["instances_restarted"] == 2  # the two killed, no healthy one
        _nudge(policy)
        sgs.update(policy, version=3)
        assert set(sgs.fingerprints().values()) == {fingerprint(policy)}
        # v1, v2: two copies each; instance 2's catch-up from the trainer once re-fed; v3: two.
        assert sgs.weight_sync.bytes_sent == 7 * payload


@pytest.mark.parametrize("instances", [1, 3])
def test_trainer_egress_per_version_does_not_grow_with_instances(tmp_path, tokenizer, instances):
    policy = build_tiny_model(tokenizer, "test", seed=0)
    model_dir = save_policy(policy, tokenizer, tmp_path / "policy")
    payload = sum(p.numel() * p.element_size() for p in policy.parameters())
    with StreamGenerationService(
        model_dir, instances, weights=WeightPath(bucket_mb=4096 / 2**20)
    ) as sgs:
        for version in (1, 2):
            _nudge(policy)
            sgs.update(policy, version=version)
            assert set(sgs.fingerprints().values()) == {fingerprint(policy)}
        assert len(sgs.weight_sync.staged.buffers) > 10  # many buckets, pipelined down the chain
        assert sgs.weight_sync.bytes_sent == 2 * payload  # one copy per version, whatever N


def test_fit_with_a_remote_site(fit_small):
    fit_small(
        generation={"num_instances": 3, "sites": ["home", "cloud", "cloud"], "trainer_site": "home"}
    )


def test_a_transfer_past_the_weight_timeout_fails_that_instance_not_the_trainer(
    tmp_path, tokenizer
):
    """A stopped head (SIGSTOP) takes nothing off the wire: the trainer's send of a 50 MB
    version passes ``weight_timeout_s``, the head is replaced, the instance it fed is fed by
    the trainer instead, and the update completes with every instance on the new weights."""
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        intermediate_size=1536,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    policy = Qwen2ForCausalLM(config).eval()
    model_dir = save_policy(policy, tokenizer, tmp_path / "policy")
    with StreamGenerationService(model_dir, 2, timeouts=Timeouts(weight_s=4.0)) as sgs:
        head, member = sgs.pool.handles
        assert member.head == head.instance_id
        os.kill(head.proc.pid, signal.SIGSTOP)
        _nudge(policy)
        started = time.monotonic()
        sgs.update(policy, version=1)
        assert time.monotonic() - started < 90
        assert head.state == "failed" and sgs.counts["instances_restarted"] == 1
        assert member.state == "active" and member.head is None  # fed by the trainer now
        assert set(sgs.fingerprints().values()) == {fingerprint(policy)}


@pytest.mark.parametrize("mode", ["update", "push"])
def test_a_head_killed_before_its_first_transfer_costs_no_weight_timeout(tmp_path, tokenizer, mode):
    """The head dies before its group ever connected (nothing on the wire yet to fail fast):
    the trainer's rendezvous sees the process gone and gives up at once instead of waiting
    out ``weight_timeout_s``; the member, announced a version it would have had from the dead
    head, sees that it was fed anew and moves on too. In async mode (``push``) the trainer
    is not waiting when the death is noticed: the service learns it from the pipe."""
    policy = build_tiny_model(tokenizer, "test", seed=0)
    model_dir = save_policy(policy, tokenizer, tmp_path / "policy")
    with StreamGenerationService(
        model_dir, 2, max_batch_size=4, timeouts=Timeouts(weight_s=60.0)
    ) as sgs:
        head, member = sgs.pool.handles
        assert member.head == head.instance_id
        os.kill(head.proc.pid, signal.SIGKILL)
        head.proc.join(10)
        _nudge(policy)
        started = time.monotonic()
        if mode == "update":
            sgs.update(policy, version=1)
        else:
            sgs.push_weights(policy, version=1)
            ids = tokenizer("copy ab=")["input_ids"]
            reqs = [
                Request(
                    f"p{i}", ids, max_tokens=8, iteration=1, forced_length=4, min_weight_version=1
                )
                for i in range(4)
            ]
            assert sorted(s.key for s in sgs.generate(reqs)) == sorted(r.key for r in reqs)
            sgs.wait_active()
        assert time.monotonic() - started < 30  # the weight timeout is 60 s
        assert head.state == "failed" and sgs.counts["instances_restarted"] == 1
        assert member.state == "active" and member.head is None
        assert set(sgs.fingerprints().values()) == {fingerprint(policy)}
