"""HFStreamGenerator: continuous batching on a tiny Qwen2 must match plain ``generate``."""

from __future__ import annotations

import pytest
import torch
from varied_models import varied_model

from streamrl.components import FIFOScheduler, HFStreamGenerator
from streamrl.policy.models import build_tiny_model, build_tokenizer
from streamrl.records import Request, Sample

torch.set_num_threads(1)

PROMPTS = ["rev ab=", "1+2=", "sort 3,1,2=", "x", "abcdefghij=", "(1*2)+3=", "zz"]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _requests(tok, max_tokens: list[int] | None = None, forced: list[int] | None = None):
    n = len(forced) if forced is not None else len(PROMPTS)
    return [
        Request(
            prompt_id=f"p{i}",
            prompt_ids=tok(PROMPTS[i % len(PROMPTS)])["input_ids"],
            max_tokens=(max_tokens[i] if max_tokens else 32),
            forced_length=(forced[i] if forced else None),
        )
        for i in range(n)
    ]


def _run(gen: HFStreamGenerator, requests: list[Request]) -> dict[str, Sample]:
    gen.submit(requests)
    return {s.prompt_id: s for s in gen.stream()}


def _run_list(gen: HFStreamGenerator, requests: list[Request]) -> list[Sample]:
    gen.submit(requests)
    return list(gen.stream())  # completion order


def _strip(ids: list[int], eos: int) -> list[int]:
    """A generate() row up to and including its first EOS (batched rows pad after it)."""
    return ids[: ids.index(eos) + 1] if eos in ids else ids


# 3 slots: requests wait and refill freed slots; 7: all prefill together, "x" is one token long.
@pytest.mark.parametrize("slots", [3, 7])
@pytest.mark.parametrize("eos_char", [None, "k"])  # "k" stops several prompts mid-sequence
def test_greedy_matches_generate(tok, eos_char, slots):
    model = varied_model(tok)
    eos = tok.eos_token_id if eos_char is None else tok.convert_tokens_to_ids(eos_char)
    requests = _requests(tok, max_tokens=[5, 17, 9, 24, 3, 12, 20])
    gen = HFStreamGenerator(model, max_batch_size=slots, greedy=True, eos_token_id=eos)
    out = _run(gen, requests)
    assert len(out) == len(requests)
    batch = tok(PROMPTS, return_tensors="pt", padding=True)  # left padded
    batched = model.generate(**batch, max_new_tokens=24, do_sample=False, eos_token_id=eos)
    reasons = set()
    for i, req in enumerate(requests):
        ids = torch.tensor([req.prompt_ids])
        ref = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=req.max_tokens,
            do_sample=False,
            eos_token_id=eos,
        )[0, ids.shape[1] :].tolist()
        sample = out[req.prompt_id]
        assert sample.token_ids == _strip(ref, eos), req.prompt_id
        row = batched[i, batch["input_ids"].shape[1] :].tolist()
        assert sample.token_ids == _strip(row, eos)[: req.max_tokens], req.prompt_id
        reasons.add(sample.finish_reason)
        assert sample.finish_reason == ("eos" if sample.token_ids[-1] == eos else "length")
    assert reasons == {"eos", "length"}  # both stop paths were exercised


def test_completion_order(tok):
    gen = HFStreamGenerator(varied_model(tok), max_batch_size=3, greedy=True)
    samples = _run_list(gen, _requests(tok, forced=[12, 3, 7]))
    assert [s.length for s in samples] == [3, 7, 12]
    finished = [s.finished_s for s in samples]
    assert finished == sorted(finished)
    assert all(s.submitted_s <= s.started_s <= s.finished_s for s in samples)


def test_slots_bounded_and_refilled_at_once(tok):
    forced = [4, 9, 2, 6, 3, 8, 5, 1, 7]
    gen = HFStreamGenerator(varied_model(tok), max_batch_size=3, greedy=True)
    gen.submit(_requests(tok, forced=forced))
    done: list[Sample] = []
    while not gen.idle:
        before = gen.num_running + gen.num_waiting
        finished = gen.step()
        # Every free slot was filled at this step's admission, then the finished rows left.
        assert gen.num_running == min(3, before) - len(finished)
        assert gen.num_running <= 3
        done.extend(finished)
    assert sorted(s.length for s in done) == sorted(forced)
    assert gen.num_waiting == 0 and gen.num_running == 0


