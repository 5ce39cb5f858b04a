"""Real tokenizers and chat formats: the byte-level BPE, chat rendering, completion text, and
generation that stops at the end of the turn or at a stop string."""

from __future__ import annotations

import random

import pytest
import torch
from varied_models import varied_model

from streamrl.components.generation.engines import HFEngine
from streamrl.components.generation.hf_generator import HFStreamGenerator
from streamrl.errors import ConfigError
from streamrl.policy.chat import completion_text, render_prompt, stop_token_ids
from streamrl.policy.models import (
    DEFAULT_CHAT_TEMPLATE,
    build_bpe_tokenizer,
    build_tiny_model,
    load_policy,
    load_tokenizer,
    save_policy,
)
from streamrl.protocols import EngineSpec
from streamrl.records import Request

torch.set_num_threads(1)

SUBJECTS = ["the farmer", "a small robot", "my neighbour", "the teacher", "every student"]
VERBS = ["counts", "sorts", "reverses", "adds", "writes", "reads", "compares"]
OBJECTS = ["seven apples", "the numbers", "a long list", "three letters", "the answer"]
ENDINGS = ["today.", "before lunch.", "in the garden.", "very slowly.", "again and again!"]


def sentences(n: int = 300, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [
        f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(ENDINGS)}"
        for _ in range(n)
    ]


@pytest.fixture(scope="module")
def bpe():
    return build_bpe_tokenizer(sentences(), vocab_size=400)


def _ids(tok, *tokens: str) -> list[int]:
    return [tok.convert_tokens_to_ids(t) for t in tokens]


# -- the tokenizer ---------------------------------------------------------------------------


def test_bpe_learns_multi_char_tokens_and_splits_rare_words(bpe):
    pieces = [bpe.convert_ids_to_tokens(i) for i in range(len(bpe))]
    assert sum(len(p) > 3 for p in pieces) > 20  # merges were learned
    assert len(bpe(" student")["input_ids"]) == 1  # a frequent word is one token
    assert len(bpe(" xylophonist")["input_ids"]) > 1  # an unseen word is several
    assert len(bpe) <= 400


def test_bpe_special_tokens_are_single_ids(bpe):
    assert (bpe.eos_token, bpe.pad_token) == ("<|endoftext|>", "<|endoftext|>")
    assert _ids(bpe, "<|endoftext|>", "<|im_start|>", "<|im_end|>") == [0, 1, 2]
    assert bpe("a<|im_start|>b<|im_end|>c<|endoftext|>")["input_ids"][1::2] == [1, 2, 0]
    assert bpe.padding_side == "left"


@pytest.mark.parametrize(
    "text",
    ["the farmer counts seven apples today.", "  Two spaces,\ttabs\nand lines\n", "héllo 😀 ✓", ""],
)
def test_bpe_round_trips_any_text(bpe, text):
    assert bpe.decode(bpe(text)["input_ids"]) == text


def test_bpe_training_is_deterministic(bpe):
    again = build_bpe_tokenizer(sentences(), vocab_size=400)
    assert again.get_vocab() == bpe.get_vocab()


def test_bpe_refuses_a_vocabulary_below_the_bytes():
    with pytest.raises(ValueError, match="vocab_size=100"):
        build_bpe_tokenizer(["a b c"], vocab_size=100)


# -- rendering prompts -----------------------------------------------------------------------


