"""An environment's or a demonstration's bad output is a one-line error that names it: a first
prompt that is blank or does not fit the context, a malformed step in the warm start, and
demonstrations that are not lists of turn texts."""

from __future__ import annotations

import json

import pytest
import yaml

from streamrl.cli.main import main
from streamrl.envs.demos import demo_tokens, sft_on_episodes
from streamrl.envs.runner import EpisodeRunner
from streamrl.errors import ConfigError, EnvError
from streamrl.policy.models import build_bpe_tokenizer, build_tiny_model, save_policy
from streamrl.records import Step

ROW = {"prompt_id": "q", "prompt": "go"}


@pytest.fixture(scope="module")
def tok():
    return build_bpe_tokenizer(["Guess the word. go no maybe yes"], vocab_size=300)


class Scripted:
    """Resets to ``first``; each step returns ``step`` (a ``Step`` ending the episode unless
    told otherwise); counts ``close`` calls."""

    closed = 0

    def __init__(self, first: object = "Guess the word.", step: object = None) -> None:
        self.first, self.answer = first, step if step is not None else Step(None, 1.0, True)

    def reset(self, row):
        return self.first

    def step(self, action: str):
        return self.answer

    def close(self) -> None:
        Scripted.closed += 1


def runner(tok, first: object, context: int = 64) -> EpisodeRunner:
    # start() needs no service: it resets, renders and checks the first prompt.
    make = lambda: Scripted(first)  # noqa: E731
    return EpisodeRunner(None, make, tok, max_tokens=4, context=context)  # type: ignore[arg-type]


def test_a_first_prompt_past_the_context_is_one_line_naming_it(tok):
    Scripted.closed = 0
    with pytest.raises(EnvError) as err:
        runner(tok, "word " * 100, context=64).start(ROW)
    message = str(err.value)
    assert "\n" not in message and message.startswith("Prompt 'q': Scripted.reset's first prompt")
    assert "no room left in the context of 64; shorten the observation" in message
    assert "larger context" in message and Scripted.closed == 1
    assert runner(tok, "word " * 5, context=64).start(ROW).max_tokens == 4


@pytest.mark.parametrize(
    "first, match",
    [
        ("", "returned an empty first prompt ''"),
        ("  \n", r"returned an empty first prompt '  \\n'"),
        ([], "returned chat messages without text"),
        (
            [{"role": "system", "content": "rules"}, {"role": "user", "content": " "}],
            "returned chat messages without text besides the system's",
        ),
        ([{"content": "hi"}], "returned a list that is not chat messages"),
        (None, "returned NoneType None"),
        ({"prompt": "hi"}, "returned dict"),
    ],
)
def test_a_blank_or_malformed_first_prompt_is_an_env_error_in_rl_and_warm_start(tok, first, match):
    pattern = f"Scripted.reset {match}.* for prompt 'q'; return the first prompt, a non-blank"
    with pytest.raises(EnvError, match=pattern):
        runner(tok, first).start(ROW)
    with pytest.raises(EnvError, match=pattern):
        demo_tokens(ROW, Scripted(first), ["yes"], tok)


@pytest.mark.parametrize(
    "step, match",
    [
        (
            {"observation": "no", "done": False},
            r"returned dict \{'observation': 'no', 'done': False\}",
        ),
        ("no", "returned str 'no'"),
        (Step("no", reward=float("nan")), "returned the reward nan"),
        (Step(None, done=False), "returned done=False with the observation None"),
    ],
)
def test_the_warm_start_checks_steps_as_rl_does(tok, step, match):
    with pytest.raises(
        EnvError, match=f"Scripted.step {match} on prompt 'q'; return streamrl.Step"
    ):
        demo_tokens(ROW, Scripted(step=step), ["maybe", "yes"], tok)
    ids, labels = demo_tokens(ROW, Scripted(step=Step("no")), ["maybe", "yes"], tok)
    assert len(ids) == len(labels) and sum(label != -100 for label in labels) > 0


@pytest.mark.parametrize(
    "turns, match",
    [
        ("maybe", r"returned str 'maybe'"),
        (None, "returned NoneType None"),
        (["maybe", 3], r"returned a list with int items \['maybe', 3\]"),
        ([], "returned no turns"),
    ],
)
def test_demonstrations_must_be_lists_of_turn_texts(tok, turns, match):
    def demos(row):
        return turns

    pattern = (
        f"Demonstrations test_env_inputs:.*demos {match} for prompt 'q'; return the model's "
        "turns, a list of strings"
    )
    with pytest.raises(ConfigError, match=pattern):
        sft_on_episodes(
            [ROW],
            make_env=Scripted,
            demonstrate=demos,
            tokenizer=tok,
            model=None,  # type: ignore[arg-type]  # never reached
            steps=1,
            lr=1e-3,
            tokens_per_batch=256,
            seed=0,
        )


def test_the_cli_prints_an_overlong_first_prompt_as_one_line(tmp_path, tok, capsys):
    """Your environment and your model: the held-out evaluation's first episode stops the run
    with one line (it was an 86-line traceback)."""
    model = tmp_path / "policy"
    save_policy(build_tiny_model(tok, "test", max_positions=48), tok, model)
    rows = tmp_path / "rows.jsonl"
    prompt = "word " * 60
    rows.write_text("".join(json.dumps({"prompt": prompt, "answer": "a"}) + "\n" for _ in range(8)))
    config = tmp_path / "run.yaml"
    body = {
        "output_dir": str(tmp_path / "out"),
        "model": str(model),
        "env": {"name": "extension_plugins:GuessEnv", "max_turns": 2},
        "data": {"path": str(rows), "heldout_fraction": 0.25},
        "rl": {
            "iterations": 1,
            "prompts_per_iteration": 2,
            "group_size": 2,
            "rollouts": {"max_tokens": 4},
        },
    }
    config.write_text(yaml.safe_dump(body))
    capsys.readouterr()  # the policy's saving
    code = main(["fit", "--config", str(config), "--no-progress"])
    lines = capsys.readouterr().err.strip().splitlines()
    err = [line for line in lines if line and not line.startswith("[")]  # beside the headings
    assert code == 1 and len(err) == 1, lines
    assert "GuessEnv.reset's first prompt has" in err[0]
    assert "no room left in the context of 48; shorten the observation" in err[0]
