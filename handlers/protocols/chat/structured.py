"""Constrained-decoding specs for `response_format` and forced tool calls (pure functions).

- `response_format` `json_object` -> any JSON object; `json_schema` -> its `schema`.
- `tool_choice` naming a function -> the output is that function's arguments: a JSON object
  valid against its `parameters` (whose `type` is "object" when it names none).
- `tool_choice: "required"` -> the output is a JSON list of one or more calls
  `{"name": <an offered function>, "arguments": <valid against its parameters>}`: at most
  `MAX_PARALLEL_CALLS`, one when `parallel_tool_calls` is false. Without a cap, small models
  repeat the same call greedily until `max_tokens` cuts the JSON off.

The grammar guarantees valid output only if it can finish: when `max_tokens` (or the context)
cuts it off, `finish_reason` is `length` and the answer is the partial text as content, as OpenAI
answers then (`json_object` is the usual victim: nothing bounds an object's size). A cut-off
forced call is not reported as `tool_calls`; a streamed named call has already sent its partial
arguments, and `length` says they are incomplete.
"""

from __future__ import annotations

import json
from typing import Any

from handlers.engine.types import StructuredOutput
from handlers.protocols.chat.requests import (
    ChatCompletionRequest,
    NamedToolChoice,
    ResponseFormat,
    Tool,
)

ANY_OBJECT: dict[str, Any] = {"type": "object"}
MAX_PARALLEL_CALLS = 4
_LOCAL = ("#/$defs/", "#/definitions/")
_VALUES = ("enum", "const", "default", "examples")  # JSON values, not schemas


def structured_output(request: ChatCompletionRequest) -> StructuredOutput | None:
    choice = request.tool_choice
    tools = request.tools or []
    if isinstance(choice, NamedToolChoice):
        i = next(i for i, t in enumerate(tools) if t.function.name == choice.function.name)
        return _schema(_arguments(tools[i]), f"tools[{i}].function.parameters")
    if choice == "required":
        one_call = request.parallel_tool_calls is False
        return _schema(required_calls_schema(tools, one_call), "tools")
    return response_format_output(request.response_format)


def response_format_output(fmt: ResponseFormat | None) -> StructuredOutput | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutput("json_object", param="response_format")
    schema = fmt.json_schema.json_schema if fmt.json_schema else None
    return _schema(schema or ANY_OBJECT, "response_format.json_schema.schema")


def required_calls_schema(tools: list[Tool], one_call: bool = False) -> dict[str, Any]:
    definitions: dict[str, Any] = {}
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t.function.name]},
                "arguments": _hoisted(t.function.name, _arguments(t), definitions),
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema = {"type": "array", "minItems": 1, "maxItems": 1 if one_call else MAX_PARALLEL_CALLS,
              "items": {"anyOf": calls}}
    return {**schema, "$defs": definitions} if definitions else schema


def _hoisted(function: str, arguments: dict[str, Any], definitions: dict[str, Any]
             ) -> dict[str, Any]:
    """`arguments` moved under this schema's root: its definitions into `definitions` as
    `function:NAME` (its root as `function`), its `$ref`s (which name them from its own root)
    pointed there."""
    local = {**arguments.get("$defs", {}), **arguments.get("definitions", {})}
    if not local and not _refers(arguments):
        return arguments

    def rebased(value: Any) -> Any:
        if isinstance(value, list):
            return [rebased(v) for v in value]
        if not isinstance(value, dict):
            return value
        out = {k: v if k in _VALUES else rebased(v) for k, v in value.items()}
        ref = value.get("$ref")
        if ref == "#" or isinstance(ref, str) and ref.startswith(_LOCAL):
            out["$ref"] = f"#/$defs/{function}" + (f":{ref.rpartition('/')[2]}"
                                                   if ref != "#" else "")
        return out

    root = {k: v for k, v in rebased(arguments).items() if k not in ("$defs", "definitions")}
    definitions[function] = root
    definitions.update({f"{function}:{name}": rebased(d) for name, d in local.items()})
    return root


def _refers(value: Any) -> bool:
    if isinstance(value, dict):
        return "$ref" in value or any(_refers(v) for v in value.values())
    return isinstance(value, list) and any(_refers(v) for v in value)


def _arguments(tool: Tool) -> dict[str, Any]:
    """A function's parameters, an object even where they name no type (a root `$ref` is left
    to name its own)."""
    parameters = tool.function.parameters or ANY_OBJECT
    if "type" in parameters or "$ref" in parameters:
        return parameters
    return {**parameters, "type": "object"}


def _schema(schema: dict[str, Any], param: str) -> StructuredOutput:
    return StructuredOutput("json_schema", json.dumps(schema, ensure_ascii=False), param)
