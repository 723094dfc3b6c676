"""The text format of tool calls for templates that do not render tools themselves.

Offered tools go into the system message (`TOOL_PROMPT`), and the model is asked to answer a
call as one block per call:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`ToolCallParser` reads calls back from the output: such blocks anywhere in it (the closing tag may
be missing at the very end), or an output that is as a whole one JSON object
`{"name": ..., "arguments": {...}}` (`parameters` is accepted for `arguments`) or a JSON list of
them. A call naming a function that was not offered stays text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from handlers.protocols.chat.requests import ToolCall
from handlers.protocols.chat.tags import partial_tag_length

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


def arguments_call(name: str, arguments: str) -> ParsedCall | None:
    """A forced call to `name` from its generated arguments, unless they are not one whole JSON
    object (max_tokens cut them off): a client never gets arguments that do not parse."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return None
    return ParsedCall(name, arguments) if isinstance(value, dict) else None


def parse_calls_json(text: str, names: set[str]) -> list[ParsedCall] | None:
    """Calls from a text that is one JSON call object or a list of them; None otherwise."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = [parse_call(item, names) for item in items]
    if not calls or None in calls:
        return None
    return calls  # type: ignore[return-value]


class ToolCallParser:
    """Splits streamed output text into content to show now and completed tool calls.

    Text that may still become a call is held: a partial `<tool_call>` tag, an open block, and
    an output that starts with `{` or `[` (held whole until the end, then parsed as JSON).
    """

    def __init__(self, names: set[str]) -> None:
        self.names = names
        self._held = ""
        self._mode = "start"  # start (only whitespace so far) | text | json

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        self._held += text
        if self._mode == "start":
            stripped = self._held.lstrip()
            if not stripped:
                return "", []
            self._mode = "json" if stripped[0] in "{[" else "text"
        if self._mode == "json":
            return "", []
        return self._scan_blocks()

    def finish(self) -> tuple[str, list[ParsedCall]]:
        held, self._held = self._held, ""
        if self._mode == "json":
            calls = parse_calls_json(held, self.names)
            return ("", calls) if calls else (held, [])
        if held.startswith(OPEN):  # a block the output ended inside of
            call = self._block_call(held[len(OPEN):])
            return ("", [call]) if call else (held, [])
        return held, []

    def _scan_blocks(self) -> tuple[str, list[ParsedCall]]:
        content, calls = "", []
        while True:
            start = self._held.find(OPEN)
            if start < 0:
                keep = partial_tag_length(self._held, OPEN)
                cut = len(self._held) - keep
                content, self._held = content + self._held[:cut], self._held[cut:]
                return content, calls
            end = self._held.find(CLOSE, start)
            content += self._held[:start]
            if end < 0:
                self._held = self._held[start:]
                return content, calls
            call = self._block_call(self._held[start + len(OPEN):end])
            if call is None:
                content += self._held[start:end + len(CLOSE)]
            else:
                calls.append(call)
            self._held = self._held[end + len(CLOSE):]

    def _block_call(self, body: str) -> ParsedCall | None:
        try:
            return parse_call(json.loads(body), self.names)
        except ValueError:
            return None
