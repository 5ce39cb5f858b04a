"""Speculative decoding in the tail (``SpeculativeDecoding``): drafts from the prompt, the sample
and its group, verified in one forward with exactly the outputs of plain decoding."""

from __future__ import annotations

import math
import pickle
from collections import Counter

import pytest
import torch
from varied_models import varied_model

from streamrl.components import HFEngine, HFStreamGenerator, VLLMEngine
from streamrl.components.generation.drafting import SuffixDrafter, SuffixIndex
from streamrl.components.generation.speculative import SpeculativeDecoding, vllm_speculative_config
from streamrl.components.generation.verification import accept_drafts, verify_batch
from streamrl.components.skewness.schedulers import FIFOScheduler
from streamrl.errors import ConfigError
from streamrl.policy.models import build_tiny_model, build_tokenizer, save_policy
from streamrl.protocols import EngineSpec
from streamrl.records import Request, Sample

torch.set_num_threads(1)

ALWAYS = SpeculativeDecoding(max_running=None, min_acceptance=0)  # every step speculates


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _run(gen: HFStreamGenerator, requests: list[Request]) -> dict[tuple, Sample]:
    gen.submit(requests)
    return {(s.prompt_id, s.sample_index): s for s in gen.stream()}


def _assert_same(plain: dict[tuple, Sample], spec: dict[tuple, Sample]) -> None:
    assert plain.keys() == spec.keys()
    for key, a in plain.items():
        b = spec[key]
        assert b.token_ids == a.token_ids, key
        assert b.finish_reason == a.finish_reason, key
        assert b.token_versions == a.token_versions, key
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-4), key


# ---------------------------------------------------------------- the drafter, by hand


def test_the_longest_most_recent_suffix_drafts_what_followed_it():
    # tokens:      0  1  2  3  4  5  6  7  8  9
    own = SuffixIndex(1, 3, [1, 2, 9, 4, 2, 9, 5, 7, 2, 9])
    drafter = SuffixDrafter(min_ngram=1, max_ngram=3, stored_samples=4)
    # "2 9" last occurred at 4-5 (followed by 5 7 ...); "7 2 9" never did, "4 2 9" is no suffix.
    assert drafter.propose(own, "g", limit=3) == [5, 7, 2]
    assert drafter.propose(SuffixIndex(1, 3, [3, 8]), "g", limit=3) == []  # nothing matches
    # A repeating pattern that runs into the end goes on with its own period (an LZ77 copy).
    assert drafter.propose(SuffixIndex(1, 3, [6, 1, 2, 1, 2]), "g", limit=5) == [1, 2, 1, 2, 1]


def test_a_group_drafts_from_its_finished_samples_and_the_store_is_bounded():
    drafter = SuffixDrafter(min_ngram=1, max_ngram=2, stored_samples=2)
    drafter.remember(("p", 0), [5, 6, 3, 3, 1])
    start = SuffixIndex(1, 2, [5, 6])
    assert drafter.propose(start, ("p", 0), limit=4) == [3, 3, 1]
    assert drafter.propose(start, ("p", 1), limit=4) == []  # another iteration's group
    drafter.remember(("q", 0), [7, 7])
    drafter.remember(("q", 0), [5, 6, 8])  # a third sample: the oldest, p's, is forgotten
    assert len(drafter) == 2
    assert drafter.propose(start, ("p", 0), limit=4) == []
    assert drafter.propose(start, ("q", 0), limit=4) == [8]


