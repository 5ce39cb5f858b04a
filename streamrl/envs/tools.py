"""Plain Python functions as tools the policy calls in its turns, and the environment running them.

A tool is any function with type hints and a docstring that describes its arguments (Google style,
an ``Args:`` section); its JSON schema is built from them (``tool_schema``, transformers'
``get_json_schema``), so the tools a prompt lists are the functions that run. The model calls
them in the Hermes format that Qwen-style chat templates use::

    <tool_call>{"name": "lookup", "arguments": {"key": "zorp"}}</tool_call>

and sees the result as a ``tool`` message. Several calls in one turn all run, in order, and the
one ``tool`` message holds each result in order, each as ``<tool_response>...</tool_response>``
on a line of its own (one call's result comes bare). A turn without a call is the answer: the
episode ends and the task's reward scores it. What goes wrong in a call is told to the model (as
that call's result, ``Error: ...``) and counted (``ToolEnvironment.tool_errors``), never raised:
text that is not a call's JSON, an unknown tool, arguments that do not fit the tool's schema
(``streamrl.envs.tool_args``), a tool that raises, a tool that does not return within
``tool_timeout_s`` (each tool call runs on its own daemon thread).

Examples:
    >>> def add(a: int, b: int) -> int:
    ...     '''Add two integers.
    ...
    ...     Args:
    ...         a: the first.
    ...         b: the second.
    ...     '''
    ...     return a + b
    >>> env = ToolEnvironment([add], reward=lambda answer, row: float(answer == row["answer"]))
    >>> _ = env.reset({"prompt": "2+3?", "answer": "5"})
    >>> env.step(format_call("add", {"a": 2, "b": 3})).observation
    '5'
    >>> env.step("5").reward
    1.0
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from streamrl.envs.tool_args import argument_problem
from streamrl.errors import ConfigError
from streamrl.records import Step
from streamrl.rewards.spec import RewardSpec, load_rewards

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)(?:" + re.escape(CALL_CLOSE) + r"|$)", re.S)

#: How a system message lists the tools (``{tools}``: one ``signature: description`` line per
#: tool, ``describe_tool``; pass ``{schemas}`` instead for their JSON schemas, one per line).
TOOLS_PROMPT = (
    "Tools:\n{tools}\n"
    'Call one as <tool_call>{{"name": ..., "arguments": {{...}}}}</tool_call>, or answer.'
)


def tool_schema(fn: Callable[..., Any]) -> dict:
    """The JSON schema of ``fn`` as chat templates take it (``{"type": "function", ...}``).

    Raises:
        ConfigError: ``fn`` lacks type hints or a docstring line for an argument.
    """
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as err:  # transformers raises its own parsing exceptions
        name = getattr(fn, "__name__", repr(fn))
        raise ConfigError(
            f"Tool {name!r} has no schema: {err}. Give every argument a type hint and a line in "
            "an 'Args:' section of the docstring (Google style)."
        ) from err


def describe_tool(schema: dict) -> str:
    """A schema as one short line: ``name(a: integer, b: integer): what it does``."""
    fn = schema["function"]
    args = ", ".join(
        f"{k}: {v.get('type', 'any')}" for k, v in fn["parameters"]["properties"].items()
    )
    return f"{fn['name']}({args}): {fn.get('description', '')}"


def format_call(name: str, arguments: Mapping[str, Any]) -> str:
    """A tool call as the model writes it (demonstrations use this)."""
    return f"{CALL_OPEN}{json.dumps({'name': name, 'arguments': dict(arguments)})}{CALL_CLOSE}"


class ToolError(ValueError):
    """A tool call the model got wrong; its message goes back to the model."""


def parse_call(text: str) -> tuple[str, dict] | None:
    """The ``(name, arguments)`` of the first tool call in ``text``, ``None`` if it has none.

    Raises:
        ToolError: the call is there but is not ``{"name": str, "arguments": {...}}`` JSON.
    """
    match = _CALL.search(text)
    return None if match is None else _parse_one(match.group(1))


def parse_calls(text: str) -> list[tuple[str, dict] | ToolError]:
    """Every tool call in ``text``, in order: its ``(name, arguments)``, or the ``ToolError``
    saying why it is malformed."""
    calls: list[tuple[str, dict] | ToolError] = []
    for match in _CALL.finditer(text):
        try:
            calls.append(_parse_one(match.group(1)))
        except ToolError as err:
            calls.append(err)
    return calls


def _parse_one(body: str) -> tuple[str, dict]:
    try:
        call = json.loads(body)
    except json.JSONDecodeError as err:
        raise ToolError(f"the tool call is not valid JSON ({err.msg}).") from None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise ToolError('a tool call needs {"name": "...", "arguments": {...}}.')
    arguments = call.get("arguments", {})
    if not isinstance(arguments, dict):
        raise ToolError("the tool call's arguments must be a JSON object.")
    return call["name"], arguments


def run_with_timeout(fn: Callable[[], Any], timeout_s: float) -> Any:
    """``fn()`` on a daemon thread; its result, or its exception re-raised here.

    Raises:
        TimeoutError: it did not return within ``timeout_s`` (the thread is left to finish on
            its own: Python cannot stop it, and as a daemon it never blocks the exit).
    """
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["value"] = fn()
        except BaseException as err:  # handed to the caller
            out["error"] = err

    thread = threading.Thread(target=target, daemon=True, name="streamrl-tool")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"did not return within {timeout_s:g} s")
    if "error" in out:
        raise out["error"]
    return out["value"]


class ToolEnvironment:
    """An episode in which the model may call ``tools`` before it answers (an ``Environment``).

    ``reset`` puts the tools' schemas in a system message before the row's prompt. Each turn
    with a tool call gets the tool's result (or what went wrong) as a ``tool`` message; the
    first turn without one is the answer, scored by ``reward(answer, row)``. A turn with several
    calls runs them all, in order (module docstring). Subclass it and override ``reset`` or
    ``answer`` for other tasks; its ``tools`` may also be bound methods.

    Args:
        tools: the functions the model may call (``tool_schema`` of each).
        reward: scores the answer against the row, any form ``streamrl.rewards.spec`` accepts
            (``fn(completion, row)``, ``fn(completion, answer)``...).
        tool_timeout_s: the longest a tool call may take; past it the model is told so.
        system_prompt: the system message: ``{tools}`` is replaced by a line per tool
            (``describe_tool``), ``{schemas}`` by their JSON schemas.

    Attributes:
        calls: the episode's well-formed tool calls so far.
        tool_errors: the episode's calls that went wrong so far (malformed, unknown tool,
            arguments that do not fit the schema, a tool that raised or hung); each step's
            ``info`` also holds its turn's ``tools`` and ``tool_errors``.
    """

    def __init__(
        self,
        tools: Sequence[Callable[..., Any]],
        reward: Callable[..., Any],
        *,
        tool_timeout_s: float = 5.0,
        system_prompt: str = TOOLS_PROMPT,
    ) -> None:
        self.tools = {fn.__name__: fn for fn in tools}
        if len(self.tools) != len(tools):
            raise ConfigError(f"Two tools have the same name: {[fn.__name__ for fn in tools]}.")
        self.schemas = [tool_schema(fn) for fn in tools]
        self._schema = {fn.__name__: schema for fn, schema in zip(tools, self.schemas)}
        self.reward = load_rewards([RewardSpec(reward)])
        self.tool_timeout_s, self.system_prompt = tool_timeout_s, system_prompt
        self.row: Mapping = {}
        self.calls = self.tool_errors = 0

    def reset(self, row: Mapping) -> list[dict]:
        """A system message listing the tools, then the row's prompt as the user's."""
        self.row, self.calls, self.tool_errors = row, 0, 0
        listing = self.system_prompt.format(
            tools="\n".join(describe_tool(s) for s in self.schemas),
            schemas="\n".join(json.dumps(s["function"]) for s in self.schemas),
        )
        system = {"role": "system", "content": listing}
        prompt = row["prompt"]
        return [system, *prompt] if isinstance(prompt, list) else [system, user(prompt)]

    def step(self, action: str) -> Step:
        """Run the turn's tool calls in order, or score the answer if it has none."""
        calls = parse_calls(action)
        if not calls:
            return Step(None, reward=self.answer(action), done=True)
        errors, results, names = self.tool_errors, [], []
        for call in calls:
            if isinstance(call, ToolError):
                self.tool_errors += 1
                results.append(f"Error: {call}")
                continue
            self.calls += 1
            names.append(call[0])
            results.append(self.call(*call))
        if len(results) > 1:
            results = [f"<tool_response>{result}</tool_response>" for result in results]
        info = {"tools": names, "tool_errors": self.tool_errors - errors}
        return Step("\n".join(results), role="tool", info=info)

    def call(self, name: str, arguments: dict) -> str:
        """One tool call's result as text, or the error the model should see (counted in
        ``tool_errors``)."""
        fn = self.tools.get(name)
        if fn is None:
            return self._error(f"no tool named {name!r}; the tools are {sorted(self.tools)}.")
        problem = argument_problem(self._schema[name], arguments)
        if problem is not None:
            return self._error(f"tool {name!r}: {problem}.")
        try:
            result = run_with_timeout(lambda: fn(**arguments), self.tool_timeout_s)
        except TimeoutError as err:
            return self._error(f"tool {name!r} {err}.")
        except TypeError as err:  # the tool's own TypeError (its arguments fit its schema)
            return self._error(f"tool {name!r}: {err}.")
        except Exception as err:
            return self._error(f"tool {name!r} raised {type(err).__name__}: {err}.")
        return result if isinstance(result, str) else json.dumps(result)

    def _error(self, message: str) -> str:
        self.tool_errors += 1
        return f"Error: {message}"

    def answer(self, text: str) -> float:
        """The reward of the final answer (``reward(text, row)``)."""
        totals, _ = self.reward.score([text], [dict(self.row)])
        return totals[0]

    def close(self) -> None:
        """Nothing to free; subclasses holding resources override it."""


def user(text: str) -> dict:
    """A user chat message."""
    return {"role": "user", "content": text}
