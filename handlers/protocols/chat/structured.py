"""Constrained-decoding specs for `response_format` and forced tool calls (pure functions).

- `response_format` `json_object` -> any JSON object; `json_schema` -> its `schema`.
- `tool_choice` naming a function -> the output is that function's arguments: a JSON object
  valid against its `parameters`.
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


def structured_output(request: ChatCompletionRequest) -> StructuredOutput | None:
    choice = request.tool_choice
    tools = request.tools or []
    if isinstance(choice, NamedToolChoice):
        i = next(i for i, t in enumerate(tools) if t.function.name == choice.function.name)
        return _schema(tools[i].function.parameters or ANY_OBJECT,
                       f"tools[{i}].function.parameters")
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
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t.function.name]},
                "arguments": t.function.parameters or ANY_OBJECT,
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return {"type": "array", "minItems": 1, "maxItems": 1 if one_call else MAX_PARALLEL_CALLS,
            "items": {"anyOf": calls}}


def _schema(schema: dict[str, Any], param: str) -> StructuredOutput:
    return StructuredOutput("json_schema", json.dumps(schema, ensure_ascii=False), param)