def test_greedy_verification_keeps_drafts_while_they_are_the_argmax():
    # Two rows, three positions, four tokens. Row 0 drafts [2, 3]: 2 is the argmax at position
    # 0, 3 is not at position 1 (token 1 is): emits 2 then 1. Row 1 drafts [0]: the argmax at
    # position 0, so it emits 0 and the bonus argmax of position 1, token 3.
    logits = torch.tensor(
        [
            [[0.0, 1.0, 5.0, 2.0], [0.0, 4.0, 1.0, 2.0], [9.0, 0.0, 0.0, 0.0]],
            [[5.0, 1.0, 0.0, 0.0], [0.0, 1.0, 2.0, 3.0], [9.0, 0.0, 0.0, 0.0]],
        ]
    )
    logp = torch.log_softmax(logits, dim=-1)
    tokens, logprobs = accept_drafts(logp, [[2, 3], [0]], greedy=True, rng=torch.Generator())
    assert tokens == [[2, 1], [0, 3]]
    assert logprobs[0] == pytest.approx([logp[0, 0, 2].item(), logp[0, 1, 1].item()])
    assert logprobs[1] == pytest.approx([logp[1, 0, 0].item(), logp[1, 1, 3].item()])


# ---------------------------------------------------------------- exactness, greedy


PROMPTS = ["rev ab=", "1+2=", "sort 3,1,2=", "x", "abcdefghij=", "(1*2)+3=", "zz", "count 3 9="]


def _mixed_requests(tok) -> list[Request]:
    """Two samples per prompt, mixed budgets: forced lengths, max_tokens, EOS and a stop
    string all end some of them; a group's second sample drafts from its first."""
    requests = []
    for i, prompt in enumerate(PROMPTS):
        forced = 26 if i % 4 == 0 else None
        for sample in range(2):
            requests.append(
                Request(
                    prompt_id=f"p{i}",
                    prompt_ids=tok(prompt)["input_ids"],
                    max_tokens=[5, 33, 9, 24, 30, 12, 20, 40][i],
                    forced_length=forced,
                    sample_index=sample,
                )
            )
    return requests


def _count_ends_inside_runs(gen: HFStreamGenerator) -> Counter:
    """Count, by finish reason, the rows that a rule ended before the end of the tokens one
    step gave them (white box: wraps the generator's ``_append``)."""
    ended, append = Counter(), gen._append

    def counted(row, tokens, logprobs):
        before = len(row.token_ids)
        reason = append(row, tokens, logprobs)
        if reason is not None and len(row.token_ids) - before < len(tokens):
            ended[reason] += 1
        return reason

    gen._append = counted
    return ended


@pytest.mark.parametrize("slots", [3, 16])
def test_greedy_speculation_gives_the_tokens_and_logprobs_of_plain_decoding(tok, slots):
    model = varied_model(tok, seed=1, std=0.1)
    settings = dict(
        max_batch_size=slots,
        greedy=True,
        eos_token_id=tok.convert_tokens_to_ids("0"),
        stop_strings=["xxxxx", ","],
        tokenizer=tok,
    )
    plain = _run(HFStreamGenerator(model, **settings), _mixed_requests(tok))
    gen = HFStreamGenerator(model, speculative=SpeculativeDecoding(max_running=16), **settings)
    ended_inside = _count_ends_inside_runs(gen)
    spec = _run(gen, _mixed_requests(tok))
    _assert_same(plain, spec)
    assert {s.finish_reason for s in plain.values()} == {"eos", "stop", "length", "forced"}
    # The case this test is for: a rule firing inside an accepted run (with 3 slots a group's
    # second sample drafts its sibling's EOS; "xxxxx" completes inside a repeated run).
    assert set(ended_inside) == ({"eos", "stop"} if slots == 3 else {"stop"})
    assert gen.speculator.accepted > 0 and gen.speculator.proposed > gen.speculator.accepted
    tokens = sum(s.length for s in spec.values())
    assert gen.speculator.verify_steps < tokens  # several tokens per forward


