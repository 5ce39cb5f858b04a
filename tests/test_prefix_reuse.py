"""An episode's next turn reuses the KV cache of its previous turn on the same instance
(``PrefixStash``): the same tokens and log-probs as a full prefill, with fewer tokens computed."""

from __future__ import annotations

import pytest
import torch
from varied_models import varied_model

from streamrl.components import HFStreamGenerator
from streamrl.policy.models import build_tokenizer
from streamrl.records import Request

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _turns(gen: HFStreamGenerator, tok, observations: list[str], others: bool) -> list:
    """Three turns of two episodes (``a`` kept, ``b`` too); ``others`` runs fresh prompts
    beside them so that kept rows are restored into a batch that moves rows around."""
    prompts = {"a": tok("rev ab=")["input_ids"], "b": tok("sort 3,1,2=")["input_ids"]}
    samples = []
    for turn, obs in enumerate(observations):
        reqs = [Request(pid, ids, max_tokens=6, keep_prefix=True) for pid, ids in prompts.items()]
        if others:
            reqs += [
                Request(f"x{turn}{i}", tok("1+2=" * (i + 1))["input_ids"], 9) for i in range(3)
            ]
        gen.submit(reqs)
        done = {s.prompt_id: s for s in gen.stream()}
        for pid in prompts:
            s = done[pid]
            samples.append(s)
            prompts[pid] = s.prompt_ids + s.token_ids + tok(obs)["input_ids"]
    return samples


@pytest.mark.parametrize("others", [False, True])
def test_reused_prefix_gives_the_tokens_of_a_full_prefill(tok, others):
    model = varied_model(tok)
    observations = ["=ok", "=more?", "=end"]
    reused = _turns(
        HFStreamGenerator(model, max_batch_size=3, greedy=True), tok, observations, others
    )
    # The baseline recomputes every prompt: a stash that can hold nothing useful (new weights
    # each turn would clear it; here it is emptied by hand).
    base_gen = HFStreamGenerator(model, max_batch_size=3, greedy=True)
    base_gen.prefixes.put = lambda *a, **k: None
    full = _turns(base_gen, tok, observations, others)
    assert [s.token_ids for s in reused] == [s.token_ids for s in full]
    for a, b in zip(reused, full):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    # Turn one computes the whole prompt; later turns only the previous turn's last token and
    # the observation.
    first, later = reused[:2], reused[2:]
    assert all(s.cached_tokens == 0 for s in first)
    for s in later:
        assert s.cached_tokens > 0 and s.prefill_tokens + s.cached_tokens == len(s.prompt_ids)
        assert s.prefill_tokens <= len(tok("=more?")["input_ids"]) + 1
    assert all(s.cached_tokens == 0 for s in full)


def test_new_weights_drop_kept_prefixes(tok):
    model = varied_model(tok)
    gen = HFStreamGenerator(model, max_batch_size=2, greedy=True)
    ids = tok("rev ab=")["input_ids"]
    gen.submit([Request("a", ids, 4, keep_prefix=True)])
    (first,) = list(gen.stream())
    assert len(gen.prefixes) == 1
    gen.load_weights({}, version=1)
    assert len(gen.prefixes) == 0
    gen.submit([Request("a", ids + first.token_ids + ids, 4, keep_prefix=True)])
    (second,) = list(gen.stream())
    assert second.cached_tokens == 0 and second.prefill_tokens == len(second.prompt_ids)


def test_a_turn_with_a_kept_prefix_is_admitted_before_new_requests(tok):
    gen = HFStreamGenerator(varied_model(tok), max_batch_size=1, greedy=True)
    ids = tok("rev ab=")["input_ids"]
    gen.submit([Request("a", ids, 3, keep_prefix=True)])
    (first,) = list(gen.stream())
    fresh = [Request(f"new{i}", tok("1+2=")["input_ids"], 3) for i in range(3)]
    gen.submit([*fresh, Request("a", ids + first.token_ids + ids, 3, keep_prefix=True)])
    order = [s.prompt_id for s in gen.stream()]
    assert order == ["a", "new0", "new1", "new2"]  # one slot: the resumed turn went first
