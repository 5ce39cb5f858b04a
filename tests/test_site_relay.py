"""Weights to a remote site through its head (StreamRL §6): one copy per version leaves the
trainer for the site, its first instance forwards it to the others. Real processes and groups:
one instance at the trainer's site, two (then three) at a "cloud" site."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from streamrl.components.generation.hf_generator import fingerprint
from streamrl.components.generation.service import StreamGenerationService
from streamrl.models import build_tiny_model, save_policy
from streamrl.records import Request

pytestmark = pytest.mark.timeout(240)


def _nudge(policy: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.01)


def test_remote_site_gets_one_copy_and_its_head_fans_out(tmp_path, tokenizer):
    policy = build_tiny_model(tokenizer, "test", seed=0)
    model_dir = save_policy(policy, tokenizer, tmp_path / "policy")
    payload = sum(p.numel() * p.element_size() for p in policy.parameters())
    sites = ["home", "cloud", "cloud"]
    with StreamGenerationService(
        model_dir, 3, max_batch_size=4, sites=sites, trainer_site="home"
    ) as sgs:
        # The cloud instance that loaded first became the head; the other follows it.
        head, member = sorted(sgs.pool.handles[1:], key=lambda h: h.head is not None)
        assert head.head is None and member.head == head.instance_id
        assert head.members == {member.instance_id}
        _nudge(policy)
        sgs.update(policy, version=1)
        assert set(sgs.fingerprints().values()) == {fingerprint(policy)}
        # The trainer sent two copies (home instance, cloud head), not three.
        assert sgs.weight_sync.bytes_sent == 2 * payload

        # A newcomer at the cloud site catches up through the head, then follows it.
        new = sgs.add_instance(wait=True, site="cloud")
        assert sgs.pool.handles[new].head == head.instance_id
        assert sgs.fingerprints()[new] == fingerprint(policy)
        _nudge(policy)
        sgs.update(policy, version=2)
        assert set(sgs.fingerprints().values()) == {fingerprint(policy)}
        assert sgs.weight_sync.bytes_sent == 4 * payload
        assert [i.weight_version for i in sgs.instances()] == [2, 2, 2, 2]

        # A member killed: replaced at its site, relayed again, nothing lost.
        os.kill(member.proc.pid, signal.SIGKILL)
        ids = tokenizer("copy ab=")["input_ids"]
        reqs = [Request(f"p{i}", ids, max_tokens=8, iteration=2, forced_length=6) for i in range(8)]
        got = list(sgs.generate(reqs))
        assert sorted(s.key for s in got) == sorted(r.key for r in reqs)
        sgs.wait_active()
        replacement = sgs.pool.handles[-1]
        assert replacement.site == "cloud" and replacement.head == head.instance_id
        assert sgs.fingerprints()[replacement.instance_id] == fingerprint(policy)
        assert head.members == {new, replacement.instance_id}

        # The head killed: it and its members are replaced; the site gets a new head.
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
        assert len(cloud) == 3 and sum(h.head is None for h in cloud) == 1
        assert (
            sgs.counts["instances_restarted"] == 2
            and sgs.counts["instances_replaced_with_head"] == 2
        )
        _nudge(policy)
        sgs.update(policy, version=3)
        assert set(sgs.fingerprints().values()) == {fingerprint(policy)}


def test_fit_with_a_remote_site(fit_small):
    fit_small(generators=3, sites=["home", "cloud", "cloud"], trainer_site="home")