def test_admission_follows_scheduler(tok):
    class LongestFirst(FIFOScheduler):
        def pop(self) -> Request:
            best = max(self._queue, key=lambda r: r.predicted_length)
            self._queue.remove(best)
            return best

    requests = _requests(tok, forced=[2, 6, 4])
    for req in requests:
        req.predicted_length = float(req.forced_length)
    gen = HFStreamGenerator(
        varied_model(tok), max_batch_size=1, greedy=True, scheduler=LongestFirst()
    )
    assert [s.length for s in _run_list(gen, requests)] == [6, 4, 2]


def test_forced_length_ignores_eos(tok):
    model = varied_model(tok)
    eos = tok.convert_tokens_to_ids("k")  # a frequent token, so unforced runs do stop on it
    free = _run(
        HFStreamGenerator(model, eos_token_id=eos, seed=1), _requests(tok, max_tokens=[40] * 7)
    )
    assert any(s.finish_reason == "eos" for s in free.values())
    forced = _run(
        HFStreamGenerator(model, eos_token_id=eos, seed=1), _requests(tok, forced=[40] * 7)
    )
    for s in forced.values():
        assert s.length == 40 and s.finish_reason == "forced" and eos not in s.token_ids
        assert len(s.logprobs) == 40


def _recomputed_logprobs(model, sample: Sample, temperature: float = 1.0) -> torch.Tensor:
    ids = torch.tensor([sample.prompt_ids + sample.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(sample.prompt_ids) - 1 : -1]
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(1, torch.tensor(sample.token_ids)[:, None]).squeeze(1)


@pytest.mark.parametrize(("greedy", "temperature"), [(True, 1.0), (False, 0.7)])
def test_logprobs_match_full_forward(tok, greedy, temperature):
    model = varied_model(tok)
    gen = HFStreamGenerator(model, max_batch_size=3, greedy=greedy, temperature=temperature)
    out = _run(gen, _requests(tok, max_tokens=[5, 17, 9, 24, 3, 12, 20]))
    for sample in out.values():
        expected = _recomputed_logprobs(model, sample, temperature)
        assert torch.allclose(torch.tensor(sample.logprobs), expected, atol=1e-4), sample.prompt_id


def test_load_weights_changes_outputs_and_version(tok):
    model = varied_model(tok)
    storage = {n: p.data_ptr() for n, p in model.named_parameters()}
    gen = HFStreamGenerator(model, max_batch_size=2, greedy=True)
    before = _run(gen, _requests(tok, max_tokens=[8] * 7))
    gen.submit(_requests(tok, max_tokens=[8] * 7))
    early = gen.step()  # two sequences admitted under version 0 ...
    new_state = varied_model(tok, seed=1).state_dict()
    half = {k: v.numpy() if i % 2 else v for i, (k, v) in enumerate(new_state.items())}
    gen.load_weights(half, version=3)  # ... then the weights change between steps
    rest = early + list(gen.stream())
    assert gen.weight_version == 3
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == storage  # in place
    assert all(s.weight_version == 0 for s in before.values())
    versions = sorted(s.weight_version for s in rest)
    assert versions == [0, 0] + [3] * 5  # tagged with the version at admission
    after = {s.prompt_id: s.token_ids for s in rest if s.weight_version == 3}
    assert any(after[k] != before[k].token_ids for k in after)


def test_load_weights_rejects_bad_entries(tok):
    gen = HFStreamGenerator(varied_model(tok))
    with pytest.raises(ValueError, match="not a tensor"):
        gen.load_weights({"nope": torch.zeros(1)}, version=1)
    with pytest.raises(ValueError, match="shape"):
        gen.load_weights({"model.norm.weight": torch.zeros(3)}, version=1)
    assert gen.weight_version == 0


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "forced"),
    [([], 4, None), ([5, 6], 0, None), ([5] * 250, 10, None), ([5] * 200, 4, 60)],
)
def test_bad_input_raises_with_prompt_id(tok, prompt, max_tokens, forced):
    gen = HFStreamGenerator(varied_model(tok))
    good = Request("fine", [5, 6], 4)
    bad = Request("bad-7", prompt, max_tokens, forced_length=forced)
    with pytest.raises(ValueError, match="bad-7"):
        gen.submit([good, bad])
    assert gen.num_waiting == 0  # validated before anything was queued


def test_hf_generator_satisfies_the_stream_generator_protocol(tokenizer):
    from streamrl.protocols import StreamGenerator

    assert isinstance(HFStreamGenerator(build_tiny_model(tokenizer, "test")), StreamGenerator)
