"""The built-in rewards: ``math_answer`` (math-verify) and ``RewardModel`` (a tiny sequence
classifier built here, never downloaded)."""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import pickle
import queue
import threading

import pytest
import torch

from streamrl.errors import ConfigError
from streamrl.policy.models import build_tokenizer, load_tokenizer
from streamrl.rewards.reward_model import RewardModel
from streamrl.rewards.spec import RewardSpec, build_reward
from streamrl.rewards.verifiers import boxed_or_last_number, math_answer

pytest.importorskip("math_verify")

SPAWN_TIMEOUT_S = 120


# -- math_answer -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"so \boxed{42}.", "42"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),  # nested braces kept whole
        (r"first \boxed{1}, finally \boxed{\sqrt{2}}", r"\sqrt{2}"),  # the last box
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),  # escaped braces do not close the box
        (r"\boxed{7} then \boxed{\frac{1}{2}", "7"),  # an unclosed (truncated) box is skipped
        ("it is 3, no wait, 3/4", "3/4"),
        ("x = -5", "-5"),
        ("10-3 = 7", "7"),  # the minus of a subtraction is not a sign
        ("about 2.50 dollars", "2.50"),
        ("#### 1,250", "1250"),
        ("The answer is 42.", "42"),
        ("no numbers", None),
        ("", None),
    ],
)
def test_boxed_or_last_number(text, expected):
    assert boxed_or_last_number(text) == expected


@pytest.mark.parametrize(
    ("completion", "gold"),
    [
        (r"The answer is \boxed{42}.", "42"),
        (r"So $x = \boxed{\frac{1}{2}}$.", "0.5"),  # nested boxed vs a decimal gold
        (r"\boxed{0.5}", "1/2"),
        (r"\boxed{\dfrac{1}{2}}", r"\frac12"),
        (r"\boxed{2\sqrt{2}}", r"\sqrt{8}"),  # symbolic equality
        (r"\boxed{\{1,2\}}", r"\{2, 1\}"),  # sets
        ("She has 3 apples, then 4 more: 7", "7"),  # last number
        ("The result is 3/4", "0.75"),  # a fraction
        ("The temperature drops to -12 degrees", "-12"),  # negative
        ("It costs 1,000 dollars", "1000"),
        ("x = 2.50", "2.5"),
        ("#### 18", 18),  # a non-string gold from a dataset column
    ],
)
def test_math_answer_right(completion, gold):
    assert math_answer(completion, {"answer": gold}) == 1.0


@pytest.mark.parametrize(
    ("completion", "gold"),
    [
        (r"\boxed{43}", "42"),
        (r"\boxed{-\frac{1}{2}}", "0.5"),  # wrong sign
        ("The temperature is 12", "-12"),
        (r"\boxed{7} and later I say 9", "9"),  # the box wins over a later number
        ("I do not know", "42"),  # no answer
        ("", "42"),
        (r"}}{{\boxed{\frac{", "1"),  # garbage: unclosed boxes
        ("\x00\x01\\boxed{\\\\}}}", "1"),
        (r"\boxed{\frac{1}{0}^{^^}\left(}", "1"),  # a box that does not parse
        ("9" * 5000, "1"),
    ],
)
def test_math_answer_wrong_or_garbage_is_zero(completion, gold):
    assert math_answer(completion, {"answer": gold}) == 0.0


def test_math_answer_without_reference_says_so():
    with pytest.raises(ConfigError, match="row\\['answer'\\]"):
        math_answer(r"\boxed{1}", {"prompt": "1?"})


def test_math_answer_in_a_thread():
    # math-verify's default timeouts use signal.alarm, which raises outside the main thread.
    results, errors = [], []

    def run():
        try:
            results.append(math_answer(r"\boxed{\frac{1}{3}}", {"answer": "1/3"}))
            results.append(math_answer("so 8", {"answer": "7"}))
        except BaseException as err:
            errors.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(60)
    assert not errors, errors
    assert results == [1.0, 0.0]


def test_math_reward_through_the_spec():
    reward = build_reward(RewardSpec("math"))
    rows = [{"prompt_id": "p0", "prompt": "1/2 = ?", "answer": "0.5", "task": "math"}] * 2
    assert reward([r"\boxed{\frac12}", "0.25"], rows) == [1.0, 0.0]


# -- RewardModel -------------------------------------------------------------------------------