def test_chat_template_renders_chatml_with_the_generation_prompt(bpe):
    messages = [{"role": "user", "content": "add 2 and 3"}]
    ids = render_prompt(bpe, messages, system_prompt="Answer with a number.")
    assert type(ids) is list and all(type(i) is int for i in ids)
    assert bpe.decode(ids) == (
        "<|im_start|>system\nAnswer with a number.<|im_end|>\n"
        "<|im_start|>user\nadd 2 and 3<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # A string is one user message; a conversation with its own system message keeps it.
    assert render_prompt(bpe, "add 2 and 3") == render_prompt(bpe, messages)
    own = [{"role": "system", "content": "Be terse."}, *messages]
    assert bpe.decode(render_prompt(bpe, own, system_prompt="ignored")).count("system") == 1
    assert messages == [{"role": "user", "content": "add 2 and 3"}]  # not modified in place


def test_plain_prompts_skip_the_template(bpe, tokenizer):
    assert render_prompt(bpe, "add 2", chat=False) == bpe("add 2")["input_ids"]
    assert render_prompt(tokenizer, "rev ab=") == tokenizer("rev ab=")["input_ids"]
    with pytest.raises(ConfigError, match="system_prompt"):
        render_prompt(bpe, "add 2", chat=False, system_prompt="hi")


def test_chat_prompts_need_a_chat_template(tokenizer):
    for prompt, chat in [([{"role": "user", "content": "hi"}], None), ("hi", True)]:
        with pytest.raises(ConfigError, match="chat_template"):
            render_prompt(tokenizer, prompt, chat=chat)


def test_save_and_load_keep_the_tokenizer_and_its_template(bpe, tmp_path):
    model = build_tiny_model(bpe, size="test")
    path = save_policy(model, bpe, tmp_path / "policy")
    loaded_model, loaded = load_policy(path)
    assert loaded.chat_template == DEFAULT_CHAT_TEMPLATE
    assert type(load_tokenizer(path)) is type(loaded)
    text = "héllo the farmer\n\tsorts 😀"
    assert loaded(text)["input_ids"] == bpe(text)["input_ids"]
    rendered = render_prompt(bpe, "hi", system_prompt="s")
    assert render_prompt(loaded, "hi", system_prompt="s") == rendered
    assert (loaded.eos_token_id, loaded.pad_token_id, loaded.padding_side) == (0, 0, "left")
    assert stop_token_ids(loaded) == [0, 2]
    assert loaded_model.config.eos_token_id == [0, 2]


# -- the tiny model on it ----------------------------------------------------------------------


def test_tiny_model_on_the_bpe_stops_at_end_of_turn_by_default(bpe):
    model = build_tiny_model(bpe, size="test")
    assert model.config.vocab_size == len(bpe)
    assert model.config.pad_token_id == bpe.pad_token_id == 0
    assert model.config.eos_token_id == model.generation_config.eos_token_id == [0, 2]
    prompt = torch.tensor([render_prompt(bpe, "count the apples")])
    out = model.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert out.shape[0] == 1 and 1 <= out.shape[1] - prompt.shape[1] <= 5


def test_char_tokenizer_model_keeps_its_single_eos(tokenizer):
    model = build_tiny_model(tokenizer, size="test")
    assert stop_token_ids(tokenizer) == [tokenizer.eos_token_id]
    assert model.config.eos_token_id == model.generation_config.eos_token_id == 1


# -- completion text -------------------------------------------------------------------------


def test_completion_text_ends_at_the_turn_and_drops_special_tokens(bpe):
    ids = bpe("<|im_start|>the answer<|im_end|>\nignored text")["input_ids"]
    assert completion_text(bpe, ids) == "the answer"
    ids = bpe("the answer<|endoftext|>more")["input_ids"]
    assert completion_text(bpe, ids) == "the answer"
    assert completion_text(bpe, bpe("no stop at all")["input_ids"]) == "no stop at all"


def test_completion_text_cuts_at_the_first_stop_string(bpe):
    ids = bpe("five apples. Then six. END<|im_end|>")["input_ids"]
    assert completion_text(bpe, ids, stop_strings=["END", "."]) == "five apples"
    assert completion_text(bpe, ids, stop_strings=["END"]) == "five apples. Then six. "
    assert completion_text(bpe, ids, stop_strings=["", "zzz"]) == "five apples. Then six. END"


# -- generation stops at the end of the turn and at stop strings -----------------------------


def _bias_logits(model, token_ids: list[int], value: float):
    """Add ``value`` to the logits of ``token_ids`` at every step (a forward hook on the head)."""

    def hook(module, inputs, output):
        output[..., token_ids] += value
        return output

    return model.lm_head.register_forward_hook(hook)


def _generate(gen: HFStreamGenerator, prompts: list[list[int]], max_tokens: int = 24):
    gen.submit([Request(f"p{i}", ids, max_tokens=max_tokens) for i, ids in enumerate(prompts)])
    return {s.prompt_id: s for s in gen.stream()}


def test_generator_stops_at_end_of_turn_by_default(bpe):
    model = varied_model(bpe)
    handle = _bias_logits(model, [2], 1e4)  # <|im_end|> is always the best token
    try:
        out = _generate(HFStreamGenerator(model, greedy=True), [render_prompt(bpe, "hi")])
    finally:
        handle.remove()
    assert (out["p0"].token_ids, out["p0"].finish_reason) == ([2], "eos")


def _stop_string_after(tok, tokens: list[int], k: int) -> str | None:
    """A stop string that first appears in the text when token ``k`` arrives."""
    before, text = tok.decode(tokens[:k]), tok.decode(tokens[: k + 1])
    for size in range(5, 0, -1):  # the longest first: it spans tokens
        cand = text[-size:]
        if cand.strip() and "\ufffd" not in cand and cand not in before:
            return cand
    return None


def test_generator_stops_right_after_a_stop_string(bpe):
    model = varied_model(bpe)
    prompts = [render_prompt(bpe, p) for p in ("count the apples", "sort the numbers")]
    handle = _bias_logits(model, stop_token_ids(bpe), -1e4)  # no natural stop
    try:
        free = _generate(HFStreamGenerator(model, greedy=True), prompts)
        assert all(s.finish_reason == "length" and s.length == 24 for s in free.values())
        tokens = free["p0"].token_ids
        k, stop = next((k, s) for k in range(6, 20) if (s := _stop_string_after(bpe, tokens, k)))
        gen = HFStreamGenerator(model, greedy=True, stop_strings=[stop], tokenizer=bpe)
        stopped = _generate(gen, prompts)
    finally:
        handle.remove()
    assert stopped["p0"].token_ids == tokens[: k + 1]
    assert stopped["p0"].finish_reason == "stop"
    assert stop in completion_text(bpe, stopped["p0"].token_ids)
    assert (
        completion_text(bpe, stopped["p0"].token_ids, stop_strings=[stop])
        == bpe.decode(tokens[: k + 1]).split(stop)[0]
    )
    # The other row of the batch ran on: it stops at its own first occurrence, if any.
    other = free["p1"].token_ids
    first = next((n for n in range(1, len(other) + 1) if stop in bpe.decode(other[:n])), len(other))
    assert stopped["p1"].token_ids == other[:first]


def test_generator_needs_the_tokenizer_for_stop_strings(bpe):
    with pytest.raises(ValueError, match="tokenizer"):
        HFStreamGenerator(build_tiny_model(bpe), stop_strings=["."])


def _spec(model_dir, **stops) -> EngineSpec:
    return EngineSpec(
        model_dir=str(model_dir),
        device="cpu",
        instance_id=0,
        weight_version=0,
        max_batch_size=2,
        temperature=1.0,
        greedy=True,
        seed=0,
        **stops,
    )


def test_hf_engine_passes_the_spec_stops_to_the_generator(bpe, tokenizer, tmp_path):
    char_dir = save_policy(build_tiny_model(tokenizer), tokenizer, tmp_path / "char")
    plain = HFEngine()(_spec(char_dir), None)
    assert (plain.finishing.eos_ids, plain.stop_strings, plain.tokenizer) == ([1], (), None)
    stopping = HFEngine()(_spec(char_dir, stop_token_ids=(5, 1), stop_strings=("=",)), None)
    assert (stopping.finishing.eos_ids, stopping.stop_strings) == ([1, 5], ("=",))
    assert stopping.tokenizer.decode(tokenizer("ab=")["input_ids"]) == "ab="

    bpe_dir = save_policy(build_tiny_model(bpe), bpe, tmp_path / "bpe")
    assert HFEngine()(_spec(bpe_dir), None).finishing.eos_ids == [0, 2]


def test_hf_engine_generation_stops_at_a_stop_string(tokenizer, tmp_path):
    model_dir = save_policy(varied_model(tokenizer), tokenizer, tmp_path / "policy")
    prompt = tokenizer("1+2=")["input_ids"]
    free = _generate(HFEngine()(_spec(model_dir), None), [prompt], max_tokens=16)["p0"]
    text = tokenizer.decode(free.token_ids)
    assert len(free.token_ids) >= 4, text  # the seed gives a completion long enough to cut
    stop = text[2:4]
    gen = HFEngine()(_spec(model_dir, stop_strings=(stop,)), None)
    stopped = _generate(gen, [prompt], max_tokens=16)["p0"]
    assert tokenizer.decode(stopped.token_ids) == text[: text.index(stop) + len(stop)]
    assert stopped.finish_reason == "stop"


def test_vllm_engine_passes_the_spec_stops_when_given(monkeypatch, tmp_path):
    from streamrl.components.generation import vllm_generator
    from streamrl.components.generation.engines import VLLMEngine

    made = {}
    monkeypatch.setattr(vllm_generator, "VLLMStreamGenerator", lambda *a, **k: made.update(k))
    VLLMEngine()(_spec(tmp_path, stop_token_ids=(2,), stop_strings=("END",)), None)
    assert (made["stop_token_ids"], made["stop_strings"]) == ((2,), ("END",))
    made.clear()
    VLLMEngine()(_spec(tmp_path), None)
    assert "stop_token_ids" not in made and "stop_strings" not in made
