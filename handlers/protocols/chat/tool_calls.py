"""The text format of tool calls for templates that do not render tools themselves.

Offered tools go into the system message (`TOOL_PROMPT`), and the model is asked to answer a
call as one block per call:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`tool_parsers` reads calls back from the output (this is the `hermes` family's format).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from handlers.engine.types import CallDelta
from handlers.protocols.chat.requests import ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"

TOOL_PROMPT = """You can call functions to help answer. The functions, one JSON object each:
<tools>
{tools}
</tools>
To call one, reply with a block per call, holding a JSON object with the function's name and its \
arguments:
<tool_call>
{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}
</tool_call>"""


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text
    id: str | None = None  # None: the answer gives it one (a family may want its own shape)


def collect_calls(deltas: list[CallDelta]) -> list[ParsedCall]:
    """The calls a stream of deltas made."""
    calls: dict[int, ParsedCall] = {}
    for delta in deltas:
        if delta.name is not None:
            calls[delta.index] = ParsedCall(delta.name, delta.arguments, delta.id)
        else:
            calls[delta.index].arguments += delta.arguments
    return list(calls.values())


def tool_prompt(tools: list[dict[str, Any]]) -> str:
    lines = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
    return TOOL_PROMPT.format(tools=lines)


def with_tool_prompt(messages: list[dict[str, Any]], tools: list[dict[str, Any]]
                     ) -> list[dict[str, Any]]:
    """The messages with the tool prompt appended to the system message (or as a new one)."""
    prompt = tool_prompt(tools)
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        content = f"{first['content']}\n\n{prompt}" if first["content"] else prompt
        return [{**first, "content": content}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def template_call(call: ToolCall) -> dict[str, Any]:
    """A past call as chat templates expect it: `arguments` as an object where it parses."""
    try:
        arguments: Any = json.loads(call.function.arguments)
    except ValueError:
        arguments = call.function.arguments
    return {"id": call.id, "type": "function",
            "function": {"name": call.function.name, "arguments": arguments}}


def append_calls_text(content: str, calls: list[dict[str, Any]]) -> str:
    blocks = [format_call(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    return "\n".join([content, *blocks] if content else blocks)


def format_call(name: str, arguments: Any) -> str:
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{OPEN}\n{body}\n{CLOSE}"


def parse_call(value: Any, names: set[str]) -> ParsedCall | None:
    """A decoded `{"name", "arguments"}` object naming an offered function, else None."""
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def parse_call_text(text: str, names: set[str]) -> ParsedCall | None:
    """A call from JSON text (see `parse_call`); None where it does not parse."""
    try:
        return parse_call(json.loads(text), names)
    except ValueError:
        return None


def arguments_call(name: str, arguments: str) -> ParsedCall | None:
    """A forced call to `name` from its generated arguments, unless they are not one whole JSON
    object (max_tokens cut them off): a client never gets arguments that do not parse."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return None
    return ParsedCall(name, arguments) if isinstance(value, dict) else None