PROMPT = "Q: 2+2? A: "
COMPLETIONS = ["4", "5, I think", "", "four. " * 10]


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    """A tiny Qwen2 reward model (one output) and its char-level tokenizer, saved together."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    tokenizer = build_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = Qwen2ForSequenceClassification(config)
    path = tmp_path_factory.mktemp("rm")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def direct_scores(path, texts):
    """One unpadded forward pass per text, the reference for ``RewardModel``."""
    # The texts must tokenize char by char (AutoTokenizer alone would load Qwen2Tokenizer).
    assert [len(load_tokenizer(path)(t)["input_ids"]) for t in texts] == [len(t) for t in texts]
    from transformers import AutoModelForSequenceClassification

    tokenizer = load_tokenizer(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    scores = []
    with torch.inference_mode():
        for text in texts:
            ids = torch.tensor([tokenizer(text)["input_ids"]])
            scores.append(model(input_ids=ids).logits[0, 0].item())
    return scores


def test_reward_model_scores_match_a_direct_forward_pass(rm_dir):
    rm = RewardModel(str(rm_dir), batch_size=3)
    rows = [{"prompt_id": "p0", "prompt": PROMPT, "answer": "4"}] * len(COMPLETIONS)
    scores = rm(COMPLETIONS, rows)
    assert all(isinstance(s, float) and math.isfinite(s) for s in scores)
    assert len(set(scores)) == len(scores)  # a random head still tells the texts apart
    assert scores == rm(COMPLETIONS, rows)  # deterministic
    expected = direct_scores(rm_dir, [PROMPT + c for c in COMPLETIONS])
    assert scores == pytest.approx(expected, abs=1e-5)
    # Neither the order nor the batchmates change a score (right padding keeps positions).
    assert rm(COMPLETIONS[::-1], rows)[::-1] == pytest.approx(scores, abs=1e-5)
    assert RewardModel(str(rm_dir), batch_size=1)(COMPLETIONS, rows) == pytest.approx(
        scores, abs=1e-5
    )


def test_reward_model_renders_chat_prompts(rm_dir):
    rm = RewardModel(str(rm_dir))
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    # The char-level tokenizer has no chat template: contents joined by newlines.
    [score] = rm(["4"], [{"prompt": chat}])
    assert score == pytest.approx(direct_scores(rm_dir, ["Be brief.\n2+2?\n4"])[0], abs=1e-5)


def test_reward_model_renders_chat_prompts_with_the_template(rm_dir, tmp_path):
    import shutil

    shutil.copytree(rm_dir, tmp_path, dirs_exist_ok=True)
    tokenizer = load_tokenizer(rm_dir)
    tokenizer.chat_template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    tokenizer.save_pretrained(tmp_path)
    chat = [{"role": "user", "content": "2+2?"}]
    [score] = RewardModel(str(tmp_path))(["4"], [{"prompt": chat}])
    expected = direct_scores(tmp_path, ["[user] 2+2?\n[assistant] 4\n"])[0]
    assert score == pytest.approx(expected, abs=1e-5)


def test_reward_model_truncates_to_max_length(rm_dir):
    rm = RewardModel(str(rm_dir), max_length=8)
    long = "x" * 500  # past max_position_embeddings (128) without truncation
    [score] = rm([long], [{"prompt": PROMPT}])
    assert score == pytest.approx(direct_scores(rm_dir, [(PROMPT + long)[:8]])[0], abs=1e-5)
    assert RewardModel(str(rm_dir)).max_length == 128  # the model's context by default


def test_reward_model_is_lazy_and_pickles_without_weights(rm_dir):
    rm = RewardModel(str(rm_dir))
    assert rm._model is None  # constructing checks the directory only
    clone = pickle.loads(pickle.dumps(rm))
    rows = [{"prompt": PROMPT}] * 2
    scores = clone(["4", "5"], rows)
    assert scores == rm(["4", "5"], rows)
    # A loaded model pickles as its options again.
    assert pickle.loads(pickle.dumps(rm))._model is None


def _score_in_child(rm, completions, rows, results):
    try:
        results.put(rm(completions, rows))
    except BaseException as err:
        results.put(repr(err))


def test_reward_model_scores_in_a_spawned_process(rm_dir):
    rm = RewardModel(str(rm_dir))
    rows = [{"prompt": PROMPT}] * 2
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_score_in_child, args=(rm, ["4", "5"], rows, results), daemon=True)
    proc.start()
    try:
        got = results.get(timeout=SPAWN_TIMEOUT_S)
    except queue.Empty:
        pytest.fail(f"the child did not report within {SPAWN_TIMEOUT_S} s")
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    assert got == pytest.approx(rm(["4", "5"], rows), abs=1e-6)


def test_reward_model_through_the_spec(rm_dir):
    reward = build_reward(RewardSpec("reward_model", options={"path": str(rm_dir)}))
    assert reward is not None and getattr(reward, "batched", False)
    assert len(reward(["4"], [{"prompt": PROMPT}])) == 1


def test_reward_model_rejects_a_missing_directory(tmp_path):
    with pytest.raises(ConfigError, match=r"no config\.json"):
        RewardModel(str(tmp_path / "nowhere"))


def test_reward_model_rejects_a_causal_lm(tmp_path, rm_dir):
    config = json.loads((rm_dir / "config.json").read_text())
    config["architectures"] = ["Qwen2ForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "tokenizer.json").write_text((rm_dir / "tokenizer.json").read_text())
    with pytest.raises(ConfigError, match=r"not a sequence classifier.*ForSequenceClassification"):
        RewardModel(str(tmp_path))


def test_reward_model_rejects_a_directory_without_tokenizer(tmp_path, rm_dir):
    (tmp_path / "config.json").write_text((rm_dir / "config.json").read_text())
    with pytest.raises(ConfigError, match=r"tokenizer\.save_pretrained"):
        RewardModel(str(tmp_path))


def test_reward_model_rejects_a_label_it_does_not_have(rm_dir):
    with pytest.raises(ConfigError, match=r"label=1 but .* has 1 output"):
        RewardModel(str(rm_dir), label=1)