def test_an_echo_accepts_its_drafts_and_needs_fewer_forwards(tok):
    # The default-initialised model repeats one token whatever the context: an echo of itself.
    model = build_tiny_model(tok, "test", seed=0)
    requests = [Request(f"p{i}", tok("copy abc=")["input_ids"], 40) for i in range(2)]
    plain = _run(HFStreamGenerator(model, greedy=True), requests)
    gen = HFStreamGenerator(model, greedy=True, speculative=SpeculativeDecoding(draft_tokens=4))
    spec = _run(gen, [Request(r.prompt_id, r.prompt_ids, r.max_tokens) for r in requests])
    _assert_same(plain, spec)
    sp = gen.speculator
    assert sp.acceptance_rate > 0.9
    # 40 tokens at up to 5 per verify forward: at most a couple of plain steps besides.
    assert sp.verify_steps <= 40 // 5 + 3


def test_speculation_runs_only_at_or_below_max_running(tok):
    model = build_tiny_model(tok, "test", seed=0)  # an echo: every row always has a draft
    forced = [3, 6, 9, 40]
    gen = HFStreamGenerator(
        model, max_batch_size=4, greedy=True, speculative=SpeculativeDecoding(max_running=2)
    )
    gen.submit(Request(f"p{i}", [5, 6, 7], 40, forced_length=n) for i, n in enumerate(forced))
    seen = []
    while not gen.idle:
        before = gen.speculator.verify_steps
        running = max(gen.num_running, min(4, gen.num_running + gen.num_waiting))
        gen.step()
        seen.append((running, gen.speculator.verify_steps > before))
    assert all(not verified for running, verified in seen if running > 2)
    assert any(verified for running, verified in seen if running <= 2)
    assert [n for n, _ in seen].count(4) >= 3  # the first steps ran plain, four rows


def test_low_acceptance_backs_off_to_plain_decoding_then_tries_again(tok):
    """Sampling a random policy hot: drafts are rarely right, so after a few verify steps the
    instance decodes plainly for ``backoff_steps`` steps, then probes again; an echo never
    backs off."""
    model = build_tiny_model(tok, "test", seed=0)
    noisy = SpeculativeDecoding(max_running=None, min_acceptance=0.5, backoff_steps=16)
    gen = HFStreamGenerator(model, temperature=8.0, speculative=noisy)
    gen.submit([Request(f"p{i}", [5, 6, 7], 120, forced_length=120) for i in range(2)])
    steps = 0
    while not gen.idle:
        gen.step()
        steps += 1
    sp = gen.speculator
    assert sp.acceptance_rate < 0.5 and sp.backoffs >= 2  # off, back on, off again
    # Each backoff follows 4 verify steps and lasts 16 plain ones: most steps are plain.
    assert sp.verify_steps <= 4 * (sp.backoffs + 1) and sp.verify_steps < steps / 2
    echo = HFStreamGenerator(model, greedy=True, speculative=SpeculativeDecoding())
    echo.submit([Request("e", [5, 6, 7], 60, forced_length=60)])
    list(echo.stream())
    assert echo.speculator.backoffs == 0 and echo.speculator.acceptance_rate > 0.9


# ---------------------------------------------------------------- exactness, sampling


def _outcome_probabilities(model, prompt: list[int], eos: int, steps: int, temperature: float):
    """Exact probability of every completion of up to ``steps`` tokens (EOS ends one), from
    full forwards without any cache; and each token's log-prob given its prefix."""
    exact, logps = {}, {}
    frontier = [((), 0.0)]
    for _ in range(steps):
        grown = []
        for prefix, logp_prefix in frontier:
            with torch.no_grad():
                logits = model(torch.tensor([prompt + list(prefix)])).logits[0, -1]
            logp = torch.log_softmax(logits.float() / temperature, dim=-1)
            for token, lp in enumerate(logp.tolist()):
                seq = (*prefix, token)
                logps[seq] = lp
                if token == eos or len(seq) == steps:
                    exact[seq] = math.exp(logp_prefix + lp)
                else:
                    grown.append((seq, logp_prefix + lp))
        frontier = grown
    return exact, logps


