"""A tool call's arguments checked against the tool's JSON schema (``tool_schema``) before it runs.

The model wrote the call, so what is wrong goes back to it as the tool's result and the episode
goes on: an argument the tool does not take, a required one missing, a value of the wrong JSON
type (``integer``, ``number``, ``string``, ``boolean``, ``array`` and its items' type,
``object``, ``null``; ``nullable`` and lists of types as ``get_json_schema`` writes them), or a
value outside an ``enum`` (``Literal[...]``). Types are checked strictly: ``"3"`` or ``3.0`` is
not an ``integer``, ``true`` is not a ``number``.

Examples:
    >>> schema = {"function": {"name": "add", "parameters": {"type": "object",
    ...     "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    ...     "required": ["a", "b"]}}}
    >>> argument_problem(schema, {"a": 2, "b": 3}) is None
    True
    >>> argument_problem(schema, {"a": "2"})
    "argument 'a' must be an integer, got '2' (str); argument 'b' is missing"
"""

from __future__ import annotations

from typing import Any

#: The Python values each JSON schema type takes (``bool`` is not a number here).
_TYPES: dict[str, tuple[type, ...]] = {
    "integer": (int,),
    "number": (int, float),
    "string": (str,),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


def argument_problem(schema: dict, arguments: dict[str, Any]) -> str | None:
    """What is wrong with ``arguments`` for the tool of ``schema`` (every problem, joined by
    ``"; "``), or ``None`` if they fit it."""
    parameters = schema["function"].get("parameters", {})
    properties: dict = parameters.get("properties", {})
    problems = []
    for name in arguments:
        if name not in properties:
            problems.append(f"no argument {name!r} (it takes {sorted(properties)})")
    for name, spec in properties.items():
        if name in arguments:
            problem = value_problem(spec, arguments[name])
            if problem is not None:
                problems.append(f"argument {name!r} must be {problem}")
        elif name in parameters.get("required", []):
            problems.append(f"argument {name!r} is missing")
    return "; ".join(problems) or None


def value_problem(spec: dict, value: Any) -> str | None:
    """What ``value`` should be for the schema ``spec`` (``"an integer, got ..."``), or
    ``None`` if it fits."""
    kinds = spec.get("type")
    if kinds is None:  # Any: no type declared
        return None
    kinds = [kinds] if isinstance(kinds, str) else list(kinds)
    if spec.get("nullable"):
        kinds.append("null")
    fits = [k for k in kinds if k in _TYPES and _is(value, k)]
    if not fits and any(k in _TYPES for k in kinds):
        wanted = " or ".join(_article(k) for k in kinds)
        return f"{wanted}, got {value!r} ({type(value).__name__})"
    if "enum" in spec and value is not None and value not in spec["enum"]:
        return f"one of {spec['enum']}, got {value!r}"
    items = spec.get("items")
    if fits == ["array"] and isinstance(items, dict):
        for i, item in enumerate(value):
            problem = value_problem(items, item)
            if problem is not None:
                return f"an array whose items are {problem} at [{i}]"
    return None


def _is(value: Any, kind: str) -> bool:
    if isinstance(value, bool) and kind != "boolean":
        return False
    return isinstance(value, _TYPES[kind])


def _article(kind: str) -> str:
    return f"an {kind}" if kind[0] in "aeiou" else f"a {kind}"
