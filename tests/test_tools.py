"""Tools from plain functions: schemas, the call format, and what a wrong call, a raising tool
or a hanging one tells the model."""

from __future__ import annotations

import time

import pytest
import torch

from streamrl.components.training.layout import layout_batch
from streamrl.components.training.off_policy import correct_stale
from streamrl.envs.tool_args import argument_problem
from streamrl.envs.tools import ToolEnvironment, format_call, parse_call, tool_schema
from streamrl.errors import ConfigError
from streamrl.records import Sample


def lookup(key: str, default: int = 0) -> str:
    """Look a key up.

    Args:
        key: what to find.
        default: returned when missing.
    """
    return {"zorp": "4821"}.get(key, str(default))


def broken(x: int) -> int:
    """Always fails.

    Args:
        x: ignored.
    """
    raise KeyError("no table")


def slow(x: int) -> int:
    """Never returns in time.

    Args:
        x: ignored.
    """
    time.sleep(30)
    return x


RAN: list[tuple] = []


def scale(x: int, factor: float, label: str, exact: bool, tags: list[int] | None = None) -> str:
    """Scale a number (records its calls in ``RAN``).

    Args:
        x: the number.
        factor: by how much.
        label: a name.
        exact: no rounding.
        tags: optional.
    """
    RAN.append((x, factor, label, exact, tags))
    return f"{label}={x * factor}"


def env() -> ToolEnvironment:
    reward = lambda answer, row: float(answer.strip() == row["answer"])  # noqa: E731
    return ToolEnvironment([lookup, broken, slow, scale], reward=reward, tool_timeout_s=0.3)


def test_schema_comes_from_the_signature_and_the_docstring():
    schema = tool_schema(lookup)["function"]
    assert schema["name"] == "lookup" and schema["description"] == "Look a key up."
    assert schema["parameters"]["properties"]["key"] == {
        "type": "string",
        "description": "what to find.",
    }
    assert schema["parameters"]["required"] == ["key"]

    def undocumented(x: int) -> int:
        return x

    with pytest.raises(ConfigError, match=r"undocumented.*Args"):
        tool_schema(undocumented)
    with pytest.raises(ConfigError, match="same name"):
        ToolEnvironment([lookup, lookup], reward=lambda c, row: 0.0)


def test_reset_lists_the_tools_and_a_call_runs_one():
    e = env()
    system, user = e.reset({"prompt": "code of zorp?", "answer": "4821"})
    assert "lookup(key: string, default: integer): Look a key up." in system["content"]
    assert user == {"role": "user", "content": "code of zorp?"}
    step = e.step("Let me look. " + format_call("lookup", {"key": "zorp"}))
    assert (step.observation, step.role, step.done) == ("4821", "tool", False)
    final = e.step("4821")
    assert final.done and final.reward == 1.0 and e.calls == 1