def _chi_square_passes(counts: Counter, exact: dict, n: int) -> tuple[bool, float, float]:
    """Pearson's chi-square of ``counts`` against ``exact`` (cells expecting < 5 pooled), and
    its 0.1% critical value (Wilson-Hilferty approximation of the chi-square quantile)."""
    stat, pooled_obs, pooled_exp, cells = 0.0, 0, 0.0, 0
    for seq, p in exact.items():
        if n * p < 5:
            pooled_obs, pooled_exp = pooled_obs + counts[seq], pooled_exp + n * p
            continue
        stat += (counts[seq] - n * p) ** 2 / (n * p)
        cells += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        cells += 1
    df, z = cells - 1, 3.0902  # z of the 99.9% normal quantile
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat < critical, stat, critical


@pytest.mark.parametrize("speculative", [None, ALWAYS], ids=["plain", "speculative"])
def test_sampled_completions_follow_the_exact_distribution(speculative):
    tok = build_tokenizer(alphabet="ab")  # 5 ids: pad, eos, unk, a, b
    model = varied_model(tok)  # std 0.2: a spread distribution; drafts often rejected
    prompt, steps, temperature, n = tok("abbab")["input_ids"], 3, 0.8, 4000
    exact, logps = _outcome_probabilities(model, prompt, tok.eos_token_id, steps, temperature)
    gen = HFStreamGenerator(
        model, max_batch_size=64, temperature=temperature, seed=7, speculative=speculative
    )
    gen.submit(Request(f"p{i}", prompt, max_tokens=steps) for i in range(n))
    samples = list(gen.stream())
    counts = Counter(tuple(s.token_ids) for s in samples)
    passes, stat, critical = _chi_square_passes(counts, exact, n)
    assert passes, f"chi-square {stat:.1f} >= {critical:.1f}: not the model's distribution"
    for s in samples[:200]:  # every token's log-prob is the model's, given its prefix
        expected = [logps[tuple(s.token_ids[: j + 1])] for j in range(s.length)]
        assert s.logprobs == pytest.approx(expected, abs=1e-4)
    if speculative is not None:  # drafts were both accepted and rejected
        sp = gen.speculator
        assert 0.1 < sp.acceptance_rate < 0.9, sp.acceptance_rate


# ---------------------------------------------------------------- with the generator's other parts


@pytest.mark.parametrize("recompute", [False, True])
def test_weights_loaded_mid_sequence_tag_the_tokens_after_them(tok, recompute):
    old = build_tiny_model(tok, "test", seed=0)  # an echo: drafts are accepted
    new_state = varied_model(tok, seed=1, std=0.1).state_dict()
    requests = [Request("a", tok("copy abc=")["input_ids"], 30, forced_length=30)]

    def run(speculative):
        model = build_tiny_model(tok, "test", seed=0)
        gen = HFStreamGenerator(model, greedy=True, speculative=speculative)
        gen.submit(requests)
        out = []
        while not out and (gen.num_running == 0 or len(gen._rows[0].token_ids) < 11):
            out += gen.step()
        loaded_at = len(gen._rows[0].token_ids)
        gen.load_weights(new_state, version=3)
        if recompute:
            gen.recompute_running()
        return out + list(gen.stream()), loaded_at, gen

    spec, at, gen = run(SpeculativeDecoding())
    assert gen.speculator.accepted > 0 and at >= 11
    (sample,) = spec
    assert sample.token_versions == [0] * at + [3] * (30 - at)
    # Plain decoding with the same load after the same tokens draws the same tokens.
    plain = HFStreamGenerator(old, greedy=True)
    plain.submit(requests)
    while not plain.num_running or len(plain._rows[0].token_ids) < at:
        plain.step()
    plain.load_weights(new_state, version=3)
    if recompute:
        plain.recompute_running()
    (expected,) = list(plain.stream())
    assert sample.token_ids == expected.token_ids
    assert sample.logprobs == pytest.approx(expected.logprobs, abs=1e-4)


def test_a_kept_prefix_and_lora_decode_as_without_speculation(tok):
    from streamrl.components.generation.lora_generator import LoRAStreamGenerator
    from streamrl.policy.lora import LoRASpec, apply_lora

    def turns(gen):
        prompt, out = tok("rev ab=")["input_ids"], []
        for obs in ("=ok", "=more"):
            gen.submit([Request("e", prompt, max_tokens=12, keep_prefix=True)])
            (s,) = list(gen.stream())
            out.append(s)
            prompt = s.prompt_ids + s.token_ids + tok(obs)["input_ids"]
        return {(i, 0): s for i, s in enumerate(out)}

    def lora_model():
        model = apply_lora(varied_model(tok, seed=1, std=0.1), LoRASpec(r=2, alpha=4))
        torch.manual_seed(0)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.05)  # non-zero adapters, so they change the outputs
        return model

    plain = turns(LoRAStreamGenerator(lora_model(), greedy=True))
    gen = LoRAStreamGenerator(lora_model(), greedy=True, speculative=ALWAYS)
    spec = turns(gen)
    _assert_same(plain, spec)
    assert spec[(1, 0)].cached_tokens > 0  # the second turn reused the first's KV cache
    assert gen.speculator.verify_steps > 0


# ---------------------------------------------------------------- settings and engines


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(draft_tokens=0), "draft at least 1"),
        (dict(min_ngram=3, max_ngram=2), "min_ngram <= max_ngram"),
        (dict(min_ngram=0), "min_ngram <= max_ngram"),
        (dict(max_running=0), "or None to speculate at any batch size"),
        (dict(stored_samples=-1), "pass >= 0"),
        (dict(min_acceptance=1.0), "0 <= min_acceptance < 1"),
        (dict(backoff_steps=0), "backoff_steps >= 1"),
    ],
)
def test_bad_settings_say_what_to_pass(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        SpeculativeDecoding(**kwargs)


def test_the_hf_engine_builds_a_speculating_generator(tmp_path, tok):
    settings = SpeculativeDecoding(draft_tokens=3, max_running=2)
    # YAML gives the fields as a mapping:
    # rl.engine: {class_path: hf, init_args: {speculative: {...}}}
    assert HFEngine(speculative={"draft_tokens": 3, "max_running": 2}).speculative == settings
    with pytest.raises(ConfigError, match="its fields are draft_tokens"):
        HFEngine(speculative={"draft": 3})
    with pytest.raises(ConfigError, match="pass SpeculativeDecoding"):
        VLLMEngine(speculative=4)
    engine = pickle.loads(pickle.dumps(HFEngine(speculative=settings)))  # sent to instances
    model_dir = save_policy(build_tiny_model(tok, "test"), tok, tmp_path / "policy")
    spec = EngineSpec(str(model_dir), "cpu", 0, 0, 4, 1.0, True, 0)
    gen = engine(spec, FIFOScheduler())
    assert gen.speculator.settings == settings
    gen.submit([Request("p", tok("copy abc=")["input_ids"], 12)])
    assert [s.length for s in gen.stream()] == [12] and gen.speculator.accepted > 0


def test_vllm_gets_its_ngram_config_or_a_refusal_naming_why():
    settings = SpeculativeDecoding(
        draft_tokens=5, max_ngram=3, min_ngram=2, stored_samples=0, min_acceptance=0
    )
    # vLLM 0.32's n-gram proposer; the tail threshold as its per-batch-size schedule: 5 draft
    # tokens for batches of 1 to 4 requests, none from 5 on (vLLM carries the last range on).
    assert vllm_speculative_config(settings) == {
        "method": "ngram",
        "num_speculative_tokens": 5,
        "prompt_lookup_max": 3,
        "prompt_lookup_min": 2,
        "num_speculative_tokens_per_batch_size": [[1, 4, 5], [5, 5, 0]],
    }
    always = SpeculativeDecoding(max_running=None, stored_samples=0, min_acceptance=0)
    assert "num_speculative_tokens_per_batch_size" not in vllm_speculative_config(always)
    no_groups = SpeculativeDecoding(min_acceptance=0)
    with pytest.raises(ConfigError, match="stored_samples=0"):
        vllm_speculative_config(no_groups)  # group drafts: vLLM has none
    with pytest.raises(ConfigError, match="stored_samples=0"):
        VLLMEngine(speculative=no_groups).check(cluster=None, gpus_per_instance=0)
    with pytest.raises(ConfigError, match="min_acceptance=0"):
        vllm_speculative_config(SpeculativeDecoding(stored_samples=0))  # no backoff in vLLM
    engine = VLLMEngine(options={"speculative_config": {}}, speculative=settings)
    with pytest.raises(ConfigError, match="keep one"):
        engine.check(cluster=None, gpus_per_instance=0)


def test_bench_generate_speculative_times_both_modes_on_one_model(tmp_path, tok, capsys):
    import json

    from streamrl.cli.main import main

    model_dir = save_policy(build_tiny_model(tok, "test"), tok, tmp_path / "policy")
    argv = ["bench", "generate", "--speculative", "--model", str(model_dir), "--prompts", "6"]
    argv += ["--batch-sizes", "4", "--max-tokens", "24", "--repeats", "2"]
    assert main(argv) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["batch"]["4"]
    assert row["identical"] is True  # greedy: both modes decode the same tokens
    for phase in ("tail", "whole"):
        times = row[f"{phase}_s"]
        assert times["speculative"] > 0 and times["plain"] > 0
        assert row[f"{phase}_ratio"] == pytest.approx(times["speculative"] / times["plain"], 0.02)
    assert row["verify_steps"] > 0 and row["acceptance_rate"] > 0.5  # an echo: drafts hold
    assert row["tail_s"]["plain"] <= row["whole_s"]["plain"]


def test_bench_generate_speculative_refuses_inputs_before_any_work(capsys):
    from streamrl.cli.main import main

    assert main(["bench", "generate", "--speculative", "--max-tokens", "500"]) == 2
    assert "at most 96 letters" in capsys.readouterr().err
    assert main(["bench", "generate", "--speculative", "--model", "qwen2-0.5b"]) == 2
    assert "does not copy" in capsys.readouterr().err


def test_yaml_turns_speculation_on_through_the_engine_options(tmp_path):
    from streamrl.run.config_checks import placement_of
    from streamrl.run.config_file import load_config
    from streamrl.run.parts import check_parts

    def check(options: str):
        path = tmp_path / "c.yaml"
        path.write_text(
            f"rl:\n  engine: {{class_path: hf, init_args: {{speculative: {options}}}}}\n"
        )
        config = load_config(path)
        check_parts(config.rl, placement_of(config))
        return config

    config = check("{draft_tokens: 3, max_running: 2}")
    assert config.rl.engine["init_args"]["speculative"] == {"draft_tokens": 3, "max_running": 2}
    with pytest.raises(ConfigError, match="its fields are draft_tokens"):
        check("{draft: 3}")
    with pytest.raises(ConfigError, match="min_ngram <= max_ngram"):
        check("{min_ngram: 5}")


def test_a_verify_batch_pads_rows_past_their_drafts_at_their_last_position():
    ids, positions, columns, allowed = verify_batch(
        [3, 5], [7, 8], [[1, 2], []], pad_token_id=0, device=torch.device("cpu")
    )
    assert ids.tolist() == [[7, 1, 2], [8, 0, 0]]
    assert columns.tolist() == [[3, 4, 5], [5, 6, 7]]  # distinct columns, pads included
    assert positions.tolist() == [[3, 4, 5], [5, 5, 5]]  # pads repeat the row's last position
    assert allowed.shape == (2, 3, 8)
    # Row 0's second query (its first draft token, column 4) sees columns 0-4 only.
    assert allowed[0, 1].tolist() == [True] * 5 + [False] * 3