@pytest.mark.parametrize(
    "turn, told",
    [
        ("<tool_call>{not json</tool_call>", "Error: the tool call is not valid JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'Error: a tool call needs {"name"'),
        (
            '<tool_call>{"name": "lookup", "arguments": [1]}</tool_call>',
            "Error: the tool call's arguments must be a JSON object",
        ),
        (format_call("search", {"q": "x"}), "Error: no tool named 'search'"),
        (format_call("lookup", {"wrong": 1}), "Error: tool 'lookup': "),
        (format_call("broken", {"x": 1}), "Error: tool 'broken' raised KeyError"),
        (format_call("slow", {"x": 1}), "Error: tool 'slow' did not return within 0.3 s"),
    ],
)
def test_what_goes_wrong_in_a_call_is_told_to_the_model(turn, told):
    e = env()
    e.reset({"prompt": "p", "answer": "a"})
    started = time.monotonic()
    step = e.step(turn)
    assert step.observation.startswith(told) and not step.done and step.role == "tool"
    assert time.monotonic() - started < 5  # a hanging tool does not stall the episode


def test_several_calls_in_one_turn_all_run_in_order():
    e = env()
    e.reset({"prompt": "p", "answer": "a"})
    turn = (
        format_call("lookup", {"key": "zorp"})
        + "<tool_call>{not json</tool_call>"
        + format_call("lookup", {"key": "nope", "default": 7})
        + format_call("broken", {"x": 1})
    )
    step = e.step(turn)
    assert step.observation.splitlines() == [
        "<tool_response>4821</tool_response>",
        "<tool_response>Error: the tool call is not valid JSON (Expecting property name "
        "enclosed in double quotes).</tool_response>",
        "<tool_response>7</tool_response>",
        "<tool_response>Error: tool 'broken' raised KeyError: 'no table'.</tool_response>",
    ]
    assert (step.role, step.done) == ("tool", False)
    assert step.info == {"tools": ["lookup", "lookup", "broken"], "tool_errors": 2}
    assert (e.calls, e.tool_errors) == (3, 2)
    assert e.step(format_call("lookup", {"key": "zorp"})).observation == "4821"  # one: bare


@pytest.mark.parametrize(
    "arguments, told",
    [
        (
            {"x": "3", "factor": 2.0, "label": "a", "exact": True},
            "argument 'x' must be an integer, got '3' (str)",
        ),
        (
            {"x": 3.0, "factor": 2, "label": "a", "exact": True},
            "argument 'x' must be an integer, got 3.0 (float)",
        ),
        (
            {"x": 3, "factor": True, "label": "a", "exact": True},
            "argument 'factor' must be a number, got True (bool)",
        ),
        (
            {"x": 3, "factor": 2, "label": 5, "exact": True},
            "argument 'label' must be a string, got 5 (int)",
        ),
        (
            {"x": 3, "factor": 2, "label": "a", "exact": "yes"},
            "argument 'exact' must be a boolean, got 'yes' (str)",
        ),
        (
            {"x": 3, "factor": 2, "label": "a", "exact": 1, "tags": [1, "b"]},
            "argument 'exact' must be a boolean, got 1 (int); argument 'tags' must be an array "
            "whose items are an integer, got 'b' (str) at [1]",
        ),
        ({"x": 3, "label": "a"}, "argument 'factor' is missing; argument 'exact' is missing"),
        (
            {"x": 3, "factor": 2, "label": "a", "exact": True, "y": 1},
            "no argument 'y' (it takes ['exact', 'factor', 'label', 'tags', 'x'])",
        ),
    ],
)
def test_arguments_are_checked_against_the_schema_and_told_to_the_model(arguments, told):
    e = env()
    e.reset({"prompt": "p", "answer": "a"})
    RAN.clear()
    step = e.step(format_call("scale", arguments))
    assert step.observation == f"Error: tool 'scale': {told}." and not step.done
    assert RAN == [] and e.tool_errors == 1 and step.info["tool_errors"] == 1
    fine = {"x": 3, "factor": 2, "label": "a", "exact": False, "tags": None}
    assert e.step(format_call("scale", fine)).observation == "a=6" and e.tool_errors == 1
    assert RAN == [(3, 2, "a", False, None)]


def test_unions_and_enums_in_a_schema():
    schema = {
        "function": {
            "name": "f",
            "parameters": {
                "properties": {
                    "m": {"type": ["integer", "string"]},
                    "k": {"type": "string", "enum": ["x", "y"]},
                    "v": {},
                }
            },
        }
    }
    assert argument_problem(schema, {"m": "s", "k": "y", "v": object()}) is None
    assert argument_problem(schema, {"m": 1.5, "k": "z"}) == (
        "argument 'm' must be an integer or a string, got 1.5 (float); "
        "argument 'k' must be one of ['x', 'y'], got 'z'"
    )


def test_an_unclosed_call_at_the_turn_limit_still_parses():
    assert parse_call('<tool_call>{"name": "f", "arguments": {"a": 1}}') == ("f", {"a": 1})
    assert parse_call("just an answer") is None


def test_the_loss_mask_and_token_versions_reach_the_tensors():
    episode = Sample("p", 0, [5, 6], [7, 8, 9, 10], [-1.0, 0.0, 0.0, -2.0], 3, 0)
    episode.loss_mask, episode.token_versions = [1, 0, 0, 1], [3, 3, 3, 4]
    single = Sample("q", 0, [5], [7, 8], [-0.5, -0.5], 4, 0)
    b = layout_batch([episode, single], "packed", 0, torch.device("cpu"))
    assert b.mask.tolist() == [[1, 0, 0, 1], [1, 1, 0, 0]]
    assert b.versions.tolist() == [[3, 3, 3, 4], [4, 4, 0, 0]]
    # At version 4, only the episode's first turn is stale: corrected per token.
    current = torch.zeros(2, 4)
    fix = correct_stale(current, b.behaviour, b.mask, b.versions < 4, cap=2.0)
    assert fix.stale_samples == 1
    assert fix.weights.tolist() == [[2.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]]
    assert fix.old_logprobs.tolist()[0] == [0.0, 0.0, 0.0, -2.0]
